"""qk_norm_rope_olmo2 (OLMo 2's q/k norms over the whole projection + its float32 RoPE in one launch):
the reference against transformers' OLMo 2 modules bit for bit, the kernel's tile logic emulated on
the CPU against float64 and stock (real widths, heads no power of two, fewer KV heads, positions no
tile divides, a strided view of a stacked projection, cos/sin of batch 1), the op's shape checks
(opcheck, the fake, gradients and fullgraph compile are tests/test_op_contract.py's); on the GPU the kernel against the stock modules with poisoned outputs, the declared fallback, CUDA-graph
replay and compile, and the inventory Solution."""

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

from transformers.models.olmo2 import modeling_olmo2 as olmo2  # noqa: E402

INVENTORY = Path(__file__).resolve().parents[1] / "inventory"
NAME = "qk_norm_rope_olmo2"
LOGGER = "cutile_kernels"
EPS = 1e-6


def _inputs(b, hq, hk, s, d=128, dtype=torch.bfloat16, cos_batch=None, device="cpu", stacked=False, scale=3.0):
    """q and k as the projections return them ((B, S, H * D); with ``stacked`` views of one q/k/v
    output, as the stacked projection gives them), norm weights around 1, and float32 cos/sin of
    OLMo 2's frequencies (theta 5e5) for per-row positions."""
    g = torch.Generator().manual_seed(b * 1000 + s * 10 + hq + 7 * hk)
    if stacked:
        qkv = (torch.randn(b, s, (hq + 2 * hk) * d, generator=g) * scale).to(device=device, dtype=dtype)
        q, k = qkv[..., : hq * d], qkv[..., hq * d: (hq + hk) * d]
    else:
        q = (torch.randn(b, s, hq * d, generator=g) * scale).to(device=device, dtype=dtype)
        k = (torch.randn(b, s, hk * d, generator=g) * scale).to(device=device, dtype=dtype)
    qw = (1 + 0.3 * torch.randn(hq * d, generator=g)).to(device=device, dtype=dtype)
    kw = (1 + 0.3 * torch.randn(hk * d, generator=g)).to(device=device, dtype=dtype)
    cb = b if cos_batch is None else cos_batch
    pos = (torch.arange(s)[None] + 5 * torch.arange(cb)[:, None]).double()
    inv_freq = 1.0 / (500_000 ** (torch.arange(0, d, 2).double() / d))
    # The halves' angles differ a little (a rotary embedding repeats them): a kernel that mixed up
    # cos1 and cos2 (or sin1 and sin2) would then differ from the formula.
    emb = torch.cat((pos[..., None] * inv_freq, 1.1 * pos[..., None] * inv_freq), dim=-1)
    return q, k, qw, kw, emb.cos().float().to(device), emb.sin().float().to(device)


def _stock(q, k, qw, kw, eps, cos, sin):
    """transformers' Olmo2RMSNorm modules and apply_rotary_pos_emb as Olmo2Attention.forward runs
    them; returned in the projection's shape (the stock result transposed back)."""
    d = cos.shape[-1]
    qn, kn = olmo2.Olmo2RMSNorm(q.shape[-1], eps), olmo2.Olmo2RMSNorm(k.shape[-1], eps)
    qn.weight.data, kn.weight.data = qw, kw
    with torch.no_grad():
        qh = qn(q).view(*q.shape[:2], -1, d).transpose(1, 2)
        kh = kn(k).view(*k.shape[:2], -1, d).transpose(1, 2)
        qe, ke = olmo2.apply_rotary_pos_emb(qh, kh, cos, sin)
    return qe.transpose(1, 2).flatten(2), ke.transpose(1, 2).flatten(2)


def _exact_and_bound(x, w, eps, cos, sin, dtype):
    """The float64 result of the formula and a bound on a faithful evaluation's error in dtype (the
    normed value rounded to dtype, then float32 products and sum, then one rounding to dtype)."""
    d = cos.shape[-1]
    x, w = x.double(), w.double()
    n = (w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).unflatten(-1, (-1, d))
    cos, sin = cos.double().unsqueeze(2), sin.double().unsqueeze(2)
    half = d // 2
    turned = torch.cat((-n[..., half:], n[..., :half]), dim=-1)
    exact = (n * cos + turned * sin).flatten(2)
    u = torch.finfo(dtype).eps / 2
    # The normed value carries ~5 roundings in float32 (mean, sqrt, division, two products), its
    # rounding to dtype, the rotation's products and sum; then the result's rounding to dtype.
    bound = 8 * u * ((n * cos).abs() + (turned * sin).abs()).flatten(2) + u * exact.abs()
    return exact, bound + torch.finfo(dtype).tiny


def _emulate(q, k, qw, kw, eps, cos, sin):
    """Run qk_norm_rope_olmo2_kernel on NumPy as the op launches it, outputs poisoned with NaN.
    Takes float16 or float32 q/k (cutile_numpy does not emulate bfloat16 rounding)."""
    b, s, _ = q.shape
    d = cos.shape[-1]
    q_out, k_out = ops._olmo2_outputs(q, k)
    q_out.fill_(float("nan"))
    k_out.fill_(float("nan"))
    want = dict(ops._olmo2_want(d, max(q.shape[-1], k.shape[-1]) // d, s))
    laid = ops._olmo2_layout((q, k, qw, kw, cos, sin, q_out, k_out, eps))
    grid = (-(-s // want["ROWS"]), 2, b)
    run = cutile_numpy.emulate(src.qk_norm_rope_olmo2_kernel, src)
    run(grid, (*laid[:8], cutile_numpy.float32(eps), want["BLOCK"], want["HP"], want["ROWS"]))
    assert not q_out.isnan().any() and not k_out.isnan().any(), "an output element was not written"
    return q_out, k_out


# ---------------------------------------------------------------------------------------------
# CPU: the reference is transformers'
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(2, 4, 4, 7, 16), (1, 16, 16, 1, 128), (3, 5, 1, 4, 32)], ids=str)
def test_reference_matches_transformers_bitwise(shape, dtype):
    b, hq, hk, s, d = shape
    q, k, qw, kw, cos, sin = _inputs(b, hq, hk, s, d, dtype)
    want = _stock(q, k, qw, kw, EPS, cos, sin)
    got = ops.qk_norm_rope_olmo2_reference(q, k, qw, kw, EPS, cos, sin)
    ours = cutile_kernels.qk_norm_rope_olmo2(q, k, qw, kw, EPS, cos, sin)  # CPU: the reference, contiguous
    for g, o, w in zip(got, ours, want):
        assert g.dtype == w.dtype == dtype and torch.equal(g, w) and torch.equal(o, w) and o.is_contiguous()


# ---------------------------------------------------------------------------------------------
# CPU: the kernel's tile logic (tests/cutile_numpy.py) against float64 and stock
# ---------------------------------------------------------------------------------------------

#: (B, Hq, Hk, S, cos batch, stacked): OLMo-2-1B's 16 heads at decode b1 and b16 and a prefill no tile
#: divides; OLMo-3-7B's 32 at decode; the edges: 5 heads (padded to 8), fewer KV heads (OLMo 2 32B's
#: 40 / 8 shape, padded to 64), one KV head, cos/sin of batch 1 for a batch of 3, strided views of a
#: stacked q/k/v output.
EMULATED = [
    (1, 16, 16, 1, None, False), (16, 16, 16, 1, None, False), (1, 16, 16, 11, None, False),
    (2, 32, 32, 1, None, True), (2, 5, 5, 3, None, False), (1, 40, 8, 2, None, True), (2, 8, 1, 9, None, False),
    (3, 16, 16, 5, 1, True),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", EMULATED, ids=lambda c: "b{}-hq{}-hk{}-s{}-cb{}-stacked{}".format(*c))
def test_emulated_kernel_matches_float64_and_stock(case, dtype):
    b, hq, hk, s, cb, stacked = case
    q, k, qw, kw, cos, sin = _inputs(b, hq, hk, s, dtype=dtype, cos_batch=cb, stacked=stacked)
    got = _emulate(q, k, qw, kw, EPS, cos, sin)
    stock = _stock(q, k, qw, kw, EPS, cos, sin)
    for g, st, x, w in zip(got, stock, (q, k), (qw, kw)):
        assert g.shape == st.shape and g.dtype == st.dtype and g.is_contiguous()
        exact, bound = _exact_and_bound(x, w, EPS, cos, sin, dtype)
        assert ((g.double() - exact).abs() <= bound).all(), (g.double() - exact).abs().max().item()
        assert ((st.double() - exact).abs() <= bound).all()  # the bound holds for stock too
        if dtype != torch.float32:  # stock's roundings but for the norm factor's summation order
            assert torch.eq(g, st).float().mean() >= 0.97


def test_emulated_kernel_pads_a_narrower_head():
    # head_dim 96: halves of 48 lanes in the 64-lane tile, the padding neither summed nor stored.
    q, k, qw, kw, cos, sin = _inputs(2, 6, 3, 5, d=96, dtype=torch.float16)
    got = _emulate(q, k, qw, kw, EPS, cos, sin)
    for g, st, x, w in zip(got, _stock(q, k, qw, kw, EPS, cos, sin), (q, k), (qw, kw)):
        exact, bound = _exact_and_bound(x, w, EPS, cos, sin, torch.float16)
        assert ((g.double() - exact).abs() <= bound).all() and torch.eq(g, st).float().mean() >= 0.97


def test_emulated_kernel_with_bfloat16_values():
    # cutile_numpy computes bfloat16 as float32: the tile logic on bfloat16-valued inputs.
    q, k, qw, kw, cos, sin = _inputs(2, 16, 16, 3, dtype=torch.bfloat16)
    q, k, qw, kw = (t.float() for t in (q, k, qw, kw))
    got = _emulate(q, k, qw, kw, EPS, cos, sin)
    for g, x, w in zip(got, (q, k), (qw, kw)):
        exact, bound = _exact_and_bound(x, w, EPS, cos, sin, torch.float32)
        assert ((g.double() - exact).abs() <= bound).all()


# ---------------------------------------------------------------------------------------------
# CPU: build matrix, tile choice, the op's contract
# ---------------------------------------------------------------------------------------------

def test_build_matrix():
    specs = [s for s in src.VARIANTS if s.kernel == NAME]
    assert len({s.tag for s in specs}) == len(specs)
    tiles = {(s.constants["BLOCK"], s.constants["HP"], s.constants["ROWS"]) for s in specs}
    for block, hp in src.OLMO2_TILES:
        assert (block, hp, 1) in tiles and (block, hp, src.OLMO2_ROWS[(block, hp)]) in tiles
        assert src.OLMO2_ROWS[(block, hp)] * hp * 2 * block in (8192, 2 * block * hp * 1)
    for s in specs:
        assert [p.name for p in s.params] == ["q", "k", "q_weight", "k_weight", "cos", "sin", "q_out", "k_out", "eps",
                                              "BLOCK", "HP", "ROWS"]
        assert {p.dtype for p in s.params[4:6]} == {"float32"} and s.params[0].dtype in ("bfloat16", "float16")
    assert len(specs) == 2 * 2 * sum(len({src.OLMO2_ROWS[t], 1}) for t in src.OLMO2_TILES)  # dtypes x layouts


def test_tile_choice():
    want = ops._olmo2_want
    assert want(128, 16, 2048) == (("BLOCK", 64), ("HP", 16), ("ROWS", 4))  # OLMo-2-1B prefill
    assert want(128, 16, 1) == (("BLOCK", 64), ("HP", 16), ("ROWS", 1))  # decode
    assert want(128, 32, 2048) == (("BLOCK", 64), ("HP", 32), ("ROWS", 2))  # OLMo-3-7B
    assert want(128, 40, 7) == (("BLOCK", 64), ("HP", 64), ("ROWS", 1))  # 13B / 32B: 40 heads
    assert want(128, 3, 1) == (("BLOCK", 64), ("HP", 8), ("ROWS", 1))
    assert ops._olmo2_tile(96, 16) == (64, 16)  # halves of 48 padded
    assert ops._olmo2_tile(64, 16) is None and ops._olmo2_tile(130, 16) is None and ops._olmo2_tile(128, 65) is None


def test_tile_reason_is_the_one_rule():
    """olmo2_tile_reason (what the patch asks at kernelize time) and olmo2_unsupported (each call)
    give the same answer and words for a head dim and head count."""
    assert ops.olmo2_tile_reason(128, 16) is None and ops.olmo2_tile_reason(128, 64) is None
    assert ops.olmo2_tile_reason(66, 1) is None and ops.olmo2_tile_reason(96, 40) is None
    for d, heads in ((16, 4), (64, 16), (130, 16), (256, 8), (128, 65)):
        why = ops.olmo2_tile_reason(d, heads)
        assert why.startswith(f"head_dim {d} with {heads} heads") and str(src.OLMO2_TILES) in why, why
    q, k, qw, kw, cos, sin = _inputs(1, 4, 2, 3, d=16)
    assert ops.olmo2_unsupported(q, k, qw, kw, cos, sin) == ops.olmo2_tile_reason(16, 4)


def test_unsupported_inputs_say_why():
    q, k, qw, kw, cos, sin = _inputs(1, 16, 16, 3)
    assert ops.olmo2_unsupported(q, k, qw, kw, cos, sin) is None
    assert "dtypes" in ops.olmo2_unsupported(q, k, qw.float(), kw, cos, sin)
    assert "dtypes" in ops.olmo2_unsupported(q, k, qw, kw, cos.bfloat16(), sin.bfloat16())
    assert "dtypes" in ops.olmo2_unsupported(q.float(), k.float(), qw.float(), kw.float(), cos, sin)
    narrow = _inputs(1, 4, 4, 2, d=64)
    assert "head_dim 64" in ops.olmo2_unsupported(*narrow)
    assert "strided last dimension" in ops.olmo2_unsupported(q[..., ::2], k[..., ::2], qw[::2], kw[::2], cos, sin)


def test_shape_errors_and_contract_edges():
    q, k, qw, kw, cos, sin = _inputs(2, 4, 2, 3, d=16)
    with pytest.raises(ValueError, match="q_weight"):
        cutile_kernels.qk_norm_rope_olmo2(q, k, qw[:16], kw, EPS, cos, sin)
    with pytest.raises(ValueError, match="head_dim D dividing"):
        cutile_kernels.qk_norm_rope_olmo2(q[..., :40], k, qw[:40], kw, EPS, cos, sin)
    with pytest.raises(ValueError, match="expected q"):
        cutile_kernels.qk_norm_rope_olmo2(q.unflatten(-1, (4, 16)), k, qw, kw, EPS, cos, sin)
    with pytest.raises(TypeError):
        cutile_kernels.qk_norm_rope_olmo2(q.int(), k, qw, kw, EPS, cos, sin)
    cutile_kernels.reset_stats()
    cutile_kernels.qk_norm_rope_olmo2(q, k, qw, kw, EPS, cos, sin)
    assert cutile_kernels.stats()["reference_calls"] == {NAME: 1}
    empty = [t[:, :0] if t.dim() == 3 else t for t in (q, k)]
    got = cutile_kernels.qk_norm_rope_olmo2(*empty, qw, kw, EPS, cos[:, :0], sin[:, :0])
    assert got[0].shape == (2, 0, 64) and got[1].shape == (2, 0, 32)


def test_definition_constraints_are_the_kernels_tiles():
    """evaluate's boundary Workloads keep to the Definition's constraints: they must admit exactly
    the shapes the kernel's tiles take (else a boundary Workload takes the fallback, an error under
    strict mode)."""
    from cutile_kernels_tools.inventory import families

    (d,) = [e.definition for e in families.entries() if e.definition.name == NAME]
    for head_dim in range(2, 260, 2):
        for heads in (1, 5, 8, 16, 40, 64, 65, 128):
            axes = {"batch": 1, "seq_len": 1, "q_dim": heads * head_dim, "kv_dim": head_dim, "head_dim": head_dim}
            assert (not d.satisfies(axes)) == (ops._olmo2_tile(head_dim, heads) is not None), (head_dim, heads)


# ---------------------------------------------------------------------------------------------
# CPU: the patch olmo2_qk_norm_rope (layers/models/olmo2.py, a default)
# ---------------------------------------------------------------------------------------------
#
# Models with head_dim 128 (families.OLMO_KERNEL_HEADS; the kernel's tiles) where the patch must
# apply; the family rows' head_dim 16, which no tile takes, where it must not.

def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _attention(model):
    return [layer.self_attn for layer in model.model.layers]


@pytest.mark.parametrize("model_type", ["olmo2", "olmo3"])
def test_patch_keeps_stock_logits_stacks_and_undoes(model_type):
    """On the CPU the op is its reference, bit for bit stock: the patched model's logits equal stock's,
    alone and with its q/k/v stacked by fused_qkv (OLMo 3: sliding layers with their window); the
    fused op runs once a layer; the undo leaves no instance forward or window attribute behind."""
    from families import OLMO_KERNEL_HEADS, model as tiny

    model, stock = tiny(model_type, **OLMO_KERNEL_HEADS), tiny(model_type, **OLMO_KERNEL_HEADS)
    ids = torch.randint(1, 256, (2, 9), generator=torch.Generator().manual_seed(5))
    want = _logits(stock, ids)
    assert cutile_kernels.patch(model, names=["olmo2_qk_norm_rope"]).changed == {"olmo2_qk_norm_rope": 3}
    windows = [m.__dict__["_cutile_olmo_window"] for m in _attention(model)]
    assert windows == [model_type == "olmo3"] * 3
    cutile_kernels.reset_stats()
    assert torch.equal(_logits(model, ids), want)
    assert cutile_kernels.stats()["reference_calls"].get(NAME) == 3
    assert cutile_kernels.patch(model, names=["fused_qkv"]).changed == {"fused_qkv": 3}
    assert all(hasattr(m, "qkv_proj") and not hasattr(m, "q_proj") for m in _attention(model))
    assert torch.equal(_logits(model, ids), want)
    # the verdict also judges stacked modules (no q_proj / k_proj: their heads from the norms' widths)
    assert cutile_kernels.unpatch(model, names=["olmo2_qk_norm_rope"]).changed == {"olmo2_qk_norm_rope": 3}
    assert cutile_kernels.patch(model, names=["olmo2_qk_norm_rope"]).changed == {"olmo2_qk_norm_rope": 3}
    assert torch.equal(_logits(model, ids), want)
    assert cutile_kernels.unpatch(model, names=["fused_qkv", "olmo2_qk_norm_rope"]).changed == \
        {"fused_qkv": 3, "olmo2_qk_norm_rope": 3}
    assert not any("forward" in vars(m) or "_cutile_olmo_window" in vars(m) for m in _attention(model))
    assert torch.equal(_logits(model, ids), want)


def test_a_stacked_module_keeps_passing_its_window_after_the_undo(monkeypatch):
    """Undone while fused_qkv still stacks the module (whose class forward is then the fused one, on
    the stock lines), OLMo 3's attention still passes ``sliding_window`` as stock's does: what a
    flash-attention implementation reads (sdpa's mask carries the window anyway)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import AttentionInterface

    from families import OLMO_KERNEL_HEADS, model as tiny

    seen = []

    def recording(module, *args, **kwargs):
        seen.append((module.layer_idx, kwargs.get("sliding_window", "absent")))
        return sdpa_attention_forward(module, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", recording)
    ids = torch.randint(1, 256, (1, 9), generator=torch.Generator().manual_seed(4))
    stock, model = tiny("olmo3", **OLMO_KERNEL_HEADS), tiny("olmo3", **OLMO_KERNEL_HEADS)
    _logits(stock, ids)
    want, seen[:] = list(seen), []
    assert want == [(0, 4), (1, None), (2, 4)]
    cutile_kernels.patch(model, names=["olmo2_qk_norm_rope", "fused_qkv"])
    cutile_kernels.unpatch(model, names=["olmo2_qk_norm_rope"])
    assert all(hasattr(m, "qkv_proj") for m in _attention(model))
    assert torch.equal(_logits(model, ids), _logits(stock, ids)) and seen[:3] == want
    cutile_kernels.unpatch(model, names=["fused_qkv"])
    seen.clear()
    _logits(model, ids)
    assert seen == want


def test_hooked_or_mismatched_norms_run_the_stock_lines():
    from families import OLMO_KERNEL_HEADS, model as tiny

    model, stock = tiny("olmo2", **OLMO_KERNEL_HEADS), tiny("olmo2", **OLMO_KERNEL_HEADS)
    ids = torch.randint(1, 256, (1, 7), generator=torch.Generator().manual_seed(6))
    cutile_kernels.patch(model, names=["olmo2_qk_norm_rope"])
    seen = []
    model.model.layers[0].self_attn.q_norm.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    model.model.layers[1].self_attn.k_norm.variance_epsilon = 1e-3
    stock.model.layers[1].self_attn.k_norm.variance_epsilon = 1e-3
    cutile_kernels.reset_stats()
    assert torch.equal(_logits(model, ids), _logits(stock, ids))
    assert seen == [(1, 7, 4 * 128)]  # the hook fired on the stock line (4 heads of 128)
    assert cutile_kernels.stats()["reference_calls"].get(NAME) == 1  # only the third layer fused


def test_patch_leaves_other_attention_code_alone(caplog):
    from families import OLMO_KERNEL_HEADS, model as tiny

    class Changed(olmo2.Olmo2Attention):
        def forward(self, *args, **kwargs):  # another forward: not OLMo 2's code
            return super().forward(*args, **kwargs)

    model = tiny("olmo2", **OLMO_KERNEL_HEADS)
    model.model.layers[0].self_attn.__class__ = Changed
    with caplog.at_level("INFO", logger=LOGGER):
        assert cutile_kernels.patch(model, names=["olmo2_qk_norm_rope"]).changed == {"olmo2_qk_norm_rope": 2}
    assert "leaves 1 Changed alone: its forward is not" in caplog.text
    llama = tiny("llama")
    assert cutile_kernels.patch(llama, names=["olmo2_qk_norm_rope"]).changed == {"olmo2_qk_norm_rope": 0}


@pytest.mark.parametrize("model_type", ["olmo2", "olmo3"])
def test_patch_leaves_heads_no_tile_takes_alone(model_type, caplog):
    """The family rows' head_dim 16 (4 query heads over 2 KV heads): no tile of the kernel takes it,
    so the patch declines every attention module when the model is kernelized, with the tile rule's
    reason logged once per class; the modules keep their class forward (no fused call, no fallback
    on any forward: under CUTILE_KERNELS_STRICT=1 on CUDA each forward raised before), the logits
    are stock's, and fused_qkv, which stacks only modules this patch owns, stacks none of them."""
    from families import model as tiny

    model, stock = tiny(model_type), tiny(model_type)
    ids = torch.randint(1, 256, (2, 9), generator=torch.Generator().manual_seed(5))
    want = _logits(stock, ids)
    cls = type(_attention(model)[0]).__name__
    with caplog.at_level("INFO", logger=LOGGER):
        report = cutile_kernels.patch(model, names=["olmo2_qk_norm_rope", "fused_qkv"])
    assert report.changed == {"olmo2_qk_norm_rope": 0, "fused_qkv": 0}
    assert f"patch olmo2_qk_norm_rope leaves 3 {cls} alone: {ops.olmo2_tile_reason(16, 4)}" in caplog.text
    assert "head_dim 16 with 4 heads" in caplog.text
    assert "stacking it needs the olmo2_qk_norm_rope patch" in caplog.text
    assert not any("forward" in vars(m) or "_cutile_olmo_window" in vars(m) or hasattr(m, "qkv_proj")
                   for m in _attention(model))
    cutile_kernels.reset_stats()
    assert torch.equal(_logits(model, ids), want)
    assert NAME not in cutile_kernels.stats()["reference_calls"]
    # the default patches (what kernelize applies) leave them alone too
    assert cutile_kernels.patch(model).changed.get("olmo2_qk_norm_rope") == 0


@pytest.mark.parametrize("stack", [False, True], ids=["separate", "stacked"])
def test_patched_model_compiles_fullgraph_with_the_op(stack):
    """Under torch.compile(fullgraph=True) the patched attention traces without a graph break into
    one qk_norm_rope_olmo2 op a layer (OLMo 3: its sliding layers too), with stock's logits."""
    from families import OLMO_KERNEL_HEADS, model as tiny

    model, stock = tiny("olmo3", **OLMO_KERNEL_HEADS), tiny("olmo3", **OLMO_KERNEL_HEADS)
    ids = torch.randint(1, 256, (2, 9), generator=torch.Generator().manual_seed(7))
    cutile_kernels.patch(model, names=["olmo2_qk_norm_rope", *(["fused_qkv"] if stack else [])])
    ops_seen = []

    def backend(gm, example_inputs):
        ops_seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend=backend, fullgraph=True)(ids).logits
    assert torch.equal(got, _logits(stock, ids))
    assert sum(NAME in t for t in ops_seen) == len(model.model.layers)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

GPU_CASES = [(1, 16, 16, 1, None, False), (16, 16, 16, 1, None, True), (1, 16, 16, 2048, None, False),
             (1, 32, 32, 1, None, True), (2, 32, 32, 333, 1, False), (2, 5, 5, 3, None, False),
             (1, 40, 8, 17, None, True), (2, 8, 1, 9, None, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "b{}-hq{}-hk{}-s{}-cb{}-stacked{}".format(*c))
def test_kernel_matches_stock_modules(case, dtype, strict):
    """Within the float64 bound of every faithful evaluation, as stock is; most elements bitwise
    equal to stock (the float32 norm factor is summed in another order)."""
    b, hq, hk, s, cb, stacked = case
    q, k, qw, kw, cos, sin = _inputs(b, hq, hk, s, dtype=dtype, cos_batch=cb, device="cuda", stacked=stacked)
    want = _stock(q, k, qw, kw, EPS, cos, sin)
    q_out, k_out = ops._olmo2_outputs(q, k)
    q_out.fill_(float("nan"))
    k_out.fill_(float("nan"))
    before = dispatch.stats()["launches"]
    assert ops.qk_norm_rope_olmo2_into(q, k, qw, kw, EPS, cos, sin, q_out, k_out)
    (variant,) = launched_variants(before)
    torch.cuda.synchronize()
    for g, w, x, wt in zip((q_out, k_out), want, (q, k), (qw, kw)):
        assert not g.isnan().any() and g.dtype == w.dtype
        exact, bound = _exact_and_bound(x.cpu(), wt.cpu(), EPS, cos.cpu(), sin.cpu(), dtype)
        assert ((g.double().cpu() - exact).abs() <= bound).all()
        share = torch.eq(g, w).float().mean().item()
        print(f"{case} {dtype}: bitwise equal to stock {share:.4%}")
        assert share >= 0.97
    assert dict(ops._olmo2_want(128, max(hq, hk), s)) == {k: variant.constants[k] for k in ("BLOCK", "HP", "ROWS")}


@pytest.mark.gpu
def test_unsupported_inputs_fall_back_and_say_so(caplog):
    q, k, qw, kw, cos, sin = _inputs(1, 4, 4, 3, d=64, device="cuda")
    with caplog.at_level("WARNING", logger=LOGGER):
        got = cutile_kernels.qk_norm_rope_olmo2(q, k, qw, kw, EPS, cos, sin)
    want = ops.qk_norm_rope_olmo2_reference(q, k, qw, kw, EPS, cos, sin)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert "qk_norm_rope_olmo2 falls back to PyTorch: head_dim 64" in caplog.text


@pytest.mark.gpu
def test_cuda_graph_replay_and_compile(strict):
    inputs = list(_inputs(4, 16, 16, 1, device="cuda"))
    replays_and_compiles(lambda q, k, qw, kw, cos, sin: cutile_kernels.qk_norm_rope_olmo2(q, k, qw, kw, EPS, cos, sin),
                         inputs)


@pytest.mark.gpu
def test_solution_passes_evaluate():
    assert_solution_passes(NAME, INVENTORY)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["olmo2", "olmo3"])
def test_gpu_patched_model_runs_the_kernel_within_stock_rounding(model_type, strict):
    """A bf16 OLMo model with head_dim 128 (the kernel's tiles) on the GPU: patched (with its q/k/v
    stacked) against stock, both against float32: the kernel runs once a layer and the logits stay
    as close to float32's as stock's are (the logit gate's 1.1x)."""
    from families import model as tiny

    fields = dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=4, head_dim=128)
    ref = tiny(model_type, **fields).cuda().float()
    stock = tiny(model_type, **fields).cuda().to(torch.bfloat16)
    ours = tiny(model_type, **fields).cuda().to(torch.bfloat16)
    cutile_kernels.patch(ours, names=["olmo2_qk_norm_rope", "fused_qkv"])
    ids = torch.randint(1, 256, (2, 37), generator=torch.Generator().manual_seed(8)).cuda()
    before = dispatch.stats()["launches"]
    want, base, got = _logits(ref, ids), _logits(stock, ids).float(), _logits(ours, ids).float()
    assert any(v.kernel == NAME for v in launched_variants(before))
    err = lambda x: ((x - want).norm() / want.norm()).item()  # noqa: E731
    assert err(got) <= 1.1 * err(base) + 1e-6, (err(got), err(base))
