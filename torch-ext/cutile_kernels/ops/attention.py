"""Scaled dot-product attention (flash attention forward): custom op, fake, reference, dispatch.

Semantics (``kernel_src/attention.py`` states the kernel's math): for ``q`` ``(B, Hq, Sq, D)``,
``k``/``v`` ``(B, Hkv, Skv, D)`` with ``Hq % Hkv == 0`` (query head ``h`` reads KV head
``h // (Hq // Hkv)``), key ``j`` is visible to query ``i`` of batch ``b`` when

* ``causal``: ``j <= i + Skv - Sq`` (lower-right: the queries are the last ``Sq`` positions);
* ``window``: ``j > i + Skv - Sq - window`` (transformers' ``sliding_window_overlay``);
* ``mask``: ``mask[b, 0, i, j]`` is True (a boolean ``(B or 1, 1, Sq, Skv)`` tensor, True =
  attend, the form transformers' ``sdpa_mask`` builds);

then ``o_i = softmax(scale * q_i k^T [softcap: softcap * tanh(. / softcap)], visible) v``, and a
query that sees no key gets zeros. With ``kv_len`` (a one-element int64 device tensor, e.g. a
``StaticLayer``'s ``cumulative_length``) only the first ``n = kv_len`` keys exist: the result is
that of ``k[:, :, :n]``, ``v[:, :, :n]``, ``mask[..., :n]`` (``Skv`` reads ``n`` above), computed
without reading ``n`` on the host, so that a captured CUDA graph follows each step's length. :func:`attention_reference` restates this in PyTorch (float32,
or float64 for float64 inputs); it is the fallback and the tests' model of the kernel.

The output is ``(B, Hq, Sq, D)`` laid out as a contiguous ``(B, Sq, Hq, D)`` buffer (strides of
``buf.transpose(1, 2)``), so that ``out.transpose(1, 2)`` is the contiguous
``(B, Sq, Hq, D)`` tensor transformers' attention functions return, without a copy.
"""

from __future__ import annotations

import functools
import logging
import math

import torch

from .. import dispatch
from ._dtypes import check_float
from ._define import define_op
from .kv_cache import mismatch as kv_mismatch
from .rope import _append_check as rope_append_check
from .rope import _halves
from .rope import _result_dtype as rope_result_dtype
from .rope import _mismatch as rope_mismatch
from .rope import rope_append, rope_append_reference
from ..kernel_src._spec import next_power_of_2
from ..kernel_src.attention import (COMBINE_BS, DECODE_BN, DECODE_BN_LONG, DECODE_HEADS, DECODE_LONG_KEYS, DECODE_ROWS,
                                    HEAD_DIMS, PREFILL)

KERNEL_DTYPES = (torch.bfloat16, torch.float16)
#: Query lengths up to this take the decode tiles (query heads of a group packed into one tile).
DECODE_MAX_SQ = DECODE_ROWS
#: Split-KV: each split gets at least this many keys, and there are at most MAX_SPLITS (H200 sweep,
#: ``dev/microbench/decode_splits.py``: shorter splits lose more to the combine than they gain).
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------

def visible_mask(batch: int, sq: int, skv: int, mask: torch.Tensor | None = None, causal: bool = True,
                 window: int | None = None, device=None, kv_len: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean ``(B or 1, 1, Sq, Skv)``: which keys each query sees (the module docstring's rule;
    with ``kv_len``, keys from ``kv_len`` on are hidden and positions count from it, on the device)."""
    device = mask.device if mask is not None else device
    j = torch.arange(skv, device=device).view(1, skv)
    n = skv if kv_len is None else kv_len.reshape(()).clamp(max=skv)
    i = torch.arange(sq, device=device).view(sq, 1) + (n - sq)
    vis = torch.ones(sq, skv, dtype=torch.bool, device=device) if kv_len is None else (j < n).expand(sq, skv)
    if causal:
        vis = vis & (j <= i)
    if window is not None and window > 0:
        vis = vis & (j > i - window)
    vis = vis.view(1, 1, sq, skv)
    if mask is not None:
        vis = vis & mask.to(torch.bool)
    return vis


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                        scale: float | None = None, causal: bool = True, window: int | None = None,
                        softcap: float | None = None, kv_len: torch.Tensor | None = None) -> torch.Tensor:
    """Attention by explicit softmax, with the semantics of the module docstring.

    Computes in float32 (float64 when ``q`` is float64), loops over query heads to bound memory,
    and returns ``(B, Hq, Sq, D)`` in ``q.dtype`` with the op's memory layout.
    """
    _check(q, k, v, mask, kv_len)
    B, Hq, Sq, D = q.shape
    Skv = k.shape[2]
    group = Hq // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    vis = visible_mask(B, Sq, Skv, mask, causal, window, device=q.device, kv_len=kv_len)
    if kv_len is not None:  # the slots past kv_len may hold anything (0 * NaN is not 0)
        filled = (torch.arange(Skv, device=k.device) < kv_len.reshape(())).view(1, 1, Skv, 1)
        k, v = k.masked_fill(~filled, 0), v.masked_fill(~filled, 0)
    out = torch.empty(B, Sq, Hq, v.shape[3], dtype=q.dtype, device=q.device)
    for h in range(Hq):
        qh, kh, vh = q[:, h].to(cdt), k[:, h // group].to(cdt), v[:, h // group].to(cdt)
        s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~vis[:, 0], float("-inf"))
        if Skv == 0:  # no key at all: every query sees nothing (zeros, as the kernel path and sdpa)
            out[:, :, h] = 0
            continue
        mx = s.amax(-1, keepdim=True)
        e = torch.exp(s - torch.where(torch.isinf(mx), torch.zeros_like(mx), mx))
        den = e.sum(-1, keepdim=True)
        p = e / torch.where(den == 0, torch.ones_like(den), den)
        out[:, :, h] = torch.matmul(p, vh).to(q.dtype)
    return out.transpose(1, 2)


def mask_mismatch(mask, batch: int, q_len: int, kv_len: int, device: torch.device | None = None) -> str | None:
    """Why ``mask`` is not the boolean attention mask our kernels read, or None when it is.

    The kernels take sdpa's boolean layout (``True`` = attend): a ``torch.bool`` tensor of shape
    ``(batch or 1, 1, q_len, kv_len)``, on ``device`` where one is given (transformers'
    ``sdpa_mask`` builds this layout). The one shape rule for :func:`attention`,
    :func:`rope_append_attention` and the attention layer's routing."""
    if not isinstance(mask, torch.Tensor):
        return f"mask is a {type(mask).__name__}, not a boolean tensor"
    if (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[0] not in (1, batch)
            or tuple(mask.shape[1:]) != (1, q_len, kv_len)):
        return (f"mask {mask.dtype} {tuple(mask.shape)} is not a boolean (B or 1, 1, Sq, Skv) = "
                f"({batch} or 1, 1, {q_len}, {kv_len}) mask (True = attend)")
    if device is not None and mask.device != device:
        return f"mask is on {mask.device}, not {device}"
    return None


def _check(q, k, v, mask, kv_len=None) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention: q, k, v must be 4-D (B, H, S, D); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, Hq, Sq, D = q.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != B or k.shape[3] != D or v.shape[3] != D:
        raise ValueError(f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} must be (B, Hkv, Skv, D) "
                         f"with q's B and D (q is {tuple(q.shape)})")
    if k.shape[1] == 0 or Hq % k.shape[1]:
        raise ValueError(f"attention: {Hq} query heads are not a multiple of {k.shape[1]} KV heads")
    if mask is not None and (why := mask_mismatch(mask, B, Sq, k.shape[2])) is not None:
        raise ValueError(f"attention: {why}")
    if kv_len is not None and not isinstance(kv_len, torch.Tensor):
        raise TypeError(f"attention: kv_len must be a one-element int64 tensor on k's device, not a "
                        f"{type(kv_len).__name__} (a host number would freeze in a captured graph)")
    if kv_len is not None and (kv_len.numel() != 1 or kv_len.dtype != torch.int64 or kv_len.device != k.device):
        raise ValueError(f"attention: kv_len must be one int64 element on k's device; got {kv_len.dtype} of shape "
                         f"{tuple(kv_len.shape)} on {kv_len.device}")


# ---------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------

def padded_head_dim(head_dim: int) -> int:
    """The head dim the kernel's tiles load for ``head_dim`` (zero-padded lanes): the next power of
    two, at least the smallest built (``HEAD_DIMS``); a built variant exists when it is in it."""
    return max(HEAD_DIMS[0], next_power_of_2(head_dim))


@functools.lru_cache(maxsize=None)
def tiles_for(head_dim: int, sq: int, group: int) -> tuple | None:
    """The (D, HB, BS, BN) tile constants for a call, or None when no variant takes the head dim.

    Decode and short chunks (``Sq <= 16``) pack ``HB`` query heads of a KV group into one 16-row
    tile (``HB`` the largest built value dividing the group size), with the short tile's keys
    (:func:`decode_bn` may widen them for a launch); longer queries take the prefill tiles, one head
    per block.
    """
    dp = padded_head_dim(head_dim)
    if dp not in HEAD_DIMS:
        return None
    if sq <= DECODE_MAX_SQ:
        hb = max(h for h in DECODE_HEADS if group % h == 0)
        return (dp, hb, DECODE_ROWS // hb, DECODE_BN[dp])
    return (dp,) + PREFILL[dp]


@functools.lru_cache(maxsize=None)
def padded_heads(group: int) -> int | None:
    """The query heads a decode tile packs for a KV group of ``group`` heads that no built ``HB``
    divides (Phi-4-mini's 3, Qwen2.5's 6 and 7): the group padded up to a power of two, at most the
    largest built ``HB``, where that reads each KV head's keys in fewer blocks than the largest
    divisor does (3: one block instead of three); else None. The call then runs as ``B * Hkv``
    batches of one KV head (:func:`launches`), the padded head rows loaded as zeros and not stored."""
    divisor = max(h for h in DECODE_HEADS if group % h == 0)
    pad = min(max(DECODE_HEADS), next_power_of_2(group))
    return pad if -(-group // pad) < group // divisor else None


def _one_kv_head_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor):
    # q, o (B, Hq, Sq, D) and k, v (B, Hkv, Skv, D) as B * Hkv batches of one KV head: views, or None
    # where the batch and head strides do not merge (q of several positions and rows; a strided k).
    (B, Hq, Sq, D), Hkv = q.shape, k.shape[1]
    try:
        return (q.view(B * Hkv, Hq // Hkv, Sq, D), k.view(B * Hkv, 1, k.shape[2], D),
                v.view(B * Hkv, 1, v.shape[2], D), o.view(B * Hkv, Hq // Hkv, Sq, D))
    except RuntimeError:
        return None


def decode_bn(dp: int, keys: int, splits: int) -> int:
    """Keys per tile of a decode-tile launch over ``keys`` cache slots (k's length: the static
    cache's size, not its filled count, so that a captured graph keeps one tile) in ``splits`` KV
    splits: the long tile (``DECODE_BN_LONG``) for one unsplit pass over at least
    ``DECODE_LONG_KEYS`` slots, the short one (``DECODE_BN``) otherwise (H200 sweep: see
    ``kernel_src/attention.py``)."""
    return DECODE_BN_LONG[dp] if splits == 1 and keys >= DECODE_LONG_KEYS else DECODE_BN[dp]


def num_splits(blocks: int, keys: int, sms: int) -> int:
    """How many KV splits a decode launch of ``blocks`` blocks over ``keys`` cache slots takes.

    One (no split) when the blocks outnumber half the ``sms`` multiprocessors; otherwise enough to
    bring the grid up to about one block per multiprocessor, ``keys // MIN_KEYS_PER_SPLIT`` at most
    (the kernel deals whole KV tiles to the splits, so a last split may get fewer keys), and at most
    MAX_SPLITS. Measured on the H200 (``dev/microbench/decode_splits.py``, 2026-12-03): a split
    costs its combine launch and pays only where few blocks each read many keys (e.g. 8 blocks over
    1024 keys: 11.3 us unsplit, 10.4 with 4 splits; 128 blocks over 392 keys: 8.2 us unsplit, 15.5
    with 2).
    """
    if 2 * blocks > sms:
        return 1
    return max(1, min(sms // blocks, keys // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


#: (kind, device, padded head dim or 0) -> a stand-in array made by :func:`prepare`.
_DUMMIES: dict = {}
_DUMMY_KINDS = {"mask": ((1, 1, 1), torch.int8), "tiles": ((1, 1, 1), torch.int8),
                "part": ((1, 1, 1, None), torch.float32), "lse": ((1, 1, 1), torch.float32),
                "kv_len": ((1,), torch.int64)}


def _new_dummy(kind: str, device: torch.device, dp: int) -> torch.Tensor:
    shape, dtype = _DUMMY_KINDS[kind]
    return torch.zeros(tuple(dp if n is None else n for n in shape), dtype=dtype, device=device)


def _dummy(kind: str, device: torch.device, dp: int = 0) -> torch.Tensor:
    # Stand-ins for the arrays a launch does not read (no mask) or write (no split): the kernel
    # branches on a scalar and never touches them. Never kept from inside a call (see prepare).
    key = (kind, device, dp if kind == "part" else 0)
    t = _DUMMIES.get(key)
    return _new_dummy(kind, device, key[2]) if t is None else t


def prepare(device: torch.device | str) -> None:
    """Make the kernel's stand-in arrays (for the mask, filled length and split buffers a launch
    does not use) on ``device`` once, so that launches there allocate none.

    Called when a model is switched to our attention (``layers/models``' ``cutile_attention`` and
    ``gemma2_attention`` patches), outside any forward: an array first made and kept inside a call
    would be made inside torch.compile's CUDA-graph warm-up when the first kernel call is a compiled
    decode step (prefill on sdpa), and kept, would sit in the graphs' memory pool (cudagraph trees
    then refuse to record: "tensors in the cudagraph pool not tracked as outputs"; H200,
    2026-12-04). Without it each launch makes its own (a few microseconds of host time). Idempotent.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    for kind in _DUMMY_KINDS:
        for dp in (HEAD_DIMS if kind == "part" else (0,)):
            _DUMMIES.setdefault((kind, device, dp), _new_dummy(kind, device, dp))


def kernel_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The kernel's ``(MB, Sq, Skv)`` int8 view of a boolean ``(B or 1, 1, Sq, Skv)`` mask.

    A batch dimension that is broadcast (stride 0, as ``sdpa_mask`` expands it) becomes MB = 1;
    any other broadcast dimension is materialised. The bytes are reinterpreted, not copied.
    """
    if mask is None:
        return None
    m = mask[:, 0]
    if m.shape[0] > 1 and m.stride(0) == 0:
        m = m[:1]
    if (m.shape[1] > 1 and m.stride(1) == 0) or (m.shape[2] > 1 and m.stride(2) == 0):
        m = m.contiguous()
    return m.view(torch.int8)


def launches(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, out: torch.Tensor,
             scale: float, causal: bool = True, window: int | None = None, softcap: float | None = None,
             splits: int | None = None, sms: int | None = None, kv_len: torch.Tensor | None = None) -> list[tuple] | str:
    """The kernel launches that compute attention into ``out``, as ``dispatch.run`` arguments
    ``(kernel, want, args, n_inputs, grid)``; or the reason no kernel takes the call.

    One launch of ``attention``, or with ``splits > 1`` KV splits (default: :func:`num_splits`, for
    decode-sized queries) the split launch then
    ``attention_combine`` (a split call takes the short tiles at any length); an unsplit
    prefill-sized call (``Sq > DECODE_MAX_SQ``) with a mask first classifies the mask's tiles
    (``attention_mask_tiles``: hidden, partial, full), which its ``attention`` launch reads to skip
    hidden tiles and the mask reads of full ones. ``sms`` defaults to the device's multiprocessor
    count. ``kv_len`` is
    for the short tiles (decode-sized or split calls) only; their splits are chosen for k's whole
    length (a graph replays them for every ``kv_len``) and share the first ``kv_len`` keys' tiles;
    their keys per tile follow (:func:`decode_bn`). A decode-sized call whose KV group no built
    ``HB`` divides (:func:`padded_heads`) runs unsplit as ``B * Hkv`` batches of one KV head where
    the views allow it (one position, or batch 1), the mask is shared by the batch, and no split is
    asked for or chosen for that grid (:func:`num_splits`); otherwise with the largest divisor.
    """
    B, Hq, Sq, D = q.shape
    Skv = k.shape[2]
    # Decode-sized queries, and any call split over the KV (the prefill tiles do not split), take
    # the short tiles.
    short = Sq <= DECODE_MAX_SQ or (splits or 1) > 1
    tiles = tiles_for(D, 1 if short else Sq, Hq // k.shape[1])
    if tiles is None:
        return f"head_dim {D} > {HEAD_DIMS[-1]}"
    if kv_len is not None and not short:
        return "kv_len with prefill tiles (attention_into makes it part of the mask)"
    dp, hb, bs, bn = tiles
    o = out.transpose(1, 2)
    m = kernel_mask(mask)
    has_mask = int(m is not None)
    if m is None:
        m = _dummy("mask", q.device)
    n = _dummy("kv_len", q.device) if kv_len is None else kv_len.view(1)
    q_blocks = -(-Sq // bs)
    if short:
        if splits is None:
            sms = sms if sms is not None else dispatch.sm_count(q.device.index or 0)
        # A group no HB divides, unsplit, mask shared by the batch: B * Hkv batches of one KV head.
        pad = padded_heads(Hq // k.shape[1]) if splits in (None, 1) and m.shape[0] == 1 else None
        views = _one_kv_head_views(q, k, v, o) if pad else None
        if views is not None:
            pad_blocks = -(-Sq // (DECODE_ROWS // pad))
            if splits == 1 or num_splits(pad_blocks * B * k.shape[1] * -(-(Hq // k.shape[1]) // pad), Skv, sms) == 1:
                (q, k, v, o), hb, bs, q_blocks, splits = views, pad, DECODE_ROWS // pad, pad_blocks, 1
    if splits is None:
        splits = 1
        if short:
            splits = num_splits(q_blocks * B * (Hq // hb), Skv, sms)
    if short:  # the keys per tile depend on the split count, known only now
        bn = decode_bn(dp, Skv, splits)
    want = (("D", dp), ("HB", hb), ("BS", bs), ("BN", bn))
    grid = (q_blocks * splits, q.shape[0] * -(-q.shape[1] // hb), 1)
    if not short:  # the prefill tiles; with a mask, its tiles classified first
        kv_tiles = -(-Skv // bn)
        # Without a mask, a stand-in of its own kind: one array passed as two inputs would be refused as aliased.
        classes = (torch.empty(m.shape[0], q_blocks, kv_tiles, dtype=torch.int8, device=q.device) if has_mask
                   else _dummy("tiles", q.device))
        args = (q, k, v, m, classes, o, float(scale), float(softcap or 0.0), int(window or 0), has_mask, has_mask,
                int(bool(causal)))
        attend = [("attention", want, args, 5, lambda consts: grid)]
        if not has_mask:
            return attend
        tgrid = (kv_tiles, q_blocks, m.shape[0])
        return [("attention_mask_tiles", (("BS", bs), ("BN", bn)), (m, classes), 1, lambda consts: tgrid)] + attend
    scalars = (float(scale), float(softcap or 0.0), int(window or 0), has_mask, int(kv_len is not None),
               int(bool(causal)), splits)
    if splits == 1:
        args = (q, k, v, m, n, o, _dummy("part", q.device, dp), _dummy("lse", q.device)) + scalars
        return [("attention", want, args, 5, lambda consts: grid)]
    part = torch.empty(splits, B * Hq, Sq, dp, dtype=torch.float32, device=q.device)
    lse = torch.empty(splits, B * Hq, Sq, dtype=torch.float32, device=q.device)
    cgrid = (-(-Sq // COMBINE_BS), B * Hq, 1)
    return [("attention", want, (q, k, v, m, n, o, part, lse) + scalars, 5, lambda consts: grid),
            ("attention_combine", (("D", dp), ("BS", COMBINE_BS)), (part, lse, o, splits), 2, lambda consts: cgrid)]


def attention_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   out: torch.Tensor, scale: float, causal: bool = True, window: int | None = None,
                   softcap: float | None = None, splits: int | None = None, kv_len: torch.Tensor | None = None) -> bool:
    """Launch the attention kernel(s) on CUDA tensors into ``out`` ``(B, Sq, Hq, D)`` (contiguous,
    new, of q's dtype; not checked). Arguments as :func:`attention`; ``splits`` forces the number
    of KV splits. Returns False (nothing written) when no cuTile path fits; the caller then falls
    back.

    Raises:
        FallbackError: no cuTile path and ``CUTILE_KERNELS_STRICT=1``.
        RuntimeError: a split launch ran but the build has no combine kernel for it.
    """
    if q.dtype not in KERNEL_DTYPES:
        return dispatch.fallback("attention", f"dtype {q.dtype} (the kernels take bfloat16 and float16)")
    if kv_len is not None and q.shape[2] > DECODE_MAX_SQ:
        # The prefill tiles read all of k (their code predates kv_len): the length joins the mask,
        # computed on the device (a prefill into a static cache; not the decode steps graphs replay).
        mask = visible_mask(q.shape[0], q.shape[2], k.shape[2], mask, causal, window, q.device, kv_len)
        causal, window, kv_len = False, None, None
    plan = launches(q, k, v, mask, out, scale, causal, window, softcap, splits, kv_len=kv_len)
    if isinstance(plan, str):
        return dispatch.fallback("attention", plan)
    if not dispatch.run(*plan[0]):
        return False
    for step in plan[1:]:
        if not dispatch.run(*step):
            raise RuntimeError(f"attention: {plan[0][0]} ran but {step[0]} could not (the build must "
                               "hold every attention kernel)")
    return True


def _attention_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                    causal: bool, window: int, softcap: float, kv_len: torch.Tensor | None) -> torch.Tensor:
    window, softcap = window or None, softcap or None
    B, Hq, Sq, D = q.shape
    out = torch.empty(B, Sq, Hq, D, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out.transpose(1, 2)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        dispatch.fallback("attention", f"mixed dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}")
    elif k.shape[2] == 0:
        out.zero_()  # no key at all: every query sees nothing
        return out.transpose(1, 2)
    elif attention_into(q, k, v, mask, out, scale, causal, window, softcap, kv_len=kv_len):
        return out.transpose(1, 2)
    return attention_reference(q, k, v, mask, scale, causal, window, softcap, kv_len)


def _op_reference(q, k, v, mask, scale, causal, window, softcap, kv_len):
    # The op's arguments say "none" as 0 (its schema has no optional int / float).
    return attention_reference(q, k, v, mask, scale, causal, window or None, softcap or None, kv_len)


def _op_check(q, k, v, mask, scale, causal, window, softcap, kv_len) -> None:
    _check(q, k, v, mask, kv_len)


def _attention_fake(q, k, v, mask, scale, causal, window, softcap, kv_len):
    B, Hq, Sq, D = q.shape
    return q.new_empty(B, Sq, Hq, v.shape[3]).transpose(1, 2)


# The CPU path is the reference as it returns (the op's layout already, not contiguous).
_attention = define_op("attention", _attention_cuda, reference=_op_reference, fake=_attention_fake, check=_op_check,
                       cpu=_op_reference)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *,
              scale: float | None = None, causal: bool = True, window: int | None = None,
              softcap: float | None = None, kv_len: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention forward with GQA, causal / sliding-window / boolean masks and
    logit soft-capping (semantics in the module docstring).

    Args:
        q: ``(B, Hq, Sq, D)`` queries, any strides; bfloat16 or float16 for the kernel.
        k, v: ``(B, Hkv, Skv, D)`` keys and values (``Hq % Hkv == 0``), same dtype as ``q``;
            views of a cache are fine (nothing is read past ``Skv``).
        mask: optional boolean ``(B or 1, 1, Sq, Skv)``, True where a query may attend.
        scale: multiplies ``q k^T`` (default ``1 / sqrt(D)``).
        causal: lower-right causal masking (query ``i`` is at position ``Skv - Sq + i``).
        window: sliding window in keys (``j > i + Skv - Sq - window``); None or 0 for none.
        softcap: ``softcap * tanh(s / softcap)`` on the scaled logits; None or 0 for none.
        kv_len: optional one-element int64 tensor on k's device: only the first ``kv_len`` keys
            exist (a static cache's filled slots; read on the device, never on the host). With
            more than 16 queries the kernel folds it into the mask and still reads the slots past
            it, which must then hold finite values (a ``StaticCache``'s are zeros until written).

    Returns:
        ``(B, Hq, Sq, D)`` in ``q.dtype``, memory laid out as contiguous ``(B, Sq, Hq, D)``.

    On CUDA this runs the cuTile kernel (prebuilt, else JIT) with float32 accumulation; what the
    kernels cannot take (float32 or float64, head_dim > 256, mixed dtypes, no build for the GPU)
    takes :func:`attention_reference` and logs the reason once. Under ``torch.compile`` or when an
    input requires grad it is the custom op ``<namespace>::attention`` (fake implementation;
    gradients from the reference).

    Raises:
        TypeError: q, k or v is not bfloat16, float16, float32 or float64.
        ValueError: shapes or mask do not match, Hq is not a multiple of Hkv, or kv_len is not one
            int64 element on k's device.
        TypeError: kv_len is not a tensor.
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
        CudaError: the CUDA driver failed to launch the kernel.
    """
    check_float("attention", "q, k, v", q, k, v, kernel_dtypes=(torch.bfloat16, torch.float16))
    _check(q, k, v, mask, kv_len)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    return _attention.call_checked(q, k, v, mask, scale, bool(causal), int(window or 0), float(softcap or 0.0),
                                   kv_len)


# ---------------------------------------------------------------------------------------------
# RoPE, the static KV cache write and decode attention in one launch
# ---------------------------------------------------------------------------------------------

ROPE_APPEND_KERNEL = "rope_append_attention"
#: Reasons :func:`rope_append_attention` took two launches, logged once each.
_SAID: set = set()
logger = logging.getLogger("cutile_kernels")


def _one_launch(q, k, v, cos, sin, keys, values) -> tuple | str:
    """The one launch's ``(HB, splits)`` for these arguments (the decode tile's head block and the
    split count the attention op would choose for this grid and cache; off the GPU, one split), or
    why :func:`rope_append_attention`'s one launch does not take them (the op then runs
    ``rope_append`` and ``attention``); shapes already checked."""
    D = q.shape[3]
    if D not in HEAD_DIMS or cos.shape[-1] != D:
        dims = "/".join(map(str, HEAD_DIMS))
        return f"head_dim {D} rotated over {cos.shape[-1]} (one launch: all of a head of {dims})"
    if len({q.dtype, k.dtype, v.dtype, cos.dtype, sin.dtype, keys.dtype, values.dtype}) != 1 \
            or q.dtype not in KERNEL_DTYPES:
        return f"dtypes q {q.dtype}, cos {cos.dtype}, cache {keys.dtype} (one of bfloat16/float16 throughout)"
    group = q.shape[1] // k.shape[1]
    if padded_heads(group) is not None:
        return f"a KV group of {group} heads (attention pads it: B * Hkv batches of one KV head)"
    hb = max(h for h in DECODE_HEADS if group % h == 0)
    if q.device.type != "cuda":
        return hb, 1
    splits = num_splits(q.shape[0] * (q.shape[1] // hb), keys.shape[2], dispatch.sm_count(q.device.index or 0))
    if decode_bn(D, keys.shape[2], splits) != DECODE_BN[D]:
        return f"one pass over {keys.shape[2]} slots (attention's long tile)"
    return hb, splits


def rope_append_attention_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                mask: torch.Tensor | None = None) -> bool:
    """Whether :func:`rope_append_attention` runs these arguments as its one launch: a decode step
    (one position) in its shape contract (``mask`` None or boolean ``(B or 1, 1, 1, L)``), the whole
    head rotated (``R == D``, D one of 64, 128, 256), one 16-bit dtype throughout, a KV group the
    decode tile packs as it is, a cache the decode attention reads with its short tile, and no
    gradient asked for. A caller that gets False runs :func:`~.rope.rope_append` and
    :func:`attention` itself (the op would run them too, and say so)."""
    if _rope_append_attention_mismatch(q, k, v, cos, sin, keys, values, mask):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, cos, sin)):
        return False
    return not isinstance(_one_launch(q, k, v, cos, sin, keys, values), str)


def _rope_append_attention_mismatch(q, k, v, cos, sin, keys, values, mask=None) -> str | None:
    if q.dim() != 4 or q.shape[2] != 1:
        return f"q {tuple(q.shape)} is not (B, Hq, 1, D): one position (a decode step)"
    why = rope_mismatch(q, k, cos, sin) or kv_mismatch(keys, values, k, v)
    if why is not None:
        return why
    if q.shape[3] != keys.shape[3] or q.shape[1] % keys.shape[1]:
        return f"q {tuple(q.shape)} and the cache {tuple(keys.shape)}: not (B, Hq, 1, D) over (B, Hkv, L, D), Hkv | Hq"
    if mask is not None:
        return mask_mismatch(mask, q.shape[0], 1, keys.shape[2], keys.device)
    return None


def _rope_append_attention_check(q, k, v, cos, sin, keys, values, length, mask, out, scale, softcap,
                                 window) -> None:
    why = _rope_append_attention_mismatch(q, k, v, cos, sin, keys, values, mask)
    if why is not None:
        raise ValueError(f"rope_append_attention: {why}")
    B, Hq, _, D = q.shape
    dtype = rope_result_dtype(q.dtype, cos.dtype, sin.dtype)  # the rotated q's, as apply_rope promotes
    rope_append_check(q, k, v, cos, sin, keys, values, length, q.new_empty((), dtype=dtype).expand(q.shape))
    if out.shape != (B, 1, Hq, D) or out.dtype != dtype:
        raise ValueError(f"rope_append_attention: out {tuple(out.shape)} {out.dtype} is not ({B}, 1, {Hq}, {D}) "
                         f"{dtype}")


def rope_append_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                    sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor,
                                    mask: torch.Tensor | None, out: torch.Tensor, scale: float, softcap: float,
                                    window: int) -> None:
    """:func:`~.rope.rope_append_reference` (RoPE of q and k, the rotated k and v written at slot
    ``length``), then :func:`attention_reference` of the rotated q over the first ``length + 1``
    keys (causal, or with a boolean ``mask`` ``(B or 1, 1, 1, L)`` the mask's keys; ``window``,
    ``softcap``: 0 says none) into ``out`` ``(B, 1, Hq, D)``."""
    q_rot = torch.empty_like(q, dtype=out.dtype)
    rope_append_reference(q, k, v, cos, sin, keys, values, length, q_rot)
    o = attention_reference(q_rot, keys, values, mask, scale, mask is None, window or None, softcap or None,
                            kv_len=length.reshape(1) + 1)
    out.copy_(o.transpose(1, 2))


def _rope_attention_layout(args: tuple) -> tuple:
    # q, k, cos and sin as (..., 2, D/2) halves (the whole head rotated); the rest as they are.
    d = args[0].shape[-1]
    return tuple(_halves(t, d) if i in (0, 1, 3, 4) else t for i, t in enumerate(args))


def _rope_append_attention_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor,
                                mask: torch.Tensor | None, out: torch.Tensor, scale: float, softcap: float,
                                window: int) -> None:
    plan = _one_launch(q, k, v, cos, sin, keys, values)
    why = plan if isinstance(plan, str) else None
    if why is None:
        (B, Hq, _, D), (hb, splits) = q.shape, plan
        o = out.transpose(1, 2)
        if splits == 1:
            part, lse = _dummy("part", q.device, D), _dummy("lse", q.device)
        else:
            part = torch.empty(splits, B * Hq, 1, D, dtype=torch.float32, device=q.device)
            lse = torch.empty(splits, B * Hq, 1, dtype=torch.float32, device=q.device)
        want = (("D", D), ("HB", hb), ("BS", DECODE_ROWS // hb), ("BN", DECODE_BN[D]),
                ("MASKED", int(mask is not None)))
        m = _dummy("mask", q.device) if mask is None else kernel_mask(mask)
        args = (q, k, v, cos, sin, keys, values, length.view(1), m, o, part, lse, float(scale), float(softcap),
                int(window), splits)
        grid = (splits, B * Hq // hb, 1)
        if dispatch.run(ROPE_APPEND_KERNEL, want, args, 9, lambda consts: grid, _rope_attention_layout,
                        optional=True):
            if splits > 1 and not dispatch.run("attention_combine", (("D", D), ("BS", COMBINE_BS)),
                                               (part, lse, o, splits), 2, lambda consts: (1, B * Hq, 1)):
                raise RuntimeError(f"{ROPE_APPEND_KERNEL} ran but attention_combine could not (the build must "
                                   "hold every attention kernel)")
            return
        why = f"no {ROPE_APPEND_KERNEL} variant fits these tensors"
    if why not in _SAID:  # not a fallback: our two kernels run (each says so if it cannot)
        _SAID.add(why)
        logger.info("cutile_kernels: %s runs rope_append, then attention: %s", ROPE_APPEND_KERNEL, why)
    q_rot = rope_append(q, k, v, cos, sin, keys, values, length)
    o = attention(q_rot, keys, values, mask, scale=scale, causal=mask is None, window=window or None,
                  softcap=softcap or None, kv_len=length.reshape(1) + 1)
    out.copy_(o.transpose(1, 2))


def _rope_append_attention_fake(q, k, v, cos, sin, keys, values, length, mask, out, scale, softcap, window) -> None:
    return None


# Flexible as rope_append is: every layer of a compiled step reads the step's one mask and cos/sin pair,
# which inductor's default copied for each layer's call (seen in its CPU code at head dim 64); the kernel
# takes any strides of them and a variant that does not fit falls back (two launches, said once).
_rope_append_attention = define_op(ROPE_APPEND_KERNEL, _rope_append_attention_cuda,
                                   reference=rope_append_attention_reference, fake=_rope_append_attention_fake,
                                   check=_rope_append_attention_check, cpu=rope_append_attention_reference,
                                   backward=None, mutates_args=("keys", "values", "out"), flexible=True)


def rope_append_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor, *,
                          scale: float | None = None, softcap: float | None = None,
                          window: int | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's RoPE of q and k, the static KV cache write of the rotated k and of v, and
    attention of the rotated q over the filled cache (causal, or as ``mask`` shows it), in one launch: what
    :func:`~.rope.rope_append` (transformers' ``apply_rotary_pos_emb`` then ``StaticLayer.update``'s
    writes, cache_utils.py v5.22.2) followed by :func:`attention` with ``kv_len = length + 1``
    (and ``mask``, where given) compute. The new key is attended from registers; the cached ones as
    the decode tiles do.

    Args:
        q: ``(B, Hq, 1, D)`` queries before RoPE, any strides (views of a stacked projection).
        k, v: ``(B, Hkv, 1, D)`` the step's key (rotated here) and value.
        cos, sin: ``(B or 1, 1, R)`` as the model's rotary embedding returns them.
        keys, values: ``(B, Hkv, L, D)`` the cache layer's tensors, written at slot ``length`` (on
            CUDA not where ``length >= L``: the caller checks room first).
        length: one int64 element on the cache's device: the keys already cached (read on the
            device, not advanced: the caller adds 1 as ``update`` does).
        scale: logit scale (default ``1 / sqrt(D)``); softcap: ``softcap * tanh(s / softcap)``;
            window: sliding window in keys (``j > length - window``); None or 0 for none.
        mask: None, or sdpa's boolean ``(B or 1, 1, 1, L)`` mask of the step (True = attend; a
            compiled step's, padding included): it then decides which of the first ``length + 1``
            keys the query sees, in place of causality (as :func:`attention` with a mask).

    Returns:
        The attention output ``(B, Hq, 1, D)`` in the rotated q's dtype (q's, promoted with cos's
        as :func:`~.rope.apply_rope` promotes), laid out as contiguous ``(B, 1, Hq, D)``
        (as :func:`attention`).

    The one launch (cuTile ``rope_append_attention_kernel``) takes the calls of
    :func:`rope_append_attention_takes`; other calls (and a GPU without a fitting variant) run
    :func:`~.rope.rope_append` and :func:`attention`, said once a reason; off the GPU
    :func:`rope_append_attention_reference`. Under ``torch.compile`` the custom op
    ``<namespace>::rope_append_attention`` (mutating the cache), without a backward.

    Raises:
        TypeError: a tensor is not floating point, or ``length`` is not a tensor.
        ValueError: shapes or dtypes do not match (a q of more than one position among them), or
            ``mask`` is not a boolean ``(B or 1, 1, 1, L)`` tensor on the cache's device.
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
    """
    check_float(ROPE_APPEND_KERNEL, "q, k, v, cos, sin, keys, values", q, k, v, cos, sin, keys, values)
    B, Hq, _, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = torch.empty(B, 1, Hq, D, dtype=rope_result_dtype(q.dtype, cos.dtype, sin.dtype), device=q.device)
    _rope_append_attention(q, k, v, cos, sin, keys, values, length, mask, out, scale, float(softcap or 0.0),
                           int(window or 0))
    return out.transpose(1, 2)
