"""rope_cos_sin (scaffolded by `cutile-kernels autokernelize llama-3.2-1b --scaffold rotary_emb`): the
reference against transformers' rotary embeddings, the kernel's tile logic emulated on the CPU
against float64, the op, the ``rope_cos_sin`` patch (CPU); the kernel against transformers' module
and a patched model against stock (GPU); the Solution through `evaluate` (GPU)."""

from __future__ import annotations

import functools
import importlib
import logging
from pathlib import Path

import pytest
import torch

import cutile_kernels
from cutile_kernels import dispatch
from cutile_kernels.kernel_src import rope_cos_sin as src
from launches import launched_variants
from cutile_kernels.layers import patch as patcher
from cutile_kernels.layers import rope_cos_sin as layer
from cutile_kernels_tools.inventory import evaluate
from cutile_kernels_tools import inventory

import cutile_numpy

ops = importlib.import_module("cutile_kernels.ops.rope_cos_sin")
transformers = pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

INVENTORY = Path(__file__).resolve().parents[1] / "inventory"
NAME = "rope_cos_sin"
LOGGER = "cutile_kernels"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
#: RoPE scaling types, as ``rope_parameters`` (rope_theta added); max_position_embeddings is 256.
ROPE_TYPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                 "long_factor": [2.0 + 0.2 * i for i in range(8)], "original_max_position_embeddings": 64},
}


def _config(model_type="llama", head_dim=16, rope=None, layers=2, **kw):
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, head_dim=head_dim, max_position_embeddings=256, **kw)
    if rope:
        rope = dict(rope, rope_theta=10000.0)
        if rope["rope_type"] == "longrope":  # one factor per frequency: head_dim / 2 of them
            half = head_dim // 2
            rope["short_factor"] = [1.0 + 0.1 * (i % 8) for i in range(half)]
            rope["long_factor"] = [2.0 + 0.2 * (i % 8) for i in range(half)]
        kw["rope_parameters"] = rope
    return AutoConfig.for_model(model_type, **kw)


def _rotary(model_type="llama", head_dim=16, rope=None, device="cpu", **kw):
    """A transformers rotary embedding module of ``model_type`` (its own class)."""
    mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    cls = next(v for k, v in vars(mod).items() if k.endswith("RotaryEmbedding") and isinstance(v, type))
    return cls(_config(model_type, head_dim, rope, **kw)).to(device)


def _positions(b, s, start=0, device="cpu"):
    """Per-row positions as a left-padded batch gives them: row i starts at ``start + 3 * i``."""
    return torch.arange(s, device=device)[None] + start + 3 * torch.arange(b, device=device)[:, None]


# ---------------------------------------------------------------------------------------------
# CPU: the Definition's reference (scaffolded test) and the op's reference are transformers'
# ---------------------------------------------------------------------------------------------

def test_reference_runs_on_the_model_shapes():
    inv = inventory.Inventory.load(INVENTORY)
    d = inv.definitions[NAME]
    run = inventory.load_reference(d)
    w = min(inv.workloads[NAME], key=lambda w: sum(w.axes.values()))
    out = run(*evaluate.reference_inputs(d, evaluate.make_inputs(d, w, "cpu")))
    assert evaluate.check_outputs(d, out, w.axes) == (None, "")


def test_definition_reference_is_the_op_reference():
    inv = inventory.Inventory.load(INVENTORY)
    d = inv.definitions[NAME]
    run = inventory.load_reference(d)
    for w in inv.workloads[NAME]:
        args = evaluate.reference_inputs(d, evaluate.make_inputs(d, w, "cpu"))
        want = ops.rope_cos_sin_reference(*args, torch.bfloat16)
        assert all(torch.equal(g, x) for g, x in zip(run(*args), want)), w.uuid


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rope", sorted(ROPE_TYPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_and_op_match_transformers(family, rope, dtype):
    emb = _rotary(family, rope=ROPE_TYPES[rope])
    x = torch.empty(1, dtype=dtype)
    positions = _positions(2, 7, start=300)  # past max_position_embeddings: dynamic and longrope update
    want = emb(x, positions)
    got_ref = ops.rope_cos_sin_reference(emb.inv_freq, positions, emb.attention_scaling, dtype)
    got_op = cutile_kernels.rope_cos_sin(emb.inv_freq, positions, emb.attention_scaling, dtype)
    for got in (got_ref, got_op):
        assert all(g.dtype == w.dtype and g.stride() == w.stride() and torch.equal(g, w) for g, w in zip(got, want))


# ---------------------------------------------------------------------------------------------
# CPU: the kernel's tile logic (tests/cutile_numpy.py) against float64
# ---------------------------------------------------------------------------------------------

def _exact(inv_freq, positions, scale):
    """cos/sin in float64 of the float32 angles transformers forms (the product is rounded to
    float32 there: part of the formula, and large at large positions), scaled by float32(scale)."""
    freqs = (positions[..., None].float() * inv_freq.float()).double()
    emb = torch.cat((freqs, freqs), dim=-1)
    s = float(torch.tensor(scale, dtype=torch.float32))
    return emb.cos() * s, emb.sin() * s


def _ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # One unit in the last place of dtype at |ref| (its smallest normal below that).
    fi = torch.finfo(dtype)
    mag = ref.abs().clamp_min(fi.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * fi.eps


def _emulate(inv_freq, positions, scale, out_dtype):
    """Run rope_cos_sin_kernel on NumPy as the op launches it; outputs poisoned with NaN first.
    bfloat16 is not emulated: its case runs the float32 kernel and rounds as the kernel's cast does."""
    half = inv_freq.shape[0]
    (_, block), = ops._want(half)
    rows = src.ROWS[block]
    store = torch.float32 if out_dtype == torch.bfloat16 else out_dtype
    pos = positions.reshape(-1)
    n = pos.shape[0]
    cos = torch.full((*positions.shape, 2 * half), float("nan"), dtype=store)
    sin = torch.full_like(cos, float("nan"))
    run = cutile_numpy.emulate(src.rope_cos_sin_kernel, src)
    run(((n + rows - 1) // rows,), (inv_freq.float(), pos, cos.view(n, 2, half), sin.view(n, 2, half),
                                    cutile_numpy.float32(scale), block, rows))
    assert not cos.isnan().any() and not sin.isnan().any(), "an output element was not written"
    return cos.to(out_dtype), sin.to(out_dtype)


def _inv_freq(rot, theta=10000.0):
    return 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))


#: (B, S, R, attention_scaling, first position): the Workloads' shapes (Llama-3.2-1B, R = 64), then
#: the edges: odd S and S not a multiple of ROWS, every tile width (R = 32 Phi-style partial, 80,
#: 96, 128, 256), attention_scaling != 1 (yarn), large positions (131071 = Llama-3.2's last).
EMULATED = [
    (1, 1, 64, 1.0, 0), (16, 1, 64, 1.0, 100), (1, 2048, 64, 1.0, 0), (3, 11, 64, 1.0, 5),
    (1, 1, 128, 1.0, 7), (2, 333, 128, 1.0, 0), (3, 65, 64, 1.2079441541679836, 0), (2, 9, 32, 1.0, 0),
    (2, 17, 80, 1.0, 0), (2, 17, 96, 0.5, 0), (2, 17, 256, 1.0, 0), (2, 5, 128, 1.0, 131066),
    (1, 3, 64, 1.0, 131068),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", EMULATED, ids=lambda c: "b{}-s{}-r{}-x{:g}-p{}".format(*c))
def test_emulated_kernel_matches_float64(case, dtype):
    b, s, rot, scale, start = case
    inv_freq = _inv_freq(rot)
    positions = _positions(b, s, start)
    cos, sin = _emulate(inv_freq, positions, scale, dtype)
    want = _exact(inv_freq, positions, scale)
    stock = ops.rope_cos_sin_reference(inv_freq, positions, scale, dtype)
    # 16-bit: one rounding of a float32 value within a few float32 ulps of the exact one, so at
    # most one ulp of the dtype from exact, as transformers' own result. float32: the float32 cos
    # (NumPy here, CUDA's on the GPU) and the scale product, a few ulps.
    tol = 1 if dtype != torch.float32 else 4
    for got, ref, st in zip((cos, sin), want, stock):
        assert got.shape == st.shape and got.dtype == st.dtype
        err = (got.double() - ref).abs()
        assert (err <= tol * _ulp(ref, dtype)).all(), err.max().item()
        assert ((st.double() - ref).abs() <= tol * _ulp(ref, dtype)).all()  # the bound holds for stock too


def test_emulated_kernel_per_row_positions_of_a_left_padded_batch():
    mask = torch.tensor([[1] * 12, [0] * 3 + [1] * 9, [0] * 7 + [1] * 5])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # what generate() builds for left padding
    cos, sin = _emulate(_inv_freq(128), positions, 1.0, torch.float32)
    for got, ref in zip((cos, sin), _exact(_inv_freq(128), positions, 1.0)):
        assert ((got.double() - ref).abs() <= 4 * _ulp(ref, torch.float32)).all()
    assert torch.equal(cos[1, :3], cos[1, 3:4].expand(3, -1))  # the pads repeat position 0


# ---------------------------------------------------------------------------------------------
# CPU: build matrix, tile choice, the op's contract
# ---------------------------------------------------------------------------------------------

def test_build_matrix_is_small():
    specs = src.VARIANTS
    assert len(specs) == 3 * 2 * len(src.BLOCKS) == 18
    assert len({s.tag for s in specs}) == len(specs)
    for s in specs:
        assert [p.name for p in s.params] == ["inv_freq", "position_ids", "cos", "sin", "attention_scaling",
                                              "BLOCK", "ROWS"]
        arrays = {p.name: p for p in s.params if p.kind == "array"}
        assert (arrays["inv_freq"].dtype, arrays["position_ids"].dtype) == ("float32", "int64")
        assert arrays["cos"].dtype == arrays["sin"].dtype and arrays["cos"].ndim == 3
        assert s.constants["ROWS"] * s.constants["BLOCK"] == 2048
    for block in src.BLOCKS:  # aligned before generic: the runtime's order of preference
        tags = [s.tag for s in specs if s.constants["BLOCK"] == block and s.tag.startswith("bf16")]
        assert tags == [f"bf16.h{block}.r{src.ROWS[block]}.aligned", f"bf16.h{block}.r{src.ROWS[block]}.generic"]


def test_tile_choice_per_rotary_dim():
    assert ops._want(16) == ops._want(32) == (("BLOCK", 32),)  # R = 32 (partial) and 64
    assert ops._want(40) == ops._want(48) == ops._want(64) == (("BLOCK", 64),)  # R = 80, 96, 128
    assert ops._want(128) == (("BLOCK", 128),)  # R = 256


def test_unsupported_inputs_say_why():
    inv, pos = _inv_freq(64), _positions(2, 3)
    assert ops.unsupported(inv, pos, 1.0, torch.bfloat16) is None
    assert "int64" in ops.unsupported(inv, pos.int(), 1.0, torch.bfloat16)
    assert "output dtype" in ops.unsupported(inv, pos, 1.0, torch.float64)
    assert "rotary dim 512" in ops.unsupported(_inv_freq(512), pos, 1.0, torch.bfloat16)
    assert "not a Python number" in ops.unsupported(inv, pos, torch.tensor(1.0), torch.bfloat16)
    with pytest.raises(ValueError, match="integer tensor"):
        cutile_kernels.rope_cos_sin(inv, pos.float(), 1.0, torch.bfloat16)
    with pytest.raises(ValueError, match="1-D float"):
        cutile_kernels.rope_cos_sin(inv[None], pos, 1.0, torch.bfloat16)


def test_cpu_path_is_the_counted_reference():
    cutile_kernels.reset_stats()
    cos, sin = cutile_kernels.rope_cos_sin(_inv_freq(64), _positions(2, 3), 1.0, torch.bfloat16)
    assert cos.shape == sin.shape == (2, 3, 64) and cos.is_contiguous()
    assert cutile_kernels.stats()["reference_calls"] == {"rope_cos_sin": 1}


def test_custom_op_passes_opcheck_and_compiles():
    args = (_inv_freq(64), _positions(2, 7), 1.25, torch.bfloat16)
    torch.library.opcheck(ops._rope_cos_sin.op, args, test_utils=("test_schema", "test_faketensor"))
    fn = torch.compile(lambda i, p: cutile_kernels.rope_cos_sin(i, p, 1.25, torch.bfloat16), backend="eager",
                       fullgraph=True)
    assert all(torch.equal(g, w) for g, w in zip(fn(*args[:2]), ops.rope_cos_sin_reference(*args)))


# ---------------------------------------------------------------------------------------------
# CPU: the rope_cos_sin patch
# ---------------------------------------------------------------------------------------------

def _model(model_type="llama", dtype=torch.float32, rope=None):
    torch.manual_seed(1234)
    return AutoModelForCausalLM.from_config(_config(model_type, rope=rope)).to(dtype).eval()


def _patched(m) -> bool:
    return patcher.swapped(m, layer.CutileRotaryEmbedding.forward)


def test_patch_is_registered_opt_in():
    p = patcher.PATCHES["rope_cos_sin"]
    assert p.apply is layer.patch_rotary_embeddings and p.undo is layer.unpatch_rotary_embeddings
    assert not p.changes_weights
    from cutile_kernels.layers import hub

    # autokernelize discarded it on the H200 (benchmarks/results/autokernelize.tsv): kernel_config
    # and kernelize leave it out; patch(model, names="rope_cos_sin") applies it.
    assert not p.default and "rope_cos_sin" not in hub._patch_names(())
    assert "decoder_add_rms_norm" in hub._patch_names(())


@pytest.mark.parametrize("model_type", FAMILIES)
def test_patched_logits_equal_stock_and_unpatch_restores(model_type, caplog):
    model = _model(model_type)
    ids = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        want = model(ids).logits
    with caplog.at_level(logging.INFO, logger=LOGGER):
        report = cutile_kernels.patch(model, names="rope_cos_sin")
    rotary = model.model.rotary_emb
    assert report.changed == {"rope_cos_sin": 1} and _patched(rotary)
    assert f"cos/sin of 1 {type(rotary).__name__} on one cuTile launch" in caplog.text
    assert cutile_kernels.patch(model, names="rope_cos_sin").changed == {"rope_cos_sin": 0}  # idempotent
    cutile_kernels.reset_stats()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    assert cutile_kernels.stats()["reference_calls"] == {"rope_cos_sin": 1}  # once per forward
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(ids).logits, want)
    assert cutile_kernels.unpatch(model, names="rope_cos_sin").changed == {"rope_cos_sin": 1}
    assert "forward" not in rotary.__dict__ and patcher.applied(model) == {}


@pytest.mark.parametrize("rope", ["dynamic", "longrope", "yarn", "llama3"])
def test_scaling_types_keep_dynamic_rope_update(rope):
    """dynamic and longrope update inv_freq (and attention_scaling) in transformers' own wrapper,
    which wraps our forward as it wraps the stock one; positions past the original length switch."""
    stock, ours = _rotary(rope=ROPE_TYPES[rope]), _rotary(rope=ROPE_TYPES[rope])
    holder = torch.nn.ModuleDict({"rotary_emb": ours})
    assert layer.patch_rotary_embeddings(holder) == 1
    x = torch.empty(1, dtype=torch.bfloat16)
    for positions in (_positions(2, 5), _positions(1, 400, start=10), _positions(2, 3)):  # grow, then reset
        want, got = stock(x, positions), ours(x, positions)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert torch.equal(ours.inv_freq, stock.inv_freq) and ours.attention_scaling == stock.attention_scaling


def test_other_rotary_forwards_are_left_alone(caplog):
    model = _model("gemma3_text")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert cutile_kernels.patch(model, names="rope_cos_sin").changed == {"rope_cos_sin": 0}
    assert "leaves 1 Gemma3RotaryEmbedding alone: its forward is not LlamaRotaryEmbedding.forward's code" in caplog.text


def test_instance_forwards_are_left_alone(caplog):
    model = _model("llama")
    rotary = model.model.rotary_emb
    rotary.forward = functools.partial(type(rotary).forward, rotary)  # as accelerate wraps it on the instance
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert cutile_kernels.patch(model, names="rope_cos_sin").changed == {"rope_cos_sin": 0}
    assert "already replaced on the instance" in caplog.text


def test_pinned_digest_is_this_transformers():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from cutile_kernels.layers._match import statements_digest
    from cutile_kernels.layers._pins import PINS

    assert statements_digest(layer._wrappers(LlamaRotaryEmbedding.forward)[-1]) == PINS[layer.PIN].digest
    assert layer.rotary_verdict(LlamaRotaryEmbedding) is None


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma"])
def test_llama_code_classes_are_recognised(model_type):
    assert layer.rotary_verdict(type(_rotary(model_type))) is None


@pytest.mark.slow
def test_survey_of_rotary_classes():
    """How many of transformers' rotary embedding classes the patch reaches (the docstring's 123)."""
    import os

    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    ours = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, f"modeling_{name}.py")
        if not os.path.isfile(path) or "RotaryEmbedding(nn.Module)" not in open(path).read():
            continue
        mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        ours += [k for k, v in vars(mod).items() if isinstance(v, type) and k.endswith("RotaryEmbedding")
                 and v.__module__ == mod.__name__ and "forward" in v.__dict__ and layer.rotary_verdict(v) is None]
    assert len(ours) == 123 and {"LlamaRotaryEmbedding", "MistralRotaryEmbedding", "Qwen2RotaryEmbedding",
                                 "Qwen3RotaryEmbedding"} <= set(ours)


def test_a_differently_decorated_forward_is_refused():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    bare = type("BareRotary", (LlamaRotaryEmbedding,), {"forward": layer._wrappers(LlamaRotaryEmbedding.forward)[-1]})
    assert "same decorators" in layer.rotary_verdict(bare)


def test_autokernelize_counts_the_patched_region_as_covered():
    from cutile_kernels_tools import autokernelize as ak

    model = _model("llama")
    assert ak._covered_by_layer(model.model.rotary_emb) is None
    cutile_kernels.patch(model, names="rope_cos_sin")
    assert ak._covered_by_layer(model.model.rotary_emb) == "kernelized (CutileRotaryEmbedding)"


# ---------------------------------------------------------------------------------------------
# GPU: the kernel against transformers' module, outputs poisoned first
# ---------------------------------------------------------------------------------------------

#: (B, S, R, rope type, first position): the presets' decode / prefill shapes (R = 64 Llama-3.2,
#: 128 Qwen2/3, Mistral), then the edges.
GPU_CASES = [
    (1, 1, 64, "llama3", 130), (16, 1, 64, "llama3", 2000), (1, 2048, 64, "llama3", 0), (1, 1, 128, "default", 7),
    (1, 2048, 128, "default", 0), (4, 333, 128, "default", 0), (3, 65, 64, "yarn", 0), (2, 9, 32, "default", 0),
    (2, 17, 80, "default", 0), (2, 17, 96, "longrope", 0), (2, 17, 256, "default", 0),
    (2, 5, 64, "llama3", 131066), (3, 1, 128, "dynamic", 300),
]



@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "b{}-s{}-r{}-{}-p{}".format(*c))
def test_kernel_matches_transformers_module(case, dtype, strict):
    """Within one ulp of the dtype of transformers' own output (float32: 4 ulps), and of float64.

    Not asserted bitwise: both sides form the same float32 angles and round once to the dtype,
    but cos/sin are CUDA's cosf/sinf in torch and tileiras' lowering of cuTile's cos/sin in ours,
    each within a few float32 ulps of exact and not guaranteed to be the same code; a 16-bit result
    differs only where those float32 values straddle a rounding boundary. The share of bitwise
    equal elements is printed."""
    b, s, rot, rope, start = case
    emb = _rotary("llama", head_dim=rot, rope=ROPE_TYPES[rope], device="cuda")
    positions = _positions(b, s, start, device="cuda")
    x = torch.empty(1, dtype=dtype, device="cuda")
    want = emb(x, positions)  # runs dynamic_rope_update: inv_freq / attention_scaling are current
    cos, sin = ops._outputs(emb.inv_freq, positions, dtype)
    cos.fill_(float("nan"))
    sin.fill_(float("nan"))
    before = dispatch.stats()["launches"]
    assert ops.rope_cos_sin_into(emb.inv_freq.float(), positions, emb.attention_scaling, cos, sin)
    (variant,) = launched_variants(before)
    torch.cuda.synchronize()
    assert not cos.isnan().any() and not sin.isnan().any(), "an output element was not written"
    tol = 1 if dtype != torch.float32 else 4
    exact = _exact(emb.inv_freq.cpu(), positions.cpu(), emb.attention_scaling)
    for got, w, ref in zip((cos, sin), want, exact):
        assert got.shape == w.shape and got.dtype == w.dtype and got.stride() == w.stride()
        ulp = _ulp(w.double().cpu(), dtype)
        assert ((got.double().cpu() - w.double().cpu()).abs() <= tol * ulp).all()
        assert ((got.double().cpu() - ref).abs() <= tol * _ulp(ref, dtype)).all()
        print(f"{case} {dtype}: bitwise equal to transformers {torch.eq(got, w).float().mean().item():.4%}")
    aligned = (rot // 2) % 16 == 0
    assert variant.tag.endswith("aligned" if aligned else "generic"), variant.tag
    assert variant.constants["BLOCK"] == max(32, 1 << (rot // 2 - 1).bit_length())


@pytest.mark.gpu
def test_unsupported_inputs_fall_back_and_say_so(caplog):
    emb = _rotary("llama", head_dim=512, device="cuda")
    positions = _positions(1, 3, device="cuda")
    with caplog.at_level("WARNING", logger=LOGGER):
        got = cutile_kernels.rope_cos_sin(emb.inv_freq, positions, 1.0, torch.bfloat16)
    want = emb(torch.empty(1, dtype=torch.bfloat16, device="cuda"), positions)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert "rope_cos_sin falls back to PyTorch: rotary dim 512" in caplog.text


@pytest.mark.gpu
def test_cuda_graph_replay_and_compile(strict):
    inv = _inv_freq(128).cuda()
    positions = _positions(4, 1, 50, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cutile_kernels.rope_cos_sin(inv, positions, 1.0, torch.bfloat16)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gc, gs = cutile_kernels.rope_cos_sin(inv, positions, 1.0, torch.bfloat16)
    positions.add_(1000)
    g.replay()
    torch.cuda.synchronize()
    ec, es = cutile_kernels.rope_cos_sin(inv, positions, 1.0, torch.bfloat16)
    assert torch.equal(gc, ec) and torch.equal(gs, es)
    compiled = torch.compile(lambda i, p: cutile_kernels.rope_cos_sin(i, p, 1.0, torch.bfloat16), fullgraph=True)
    got = compiled(inv, positions)
    assert torch.equal(got[0], ec) and torch.equal(got[1], es)


def _logit_errors(logits, ref):
    d = (logits.double() - ref.double())
    return (d.norm() / ref.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_patched_model_logits_against_stock(model_type, strict):
    """bf16 logits of the patched model are no further from the float32 stock model than stock bf16
    is (x 1.1): cos/sin may differ from stock's by one bf16 ulp (see above), so not bitwise."""
    ref_model = _model(model_type).cuda()
    model = _model(model_type, torch.bfloat16).cuda()
    ids = torch.randint(0, 256, (2, 37), device="cuda")
    with torch.no_grad():
        ref = ref_model(ids).logits
        stock = model(ids).logits
    assert cutile_kernels.patch(model, names="rope_cos_sin").changed == {"rope_cos_sin": 1}
    before = sum(dispatch.stats()["launches"].values())
    with torch.no_grad():
        ours = model(ids).logits
    assert sum(dispatch.stats()["launches"].values()) == before + 1  # one launch per forward
    assert _logit_errors(ours, ref) <= 1.1 * _logit_errors(stock, ref) + 1e-6
    # Compiled, the rest of the model is inductor's code (its norms round differently), so the
    # compiled logits are held to the same gate, not to bit equality with eager.
    compiled = torch.compile(model, fullgraph=True)
    before = sum(dispatch.stats()["launches"].values())
    with torch.no_grad():
        got = compiled(ids).logits
    assert sum(dispatch.stats()["launches"].values()) > before  # our op inside the compiled graph
    assert _logit_errors(got, ref) <= 1.25 * _logit_errors(stock, ref) + 1e-6


@pytest.mark.gpu
def test_solution_passes_evaluate():
    inv = inventory.Inventory.load(INVENTORY)
    solutions = inv.solutions_of(NAME)
    assert solutions, f"no Solution for {NAME} yet: write the kernel, then `autokernelize --score`"
    result = evaluate.evaluate(solutions[0].name, INVENTORY)
    assert result.status == "PASSED", result.message
