"""qk_norm_rope_gemma (Qwen3.5's zero-centered q/k norms + partial RoPE in one launch): the reference
against transformers' Qwen3.5 modules, the kernel's tile logic emulated on the CPU against float64
and stock (partial and full rotary, padded chunks, the edges), the op's contract; on the GPU the
kernel against the stock modules with poisoned outputs, the declared fallback, CUDA-graph replay and
compile, and the inventory Solution."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

import cutile_kernels
from cutile_kernels import dispatch
from cutile_kernels.kernel_src import qk_norm_rope as src
from launches import assert_solution_passes, launched_variants, replays_and_compiles

import cutile_numpy

ops = importlib.import_module("cutile_kernels.ops.qk_norm_rope")
pytest.importorskip("transformers")

from transformers.models.qwen3_5 import modeling_qwen3_5 as q35  # noqa: E402

INVENTORY = Path(__file__).resolve().parents[1] / "inventory"
NAME = "qk_norm_rope_gemma"
LOGGER = "cutile_kernels"
EPS = 1e-6


def _inputs(b, hq, hk, s, d, rot, dtype=torch.float32, cos_batch=None, device="cpu", scale=3.0):
    """q, k as transformers passes them (a (B, S, H, D) buffer seen transposed; q a chunk of the
    gated q projection, as Qwen3_5Attention.forward takes it), norm weights around 0 (the model
    multiplies by 1 + weight), and cos/sin of R = rot rotated elements for per-row positions."""
    g = torch.Generator().manual_seed(b * 1000 + s * 10 + d + rot)
    qg = torch.randn(b, s, hq, 2 * d, generator=g) * scale
    q = qg.to(device=device, dtype=dtype)[..., :d].transpose(1, 2)  # the query half of (query, gate)
    k = (torch.randn(b, s, hk, d, generator=g) * scale).to(device=device, dtype=dtype).transpose(1, 2)
    qw = (0.3 * torch.randn(d, generator=g)).to(device=device, dtype=dtype)
    kw = (0.3 * torch.randn(d, generator=g)).to(device=device, dtype=dtype)
    cb = b if cos_batch is None else cos_batch
    pos = (torch.arange(s)[None] + 5 * torch.arange(cb)[:, None]).double()
    inv_freq = 1.0 / (10_000_000 ** (torch.arange(0, rot, 2).double() / rot))
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return q, k, qw, kw, emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def _stock(q, k, qw, kw, eps, cos, sin):
    """transformers' Qwen3_5RMSNorm modules and partial-rotary apply_rotary_pos_emb, as
    Qwen3_5Attention.forward runs them (norms on the (B, S, H, D) views)."""
    d = q.shape[-1]
    qn, kn = q35.Qwen3_5RMSNorm(d, eps), q35.Qwen3_5RMSNorm(d, eps)
    qn.weight.data, kn.weight.data = qw, kw
    with torch.no_grad():
        return q35.apply_rotary_pos_emb(qn(q.transpose(1, 2)).transpose(1, 2), kn(k.transpose(1, 2)).transpose(1, 2),
                                        cos, sin)


def _exact_and_bound(x, w, eps, cos, sin, dtype):
    """The float64 result of the formula and a bound on a faithful evaluation's error in dtype: a
    few unit roundoffs of the terms (the normed value, each product and the sum rounded once). The
    pass-through part is the normed value alone."""
    x, w, cos, sin = (t.double() for t in (x, w, cos, sin))
    n = (1 + w) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    rot = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r, rest = n[..., :rot], n[..., rot:]
    half = rot // 2
    turned = torch.cat((-r[..., half:], r[..., :half]), dim=-1)
    u = torch.finfo(dtype).eps / 2
    exact = torch.cat((r * cos + turned * sin, rest), dim=-1)
    # float32's normed value carries ~5 roundings (mean, sqrt, division, two products, 1 + w).
    bound = torch.cat((8 * u * ((r * cos).abs() + (turned * sin).abs()), 8 * u * rest.abs()), dim=-1)
    return exact, bound + torch.finfo(dtype).tiny


def _emulate(q, k, qw, kw, eps, cos, sin):
    """Run qk_norm_rope_gemma_kernel on NumPy as the op launches it, outputs poisoned with NaN.
    float16 and float32 only (cutile_numpy does not emulate bfloat16 rounding)."""
    (b, hq, s, d), hk, rot = q.shape, k.shape[1], cos.shape[-1]
    q_out, k_out = ops._gemma_outputs(q, k, cos, sin)
    q_out.fill_(float("nan"))
    k_out.fill_(float("nan"))
    want = dict(ops._gemma_want(d, rot, s, q.dtype))
    block, chunks = want["BLOCK"], want["CHUNKS"]
    rows = want.get("ROWS", src.GEMMA_ROWS[(block, chunks)])
    laid = ops._gemma_layout((q, k, qw, kw, cos, sin, q_out, k_out, eps, 1.0))
    grid = (-(-s // rows), -(-hq // src.HEADS) + -(-hk // src.HEADS), b)
    run = cutile_numpy.emulate(src.qk_norm_rope_gemma_kernel, src)
    run(grid, (*laid[:8], cutile_numpy.float32(eps), cutile_numpy.float32(1.0), block, chunks, rows, src.HEADS))
    assert not q_out.isnan().any() and not k_out.isnan().any(), "an output element was not written"
    return q_out, k_out


# ---------------------------------------------------------------------------------------------
# CPU: the reference is transformers'
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(2, 8, 2, 7, 256, 64), (1, 4, 1, 1, 256, 256), (3, 6, 2, 5, 128, 64),
                                   (1, 2, 2, 9, 96, 48)])
def test_reference_matches_transformers_bitwise(shape, dtype):
    b, hq, hk, s, d, rot = shape
    q, k, qw, kw, cos, sin = _inputs(b, hq, hk, s, d, rot, dtype)
    got = ops.qk_norm_rope_gemma_reference(q, k, qw, kw, EPS, cos, sin, 1.0)
    want = _stock(q, k, qw, kw, EPS, cos, sin)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)
    ours = cutile_kernels.qk_norm_rope_gemma(q, k, qw, kw, EPS, cos, sin)  # CPU: the reference, stock's layout
    assert all(torch.equal(g, w) and g.stride() == w.stride() for g, w in zip(ours, want))


# ---------------------------------------------------------------------------------------------
# CPU: the kernel's tile logic (tests/cutile_numpy.py) against float64 and stock
# ---------------------------------------------------------------------------------------------

#: (B, Hq, Hk, S, D, R, cos batch): Qwen3.5-0.8B's full-attention layers (8 / 2 heads of 256, R 64)
#: at decode b1 and b16 and a short prefill; then the edges: one KV head, head counts no multiple of
#: HEADS, S not a multiple of ROWS, R = D / 2, full rotary (Gemma 3's 256 and 128), D = 96 with R 48
#: (chunks of 24 padded to 32, four of them), cos/sin of batch 1 for a batch of 3.
EMULATED = [
    (1, 8, 2, 1, 256, 64, None), (16, 8, 2, 1, 256, 64, None), (1, 8, 2, 37, 256, 64, None),
    (2, 5, 1, 6, 256, 64, None), (3, 6, 3, 11, 128, 64, 1), (2, 4, 1, 5, 256, 256, None),
    (1, 3, 2, 9, 128, 128, None), (2, 4, 2, 7, 96, 48, None),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", EMULATED, ids=lambda c: "b{}-hq{}-hk{}-s{}-d{}-r{}-cb{}".format(*c))
def test_emulated_kernel_matches_float64_and_stock(case, dtype):
    b, hq, hk, s, d, rot, cb = case
    q, k, qw, kw, cos, sin = _inputs(b, hq, hk, s, d, rot, dtype, cos_batch=cb)
    got = _emulate(q, k, qw, kw, EPS, cos, sin)
    stock = _stock(q, k, qw, kw, EPS, cos, sin)
    for g, st, x, w in zip(got, stock, (q, k), (qw, kw)):
        assert g.shape == st.shape and g.dtype == st.dtype and g.stride() == st.stride()
        exact, bound = _exact_and_bound(x, w, EPS, cos, sin, dtype)
        assert ((g.double() - exact).abs() <= bound).all(), (g.double() - exact).abs().max().item()
        assert ((st.double() - exact).abs() <= bound).all()  # the bound holds for stock too
        if dtype != torch.float32:  # the same roundings as stock but for the norm factor's summation order
            assert torch.eq(g, st).float().mean() >= 0.97


def test_emulated_kernel_with_bfloat16_values():
    # cutile_numpy computes bfloat16 as float32: the tile logic on bfloat16 inputs, float32 roundings.
    q, k, qw, kw, cos, sin = (t.to(torch.bfloat16).float() for t in _inputs(2, 8, 2, 5, 256, 64))
    got = _emulate(q, k, qw, kw, EPS, cos, sin)
    for g, x, w in zip(got, (q, k), (qw, kw)):
        exact, bound = _exact_and_bound(x, w, EPS, cos, sin, torch.float32)
        assert ((g.double() - exact).abs() <= bound).all()


# ---------------------------------------------------------------------------------------------
# CPU: build matrix, tile choice, the op's contract
# ---------------------------------------------------------------------------------------------

def test_build_matrix():
    specs = [s for s in src.VARIANTS if s.kernel == NAME]
    tiles = len(src.GEMMA_TILES)
    assert len(specs) == (3 + 2) * 2 * tiles  # prefill tiles x 3 dtypes, decode tiles x 2, two layouts
    assert len({s.tag for s in specs}) == len(specs)
    for s in specs:
        assert [p.name for p in s.params] == ["q", "k", "q_weight", "k_weight", "cos", "sin", "q_out", "k_out", "eps",
                                              "offset", "BLOCK", "CHUNKS", "ROWS", "HEADS"]
        c = s.constants
        assert c["BLOCK"] * c["CHUNKS"] <= 256
        assert c["HEADS"] * c["ROWS"] * c["CHUNKS"] * c["BLOCK"] == 4096 or c["ROWS"] == 1
    assert (32, 8) in src.GEMMA_TILES and (128, 2) in src.GEMMA_TILES  # Qwen3.5, Gemma 3


def test_tile_choice():
    want = ops._gemma_want
    assert want(256, 64, 2048, torch.bfloat16) == (("BLOCK", 32), ("CHUNKS", 8))  # Qwen3.5 prefill
    assert want(256, 64, 1, torch.bfloat16) == (("BLOCK", 32), ("CHUNKS", 8), ("ROWS", 1))  # decode
    assert want(256, 64, 1, torch.float32) == (("BLOCK", 32), ("CHUNKS", 8))  # no float32 decode tile
    assert want(256, 256, 2048, torch.bfloat16) == (("BLOCK", 128), ("CHUNKS", 2))  # Gemma 3
    assert want(96, 48, 2048, torch.float16) == (("BLOCK", 32), ("CHUNKS", 4))
    assert ops._gemma_tile(128, 96) is None  # Phi-4-mini: 128 is no multiple of 48
    assert ops._gemma_tile(512, 512) is None  # wider than the tiles


def test_unsupported_inputs_say_why():
    q, k, qw, kw, cos, sin = _inputs(1, 4, 2, 3, 256, 64, torch.bfloat16)
    assert ops.gemma_unsupported(q, k, qw, kw, cos, sin) is None
    assert "dtypes" in ops.gemma_unsupported(q, k, qw.float(), kw, cos, sin)
    odd = _inputs(1, 2, 1, 2, 128, 96, torch.bfloat16)
    assert "head_dim 128 with 96 rotated" in ops.gemma_unsupported(*odd)


def test_shape_errors_and_contract_edges():
    q, k, qw, kw, cos, sin = _inputs(2, 4, 2, 3, 256, 64)
    with pytest.raises(ValueError, match="q_weight of shape"):
        cutile_kernels.qk_norm_rope_gemma(q, k, qw[:32], kw, EPS, cos, sin)
    with pytest.raises(TypeError):
        cutile_kernels.qk_norm_rope_gemma(q.int(), k, qw, kw, EPS, cos, sin)
    # offset 0: OLMo 2's float order (the reference with that offset)
    got = cutile_kernels.qk_norm_rope_gemma(q, k, qw, kw, EPS, cos, sin, offset=0.0)
    want = ops.qk_norm_rope_gemma_reference(q, k, qw, kw, EPS, cos, sin, 0.0)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    cutile_kernels.reset_stats()
    cutile_kernels.qk_norm_rope_gemma(q, k, qw, kw, EPS, cos, sin)
    assert cutile_kernels.stats()["reference_calls"] == {NAME: 1}


def test_fake_gives_the_stock_dtypes_and_layouts():
    q, k, qw, kw, cos, sin = _inputs(2, 4, 2, 3, 256, 64, torch.bfloat16)
    qo, ko = ops._gemma_fake(q, k, qw, kw, EPS, cos.float(), sin.float(), 1.0)
    want = _stock(q, k, qw, kw, EPS, cos.float(), sin.float())
    assert (qo.dtype, ko.dtype) == (want[0].dtype, want[1].dtype) == (torch.float32, torch.float32)
    assert qo.stride() == want[0].stride() and ko.stride() == want[1].stride()


def test_custom_op_passes_opcheck_and_compiles():
    q, k, qw, kw, cos, sin = _inputs(2, 4, 2, 5, 256, 64)
    torch.library.opcheck(ops._qk_norm_rope_gemma.op, (q, k, qw, kw, EPS, cos, sin, 1.0),
                          test_utils=("test_schema", "test_faketensor"))
    fn = torch.compile(lambda *a: cutile_kernels.qk_norm_rope_gemma(*a[:4], EPS, *a[4:]), backend="eager",
                       fullgraph=True)
    want = ops.qk_norm_rope_gemma_reference(q, k, qw, kw, EPS, cos, sin, 1.0)
    assert all(torch.equal(g, w) for g, w in zip(fn(q, k, qw, kw, cos, sin), want))


def test_gradients_follow_the_reference_formula():
    q, k, qw, kw, cos, sin = (t.detach().requires_grad_() for t in _inputs(1, 2, 1, 3, 64, 32))
    got = cutile_kernels.qk_norm_rope_gemma(q, k, qw, kw, EPS, cos, sin)
    (got[0].sum() + 2 * got[1].sum()).backward()
    grads = [t.grad.clone() for t in (q, k, qw, kw, cos, sin)]
    for t in (q, k, qw, kw, cos, sin):
        t.grad = None
    want = ops.qk_norm_rope_gemma_reference(q, k, qw, kw, EPS, cos, sin, 1.0)
    (want[0].sum() + 2 * want[1].sum()).backward()
    assert all(torch.allclose(g, t.grad) for g, t in zip(grads, (q, k, qw, kw, cos, sin)))


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

GPU_CASES = [(1, 8, 2, 1, 256, 64, None), (16, 8, 2, 1, 256, 64, None), (1, 8, 2, 2048, 256, 64, None),
             (2, 5, 1, 33, 256, 64, 1), (2, 4, 1, 5, 256, 256, None), (3, 6, 3, 17, 128, 64, None),
             (2, 4, 2, 7, 96, 48, None)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "b{}-hq{}-hk{}-s{}-d{}-r{}-cb{}".format(*c))
def test_kernel_matches_stock_modules(case, dtype, strict):
    """Within the float64 bound of every faithful evaluation, as stock is; for 16-bit dtypes most
    elements bitwise equal to stock (the float32 norm factor is summed in another order)."""
    b, hq, hk, s, d, rot, cb = case
    q, k, qw, kw, cos, sin = _inputs(b, hq, hk, s, d, rot, dtype, cos_batch=cb, device="cuda")
    want = _stock(q, k, qw, kw, EPS, cos, sin)
    q_out, k_out = ops._gemma_outputs(q, k, cos, sin)
    q_out.fill_(float("nan"))
    k_out.fill_(float("nan"))
    before = dispatch.stats()["launches"]
    assert ops.qk_norm_rope_gemma_into(q, k, qw, kw, EPS, cos, sin, 1.0, q_out, k_out)
    (variant,) = launched_variants(before)
    torch.cuda.synchronize()
    for g, w, x, wt in zip((q_out, k_out), want, (q, k), (qw, kw)):
        assert not g.isnan().any() and g.stride() == w.stride() and g.dtype == w.dtype
        exact, bound = _exact_and_bound(x.cpu(), wt.cpu(), EPS, cos.cpu(), sin.cpu(), dtype)
        assert ((g.double().cpu() - exact).abs() <= bound).all()
        share = torch.eq(g, w).float().mean().item()
        print(f"{case} {dtype}: bitwise equal to stock {share:.4%}")
        assert dtype == torch.float32 or share >= 0.97
    block, chunks = ops._gemma_tile(d, rot)
    assert (variant.constants["BLOCK"], variant.constants["CHUNKS"]) == (block, chunks)
    decode = s < src.GEMMA_ROWS[(block, chunks)] and dtype != torch.float32
    assert variant.constants["ROWS"] == (1 if decode else src.GEMMA_ROWS[(block, chunks)]), variant.tag


@pytest.mark.gpu
def test_unsupported_inputs_fall_back_and_say_so(caplog):
    q, k, qw, kw, cos, sin = _inputs(1, 4, 2, 3, 128, 96, torch.bfloat16, device="cuda")
    with caplog.at_level("WARNING", logger=LOGGER):
        got = cutile_kernels.qk_norm_rope_gemma(q, k, qw, kw, EPS, cos, sin)
    want = ops.qk_norm_rope_gemma_reference(q, k, qw, kw, EPS, cos, sin, 1.0)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert "qk_norm_rope_gemma falls back to PyTorch: head_dim 128 with 96 rotated" in caplog.text


@pytest.mark.gpu
def test_cuda_graph_replay_and_compile(strict):
    inputs = list(_inputs(4, 8, 2, 1, 256, 64, torch.bfloat16, device="cuda"))
    replays_and_compiles(lambda q, k, qw, kw, cos, sin: cutile_kernels.qk_norm_rope_gemma(q, k, qw, kw, EPS, cos, sin),
                         inputs)


@pytest.mark.gpu
def test_solution_passes_evaluate():
    assert_solution_passes(NAME, INVENTORY)


def test_definition_constraints_are_the_kernels_tiles():
    """evaluate's boundary Workloads keep to the Definition's constraints: they must admit exactly
    the shapes the kernel's tiles take (else a boundary Workload takes the fallback, an error under
    strict mode; found on the H200 with head_dim 257)."""
    from cutile_kernels_tools.inventory import families

    (d,) = [e.definition for e in families.entries() if e.definition.name == NAME]
    for head_dim in range(2, 300):
        for rot in range(2, head_dim + 1, 2):
            axes = {"batch": 1, "seq_len": 1, "num_q_heads": 1, "num_kv_heads": 1, "head_dim": head_dim,
                    "rot_dim": rot}
            assert (not d.satisfies(axes)) == (ops._gemma_tile(head_dim, rot) is not None), (head_dim, rot)


# ---------------------------------------------------------------------------------------------
# The patch gemma3_qk_norm_rope (layers/models/gemma.py): Gemma 3 attention on this kernel
# ---------------------------------------------------------------------------------------------

def _gemma3_attention(model):
    return [m for m in model.modules() if type(m).__name__ == "Gemma3Attention"]


def test_gemma3_patch_keeps_stock_logits_hooks_and_undoes(caplog):
    import logging

    import families
    from cutile_kernels.layers.models import gemma as fam

    model = families.model("gemma3_text", sliding_window=4)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(6))
    want = families.prefill_and_step(model, ids)
    n = len(_gemma3_attention(model))
    assert n and cutile_kernels.patch(model).changed["gemma3_qk_norm_rope"] == n  # a default patch
    dispatch.reset_stats()
    assert torch.equal(families.prefill_and_step(model, ids), want)  # sliding and global layers, cached step
    assert dispatch.stats()["reference_calls"][NAME] == 2 * n
    # A hooked norm: the stock lines for that layer, the hook fires.
    seen = []
    handle = _gemma3_attention(model)[0].q_norm.register_forward_hook(lambda m, a, out: seen.append(1))
    dispatch.reset_stats()
    assert torch.equal(families.prefill_and_step(model, ids), want)
    handle.remove()
    assert len(seen) == 2 and dispatch.stats()["reference_calls"][NAME] == 2 * (n - 1)
    assert fam.unpatch_gemma3_qk_norm_rope(model) == n
    assert not any("forward" in vars(m) for m in _gemma3_attention(model))
    # What it leaves alone: other attention code, other norm formulas.
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRMSNorm

    assert fam.attention_verdict(LlamaAttention) == "its forward is not Gemma3Attention.forward's code"
    attn = _gemma3_attention(model)[0]
    attn.k_norm = LlamaRMSNorm(attn.head_dim)
    assert fam._attention_verdict(attn) == "its q_norm / k_norm are not GemmaRMSNorm-formula norms"
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert cutile_kernels.patch(model, names=["gemma3_qk_norm_rope"]).changed == {"gemma3_qk_norm_rope": n - 1}
    assert "q_norm / k_norm are not GemmaRMSNorm-formula norms" in caplog.text


def test_gemma3_patched_model_compiles_fullgraph_with_the_op():
    import families

    model = families.model("gemma3_text")
    cutile_kernels.patch(model, names=["gemma3_qk_norm_rope"])
    frames, targets, got, want = families.compile_fullgraph(model, seed=10)
    assert frames == 1 and any(t.endswith("qk_norm_rope_gemma.default") for t in targets)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.gpu
def test_gpu_gemma3_patched_model_is_as_close_to_float32_as_stock(strict):
    import families

    before = dispatch.stats()["launches"]
    ours, stock, report = families.relative_errors_vs_float32("gemma3_text", ["gemma3_qk_norm_rope"], seq=41,
                                                              layers=4, sliding_window=24)
    assert report.changed == {"gemma3_qk_norm_rope": 4}
    assert any(k.startswith("qk_norm_rope_gemma_kernel") and n > before.get(k, 0)
               for k, n in dispatch.stats()["launches"].items())
    assert ours <= 1.1 * stock, (ours, stock)
