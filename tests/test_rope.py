"""RoPE: reference semantics and the hub-function layer (CPU), the kernel against float64 (GPU)."""

from __future__ import annotations

import importlib
import inspect
import os
import types

import pytest
import torch

import cutile_kernels
from cutile_kernels import dispatch
from cutile_kernels.kernel_src import rope as rope_src
from cutile_kernels.layers import rope as rope_layer
from cutile_kernels.layers.rope import CutileRotaryPosEmb, computes_llama_rope, computes_olmo2_rope, wrapped_function
from launches import launched_variants
rope_ops = importlib.import_module("cutile_kernels.ops.rope")

transformers = pytest.importorskip("transformers")
kernels = pytest.importorskip("kernels")

from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _model_qk(b, hq, hkv, s, d, dtype=torch.float32, device="cpu"):
    """q, k as transformers' attention passes them: (B, S, H, D) projections seen as (B, H, S, D)."""
    q = torch.randn(b, s, hq, d, dtype=dtype, device=device).transpose(1, 2)
    k = torch.randn(b, s, hkv, d, dtype=dtype, device=device).transpose(1, 2)
    return q, k


def _cos_sin(b, s, rot, dtype=torch.float32, device="cpu", rope_parameters=None, positions=None):
    """cos/sin from transformers' own Llama rotary embedding (any scaling type), for B rows of
    positions (default: row i starts at 3 * i, as rows of a left-padded batch do)."""
    kw = dict(hidden_size=64 * 4, num_attention_heads=4, num_key_value_heads=2, head_dim=rot,
              max_position_embeddings=256)
    if rope_parameters:
        kw["rope_parameters"] = dict(rope_parameters, rope_theta=10000.0)
    emb = LlamaRotaryEmbedding(LlamaConfig(**kw)).to(device)
    if positions is None:
        positions = torch.arange(s, device=device)[None] + 3 * torch.arange(b, device=device)[:, None]
    x = torch.empty(1, dtype=dtype, device=device)
    return emb(x, positions)


def _stock_functions():
    """The stock ``apply_rotary_pos_emb`` of the four target families (``kernels`` Func modules)."""
    names = ["llama", "mistral", "qwen2", "qwen3"]
    return {n: importlib.import_module(f"transformers.models.{n}.modeling_{n}").apply_rotary_pos_emb for n in names}


# ---------------------------------------------------------------------------------------------
# CPU: the reference and the public function are transformers' formula, bit for bit
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(_stock_functions()))
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("shape", [(2, 4, 2, 7, 64), (1, 3, 1, 1, 128), (3, 2, 2, 5, 80)], ids=str)
def test_reference_and_rope_match_transformers(family, dtype, shape):
    stock = _stock_functions()[family]
    b, hq, hkv, s, d = shape
    q, k = _model_qk(b, hq, hkv, s, d, dtype)
    cos, sin = _cos_sin(b, s, d, dtype)
    want = stock(q, k, cos, sin)
    for got in (cutile_kernels.apply_rope_reference(q, k, cos, sin), cutile_kernels.apply_rope(q, k, cos, sin)):
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w)
    # The public function also keeps the stock result's layout (q's memory order).
    for g, w in zip(cutile_kernels.apply_rope(q, k, cos, sin), want):
        assert g.stride() == w.stride()


@pytest.mark.parametrize("layout", ["bshd-view", "contiguous", "decode", "sliced"])
def test_output_layout_is_the_stock_one(layout):
    b, hq, hkv, s, d = 2, 4, 2, 5, 64
    if layout == "contiguous":
        q, k = torch.randn(b, hq, s, d), torch.randn(b, hkv, s, d)
    elif layout == "decode":
        q, k = _model_qk(b, hq, hkv, 1, d)
        s = 1
    elif layout == "sliced":  # Phi: the rotary part of each head, a strided slice
        q, k = (t[..., :d] for t in _model_qk(b, hq, hkv, s, d + 16))
    else:
        q, k = _model_qk(b, hq, hkv, s, d)
    cos, sin = _cos_sin(b, s, d)
    want = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    got = cutile_kernels.apply_rope(q, k, cos, sin)
    assert [t.stride() for t in got] == [t.stride() for t in want]
    # The fake implementation promises the same layout as the real one.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk = rope_ops._rope.op(*(mode.from_tensor(t) for t in (q, k, cos, sin)))
    assert (fq.stride(), fk.stride()) == (got[0].stride(), got[1].stride())


def test_unsqueeze_dim_2_layout():
    q, k = torch.randn(2, 6, 4, 64), torch.randn(2, 6, 2, 64)  # (B, S, H, D)
    cos, sin = _cos_sin(2, 6, 64)
    want = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    got = cutile_kernels.apply_rope(q, k, cos, sin, unsqueeze_dim=2)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("rope_parameters", [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
], ids=lambda p: (p or {}).get("rope_type", "default"))
def test_scaling_types_come_in_through_cos_sin(rope_parameters):
    # Positions past max_position_embeddings make dynamic scaling kick in.
    positions = torch.tensor([[0, 1, 2, 3, 4], [300, 301, 302, 303, 304]])
    cos, sin = _cos_sin(2, 5, 64, torch.bfloat16, rope_parameters=rope_parameters, positions=positions)
    q, k = _model_qk(2, 4, 2, 5, 64, torch.bfloat16)
    want = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    got = cutile_kernels.apply_rope(q, k, cos, sin)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_partial_rotary_rotates_the_first_r_and_passes_the_rest():
    q, k = _model_qk(2, 4, 2, 5, 80, torch.float64)
    cos, sin = _cos_sin(2, 5, 32, torch.float64)
    got_q, got_k = cutile_kernels.apply_rope(q, k, cos, sin)
    for got, x in ((got_q, q), (got_k, k)):
        want_rot, _ = modeling_llama.apply_rotary_pos_emb(x[..., :32], x[..., :32], cos, sin)
        assert torch.equal(got[..., :32], want_rot) and torch.equal(got[..., 32:], x[..., 32:])


def test_phi_partial_rotary_through_its_own_slices():
    from transformers import PhiConfig
    from transformers.models.phi import modeling_phi
    from transformers.models.phi.modeling_phi import PhiRotaryEmbedding

    cfg = PhiConfig(hidden_size=320, num_attention_heads=4, num_key_value_heads=4, partial_rotary_factor=0.4)
    cos, sin = PhiRotaryEmbedding(cfg)(torch.empty(1, dtype=torch.bfloat16), torch.arange(6)[None])
    assert cos.shape == (1, 6, 32)
    q, k = (t[..., :32] for t in _model_qk(1, 4, 4, 6, 80, torch.bfloat16))  # what PhiAttention passes
    want = modeling_phi.apply_rotary_pos_emb(q, k, cos, sin)
    got = cutile_kernels.apply_rope(q, k, cos, sin)
    assert all(torch.equal(g, w) and g.stride() == w.stride() for g, w in zip(got, want))


def test_shapes_outside_the_kernel_contract_take_the_reference():
    q, k = _model_qk(2, 4, 2, 5, 64)
    cos, sin = _cos_sin(2, 5, 64)
    # A 3-D q (no batch) broadcasts in transformers' formula: same result here.
    want = modeling_llama.apply_rotary_pos_emb(q[0], k[0], cos[0], sin[0], unsqueeze_dim=0)
    got = cutile_kernels.apply_rope(q[0], k[0], cos[0], sin[0], unsqueeze_dim=0)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    # What does not broadcast raises as transformers raises.
    with pytest.raises(RuntimeError):
        cutile_kernels.apply_rope(q, k, cos[:, :4], sin[:, :4])
    # The custom op itself states its contract.
    with pytest.raises(ValueError, match="even last dim"):
        rope_ops._rope.op(q, k, cos[..., :31], sin[..., :31])
    with pytest.raises(ValueError, match="batch 1 or B"):
        rope_ops._rope.op(q, k, torch.cat([cos, cos, cos]), torch.cat([sin, sin, sin]))


@pytest.mark.parametrize("case", ["view", "partial", "cos-batch-1"])
def test_custom_op_passes_opcheck(case):
    q, k = _model_qk(2, 4, 2, 7, 64)
    cos, sin = _cos_sin(2, 7, 64)
    if case == "partial":
        q, k, cos, sin = q[..., :48], k[..., :48], cos[..., :32], sin[..., :32]
    if case == "cos-batch-1":
        cos, sin = cos[:1], sin[:1]
    q.requires_grad_(True)
    utils = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(rope_ops._rope.op, (q, k, cos, sin), test_utils=utils)


def test_gradients_follow_the_reference_formula():
    q, k = (t.requires_grad_(True) for t in _model_qk(2, 4, 2, 5, 64, torch.float64))
    cos, sin = (t.requires_grad_(True) for t in _cos_sin(2, 5, 64, torch.float64))
    qe, ke = cutile_kernels.apply_rope(q, k, cos, sin)
    assert qe.grad_fn is not None and "rope" in qe.grad_fn.name()
    (qe.square().sum() + 3 * ke.sum()).backward()
    got = [t.grad.clone() for t in (q, k, cos, sin)]
    for t in (q, k, cos, sin):
        t.grad = None
    qr, kr = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    (qr.square().sum() + 3 * kr.sum()).backward()
    for a, t in zip(got, (q, k, cos, sin)):
        assert torch.allclose(a, t.grad, rtol=1e-12, atol=1e-12)


def test_compile_on_cpu_matches_eager():
    q, k = _model_qk(2, 4, 2, 5, 64)
    cos, sin = _cos_sin(2, 5, 64)
    fn = torch.compile(lambda *a: cutile_kernels.apply_rope(*a), backend="eager", fullgraph=True)
    got, want = fn(q, k, cos, sin), modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def _want(rot, positions=2048, dtype=torch.bfloat16):
    return rope_ops._want(rot // 2, positions, dtype)


def test_tile_choice_per_head_dim():
    assert _want(64) == (("BLOCK", 32),)
    assert _want(32) == (("BLOCK", 32),)  # Phi's rotary part of 32: the smallest tile
    assert _want(80) == _want(96) == _want(128) == (("BLOCK", 64),)
    assert _want(256) == (("BLOCK", 128),)
    assert _want(512, positions=1) == (("BLOCK", 256),)  # no such variant: the PyTorch path


def test_decode_steps_ask_for_one_position_per_block():
    # Fewer positions than the prefill tile's rows (16, 8, 4 for BLOCK 32, 64, 128) in 16 bits.
    assert _want(64, 1) == _want(64, 15) == (("BLOCK", 32), ("ROWS", 1))
    assert _want(64, 16) == (("BLOCK", 32),)
    assert _want(128, 3, torch.float16) == (("BLOCK", 64), ("ROWS", 1))
    assert _want(128, 8) == (("BLOCK", 64),)
    assert _want(128, 1, torch.float32) == (("BLOCK", 64),)  # no float32 decode tiles


def test_build_matrix_is_small():
    specs = [s for s in rope_src.VARIANTS if s.kernel == "rope"]
    # rope_append's (test_rope_append.py) and the partial-rotary kernels' (below)
    assert [s for s in rope_src.VARIANTS if s.kernel != "rope"] == rope_src.APPEND_VARIANTS + rope_src.PASS_VARIANTS
    # Llama's: prefill tiles for three dtypes, decode tiles (ROWS=1) for the two 16-bit ones, two
    # layouts each; OLMo 2's float32 cos/sin: the same for the two 16-bit dtypes.
    assert len(specs) == (3 + 2) * 2 * len(rope_src.BLOCKS) + (2 + 2) * 2 * len(rope_src.BLOCKS) == 54
    assert len({s.tag for s in specs}) == len(specs)
    for s in specs:
        arrays = [p for p in s.params if p.kind == "array"]
        assert [p.name for p in arrays] == ["q", "k", "cos", "sin", "q_out", "k_out"]
        assert [p.ndim for p in arrays] == [5, 5, 4, 4, 5, 5]
        dtypes = [p.dtype for p in arrays]
        cast = s.tag.split(".")[0].endswith("c32")
        assert dtypes == [dtypes[0]] * 2 + ["float32" if cast else dtypes[0]] * 2 + [dtypes[0]] * 2, s.tag
        assert not cast or dtypes[0] in ("bfloat16", "float16")
        assert s.constants["HEADS"] * s.constants["ROWS"] * s.constants["BLOCK"] * 2 == 4096 or s.constants["ROWS"] == 1
    # Aligned before generic for the same tile: the runtime's order of preference.
    for block in rope_src.BLOCKS:
        tags = [s.tag for s in specs if s.constants["BLOCK"] == block and s.tag.startswith("bf16.")]
        prefill, decode = (f"bf16.h{block}.t{rope_src.HEADS}x{rows}" for rows in (rope_src.ROWS[block], 1))
        assert tags == [f"{prefill}.aligned", f"{decode}.aligned", f"{prefill}.generic", f"{decode}.generic"]


def test_partial_rotary_variants():
    """rope_pass (prefill and decode tiles) and rope_append_pass (decode tiles): the 16-bit dtypes,
    both layouts, the half-widths up to 64 and 32 pass-through lanes; inputs before outputs."""
    by_kernel = {k: [s for s in rope_src.PASS_VARIANTS if s.kernel == k] for k in ("rope_pass", "rope_append_pass")}
    assert len(by_kernel["rope_pass"]) == 2 * 2 * len(rope_src.PASS_BLOCKS) * 2 == 16
    assert len(by_kernel["rope_append_pass"]) == 2 * 2 * len(rope_src.PASS_BLOCKS) == 8
    assert len({(s.kernel, s.tag) for s in rope_src.PASS_VARIANTS}) == 24
    for s in rope_src.PASS_VARIANTS:
        assert s.constants["PBLOCK"] == rope_src.PBLOCK == 32 and s.constants["BLOCK"] in (32, 64)
        assert {p.dtype for p in s.params if p.kind == "array" and p.name != "length"} == {s.params[0].dtype}
    names = [p.name for p in by_kernel["rope_pass"][0].params if p.kind == "array"]
    assert names == ["q", "k", "cos", "sin", "q_pass", "k_pass", "q_out", "k_out", "q_pass_out", "k_pass_out"]
    assert {s.constants["ROWS"] for s in by_kernel["rope_append_pass"]} == {1}


def _emulate_pass(q, k, cos, sin, rows):
    """rope_pass_kernel in the NumPy interpreter over NaN-poisoned outputs, as rope_into lays it out."""
    from cutile_numpy import emulate

    (b, hq, s, _), rot = q.shape, cos.shape[-1]
    q_out, k_out = (torch.full_like(t, float("nan")) for t in (q, k))
    args = rope_ops._pass_layout((q, k, cos, sin, q[..., rot:], k[..., rot:], q_out, k_out, q_out[..., rot:],
                                  k_out[..., rot:]))
    block = max(32, 1 << (rot // 2 - 1).bit_length())
    grid = (-(-s // rows), -(-hq // rope_src.HEADS) + -(-k.shape[1] // rope_src.HEADS), b)
    emulate(rope_src.rope_pass_kernel, rope_src)(grid, (*args, block, rows, rope_src.HEADS, rope_src.PBLOCK))
    return q_out, k_out


@pytest.mark.parametrize("b,hq,hkv,s,d,rot,rows", [
    (1, 24, 8, 37, 128, 96, 8),   # Phi-4-mini's heads, a prefill of 37 positions (tiles of 8)
    (3, 24, 8, 1, 128, 96, 1),    # its decode step, three rows
    (2, 4, 1, 19, 80, 64, 16),    # 16 pass-through lanes of 32 (padded), one KV head
    (1, 5, 5, 3, 64, 32, 1),      # a 32-wide rotary part (BLOCK 32), heads no tile of 4 divides
], ids=["phi4-prefill", "phi4-decode", "hd80-r64", "hd64-r32"])
def test_emulated_pass_kernel_is_the_reference(b, hq, hkv, s, d, rot, rows):
    """The partial-rotary kernel's logic on the CPU (float32, where the kernel rounds as torch does):
    the first R elements rotated, the rest copied, every element written, transformers' bits."""
    q, k = _model_qk(b, hq, hkv, s, d)
    cos, sin = _cos_sin(b, s, rot)
    got = _emulate_pass(q, k, cos, sin, rows)
    want = rope_ops.apply_rope_reference(q, k, cos, sin)
    for g, w, x in zip(got, want, (q, k)):
        assert torch.equal(g, w)
        assert torch.equal(g[..., rot:], x[..., rot:])


def test_partial_rotary_takes_the_one_launch_where_it_fits():
    """Which partial-rotary calls the one-launch kernels take (the others copy with two copy_)."""
    q, k = _model_qk(1, 4, 2, 3, 128, torch.bfloat16)
    cos, sin = _cos_sin(1, 3, 96, torch.bfloat16)
    assert rope_ops._pass_fits(q, k, cos, sin)  # Phi-4-mini: 96 of 128
    assert not rope_ops._pass_fits(q, k, cos[..., :64], sin[..., :64])  # 64 lanes to pass: more than 32
    assert not rope_ops._pass_fits(q.float(), k.float(), cos.float(), sin.float())  # no float32 variants
    assert not rope_ops._pass_fits(q, k, cos.float(), sin.float())  # mixed dtypes
    q, k = _model_qk(1, 4, 2, 3, 288, torch.bfloat16)
    cos, sin = _cos_sin(1, 3, 256, torch.bfloat16)
    assert not rope_ops._pass_fits(q, k, cos, sin)  # a half of 128: wider than the pass tiles


# ---------------------------------------------------------------------------------------------
# CPU: the layer for the "rotary_pos_emb" hub function
# ---------------------------------------------------------------------------------------------

def _func_module(model_type: str):
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}").apply_rotary_pos_emb


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "phi", "gemma"])
def test_llama_formula_functions_are_recognised(model_type):
    fn = _func_module(model_type)
    assert fn.kernel_layer_name == "rotary_pos_emb"
    assert computes_llama_rope(type(fn))
    assert wrapped_function(type(fn)).__module__ == f"transformers.models.{model_type}.modeling_{model_type}"


@pytest.mark.parametrize("model_type", ["olmo2", "olmo", "olmo3", "flex_olmo"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_olmo2_formula_runs_the_cast_op(model_type, dtype, caplog):
    """OLMo 2's apply_rotary_pos_emb (and its copies) with the float32 cos/sin OLMo 2's rotary
    embedding returns: the layer runs apply_rope_cast, on the CPU stock's bits, strided q/k kept."""
    fn = _func_module(model_type)
    assert computes_olmo2_rope(type(fn)) and not computes_llama_rope(type(fn))
    q, k = _model_qk(2, 4, 2, 5, 64, dtype)
    cos, sin = _cos_sin(2, 5, 64, torch.float32)
    want = fn(q, k, cos, sin)
    layer = types.MethodType(CutileRotaryPosEmb.forward, fn)
    before = dispatch.stats()["reference_calls"].get("rope_cast", 0)
    with caplog.at_level("WARNING", logger="cutile_kernels"):
        got = layer(q, k, cos, sin)
    assert dispatch.stats()["reference_calls"].get("rope_cast", 0) == before + 1 and caplog.text == ""
    assert all(torch.equal(g, w) and g.dtype == dtype and g.stride() == w.stride() for g, w in zip(got, want))
    # The reference promotes, then casts back: not Llama's formula in q's dtype.
    llama = rope_ops.apply_rope_reference(q, k, cos.to(dtype), sin.to(dtype))
    assert dtype == torch.float32 or not torch.equal(llama[0], want[0])


def test_olmo2_pin_turns_the_cast_path_off(change_pin):
    change_pin(rope_layer.OLMO2_PIN)
    assert not computes_olmo2_rope.judge(type(_func_module("olmo2")))
    assert computes_llama_rope.judge(type(_func_module("llama")))


@pytest.mark.parametrize("model_type", ["nanochat", "gpt_oss", "modernbert", "hunyuan_vl"])
def test_other_formulas_keep_their_own_forward(model_type, caplog):
    fn = _func_module(model_type)
    assert not computes_llama_rope(type(fn)) and not computes_olmo2_rope(type(fn))
    q, k = _model_qk(1, 4, 2, 5, 64, torch.bfloat16)
    half = model_type == "gpt_oss"  # GPT-OSS takes cos/sin of D/2
    cos, sin = _cos_sin(1, 5, 32 if half else 64, torch.bfloat16)
    want = fn(q, k, cos, sin)
    layer = types.MethodType(CutileRotaryPosEmb.forward, fn)
    with caplog.at_level("WARNING", logger="cutile_kernels"):
        got = layer(q, k, cos, sin)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert "is neither Llama's nor OLMo 2's apply_rotary_pos_emb formula" in caplog.text


def test_nanochat_differs_only_in_rotate_half():
    # Same function code as Llama's: only the rotate_half it resolves tells them apart.
    from cutile_kernels.layers._match import same_code

    fn, llama = wrapped_function(type(_func_module("nanochat"))), wrapped_function(type(_func_module("llama")))
    assert same_code(fn, llama)
    assert not same_code(fn.__globals__["rotate_half"], modeling_llama.rotate_half)


def test_pinned_digests_are_this_transformers():
    from cutile_kernels.layers._match import statements_digest

    llama = wrapped_function(type(modeling_llama.apply_rotary_pos_emb))
    from cutile_kernels.layers._pins import PINS

    assert (statements_digest(llama), statements_digest(modeling_llama.rotate_half)) == tuple(
        PINS[p].digest for p in rope_layer.PINS)


@pytest.mark.slow
def test_survey_of_every_decorated_function():
    """Which of transformers' ``rotary_pos_emb`` functions the layer runs (the module docstring's
    list): every one decorated in this transformers, imported and classified."""
    root = os.path.dirname(transformers.__file__)
    ours, cast, theirs = [], [], []
    for name in sorted(os.listdir(os.path.join(root, "models"))):
        path = os.path.join(root, "models", name, f"modeling_{name}.py")
        if not os.path.isfile(path) or 'use_kernel_forward_from_hub("rotary_pos_emb")' not in open(path).read():
            continue
        mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        funcs = [v for v in vars(mod).values() if isinstance(v, torch.nn.Module)
                 and getattr(type(v), "kernel_layer_name", None) == "rotary_pos_emb"
                 and wrapped_function(type(v)).__module__ == mod.__name__]
        assert len(funcs) == 1, name
        verdict = type(funcs[0])
        (ours if computes_llama_rope(verdict) else cast if computes_olmo2_rope(verdict) else theirs).append(name)
        sig = inspect.signature(wrapped_function(type(funcs[0])))
        assert list(sig.parameters) == ["q", "k", "cos", "sin", "unsqueeze_dim"], name  # the layer's signature
    assert len(ours) == 104 and {"llama", "mistral", "qwen2", "qwen3", "phi"} <= set(ours)
    assert sorted(cast) == ["beam", "flex_olmo", "olmo", "olmo2", "olmo3", "olmo_hybrid"]
    assert sorted(theirs) == ["esm", "evolla", "gpt_oss", "hunyuan_vl", "modernbert", "modernbert_decoder", "nanochat",
                              "openai_privacy_filter"]


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_layer_passes_kernels_validator(model_type):
    from kernels.layer.layer import _validate_layer

    _validate_layer(check_cls=type(_func_module(model_type)), cls=CutileRotaryPosEmb, repo="cutile-kernels (test)")
    assert CutileRotaryPosEmb.can_torch_compile is True


def test_mapping_row():
    assert cutile_kernels.layers.MAPPING["rotary_pos_emb"] == "CutileRotaryPosEmb"
    assert cutile_kernels.layers.CutileRotaryPosEmb is CutileRotaryPosEmb


class _SourceRepo:
    """A ``kernels`` repository serving this source package's layer (no build needed)."""

    def load(self):
        return CutileRotaryPosEmb

    def __hash__(self):
        return hash("cutile-kernels-source-rope")

    def __eq__(self, other):
        return isinstance(other, _SourceRepo)


@pytest.fixture
def restore_funcs():
    """kernels rebinds the module-level Func instances (process-wide): put them back afterwards."""
    funcs = [_func_module(t) for t in ("llama", "qwen3")]
    yield
    for f in funcs:
        f.__dict__.pop("forward", None)


def _tiny(model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _kernelize_for_cuda(model, repo, monkeypatch):
    import kernels.layer.repos as repos
    from kernels import Mode

    monkeypatch.setattr(repos, "_find_capability", lambda: 90)
    mapping = {"rotary_pos_emb": {"cuda": {Mode.INFERENCE: repo}}}
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(model, mode=Mode.INFERENCE, device="cuda", use_fallback=True)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_kernels_kernelize_reaches_the_function(model_type, monkeypatch, restore_funcs):
    """The hub path reaches the decorated function through the attention's ``_kernel_funcs``."""
    model = _tiny(model_type)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        want = model(ids).logits
    func = _func_module(model_type)
    attn = model.model.layers[0].self_attn
    assert attn._kernel_funcs == {"rotary_pos_emb": func}
    _kernelize_for_cuda(model, _SourceRepo(), monkeypatch)
    assert func.forward.__func__ is CutileRotaryPosEmb.forward
    cutile_kernels.reset_stats()
    with torch.no_grad():
        got = model(ids).logits
    assert torch.equal(got, want)
    assert cutile_kernels.stats()["reference_calls"].get("rope") == 2  # one per layer, CPU reference path
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # the layer traces without a break
    with torch.no_grad():
        assert torch.equal(compiled(ids).logits, want)


def test_kernels_kernelize_from_the_build(monkeypatch, restore_funcs, built_package_dir):
    from kernels import LocalLayerRepository, get_local_kernel

    variant = built_package_dir.parent
    mod = get_local_kernel(variant)
    # The test command builds first: a build without the layer is a stale build, and a failure.
    assert hasattr(mod.layers, "CutileRotaryPosEmb"), f"{variant} predates the RoPE layer: run `cutile-kernels build`"
    model = _tiny("llama")
    ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        want = model(ids).logits
    _kernelize_for_cuda(model, LocalLayerRepository(variant, layer_name="CutileRotaryPosEmb"), monkeypatch)
    assert _func_module("llama").forward.__func__.__module__ == f"{mod.__name__}.layers.rope"
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)


def test_kernel_config_maps_and_keeps_rotary_pos_emb(tmp_path, monkeypatch):
    from cutile_kernels.layers.hub import CutileKernelConfig

    model = _tiny("qwen3")
    cfg = CutileKernelConfig({"rotary_pos_emb": "/abs/build/torch-cuda:CutileRotaryPosEmb",
                              "RMSNorm": "/abs/build/torch-cuda:CutileRMSNorm"}, use_local_kernel=True)
    cfg.sanitize_kernel_mapping(model)
    assert set(cfg.kernel_mapping) == {"rotary_pos_emb", "RMSNorm"}  # the function is a registered name


def test_a_build_that_predates_the_layer_maps_what_it_has(tmp_path, monkeypatch, caplog):
    """kernel_config/kernelize map only the layers the build ships (an older build lacks RoPE; mapping
    it anyway makes kernels raise ``Layer ... not found``, even for a CPU model)."""
    from cutile_kernels.layers import hub

    old_build = types.SimpleNamespace(layers=types.SimpleNamespace(CutileRMSNorm=object))
    monkeypatch.setattr(kernels, "get_local_kernel", lambda variant: old_build)
    with caplog.at_level("WARNING", logger="cutile_kernels"):
        assert hub._mapping_in_build(tmp_path) == {"RMSNorm": "CutileRMSNorm"}
    assert "has no " in caplog.text and "CutileRotaryPosEmb" in caplog.text and "cutile-kernels build" in caplog.text


# ---------------------------------------------------------------------------------------------
# GPU: the kernel against float64, outputs poisoned first
# ---------------------------------------------------------------------------------------------

#: (B, Hq, Hkv, S, D, R, dtype, layout): the four families' shapes (prefill and decode), then the
#: edges. layout: "model" = transformers' transposed view; "contiguous" (B, H, S, D); "misaligned"
#: = base one element off 16 bytes (generic variant); "phi" = the rotary slice of wider heads;
#: "cos1" = cos/sin of batch 1 for B rows.
GPU_CASES = [
    (1, 32, 8, 2048, 64, 64, torch.bfloat16, "model"),     # Llama-3.2-1B prefill
    (16, 32, 8, 1, 64, 64, torch.bfloat16, "model"),       # Llama-3.2-1B decode b=16
    (1, 16, 8, 2048, 128, 128, torch.bfloat16, "model"),   # Qwen3-0.6B prefill
    (1, 16, 8, 1, 128, 128, torch.bfloat16, "model"),      # Qwen3-0.6B decode b=1
    (1, 12, 2, 333, 128, 128, torch.bfloat16, "model"),    # Qwen2.5-1.5B, odd S
    (4, 12, 2, 1, 128, 128, torch.bfloat16, "model"),      # Qwen2.5-1.5B decode
    (2, 32, 8, 77, 128, 128, torch.bfloat16, "model"),     # Mistral-7B, odd S, B>1 per-row positions
    (3, 8, 1, 19, 64, 64, torch.bfloat16, "model"),        # one KV head
    (2, 8, 2, 17, 80, 80, torch.bfloat16, "model"),        # D=80 (half 40, padded to 64)
    (2, 8, 2, 17, 96, 96, torch.bfloat16, "model"),        # D=96
    (2, 8, 2, 17, 256, 256, torch.bfloat16, "model"),      # D=256
    (2, 32, 32, 9, 80, 32, torch.bfloat16, "phi"),         # Phi-2 partial rotary (32 of 80)
    (2, 8, 4, 9, 128, 64, torch.bfloat16, "model"),        # narrower cos: first 64 of 128 rotated
    (2, 16, 8, 100, 128, 128, torch.float16, "model"),
    (2, 16, 8, 100, 64, 64, torch.float32, "model"),
    (2, 16, 8, 31, 128, 128, torch.bfloat16, "contiguous"),
    (2, 16, 8, 31, 128, 128, torch.bfloat16, "misaligned"),
    (4, 16, 8, 13, 128, 128, torch.bfloat16, "cos1"),
    (3, 16, 8, 1, 128, 128, torch.bfloat16, "misaligned"),  # decode tiles: generic layout
    (2, 32, 32, 1, 80, 32, torch.float16, "phi"),           # decode, partial rotary
    (5, 8, 1, 3, 64, 64, torch.bfloat16, "cos1"),           # a few positions (speculative decode)
    # Partial rotary with the pass-through in the launch (rope_pass): Phi-4-mini's 96 of 128.
    (1, 24, 8, 2048, 128, 96, torch.bfloat16, "model"),     # Phi-4-mini prefill
    (16, 24, 8, 1, 128, 96, torch.bfloat16, "model"),       # its decode, b=16
    (2, 8, 2, 37, 80, 64, torch.float16, "model"),          # 16 lanes passed (of a 32-lane tile)
    (2, 24, 8, 31, 128, 96, torch.bfloat16, "misaligned"),  # generic layout
]


def _case_id(c):
    b, hq, hkv, s, d, r, dtype, layout = c
    return f"b{b}-h{hq}x{hkv}-s{s}-d{d}-r{r}-{str(dtype).split('.')[-1]}-{layout}"


def _gpu_inputs(case):
    b, hq, hkv, s, d, r, dtype, layout = case
    if layout == "contiguous":
        q = torch.randn(b, hq, s, d, device="cuda", dtype=dtype)
        k = torch.randn(b, hkv, s, d, device="cuda", dtype=dtype)
    elif layout == "misaligned":
        flat = torch.randn(b * hq * s * d + b * hkv * s * d + 1, device="cuda", dtype=dtype)
        q = flat[1:1 + b * hq * s * d].view(b, hq, s, d)
        k = flat[1 + b * hq * s * d:].view(b, hkv, s, d).clone()  # not overlapping q's span
    elif layout == "phi":
        q, k = (t[..., :r] for t in _model_qk(b, hq, hkv, s, d, dtype, "cuda"))
        d = r
    else:
        q, k = _model_qk(b, hq, hkv, s, d, dtype, "cuda")
    cos, sin = _cos_sin(1 if layout == "cos1" else b, s, r, dtype, "cuda")
    return q, k, cos, sin


def _exact(q, k, cos, sin):
    """RoPE in float64 without intermediate rounding: the higher-precision reference."""
    return rope_ops.apply_rope_reference(q.double(), k.double(), cos.double(), sin.double())


def _errors(out, ref):
    diff = (out.double() - ref).abs()
    return diff.max().item(), ((out.double() - ref).norm() / ref.norm()).item()



@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_rope_kernel_matches_float64(case, strict):
    q, k, cos, sin = _gpu_inputs(case)
    q_out, k_out = rope_ops._outputs(q, k, cos, sin)
    q_out.fill_(float("nan"))
    k_out.fill_(float("nan"))
    before = dispatch.stats()["launches"]
    assert rope_ops.rope_into(q, k, cos, sin, q_out, k_out)
    (variant,) = launched_variants(before)
    torch.cuda.synchronize()
    assert not torch.isnan(q_out).any() and not torch.isnan(k_out).any(), "an output element was not written"
    ref_q, ref_k = _exact(q, k, cos, sin)
    st_q, st_k = rope_ops.apply_rope_reference(q, k, cos, sin)  # what transformers computes in this dtype
    for ours, ref, st in ((q_out, ref_q, st_q), (k_out, ref_k, st_k)):
        o_max, o_rel = _errors(ours, ref)
        s_max, s_rel = _errors(st, ref)
        assert o_rel <= 1.1 * s_rel + 1e-12 and o_max <= 1.1 * s_max + 1e-12, (o_max, o_rel, s_max, s_rel)
        # The kernel rounds each product and the sum as eager torch does: the same bits (and the
        # CPU tests show the reference is transformers' function, bit for bit).
        assert torch.equal(ours, st)
    b, hq, hkv, s, d, r, dtype, layout = case
    passed = layout != "phi" and r < d and d - r <= rope_src.PBLOCK and dtype != torch.float32
    assert variant.kernel == ("rope_pass" if passed else "rope"), variant.kernel
    aligned = layout != "misaligned" and (r // 2) % 16 == 0 and (not passed or (d - r) % 16 == 0)
    assert variant.tag.endswith("aligned" if aligned else "generic"), variant.tag
    block = max(32, 1 << (r // 2 - 1).bit_length())
    assert variant.constants["BLOCK"] == block
    decode = s < rope_src.ROWS[block] and dtype != torch.float32
    assert variant.constants["ROWS"] == (1 if decode else rope_src.ROWS[block]), variant.tag


@pytest.mark.gpu
@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
], ids=lambda p: p["rope_type"])
def test_scaling_types_on_the_kernel(rope_parameters, strict):
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [300, 301, 302, 303, 304, 305]], device="cuda")
    cos, sin = _cos_sin(2, 6, 64, torch.bfloat16, "cuda", rope_parameters, positions)
    q, k = _model_qk(2, 8, 2, 6, 64, torch.bfloat16, "cuda")
    got = cutile_kernels.apply_rope(q, k, cos, sin)
    want = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    assert all(torch.equal(g, w) and g.stride() == w.stride() for g, w in zip(got, want))


@pytest.mark.gpu
def test_left_padded_batch_per_row_positions(strict):
    # Rows of a left-padded batch: row i's first real token sits at position 0 after i pads.
    mask = torch.tensor([[1] * 12, [0] * 3 + [1] * 9, [0] * 7 + [1] * 5], device="cuda")
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cos, sin = _cos_sin(3, 12, 128, torch.bfloat16, "cuda", None, positions)
    q, k = _model_qk(3, 16, 8, 12, 128, torch.bfloat16, "cuda")
    got = cutile_kernels.apply_rope(q, k, cos, sin)
    want = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


#: (B, Hq, Hkv, S, D, dtype) of OLMo 2's RoPE: float32 cos/sin, 16-bit q and k.
CAST_CASES = [
    (1, 16, 16, 2048, 128, torch.bfloat16),   # OLMo-2-0425-1B prefill
    (1, 16, 16, 1, 128, torch.bfloat16),      # its decode b=1
    (16, 16, 16, 1, 128, torch.bfloat16),     # decode b=16
    (3, 8, 1, 37, 64, torch.bfloat16),        # one KV head, odd S
    (2, 8, 2, 17, 80, torch.float16),         # D=80 (half 40, padded to 64), fp16
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CAST_CASES, ids=lambda c: "-".join(map(str, c)).replace("torch.", ""))
def test_rope_cast_kernel_is_olmo2s_formula(case, strict):
    """The float32-cos variants against float64 and, bit for bit, against OLMo 2's own function
    (float32 math, each result cast back), outputs poisoned first."""
    from transformers.models.olmo2 import modeling_olmo2

    b, hq, hkv, s, d, dtype = case
    q, k = _model_qk(b, hq, hkv, s, d, dtype, "cuda")
    cos, sin = _cos_sin(b, s, d, torch.float32, "cuda")
    q_out, k_out = (torch.full_like(t, float("nan")) for t in (q, k))
    before = dispatch.stats()["launches"]
    assert rope_ops.rope_into(q, k, cos, sin, q_out, k_out)
    (variant,) = launched_variants(before)
    assert variant.tag.split(".")[0].endswith("c32"), variant.tag  # a float32-cos variant
    torch.cuda.synchronize()
    assert not torch.isnan(q_out).any() and not torch.isnan(k_out).any(), "an output element was not written"
    want = modeling_olmo2.apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(q_out, want[0]) and torch.equal(k_out, want[1])
    ref_q, ref_k = _exact(q, k, cos, sin)
    for ours, ref in ((q_out, ref_q), (k_out, ref_k)):
        # one rounding to the 16-bit dtype after float32 math: within one unit of it
        assert _errors(ours, ref)[1] < (4e-3 if dtype == torch.bfloat16 else 5e-4)
    got = cutile_kernels.apply_rope_cast(q, k, cos, sin)
    assert all(torch.equal(g, w) and g.stride() == w.stride() for g, w in zip(got, want))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gq, gk = cutile_kernels.apply_rope_cast(q, k, cos, sin)
    cos.copy_(torch.rand_like(cos))
    g.replay()
    torch.cuda.synchronize()
    want = modeling_olmo2.apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(gq, want[0]) and torch.equal(gk, want[1])


@pytest.mark.gpu
def test_unsupported_inputs_fall_back_and_say_so(caplog):
    q, k = _model_qk(1, 4, 2, 3, 512, torch.bfloat16, "cuda")  # half of 256 > the widest tile
    cos, sin = _cos_sin(1, 3, 512, torch.bfloat16, "cuda")
    with caplog.at_level("WARNING", logger="cutile_kernels"):
        got = cutile_kernels.apply_rope(q, k, cos, sin)
    want = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert "falls back to PyTorch" in caplog.text
    mixed = cutile_kernels.apply_rope(q[..., :64], k[..., :64], cos[..., :64].float(), sin[..., :64].float())
    assert mixed[0].dtype == torch.float32  # promoted as transformers' formula promotes


@pytest.mark.gpu
def test_cuda_graph_replay_and_compile(strict):
    q, k = _model_qk(2, 16, 8, 1, 128, torch.bfloat16, "cuda")
    cos, sin = _cos_sin(2, 1, 128, torch.bfloat16, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cutile_kernels.apply_rope(q, k, cos, sin)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gq, gk = cutile_kernels.apply_rope(q, k, cos, sin)
    q.copy_(torch.randn_like(q))
    cos.copy_(torch.rand_like(cos))
    g.replay()
    torch.cuda.synchronize()
    eq, ek = cutile_kernels.apply_rope(q, k, cos, sin)
    assert torch.equal(gq, eq) and torch.equal(gk, ek)
    compiled = torch.compile(lambda *a: cutile_kernels.apply_rope(*a), fullgraph=True)
    got = compiled(q, k, cos, sin)
    assert torch.equal(got[0], eq) and torch.equal(got[1], ek)


@pytest.mark.gpu
def test_gradients_on_the_kernel_path(strict):
    q, k = (t.requires_grad_(True) for t in _model_qk(2, 8, 2, 9, 64, torch.float32, "cuda"))
    cos, sin = _cos_sin(2, 9, 64, torch.float32, "cuda")
    before = sum(dispatch.stats()["launches"].values())
    qe, ke = cutile_kernels.apply_rope(q, k, cos, sin)
    assert sum(dispatch.stats()["launches"].values()) == before + 1
    (qe.square().sum() + ke.sum()).backward()
    gq, gk = q.grad.clone(), k.grad.clone()
    q.grad = k.grad = None
    qr, kr = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    (qr.square().sum() + kr.sum()).backward()
    assert torch.allclose(gq, q.grad, rtol=1e-5, atol=1e-6) and torch.allclose(gk, k.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_kernelized_model_on_gpu(model_type, monkeypatch, restore_funcs, strict):
    model = _tiny(model_type).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 256, (2, 33), device="cuda")
    with torch.no_grad():
        want = model(ids).logits
    _kernelize_for_cuda(model, _SourceRepo(), monkeypatch)
    before = dispatch.stats()["launches"]
    with torch.no_grad():
        got = model(ids).logits
    assert sum(dispatch.stats()["launches"].values()) - sum(before.values()) == 2  # one launch per layer
    assert torch.equal(got, want)  # RoPE is bit-identical, so the logits are too
