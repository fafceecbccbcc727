"""SiLU and SiLU-and-mul: reference semantics against transformers (CPU), custom ops and variant
selection (CPU), AOT compile of the variants (CPU), kernels against float64 (GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cutile_kernels
from cutile_kernels import dispatch, registry
from cutile_kernels.kernel_src import activation as kact
from cutile_kernels.ops import activation as act_ops
from launches import launched_variants

DTYPES = [torch.bfloat16, torch.float16, torch.float32]

#: How far ours may be from stock, relative: two units in the last place of the 16-bit dtypes (a
#: silu one ulp off, where exp's last float32 bit decides a rounding, moves the rounded product by
#: up to two), a few float32 ulps (exp's own error on either side).
ULP = {torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9, torch.float32: 2.0 ** -20}

#: Intermediate sizes: Qwen3-0.6B, Llama-3.2-1B, Qwen2.5-1.5B, Mistral-7B-v0.3.
WIDTHS = (3072, 8192, 8960, 14336)


# ---------------------------------------------------------------------------------------------
# CPU: the reference path is transformers' own MLP arithmetic, bit for bit
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
def test_reference_is_llama_mlp_activation(dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=48)).to(dtype)
    x = torch.randn(3, 5, 32, dtype=dtype) * 2
    g, u = mlp.gate_proj(x), mlp.up_proj(x)
    want = mlp.act_fn(g) * u  # the expression inside LlamaMLP.forward
    for got in (cutile_kernels.silu_and_mul_reference(g, u), cutile_kernels.silu_and_mul(g, u),
                cutile_kernels.silu_and_mul_fused(torch.cat([g, u], -1))):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(cutile_kernels.silu(g), mlp.act_fn(g))
    assert torch.equal(mlp.down_proj(cutile_kernels.silu_and_mul(g, u)), mlp(x))


def test_reference_rounds_silu_before_the_product():
    # In bf16 the stock order (silu rounded, then the product rounded) differs from one rounding at
    # the end on some inputs: the reference must keep the stock order.
    g = torch.randn(4096, dtype=torch.float32) * 4
    u = torch.randn(4096, dtype=torch.float32) * 4
    gb, ub = g.bfloat16(), u.bfloat16()
    stock = F.silu(gb) * ub
    once = (F.silu(gb.float()) * ub.float()).bfloat16()
    assert not torch.equal(stock, once)  # the two orders are distinguishable here
    assert torch.equal(cutile_kernels.silu_and_mul_reference(gb, ub), stock)


def test_mixed_dtypes_promote_like_torch():
    g, u = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.float32)
    got = cutile_kernels.silu_and_mul(g, u)
    assert got.dtype == torch.float32 and torch.equal(got, F.silu(g) * u)


def test_shape_errors():
    with pytest.raises(ValueError, match="gate shape"):
        cutile_kernels.silu_and_mul(torch.randn(4, 8), torch.randn(4, 9))
    with pytest.raises(ValueError, match="not even"):
        cutile_kernels.silu_and_mul_fused(torch.randn(4, 7))


def test_strided_and_empty_inputs_on_cpu():
    x = torch.randn(6, 2, 40).transpose(0, 1)  # non-contiguous (2, 6, 40)
    out = cutile_kernels.silu_and_mul_fused(x)
    assert out.shape == (2, 6, 20) and out.is_contiguous()
    assert torch.equal(out, F.silu(x[..., :20].contiguous()) * x[..., 20:])
    assert cutile_kernels.silu_and_mul(torch.empty(0, 5), torch.empty(0, 5)).shape == (0, 5)
    assert cutile_kernels.silu(torch.tensor(1.5)).shape == ()


@pytest.mark.parametrize("op,args", [
    ("silu_and_mul", lambda: (torch.randn(6, 5, 24), torch.randn(6, 5, 24))),
    ("silu_and_mul_fused", lambda: (torch.randn(6, 5, 48),)),
    ("silu", lambda: (torch.randn(6, 5, 24).transpose(0, 1),)),
])
def test_custom_ops_pass_opcheck(op, args):
    fn = getattr(act_ops, f"_{op}").op
    a = tuple(t.requires_grad_() for t in args())
    torch.library.opcheck(fn, a, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_gradients_follow_the_reference_formula():
    g = torch.randn(5, 7, 32, dtype=torch.float64, requires_grad=True)
    u = torch.randn(5, 7, 32, dtype=torch.float64, requires_grad=True)
    x = torch.randn(5, 64, dtype=torch.float64, requires_grad=True)
    y = cutile_kernels.silu_and_mul(g, u)
    z = cutile_kernels.silu_and_mul_fused(x)
    s = cutile_kernels.silu(g)
    assert all("silu" in t.grad_fn.name() for t in (y, z, s))
    (y.square().sum() + z.sum() + s.sum()).backward()
    got = [t.grad.clone() for t in (g, u, x)]
    for t in (g, u, x):
        t.grad = None
    (act_ops.silu_and_mul_reference(g, u).square().sum() + act_ops.silu_and_mul_fused_reference(x).sum()
     + F.silu(g).sum()).backward()
    for a, b in zip(got, (g.grad, u.grad, x.grad)):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_fake_implementations_give_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        g = torch.empty(2, 3, 896, dtype=torch.float16)
        y = act_ops._silu_and_mul.op(g, g.float())
        z = act_ops._silu_and_mul_fused.op(torch.empty(7, 2 * 8960, dtype=torch.bfloat16))
        s = act_ops._silu.op(g)
    assert y.shape == (2, 3, 896) and y.dtype == torch.float32
    assert z.shape == (7, 8960) and z.dtype == torch.bfloat16
    assert s.shape == (2, 3, 896) and s.dtype == torch.float16


def test_compile_on_cpu_matches_eager():
    fn = torch.compile(lambda x: cutile_kernels.silu_and_mul_fused(x * 2) + cutile_kernels.silu(x[:, :8]),
                       backend="eager", fullgraph=True)
    x = torch.randn(4, 16)
    assert torch.equal(fn(x), act_ops.silu_and_mul_fused_reference(x * 2) + F.silu(x[:, :8]))


# ---------------------------------------------------------------------------------------------
# CPU: which kernel and which variant a call asks for
# ---------------------------------------------------------------------------------------------

def test_halves_of_a_fused_tensor_are_recognised():
    x = torch.randn(5, 2 * 24)
    v = act_ops.fused_view(x[:, :24], x[:, 24:])
    assert v is not None and v.shape == (5, 2, 24) and v.stride() == (48, 24, 1)
    assert torch.equal(v[:, 0], x[:, :24]) and torch.equal(v[:, 1], x[:, 24:])
    # Rows of a wider tensor, and halves that are not adjacent: still one strided array.
    w = torch.randn(5, 100)
    v = act_ops.fused_view(w[:, 10:30], w[:, 60:80])
    assert v.stride() == (100, 50, 1) and torch.equal(v[:, 1], w[:, 60:80])
    # Not one tensor, reversed order, different strides or dtypes: no fused view.
    assert act_ops.fused_view(torch.randn(5, 24), torch.randn(5, 24)) is None
    assert act_ops.fused_view(x[:, 24:], x[:, :24]) is None
    assert act_ops.fused_view(x[:4, :24], x[:, 24:]) is None
    assert act_ops.fused_view(x[:, :24], x[:, 24:].double()) is None


def test_tile_config_by_rows():
    # One config at every row count (it won at decode and prefill on the H200).
    assert act_ops._want(1) == act_ops._want(16) == act_ops._want(2048) == (("ROWS", 1), ("BLOCK", 512))
    grid = act_ops._grid(2049, 8960)({"ROWS": 1, "BLOCK": 512})
    assert grid == (2049, 18, 1)  # one block per row, ceil(8960/512) column blocks: every element
    grid = act_ops._grid(2049, 8960)({"ROWS": 4, "BLOCK": 1024})
    assert grid == (513, 9, 1)  # the grid follows whatever tile it is asked for


def test_variant_matrix():
    specs = [s for s in kact.VARIANTS if not s.constants.get("PDL")]
    # 5 kernels (GeGLU since 2026-12-01, the sigmoid output gate since 2026-12-02), 3 dtypes, 2 layouts
    assert len(specs) == 5 * 3 * 2 * len(kact.TILES) == 30
    # silu_and_mul_fused's 16-bit aligned tiles again with programmatic dependent launch, after the rest
    twins = kact.VARIANTS[len(specs):]
    assert [(s.kernel, s.tag, s.constants["PDL"]) for s in twins] == [
        ("silu_and_mul_fused", f"{d}.r1.b512.aligned.pdl", 1) for d in ("bf16", "fp16")]
    for kernel in kact.KERNELS:
        mine = [s for s in specs if s.kernel == kernel]
        for d in ("bf16", "fp16", "fp32"):
            layouts = [s.tag.rsplit(".", 1)[1] for s in mine if s.tag.startswith(d + ".")]
            assert layouts == sorted(layouts) and layouts.count("aligned") == layouts.count("generic")
        for s in mine:
            # Every config the runtime may ask for exists in both layouts.
            consts = {k: v for k, v in s.constants.items() if k != "PDL"}
            assert consts in [dict(act_ops._want(1)), dict(act_ops._want(4096))]
    fused = next(s for s in specs if s.kernel == "silu_and_mul_fused" and s.tag.endswith("aligned"))
    x = fused.params[0]
    assert x.ndim == 3 and x.stride_one == (2,) and x.shape_divisible_by == (1, 1, 16)


def test_aligned_fused_variant_takes_a_gemm_output_halves():
    # The registry's checks, on CPU tensors shaped like a fused GEMM output of each family.
    from cutile_kernels.registry import TORCH_DTYPES, ArrayCheck

    spec = next(s for s in kact.VARIANTS if s.kernel == "silu_and_mul_fused" and s.tag == "bf16.r1.b512.aligned")
    p = spec.params[0]
    check = ArrayCheck(0, p.name, TORCH_DTYPES[p.dtype], p.ndim, p.stride_one, p.stride_divisible_by,
                       p.shape_divisible_by, 16, 32, 1024)
    for n in WIDTHS:
        gu = torch.empty(7, 2 * n, dtype=torch.bfloat16)
        assert check.violation(act_ops.fused_view(gu[:, :n], gu[:, n:])) is None
    gu = torch.empty(7, 200, dtype=torch.bfloat16)
    assert "not divisible" in check.violation(act_ops.fused_view(gu[:, :100], gu[:, 100:]))


# ---------------------------------------------------------------------------------------------
# CPU: the kernels' tile logic, run by the NumPy interpreter of tests/cutile_numpy.py
# ---------------------------------------------------------------------------------------------

def _emulate(kernel: str, args: tuple, rows: int, n: int, config: str):
    from cutile_numpy import emulate

    function = kact.KERNELS[kernel][0]
    r, b = kact.TILES[config]
    emulate(getattr(kact, function), kact)(act_ops._grid(rows, n)({"ROWS": r, "BLOCK": b}), args + (r, b))


@pytest.mark.parametrize("config", sorted(kact.TILES))
@pytest.mark.parametrize("rows,n", [(1, 100), (5, 1000), (19, 1536), (3, 8960)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_kernel_tiles_cover_every_element_and_nothing_else(rows, n, dtype, config):
    gu = (torch.randn(rows, 2 * n) * 3).to(dtype)
    gate, up = gu[:, :n], gu[:, n:]
    # float32: torch's own formula; float16: silu rounded to fp16 before the product, as stock.
    stock = F.silu(gate) * up
    for kernel in ("silu_and_mul", "silu_and_mul_fused", "silu"):
        buf = torch.full((rows + 2, n + 40), 7.0, dtype=dtype)  # the output is a window of it
        out = buf[1:rows + 1, 8:n + 8]
        if kernel == "silu_and_mul":
            _emulate(kernel, (gate.contiguous(), up.contiguous(), out), rows, n, config)
        elif kernel == "silu_and_mul_fused":
            _emulate(kernel, (gu.unflatten(-1, (2, n)), out), rows, n, config)
        else:
            _emulate(kernel, (gate, out), rows, n, config)
        want = F.silu(gate) if kernel == "silu" else stock
        tol = ULP[dtype]
        assert ((out.float() - want.float()).abs() <= tol * want.float().abs() + 1e-30).all(), kernel
        if dtype == torch.float16 and kernel != "silu":
            assert (out != want).float().mean().item() <= 0.01, kernel  # NumPy's exp is not torch's
        outside = torch.ones_like(buf, dtype=torch.bool)
        outside[1:rows + 1, 8:n + 8] = False
        assert (buf[outside] == 7.0).all(), f"{kernel} wrote outside its output"


def test_fp16_kernel_logic_keeps_the_stock_rounding_order():
    # silu rounded to fp16 and then multiplied is what stock computes; one rounding at the end is
    # not, and the emulated kernel must side with stock on inputs where the two differ.
    g = (torch.randn(4, 512) * 3).half()
    u = (torch.randn(4, 512) * 3).half()
    stock = F.silu(g) * u
    once = (F.silu(g.float()) * u.float()).half()
    differ = stock != once
    assert differ.any()
    out = torch.empty_like(g)
    _emulate("silu_and_mul", (g, u, out), 4, 512, "row")
    assert (out[differ] == stock[differ]).float().mean().item() >= 0.95


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_every_variant_compiles_ahead_of_time(arch):
    from cutile_kernels_build import aot

    for spec in kact.VARIANTS:
        if arch == "sm_80" and not spec.tag.startswith("bf16."):
            continue  # one dtype is enough to show another arch takes the same code
        data, _ = aot.compile_variant(spec, arch)
        assert data[:4] == b"\x7fELF", spec.tag


def test_aligned_variants_vectorise_both_halves():
    # The aligned fused variant must load gate and up with 16-byte vector loads (what its declared
    # strides buy); the generic one may not. Read from the PTX that cuTile embeds in the cubin.
    from cutile_kernels_build import aot

    counts = {}
    for layout in ("aligned", "generic"):
        spec = next(s for s in kact.VARIANTS if s.kernel == "silu_and_mul_fused" and s.tag == f"bf16.r1.b512.{layout}")
        ptx = aot.compile_variant(spec, "sm_90")[0].decode("latin1")
        # A 1x512 tile stores 4 bf16 (8 bytes) per thread: st.global.v2.b32.
        counts[layout] = ptx.count("ld.global.v4"), ptx.count("st.global.v2") + ptx.count("st.global.v4")
    assert counts["aligned"][0] >= 2 and counts["aligned"][1] >= 1, counts
    assert counts["generic"] == (0, 0), counts


# ---------------------------------------------------------------------------------------------
# GPU: every kernel against a float64 reference, output poisoned first
# ---------------------------------------------------------------------------------------------

#: (rows, width, dtype, layout). Layouts: "separate" (two contiguous tensors), "halves" (the two
#: halves of one (M, 2N) GEMM output), "fused" (silu_and_mul_fused on (M, 2N)), "wide" (rows of
#: wider tensors), "misaligned" (base one element past 16 bytes), "transposed" (column-major).
GPU_CASES = (
    [(r, n, torch.bfloat16, "halves") for n in WIDTHS for r in (1, 3, 16, 17, 2048)]
    + [(r, n, torch.bfloat16, "separate") for n in (3072, 8192) for r in (1, 19, 2048)]
    + [(333, n, d, "fused") for n in (3072, 8960) for d in DTYPES]
    + [(257, n, d, "halves") for n in (8192, 14336) for d in (torch.float16, torch.float32)]
    + [(7, 100, torch.bfloat16, "halves"), (65, 100, torch.float16, "separate"), (1, 1, torch.float32, "separate")]
    + [(129, 3072, torch.bfloat16, "wide"), (33, 8960, torch.float16, "misaligned"),
       (41, 8192, torch.bfloat16, "transposed"), (100_000, 1536, torch.bfloat16, "halves")]
)


def _case_id(c):
    r, n, d, lay = c
    return f"{r}x{n}-{str(d).split('.')[-1]}-{lay}"


def _inputs(rows, n, dtype, layout, device="cuda"):
    """(gate, up) of the case, or (x, None) for "fused". Gate values reach +-100 in fp16 so that a
    kernel computing exp in fp16 would overflow; up is kept small enough that products stay finite."""
    gscale = 30.0 if dtype == torch.float16 else 3.0

    def rnd(*shape):
        return torch.randn(*shape, device=device, dtype=torch.float32)

    if layout == "fused":
        x = rnd(rows, 2 * n)
        x[:, :n] *= gscale
        return x.to(dtype), None
    if layout == "halves":
        gu = torch.cat([rnd(rows, n) * gscale, rnd(rows, n)], 1).to(dtype)
        return gu[:, :n], gu[:, n:]
    if layout == "separate":
        return (rnd(rows, n) * gscale).to(dtype), rnd(rows, n).to(dtype)
    if layout == "wide":
        a, b = (rnd(rows, 3 * n + 8) * gscale).to(dtype), rnd(rows, n + 24).to(dtype)
        return a[:, 8:n + 8], b[:, :n]
    if layout == "misaligned":
        return _misaligned_copy((rnd(rows, n) * gscale).to(dtype)), _misaligned_copy(rnd(rows, n).to(dtype))
    if layout == "transposed":
        return (rnd(n, rows) * gscale).to(dtype).t(), rnd(n, rows).to(dtype).t()
    raise ValueError(layout)


def _misaligned_copy(t):
    # t's values at a base address one element past a 16-byte boundary
    flat = torch.empty(t.numel() + 1, device=t.device, dtype=t.dtype)
    out = flat[1:].view(t.shape)
    out.copy_(t)
    return out


def _expected_variant(rows, n, layout):
    """(kernel, layout tag) that a GPU case must launch."""
    kernel = "silu_and_mul_fused" if layout in ("fused", "halves") else "silu_and_mul"
    aligned = layout in ("fused", "halves", "separate", "wide") and n % 16 == 0
    return kernel, "aligned" if aligned else "generic"


@pytest.mark.parametrize("case", [c for c in GPU_CASES if c[0] <= 4096], ids=_case_id)
def test_variant_choice_of_each_gpu_case(case, built_package_dir):
    # The registry's checks are tensor metadata only: run them on CPU tensors of each GPU case.
    rows, n, dtype, layout = case
    reg = registry.Registry(built_package_dir)
    arch = reg.archs[-1]
    a, b = _inputs(rows, n, dtype, layout, device="cpu")
    out = torch.empty(rows, n, dtype=dtype)
    x = a.unflatten(-1, (2, n)) if layout == "fused" else act_ops.fused_view(a, b)
    kernel, args = ("silu_and_mul_fused", (x, out)) if x is not None else ("silu_and_mul", (a, b, out))
    variant, why = reg.select(kernel, arch, dict(act_ops._want(rows)), args)
    assert variant is not None, why
    assert (variant.kernel, variant.tag.rsplit(".", 1)[1]) == _expected_variant(rows, n, layout)


def _errors(out, ref):
    diff = (out.double() - ref).abs()
    return diff.max().item(), ((out.double() - ref).norm() / ref.norm()).item()



def _assert_close_to_stock(ours, stock, ref):
    """Ours is no further from float64 than stock transformers is, and agrees with stock to
    :data:`ULP` everywhere (bit-equal on all but a few elements in 16-bit dtypes)."""
    assert not torch.isnan(ours).any(), "an output element was not written"
    o_max, o_rel = _errors(ours, ref)
    s_max, s_rel = _errors(stock, ref)
    assert o_rel <= 1.1 * s_rel + 1e-7, (o_rel, s_rel)
    assert o_max <= 1.1 * s_max + 1e-6, (o_max, s_max)
    diff = (ours.float() - stock.float()).abs()
    assert (diff <= ULP[ours.dtype] * stock.float().abs() + 1e-30).all(), diff.max()
    if ours.dtype != torch.float32:
        assert (ours != stock).sum().item() <= max(1e-3 * ours.numel(), 10)



@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_silu_and_mul_kernel_matches_float64(case, strict):
    rows, n, dtype, layout = case
    a, b = _inputs(rows, n, dtype, layout)
    before = dispatch.stats()["launches"]
    if layout == "fused":
        out = torch.full((rows, n), float("nan"), device="cuda", dtype=dtype)
        assert act_ops.silu_and_mul_fused_into(a.unflatten(-1, (2, n)), out)
        gate, up = a[:, :n], a[:, n:]
    else:
        out = torch.full((rows, n), float("nan"), device="cuda", dtype=dtype)
        assert act_ops.silu_and_mul_into(a, b, out)
        gate, up = a, b
    torch.cuda.synchronize()
    (variant,) = launched_variants(before)
    ref = F.silu(gate.double()) * up.double()  # no intermediate rounding
    _assert_close_to_stock(out, F.silu(gate) * up, ref)
    assert (variant.kernel, variant.tag.rsplit(".", 1)[1]) == _expected_variant(rows, n, layout)
    assert (variant.constants["ROWS"], variant.constants["BLOCK"]) == kact.TILES["row"]


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c[3] != "fused" and c[0] <= 2048], ids=_case_id)
def test_silu_kernel_matches_float64(case, strict):
    rows, n, dtype, layout = case
    x, _ = _inputs(rows, n, dtype, layout)
    out = torch.full((rows, n), float("nan"), device="cuda", dtype=dtype)
    assert act_ops.silu_into(x, out)
    torch.cuda.synchronize()
    _assert_close_to_stock(out, F.silu(x), F.silu(x.double()))


@pytest.mark.gpu
def test_no_write_outside_the_output(strict):
    # The output is a window of a poisoned buffer: the kernel must fill the window and nothing else.
    rows, n = 19, 8960
    gu = torch.randn(rows, 2 * n, device="cuda", dtype=torch.bfloat16)
    buf = torch.full((rows + 2, n + 64), 7.0, device="cuda", dtype=torch.bfloat16)
    out = buf[1:rows + 1, 32:n + 32]
    assert act_ops.silu_and_mul_fused_into(gu.unflatten(-1, (2, n)), out)
    torch.cuda.synchronize()
    gate, up = gu[:, :n], gu[:, n:]
    _assert_close_to_stock(out, F.silu(gate) * up, F.silu(gate.double()) * up.double())
    mask = torch.ones_like(buf, dtype=torch.bool)
    mask[1:rows + 1, 32:n + 32] = False
    assert (buf[mask] == 7.0).all()


@pytest.mark.gpu
def test_public_api_on_3d_and_empty(strict):
    x = torch.randn(2, 7, 2 * 3072, device="cuda", dtype=torch.bfloat16).transpose(0, 1)  # (7, 2, 6144) view
    y = cutile_kernels.silu_and_mul_fused(x)
    assert y.shape == (7, 2, 3072) and y.is_contiguous()
    ref = cutile_kernels.silu_and_mul_fused_reference(x)
    assert (y.float() - ref.float()).abs().max().item() <= 2 ** -7 * ref.float().abs().max().item()
    g, u = x[..., :3072], x[..., 3072:]
    assert torch.equal(cutile_kernels.silu_and_mul(g, u), y)
    empty = torch.empty(0, 2 * 3072, device="cuda", dtype=torch.bfloat16)
    assert cutile_kernels.silu_and_mul_fused(empty).shape == (0, 3072)
    assert cutile_kernels.silu(torch.randn(3, 5, 7, device="cuda")).shape == (3, 5, 7)


@pytest.mark.gpu
def test_unsupported_inputs_fall_back_and_say_so(caplog):
    g = torch.randn(8, 256, device="cuda", dtype=torch.float64)
    with caplog.at_level("WARNING", logger="cutile_kernels"):
        y = cutile_kernels.silu_and_mul(g, g * 2)
    assert torch.equal(y, F.silu(g) * (g * 2))
    assert "falls back to PyTorch" in caplog.text
    # Overlapping inputs (up starts inside gate's rows, stride 1): never reach a kernel.
    buf = torch.randn(1, 300, device="cuda", dtype=torch.bfloat16)
    a, b = buf[:, :256], buf[:, 10:266]
    assert torch.equal(cutile_kernels.silu_and_mul(a, b), F.silu(a) * b)
    mixed = cutile_kernels.silu_and_mul(g.bfloat16(), g.float())
    assert mixed.dtype == torch.float32 and torch.equal(mixed, F.silu(g.bfloat16()) * g.float())


@pytest.mark.gpu
def test_strict_mode_raises_instead_of_falling_back(strict):
    g = torch.randn(4, 64, device="cuda", dtype=torch.float64)
    with pytest.raises(cutile_kernels.FallbackError):
        cutile_kernels.silu_and_mul(g, g)


@pytest.mark.gpu
def test_gradients_on_the_kernel_path(strict):
    gu = torch.randn(33, 2 * 3072, device="cuda", dtype=torch.float32, requires_grad=True)
    before = sum(dispatch.stats()["launches"].values())
    y = cutile_kernels.silu_and_mul_fused(gu)
    assert sum(dispatch.stats()["launches"].values()) == before + 1
    g = torch.randn_like(y)
    y.backward(g)
    got = gu.grad.clone()
    gu.grad = None
    cutile_kernels.silu_and_mul_fused_reference(gu).backward(g)
    assert torch.allclose(got, gu.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager(strict):
    gu = torch.randn(64, 2 * 8192, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: load the modules outside the capture
        cutile_kernels.silu_and_mul_fused(gu)
        cutile_kernels.silu(gu)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cutile_kernels.silu_and_mul(gu[:, :8192], gu[:, 8192:])
        s = cutile_kernels.silu(gu)
    gu.copy_(torch.randn_like(gu))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, cutile_kernels.silu_and_mul_fused(gu))
    assert torch.equal(s, cutile_kernels.silu(gu))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_torch_compile_matches_eager(mode, strict):
    w = torch.randn(2 * 3072, 1024, device="cuda", dtype=torch.bfloat16) * 0.03

    def fn(x):
        gu = torch.nn.functional.linear(x, w)
        return cutile_kernels.silu_and_mul(gu[..., :3072], gu[..., 3072:]) + cutile_kernels.silu(gu[..., :3072])

    compiled = torch.compile(fn, mode=mode, fullgraph=True)
    for _ in range(3):
        x = torch.randn(17, 1024, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(compiled(x), fn(x))


# ---------------------------------------------------------------------------------------------
# sigmoid_and_mul: gated attention's output gate (Qwen3.5)
# ---------------------------------------------------------------------------------------------

def _gated(b, s, h, d, dtype, device="cpu"):
    """The gate as Qwen3_5Attention.forward has it (the second half of each head of the q
    projection, a strided (B, S, H, D) view) and the attention output (B, S, H * D)."""
    g = torch.Generator().manual_seed(b * 100 + s + h + d)
    proj = (torch.randn(b, s, h, 2 * d, generator=g) * 4).to(device=device, dtype=dtype)
    out = torch.randn(b, s, h * d, generator=g).to(device=device, dtype=dtype)
    return proj[..., d:], out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sigmoid_and_mul_reference_is_the_stock_gate(dtype):
    gate, x = _gated(2, 5, 3, 16, dtype)
    stock = x * torch.sigmoid(gate.reshape(2, 5, -1))  # Qwen3_5Attention.forward's lines
    got = cutile_kernels.sigmoid_and_mul(gate, x.view(gate.shape)).view(2, 5, -1)
    assert got.dtype == stock.dtype and torch.equal(got, stock)
    with pytest.raises(ValueError, match="gate shape"):
        cutile_kernels.sigmoid_and_mul(gate, x)


@pytest.mark.parametrize("rows,n", [(1, 256), (7, 100), (33, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_sigmoid_and_mul_kernel_logic_matches_stock(rows, n, dtype):
    """The kernel on NumPy: every element of a poisoned output window written, nothing beside it;
    the gate read in place from a strided view; the sigmoid rounded before the product as stock."""
    wide = (torch.randn(rows, 2 * n) * 4).to(dtype)
    gate, x = wide[:, n:], torch.randn(rows, n).to(dtype)
    buf = torch.full((rows + 2, n + 40), float("nan"), dtype=dtype)
    out = buf[1:rows + 1, 8:n + 8]
    _emulate("sigmoid_and_mul", (gate, x, out), rows, n, "row")
    assert not out.isnan().any()
    assert buf[0].isnan().all() and buf[-1].isnan().all() and buf[:, :8].isnan().all() and buf[:, n + 8:].isnan().all()
    stock = x * torch.sigmoid(gate)
    diff = (out.float() - stock.float()).abs()
    assert (diff <= ULP[dtype] * stock.float().abs() + 1e-30).all()
    if dtype == torch.float16:
        assert (out == stock).float().mean() >= 0.99


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 8, 256), (16, 1, 8, 256), (1, 2048, 8, 256), (3, 5, 3, 100)],
                         ids=lambda c: "b{}-s{}-h{}-d{}".format(*c))
def test_sigmoid_and_mul_kernel_matches_stock(shape, dtype, strict):
    """Qwen3.5-0.8B's gate (8 heads of 256) at decode b1 / b16 and a 2048-token prefill, and an
    odd shape: as close to float64 as stock, and equal to stock but for a few last-bit flips."""
    gate, x = _gated(*shape, dtype, device="cuda")
    before = dispatch.stats()["launches"]
    got = cutile_kernels.sigmoid_and_mul(gate, x.view(gate.shape))
    (variant,) = launched_variants(before)
    assert variant.kernel == "sigmoid_and_mul"
    stock = (x * torch.sigmoid(gate.reshape(x.shape))).view(gate.shape)
    _assert_close_to_stock(got, stock, x.double().view(gate.shape) * torch.sigmoid(gate.double()))
    out = torch.full(gate.shape, float("nan"), device="cuda", dtype=dtype)  # poisoned: every element written
    assert dispatch.run("sigmoid_and_mul", act_ops._want(1), (gate, x.view(gate.shape), out), 2,
                        act_ops._grid(out.numel() // shape[-1], shape[-1]), act_ops._rows_layout)
    assert torch.equal(out, got)


@pytest.mark.gpu
def test_sigmoid_and_mul_in_a_cuda_graph_and_compiled(strict):
    gate, x = _gated(4, 1, 8, 256, torch.bfloat16, device="cuda")
    x = x.view(gate.shape)
    cutile_kernels.sigmoid_and_mul(gate, x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cutile_kernels.sigmoid_and_mul(gate, x)
    x.mul_(2)
    graph.replay()
    eager = cutile_kernels.sigmoid_and_mul(gate, x)
    assert torch.equal(captured, eager)
    compiled = torch.compile(cutile_kernels.sigmoid_and_mul, fullgraph=True)
    assert torch.equal(compiled(gate, x), eager)
