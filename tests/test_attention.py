"""Attention: semantics of the reference against transformers' masks and sdpa (CPU, float64), the
kernel's tile logic run by a NumPy interpreter of cuTile (CPU), the ``"cutile"`` attention
function and its registration, kernelized models against stock ones (CPU: reference path and
emulated kernel; GPU: the cubins), and AOT compilation of the variants."""

from __future__ import annotations

import copy

import importlib
import itertools
import math
import types

import pytest
import torch
import torch.nn.functional as F

import cutile_kernels
from cutile_kernels import dispatch, registry
from cutile_kernels.kernel_src import attention as kattn
from cutile_kernels.layers import attention as lattn

attn_ops = importlib.import_module("cutile_kernels.ops.attention")  # the package exports the function too

from cutile_numpy import emulate

transformers = pytest.importorskip("transformers")

from transformers.masking_utils import (  # noqa: E402
    causal_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

def make_qkv(B, Hq, Hkv, Sq, Skv, D, dtype=torch.float64, device="cpu", scale=1.0):
    """q as transformers passes it (a (B, Hq, Sq, D) view of a (B, Sq, Hq, D) projection), k and v
    as a cache holds them (contiguous (B, Hkv, Skv, D))."""
    q = (torch.randn(B, Sq, Hq, D, device=device, dtype=torch.float32) * scale).to(dtype).transpose(1, 2)
    k = (torch.randn(B, Hkv, Skv, D, device=device, dtype=torch.float32) * scale).to(dtype)
    v = torch.randn(B, Hkv, Skv, D, device=device, dtype=torch.float32).to(dtype)
    return q, k, v


def hf_mask(B, Sq, Skv, q_offset, padding=None, window=None, kv_offset=0, device="cpu"):
    """The boolean mask transformers' sdpa_mask builds (never skipped)."""
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    return sdpa_mask(batch_size=B, q_length=Sq, kv_length=Skv, q_offset=q_offset, kv_offset=kv_offset,
                     mask_function=fn, attention_mask=padding, allow_is_causal_skip=False, device=device)


def left_padding(B, S, pads, device="cpu"):
    m = torch.ones(B, S, dtype=torch.bool, device=device)
    for b, p in enumerate(pads):
        m[b, :p] = False
    return m


def sdpa_gqa(q, k, v, mask=None, scale=None, is_causal=False):
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                          attn_mask=mask, scale=scale, is_causal=is_causal)


def emulated_attention(q, k, v, mask=None, scale=None, causal=True, window=None, softcap=None, splits=None, sms=132,
                       kv_len=None):
    """The kernel launches the op would make, executed by the NumPy cuTile interpreter.
    Returns (output (B, Hq, Sq, D), the launched kernel names)."""
    B, Hq, Sq, D = q.shape
    scale = 1 / math.sqrt(D) if scale is None else scale
    out = torch.full((B, Sq, Hq, D), float("nan"), dtype=q.dtype)
    plan = attn_ops.launches(q, k, v, mask, out, scale, causal, window, softcap, splits, sms=sms, kv_len=kv_len)
    assert not isinstance(plan, str), plan
    for step in plan:
        run_launch(step)
    return out.transpose(1, 2), [p[0] for p in plan]


def run_launch(step) -> dict:
    """Run one ``launches`` step ``(kernel, want, args, n_inputs, grid)`` in the NumPy interpreter;
    returns the variant's constants."""
    kernel, want, args, _n, grid = step
    (spec,) = {s.function: s for s in kattn.VARIANTS  # the bf16 and fp16 variants run the same code
               if s.kernel == kernel and all(s.constants[a] == b for a, b in want)}.values()
    emulate(getattr(kattn, spec.function), kattn)(grid(spec.constants), tuple(args) + tuple(spec.constants.values()))
    return spec.constants


# ---------------------------------------------------------------------------------------------
# CPU: the reference's semantics are transformers' masks and sdpa's math
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("Sq,Skv", [(7, 7), (1, 9), (5, 12), (16, 16), (3, 40)])
@pytest.mark.parametrize("window", [None, 1, 3, 8])
@pytest.mark.parametrize("heads", [(4, 2), (6, 2), (4, 1), (3, 3)])
def test_reference_causal_and_window_are_transformers_masks(Sq, Skv, window, heads):
    Hq, Hkv = heads
    q, k, v = make_qkv(2, Hq, Hkv, Sq, Skv, 16)
    # A cache holding every past token (DynamicCache): the queries are the last Sq positions.
    want = sdpa_gqa(q, k, v, hf_mask(2, Sq, Skv, Skv - Sq, window=window), scale=0.3)
    got = cutile_kernels.attention_reference(q, k, v, None, 0.3, True, window)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_reference_matches_sdpa_on_padding_and_static_cache_masks():
    B, Sq, D = 3, 6, 32
    # Left-padded prefill.
    pad = left_padding(B, Sq, [0, 2, 5])
    q, k, v = make_qkv(B, 4, 2, Sq, Sq, D)
    m = hf_mask(B, Sq, Sq, 0, pad)
    torch.testing.assert_close(cutile_kernels.attention_reference(q, k, v, m, 0.2, False), sdpa_gqa(q, k, v, m, 0.2),
                               rtol=1e-12, atol=1e-12)
    # Three new tokens into a static cache of 16 slots holding 5 (2D mask covers 8 seen tokens).
    pad8 = left_padding(B, 8, [0, 1, 3])
    q, k, v = make_qkv(B, 4, 2, 3, 16, D)
    m = hf_mask(B, 3, 16, 5, pad8)
    assert not m[..., 8:].any()  # the empty slots are masked
    torch.testing.assert_close(cutile_kernels.attention_reference(q, k, v, m, 0.2, False), sdpa_gqa(q, k, v, m, 0.2),
                               rtol=1e-12, atol=1e-12)


def test_no_key_at_all_gives_zeros():
    """A cache with no key (Skv = 0): every query sees nothing, so zeros, as sdpa gives."""
    q, k, v = make_qkv(1, 2, 1, 3, 0, 64, torch.float32)
    got = cutile_kernels.attention(q, k, v, causal=False)
    assert got.shape == (1, 2, 3, 64) and torch.equal(got, torch.zeros_like(got))
    torch.testing.assert_close(got, sdpa_gqa(q, k, v), rtol=0, atol=0)


def test_reference_softcap_and_empty_rows():
    q, k, v = make_qkv(1, 2, 1, 4, 6, 8, scale=3.0)
    cap = 2.5
    s = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, 1)) * 0.5
    s = cap * torch.tanh(s / cap)
    vis = attn_ops.visible_mask(1, 4, 6, None, True, None)
    want = torch.softmax(s.masked_fill(~vis, float("-inf")), -1) @ v.repeat_interleave(2, 1)
    got = cutile_kernels.attention_reference(q, k, v, None, 0.5, True, None, cap)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    m = torch.ones(1, 1, 4, 6, dtype=torch.bool)
    m[0, 0, 2] = False  # a query that sees nothing gets zeros (sdpa's math path agrees)
    out = cutile_kernels.attention_reference(q, k, v, m, 0.5, False)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    torch.testing.assert_close(out, sdpa_gqa(q, k, v, m, 0.5), rtol=1e-12, atol=1e-12)


def test_reference_layout_and_shape_errors():
    q, k, v = make_qkv(2, 4, 2, 5, 7, 16)
    out = cutile_kernels.attention_reference(q, k, v)
    assert out.shape == (2, 4, 5, 16) and out.transpose(1, 2).is_contiguous()
    with pytest.raises(ValueError, match="not a multiple"):
        cutile_kernels.attention(q, k[:, :1].expand(2, 3, 7, 16), v[:, :1].expand(2, 3, 7, 16))
    bad_shape = r"mask torch.bool \(2, 1, 5, 8\) is not a boolean \(B or 1, 1, Sq, Skv\) = \(2 or 1, 1, 5, 7\)"
    with pytest.raises(ValueError, match=bad_shape):
        cutile_kernels.attention(q, k, v, torch.ones(2, 1, 5, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="boolean"):
        cutile_kernels.attention(q, k, v, torch.zeros(2, 1, 5, 7))


# ---------------------------------------------------------------------------------------------
# CPU: the kernel's tile logic (NumPy interpreter of the cuTile calls) against the reference
# ---------------------------------------------------------------------------------------------

#: (B, Hq, Hkv, Sq, Skv, head_dim, extra): family head shapes, decode and prefill lengths, masks.
EMULATED = [
    (1, 4, 1, 1, 1, 64, {}),                       # one key
    (2, 8, 2, 1, 300, 64, {}),                     # Llama GQA 4, decode
    (1, 4, 2, 7, 7, 128, {}),                      # Qwen3 GQA 2, short prefill (decode tiles)
    (1, 6, 1, 17, 17, 128, {}),                    # Qwen2.5 GQA 6, prefill tiles, 17 queries
    (2, 4, 1, 130, 130, 64, {}),                   # one KV head, two query blocks
    (1, 2, 2, 70, 200, 80, {}),                    # MHA, head_dim 80, chunk over a cache
    (1, 4, 4, 3, 45, 96, {"window": 5}),           # head_dim 96, sliding window, decode tiles
    (2, 2, 1, 150, 150, 256, {"window": 33}),      # head_dim 256, window across tiles
    (1, 4, 2, 20, 50, 32, {"softcap": 3.0}),       # softcap, head_dim 32 padded to 64
    (1, 2, 2, 9, 5, 64, {}),                       # more queries than keys: first rows see nothing
    (1, 8, 2, 1, 600, 64, {"splits": 5}),          # split-KV, forced
    (1, 8, 1, 1, 1000, 64, {"sms": 132}),          # split-KV chosen by the grid heuristic
    (2, 8, 8, 4, 500, 128, {"splits": 7, "window": 100}),
    (1, 2, 2, 5, 5, 64, {"causal": False}),
    # The long decode tile (256 keys: one unsplit pass over >= 2048 slots), a partial last tile.
    (1, 4, 2, 1, 2100, 128, {"splits": 1}),
    (1, 4, 2, 1, 2100, 128, {"splits": 1, "window": 300}),
    (1, 4, 2, 3, 2100, 64, {"splits": 1, "softcap": 5.0}),
    # Groups no HB divides: Phi-4-mini's 3 (one block of 4 head rows a KV head), Qwen2.5's 6 and 7
    # (two blocks, the last one's rows past the group padded); where the views do not merge (two
    # rows of several positions) or a split is chosen, the divisor's tiles.
    (2, 6, 2, 1, 300, 128, {}),
    (1, 12, 2, 5, 40, 64, {}),
    (3, 14, 2, 1, 100, 64, {"window": 30}),
    (2, 6, 2, 4, 50, 64, {}),
    (1, 3, 1, 1, 1000, 128, {"sms": 132}),
]


@pytest.mark.parametrize("case", EMULATED, ids=lambda c: "-".join(map(str, c[:6])) + "".join(f"-{k}{v}" for k, v in c[6].items()))
def test_emulated_kernel_matches_reference(case):
    B, Hq, Hkv, Sq, Skv, D, extra = case
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Skv, D)
    kw = {"causal": extra.get("causal", True), "window": extra.get("window"), "softcap": extra.get("softcap")}
    got, kernels = emulated_attention(q, k, v, None, 0.17, splits=extra.get("splits"), sms=extra.get("sms", 132), **kw)
    want = cutile_kernels.attention_reference(q, k, v, None, 0.17, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # float32 inside; logic errors are O(0.1)
    assert ("attention_combine" in kernels) == (extra.get("splits", 1) > 1 or "sms" in extra)


@pytest.mark.parametrize("kind", ["left-padded prefill", "chunk over a padded cache", "static-cache decode",
                                  "static-cache decode, split", "sliding window + padding", "batch-shared mask"])
def test_emulated_kernel_with_transformers_masks(kind):
    B, Hq, Hkv, D = 3, 4, 2, 64
    if kind == "left-padded prefill":
        Sq = Skv = 140
        m = hf_mask(B, Sq, Skv, 0, left_padding(B, Skv, [0, 3, 70]))
    elif kind == "chunk over a padded cache":
        Sq, Skv = 9, 30
        m = hf_mask(B, Sq, Skv, Skv - Sq, left_padding(B, Skv, [0, 3, 25]))
    elif kind.startswith("static-cache decode"):
        Sq, Skv = 1, 300
        m = hf_mask(B, Sq, Skv, 12, left_padding(B, 13, [0, 2, 5]))
    elif kind == "sliding window + padding":
        Sq = Skv = 40
        m = hf_mask(B, Sq, Skv, 0, left_padding(B, Skv, [0, 3, 9]), window=6)
    else:
        Sq, Skv = 5, 20
        m = hf_mask(1, Sq, Skv, Skv - Sq).expand(B, 1, Sq, Skv)  # stride 0 along the batch
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Skv, D)
    splits = 4 if kind.endswith("split") else 1
    got, kernels = emulated_attention(q, k, v, m, 0.125, causal=False, splits=splits)
    want = cutile_kernels.attention_reference(q, k, v, m, 0.125, False)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    prefill = Sq > attn_ops.DECODE_MAX_SQ
    assert kernels == (["attention", "attention_combine"] if splits > 1
                       else ["attention_mask_tiles", "attention"] if prefill else ["attention"])


def mask_tile_classes(m: torch.Tensor, BS: int, BN: int) -> torch.Tensor:
    """What attention_mask_tiles writes for a kernel mask ``(MB, Sq, Skv)``: per (query block, KV
    tile) 0 when nothing inside the mask is visible, 2 when all is, else 1."""
    MB, Sq, Skv = m.shape
    out = torch.empty(MB, -(-Sq // BS), -(-Skv // BN), dtype=torch.int8)
    for mb, qb, j in itertools.product(*map(range, out.shape)):
        sub = m[mb, qb * BS:(qb + 1) * BS, j * BN:(j + 1) * BN] != 0
        out[mb, qb, j] = 0 if not sub.any() else 2 if sub.all() else 1
    return out


def _holes(B, Sq, Skv, seed=0):
    """A mask no causal or window rule makes: random holes, a query row that sees nothing, a band
    of keys hidden from every query, a tile-sized block fully visible."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(B, 1, Sq, Skv, generator=g) < 0.6
    m[:, :, 5] = False
    m[:, :, :, 64:128] = False
    m[:, :, 128:, 128:256] = True
    return m


#: (B, Hq, Hkv, Sq, Skv, D, mask kind, shared by the batch)
MASK_TILE_CASES = [
    (2, 4, 2, 300, 300, 64, "window 70 + padding", False),     # BS 128, the window's lower edge inside tiles
    (1, 4, 1, 200, 333, 256, "window 100 over a cache", True),  # BS 64: Gemma 3's head layout, a ragged last tile
    (2, 2, 2, 270, 290, 64, "holes", False),
    (3, 2, 1, 150, 150, 128, "holes", True),                    # one mask for the batch (MB = 1)
    (1, 2, 1, 17, 200, 64, "padding", False),                   # the shortest prefill: one query block
]


@pytest.mark.parametrize("case", MASK_TILE_CASES, ids=lambda c: f"{c[6]}-d{c[5]}-B{c[0]}" + ("-shared" if c[7] else ""))
@pytest.mark.parametrize("row", [None, 2], ids=["bounds", "no-bounds"])
def test_masked_prefill_classifies_mask_tiles(case, row, monkeypatch):
    """A masked prefill: the classes match the mask tile by tile, and the attention that skips
    hidden tiles, reads no mask on full ones and (``row``: TILE_ROW shrunk below the KV tiles, so
    the kernel visits every tile and reads each class) bounds its loop by them matches the
    reference."""
    B, Hq, Hkv, Sq, Skv, D, kind, shared = case
    if row is not None:
        monkeypatch.setattr(kattn, "TILE_ROW", row)
    MB = 1 if shared else B
    if kind.startswith("window"):
        pad = left_padding(MB, Skv, [0, 9, 40][:MB]) if "padding" in kind else None
        m = hf_mask(MB, Sq, Skv, Skv - Sq, pad, window=int(kind.split()[1]))
    elif kind == "padding":
        m = hf_mask(MB, Sq, Skv, Skv - Sq, left_padding(MB, Skv, [70]))
    else:
        m = _holes(MB, Sq, Skv)
    if shared:
        m = m.expand(B, 1, Sq, Skv)
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Skv, D)
    got, kernels = emulated_attention(q, k, v, m, 0.11, causal=False)
    assert kernels == ["attention_mask_tiles", "attention"]
    torch.testing.assert_close(got, cutile_kernels.attention_reference(q, k, v, m, 0.11, False), rtol=1e-4, atol=1e-4)
    # The classes themselves, from the first launch alone.
    out = torch.empty(B, Sq, Hq, D, dtype=q.dtype)
    first = attn_ops.launches(q, k, v, m, out, 0.11, False)[0]
    args = first[2]
    args[1].fill_(-1)  # poisoned: every class must be written
    consts = run_launch(first)
    want_classes = mask_tile_classes(attn_ops.kernel_mask(m), consts["BS"], consts["BN"])
    assert torch.equal(args[1], want_classes)
    if kind == "holes":
        assert set(want_classes.unique().tolist()) == {0, 1, 2}


def test_masked_prefill_trusts_the_classes():
    """The attention reads a full tile's class instead of its mask: mark a partial tile full and
    the hidden keys in it count (so the classes are what decides, and a full tile costs no mask
    read)."""
    B, Hq, Hkv, Sq, Skv, D = 1, 2, 1, 40, 64, 64
    m = hf_mask(B, Sq, Skv, Skv - Sq)  # causal over a cache: the one KV tile is partial
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Skv, D)
    out = torch.full((B, Sq, Hq, D), float("nan"), dtype=q.dtype)
    tiles, attn = attn_ops.launches(q, k, v, m, out, 0.2, False)
    run_launch(tiles)
    assert tiles[2][1].tolist() == [[[1]]]
    run_launch(attn)
    causal = out.transpose(1, 2).clone()
    tiles[2][1].fill_(2)
    run_launch(attn)
    torch.testing.assert_close(causal, cutile_kernels.attention_reference(q, k, v, m, 0.2, False), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.transpose(1, 2), cutile_kernels.attention_reference(q, k, v, None, 0.2, False),
                               rtol=1e-4, atol=1e-4)


#: (B, Hq, Hkv, Sq, Skv, kv_len, D, extra): a static cache of Skv slots holding kv_len keys.
KV_LEN_CASES = [
    (1, 8, 2, 1, 600, 1, 64, {}),                       # one key filled
    (2, 8, 2, 1, 600, 129, 64, {}),                     # one past a tile
    (1, 4, 2, 1, 300, 300, 128, {}),                    # full
    (1, 8, 1, 1, 1000, 257, 64, {}),                    # split-KV by the heuristic over the whole cache
    (1, 8, 2, 1, 600, 130, 64, {"splits": 5}),          # more splits than filled tiles: some get none
    (2, 4, 2, 4, 500, 77, 64, {}),                      # a chunk of 4 queries, causal from kv_len
    (1, 4, 4, 3, 200, 90, 96, {"window": 20}),          # window counted from kv_len
    (2, 4, 2, 1, 300, 40, 64, {"mask": True}),          # with a padding mask over every slot
    (1, 4, 2, 1, 2048, 1500, 64, {"splits": 1}),        # the long tile (256 keys), its tail partly filled
    (2, 24, 8, 1, 300, 150, 128, {}),                   # Phi-4-mini's group of 3, one KV head a batch
    (2, 6, 1, 1, 200, 77, 64, {"mask": True}),          # group 6 with a padding mask (per row: no merge)
    (3, 12, 2, 1, 200, 77, 64, {"shared_mask": True}),  # group 6, a mask shared by the batch: batches of one KV head
]


@pytest.mark.parametrize("case", KV_LEN_CASES, ids=lambda c: "-".join(map(str, c[:7])) + "".join(f"-{k}{v}" for k, v in c[7].items()))
def test_emulated_kernel_reads_only_the_filled_keys(case):
    """With kv_len the kernel equals attention over the first kv_len keys: the slots after them
    hold NaN here, so reading one shows."""
    B, Hq, Hkv, Sq, Skv, n, D, extra = case
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Skv, D)
    k[:, :, n:], v[:, :, n:] = float("nan"), float("nan")
    mask = None
    if extra.get("mask"):
        mask = hf_mask(B, Sq, Skv, n - Sq, left_padding(B, n, [0, 7][:B]))
    if extra.get("shared_mask"):  # one row for the batch (stride 0), hiding slots 3..9 of every row
        shared = left_padding(1, n, [0])
        shared[:, 3:10] = False
        mask = hf_mask(1, Sq, Skv, n - Sq, shared).expand(B, 1, Sq, Skv)
    kw = {"causal": mask is None, "window": extra.get("window")}
    kv_len = torch.tensor(n)
    got, kernels = emulated_attention(q, k, v, mask, 0.2, splits=extra.get("splits"), sms=extra.get("sms", 132),
                                      kv_len=kv_len, **kw)
    want = cutile_kernels.attention_reference(q[..., :, :], k[:, :, :n], v[:, :, :n],
                                              None if mask is None else mask[..., :n], 0.2, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    ref = cutile_kernels.attention_reference(q, k, v, mask, 0.2, kv_len=kv_len, **kw)
    torch.testing.assert_close(ref, want, rtol=1e-6, atol=1e-6)  # the reference's own kv_len path
    if "splits" in extra:
        assert kernels == ["attention", "attention_combine"][:1 + (extra["splits"] > 1)]


def test_kv_len_must_be_a_device_tensor():
    q, k, v = make_qkv(1, 4, 2, 1, 9, 16)
    with pytest.raises(TypeError, match="kv_len must be a one-element int64 tensor"):
        cutile_kernels.attention(q, k, v, kv_len=5)
    with pytest.raises(ValueError, match="one int64 element"):
        cutile_kernels.attention(q, k, v, kv_len=torch.tensor(5, dtype=torch.int32))


def test_emulator_flags_undefined_behaviour():
    from cutile_numpy import UndefinedBehaviour, load

    import numpy as np

    with pytest.raises(UndefinedBehaviour, match="entirely outside"):
        load(np.zeros((4, 4)), (1, 0), (4, 4))
    assert np.isnan(load(np.zeros((3,)), (0,), (4,))[3])  # undetermined padding is visible


# ---------------------------------------------------------------------------------------------
# CPU: host-side choices
# ---------------------------------------------------------------------------------------------

def test_tiles_and_splits():
    assert attn_ops.tiles_for(64, 2048, 4) == (64, 1, 128, 64)
    assert attn_ops.tiles_for(80, 1, 4) == (128, 4, 4, 64)        # decode: 4 heads of a group x 4 queries
    assert attn_ops.tiles_for(128, 7, 6) == (128, 2, 8, 64)       # group 6: 2 heads per tile
    assert attn_ops.tiles_for(128, 16, 1) == (128, 1, 16, 64)
    assert attn_ops.tiles_for(64, 1, 4) == (64, 4, 4, 128)
    # Keys per decode tile: the long tile only for one unsplit pass over a long cache.
    assert attn_ops.decode_bn(128, keys=2047, splits=1) == 64
    assert attn_ops.decode_bn(128, keys=2048, splits=1) == 256
    assert attn_ops.decode_bn(128, keys=8192, splits=4) == 64
    assert attn_ops.decode_bn(64, keys=4096, splits=1) == 256
    assert attn_ops.decode_bn(64, keys=169, splits=1) == 128
    assert attn_ops.decode_bn(256, keys=4096, splits=1) == 64
    assert attn_ops.tiles_for(32, 17, 2) == (64, 1, 128, 64)
    assert attn_ops.tiles_for(256, 5000, 8)[0] == 256
    assert attn_ops.tiles_for(512, 1, 1) is None
    assert attn_ops.num_splits(blocks=8, keys=1024, sms=132) == 4          # capped by 256 keys per split
    assert attn_ops.num_splits(blocks=8, keys=1 << 20, sms=132) == 16      # about one block per SM
    assert attn_ops.num_splits(blocks=1, keys=1 << 20, sms=132) == 64      # at most 64 splits
    assert attn_ops.num_splits(blocks=64, keys=4096, sms=132) == 2
    assert attn_ops.num_splits(blocks=128, keys=4096, sms=132) == 1        # more blocks than half the SMs
    assert attn_ops.num_splits(blocks=67, keys=4096, sms=132) == 1
    assert attn_ops.num_splits(blocks=66, keys=4096, sms=132) == 2
    assert attn_ops.num_splits(blocks=1, keys=392, sms=132) == 1           # too short to split
    assert attn_ops.num_splits(blocks=1, keys=511, sms=132) == 1
    assert attn_ops.num_splits(blocks=1, keys=512, sms=132) == 2


def test_groups_no_tile_divides_run_as_batches_of_one_kv_head():
    assert [attn_ops.padded_heads(g) for g in (1, 2, 3, 4, 5, 6, 7, 8, 12)] == [None, None, 4, None, 4, 4, 4, None, None]
    q, k, v = make_qkv(16, 24, 8, 1, 169, 128, torch.float32)  # Phi-4-mini's heads, batch 16
    out = torch.empty(16, 1, 24, 128)
    (plan,) = attn_ops.launches(q, k, v, None, out, 0.1, sms=132)
    _, want, args, _, grid = plan
    assert dict(want)["HB"] == 4 and dict(want)["BS"] == 4 and grid({}) == (1, 16 * 8, 1)
    assert args[0].shape == (128, 3, 1, 128) and args[1].shape == (128, 1, 169, 128)
    assert args[5].shape == (128, 3, 1, 128) and args[5].data_ptr() == out.data_ptr()
    # A mask per row, or rows of several positions: the divisor's tiles (HB 1).
    mask = hf_mask(16, 1, 169, 168, left_padding(16, 169, [0] * 15 + [3]))
    (plan,) = attn_ops.launches(q, k, v, mask, out, 0.1, sms=132)
    assert dict(plan[1])["HB"] == 1 and plan[4]({}) == (1, 16 * 24, 1)
    q4, k4, v4 = make_qkv(2, 24, 8, 4, 169, 128, torch.float32)
    (plan,) = attn_ops.launches(q4, k4, v4, None, torch.empty(2, 4, 24, 128), 0.1, sms=132)
    assert dict(plan[1])["HB"] == 1


def test_kernel_mask_views_without_copies():
    m = hf_mask(1, 5, 9, 4).expand(3, 1, 5, 9)
    km = attn_ops.kernel_mask(m)
    assert km.shape == (1, 5, 9) and km.dtype == torch.int8 and km.data_ptr() == m.data_ptr()
    m2 = hf_mask(3, 5, 9, 4, left_padding(3, 9, [0, 1, 2]))
    km2 = attn_ops.kernel_mask(m2)
    assert km2.shape == (3, 5, 9) and torch.equal(km2.bool(), m2[:, 0])
    assert attn_ops.kernel_mask(None) is None


def test_launch_plan_layout_and_decode_split():
    B, Hq, Hkv, D = 1, 32, 8, 64
    q, k, v = make_qkv(B, Hq, Hkv, 1, 4096, D, torch.float32)
    out = torch.empty(B, 1, Hq, D)
    plan = attn_ops.launches(q, k, v, None, out, 0.125, sms=132)
    assert [p[0] for p in plan] == ["attention", "attention_combine"]
    kernel, want, args, n_inputs, grid = plan[0]
    assert dict(want) == {"D": 64, "HB": 4, "BS": 4, "BN": 128} and n_inputs == 5
    splits = args[-1]
    assert grid({}) == (splits, B * Hq // 4, 1) and splits > 1
    assert args[5].shape == (B, Hq, 1, D) and args[5].data_ptr() == out.data_ptr()  # o is a view of out
    assert args[-3] == 0  # has_len
    length = torch.tensor(100)
    with_len = attn_ops.launches(q, k, v, None, out, 0.125, sms=132, kv_len=length)[0][2]
    assert with_len[4].shape == (1,) and with_len[4].data_ptr() == length.data_ptr() and with_len[-3] == 1
    assert with_len[-1] == splits  # chosen for the whole cache: a graph replays them at every length
    prefill = attn_ops.launches(*make_qkv(B, Hq, Hkv, 2048, 2048, D, torch.float32), None,
                                torch.empty(B, 2048, Hq, D), 0.125, sms=132)
    assert len(prefill) == 1 and prefill[0][2][-1] == 1  # prefill never splits
    # Keys per decode tile: the long tile for one unsplit pass over a long cache (batch 16: 128
    # blocks, no split), the short one for a short cache; at head dim 128 the short tile is 64.
    for Hkv_, D_, skv, bn in ((8, 64, 4096, 256), (8, 64, 169, 128), (8, 128, 4096, 256), (8, 128, 169, 64)):
        q16, k16, v16 = make_qkv(16, Hq, Hkv_, 1, skv, D_, torch.float32)
        (plan16,) = attn_ops.launches(q16, k16, v16, None, torch.empty(16, 1, Hq, D_), 0.125, sms=132)
        assert dict(plan16[1])["BN"] == bn and plan16[2][-1] == 1, (D_, skv)


# ---------------------------------------------------------------------------------------------
# CPU: the custom op
# ---------------------------------------------------------------------------------------------

def test_custom_op_passes_opcheck():
    q, k, v = make_qkv(2, 4, 2, 5, 7, 16, torch.float32)
    m = hf_mask(2, 5, 7, 2, left_padding(2, 7, [0, 3]))
    utils = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(attn_ops._attention.op, (q, k, v, m, 0.25, False, 0, 0.0, None), test_utils=utils)
    torch.library.opcheck(attn_ops._attention.op, (q, k, v, None, 0.25, True, 3, 5.0, None), test_utils=utils)
    torch.library.opcheck(attn_ops._attention.op, (q, k, v, m, 0.25, False, 0, 0.0, torch.tensor(4)),
                          test_utils=utils)


def test_fake_gives_the_output_layout():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 7, 8, 64, dtype=torch.bfloat16).transpose(1, 2)
        k = torch.empty(2, 2, 30, 64, dtype=torch.bfloat16)
        out = attn_ops._attention.op(q, k, k, None, 0.1, True, 0, 0.0, None)
    assert out.shape == (2, 8, 7, 64) and out.dtype == torch.bfloat16 and out.transpose(1, 2).is_contiguous()


def test_gradients_follow_the_reference():
    q, k, v = (t.requires_grad_(True) for t in make_qkv(1, 4, 2, 6, 9, 8))
    out = cutile_kernels.attention(q, k, v, scale=0.3, window=4)
    assert out.grad_fn is not None and "attention" in out.grad_fn.name()
    out.square().sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    cutile_kernels.attention_reference(q, k, v, None, 0.3, True, 4).square().sum().backward()
    for a, b in zip(got, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_compile_on_cpu_matches_eager():
    q, k, v = make_qkv(1, 4, 2, 5, 5, 16, torch.float32)
    fn = torch.compile(lambda q, k, v: cutile_kernels.attention(q * 2, k, v, window=3) + 1, backend="eager",
                       fullgraph=True)
    torch.testing.assert_close(fn(q, k, v), cutile_kernels.attention_reference(q * 2, k, v, window=3) + 1)


# ---------------------------------------------------------------------------------------------
# CPU: the attention function and its registration
# ---------------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _source_attention_registered(request, monkeypatch):
    """The tests here patch this package's op (``attn_ops``); a test that ran before them in the
    process and kernelized imported the build's copy of the package, whose function is then the one
    registered as ``"cutile"``. Each test (but the one that checks the registration) gets this
    package's functions registered."""
    from transformers import AttentionInterface

    if request.function.__name__ == "test_registered_with_transformers":
        return
    monkeypatch.setitem(AttentionInterface._global_mapping, lattn.NAME, lattn.cutile_attention_forward)
    monkeypatch.setitem(AttentionInterface._global_mapping, lattn.KERNEL_NAME, lattn.cutile_kernel_attention_forward)


def _module(groups, causal=True, training=False):
    return types.SimpleNamespace(is_causal=causal, num_key_value_groups=groups, training=training)


def test_registered_with_transformers():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    # This package's function, or a build copy's: kernelize imports the build's copy of the
    # package, which registers its own (the same code) when an earlier test of the process ran it.
    for name, forward in (("cutile", lattn.cutile_attention_forward),
                          ("cutile_kernel", lattn.cutile_kernel_attention_forward)):
        registered = AttentionInterface._global_mapping[name]
        assert registered is forward or (
            registered.__qualname__ == forward.__qualname__ and registered.__module__.endswith(".layers.attention")
            and registered.__code__.co_code == forward.__code__.co_code)
        assert ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[name] is sdpa_mask


def _route_as_on_a_gpu(monkeypatch):
    """``"cutile"`` routes as on a GPU in a 16-bit model (the tests' float64 calls included)."""
    monkeypatch.setattr(lattn, "_KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(lattn, "KERNEL_DTYPES", (*lattn.KERNEL_DTYPES, torch.float32, torch.float64))


@pytest.mark.parametrize("forward", ["cutile", "cutile_kernel"])
@pytest.mark.parametrize("kind", ["prefill", "decode", "static-cache prefill", "padded", "window, no mask",
                                  "padded static decode"])
def test_attention_function_matches_sdpa_forward(kind, forward, monkeypatch):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _route_as_on_a_gpu(monkeypatch)  # "cutile" then gives the padded decodes to the kernel
    B, Hq, Hkv, D = 2, 4, 2, 32
    mask, window = None, None
    if kind == "prefill":
        Sq = Skv = 9
    elif kind == "decode":
        Sq, Skv = 1, 12
    elif kind == "static-cache prefill":  # sdpa_mask returns None; the cache holds 20 slots, 6 filled
        Sq, Skv = 6, 20
    elif kind == "padded":
        Sq = Skv = 9
        mask = hf_mask(B, Sq, Skv, 0, left_padding(B, Skv, [0, 4]))
    elif kind == "window, no mask":
        Sq = Skv = 9
        window = 30  # sdpa_mask skips the mask only when the window cannot bite
    else:
        Sq, Skv = 1, 16
        mask = hf_mask(B, Sq, Skv, 7, left_padding(B, 8, [0, 4]))
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Skv, D)
    fn = {"cutile": lattn.cutile_attention_forward, "cutile_kernel": lattn.cutile_kernel_attention_forward}[forward]
    got, w = fn(_module(Hq // Hkv), q, k, v, mask, scaling=0.2, sliding_window=window)
    want, _ = sdpa_attention_forward(_module(Hq // Hkv), q, k, v, mask, scaling=0.2)
    assert w is None and got.shape == (B, Sq, Hq, D) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_unsupported_inputs_take_eager_and_say_so(caplog, monkeypatch):
    """``"cutile_kernel"``: what the kernel cannot take goes to the model's eager attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = make_qkv(2, 4, 2, 5, 5, 16)
    boolean = hf_mask(2, 5, 5, 0, left_padding(2, 5, [0, 2]))
    additive = torch.zeros(boolean.shape, dtype=torch.float64).masked_fill(~boolean, torch.finfo(torch.float64).min)
    with caplog.at_level("WARNING", logger="cutile_kernels"):
        got, _ = lattn.cutile_kernel_attention_forward(_module(2), q, k, v, additive, scaling=0.25)
    want, _ = sdpa_attention_forward(_module(2), q, k, v, additive, scaling=0.25)
    rows = boolean.any(-1)[:, 0]  # padding queries see nothing: eager averages, sdpa gives NaN there
    torch.testing.assert_close(got[rows], want[rows], rtol=1e-5, atol=1e-6)  # eager: float32 softmax
    assert "falls back" in caplog.text and "float64" in caplog.text
    # Dropout while training: eager with dropout (p=1 drops everything: zeros prove it ran).
    got, _ = lattn.cutile_kernel_attention_forward(_module(2, training=True), q, k, v, None, scaling=0.25,
                                                   dropout=1.0)
    assert torch.equal(got, torch.zeros_like(got))
    monkeypatch.setenv("CUTILE_KERNELS_STRICT", "1")
    for fn in (lattn.cutile_kernel_attention_forward, lattn.cutile_attention_forward):  # sdpa has no sinks either
        with pytest.raises(cutile_kernels.FallbackError, match="sinks"):
            fn(_module(2), q, k, v, None, s_aux=torch.zeros(4))


@pytest.fixture
def route_spy(monkeypatch):
    """Counts the calls ``"cutile"`` gives the kernel (the op) and transformers' sdpa attention."""
    calls = {"kernel": 0, "sdpa": 0}
    op, sdpa = lattn.attention, lattn._SDPA

    def kernel(*args, **kwargs):
        calls["kernel"] += 1
        return op(*args, **kwargs)

    def via_sdpa(*args, **kwargs):
        calls["sdpa"] += 1
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(lattn, "attention", kernel)
    monkeypatch.setattr(lattn, "_SDPA", via_sdpa)
    _route_as_on_a_gpu(monkeypatch)
    return calls


def test_route_keeps_sdpa_where_the_kernel_has_no_variant(route_spy, monkeypatch):
    """Off the GPU, in float32 / float64 or past head_dim 256 only a softcap (which sdpa lacks) takes
    the op (its reference, or its fallback, there)."""
    q, k, v = make_qkv(2, 4, 2, 1, 12, 16)
    mask = hf_mask(2, 1, 12, 11, left_padding(2, 12, [0, 3]))
    length = torch.tensor(12)
    assert lattn.route(q, mask, None, length)  # as on a GPU, in a dtype the kernel takes
    assert not lattn.route(make_qkv(2, 4, 2, 1, 12, 512)[0], mask, None, length)  # head_dim 512
    monkeypatch.setattr(lattn, "KERNEL_DTYPES", (torch.bfloat16, torch.float16))
    assert not lattn.route(q, mask, None, length)  # float64
    assert lattn.route(q.to(torch.bfloat16), mask, None, length)
    monkeypatch.setattr(lattn, "_KERNEL_DEVICES", ("cuda",))
    assert not lattn.route(q.to(torch.bfloat16), mask, None, length)  # a CPU tensor
    lattn.cutile_attention_forward(_module(2), q, k, v, mask, scaling=0.25)
    lattn.cutile_attention_forward(_module(2), q, k, v, mask, scaling=0.25, softcap=0.5)
    assert route_spy == {"kernel": 1, "sdpa": 1}


@pytest.mark.parametrize("kind,want", [
    ("prefill", "sdpa"), ("padded prefill", "sdpa"), ("decode", "sdpa"), ("padded decode", "kernel"),
    ("static decode, mask", "kernel"), ("static decode, filled length", "kernel"),
    ("static decode, filled length, no mask", "kernel"), ("16-query chunk, mask", "kernel"),
    ("17-query chunk, mask", "sdpa"), ("softcap prefill", "kernel"), ("softcap decode", "kernel"),
    ("windowed prefill, mask", "sdpa")])
def test_route_sends_each_call_where_it_is_fastest(kind, want, route_spy):
    """``"cutile"`` hands the calls the kernel is slower on (H200) to sdpa and keeps the rest, and
    both give the reference's values."""
    B, Hq, Hkv, D = 2, 4, 2, 16
    Sq = {"prefill": 20, "padded prefill": 20, "softcap prefill": 20, "16-query chunk, mask": 16,
          "17-query chunk, mask": 17, "windowed prefill, mask": 20}.get(kind, 1)
    Skv = 24 if "static" in kind else (Sq + 7 if Sq > 1 else 12)
    seen = Skv if "static" not in kind else 10
    pads = [0, 3] if "padded" in kind else [0, 0]
    mask = None
    window = 8 if "windowed" in kind else None  # a sliding layer whose window hides keys: sdpa's (H200 sweep)
    if ("mask" in kind and "no mask" not in kind) or "padded" in kind or kind == "static decode, filled length":
        mask = hf_mask(B, Sq, Skv, seen - Sq, left_padding(B, seen, pads), window=window)
    length = {"cutile_kv_len": torch.tensor(seen)} if "filled length" in kind else {}
    if window:
        length["sliding_window"] = window
    softcap = 0.3 if "softcap" in kind else None
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Skv, D)
    got, _ = lattn.cutile_attention_forward(_module(Hq // Hkv), q, k, v, mask, scaling=0.25, softcap=softcap,
                                            **length)
    assert route_spy == {"kernel": int(want == "kernel"), "sdpa": int(want == "sdpa")}
    causal = mask is None
    if causal and Skv > Sq > 1:  # sdpa's upper-left causal mask: the first Sq keys
        k, v = k[:, :, :Sq], v[:, :, :Sq]
    ref = attn_ops.attention_reference(q, k, v, mask, 0.25, causal and Sq > 1, None, softcap,
                                       kv_len=length.get("cutile_kv_len"))
    rows = torch.ones(B, Sq, dtype=torch.bool) if mask is None else mask.any(-1)[:, 0]
    torch.testing.assert_close(got[rows], ref.transpose(1, 2)[rows], rtol=1e-10, atol=1e-10)


def test_route_hands_what_the_kernel_cannot_take_to_sdpa(caplog, monkeypatch, route_spy):
    """``"cutile"``: an additive mask, dropout while training or a position bias go to sdpa (which
    takes them), said once; an error under ``CUTILE_KERNELS_STRICT=1``."""
    q, k, v = make_qkv(2, 4, 2, 1, 5, 16)
    boolean = hf_mask(2, 1, 5, 4, left_padding(2, 5, [0, 2]))
    additive = torch.zeros(boolean.shape, dtype=torch.float64).masked_fill(~boolean, torch.finfo(torch.float64).min)
    with caplog.at_level("WARNING", logger="cutile_kernels"):
        got, _ = lattn.cutile_attention_forward(_module(2), q, k, v, additive, scaling=0.25)
    want, _ = lattn._SDPA(_module(2), q, k, v, boolean, scaling=0.25)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert "transformers' sdpa attends" in caplog.text and "float64" in caplog.text
    bias = torch.randn(1, 4, 1, 5, dtype=torch.float64)
    got, _ = lattn.cutile_attention_forward(_module(2), q, k, v, None, scaling=0.25, position_bias=bias)
    # Dropout while training reaches sdpa (p = 1 drops every weight: zeros prove it).
    got, _ = lattn.cutile_attention_forward(_module(2, training=True), q, k, v, boolean, dropout=1.0)
    assert torch.equal(got, torch.zeros_like(got))
    assert route_spy == {"kernel": 0, "sdpa": 4}
    monkeypatch.setenv("CUTILE_KERNELS_STRICT", "1")
    with pytest.raises(cutile_kernels.FallbackError, match="dropout"):
        lattn.cutile_attention_forward(_module(2, training=True), q, k, v, boolean, dropout=0.5)


@pytest.mark.parametrize("plan", ["prefill", "masked prefill", "decode", "masked decode", "split", "kv_len"])
def test_launch_inputs_never_alias_with_prepared_stand_ins(plan, monkeypatch):
    """With the stand-ins kept (what ``prepare`` does on a GPU: one array per kind and device), no
    launch gets one array as two inputs, which the launcher refuses as aliased (the call would then
    take the reference, or raise under CUTILE_KERNELS_STRICT=1)."""
    from cutile_kernels import registry

    cpu = torch.device("cpu")
    kept = {(kind, cpu, dp if kind == "part" else 0): attn_ops._new_dummy(kind, cpu, dp if kind == "part" else 0)
            for kind in attn_ops._DUMMY_KINDS for dp in (kattn.HEAD_DIMS if kind == "part" else (0,))}
    monkeypatch.setattr(attn_ops, "_DUMMIES", kept)
    Sq = 1 if "decode" in plan or plan == "kv_len" else 40
    B, Hq, Hkv, Skv, D = 2, 4, 2, 200, 64
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Skv, D)
    mask = hf_mask(B, Sq, Skv, Skv - Sq) if "masked" in plan else None
    kv_len = torch.tensor([150]) if plan == "kv_len" else None
    out = torch.empty(B, Sq, Hq, D, dtype=q.dtype)
    steps = attn_ops.launches(q, k, v, mask, out, 0.1, causal=mask is None, splits=3 if plan == "split" else None,
                              sms=132, kv_len=kv_len)
    assert steps[-1 if plan != "split" else 0][0] == "attention"
    for kernel, _want, args, n_inputs, _grid in steps:
        assert registry.overlapping_pair([a for a in args[:n_inputs]]) is None, (kernel, plan)


def test_stand_ins_are_kept_only_when_prepared(monkeypatch):
    """A launch's stand-in arrays are made per launch unless ``prepare`` made them for the device
    (nothing kept from inside a call: it may run in torch.compile's CUDA-graph warm-up); prepare
    does nothing off the GPU; the attention patches call it for a model attending with ours."""
    import families

    from cutile_kernels.layers import models

    monkeypatch.setattr(attn_ops, "_DUMMIES", {})
    cpu = torch.device("cpu")
    a, b = attn_ops._dummy("lse", cpu), attn_ops._dummy("lse", cpu)
    assert a is not b and a.shape == (1, 1, 1) and a.dtype == torch.float32 and not a.any()
    assert attn_ops._dummy("part", cpu, 128).shape == (1, 1, 1, 128)
    assert attn_ops._dummy("kv_len", cpu).dtype == torch.int64 and attn_ops._dummy("mask", cpu).dtype == torch.int8
    attn_ops.prepare("cpu")
    assert attn_ops._DUMMIES == {}
    prepared = []
    monkeypatch.setattr(models, "prepare_devices", prepared.append)
    switched, kernel_only, eager = families.model("llama"), families.model("llama", attn="cutile_kernel"), \
        families.model("llama", attn="eager")
    for m in (switched, kernel_only, eager):
        models.patch_cutile_attention(m)
    assert prepared == [switched, kernel_only] and switched.config._attn_implementation == "cutile"
    assert kernel_only.config._attn_implementation == "cutile_kernel" and eager.config._attn_implementation == "eager"


def test_cutile_attention_patch_steps_aside_for_continuous_batching_and_missing_builds(monkeypatch, caplog):
    """transformers' continuous batching refuses attention implementations but sdpa, eager and
    flash: a switched model attends with sdpa again when it starts (said); unpatch removes the
    hook. A GPU without a build of ours (and no JIT) keeps sdpa."""
    import families

    from cutile_kernels.layers import models

    model = families.model("llama", layers=2)
    seen = []
    monkeypatch.setattr(type(model), "init_continuous_batching",
                        lambda self, *a, **k: seen.append(self.config._attn_implementation) or "manager",
                        raising=False)
    assert models.patch_cutile_attention(model) == 2 and model.config._attn_implementation == "cutile"
    with caplog.at_level("WARNING", logger="cutile_kernels"):
        assert model.init_continuous_batching() == "manager"
    assert seen == ["sdpa"] and "continuous batching takes sdpa" in caplog.text
    assert models.unpatch_cutile_attention(model) == 0 and "init_continuous_batching" not in model.__dict__
    assert models.patch_cutile_attention(model) == 2  # again, on sdpa
    assert models.unpatch_cutile_attention(model) == 2 and model.config._attn_implementation == "sdpa"
    assert "init_continuous_batching" not in model.__dict__
    monkeypatch.setattr(models, "kernel_missing_on", lambda m: "no build of ours runs on cuda:0")
    assert models.sdpa_attention_verdict(model) == "no build of ours runs on cuda:0"
    assert models.patch_cutile_attention(model) == 0 and model.config._attn_implementation == "sdpa"


def test_output_attentions_warns_once_that_there_are_no_weights(caplog):
    """As sdpa does: asked for attention weights, the model's output has none; one warning. A call
    that falls back to eager (which returns weights) does not warn."""
    import families

    model = families.model("llama", attn="cutile_kernel")
    lattn._no_weights_warning.cache_clear()
    q, k, v = make_qkv(1, 4, 2, 5, 5, 16)
    with caplog.at_level("WARNING", logger="cutile_kernels"):
        _, weights = lattn.cutile_kernel_attention_forward(_module(2, training=True), q, k, v, None, scaling=0.25,
                                                    dropout=0.5, output_attentions=True)
    assert weights is not None and "no attention weights" not in caplog.text
    ids = torch.randint(1, 256, (1, 5), generator=torch.Generator().manual_seed(3))
    with caplog.at_level("WARNING", logger="cutile_kernels"), torch.no_grad():
        out = model(ids, output_attentions=True)
        model(ids, output_attentions=True)
        plain = model(ids)
    assert not out.attentions
    assert caplog.text.count("returns no attention weights") == 1
    torch.testing.assert_close(out.logits, plain.logits, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Models: attn_implementation="cutile" against the stock model
# ---------------------------------------------------------------------------------------------

def small_configs():
    """Two-layer configs of the four families, shrunk for the CPU, with their attention edges:
    GQA 2, GQA 6, one KV head, head_dim 80, a short sliding window on every / the second layer."""
    from transformers import AutoConfig

    common = dict(vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)
    return {
        "llama": AutoConfig.for_model("llama", num_attention_heads=4, num_key_value_heads=2, head_dim=32, **common),
        "qwen3": AutoConfig.for_model("qwen3", num_attention_heads=6, num_key_value_heads=1, head_dim=16, **common),
        "qwen2-window": AutoConfig.for_model("qwen2", num_attention_heads=6, num_key_value_heads=1,
                                             use_sliding_window=True, sliding_window=5, max_window_layers=1,
                                             **common),
        "mistral-window": AutoConfig.for_model("mistral", num_attention_heads=4, num_key_value_heads=1,
                                               head_dim=80, sliding_window=6, **common),
    }


def build_models(cfg, dtype, device, seed=0, attn="cutile_kernel"):
    """The stock (sdpa) and ours (``attn``: by default the kernel on every call it takes) versions
    of one randomly initialised model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    # Each model gets its own config: from_config records attn_implementation on the config object,
    # so a shared one made the "stock" model run our attention too (seen on the H200).
    with torch.device(device):  # initialise where the model runs (the real vocabularies are large)
        stock = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa", dtype=torch.float32)
        with torch.no_grad():
            for name, p in stock.named_parameters():
                if "norm" in name and p.dim() == 1:
                    p.copy_(1 + 0.2 * torch.randn_like(p))
        ours = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn, dtype=torch.float32)
    ours.load_state_dict(stock.state_dict())
    assert ours.config._attn_implementation == attn and stock.config._attn_implementation == "sdpa"
    assert all(getattr(m, "config", stock.config)._attn_implementation == "sdpa" for m in stock.modules())
    return stock.to(device=device, dtype=dtype).eval(), ours.to(device=device, dtype=dtype).eval()


def padded_batch(vocab, lengths, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), S), generator=g)
    mask = torch.zeros(len(lengths), S, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, : S - n] = 0
        mask[b, S - n:] = 1
    return ids.to(device), mask.to(device)


def forward_logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.float()


def chunked_logits(model, ids, mask, chunks):
    """Prefill in chunks over a DynamicCache (each chunk attends to the cache and itself)."""
    from transformers import DynamicCache

    cache, out, start = DynamicCache(config=model.config), [], 0
    with torch.no_grad():
        for n in chunks:
            out.append(model(input_ids=ids[:, start:start + n], attention_mask=mask[:, :start + n],
                             past_key_values=cache, use_cache=True).logits.float())
            start += n
    return torch.cat(out, 1)


def generate_scores(model, ids, mask, cache, steps=6):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                             cache_implementation=cache, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=0, min_new_tokens=steps, disable_compile=True)
    return out.sequences, torch.stack(out.scores, 1).float()


def assert_generate_matches(stock, ours, ids, mask, cache):
    """generate() over ``cache``: ``ours`` gives ``stock``'s tokens, and its scores within 1e-4."""
    seq_s, sc_s = generate_scores(stock, ids, mask, cache)
    seq_o, sc_o = generate_scores(ours, ids, mask, cache)
    assert torch.equal(seq_o, seq_s), cache
    torch.testing.assert_close(sc_o, sc_s, rtol=1e-4, atol=1e-4)


def generate_errors(ref, models, ids, mask, cache, steps=8):
    """{name: relative L2 error of each generate() step's scores against the float32 ``ref``
    model's teacher-forced logits of the same sequence} for ``models`` {name: model} (GPU)."""
    errs = {}
    for name, model in models.items():
        seq, scores = generate_scores(model, ids, mask, cache, steps=steps)
        full_mask = torch.cat([mask, torch.ones(mask.shape[0], steps, dtype=mask.dtype, device=mask.device)], 1)
        tf = forward_logits(ref, seq, full_mask)[:, ids.shape[1] - 1:-1]
        fin = torch.isfinite(scores)  # min_new_tokens sets EOS to -inf
        errs[name] = ((scores - tf)[fin].norm() / tf[fin].norm()).item()
    return errs


def valid(logits, mask):
    return logits[mask.bool()]


@pytest.fixture(params=["reference", "emulated kernel"])
def cpu_path(request, monkeypatch):
    """On the CPU the op computes its reference; "emulated kernel" routes it through the NumPy
    interpreter of the cuTile kernel instead, so the model tests exercise the kernel's logic."""
    calls = []
    if request.param == "emulated kernel":
        def via_kernel(q, k, v, mask=None, scale=None, causal=True, window=None, softcap=None, kv_len=None):
            calls.append((tuple(q.shape), tuple(k.shape), mask is not None, window, kv_len is not None))
            return emulated_attention(q, k, v, mask, scale, causal, window, softcap, kv_len=kv_len)[0]

        monkeypatch.setattr(attn_ops, "attention_reference", via_kernel)
    yield request.param
    if request.param == "emulated kernel":  # the kernel served prefill, decode, masked and unmasked calls
        assert any(c[0][2] == 1 for c in calls) and any(c[0][2] > 1 for c in calls)
        assert any(c[2] for c in calls) and any(not c[2] for c in calls)


@pytest.mark.parametrize("family", list(small_configs()))
def test_cpu_model_matches_stock(family, cpu_path):
    cfg = small_configs()[family]
    stock, ours = build_models(cfg, torch.float32, "cpu")
    ids, mask = padded_batch(cfg.vocab_size, [11, 7, 3], "cpu")
    # Left-padded batch: every real position's logits agree.
    want, got = forward_logits(stock, ids, mask), forward_logits(ours, ids, mask)
    torch.testing.assert_close(valid(got, mask), valid(want, mask), rtol=1e-4, atol=1e-4)
    # Each row alone gives the same logits as inside the padded batch.
    for b, n in enumerate([11, 7, 3]):
        alone = forward_logits(ours, ids[b:b + 1, -n:], mask[b:b + 1, -n:])
        torch.testing.assert_close(alone[0], got[b, -n:], rtol=1e-4, atol=1e-4)
    # Chunked prefill over a cache equals the one-shot forward.
    chunked = chunked_logits(ours, ids, mask, [4, 5, 2])
    torch.testing.assert_close(valid(chunked, mask), valid(want, mask), rtol=1e-4, atol=1e-4)
    # generate() with a DynamicCache and a StaticCache: same tokens and scores as stock.
    for cache in ("dynamic", "static"):
        assert_generate_matches(stock, ours, ids, mask, cache)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_patched_model_passes_the_static_cache_length(family, monkeypatch):
    """Our reproduced attention forwards (the default patches) pass a StaticLayer's filled length
    to the kernel: the emulated kernel then reads no unfilled slot, and generate() gives stock's
    tokens and scores over a StaticCache (and no length over a DynamicCache)."""
    cfg = small_configs()[family]
    stock, ours = build_models(cfg, torch.float32, "cpu")
    cutile_kernels.patch(ours)
    calls = []

    def via_kernel(q, k, v, mask=None, scale=None, causal=True, window=None, softcap=None, kv_len=None):
        calls.append(None if kv_len is None else (int(kv_len), k.shape[2]))
        return emulated_attention(q, k, v, mask, scale, causal, window, softcap, kv_len=kv_len)[0]

    monkeypatch.setattr(attn_ops, "attention_reference", via_kernel)
    ids, mask = padded_batch(cfg.vocab_size, [11, 7, 3], "cpu")
    for cache in ("dynamic", "static"):
        calls.clear()
        assert_generate_matches(stock, ours, ids, mask, cache)
        lengths = [c for c in calls if c is not None]
        if cache == "dynamic":
            assert not lengths
        else:  # every layer, every step: the prompt (11), then one more a step, in a cache of 16
            assert len(lengths) == len(calls) == 6 * cfg.num_hidden_layers
            assert sorted({n for n, _ in lengths}) == list(range(11, 17)), lengths
            assert {s for _, s in lengths} == {16}


def test_patched_sliding_layers_pass_their_length_until_the_window_fills(monkeypatch):
    """A ``StaticSlidingWindowLayer`` passes its filled length while its window has room (Mistral,
    window 14: the 11-token prompt, then steps at 12, 13 and 14 keys) and none once it rolls (15 and
    16 tokens: its slots then hold the last 14); generate() gives stock's tokens and scores."""
    cfg = copy.deepcopy(small_configs()["mistral-window"])
    cfg.sliding_window = 14
    stock, ours = build_models(cfg, torch.float32, "cpu")
    cutile_kernels.patch(ours)
    calls = []

    def via_kernel(q, k, v, mask=None, scale=None, causal=True, window=None, softcap=None, kv_len=None):
        calls.append((None if kv_len is None else int(kv_len), k.shape[2]))
        return emulated_attention(q, k, v, mask, scale, causal, window, softcap, kv_len=kv_len)[0]

    monkeypatch.setattr(attn_ops, "attention_reference", via_kernel)
    ids, mask = padded_batch(cfg.vocab_size, [11, 7, 3], "cpu")
    assert_generate_matches(stock, ours, ids, mask, "static")
    layers = cfg.num_hidden_layers
    assert len(calls) == 6 * layers and {s for _, s in calls} == {14}
    assert [n for n, _ in calls[::layers]] == [11, 12, 13, 14, None, None]
    assert all(calls[i] == calls[i - i % layers] for i in range(len(calls)))


@pytest.mark.parametrize("family", ["llama", "mistral-window"])
def test_cpu_routed_model_matches_stock(family, route_spy):
    """``"cutile"`` routing as on a GPU: a padded batch's prefill (more than 16 queries) on sdpa,
    its decode steps (a padding mask; a static cache's filled length) on the op (its reference
    here); logits and generate() over both caches as stock's."""
    cfg = small_configs()[family]
    stock, ours = build_models(cfg, torch.float32, "cpu", attn="cutile")
    ids, mask = padded_batch(cfg.vocab_size, [20, 13, 5], "cpu")
    want, got = forward_logits(stock, ids, mask), forward_logits(ours, ids, mask)
    assert route_spy == {"kernel": 0, "sdpa": cfg.num_hidden_layers}
    torch.testing.assert_close(valid(got, mask), valid(want, mask), rtol=1e-4, atol=1e-4)
    for cache in ("dynamic", "static"):
        assert_generate_matches(stock, ours, ids, mask, cache)
    assert route_spy["kernel"] == 2 * 5 * cfg.num_hidden_layers  # 5 decode steps a generate, both caches


def test_tiny_preset_loads_with_cutile_attention(tmp_path):
    from transformers import AutoModelForCausalLM
    from cutile_kernels_tools import presets

    path = presets.materialize("tiny", tmp_path / "tiny")
    stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="cutile").eval()
    assert ours.config._attn_implementation == "cutile"
    ids, mask = padded_batch(stock.config.vocab_size, [9, 4], "cpu")
    torch.testing.assert_close(valid(forward_logits(ours, ids, mask), mask),
                               valid(forward_logits(stock, ids, mask), mask), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Patch gemma2_attention: Gemma 2 (no sdpa path: its logit softcap) attends with the kernel
# ---------------------------------------------------------------------------------------------

def gemma2_models(dtype=torch.float32, device="cpu", softcap=0.05, window=4, layers=3, **fields):
    """A stock Gemma 2 model (eager: its class has no sdpa) and a copy, seeded, its norm weights off
    0; ``softcap`` small so that the tanh bends the logits of these small random weights."""
    import families

    stock = families.model("gemma2", layers=layers, attn_logit_softcapping=softcap, sliding_window=window,
                           **fields).to(device=device, dtype=dtype)
    ours = copy.deepcopy(stock)
    assert stock.config._attn_implementation == "eager" and stock.config is not ours.config
    return stock, ours


def test_gemma2_attention_patch_runs_gemma2_with_softcap_and_windows(cpu_path):
    stock, ours = gemma2_models(query_pre_attn_scalar=9)  # a scale other than 1 / sqrt(head_dim)
    report = cutile_kernels.patch(ours, names=["gemma2_attention"])
    assert report.changed == {"gemma2_attention": 3} and ours.config._attn_implementation == "cutile"
    assert stock.config._attn_implementation == "eager"
    lengths = [11, 7, 3]  # longer and shorter than the window of 4
    ids, mask = padded_batch(256, lengths, "cpu")
    want = forward_logits(stock, ids, mask)
    torch.testing.assert_close(valid(forward_logits(ours, ids, mask), mask), valid(want, mask), rtol=1e-4, atol=1e-4)
    # The softcap reached the kernel: without it the logits are far from stock's.
    capless = copy.deepcopy(ours)
    for m in capless.modules():
        if hasattr(m, "attn_logit_softcapping"):
            m.attn_logit_softcapping = None
    assert (valid(forward_logits(capless, ids, mask), mask) - valid(want, mask)).abs().max() > 1e-3  # 10x the tolerance
    alone = forward_logits(ours, ids[:1], mask[:1])  # one row without padding: the kernel's own masks
    torch.testing.assert_close(alone, want[:1], rtol=1e-4, atol=1e-4)
    for cache in ("dynamic", "static"):
        assert_generate_matches(stock, ours, ids, mask, cache)
    assert cutile_kernels.patch(ours, names=["gemma2_attention"]).changed == {"gemma2_attention": 0}  # idempotent
    assert cutile_kernels.unpatch(ours).changed == {"gemma2_attention": 3}
    assert ours.config._attn_implementation == "eager"
    assert torch.equal(forward_logits(ours, ids, mask), want)
    assert cutile_kernels.patch(ours, names=["gemma2_attention"]).changed == {"gemma2_attention": 3}  # again


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gemma2_attention_in_16_bits_matches_stock(dtype):
    # Gemma 2's real softcap (50) in 16-bit models (CPU: the op's reference, so this checks the
    # wiring; the kernel's fp16 scores past fp16's range: test_fp16_large_values_do_not_overflow):
    # finite, and within 16-bit noise of stock eager.
    stock, ours = gemma2_models(dtype=dtype, softcap=50.0)
    cutile_kernels.patch(ours, names=["gemma2_attention"])
    ids, mask = padded_batch(256, [11, 7, 3], "cpu")
    want, got = forward_logits(stock, ids, mask), forward_logits(ours, ids, mask)
    assert torch.isfinite(want).all() and torch.isfinite(got).all()
    torch.testing.assert_close(valid(got, mask), valid(want, mask), rtol=3e-2, atol=3e-2)


def test_gemma2_attention_is_default_and_leaves_other_models_alone(caplog):
    import families
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    from cutile_kernels.layers._patching import PATCHES
    from cutile_kernels.layers.models import gemma as fam

    gemma2 = families.model("gemma2", layers=2)
    assert "gemma2_attention" in cutile_kernels.patch(gemma2).active
    assert gemma2.config._attn_implementation == "cutile"
    # An encoder-decoder without an sdpa path (its decoder's self-attention is built non-causal and
    # takes a mask sdpa_mask would drop): left alone.
    cfg = AutoConfig.for_model("pegasus_x", vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1,
                               encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                               decoder_ffn_dim=64, max_position_embeddings=64, num_global_tokens=4, block_size=8)
    pegasus = AutoModelForSeq2SeqLM.from_config(cfg)
    assert pegasus.config._attn_implementation == "eager" and not type(pegasus)._supports_sdpa
    cases = {"eager": "its class supports sdpa, so eager attention was asked for", "sdpa": "it attends with 'sdpa'"}
    with caplog.at_level("INFO", logger="cutile_kernels"):
        assert cutile_kernels.patch(pegasus, names=["gemma2_attention"]).changed == {"gemma2_attention": 0}
        for attn in cases:
            llama = families.model("llama", layers=2, attn=attn)
            assert cutile_kernels.patch(llama, names=["gemma2_attention"]).changed == {"gemma2_attention": 0}
            assert llama.config._attn_implementation == attn
    assert pegasus.config._attn_implementation == "eager"
    assert "it is an encoder-decoder or holds sub-models" in caplog.text
    assert all(why in caplog.text for why in cases.values())
    # An attention class whose forward is not Gemma 2's code.
    assert fam.gemma2_attention_verdict(type("Gemma2Attention", (torch.nn.Module,), {"forward": lambda self: 0})) \
        == "its forward is not Gemma2Attention.forward's code"
    assert fam.eager_gemma2_verdict(torch.nn.Linear(2, 2)) == "it is not a transformers PreTrainedModel"
    excluded = families.model("gemma2", layers=2)
    cutile_kernels.patch(excluded, names=[n for n in PATCHES if n != "gemma2_attention"])
    assert excluded.config._attn_implementation == "eager"


def test_gemma2_attention_follows_a_switch_back_to_eager():
    """A user who switches a patched model back to eager (for attention weights) gets eager, and
    patch switches it again; unpatch then leaves a model switched away alone."""
    import families

    model = families.model("gemma2", layers=2)
    assert cutile_kernels.patch(model, names=["gemma2_attention"]).changed == {"gemma2_attention": 2}
    model.set_attn_implementation("eager")
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        assert len(model(ids, output_attentions=True).attentions) == 2  # eager's weights
    assert cutile_kernels.patch(model, names=["gemma2_attention"]).changed == {"gemma2_attention": 2}
    assert model.config._attn_implementation == "cutile"
    model.set_attn_implementation("eager")
    assert cutile_kernels.unpatch(model).changed == {"gemma2_attention": 0}
    assert model.config._attn_implementation == "eager"


# ---------------------------------------------------------------------------------------------
# AOT: the variants compile for sm_90 (tensor cores, TMA)
# ---------------------------------------------------------------------------------------------

def test_matrix_is_moderate_and_covers_the_dispatch():
    every = kattn.VARIANTS
    specs = [s for s in every if not s.constants.get("PDL")]
    # 44 attention (prefill, decode and combine tiles, mask classes) and 36 rope_append_attention (18 by a
    # length, 18 by a mask)
    assert len([s for s in specs if s.kernel != "rope_append_attention"]) <= 48 and len(specs) <= 84
    # the decode tiles of both again with programmatic dependent launch (kernel_src/_pdl.py), after the rest
    decode = [s for s in specs if s.function in ("attention_kernel", "rope_append_attention_kernel")]
    assert [(s.kernel, s.tag) for s in every[len(specs):]] == [(s.kernel, s.tag + ".pdl") for s in decode]
    tags = {(s.kernel, s.tag) for s in every}
    assert len(tags) == len(every)
    for dtype in ("bfloat16", "float16"):
        for head_dim in (32, 64, 80, 96, 128, 256):
            for sq in (1, 7, 16, 17, 2048):
                for group in (1, 2, 3, 4, 6, 8, 32):
                    dp, hb, bs, bn = attn_ops.tiles_for(head_dim, sq, group)
                    bns = {bn}
                    if sq <= attn_ops.DECODE_MAX_SQ:
                        bns = {attn_ops.decode_bn(dp, keys, splits) for keys in (100, 5000) for splits in (1, 4)}
                    for bn in bns:
                        want = {"D": dp, "HB": hb, "BS": bs, "BN": bn}
                        assert any(s.kernel == "attention" and {**s.constants, "PDL": 0} == {**want, "PDL": 0}
                                   and s.params[0].dtype == dtype for s in specs), (dtype, head_dim, sq, group, bn)
        for dp in kattn.HEAD_DIMS:
            assert any(s.kernel == "attention_combine" and s.constants["D"] == dp and s.params[2].dtype == dtype
                       for s in specs)


@pytest.mark.slow
@pytest.mark.parametrize("kernel,tag", [("attention", "bf16.d128.h1.m128.n64"), ("attention", "fp16.d64.h4.m4.n128"),
                                        ("attention", "bf16.d128.h2.m8.n256"),
                                        ("rope_append_attention", "bf16.d64.h4.m4.n128")])
def test_variants_compile_for_sm90(kernel, tag):
    from cutile_kernels_build import aot

    (spec,) = [s for s in kattn.VARIANTS if s.tag == tag and s.kernel == kernel]
    data, seconds = aot.compile_variant(spec, "sm_90")
    assert data[:4] == b"\x7fELF"
    assert b"cp.async.bulk.tensor" in data  # TMA loads: the aligned assumptions were used
    if "h1.m128" in tag:
        assert b"wgmma" in data  # Hopper tensor cores for the prefill tile


# ---------------------------------------------------------------------------------------------
# GPU: the kernels against float64, outputs poisoned first
# ---------------------------------------------------------------------------------------------

#: (Hq, Hkv, head_dim): Llama-3.2-1B, Qwen3-0.6B, Qwen2.5-1.5B, Mistral-7B, one KV head, 80, 96, 256,
#: Phi-4-mini (a group of 3: decode as batches of one KV head, ops.attention.padded_heads).
FAMILY_HEADS = [(32, 8, 64), (16, 8, 128), (12, 2, 128), (32, 8, 128), (8, 1, 128), (16, 1, 64),
                (8, 8, 80), (12, 4, 96), (8, 2, 256), (24, 8, 128)]

GPU_CASES = (
    [(1, h, 2048, 2048, torch.bfloat16) for h in FAMILY_HEADS[:4]]
    + [(1, h, 4099, 4099, torch.bfloat16) for h in FAMILY_HEADS[:2]]
    + [(b, h, 1, skv, torch.bfloat16) for h in FAMILY_HEADS for b, skv in ((1, 4096), (16, 1000))]
    # 2500 keys at batch 16: the long tile where the grid is wide enough (no split), the short one
    # split where it is not (one KV head of eight query heads).
    + [(16, h, 1, 2500, d) for h in FAMILY_HEADS[:5] + [(8, 8, 80)] for d in (torch.bfloat16, torch.float16)]
    + [(2, h, 7, 300, torch.bfloat16) for h in FAMILY_HEADS]
    + [(2, h, 333, 333, d) for h in FAMILY_HEADS[4:] for d in (torch.bfloat16, torch.float16)]
    + [(3, (16, 8, 128), 1, 1, torch.float16), (1, (32, 8, 64), 1, 129, torch.float16)]
    # Groups of 6 and 7 that run as batches of one KV head (unsplit at these sizes): a last head
    # block half past the group.
    + [(16, (12, 2, 128), 1, 300, torch.bfloat16), (8, (28, 4, 128), 1, 300, torch.bfloat16)]
    + [(1, (8, 2, 64), 20, 5, torch.bfloat16)]  # more queries than keys: the first rows see nothing
)


def _gpu_id(c):
    B, (Hq, Hkv, D), Sq, Skv, dtype = c
    return f"b{B}-h{Hq}x{Hkv}-d{D}-q{Sq}-kv{Skv}-{str(dtype).split('.')[-1]}"


def _rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def _check_against_float64(q, k, v, mask, scale, causal=True, window=None, softcap=None, splits=None,
                           stock_fn=None, factor=1.25, floor=4e-3):
    """Run the kernel into a NaN-poisoned output and bound its relative L2 error against the
    float64 reference by ``factor`` x the error of torch's SDPA in the same dtype (or ``floor``,
    about twice a 16-bit rounding of the output). Queries that see no key must get zeros."""
    B, Hq, Sq, D = q.shape
    out = torch.full((B, Sq, Hq, D), float("nan"), device=q.device, dtype=q.dtype)
    assert attn_ops.attention_into(q, k, v, mask, out, scale, causal, window, softcap, splits)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "an output element was not written"
    ref = cutile_kernels.attention_reference(q.double(), k.double(), v.double(), mask, scale, causal, window,
                                             softcap).transpose(1, 2)
    rows = attn_ops.visible_mask(B, Sq, k.shape[2], mask, causal, window, device=q.device).any(-1)[:, 0]
    rows = rows.expand(B, Sq)
    assert torch.equal(out[~rows], torch.zeros_like(out[~rows]))
    ours = _rel(out[rows], ref[rows])
    bound = floor
    if stock_fn is not None:  # what torch's own SDPA in this dtype gets wrong on the same inputs
        bound = max(factor * _rel(stock_fn().transpose(1, 2)[rows], ref[rows]), bound)
    assert ours <= bound, (ours, bound)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_gpu_id)
def test_kernel_matches_float64(case, strict):
    B, (Hq, Hkv, D), Sq, Skv, dtype = case
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Skv, D, dtype, "cuda")
    scale = 1 / math.sqrt(D)
    # Stock comparison: sdpa's lower-right causal is the explicit mask (is_causal is upper-left).
    m = hf_mask(1, Sq, Skv, Skv - Sq, device="cuda")
    _check_against_float64(q, k, v, None, scale, stock_fn=lambda: sdpa_gqa(q, k, v, m, scale))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", FAMILY_HEADS[:4], ids=str)
def test_fp16_large_values_do_not_overflow(heads, strict):
    Hq, Hkv, D = heads
    q, k, v = make_qkv(2, Hq, Hkv, 300, 300, D, torch.float16, "cuda", scale=30.0)  # |q.k| ~ 1e4 .. 1e5
    _check_against_float64(q, k, v, None, 1.0, floor=5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["left-padded prefill", "static-cache decode", "static-cache chunk",
                                  "sliding window mask", "window no mask", "softcap", "forced split"])
def test_kernel_masks_window_softcap(kind, strict):
    B, Hq, Hkv, D = 3, 32, 8, 128
    mask, causal, window, softcap, splits = None, True, None, None, None
    if kind == "left-padded prefill":
        Sq = Skv = 1000
        mask, causal = hf_mask(B, Sq, Skv, 0, left_padding(B, Skv, [0, 17, 700], "cuda"), device="cuda"), False
    elif kind == "static-cache decode":
        Sq, Skv = 1, 4096
        mask, causal = hf_mask(B, Sq, Skv, 900, left_padding(B, 901, [0, 5, 300], "cuda"), device="cuda"), False
    elif kind == "static-cache chunk":
        Sq, Skv = 5, 2048
        mask, causal = hf_mask(B, Sq, Skv, 600, left_padding(B, 605, [0, 5, 300], "cuda"), device="cuda"), False
    elif kind == "sliding window mask":
        Sq = Skv = 1500
        mask = hf_mask(B, Sq, Skv, 0, left_padding(B, Skv, [0, 3, 40], "cuda"), window=256, device="cuda")
        causal = False
    elif kind == "window no mask":
        Sq, Skv, window = 700, 1200, 129
    elif kind == "softcap":
        Sq = Skv = 600
        softcap = 20.0
    else:
        Sq, Skv, splits = 1, 3000, 9
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Skv, D, torch.bfloat16, "cuda")
    scale = 1 / math.sqrt(D)
    stock = None
    if softcap is None:
        full = attn_ops.visible_mask(B, Sq, Skv, mask, causal, window, device="cuda")
        stock = lambda: sdpa_gqa(q, k, v, full, scale)  # noqa: E731
    _check_against_float64(q, k, v, mask, scale, causal, window, softcap, splits, stock_fn=stock)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", FAMILY_HEADS, ids=str)
@pytest.mark.parametrize("B,Sq,filled,splits", [(1, 1, 1, None), (3, 1, 129, None), (16, 1, 1000, None),
                                                (2, 1, 300, 9), (2, 5, 777, None), (1, 1, 4096, None),
                                                (2, 40, 700, None)])
def test_kernel_reads_only_the_filled_static_slots(heads, B, Sq, filled, splits, strict):
    """A static cache of 4096 slots holding ``filled`` keys (the rest NaN, as no cache would hold
    them: reading one shows), a left-padded mask over every slot as transformers builds it, and
    kv_len on the device: the output (NaN-poisoned first) is float64 attention over the filled keys.
    A prefill chunk (40 queries: the prefill tiles, which take kv_len into the mask and read every
    slot) gets large finite values there instead: hidden, they must not count."""
    Hq, Hkv, D = heads
    Skv = 4096
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Skv, D, torch.bfloat16, "cuda")
    poison = float("nan") if Sq <= attn_ops.DECODE_MAX_SQ else 1000.0
    k[:, :, filled:], v[:, :, filled:] = poison, poison
    pads = [0, 5, filled // 2][:B] + [1] * max(0, B - 3)
    mask = hf_mask(B, Sq, Skv, filled - Sq, left_padding(B, filled, pads, "cuda"), device="cuda")
    kv_len = torch.tensor(filled, device="cuda")
    out = torch.full((B, Sq, Hq, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert attn_ops.attention_into(q, k, v, mask, out, 1 / math.sqrt(D), False, splits=splits, kv_len=kv_len)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "an output element was not written, or an unfilled slot was read"
    cut = (slice(None), slice(None), slice(0, filled))
    ref = cutile_kernels.attention_reference(q.double(), k[cut].double(), v[cut].double(), mask[..., :filled],
                                             1 / math.sqrt(D), False).transpose(1, 2)
    assert _rel(out, ref) <= 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("B,filled,slots", [(16, 3000, 4096), (16, 2100, 2176), (4, 4000, 4096)])
def test_mha_decode_over_a_long_static_cache_runs_the_kernel(B, filled, slots, strict):
    """OLMo-3-7B's layout (32 heads of 128, MHA) at batch 16 over a static cache of thousands of
    slots: the long tile (256 keys) launches (strict: a fallback raises; before the flat dims the
    int32 bound refused k, H100 2026-12-05) and matches float64 attention over the filled keys."""
    q, k, v = make_qkv(B, 32, 32, 1, slots, 128, torch.bfloat16, "cuda")
    k[:, :, filled:], v[:, :, filled:] = float("nan"), float("nan")
    out = torch.full((B, 1, 32, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    kv_len = torch.tensor(filled, device="cuda")
    plan = attn_ops.launches(q, k, v, None, out, 128 ** -0.5, True, kv_len=kv_len)
    assert dict(plan[0][1])["BN"] == attn_ops.DECODE_BN_LONG[128] or plan[0][2][-1] > 1
    assert attn_ops.attention_into(q, k, v, None, out, 128 ** -0.5, True, kv_len=kv_len)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    cut = (slice(None), slice(None), slice(0, filled))
    ref = cutile_kernels.attention_reference(q.double(), k[cut].double(), v[cut].double(), None, 128 ** -0.5,
                                             True).transpose(1, 2)
    assert _rel(out, ref) <= 4e-3


@pytest.mark.gpu
def test_kv_len_is_read_at_replay(strict):
    """A CUDA graph captured with kv_len replays the length the tensor holds at replay time."""
    B, Hq, Hkv, D, Skv = 2, 16, 8, 128, 1024
    q, k, v = make_qkv(B, Hq, Hkv, 1, Skv, D, torch.bfloat16, "cuda")
    kv_len = torch.tensor(100, device="cuda")
    mask = torch.ones(B, 1, 1, Skv, dtype=torch.bool, device="cuda")
    cutile_kernels.attention(q, k, v, mask, causal=False, kv_len=kv_len)  # load the kernels
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = cutile_kernels.attention(q, k, v, mask, causal=False, kv_len=kv_len)
    for n in (1, 100, 129, 700, 1024):
        kv_len.fill_(n)
        g.replay()
        torch.cuda.synchronize()
        want = cutile_kernels.attention(q, k[:, :, :n], v[:, :, :n], mask[..., :n], causal=False)
        assert (out.float() - want.float()).abs().max().item() < 2e-2, n


@pytest.mark.gpu
def test_splits_agree_with_one_pass(strict):
    q, k, v = make_qkv(2, 16, 8, 1, 5000, 128, torch.bfloat16, "cuda")
    outs = []
    for splits in (1, 3, 16):
        out = torch.empty(2, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
        assert attn_ops.attention_into(q, k, v, None, out, 0.088, splits=splits)
        outs.append(out.float())
    assert (outs[1] - outs[0]).abs().max().item() < 2e-2 and (outs[2] - outs[0]).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_cuda_graph_replay_and_compile(strict):
    q, k, v = make_qkv(4, 16, 8, 1, 777, 128, torch.bfloat16, "cuda")
    eager = cutile_kernels.attention(q, k, v)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cutile_kernels.attention(q, k, v)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = cutile_kernels.attention(q, k, v)
    q.copy_(torch.randn_like(q))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, cutile_kernels.attention(q, k, v)) and not torch.equal(out, eager)
    compiled = torch.compile(lambda q, k, v: cutile_kernels.attention(q * 1, k, v, window=100), fullgraph=True)
    assert torch.equal(compiled(q, k, v), cutile_kernels.attention(q, k, v, window=100))


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 256])
def test_masked_prefill_replays_in_a_cuda_graph_and_compiles(D, strict):
    """A masked prefill (its tiles classified, then the attention: two launches and the classes
    allocated inside the call) captured in a CUDA graph follows new q and a new mask at replay, and
    under torch.compile(fullgraph=True) gives the eager op's numbers; with the stand-ins kept, as a
    patched model has them (an unmasked prefill then passes no array twice)."""
    attn_ops.prepare("cuda")
    B, Hq, Hkv, S = 2, 4, 1, 300
    q, k, v = make_qkv(B, Hq, Hkv, S, S, D, torch.bfloat16, "cuda")
    m = hf_mask(B, S, S, 0, left_padding(B, S, [0, 37], "cuda"), window=100, device="cuda").clone()  # written below
    eager = cutile_kernels.attention(q, k, v, m, causal=False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cutile_kernels.attention(q, k, v, m, causal=False)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = cutile_kernels.attention(q, k, v, m, causal=False)
    q.copy_(torch.randn_like(q))
    m.copy_(hf_mask(B, S, S, 0, left_padding(B, S, [150, 0], "cuda"), window=40, device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    want = cutile_kernels.attention(q, k, v, m, causal=False)
    assert torch.equal(out, want) and not torch.equal(out, eager)
    ref = cutile_kernels.attention_reference(q.double(), k.double(), v.double(), m, causal=False)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    compiled = torch.compile(lambda q, k, v, m: cutile_kernels.attention(q * 1, k, v, m, causal=False), fullgraph=True)
    assert torch.equal(compiled(q, k, v, m), want)
    # The unmasked prefill with the stand-ins kept: strict mode raises if the launch falls back.
    ref = cutile_kernels.attention_reference(q.double(), k.double(), v.double())
    got = cutile_kernels.attention(q, k, v).double()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.gpu
def test_unsupported_dtype_falls_back(caplog):
    q, k, v = make_qkv(1, 4, 2, 5, 5, 64, torch.float32, "cuda")
    with caplog.at_level("WARNING", logger="cutile_kernels"):
        out = cutile_kernels.attention(q, k, v)
    torch.testing.assert_close(out, cutile_kernels.attention_reference(q, k, v))
    assert "float32" in caplog.text


# ---------------------------------------------------------------------------------------------
# GPU: kernelized models (bf16) against the float32 stock model
# ---------------------------------------------------------------------------------------------

def _gpu_configs():
    """The tiny preset and two-layer versions of the four families' real configs (Qwen2 with its
    sliding window on the second layer, Mistral with a 64-token window and a narrower MLP)."""
    from transformers import AutoConfig

    from cutile_kernels_tools import presets

    edits = {"qwen2.5-1.5b": {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
             "mistral-7b-v0.3": {"sliding_window": 64, "intermediate_size": 2048}}
    cfgs = {}
    for name in ("tiny", "llama-3.2-1b", "qwen3-0.6b", "qwen2.5-1.5b", "mistral-7b-v0.3"):
        cfg = {**presets.PRESETS[name].config, "num_hidden_layers": 2, **edits.get(name, {})}
        cfgs[name] = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    return cfgs


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["tiny", "llama-3.2-1b", "qwen3-0.6b", "qwen2.5-1.5b", "mistral-7b-v0.3"])
def test_gpu_model_against_fp32_stock(family, strict):
    cfg = _gpu_configs()[family]
    ref, _ = build_models(cfg, torch.float32, "cuda")
    stock, ours = build_models(cfg, torch.bfloat16, "cuda")
    lengths = [150, 97, 31]
    ids, mask = padded_batch(cfg.vocab_size, lengths, "cuda")
    want = forward_logits(ref, ids, mask)

    def err(x):
        return ((valid(x, mask) - valid(want, mask)).norm() / valid(want, mask).norm()).item()

    got, stock_bf16 = forward_logits(ours, ids, mask), forward_logits(stock, ids, mask)
    assert err(got) <= 1.25 * err(stock_bf16) + 1e-3, (err(got), err(stock_bf16))
    # Each row alone: the same logits as in the padded batch, as close as stock's own rows are.
    for b, n in enumerate(lengths):
        alone = forward_logits(ours, ids[b:b + 1, -n:], mask[b:b + 1, -n:])[0]
        stock_alone = forward_logits(stock, ids[b:b + 1, -n:], mask[b:b + 1, -n:])[0]
        d_ours = ((alone - got[b, -n:]).norm() / got[b, -n:].norm()).item()
        d_stock = ((stock_alone - stock_bf16[b, -n:]).norm() / stock_bf16[b, -n:].norm()).item()
        assert d_ours <= max(2 * d_stock, 1e-2), (b, d_ours, d_stock)
    # Chunked prefill over a DynamicCache.
    chunked = chunked_logits(ours, ids, mask, [64, 1, 50, 35])
    assert err(chunked) <= 1.25 * err(stock_bf16) + 2e-3
    # generate(): each step's scores against the fp32 model's teacher-forced logits of the same
    # sequence, as close as stock bf16 generate's are to its own sequence.
    for cache in ("dynamic", "static"):
        errs = generate_errors(ref, {"ours": ours, "stock": stock}, ids, mask, cache)
        assert errs["ours"] <= 1.25 * errs["stock"] + 2e-3, (cache, errs)
    assert sum(dispatch.stats()["launches"].get(v.symbol, 0) for v in registry.registry().variants("attention")) > 0


@pytest.mark.gpu
def test_gpu_gemma2_attends_with_the_kernel_against_fp32_eager(strict):
    """Gemma-2-2B's attention shapes (8 query heads over 4 KV heads, head_dim 256, softcap 50) in two
    layers, the window cut to 64 so that the prompts cross it and the scale off the default: patch
    gemma2_attention in bf16 against the float32 eager model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from cutile_kernels_tools import presets

    # query_pre_attn_scalar 144 (Gemma-2-27B's) makes the scale differ from 1 / sqrt(head_dim).
    fields = {**presets.PRESETS["gemma-2-2b"].config, "num_hidden_layers": 2, "sliding_window": 64,
              "query_pre_attn_scalar": 144}
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device("cuda"):
        ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), dtype=torch.float32).eval()
    stock = copy.deepcopy(ref).to(torch.bfloat16)
    ours = copy.deepcopy(stock)
    assert cutile_kernels.patch(ours, names=["gemma2_attention"]).changed == {"gemma2_attention": 2}
    lengths = [150, 97, 31]
    ids, mask = padded_batch(cfg.vocab_size, lengths, "cuda")
    want = forward_logits(ref, ids, mask)

    def err(x):
        return ((valid(x, mask) - valid(want, mask)).norm() / valid(want, mask).norm()).item()

    before = dispatch.stats()["launches"].copy()
    got = forward_logits(ours, ids, mask)
    assert err(got) <= 1.25 * err(forward_logits(stock, ids, mask)) + 1e-3
    for cache in ("dynamic", "static"):
        errs = generate_errors(ref, {"ours": ours, "stock": stock}, ids, mask, cache)
        assert errs["ours"] <= 1.25 * errs["stock"] + 2e-3, (cache, errs)
    after = dispatch.stats()["launches"]
    assert sum(after.get(v.symbol, 0) - before.get(v.symbol, 0)
               for v in registry.registry().variants("attention")) > 0


def test_prefill_sweep_candidates_include_what_ships():
    """dev/sweeps/attention_sweep.py (run on the GPU by hand) must time the shipped prefill tiles
    next to its candidates, under tags that name each one once, and its hint variants must be the
    candidate's device code."""
    from dev.sweeps import attention_sweep, attention_variants
    from cutile_kernels.kernel_src import attention as src

    specs = attention_sweep.candidates()
    assert len({s.tag for s in specs}) == len(specs)
    for dp in src.HEAD_DIMS:
        hb, bs, bn = src.PREFILL[dp]
        assert any(s.function == "attention_prefill_kernel" and s.constants == {"D": dp, "HB": hb, "BS": bs, "BN": bn}
                   for s in specs)
    pf2 = attention_variants.attention_pf2_kernel._pyfunc
    for name in ("attention_pf2_w8_kernel", "attention_pf2_occ2_kernel", "attention_pf2_w8_cta2_kernel"):
        assert getattr(attention_variants, name)._pyfunc is pf2


#: (B, Hq, Hkv, Sq, Skv, head_dim, (HB, BS, BN), extra): prefill calls without a mask tensor across
#: the three loops of the pipelined candidate: tiles no length fills, a window's lower edge, a chunk
#: over a cache, a softcap, two heads a block, non-causal; and scores large enough (q and k scaled
#: by ``scale``) that a row max in other units than the exponent's underflows the probabilities.
PF2_CASES = [
    (1, 4, 2, 130, 130, 64, (1, 64, 64), {}),
    (2, 4, 1, 150, 150, 256, (1, 32, 64), {"window": 33}),
    (1, 2, 2, 30, 200, 64, (1, 64, 32), {"window": 40}),
    (1, 4, 2, 40, 90, 32, (2, 32, 32), {"softcap": 3.0}),
    (1, 2, 1, 129, 129, 128, (1, 64, 64), {"softcap": 5.0, "window": 70}),
    (1, 2, 2, 50, 20, 80, (1, 32, 32), {"causal": False}),
    (1, 4, 2, 130, 130, 64, (1, 64, 64), {"scale": 6.0}),
    (1, 2, 2, 30, 200, 64, (1, 64, 32), {"window": 40, "scale": 6.0}),
]


@pytest.mark.parametrize("lat,rev,fma", [(1, 1, 0), (1, 0, 0), (1, 1, 1)], ids=["pf2", "fwd", "pf3"])
@pytest.mark.parametrize("case", PF2_CASES, ids=lambda c: "-".join(map(str, c[:6])) + "".join(f"-{k}{v}" for k, v in c[7].items()))
def test_prefill_sweep_candidate_matches_reference(lat, rev, fma, case):
    """The sweep's pipelined prefill candidate (not shipped) computes the op's attention, in the
    NumPy interpreter: a candidate the GPU sweep times must be correct logic first."""
    from dev.sweeps import attention_variants

    B, Hq, Hkv, Sq, Skv, D, (hb, bs, bn), extra = case
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Skv, D, scale=extra.get("scale", 1.0))
    kw = {"causal": extra.get("causal", True), "window": extra.get("window"), "softcap": extra.get("softcap")}
    from dev.sweeps.attention_sweep import candidate_args

    out = torch.full((B, Sq, Hq, D), float("nan"), dtype=q.dtype)
    args = candidate_args(attn_ops, q, k, v, None, out, 0.17, **kw)
    dp = attn_ops.tiles_for(D, Sq, Hq // Hkv)[0]  # the padded head dim
    emulate(attention_variants.attention_pf2_kernel, attention_variants)(
        (-(-Sq // bs), B * Hq // hb, 1), tuple(args) + (dp, hb, bs, bn, lat, rev, fma))
    want = cutile_kernels.attention_reference(q, k, v, None, 0.17, **kw)
    torch.testing.assert_close(out.transpose(1, 2), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("B,Hq,Hkv,D,slots,filled,masked,splits,window,softcap,use_len", [
    (2, 4, 4, 128, 200, 150, True, None, 0, 0.0, False),   # MHA, a mask over every slot (a sliding layer)
    (2, 8, 2, 64, 300, 211, True, 3, 0, 0.0, False),       # GQA, split
    (1, 4, 1, 64, 90, 90, False, None, 7, 30.0, False),    # window and softcap, no mask
    (3, 4, 4, 128, 130, 77, False, 2, 0, 0.0, True),       # kv_len over NaN-poisoned slots, split
])
def test_masked_decode_sweep_candidate_is_exact(B, Hq, Hkv, D, slots, filled, masked, splits, window, softcap,
                                                use_len):
    """dev/sweeps/decode_mask_sweep.py's candidate (every KV tile loaded, masked element-wise) run by
    the NumPy interpreter with the shipped router's plan (its split combine after it) equals the
    reference: a candidate that the GPU sweep would time must compute the op."""
    from dev.sweeps import decode_mask_sweep

    q = torch.randn(B, 1, Hq, D, dtype=torch.float64).transpose(1, 2)
    k, v = torch.randn(2, B, Hkv, slots, D, dtype=torch.float64)
    kv_len = torch.tensor([filled]) if use_len else None
    if use_len:
        k[:, :, filled:], v[:, :, filled:] = float("nan"), float("nan")
    mask = torch.rand(B, 1, 1, slots, generator=torch.Generator().manual_seed(B)) > 0.3 if masked else None
    want = cutile_kernels.attention_reference(q, k, v, mask, 0.1, not masked, window or None, softcap or None,
                                              kv_len=kv_len)
    out = torch.full((B, 1, Hq, D), float("nan"), dtype=torch.float64)
    plan = attn_ops.launches(q, k, v, mask, out, 0.1, not masked, window or None, softcap or None, splits, sms=132,
                             kv_len=kv_len)
    _kernel, tile, args, _n, grid = plan[0]
    args = list(args)
    if len(plan) > 1:  # the split buffers the kernel writes in float32
        args[6], args[7] = args[6].float().fill_(float("nan")), args[7].float().fill_(float("nan"))
        plan[1] = plan[1][:2] + ((args[6], args[7]) + plan[1][2][2:],) + plan[1][3:]
    tile = dict(tile)
    emulate(decode_mask_sweep.attention_maskfree_kernel, decode_mask_sweep)(grid(tile), tuple(args) + tuple(tile.values()))
    for step in plan[1:]:
        run_launch(step)
    torch.testing.assert_close(out.transpose(1, 2), want, rtol=1e-5, atol=1e-5)
    assert {s.constants["D"] for s in decode_mask_sweep.candidates()} == {64, 128}


def test_decode_sweep_candidates_include_what_ships():
    """dev/sweeps/decode_attention_sweep.py (run on the GPU by hand) times every decode tile the
    router can pick (both keys-per-tile choices) beside the other candidates, one tag each, and its
    eight-warp variant is the shipped device code with another hint."""
    from dev.sweeps import attention_variants, decode_attention_sweep
    from cutile_kernels.kernel_src import attention as src

    specs = decode_attention_sweep.candidates()
    assert len({s.tag for s in specs}) == len(specs)
    for dp in (64, 128):
        for hb in src.DECODE_HEADS:
            for bn in (src.DECODE_BN[dp], src.DECODE_BN_LONG[dp]):
                want = {"D": dp, "HB": hb, "BS": src.DECODE_ROWS // hb, "BN": bn, "PDL": 0}
                assert any(s.function == "attention_kernel" and s.module == "attention" and s.constants == want
                           for s in specs), want
    assert attention_variants.attention_w8_kernel._pyfunc is src.attention_kernel._pyfunc
