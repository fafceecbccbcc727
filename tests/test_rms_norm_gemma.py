"""RMSNorm in Gemma's rounding order (``rms_norm_gemma``: GemmaRMSNorm with offset 1, Olmo2RMSNorm
with offset 0): the reference against transformers' classes, the kernel's tile logic emulated on
the CPU (tests/cutile_numpy.py) against float64, its build matrix, and on the GPU every variant
family against a float64 reference with the output poisoned first."""

from __future__ import annotations

import pytest
import torch

import cutile_kernels
import cutile_numpy
from cutile_kernels import dispatch
from cutile_kernels.kernel_src import norm as src
from cutile_kernels.ops import norm as norm_ops
from launches import launched_variants

transformers = pytest.importorskip("transformers")


def _classes():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    return [(GemmaRMSNorm, 1.0), (Gemma2RMSNorm, 1.0), (Gemma3RMSNorm, 1.0), (Olmo2RMSNorm, 0.0)]


def _eps(module) -> float:
    return module.eps if hasattr(module, "eps") else module.variance_epsilon


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("cls,offset", _classes(), ids=lambda c: getattr(c, "__name__", str(c)))
def test_reference_is_the_transformers_norm(cls, offset, dtype):
    m = cls(96).to(dtype)
    with torch.no_grad():
        m.weight.normal_()
    x = (torch.randn(4, 5, 96) * 3).to(dtype)
    want = m(x)
    assert torch.equal(cutile_kernels.rms_norm_gemma_reference(x, m.weight, _eps(m), offset), want)
    got = cutile_kernels.rms_norm_gemma(x, m.weight, _eps(m), offset)  # CPU: the reference, counted
    assert got.dtype == dtype and got.is_contiguous() and torch.equal(got, want)


def test_rounding_order_differs_from_llamas():
    # The reason it is a kernel of its own: Llama rounds before the weight multiply, Gemma after.
    x, w = torch.randn(64, 2048).bfloat16(), torch.randn(2048).bfloat16()
    ours = cutile_kernels.rms_norm_gemma_reference(x, w, 1e-6, 0.0)
    assert not torch.equal(ours, cutile_kernels.rms_norm_reference(x, w, 1e-6))


def test_shape_errors():
    with pytest.raises(ValueError, match="rms_norm_gemma: weight of shape"):
        cutile_kernels.rms_norm_gemma(torch.randn(3, 8), torch.randn(9))


# ---------------------------------------------------------------------------------------------
# CPU: the kernels' tile logic against float64, output poisoned and windowed
# ---------------------------------------------------------------------------------------------

def _exact(x, w, eps, offset):
    xd = x.double()
    return (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)) * (offset + w.double())


def _emulate(x, w, eps, offset, out):
    rows, n = x.shape
    want = dict(norm_ops._want(x, rows))
    if "CHUNK" in want:
        kernel, consts = src.rms_norm_gemma_chunked_kernel, (want["CHUNK"], src.CHUNKED_ROWS)
        r = src.CHUNKED_ROWS
    else:
        layout = "aligned" if n % 16 == 0 else "generic"
        r = want.get("ROWS", src.ROWS[("rms_norm_gemma", layout)][want["BLOCK_N"]])
        kernel, consts = src.rms_norm_gemma_kernel, (want["BLOCK_N"], r)
    run = cutile_numpy.emulate(kernel, src)
    run((-(-rows // r), 1, 1), (x, w, out, cutile_numpy.float32(eps), cutile_numpy.float32(offset), *consts))


@pytest.mark.parametrize("offset", [1.0, 0.0])
@pytest.mark.parametrize("rows,n,dtype", [(1, 64, torch.float32), (5, 1000, torch.float32), (19, 1152, torch.float16),
                                          (3, 256, torch.float16), (300, 64, torch.float32),
                                          (2, 12288, torch.float32)], ids=str)
def test_emulated_kernel_matches_float64(rows, n, dtype, offset):
    x = (torch.randn(rows, 2 * n + 8) * 2)[:, :n].to(dtype)  # strided rows, as a window of a wider buffer
    w = (0.3 * torch.randn(n)).to(dtype)
    buf = torch.full((rows + 2, n + 24), 7.0, dtype=dtype)
    out = buf[1:rows + 1, 8:n + 8]
    out.fill_(float("nan"))
    _emulate(x, w, 1e-6, offset, out)
    assert not out.isnan().any(), "an output element was not written"
    outside = torch.ones_like(buf, dtype=torch.bool)
    outside[1:rows + 1, 8:n + 8] = False
    assert (buf[outside] == 7.0).all(), "the kernel wrote outside its output"
    ref = _exact(x, w, 1e-6, offset)
    stock = cutile_kernels.rms_norm_gemma_reference(x, w, 1e-6, offset)
    err = (out.double() - ref).abs().max().item()
    stock_err = (stock.double() - ref).abs().max().item()
    assert err <= 1.1 * stock_err + 4 * torch.finfo(dtype).eps * ref.abs().max().item(), (err, stock_err)


def test_build_matrix_has_every_rms_norm_tile_and_the_offset_scalar():
    gemma = [s for s in src.VARIANTS if s.kernel == "rms_norm_gemma"]
    plain = [s for s in src.VARIANTS if s.kernel == "rms_norm"]
    assert sorted(s.tag for s in gemma) == sorted(s.tag for s in plain)
    assert len({s.tag for s in gemma}) == len(gemma)
    for s in gemma:
        assert [p.name for p in s.params if p.kind == "scalar"] == ["eps", "offset"]


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

#: (rows, hidden, dtype, offset): Gemma 3 1B / Gemma 2 2B / OLMo 2 1B hidden sizes, the q/k norms'
#: head_dim 256, one row, prefill rows, rows past a tile, a chunked width.
GPU_CASES = ([(r, h, torch.bfloat16, 1.0) for h in (1152, 2304, 256) for r in (1, 16, 2048)]
             + [(r, 2048, torch.bfloat16, 0.0) for r in (1, 2048)]
             + [(333, 1152, torch.float16, 1.0), (65, 1000, torch.float32, 1.0), (7, 12288, torch.bfloat16, 1.0)])


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_kernel_matches_float64(case, strict):
    rows, hidden, dtype, offset = case
    x = (torch.randn(rows, 2 * hidden + 8, device="cuda") * 2)[:, :hidden].to(dtype)
    x = x if rows % 2 else x.contiguous()  # odd row counts strided, even ones contiguous
    w = (0.3 * torch.randn(hidden, device="cuda")).to(dtype)
    before = dispatch.stats()["launches"]
    y = cutile_kernels.rms_norm_gemma(x, w, 1e-6, offset)
    torch.cuda.synchronize()
    assert [v.kernel for v in launched_variants(before)] == ["rms_norm_gemma"]
    ref = _exact(x, w, 1e-6, offset)
    stock = cutile_kernels.rms_norm_gemma_reference(x, w, 1e-6, offset)
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    stock_rel = ((stock.double() - ref).norm() / ref.norm()).item()
    assert rel <= 1.1 * stock_rel + 1e-7, (rel, stock_rel)
    poisoned = torch.full_like(x, float("nan"), memory_format=torch.contiguous_format)
    assert norm_ops.dispatch.run("rms_norm_gemma", norm_ops._want(x, rows), (x, w, poisoned, 1e-6, offset), 2,
                                 norm_ops._grid(rows), norm_ops._rows_layout)
    torch.cuda.synchronize()
    assert not poisoned.isnan().any() and torch.equal(poisoned, y)


# ---------------------------------------------------------------------------------------------
# The patches rms_norm_gemma and rms_norm_olmo2 on models (CPU: the reference path, so stock numbers exactly)
# ---------------------------------------------------------------------------------------------

import families  # noqa: E402
from cutile_kernels.layers import norm as norm_layer  # noqa: E402


def _norms(model):
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


#: model type -> the float-order patch that takes its norms, and whether it is a default patch.
FLOAT_NORMS = {"gemma": ("rms_norm_gemma", True), "gemma3_text": ("rms_norm_gemma", True),
               "qwen3_5_text": ("rms_norm_gemma", True), "olmo2": ("rms_norm_olmo2", True)}
#: Fields over a family's tiny row: OLMo 2 at head_dim 128, whose q/k norms the default
#: olmo2_qk_norm_rope fuses with RoPE (it leaves the row's head_dim 16, which its kernel has no tile
#: for, to rms_norm_olmo2).
FIELDS = {"olmo2": families.OLMO_KERNEL_HEADS}


@pytest.mark.parametrize("model_type", sorted(FLOAT_NORMS))
def test_patch_takes_every_float_order_norm_and_keeps_stock_logits(model_type):
    name, default = FLOAT_NORMS[model_type]
    other = ({"rms_norm_gemma", "rms_norm_olmo2"} - {name}).pop()
    model = families.model(model_type, **FIELDS.get(model_type, {}))
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(ids).logits
    by_default = cutile_kernels.patch(model).changed.get(name, 0)
    n = by_default + cutile_kernels.patch(model, names=[name, other]).changed[name]
    assert n == len(_norms(model)) > 0  # every norm, q/k norms included
    assert by_default == (n if default else 0)
    assert cutile_kernels.patch(model, names=[other]).changed[other] == 0  # the other formula's patch: none
    dispatch.reset_stats()
    with torch.no_grad():
        got = model(ids).logits
    assert torch.equal(got, want)
    # Qwen3.5's post-attention norms run in the fused add + norm (patch qwen3_5_add_norm), its
    # attention's q/k norms in the fused q/k norm + RoPE (patch qwen3_5_rope: two norms a call);
    # OLMo 2's post-norms with their adds (olmo2_norm_add), its q/k norms with RoPE (olmo2_qk_norm_rope);
    # Gemma 3's pre-feedforward norms with the attention's add (gemma_add_norm), its q/k norms with
    # RoPE (gemma3_qk_norm_rope).
    calls = dispatch.stats()["reference_calls"]
    fused_add = calls.get("add_rms_norm_gemma", 0) + calls.get("rms_norm_add_gemma", 0)
    fused_qk = 2 * (calls.get("qk_norm_rope_gemma", 0) + calls.get("qk_norm_rope_olmo2", 0))
    assert calls["rms_norm_gemma"] + fused_add + fused_qk == n
    layers = model.config.num_hidden_layers
    assert fused_add == {"qwen3_5_text": 3, "olmo2": 2 * layers, "gemma3_text": layers}.get(model_type, 0)
    assert fused_qk == {"qwen3_5_text": 2, "olmo2": 2 * layers, "gemma3_text": 2 * layers}.get(model_type, 0)


def test_patch_leaves_llama_norms_alone():
    model = families.model("llama")
    assert cutile_kernels.patch(model, names=["rms_norm_gemma"]).changed["rms_norm_gemma"] == 0


def test_patch_replaces_the_hub_layers_stock_fallback_on_olmo2():
    # kernelize binds our RMSNorm hub layer to Olmo2's norms, which runs their stock code (Llama order
    # only): the patch may replace that instance forward, and unpatch gives the class forward back.
    from cutile_kernels.layers.norm import CutileRMSNorm

    model = families.model("olmo2")
    for m in _norms(model):
        m.forward = CutileRMSNorm.forward.__get__(m)
    n = cutile_kernels.patch(model, names=["rms_norm_olmo2"]).changed["rms_norm_olmo2"]
    assert n == len(_norms(model))
    assert all(m.forward.__func__ is norm_layer.olmo2_norm_forward for m in _norms(model))
    cutile_kernels.unpatch(model, names=["rms_norm_olmo2"])
    assert all("forward" not in m.__dict__ for m in _norms(model))


def test_patch_survives_kernelize_rebinding_the_hub_layer_after_it_on_olmo2():
    # from_pretrained applies the patches, then kernelize binds our hub layer to every decorated norm
    # (a CUDA model; emulated here): the marked modules still run the rms_norm_gemma op (the H200
    # bench of 2026-12-01 saw no launch of it on OLMo 2 before the mark existed).
    from cutile_kernels.layers.norm import CutileRMSNorm

    model = families.model("olmo2")
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(ids).logits
    n = cutile_kernels.patch(model, names=["rms_norm_olmo2"]).changed["rms_norm_olmo2"]
    for m in _norms(model):
        m.forward = CutileRMSNorm.forward.__get__(m)  # what kernels' kernelize does
    dispatch.reset_stats()
    with torch.no_grad():
        got = model(ids).logits
    assert torch.equal(got, want)
    assert dispatch.stats()["reference_calls"]["rms_norm_gemma"] == n == len(_norms(model))
    assert not dispatch.stats()["fallbacks"]
    frames, targets, compiled, eager = families.compile_fullgraph(model, seed=6)  # the mark: a constant
    assert frames == 1 and any("rms_norm_gemma" in t for t in targets)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)
    assert cutile_kernels.unpatch(model, names=["rms_norm_olmo2"]).changed["rms_norm_olmo2"] == n
    dispatch.reset_stats()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    assert "rms_norm_gemma" not in dispatch.stats()["reference_calls"]
    assert sum(dispatch.stats()["fallbacks"].values()) == n  # the hub layer's stock fallback again


def test_kernel_config_leaves_the_default_one_out_by_name():
    from cutile_kernels.layers.hub import _patch_names

    assert "rms_norm_olmo2" in _patch_names() and "rms_norm_olmo2" not in _patch_names(exclude=["rms_norm_olmo2"])


@pytest.mark.parametrize("model_type", ["gemma3_text", "olmo2"])
def test_patched_model_compiles_fullgraph_with_the_op_in_the_graph(model_type):
    model = families.model(model_type, layers=2)
    cutile_kernels.patch(model, names=[FLOAT_NORMS[model_type][0]])
    frames, targets, got, want = families.compile_fullgraph(model, seed=6)
    assert frames == 1
    assert any("rms_norm_gemma" in t for t in targets)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["gemma3_text", "olmo2", "qwen3_5_text"])
def test_gpu_patched_model_is_as_close_to_float32_as_stock(model_type, strict):
    name = FLOAT_NORMS[model_type][0]
    ours_rel, stock_rel, report = families.relative_errors_vs_float32(model_type, [name])
    assert report.changed[name] > 0
    assert ours_rel <= 1.1 * stock_rel, (ours_rel, stock_rel)


def _load_tiny(model_type, tmp_path, include=(), exclude=()):
    from transformers import AutoModelForCausalLM

    families.model(model_type, dtype=torch.bfloat16, layers=4).save_pretrained(tmp_path)
    return AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16, device_map="cuda", use_kernels=True,
        kernel_config=cutile_kernels.kernel_config(include=list(include), exclude=list(exclude))).eval()


def _launches_over_every_copy(model, ids) -> tuple[int, dict]:
    """The norms one forward ran in the rms_norm_gemma kernel and its fusions: add_rms_norm_gemma's
    launches (Qwen3.5's post-attention norms fused with the residual add), rms_norm_add_gemma's (OLMo
    2's post-norms with their residual add, patch olmo2_norm_add) and two per
    qk_norm_rope_gemma launch (its q_norm and k_norm, patch qwen3_5_rope), summed over this package
    and the build copy that kernelize bound (each keeps its own counters); and the fallbacks."""
    from cutile_kernels_tools.bench.worker import merged_stats, runtime_copies

    for d in runtime_copies():
        d.reset_stats()
    with torch.no_grad():
        model(ids)
    stats = merged_stats()
    launches = stats["launches"].items()
    return (sum(n for k, n in launches if k.startswith(("rms_norm_gemma", "add_rms_norm_gemma", "rms_norm_add_gemma")))
            + 2 * sum(n for k, n in launches if k.startswith("qk_norm_rope_gemma")), stats["fallbacks"])


@pytest.mark.gpu
def test_gpu_from_pretrained_runs_the_kernel_on_olmo2s_hub_decorated_norms(tmp_path, strict):
    # The real order: from_pretrained applies the patch, then kernelize binds our hub layer to
    # Olmo2RMSNorm (decorated "RMSNorm"); the marked norms still launch the kernel, none falls back.
    # The default olmo2_qk_norm_rope, whose kernel takes the q/k norms of real head dims (66-128), leaves
    # this tiny model's 16 alone when it is kernelized: its q/k norms are norms here too.
    model = _load_tiny("olmo2", tmp_path)  # rms_norm_olmo2: a default patch
    assert all(m.__dict__.get(norm_layer.FLOAT_NORM_MARK) == 0.0 for m in _norms(model))  # offset 0: present, falsy
    n, fallbacks = _launches_over_every_copy(model, torch.randint(0, 256, (1, 9), device="cuda"))
    assert n == len(_norms(model))
    assert not any(k.startswith("rms_norm:") for k in fallbacks)


@pytest.mark.gpu
def test_gpu_from_pretrained_runs_the_kernel_on_qwen3_5s_zero_centered_norms(tmp_path):
    # Qwen3_5RMSNorm is decorated "RMSNormZeroCentered": our hub layer for that name runs it.
    model = _load_tiny("qwen3_5_text", tmp_path)
    norms = [m for m in model.modules() if type(m).__name__ == "Qwen3_5RMSNorm"]
    assert norms and all(m.forward.__func__.__qualname__ == "CutileZeroCenteredRMSNorm.forward" for m in norms)
    n, fallbacks = _launches_over_every_copy(model, torch.randint(0, 256, (1, 9), device="cuda"))
    assert n == len(norms)
    assert not any(k.startswith("rms_norm_gemma:") for k in fallbacks)


# ---------------------------------------------------------------------------------------------
# add_rms_norm_gemma: the residual add fused into the (1 + weight) norm, and Qwen3.5's decoder patch
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_fused_add_reference_is_qwen3_5s_residual_add_then_norm(dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    norm = Qwen3_5RMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(0, 0.3)
    h, residual = (torch.randn(3, 5, 96) * 3).to(dtype), (torch.randn(3, 5, 96) * 3).to(dtype)
    y, s = cutile_kernels.add_rms_norm_gemma_reference(h, residual, norm.weight, norm.eps, 1.0)
    stock_s = residual + h
    assert torch.equal(s, stock_s) and torch.equal(y, norm(stock_s))
    y2, s2 = cutile_kernels.add_rms_norm_gemma(h, residual, norm.weight, norm.eps)  # CPU: the reference
    assert torch.equal(y2, y) and torch.equal(s2, s)
    with pytest.raises(ValueError, match="add_rms_norm_gemma: residual shape"):
        cutile_kernels.add_rms_norm_gemma(h, residual[:, :4], norm.weight)


@pytest.mark.parametrize("rows,n,dtype", [(1, 512, torch.float32), (19, 1152, torch.float16), (300, 640, torch.float32),
                                          (5, 1000, torch.float16), (2, 12288, torch.float32)], ids=str)
def test_emulated_fused_add_kernel_matches_float64(rows, n, dtype):
    x = (torch.randn(rows, 2 * n + 8) * 2)[:, :n].to(dtype)  # strided rows
    residual = (torch.randn(rows, n) * 2).to(dtype)
    w = (0.3 * torch.randn(n)).to(dtype)
    y = torch.full((rows, n), float("nan"), dtype=dtype)
    s = torch.full((rows, n), float("nan"), dtype=dtype)
    want = dict(norm_ops._want(x, rows))
    if "CHUNK" in want:
        kernel, r = src.add_rms_norm_gemma_chunked_kernel, src.CHUNKED_ROWS
        consts = (want["CHUNK"], r)
    else:
        r = want.get("ROWS", src.ROWS[("add_rms_norm_gemma", "generic")][want["BLOCK_N"]])
        kernel, consts = src.add_rms_norm_gemma_kernel, (want["BLOCK_N"], r)
    cutile_numpy.emulate(kernel, src)((-(-rows // r), 1, 1), (x, residual, w, y, s, cutile_numpy.float32(1e-6),
                                                              cutile_numpy.float32(1.0), *consts))
    assert torch.equal(s, x + residual), "the sum is the stock add's, rounded once"
    ref = _exact(s, w, 1e-6, 1.0)
    stock = cutile_kernels.rms_norm_gemma_reference(s, w, 1e-6, 1.0)
    err = (y.double() - ref).abs().max().item()
    stock_err = (stock.double() - ref).abs().max().item()
    assert err <= 1.1 * stock_err + 4 * torch.finfo(dtype).eps * ref.abs().max().item(), (err, stock_err)


def test_build_matrix_has_every_fused_add_tile_and_the_offset_scalar():
    # add_rms_norm's tiles for hidden sizes (512 and up) and its chunked rows.
    fused = [s for s in src.VARIANTS if s.kernel == "add_rms_norm_gemma"]
    llama = [s for s in src.VARIANTS if s.kernel == "add_rms_norm" and s.constants.get("BLOCK_N", 512) >= 512
             and not s.constants.get("PDL")]  # add_rms_norm's programmatic dependent launch twins: its own
    assert sorted(s.tag for s in fused) == sorted(s.tag for s in llama)
    for s in fused:
        assert [p.name for p in s.params if p.kind == "scalar"] == ["eps", "offset"]


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(1, 1024, torch.bfloat16), (16, 1024, torch.bfloat16), (2048, 1024, torch.bfloat16),
                                  (512, 1152, torch.bfloat16), (333, 5120, torch.float16), (65, 1000, torch.float32),
                                  (7, 12288, torch.bfloat16), (5, 64, torch.bfloat16)],
                         ids=str)
def test_gpu_fused_add_kernel_matches_float64(case, strict):
    """Qwen3.5-0.8B's and -27B's hidden sizes (1024, 5120), a decode row and batch, prefill rows (a
    Gemma-3-1B prefill of 512 in the middle tile), a width off the tiles, a chunked width, a tiny
    model's 64 in the narrowest tile; both outputs NaN-poisoned first."""
    rows, hidden, dtype = case
    x = (torch.randn(rows, 2 * hidden + 8, device="cuda") * 2)[:, :hidden].to(dtype)
    residual = (torch.randn(rows, hidden, device="cuda") * 2).to(dtype)
    w = (0.3 * torch.randn(hidden, device="cuda")).to(dtype)
    y = torch.full((rows, hidden), float("nan"), dtype=dtype, device="cuda")
    s = torch.full_like(y, float("nan"))
    args = (x, residual, w, y, s, 1e-6, 1.0)
    want = norm_ops._want(x, rows, src.HIDDEN_BLOCK_NS[0])
    assert norm_ops.dispatch.run("add_rms_norm_gemma", want, args, 3, norm_ops._grid(rows), norm_ops._rows_layout)
    torch.cuda.synchronize()
    assert torch.equal(s, x + residual)
    ref = _exact(s, w, 1e-6, 1.0)
    stock = cutile_kernels.rms_norm_gemma_reference(s, w, 1e-6, 1.0)
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    stock_rel = ((stock.double() - ref).norm() / ref.norm()).item()
    assert not y.isnan().any() and rel <= 1.1 * stock_rel + 1e-7, (rel, stock_rel)
    before = dispatch.stats()["launches"]
    y2, s2 = cutile_kernels.add_rms_norm_gemma(x, residual, w, 1e-6)
    torch.cuda.synchronize()
    launched = launched_variants(before)
    assert [v.kernel for v in launched] == ["add_rms_norm_gemma"]
    if (rows, hidden) == (512, 1152):  # the public op's middle tile (the direct launch above: the prefill tile)
        assert launched[0].tag == "bf16.n2048.r4.aligned"
    assert torch.equal(y2, y) and torch.equal(s2, s)


def test_qwen3_5_decoder_patch_keeps_stock_logits_and_undoes():
    """On the CPU (the reference path) the patched decoder layers give the stock logits bit for bit,
    over a prefill and cached decode steps; unpatch restores the class forward."""
    from cutile_kernels.layers.models import qwen3_5 as fam

    model = families.model("qwen3_5_text", layers=4)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    want = families.prefill_and_step(model, ids)
    assert fam.patch_qwen3_5_add_norm(model) == 4
    assert all(type(m).__name__ != "Qwen3_5DecoderLayer" or "forward" in m.__dict__ for m in model.modules())
    assert torch.equal(families.prefill_and_step(model, ids), want)
    assert fam.unpatch_qwen3_5_add_norm(model) == 4
    assert not any("forward" in m.__dict__ for m in model.modules() if type(m).__name__ == "Qwen3_5DecoderLayer")


def test_qwen3_5_decoder_patch_declines_other_code_and_norms(caplog, change_pin):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from cutile_kernels.layers.models import qwen3_5 as fam

    assert fam.decoder_verdict(LlamaDecoderLayer) == "its forward is not Qwen3_5DecoderLayer.forward's code"
    model = families.model("qwen3_5_text", layers=2)
    layer = model.model.layers[0]
    layer.post_attention_layernorm = torch.nn.LayerNorm(layer.hidden_size)
    assert "post_attention_layernorm" in fam._decoder_verdict(layer)
    change_pin("qwen3_5.Qwen3_5DecoderLayer.forward")
    fam.decoder_verdict.cache_clear()
    try:
        assert "not the one the fused forward reproduces" in fam.decoder_verdict(type(layer))
    finally:
        fam.decoder_verdict.cache_clear()


@pytest.mark.gpu
def test_gpu_qwen3_5_decoder_patch_is_as_close_to_float32_as_stock(strict, stock_functions):
    from cutile_kernels.layers.models import qwen3_5 as fam

    base = families.model("qwen3_5_text", layers=4).cuda()
    ids = torch.randint(1, 256, (2, 40), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.inference_mode():
        want = base(ids).logits.double()
        model = base.to(torch.bfloat16)
        stock = model(ids).logits.double()
        assert fam.patch_qwen3_5_add_norm(model) == 4
        before = dispatch.stats()["launches"]
        ours = model(ids).logits.double()
        assert "add_rms_norm_gemma" in {v.kernel for v in launched_variants(before)}
    err = [float((x - want).norm() / want.norm()) for x in (ours, stock)]
    assert err[0] <= 1.1 * err[1] + 1e-4, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_gemma_decoder_patch_keeps_stock_logits_and_undoes(model_type, dtype):
    """Patch ``gemma_add_norm`` (CPU: the reference path) gives the stock logits bit for bit
    over a prefill and a cached step, in float16 too (where Gemma's activations may overflow, NaN
    exactly where stock has them); unpatch restores the class forward."""
    from cutile_kernels.layers.models import gemma as fam

    model = families.model(model_type, dtype=dtype)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(6))
    want = families.prefill_and_step(model, ids)
    layers = model.config.num_hidden_layers
    # The other default patches but gemma2_attention (Gemma 2's attention on ours is not eager's bits:
    # tests/test_attention.py holds it to tolerance), then this one.
    from cutile_kernels.layers._patching import PATCHES

    others = [n for n, p in PATCHES.items() if p.default and n not in ("gemma2_attention", "gemma_add_norm")]
    assert "gemma_add_norm" not in cutile_kernels.patch(model, names=others).changed
    assert cutile_kernels.patch(model, names=["gemma_add_norm"]).changed == {"gemma_add_norm": layers}
    dispatch.reset_stats()
    torch.testing.assert_close(families.prefill_and_step(model, ids), want, rtol=0, atol=0, equal_nan=True)
    assert dispatch.stats()["reference_calls"]["add_rms_norm_gemma"] == 2 * layers
    assert fam.unpatch_gemma_add_norm(model) == layers


def test_gemma_decoder_patch_leaves_gemma1_and_other_norms_alone():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from cutile_kernels.layers.models import gemma as fam

    assert fam.decoder_verdict(LlamaDecoderLayer) == "its forward is not Gemma3DecoderLayer.forward's code"
    assert cutile_kernels.patch(families.model("gemma"), names=["gemma_add_norm"]).changed == {"gemma_add_norm": 0}
    model = families.model("gemma3_text", layers=2)
    layer = model.model.layers[0]
    layer.pre_feedforward_layernorm = torch.nn.LayerNorm(layer.hidden_size)
    assert "pre_feedforward_layernorm" in fam._decoder_verdict(layer)


@pytest.mark.gpu
def test_gpu_gemma_decoder_patch_is_as_close_to_float32_as_stock(strict):
    before = dispatch.stats()["launches"]
    ours, stock, report = families.relative_errors_vs_float32("gemma3_text", ["gemma_add_norm", "rms_norm_gemma"],
                                                              seq=41)
    assert report.changed["gemma_add_norm"] == 3
    assert "add_rms_norm_gemma" in {v.kernel for v in launched_variants(before)}
    assert ours <= 1.1 * stock + 1e-4, (ours, stock)


def test_gemma_decoder_patch_compiles_fullgraph_with_the_fused_op():
    model = families.model("gemma3_text", layers=2)
    cutile_kernels.patch(model, names=["gemma_add_norm", "rms_norm_gemma"])
    frames, targets, got, want = families.compile_fullgraph(model, seed=10)
    assert frames == 1 and any(t.endswith("add_rms_norm_gemma.default") for t in targets)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# rms_norm_add_gemma: OLMo 2's post-norm block (norm, then the residual add) and patch olmo2_norm_add
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_post_norm_add_reference_is_olmo2s_norm_then_residual_add(dtype):
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    norm = Olmo2RMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(96))
    h, residual = (torch.randn(3, 5, 96) * 3).to(dtype), (torch.randn(3, 5, 96) * 3).to(dtype)
    stock = residual + norm(h)
    assert torch.equal(cutile_kernels.rms_norm_add_gemma_reference(h, residual, norm.weight, 1e-6, 0.0), stock)
    assert torch.equal(cutile_kernels.rms_norm_add_gemma(h, residual, norm.weight, 1e-6), stock)  # CPU: reference
    with pytest.raises(ValueError, match="rms_norm_add_gemma: residual shape"):
        cutile_kernels.rms_norm_add_gemma(h, residual[:, :4], norm.weight)


def _post_norm_add_launch(x):
    rows = x.shape[0]
    want = dict(norm_ops._want(x, rows, src.HIDDEN_BLOCK_NS[0]))
    if "CHUNK" in want:
        return src.rms_norm_add_gemma_chunked_kernel, src.CHUNKED_ROWS, (want["CHUNK"], src.CHUNKED_ROWS)
    r = want.get("ROWS", src.ROWS[("rms_norm_add_gemma", "generic")][want["BLOCK_N"]])
    return src.rms_norm_add_gemma_kernel, r, (want["BLOCK_N"], r)


@pytest.mark.parametrize("rows,n,dtype", [(1, 2048, torch.float16), (19, 512, torch.float16), (300, 640, torch.float32),
                                          (5, 1000, torch.float16), (2, 12288, torch.float16), (3, 64, torch.float32)],
                         ids=str)
def test_emulated_post_norm_add_kernel_is_the_stock_lines(rows, n, dtype):
    """OLMo-2-1B's hidden size at decode, widths off the tiles, a chunked width, a tiny width in the
    narrowest tile; strided input rows; the output poisoned: within one rounding of the stock lines
    (norm rounded, then the add) computed from a float64 norm. (NumPy has no bfloat16: the GPU
    test below runs it; float32 here exercises the same tile logic.)"""
    x = (torch.randn(rows, 2 * n + 8) * 2)[:, :n].to(dtype)
    residual = (torch.randn(rows, n) * 2).to(dtype)
    w = (1 + 0.3 * torch.randn(n)).to(dtype)
    y = torch.full((rows, n), float("nan"), dtype=dtype)
    kernel, r, consts = _post_norm_add_launch(x)
    cutile_numpy.emulate(kernel, src)((-(-rows // r), 1, 1), (x, residual, w, y, cutile_numpy.float32(1e-6),
                                                              cutile_numpy.float32(0.0), *consts))
    stock = cutile_kernels.rms_norm_add_gemma_reference(x, residual, w, 1e-6, 0.0)
    exact = residual + _exact(x, w, 1e-6, 0.0).to(dtype)  # the norm from float64, then the stock add
    ulp = torch.finfo(dtype).eps * exact.double().abs().max().item()
    assert not y.isnan().any()
    assert (y.double() - stock.double()).abs().max().item() <= 2 * ulp
    assert (y.double() - exact.double()).abs().max().item() <= 2 * ulp


def test_build_matrix_has_the_post_norm_add_tiles_in_16_bits():
    post = [s for s in src.VARIANTS if s.kernel == "rms_norm_add_gemma"]
    fused = [s for s in src.VARIANTS if s.kernel == "add_rms_norm_gemma" and not s.tag.startswith("fp32")]
    assert post and sorted(s.tag for s in post) == sorted(s.tag for s in fused)
    for s in post:
        assert [p.name for p in s.params if p.kind == "scalar"] == ["eps", "offset"]
        assert [p.name for p in s.params if p.kind == "array"] == ["x", "residual", "weight", "y"]


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(1, 2048, torch.bfloat16), (16, 2048, torch.bfloat16), (2048, 2048, torch.bfloat16),
                                  (700, 2048, torch.bfloat16), (333, 5120, torch.float16), (7, 12288, torch.bfloat16),
                                  (5, 64, torch.bfloat16),
                                  (9, 1000, torch.float16)],
                         ids=str)
def test_gpu_post_norm_add_kernel_is_the_stock_lines(case, strict):
    """OLMo-2-1B's hidden size (2048) at decode b=1 and 16 and prefills (700 rows: the middle tile), a
    wide fp16 row, a chunked width, a tiny width, a width off the tiles; strided input, the output
    NaN-poisoned first."""
    rows, hidden, dtype = case
    x = (torch.randn(rows, 2 * hidden + 8, device="cuda") * 2)[:, :hidden].to(dtype)
    residual = (torch.randn(rows, hidden, device="cuda") * 2).to(dtype)
    w = (1 + 0.3 * torch.randn(hidden, device="cuda")).to(dtype)
    y = torch.full((rows, hidden), float("nan"), dtype=dtype, device="cuda")
    want = norm_ops._want(x, rows, src.HIDDEN_BLOCK_NS[0])
    assert norm_ops.dispatch.run("rms_norm_add_gemma", want, (x, residual, w, y, 1e-6, 0.0), 3,
                                 norm_ops._grid(rows), norm_ops._rows_layout)
    torch.cuda.synchronize()
    stock = cutile_kernels.rms_norm_add_gemma_reference(x, residual, w, 1e-6, 0.0)
    exact = residual + _exact(x, w, 1e-6, 0.0).to(dtype)
    ulp = torch.finfo(dtype).eps * exact.double().abs().max().item()
    assert not y.isnan().any()
    assert (y.double() - stock.double()).abs().max().item() <= 2 * ulp
    assert (y.double() - exact.double()).abs().max().item() <= 2 * ulp
    before = dispatch.stats()["launches"]
    y2 = cutile_kernels.rms_norm_add_gemma(x, residual, w, 1e-6)
    torch.cuda.synchronize()
    launched = launched_variants(before)
    assert [v.kernel for v in launched] == ["rms_norm_add_gemma"]
    if (rows, hidden) == (700, 2048):  # the public op's middle tile (the direct launch above: the prefill tile)
        assert launched[0].tag == "bf16.n2048.r4.aligned"
    assert torch.equal(y2, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_olmo2_post_norm_patch_keeps_stock_logits_and_undoes(dtype):
    """``olmo2_norm_add`` (CPU: the reference path) among the default patches: the stock logits bit
    for bit over a prefill and a cached step; two fused launches a layer; unpatch restores."""
    from cutile_kernels.layers.models import olmo2 as fam

    model = families.model("olmo2", dtype=dtype)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(6))
    want = families.prefill_and_step(model, ids)
    layers = model.config.num_hidden_layers
    assert cutile_kernels.patch(model).changed["olmo2_norm_add"] == layers  # a default
    dispatch.reset_stats()
    torch.testing.assert_close(families.prefill_and_step(model, ids), want, rtol=0, atol=0, equal_nan=True)
    assert dispatch.stats()["reference_calls"]["rms_norm_add_gemma"] == 2 * 2 * layers
    assert fam.unpatch_olmo2_norm_add(model) == layers
    assert not any("forward" in m.__dict__ for m in model.model.layers)


def test_olmo2_post_norm_patch_declines_other_decoders_and_hooked_norms(caplog):
    import logging

    for model_type in ("llama", "gemma2"):
        assert cutile_kernels.patch(families.model(model_type, layers=2),
                                    names=["olmo2_norm_add"]).changed == {"olmo2_norm_add": 0}
    model = families.model("olmo2", layers=2)
    model.model.layers[0].post_attention_layernorm.weight = torch.nn.Parameter(torch.ones(2, 64))
    with caplog.at_level(logging.INFO, logger="cutile_kernels"):
        assert cutile_kernels.patch(model, names=["olmo2_norm_add"]).changed == {"olmo2_norm_add": 1}
    assert "post-norms are not Olmo2RMSNorm-formula norms" in caplog.text
    # A hook on a post-norm at run time: the stock lines run (the hook fires), same result.
    model = families.model("olmo2", layers=2)
    ids = torch.randint(0, 256, (1, 7))
    want = families.prefill_and_step(model, ids)
    cutile_kernels.patch(model, names=["olmo2_norm_add"])
    seen = []
    model.model.layers[1].post_feedforward_layernorm.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    dispatch.reset_stats()
    assert torch.equal(families.prefill_and_step(model, ids), want) and len(seen) == 2
    assert dispatch.stats()["reference_calls"]["rms_norm_add_gemma"] == 2 * 3


def test_olmo2_post_norm_patch_compiles_fullgraph_with_the_fused_op():
    model = families.model("olmo2", layers=2)
    cutile_kernels.patch(model, names=["olmo2_norm_add"])
    frames, targets, got, want = families.compile_fullgraph(model, seed=6)
    assert frames == 1
    assert any("rms_norm_add_gemma" in t for t in targets)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.gpu
def test_gpu_olmo2_post_norm_patch_is_as_close_to_float32_as_stock(strict):
    ours_rel, stock_rel, report = families.relative_errors_vs_float32("olmo2", ["olmo2_norm_add"])
    assert report.changed["olmo2_norm_add"] > 0
    assert ours_rel <= 1.1 * stock_rel, (ours_rel, stock_rel)


# ---------------------------------------------------------------------------------------------
# fp16 past its range: Gemma's activations overflow fp16 in stock too; ours must overflow where
# stock does and nowhere else (no NaN where stock has none, none missing where it has one)
# ---------------------------------------------------------------------------------------------

def _overflowing_fp16_rows(n: int, device="cpu"):
    """(x, w) in fp16: an ordinary row, a row whose squares overflow fp16 (not float32), rows holding
    +inf, -inf and NaN (an overflowed residual stream), and a weight whose few huge entries (offset
    1 + 6e4) overflow the output."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, n, generator=g) * 2
    x[1] = torch.empty(n).uniform_(2e4, 6e4, generator=g) * torch.randn(n, generator=g).sign()
    x[2, 3], x[3, n // 2], x[4, 1] = float("inf"), -float("inf"), float("nan")
    x[5, :2] = torch.tensor([6e4, -6e4])
    w = 0.3 * torch.randn(n, generator=g)
    w[[0, n - 1]] = 6e4
    return x.half().to(device), w.half().to(device)


def _overflowing_residual(x):
    """A residual for ``x`` of :func:`_overflowing_fp16_rows` whose add overflows fp16: row 1 again
    (same signs: |sums| of 4e4 to 1.2e5) and 1e4 beside row 5's +-6e4; ordinary elsewhere."""
    residual = (torch.randn(x.shape, generator=torch.Generator().manual_seed(12)) * 2).to(x)
    residual[1] = x[1]
    residual[5, :2] = torch.tensor([1e4, -1e4])
    return residual


def _assert_stock_sum(s, stock_s):
    # The rounded sum of the fused add is the stock add's, inf and NaN included.
    assert s.isinf().any()
    torch.testing.assert_close(s, stock_s, rtol=0, atol=0, equal_nan=True)


def _assert_stock_non_finite(got, stock):
    """Same NaN and inf positions (and inf signs) as stock; the finite elements within fp16's
    rounding of stock's (the two round the same float32 value, or one ulp apart)."""
    assert torch.equal(got.isnan(), stock.isnan()), "NaN where stock has none, or missing"
    assert torch.equal(got.isinf(), stock.isinf()) and torch.equal(got[got.isinf()], stock[stock.isinf()])
    fin = stock.isfinite()
    assert fin.any() and not fin.all()  # the case overflows somewhere and not everywhere
    torch.testing.assert_close(got[fin].float(), stock[fin].float(), rtol=2e-3, atol=1e-3)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("n", [256, 1152])
def test_emulated_kernels_overflow_fp16_where_stock_does(n):
    x, w = _overflowing_fp16_rows(n)
    y = torch.full_like(x, 7.0)
    _emulate(x, w, 1e-6, 1.0, y)
    _assert_stock_non_finite(y, cutile_kernels.rms_norm_gemma_reference(x, w, 1e-6, 1.0))
    residual = _overflowing_residual(x)
    y2, s = torch.full_like(x, 7.0), torch.full_like(x, 7.0)
    want = dict(norm_ops._want(x, x.shape[0]))
    r = want.get("ROWS", src.ROWS[("add_rms_norm_gemma", "generic")][want["BLOCK_N"]])
    cutile_numpy.emulate(src.add_rms_norm_gemma_kernel, src)(
        (-(-x.shape[0] // r), 1, 1),
        (x, residual, w, y2, s, cutile_numpy.float32(1e-6), cutile_numpy.float32(1.0), want["BLOCK_N"], r))
    stock_y, stock_s = cutile_kernels.add_rms_norm_gemma_reference(x, residual, w, 1e-6, 1.0)
    _assert_stock_sum(s, stock_s)
    _assert_stock_non_finite(y2, stock_y)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [256, 1152, 2304])
def test_gpu_kernels_overflow_fp16_where_stock_does(n, strict):
    """The same rows through the GPU kernels (Gemma 3's head_dim and hidden size, Gemma 2's)."""
    x, w = _overflowing_fp16_rows(n, "cuda")
    before = dispatch.stats()["launches"]
    y = cutile_kernels.rms_norm_gemma(x, w, 1e-6, 1.0)
    residual = _overflowing_residual(x)
    y2, s = cutile_kernels.add_rms_norm_gemma(x, residual, w, 1e-6)
    torch.cuda.synchronize()
    assert sorted(v.kernel for v in launched_variants(before)) == ["add_rms_norm_gemma", "rms_norm_gemma"]
    _assert_stock_non_finite(y, cutile_kernels.rms_norm_gemma_reference(x, w, 1e-6, 1.0))
    stock_y, stock_s = cutile_kernels.add_rms_norm_gemma_reference(x, residual, w, 1e-6, 1.0)
    _assert_stock_sum(s, stock_s)
    _assert_stock_non_finite(y2, stock_y)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["gemma", "gemma2", "gemma3_text"])
def test_gpu_fp16_gemma_with_activations_past_fp16s_squares_stays_finite_as_stock(model_type, strict):
    """fp16 Gemma with every default of ours (``kernelize``): a token whose embedding, scaled by
    sqrt(hidden), puts 24000 into the residual stream (its squares overflow fp16, stock's float32 norms
    take them) keeps stock's finite logits, as close to float32 as stock fp16's. Where stock itself
    overflows, the element-wise kernels match it (the tests above); an overflowed stream's NaN then
    reaches the attention, whose spread over masked keys is the backend's own (sdpa's differs by
    kernel), so this model-level test stays on the side stock survives."""
    import copy

    fields = {"tie_word_embeddings": False}  # tied, the token's own logit would overflow in stock
    fields.update({} if model_type == "gemma" else {"sliding_window": 64})
    base = families.model(model_type, **fields).cuda()
    with torch.no_grad():
        base.model.embed_tokens.weight[7] = 3000.0  # x 8 (sqrt(64)): 24000
    ids = torch.randint(8, 256, (2, 24), generator=torch.Generator().manual_seed(13)).cuda()
    ids[0, 10], ids[1, 17] = 7, 7
    stock_model = copy.deepcopy(base).half()
    with torch.no_grad(), families.transformers_functions(base), families.transformers_functions(stock_model):
        want, stock = base(ids).logits.double(), stock_model(ids).logits.double()
    ours_model = cutile_kernels.kernelize(copy.deepcopy(base).half())
    before = dispatch.stats()["launches"]
    with torch.no_grad():
        got = ours_model(ids).logits.double()
    assert "rms_norm_gemma" in {v.kernel for v in launched_variants(before)}
    assert stock.isfinite().all(), "the case no longer stays finite in stock"
    assert got.isfinite().all()
    err = [float((x - want).norm() / want.norm()) for x in (got, stock)]
    assert err[0] <= 1.1 * err[1] + 1e-4, err
