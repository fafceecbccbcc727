"""RMSNorm and fused add + RMSNorm: reference semantics (CPU), custom ops (CPU), kernels (GPU)."""

from __future__ import annotations

import pytest
import torch

import cutile_kernels
from cutile_kernels import dispatch, registry
from cutile_kernels.ops import norm as norm_ops
from cutile_kernels.kernel_src.norm import DECODE_MAX_ROWS, MID_KINDS, ROWS
from launches import launched_variants

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


# ---------------------------------------------------------------------------------------------
# CPU: the reference path is transformers' own module, bit for bit
# ---------------------------------------------------------------------------------------------

def _hf_norm_classes():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    return [LlamaRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm, MistralRMSNorm]


@pytest.mark.parametrize("cls", _hf_norm_classes(), ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("hidden", [896, 1536, 128])
def test_reference_matches_transformers_modules(cls, dtype, hidden):
    mod = cls(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        mod.weight.copy_(1 + 0.1 * torch.randn(hidden))
    x = torch.randn(3, 7, hidden, dtype=dtype) * 3
    want = mod(x)
    got = cutile_kernels.rms_norm_reference(x, mod.weight, mod.variance_epsilon)
    assert got.dtype == want.dtype
    assert torch.equal(got, want)
    # On the CPU the public function is the reference path.
    assert torch.equal(cutile_kernels.rms_norm(x, mod.weight, mod.variance_epsilon), want)


def test_reference_keeps_mixed_dtype_promotion():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    mod = LlamaRMSNorm(64)  # float32 weight
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    want = mod(x)
    got = cutile_kernels.rms_norm(x, mod.weight, mod.variance_epsilon)
    assert want.dtype == got.dtype == torch.float32
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_reference_matches_decoder_residual_then_norm(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    mod = LlamaRMSNorm(256, eps=1e-6).to(dtype)
    with torch.no_grad():
        mod.weight.copy_(torch.rand(256) + 0.5)
    x, residual = torch.randn(2, 9, 256, dtype=dtype), torch.randn(2, 9, 256, dtype=dtype)
    s = residual + x  # what LlamaDecoderLayer does before post_attention_layernorm
    y, s_out = cutile_kernels.add_rms_norm(x, residual, mod.weight, 1e-6)
    assert torch.equal(s_out, s)
    assert torch.equal(y, mod(s))


def test_shape_errors():
    with pytest.raises(ValueError, match="does not match hidden size"):
        cutile_kernels.rms_norm(torch.randn(4, 8), torch.randn(7))
    with pytest.raises(ValueError, match="residual shape"):
        cutile_kernels.add_rms_norm(torch.randn(4, 8), torch.randn(4, 9), torch.randn(8))


@pytest.mark.parametrize("layout", ["contiguous", "permuted"])
def test_custom_ops_pass_opcheck(layout):
    x = torch.randn(6, 5, 64, dtype=torch.float32)
    if layout == "permuted":
        x = x.transpose(0, 1)  # non-contiguous: the op's outputs are contiguous like its fake's
    w = torch.randn(64, dtype=torch.float32, requires_grad=True)
    utils = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(norm_ops._rms_norm.op, (x, w, 1e-6), test_utils=utils)
    torch.library.opcheck(norm_ops._add_rms_norm.op, (x, torch.randn_like(x), w, 1e-6), test_utils=utils)
    y = cutile_kernels.rms_norm(x, w.detach())
    assert y.is_contiguous() and torch.equal(y, cutile_kernels.rms_norm_reference(x, w.detach(), 1e-6))


def test_gradients_follow_the_reference_formula():
    x = torch.randn(4, 7, 96, dtype=torch.float64, requires_grad=True)
    r = torch.randn(4, 7, 96, dtype=torch.float64, requires_grad=True)
    w = torch.randn(96, dtype=torch.float64, requires_grad=True)
    y, s = cutile_kernels.add_rms_norm(x, r, w, 1e-5)
    z = cutile_kernels.rms_norm(y * 3, w, 1e-5)
    assert z.grad_fn is not None and "rms_norm" in z.grad_fn.name()
    (z.square().sum() + s.sum()).backward()
    got = [t.grad.clone() for t in (x, r, w)]
    for t in (x, r, w):
        t.grad = None
    y2, s2 = cutile_kernels.add_rms_norm_reference(x, r, w, 1e-5)
    (cutile_kernels.rms_norm_reference(y2 * 3, w, 1e-5).square().sum() + s2.sum()).backward()
    for a, b in zip(got, (x.grad, r.grad, w.grad)):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def _want(hidden, rows, dtype=torch.bfloat16):
    return norm_ops._want(torch.empty(0, hidden, dtype=dtype), rows)


def test_small_hidden_sizes_use_the_smallest_tile():
    assert _want(16, 4096) == _want(64, 4096) == (("BLOCK_N", 64),)
    assert _want(65, 4096) == (("BLOCK_N", 128),)
    assert _want(8193, 4096)[0][0] == "CHUNK"


def test_decode_steps_ask_for_one_row_per_block():
    # A decode step's few rows in a prefill tile (16 rows of 2048 for add_rms_norm) leave it mostly
    # padding and the GPU mostly idle: 16-bit dtypes have decode tiles of one row.
    assert _want(2048, 1) == _want(2048, DECODE_MAX_ROWS) == (("BLOCK_N", 2048), ("ROWS", 1))
    assert _want(896, 16, torch.float16) == (("BLOCK_N", 1024), ("ROWS", 1))
    assert _want(2048, DECODE_MAX_ROWS + 1) == (("BLOCK_N", 2048),)
    assert _want(2048, 1, torch.float32) == (("BLOCK_N", 2048),)  # no float32 decode tiles: the prefill one
    assert _want(12288, 1)[0][0] == "CHUNK"  # one row per block already


def test_every_width_and_layout_has_a_decode_tile():
    """A decode request (ROWS=1) must find an aligned and a generic variant of every width, or the
    op would fall back for a misaligned or strided decode input."""
    from cutile_kernels.kernel_src import norm as src

    for kind in ("rms_norm", "add_rms_norm"):
        for dtype in ("bf16", "fp16"):
            for bn in src.BLOCK_NS:
                tags = {s.tag.rsplit(".", 1)[1] for s in src.VARIANTS if s.kernel == kind and s.tag.startswith(dtype)
                        and s.constants.get("BLOCK_N") == bn and s.constants["ROWS"] == 1
                        and not s.constants.get("PDL")}  # the twins: tests/test_pdl.py
                assert tags == {"aligned", "generic"}, (kind, dtype, bn)
    assert not any(s.constants["ROWS"] == 1 and s.constants.get("BLOCK_N", 9999) < 8192 and s.tag.endswith("aligned")
                   for s in src.VARIANTS if s.tag.startswith("fp32"))  # 16-bit only: what models decode in
    assert len({s.tag for s in src.VARIANTS if s.kernel == "rms_norm"}) == len(
        [s for s in src.VARIANTS if s.kernel == "rms_norm"])


def test_fused_adds_take_the_middle_tile_for_a_few_hundred_rows():
    # 512 rows in add_rms_norm's 16-row tile at 2048 wide are 32 blocks on 132 SMs: 4 rows a block
    # give 128 (the sm_90 sweeps' best: 5.01 against 7.68 us on the H200). The tile whose block count
    # is nearer 128 wins (1024 rows: 64 blocks of 16 against 256 of 4, a tie on the H200); where the
    # prefill tile already has 4 rows, it; decode rows and float32 as before.
    def mid(kind, rows, hidden, dtype=torch.bfloat16, min_block=64):
        return norm_ops._mid_want(kind, torch.empty(0, hidden, dtype=dtype), rows, min_block)

    assert mid("add_rms_norm", 512, 2048) == (("BLOCK_N", 2048), ("ROWS", 4))
    assert mid("add_rms_norm", 800, 2048) == (("BLOCK_N", 2048), ("ROWS", 4))  # 200 blocks against 50
    assert mid("add_rms_norm", 850, 2048) is None  # 213 against 54
    assert mid("add_rms_norm", 1024, 2048) is None and mid("add_rms_norm", 2048, 2048) is None
    assert mid("add_rms_norm", 512, 3072, torch.float16) == (("BLOCK_N", 4096), ("ROWS", 4))  # 128 against 64 of 8
    assert mid("add_rms_norm", 1000, 3072) is None  # 250 against 125
    assert mid("add_rms_norm", DECODE_MAX_ROWS, 2048) is None  # a decode step's rows: one a block
    assert mid("add_rms_norm", 512, 2048, torch.float32) is None
    assert mid("add_rms_norm", 512, 8192) is None and mid("add_rms_norm", 512, 12288) is None
    assert mid("add_rms_norm", 512, 256) is None  # not a hidden width: no middle tile built
    assert mid("add_rms_norm_gemma", 512, 896, min_block=512) == (("BLOCK_N", 1024), ("ROWS", 4))
    assert mid("rms_norm_add_gemma", 700, 2048, torch.float16, 512) == (("BLOCK_N", 2048), ("ROWS", 4))


def test_every_middle_tile_asked_for_is_built():
    """Each request _mid_want can make finds an aligned 16-bit variant of its kind."""
    from cutile_kernels.kernel_src import norm as src

    built = {(s.kernel, s.tag) for s in src.VARIANTS}
    for kind in MID_KINDS:
        for dtype, d in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
            for bn in src.HIDDEN_BLOCK_NS:
                want = norm_ops._mid_want(kind, torch.empty(0, bn, dtype=dtype), DECODE_MAX_ROWS + 1, 512)
                if want is not None:
                    assert (kind, f"{d}.n{bn}.r4.aligned") in built, (kind, d, bn)
                else:
                    assert ROWS[(kind, "aligned")][bn] <= 4, (kind, bn)


def test_fake_implementations_give_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 3, 896, dtype=torch.float16, device="cpu")
        w = torch.empty(896, dtype=torch.float32)
        y = norm_ops._rms_norm.op(x, w, 1e-6)
        a, s = norm_ops._add_rms_norm.op(x, x, w, 1e-6)
    assert y.shape == (2, 3, 896) and y.dtype == torch.float32
    assert a.shape == s.shape == (2, 3, 896) and s.dtype == torch.float16


def test_compile_on_cpu_matches_eager():
    w = torch.randn(128)
    fn = torch.compile(lambda x: cutile_kernels.rms_norm(x * 2, w, 1e-6) + 1, backend="eager", fullgraph=True)
    x = torch.randn(4, 128)
    assert torch.allclose(fn(x), cutile_kernels.rms_norm_reference(x * 2, w, 1e-6) + 1)


# ---------------------------------------------------------------------------------------------
# GPU: every kernel against a float64 reference, output poisoned first
# ---------------------------------------------------------------------------------------------

#: (rows, hidden, dtype, layout): the hidden sizes of real models, one row, 100k rows, strided rows,
#: a misaligned base (generic variant), rows longer than one tile (chunked kernel).
GPU_CASES = (
    [(r, h, torch.bfloat16, "contiguous") for h in (896, 1536, 2048, 4096, 5120, 8192) for r in (1, 19, 4096)]
    + [(4096, h, d, "contiguous") for h in (896, 2048, 5120) for d in (torch.float16, torch.float32)]
    + [(100_000, 896, torch.bfloat16, "contiguous"), (100_000, 2048, torch.bfloat16, "contiguous")]
    + [(333, h, torch.bfloat16, "strided") for h in (1536, 4096)]
    + [(333, h, d, "misaligned") for h in (896, 2048) for d in (torch.bfloat16, torch.float32)]
    + [(7, h, d, lay) for h, d, lay in ((896, torch.bfloat16, "misaligned"), (2048, torch.float16, "misaligned"),
                                         (1536, torch.bfloat16, "strided"), (2048, torch.float32, "contiguous"))]
    + [(65, 1000, torch.float16, "contiguous"), (257, 100, torch.bfloat16, "contiguous")]
    + [(64, 128, torch.bfloat16, "contiguous"), (4096, 64, torch.float16, "contiguous")]
    + [(37, 12288, torch.bfloat16, "contiguous"), (5, 16384, torch.float32, "contiguous"),
       (9, 18432, torch.bfloat16, "strided")]
    # A prefill of a few hundred rows: the fused add's middle tile (and the row count past it).
    + [(512, 2048, torch.bfloat16, "contiguous"), (600, 3072, torch.float16, "contiguous"),
       (1000, 3072, torch.float16, "contiguous"), (2048, 2048, torch.bfloat16, "contiguous")]
)


def _case_id(c):
    r, h, d, lay = c
    return f"{r}x{h}-{str(d).split('.')[-1]}-{lay}"


def _make_input(rows, hidden, dtype, layout, scale=1.0, device="cuda"):
    if layout == "contiguous":
        return torch.randn(rows, hidden, device=device, dtype=dtype) * scale
    if layout == "strided":  # rows of a wider tensor: row stride 2 * hidden + 8
        return (torch.randn(rows, 2 * hidden + 8, device=device, dtype=dtype) * scale)[:, :hidden]
    if layout == "misaligned":  # base address one element past a 16-byte boundary
        flat = torch.randn(rows * hidden + 1, device=device, dtype=dtype) * scale
        return flat[1:].view(rows, hidden)
    raise ValueError(layout)


def _exact(x, w, eps):
    """RMSNorm in float64 without intermediate rounding: the higher-precision reference. (The
    transformers-order reference upcasts to float32 only, so it is no reference for float32.)"""
    xd = x.double()
    return w.double() * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps))


#: How far our largest elementwise error may exceed stock's (see the tests' comment).
MAX_ERROR_MARGIN = 1.5


def _errors(out, ref):
    diff = (out.double() - ref).abs()
    rel_l2 = (out.double() - ref).norm() / ref.norm()
    return diff.max().item(), rel_l2.item()


def _launched_variant(before: dict) -> registry.Variant:
    new = launched_variants(before)
    assert len(new) == 1, f"expected one variant launched, got {[v.symbol for v in new]}"
    return new[0]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_rms_norm_kernel_matches_float64(case, strict):
    rows, hidden, dtype, layout = case
    scale = 300.0 if dtype == torch.float16 else 1.0  # fp16 squares overflow unless accumulated in fp32
    x = _make_input(rows, hidden, dtype, layout, scale)
    w = (1 + 0.2 * torch.randn(hidden, device="cuda")).to(dtype)
    y = torch.full((rows, hidden), float("nan"), device="cuda", dtype=dtype)
    before = dispatch.stats()["launches"]
    assert norm_ops.rms_norm_into(x, w, y, 1e-6)
    variant = _launched_variant(before)
    torch.cuda.synchronize()
    assert not torch.isnan(y).any(), "an output element was not written"
    ref = _exact(x, w, 1e-6)
    stock = cutile_kernels.rms_norm_reference(x, w, 1e-6)  # what transformers computes in this dtype
    ours_max, ours_rel = _errors(y, ref)
    stock_max, stock_rel = _errors(stock, ref)
    assert ours_rel <= 1.1 * stock_rel + 1e-7, (ours_rel, stock_rel)
    # The max is one element's rounding (about an ulp of the largest outputs for both), so it gets a
    # wider margin than the L2 error over all elements (an fp16 run once hit 1.107x stock's max).
    assert ours_max <= MAX_ERROR_MARGIN * stock_max + 1e-6, (ours_max, stock_max)
    assert (variant.kernel, variant.tag) == _expected_variant("rms_norm", case)


def _expected_variant(kind, case):
    """(kernel, tag) a case must launch: aligned unless the base or the width is not; the chunked
    kernel past 8192; one row per block for a decode step's rows in 16 bits, else the prefill tile."""
    rows, hidden, dtype, layout = case
    layout = "aligned" if layout != "misaligned" and hidden % 16 == 0 else "generic"
    d = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    if hidden > 8192:
        return kind, f"{d}.chunk2048.r1.{layout}"
    bn = max(64, 1 << (hidden - 1).bit_length())
    decode = rows <= DECODE_MAX_ROWS and dtype != torch.float32
    tile = ROWS[(kind, layout)][bn]
    # The fused adds' middle tile: 4 rows a block where that block count is nearer one wave than the
    # prefill tile's (128 here; a GPU's SM count, 132 on the H100/H200: the cases are far from where they differ).
    if kind in MID_KINDS and not decode and dtype != torch.float32 and layout == "aligned" and bn >= 512 \
            and tile > 4 and abs(-(-rows // 4) - 128) < abs(-(-rows // tile) - 128):
        tile = 4
    return kind, f"{d}.n{bn}.r{1 if decode else tile}.{layout}"


@pytest.mark.parametrize("kind", ["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_variant_choice_of_each_gpu_case(kind, case, built_package_dir):
    # The registry's checks are tensor metadata only: run them on CPU tensors of each GPU case.
    rows, hidden, dtype, layout = case
    reg = registry.Registry(built_package_dir)
    arch = "sm_90" if "sm_90" in reg.archs else reg.archs[-1]
    x = _make_input(rows, hidden, dtype, layout, device="cpu")
    w, out = torch.empty(hidden, dtype=dtype), torch.empty(rows, hidden, dtype=dtype)
    args = (x, w, out, 1e-6) if kind == "rms_norm" else (x, torch.empty_like(out), w, out, torch.empty_like(out), 1e-6)
    mid = norm_ops._mid_want(kind, x, rows, 64) if kind == "add_rms_norm" else None
    variant, why = reg.select(kind, arch, dict(mid), args) if mid else (None, "")
    if variant is None:  # the op's quiet first try failed (a generic layout): the usual tile
        variant, why = reg.select(kind, arch, dict(norm_ops._want(x, rows)), args)
    assert variant is not None, why
    assert (variant.kernel, variant.tag) == _expected_variant(kind, case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c[0] <= 4096 or c[1] == 896], ids=_case_id)
def test_add_rms_norm_kernel_matches_float64(case, strict):
    rows, hidden, dtype, layout = case
    x = _make_input(rows, hidden, dtype, layout)
    r = _make_input(rows, hidden, dtype, "contiguous")
    w = (1 + 0.2 * torch.randn(hidden, device="cuda")).to(dtype)
    y = torch.full((rows, hidden), float("nan"), device="cuda", dtype=dtype)
    s = torch.full((rows, hidden), float("nan"), device="cuda", dtype=dtype)
    before = dispatch.stats()["launches"]
    assert norm_ops.add_rms_norm_into(x, r, w, y, s, 1e-6)
    variant = _launched_variant(before)
    assert (variant.kernel, variant.tag) == _expected_variant("add_rms_norm", case)
    torch.cuda.synchronize()
    assert not torch.isnan(y).any() and not torch.isnan(s).any(), "an output element was not written"
    assert torch.equal(s, x + r)  # one rounding of the sum, as the decoder layer's add
    ref = _exact(x + r, w, 1e-6)  # x + r rounded once, as the decoder layer's add
    stock = cutile_kernels.rms_norm_reference(x + r, w, 1e-6)
    ours_max, ours_rel = _errors(y, ref)
    stock_max, stock_rel = _errors(stock, ref)
    assert ours_rel <= 1.1 * stock_rel + 1e-7, (ours_rel, stock_rel)
    # The max is one element's rounding (about an ulp of the largest outputs for both), so it gets a
    # wider margin than the L2 error over all elements (an fp16 run once hit 1.107x stock's max).
    assert ours_max <= MAX_ERROR_MARGIN * stock_max + 1e-6, (ours_max, stock_max)


@pytest.mark.gpu
def test_public_api_on_3d_noncontiguous_and_empty(strict):
    x = torch.randn(2, 7, 2048, device="cuda", dtype=torch.bfloat16).transpose(0, 1)  # (7, 2, 2048) view
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    y = cutile_kernels.rms_norm(x, w, 1e-5)
    assert y.shape == x.shape and y.is_contiguous()
    ref = cutile_kernels.rms_norm_reference(x, w, 1e-5)
    assert (y.float() - ref.float()).abs().max().item() <= 2 * (ref.float().abs().max().item() * 2**-8)
    empty = torch.empty(0, 2048, device="cuda", dtype=torch.bfloat16)
    assert cutile_kernels.rms_norm(empty, w).shape == (0, 2048)


@pytest.mark.gpu
def test_unsupported_inputs_fall_back_and_say_so(caplog):
    w = torch.randn(256, device="cuda", dtype=torch.float64)
    x = torch.randn(8, 256, device="cuda", dtype=torch.float64)
    with caplog.at_level("WARNING", logger="cutile_kernels"):
        y = cutile_kernels.rms_norm(x, w)
    assert torch.equal(y, cutile_kernels.rms_norm_reference(x, w, 1e-6))
    assert "falls back to PyTorch" in caplog.text and "float64" in caplog.text
    # Aliasing operands: the kernels declare no aliasing, so this must not reach a kernel.
    buf = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    a, b = buf[:256].view(1, 256), buf[:256].view(1, 256)
    ya, sa = cutile_kernels.add_rms_norm(a, b, buf[256:], 1e-6)
    ra, rs = cutile_kernels.add_rms_norm_reference(a, b, buf[256:], 1e-6)
    assert torch.equal(ya, ra) and torch.equal(sa, rs)
    assert any("overlap" in k for k in dispatch.stats()["fallbacks"])


@pytest.mark.gpu
def test_gradients_on_the_kernel_path(strict):
    x = torch.randn(33, 2048, device="cuda", dtype=torch.float32, requires_grad=True)
    w = torch.randn(2048, device="cuda", dtype=torch.float32, requires_grad=True)
    before = sum(dispatch.stats()["launches"].values())
    y = cutile_kernels.rms_norm(x, w, 1e-6)
    assert sum(dispatch.stats()["launches"].values()) == before + 1  # the forward ran our kernel
    g = torch.randn_like(y)
    y.backward(g)
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    cutile_kernels.rms_norm_reference(x, w, 1e-6).backward(g)
    assert torch.allclose(gx, x.grad, rtol=1e-5, atol=1e-5) and torch.allclose(gw, w.grad, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [16, 32, 48])
def test_tiny_hidden_sizes_run_the_kernel(hidden, strict):
    x = torch.randn(9, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    y = cutile_kernels.rms_norm(x, w, 1e-6)
    ref, stock = _exact(x, w, 1e-6), cutile_kernels.rms_norm_reference(x, w, 1e-6)
    assert _errors(y, ref)[1] <= 1.1 * _errors(stock, ref)[1] + 1e-7


@pytest.mark.gpu
def test_strict_mode_raises_instead_of_falling_back(strict):
    x = torch.randn(4, 64, device="cuda", dtype=torch.float64)
    with pytest.raises(cutile_kernels.FallbackError):
        cutile_kernels.rms_norm(x, torch.ones(64, device="cuda", dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [64, 512])  # 512: add_rms_norm's middle tile (its quiet first try) in the graph
def test_cuda_graph_replay_matches_eager(rows, strict):
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    before = dict(dispatch.stats()["launches"])
    with torch.cuda.stream(stream):  # warm-up: load the modules outside the capture
        cutile_kernels.rms_norm(x, w)
        cutile_kernels.add_rms_norm(x, r, w)
    torch.cuda.current_stream().wait_stream(stream)
    fused = [v.tag for v in launched_variants(before) if v.kernel == "add_rms_norm"]
    assert fused == ["bf16.n2048.r4.aligned" if rows == 512 else "bf16.n2048.r1.aligned"]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = cutile_kernels.rms_norm(x, w)
        y2, s2 = cutile_kernels.add_rms_norm(x, r, w)
    x.copy_(torch.randn_like(x))
    r.copy_(torch.randn_like(r))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, cutile_kernels.rms_norm(x, w))
    e2, es = cutile_kernels.add_rms_norm(x, r, w)
    assert torch.equal(y2, e2) and torch.equal(s2, es)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [17, 512])  # 512: the fused add's middle tile
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_torch_compile_matches_eager(mode, rows, strict):
    w = torch.randn(1536, device="cuda", dtype=torch.bfloat16)

    def fn(x, r):
        y, s = cutile_kernels.add_rms_norm(x * 2, r, w, 1e-6)
        return cutile_kernels.rms_norm(y + 1, w, 1e-6), s

    compiled = torch.compile(fn, mode=mode, fullgraph=True)
    for _ in range(3):
        x = torch.randn(rows, 1536, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        got, want = compiled(x, r), fn(x, r)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
