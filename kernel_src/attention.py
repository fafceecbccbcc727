"""Scaled dot-product attention forward (flash attention): cuTile device code and build matrix.

Math (Vaswani et al. 2017; online softmax as in Dao et al. 2022, "FlashAttention"), for query
row ``i`` of batch ``b`` and query head ``h``, over key/value rows ``j`` of KV head
``h // (Hq // Hkv)`` (grouped-query attention, K/V never repeated)::

    s_ij = scale * <q_i, k_j>                         float32 accumulation (ct.mma)
    s_ij = softcap * tanh(s_ij / softcap)             only when softcap > 0
    o_i  = sum_j softmax_j(s_ij, visible j) * v_j     running max and sum, float32 accumulator

Key ``j`` is visible to query ``i`` when every enabled condition holds (the same conditions as
``ops.attention.attention_reference``):

* ``j < Skv``: tiles reaching past the KV length are loaded with zero padding and masked. ``Skv``
  is k's length, or the device-side ``kv_len`` when given (a static cache's filled slots: no KV
  tile wholly past it is read, the tail tile's rows past it count as zeros, and a replayed CUDA
  graph sees each step's length);
* ``causal``: ``j <= i + (Skv - Sq)``, lower-right aligned, i.e. query ``i`` sits at absolute
  position ``Skv - Sq + i`` (prefill, chunked prefill and decode over a cache alike);
* ``window > 0``: ``j > i + (Skv - Sq) - window``, transformers' ``sliding_window_overlay``
  (masking_utils.py, v5.22.2): ``window`` keys including the query's own;
* ``has_mask``: ``mask[b % MB, i, j] != 0``, ``mask`` an ``(MB, Sq, Skv)`` int8 array, ``MB`` 1
  (shared by the batch) or ``B``.

A row with no visible key gets a zero output (as torch's SDPA math path). The query heads of a
KV group are packed into one tile (``HB`` heads x ``BS`` query rows = ``HB * BS`` rows), so one
block reads each K/V tile once for all of them: that is what makes decode (``Sq`` = 1) fill a
tensor-core tile. ``HB`` must divide ``Hq // Hkv``, or (one KV head, ``Hkv`` = 1) exceed ``Hq``'s
last block: the host runs a group whose size no ``HB`` divides (Phi-4-mini's 3, Qwen2.5's 6 and 7)
as ``B * Hkv`` batches of one KV head, each block's head rows past ``Hq`` zero-padded and not
stored. Every tile dimension is a power of two: the head dim is loaded as ``D =
next_power_of_2(head_dim)`` lanes with zero padding (zeros add nothing to ``<q, k>``; the padded
output lanes are not stored).

Masked prefill: ``attention_mask_tiles_kernel`` first writes each (query block, KV tile) of the
mask as hidden, partial or full; the prefill kernel then bounds its loop by the first and last
visible tile of its query block, skips hidden tiles on that one byte and reads the mask only on
partial ones (exact for any mask: full and hidden tiles need no element of it).

Split-KV (decode over long contexts): with ``num_splits > 1`` a block handles one slice of its
KV tiles and writes the slice's normalised float32 output and log2-sum-exp (``part``, ``lse``);
``attention_combine_kernel`` merges the slices (the log-sum-exp rescaling of FlashDecoding).
"""

from __future__ import annotations

import math

import cuda.tile as ct

from ._pdl import pdl_wait, with_pdl
from ._spec import DTYPE_TAGS, ArrayParam, ConstParam, ScalarParam, VariantSpec, array
from .rope import _cos_sin, _rounded_mul

ZERO = ct.PaddingMode.ZERO
#: Classes of a mask tile (attention_mask_tiles_kernel): no key visible, some, all.
TILE_HIDDEN, TILE_PARTIAL, TILE_FULL = 0, 1, 2
#: KV tiles of one query block's class row the prefill kernel reads at once for its bounds
#: (16384 keys at 64 a tile); past that it visits every KV tile and reads each one's class.
TILE_ROW = 256
LOG2E = 1.4426950408889634  # exp(x) == exp2(x * log2(e))
NEG_INF = -math.inf


@ct.function
def _kv_tile_range(qb, sq, skv, causal, window, BS: ct.Constant[int], BN: ct.Constant[int]):
    # [first, last) KV tiles holding a key visible to some row of query block qb.
    first_pos = qb * BS + (skv - sq)
    last_pos = ct.minimum(qb * BS + BS, sq) - 1 + (skv - sq)
    hi = skv
    if causal != 0:
        hi = ct.maximum(ct.minimum(skv, last_pos + 1), 0)
    lo = 0
    if window > 0:
        lo = ct.minimum(ct.maximum(first_pos - window + 1, 0), hi)
    return lo // BN, ct.cdiv(hi, BN)


@ct.function
def _kv_length(k, kv_len, has_len):
    # Skv: the keys k holds, or with has_len the first kv_len[0] of them (a static cache's filled
    # slots, read on the device so that a captured graph sees each step's length).
    skv = k.shape[2]
    if has_len != 0:
        skv = ct.minimum(ct.gather(kv_len, 0).astype(ct.int32), skv)
    return skv


@ct.function
def _tail_rows_zeroed(vt, j, skv, BN: ct.Constant[int]):
    # The tail tile: with kv_len, slots past Skv are read and may hold anything (an unfilled cache
    # slot); p is 0 there, but 0 * NaN is not 0.
    if (j + 1) * BN > skv:
        vrow = ct.reshape(j * BN + ct.arange(BN, dtype=ct.int32), (BN, 1))
        vt = ct.where(vrow < skv, vt, 0.0)
    return vt


@ct.function
def _attend(q, k, v, mask, tiles, b, hb, qb, j_lo, j_hi, skv, scale, softcap, window, has_mask, has_tiles, has_len,
            causal, D: ct.Constant[int], HB: ct.Constant[int], BS: ct.Constant[int], BN: ct.Constant[int]):
    """Online softmax over KV tiles [j_lo, j_hi) of the first ``skv`` keys, for one (batch, head
    block, query block). With ``has_tiles`` the mask's classes of this query block's KV tiles
    (:func:`attention_mask_tiles_kernel`) say which tiles to skip (hidden), which to run without
    reading the mask (full) and which need it (partial).

    Returns the unnormalised float32 accumulator (M, D), the running max (M, 1) in log2 units
    (-inf for a row that saw no visible key) and the running sum (M, 1), M = HB * BS.
    """
    M = HB * BS
    sq = q.shape[2]
    kvh = (hb * HB) // (q.shape[1] // k.shape[1])
    qt = ct.reshape(ct.load(q, index=(b, hb, qb, 0), shape=(1, HB, BS, D), padding_mode=ZERO), (M, D))
    # Absolute position of each row: row r is head hb * HB + r // BS, query qb * BS + r % BS.
    rows = ct.arange(M, dtype=ct.int32)
    pos = ct.reshape(qb * BS + rows % BS + (skv - sq), (M, 1))
    first_pos = qb * BS + (skv - sq)
    last_pos = ct.minimum(qb * BS + BS, sq) - 1 + (skv - sq)  # rows past Sq are never stored
    cols = ct.reshape(ct.arange(BN, dtype=ct.int32), (1, BN))
    mb = b % mask.shape[0]
    m_i = ct.full((M, 1), NEG_INF, dtype=ct.float32)
    l_i = ct.full((M, 1), 0.0, dtype=ct.float32)
    acc = ct.full((M, D), 0.0, dtype=ct.float32)
    for j in range(j_lo, j_hi):
        # A tile the mask hides entirely (the causal triangle of a padded batch, empty static
        # cache slots) is skipped: exact for any mask, and it restores causal block skipping.
        mt = ct.full((1, BS, BN), 1, dtype=ct.int8)
        live = has_mask == 0
        partial = has_mask != 0
        if has_tiles != 0:  # one byte says what the tile's mask holds: no mask read for a full tile
            cls = ct.gather(tiles, (mb, qb, j))
            live = cls != TILE_HIDDEN
            partial = cls == TILE_PARTIAL
            if partial:
                mt = ct.load(mask, index=(mb, qb, j), shape=(1, BS, BN), padding_mode=ZERO)
        elif has_mask != 0:
            mt = ct.load(mask, index=(mb, qb, j), shape=(1, BS, BN), padding_mode=ZERO)
            live = ct.max(mt) != 0
        if live:
            s = _tile_logits(qt, k, b, kvh, j, scale, softcap, M, D, BN)
            # Element masks only on tiles that need them: the KV end, the causal diagonal, the
            # window's lower edge, or a mask tensor. Interior tiles of a prefill skip the work.
            edge = partial | ((j + 1) * BN > skv)
            if causal != 0:
                edge = edge | ((j + 1) * BN - 1 > first_pos)
            if window > 0:
                edge = edge | (j * BN <= last_pos - window)
            if edge:
                kidx = j * BN + cols
                valid = ct.broadcast_to(kidx < skv, (M, BN))
                if partial:
                    valid = valid & (ct.reshape(ct.broadcast_to(mt, (HB, BS, BN)), (M, BN)) != 0)
                if causal != 0:
                    valid = valid & (kidx <= pos)
                if window > 0:
                    valid = valid & (kidx > pos - window)
                s = ct.where(valid, s, NEG_INF)
            p, alpha, m_new, l_i = _softmax_step(s, m_i, l_i)
            vt = ct.reshape(ct.load(v, index=(b, kvh, j, 0), shape=(1, 1, BN, D), padding_mode=ZERO), (BN, D))
            if has_len != 0:
                vt = _tail_rows_zeroed(vt, j, skv, BN)
            acc = ct.mma(p.astype(v.dtype), vt, acc * alpha)
            m_i = m_new
    return acc, m_i, l_i


@ct.function
def _logits(s, scale, softcap):
    # Scores q.k (float32) as the softmax's logits in base 2 (exp(x) = exp2(x * log2 e)): times
    # scale, or softcap * tanh(scale * s / softcap) with a softcap.
    if softcap > 0.0:
        s = ct.tanh(s * (scale / softcap)) * (softcap * LOG2E)
    else:
        s = s * (scale * LOG2E)
    return s


@ct.function
def _tile_logits(qt, k, b, kvh, j, scale, softcap, M: ct.Constant[int], D: ct.Constant[int], BN: ct.Constant[int]):
    # The logits of the M query rows qt (M, D) against KV tile j of head kvh of k (B, Hkv, S, D).
    kt = ct.load(k, index=(b, kvh, 0, j), shape=(1, 1, D, BN), order=(0, 1, 3, 2), padding_mode=ZERO)
    return _logits(ct.mma(qt, ct.reshape(kt, (D, BN)), ct.full((M, BN), 0.0, dtype=ct.float32)), scale, softcap)


@ct.function
def _softmax_step(s, m_i, l_i):
    # Online softmax over one KV tile's logits s (M, BN), float32 in log2 units (-inf where hidden):
    # the tile's probabilities, the rescale of the running state, the new max and the new sum.
    m_new = ct.maximum(m_i, ct.max(s, axis=1, keepdims=True))
    # A row with no visible key so far keeps max -inf: subtract 0 instead, so that its
    # probabilities are exp2(-inf) = 0 and not exp2(-inf + inf) = NaN.
    m_use = ct.where(m_new == NEG_INF, 0.0, m_new)
    p = ct.exp2(s - m_use)
    alpha = ct.exp2(m_i - m_use)
    return p, alpha, m_new, l_i * alpha + ct.sum(p, axis=1, keepdims=True)


@ct.kernel
def attention_kernel(q, k, v, mask, kv_len, o, part, lse, scale: float, softcap: float, window: int,
                     has_mask: int, has_len: int, causal: int, num_splits: int,
                     D: ct.Constant[int], HB: ct.Constant[int], BS: ct.Constant[int], BN: ct.Constant[int],
                     PDL: ct.Constant[int]):
    """Attention forward for one (query block, batch x head block[, KV split]).

    q: (B, Hq, Sq, head_dim); k, v: (B, Hkv, Skv, head_dim); mask: (MB, Sq, Skv) int8 (read only
    when has_mask); kv_len: (1,) int64, with has_len the number of keys k holds (Skv is then
    min(kv_len[0], k's length): k, v and mask are read as if cut there); o: (B, Hq, Sq,
    head_dim), usually a transposed view of a (B, Sq, Hq, head_dim) buffer. With num_splits > 1:
    part (num_splits, B * Hq, Sq, D) and lse (num_splits, B * Hq, Sq) float32 receive each split's
    normalised output and log2-sum-exp instead of o; the splits share the KV tiles of the first
    Skv keys evenly (a split with none writes zeros and -inf).
    Grid: (cdiv(Sq, BS) * num_splits, B * cdiv(Hq, HB)); with num_splits > 1, HB divides Hq.
    PDL: see kernel_src/_pdl.py.
    """
    pdl_wait(PDL)
    _attention_block(q, k, v, mask, o, part, lse, _kv_length(k, kv_len, has_len), scale, softcap, window, has_mask,
                     has_len, causal, num_splits, D, HB, BS, BN)


@ct.function
def _attention_block(q, k, v, mask, o, part, lse, skv, scale, softcap, window, has_mask, has_len, causal,
                     num_splits, D: ct.Constant[int], HB: ct.Constant[int], BS: ct.Constant[int],
                     BN: ct.Constant[int]):
    # One (query block, batch x head block[, KV split]) of attention_kernel over the first skv keys.
    qb = ct.bid(0) // num_splits
    split = ct.bid(0) % num_splits
    nhb = ct.cdiv(q.shape[1], HB)  # a last head block past Hq (a padded group) loads zeros, stores nothing
    b = ct.bid(1) // nhb
    hb = ct.bid(1) % nhb
    j_lo, j_hi = _kv_tile_range(qb, q.shape[2], skv, causal, window, BS, BN)
    j_lo, j_hi = _split_tiles(j_lo, j_hi, split, num_splits)
    acc, m_i, l_i = _attend(q, k, v, mask, mask, b, hb, qb, j_lo, j_hi, skv, scale, softcap, window, has_mask, 0,
                            has_len, causal, D, HB, BS, BN)
    _store_block(acc, m_i, l_i, o, part, lse, b, hb, nhb, qb, split, num_splits, D, HB, BS)


@ct.function
def _split_tiles(j_lo, j_hi, split, num_splits):
    # Split `split` of num_splits's share of KV tiles [j_lo, j_hi): even slices, the last may be short.
    if num_splits > 1:
        per = ct.cdiv(j_hi - j_lo, num_splits)
        j_lo = ct.minimum(j_lo + split * per, j_hi)
        j_hi = ct.minimum(j_lo + per, j_hi)
    return j_lo, j_hi


@ct.function
def _store_block(acc, m_i, l_i, o, part, lse, b, hb, nhb, qb, split, num_splits, D: ct.Constant[int],
                 HB: ct.Constant[int], BS: ct.Constant[int]):
    # A block's normalised output into o, or with num_splits > 1 its split's output and log2-sum-exp.
    out = acc / ct.where(l_i == 0.0, 1.0, l_i)
    if num_splits > 1:
        lse_rows = ct.where(l_i == 0.0, NEG_INF, m_i + ct.log2(ct.where(l_i == 0.0, 1.0, l_i)))
        bh = b * nhb + hb
        ct.store(part, index=(split, bh, qb, 0), tile=ct.reshape(out, (1, HB, BS, D)))
        ct.store(lse, index=(split, bh, qb), tile=ct.reshape(lse_rows, (1, HB, BS)))
    else:
        ct.store(o, index=(b, hb, qb, 0), tile=ct.reshape(out.astype(o.dtype), (1, HB, BS, D)))


@ct.function
def _rotated(x, b, h, c1, c2, s1, s2, rdtype, HEADS: ct.Constant[int], ROWS: ct.Constant[int],
             HALF: ct.Constant[int]):
    # RoPE of the (1, HEADS, ROWS) tile (b, h, 0) of x, a (B, H, S, 2, HALF) halves view, as
    # kernel_src/rope.py's rope_kernel computes and rounds it (c*, s*: (1, HALF) float32 halves of
    # one position's cos and sin): (HEADS * ROWS, 2 * HALF) in x's dtype, rows past S zero.
    shape = (1, HEADS, ROWS, 1, HALF)
    x1 = ct.reshape(ct.load(x, index=(b, h, 0, 0, 0), shape=shape, padding_mode=ZERO),
                    (HEADS * ROWS, HALF)).astype(ct.float32)
    x2 = ct.reshape(ct.load(x, index=(b, h, 0, 1, 0), shape=shape, padding_mode=ZERO),
                    (HEADS * ROWS, HALF)).astype(ct.float32)
    o1 = _rounded_mul(x1, c1, rdtype) - _rounded_mul(x2, s1, rdtype)
    o2 = _rounded_mul(x2, c2, rdtype) + _rounded_mul(x1, s2, rdtype)
    return ct.cat((o1.astype(x.dtype), o2.astype(x.dtype)), 1)


@ct.function
def _cached_tile_step(s, m_i, l_i, acc, values, b, kvh, j, n, D: ct.Constant[int], BN: ct.Constant[int]):
    # Cached KV tile j's logits s (M, BN) into rope_append_attention's online softmax: the new state.
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
    vt = ct.reshape(ct.load(values, index=(b, kvh, j, 0), shape=(1, 1, BN, D), padding_mode=ZERO), (BN, D))
    vt = _tail_rows_zeroed(vt, j, n, BN)
    return ct.mma(p.astype(values.dtype), vt, acc * alpha), m_i, l_i


@ct.kernel
def rope_append_attention_kernel(q, k, v, cos, sin, keys, values, length, mask, o, part, lse, scale: float,
                                 softcap: float, window: int, num_splits: int, D: ct.Constant[int],
                                 HB: ct.Constant[int], BS: ct.Constant[int], BN: ct.Constant[int],
                                 STORE_LAST: ct.Constant[int], MASKED: ct.Constant[int], PDL: ct.Constant[int]):
    """A decode step's RoPE of q and k, the static KV cache write of the rotated k and of v, and the
    attention of the query over the cache, for one (batch x head block[, KV split]).

    What ``kernel_src/rope.py``'s ``rope_append_kernel`` (RoPE rounded as transformers rounds it,
    the new key and value written at slot ``n = length[0]``) followed by :func:`attention_kernel`
    over the first ``n + 1`` keys (causal, window, softcap; with MASKED the keys the mask shows)
    compute, in one launch: the block attends to the ``n`` cached keys and to the new key, which it
    holds in registers (a block never reads slot ``n``: the write is not ordered with the other
    blocks' reads). The first head block of each KV group writes the group's key and value (split 0
    of it, with splits).

    q: (B, Hq, 1, 2, D/2), the un-rotated queries as halves; k: (B, Hkv, 1, 2, D/2) likewise; v:
    (B, Hkv, 1, D); cos, sin: (B or 1, 1, 2, D/2) (the whole head rotated); keys, values: (B, Hkv,
    L, D), the cache, written at slot n when n < L (before the KV loop, or with STORE_LAST after
    the output's store); length: (1,) int64, n (not advanced: the caller adds 1); mask: with MASKED,
    (MB, 1, L) int8, MB 1 or B: row ``b % MB`` shows key j where it is nonzero (a compiled step's
    boolean mask, padding included: it replaces causality, the caller passes no window), else not
    read; o: (B, Hq, 1, D). part, lse and num_splits as :func:`attention_kernel`'s (the new key
    goes to split 0). HB divides Hq // Hkv. Grid: (num_splits, B * Hq // HB). PDL: see
    kernel_src/_pdl.py.
    """
    pdl_wait(PDL)
    split = ct.bid(0)
    nhb = q.shape[1] // HB
    b = ct.bid(1) // nhb
    hb = ct.bid(1) % nhb
    group = q.shape[1] // keys.shape[1]
    kvh = (hb * HB) // group
    n = ct.gather(length, 0).astype(ct.int32)  # the cached keys; the new key's slot and position
    c1, c2, s1, s2 = _cos_sin(cos, sin, b, 0, D // 2, 1)
    c1, c2 = ct.reshape(c1, (1, D // 2)), ct.reshape(c2, (1, D // 2))
    s1, s2 = ct.reshape(s1, (1, D // 2)), ct.reshape(s2, (1, D // 2))
    qt = _rotated(q, b, hb, c1, c2, s1, s2, cos.dtype, HB, BS, D // 2)  # (M, D)
    kn = _rotated(k, b, kvh, c1, c2, s1, s2, cos.dtype, 1, 1, D // 2)   # (1, D)
    vn = ct.reshape(ct.load(v, index=(b, kvh, 0, 0), shape=(1, 1, 1, D), padding_mode=ZERO), (1, D))
    writer = split == 0 and (hb * HB) % group == 0 and n < keys.shape[2]
    if STORE_LAST == 0:
        if writer:
            ct.store(keys, index=(b, kvh, n, 0), tile=ct.reshape(kn, (1, 1, 1, D)))
            ct.store(values, index=(b, kvh, n, 0), tile=ct.reshape(vn, (1, 1, 1, D)))
    M = HB * BS
    # The new key starts split 0's state: it is visible to the query (its own position), unless
    # (MASKED) the mask hides its slot.
    s_new = _logits(ct.sum(qt.astype(ct.float32) * kn.astype(ct.float32), axis=1, keepdims=True), scale, softcap)
    m_i = ct.full((M, 1), NEG_INF, dtype=ct.float32)
    l_i = ct.full((M, 1), 0.0, dtype=ct.float32)
    acc = ct.full((M, D), 0.0, dtype=ct.float32)
    if MASKED != 0:
        if split == 0 and ct.gather(mask, (b % mask.shape[0], 0, ct.minimum(n, mask.shape[2] - 1))) != 0:
            m_i = s_new
            l_i = ct.full((M, 1), 1.0, dtype=ct.float32)
            acc = ct.broadcast_to(vn.astype(ct.float32), (M, D))
    elif split == 0:
        m_i = s_new
        l_i = ct.full((M, 1), 1.0, dtype=ct.float32)
        acc = ct.broadcast_to(vn.astype(ct.float32), (M, D))
    # The cached keys the query sees: [lo, n), lo past the window's start.
    lo = 0
    if window > 0:
        lo = ct.maximum(n - window + 1, 0)
    j_lo = lo // BN
    j_hi = ct.cdiv(n, BN)
    j_lo, j_hi = _split_tiles(j_lo, j_hi, split, num_splits)
    cols = ct.reshape(ct.arange(BN, dtype=ct.int32), (1, BN))
    for j in range(j_lo, j_hi):
        if MASKED != 0:
            # The mask's row of the tile; a tile it hides entirely is skipped (attention_kernel's rule:
            # a padded row reads no K/V of its padding).
            mt = ct.reshape(ct.load(mask, index=(b % mask.shape[0], 0, j), shape=(1, 1, BN), padding_mode=ZERO),
                            (1, BN))
            if j * BN < n and ct.max(mt) != 0:
                s = _tile_logits(qt, keys, b, kvh, j, scale, softcap, M, D, BN)
                valid = (j * BN + cols < n) & (mt != 0)
                if window > 0:
                    valid = valid & (j * BN + cols > n - window)
                s = ct.where(ct.broadcast_to(valid, (M, BN)), s, NEG_INF)
                acc, m_i, l_i = _cached_tile_step(s, m_i, l_i, acc, values, b, kvh, j, n, D, BN)
        # Always true: a runtime condition around the body, as the attention kernel's per-tile test.
        # Without it tileiras 13.4 emitted the loop in about five copies (160 HMMA against 32 for
        # this tile, 7696 instructions against 3336) and the launch took 13.6 us against 7.9 (H100).
        elif j * BN < n:
            s = _tile_logits(qt, keys, b, kvh, j, scale, softcap, M, D, BN)
            edge = (j + 1) * BN > n  # the tail tile, and the window's lower edge
            if window > 0:
                edge = edge | (j * BN <= n - window)
            if edge:
                kidx = j * BN + cols
                valid = kidx < n
                if window > 0:
                    valid = valid & (kidx > n - window)
                s = ct.where(ct.broadcast_to(valid, (M, BN)), s, NEG_INF)
            acc, m_i, l_i = _cached_tile_step(s, m_i, l_i, acc, values, b, kvh, j, n, D, BN)
    _store_block(acc, m_i, l_i, o, part, lse, b, hb, nhb, 0, split, num_splits, D, HB, BS)
    if STORE_LAST != 0:
        if writer:
            ct.store(keys, index=(b, kvh, n, 0), tile=ct.reshape(kn, (1, 1, 1, D)))
            ct.store(values, index=(b, kvh, n, 0), tile=ct.reshape(vn, (1, 1, 1, D)))


@ct.kernel
def _attention_prefill(q, k, v, mask, tiles, o, scale: float, softcap: float, window: int, has_mask: int,
                       has_tiles: int, causal: int, D: ct.Constant[int], HB: ct.Constant[int], BS: ct.Constant[int],
                       BN: ct.Constant[int]):
    """Attention forward over all of k for one (query block, batch x head block): the prefill tiles.

    Arguments as attention_kernel's (no KV length, no split), and tiles: with has_tiles (which
    needs has_mask), the ``(MB, cdiv(Sq, BS), cdiv(Skv, BN))`` int8 classes
    :func:`attention_mask_tiles_kernel` wrote for this mask and these tiles. The block then runs
    only from the first to the last KV tile the mask leaves visible to its rows (where the KV
    tiles number at most ``TILE_ROW``), reads the mask only on partial tiles and skips hidden
    ones without a read. Grid: (cdiv(Sq, BS), B * cdiv(Hq, HB)).
    """
    qb = ct.bid(0)
    nhb = ct.cdiv(q.shape[1], HB)
    b = ct.bid(1) // nhb
    hb = ct.bid(1) % nhb
    skv = k.shape[2]
    j_lo, j_hi = _kv_tile_range(qb, q.shape[2], skv, causal, window, BS, BN)
    if has_tiles != 0:
        if ct.cdiv(skv, BN) <= TILE_ROW:
            row = ct.load(tiles, index=(b % tiles.shape[0], qb, 0), shape=(1, 1, TILE_ROW), padding_mode=ZERO)
            idx = ct.reshape(ct.arange(TILE_ROW, dtype=ct.int32), (1, 1, TILE_ROW))
            j_lo = ct.maximum(j_lo, ct.min(ct.where(row != TILE_HIDDEN, idx, TILE_ROW)))
            j_hi = ct.minimum(j_hi, ct.max(ct.where(row != TILE_HIDDEN, idx + 1, 0)))
    acc, m_i, l_i = _attend(q, k, v, mask, tiles, b, hb, qb, j_lo, j_hi, skv, scale, softcap, window, has_mask,
                            has_tiles, 0, causal, D, HB, BS, BN)
    out = acc / ct.where(l_i == 0.0, 1.0, l_i)
    ct.store(o, index=(b, hb, qb, 0), tile=ct.reshape(out.astype(o.dtype), (1, HB, BS, D)))


#: The prefill tiles (128 query rows) on sm_90 take two warpgroups, one per 64-row wgmma; with one,
#: head_dim 256 does not compile (tileiras 13.4). Elsewhere the default (4 warps) compiles them all.
attention_prefill_kernel = _attention_prefill.replace_hints(num_worker_warps=ct.ByTarget(sm_90=8, default=4))


@ct.kernel
def attention_mask_tiles_kernel(mask, tiles, BS: ct.Constant[int], BN: ct.Constant[int]):
    """Classify one (BS query rows x BN keys) tile of a boolean mask for the prefill tiles.

    mask: ``(MB, Sq, Skv)`` int8 (0 hides a key); tiles: ``(MB, cdiv(Sq, BS), cdiv(Skv, BN))``
    int8, written at this block's tile: ``TILE_HIDDEN`` when no element inside the mask's bounds
    is visible, ``TILE_FULL`` when all are, else ``TILE_PARTIAL``. Elements past Sq or Skv count
    for neither (the attention masks the KV end itself and stores no row past Sq).
    Grid: (cdiv(Skv, BN), cdiv(Sq, BS), MB).
    """
    j = ct.bid(0)
    qb = ct.bid(1)
    mb = ct.bid(2)
    mt = ct.load(mask, index=(mb, qb, j), shape=(1, BS, BN), padding_mode=ZERO)
    rows = ct.reshape(qb * BS + ct.arange(BS, dtype=ct.int32), (1, BS, 1))
    cols = ct.reshape(j * BN + ct.arange(BN, dtype=ct.int32), (1, 1, BN))
    inside = (rows < mask.shape[1]) & (cols < mask.shape[2])
    seen = ct.max(ct.where(inside & (mt != 0), 1, 0))
    hidden = ct.max(ct.where(inside & (mt == 0), 1, 0))
    cls = ct.where(seen == 0, TILE_HIDDEN, ct.where(hidden == 0, TILE_FULL, TILE_PARTIAL))
    ct.store(tiles, index=(mb, qb, j), tile=ct.reshape(cls.astype(ct.int8), (1, 1, 1)))


@ct.kernel
def attention_combine_kernel(part, lse, o, num_splits: int, D: ct.Constant[int], BS: ct.Constant[int]):
    """Merge the splits of attention_kernel: o[b, h, i] = sum_s w_s part[s, b*Hq+h, i] / sum_s w_s,
    w_s = exp2(lse_s - max_s lse_s); a row no split saw (all lse -inf) gets zeros.
    part: (num_splits, B * Hq, Sq, D), lse: (num_splits, B * Hq, Sq) float32; o: (B, Hq, Sq,
    head_dim). Grid: (cdiv(Sq, BS), B * Hq)."""
    qb = ct.bid(0)
    bh = ct.bid(1)
    b = bh // o.shape[1]
    h = bh % o.shape[1]
    m_i = ct.full((BS, 1), NEG_INF, dtype=ct.float32)
    l_i = ct.full((BS, 1), 0.0, dtype=ct.float32)
    acc = ct.full((BS, D), 0.0, dtype=ct.float32)
    for s in range(num_splits):
        ls = ct.reshape(ct.load(lse, index=(s, bh, qb), shape=(1, 1, BS), padding_mode=ct.PaddingMode.NEG_INF),
                        (BS, 1))
        m_new = ct.maximum(m_i, ls)
        m_use = ct.where(m_new == NEG_INF, 0.0, m_new)
        w = ct.exp2(ls - m_use)
        alpha = ct.exp2(m_i - m_use)
        ps = ct.reshape(ct.load(part, index=(s, bh, qb, 0), shape=(1, 1, BS, D), padding_mode=ZERO), (BS, D))
        acc = acc * alpha + ps * w
        l_i = l_i * alpha + w
        m_i = m_new
    out = acc / ct.where(l_i == 0.0, 1.0, l_i)
    ct.store(o, index=(b, h, qb, 0), tile=ct.reshape(out.astype(o.dtype), (1, 1, BS, D)))


# ---------------------------------------------------------------------------------------------
# Build matrix
# ---------------------------------------------------------------------------------------------

#: Per array parameter, the dimensions every tile of this family's kernels indexes with extent 1 (a
#: batch, a head, a split): no lane reaches past their edge, so the registry's int32 offset bound
#: (``registry.ArrayCheck``) counts a tile's reach only along the others. Without it a static cache
#: of 16 x 32 heads x 4096 slots x 128 (OLMo-3-7B at batch 16) was refused as past int32 and took the
#: PyTorch fallback (H100, 2026-12-05), though its largest offset is an eighth of the limit.
ARRAY_FLAT_DIMS = {"q": (0,), "k": (0, 1), "v": (0, 1), "mask": (0,), "tiles": (0,), "o": (0,), "part": (0,),
                   "lse": (0,), "cos": (0,), "sin": (0,), "keys": (0, 1), "values": (0, 1)}

#: Padded head dims built (64 takes head_dim <= 64, e.g. 32 and 64; 128 takes 80, 96, 128).
HEAD_DIMS = (64, 128, 256)
#: Prefill tiles per padded head dim: (HB, BS, BN). One query head per block, 128 query rows
#: (64 for D = 256, whose float32 accumulator would not fit in registers at 128 rows).
PREFILL = {64: (1, 128, 64), 128: (1, 128, 64), 256: (1, 64, 64)}
#: Decode / short-chunk tiles: 16 rows = HB query heads of one KV group x (16 // HB) queries.
DECODE_ROWS = 16
DECODE_HEADS = (1, 2, 4)
#: Keys per tile of the decode tiles, two per padded head dim (H200 sweep of 64, 128 and 256 keys,
#: dev/sweeps/decode_attention_sweep.py, 2026-12-04): the short tile for a cache of fewer than
#: DECODE_LONG_KEYS slots and for a launch split over the KV (each split holds few tiles); the long
#: tile, fewer dependent load round trips a block, for one unsplit pass over a long cache. At head
#: dim 128, 64 keys beat the former 128 on every short or split case (e.g. Qwen3-0.6B's layout over
#: 150 keys: 9.1 -> 8.4 us at batch 1, 10.1 -> 8.4 at 16); 256 keys beat both unsplit over 3000 of
#: 4096 slots (Phi-4-mini's at batch 16: 181 -> 122 us; Llama-3.2-1B's: 34.8 -> 29.8). At 1024 slots
#: the two were mixed (256 ahead by 10-11 % for Llama's and Phi-4-mini's layouts, 64 by 8 % for
#: OLMo 2's) and nothing between 1024 and 4096 was timed: the 2048 threshold is a choice.
DECODE_BN = {64: 128, 128: 64, 256: 64}
DECODE_BN_LONG = {64: 256, 128: 256, 256: 64}
DECODE_LONG_KEYS = 2048
#: Query rows per block of the combine kernel.
COMBINE_BS = 16
DTYPES = ("bfloat16", "float16")


def _attention_params(dtype: str, consts: dict) -> tuple:
    qkv = [array(n, dtype, 4, "aligned") for n in ("q", "k", "v")]
    return tuple(qkv + [
        ArrayParam("mask", "int8", 3),                # any strides and length
        ArrayParam("kv_len", "int64", 1),             # a static cache layer's cumulative_length, viewed (1,)
        array("o", dtype, 4, "aligned"),
        array("part", "float32", 4, "aligned"),
        ArrayParam("lse", "float32", 3),              # its last dim is Sq: any length
        ScalarParam("scale", "float32"), ScalarParam("softcap", "float32"), ScalarParam("window", "int32"),
        ScalarParam("has_mask", "int32"), ScalarParam("has_len", "int32"), ScalarParam("causal", "int32"),
        ScalarParam("num_splits", "int32"),
    ] + [ConstParam(n, val) for n, val in consts.items()])


def _prefill_params(dtype: str, consts: dict) -> tuple:
    qkv = [array(n, dtype, 4, "aligned") for n in ("q", "k", "v")]
    return tuple(qkv + [
        ArrayParam("mask", "int8", 3),                # any strides and length
        ArrayParam("tiles", "int8", 3),               # the mask's tile classes: any length
        array("o", dtype, 4, "aligned"),
        ScalarParam("scale", "float32"), ScalarParam("softcap", "float32"), ScalarParam("window", "int32"),
        ScalarParam("has_mask", "int32"), ScalarParam("has_tiles", "int32"), ScalarParam("causal", "int32"),
    ] + [ConstParam(n, val) for n, val in consts.items()])


def _mask_tiles_params(consts: dict) -> tuple:
    return (ArrayParam("mask", "int8", 3), ArrayParam("tiles", "int8", 3)) + tuple(
        ConstParam(n, val) for n, val in consts.items())


def _combine_params(dtype: str, consts: dict) -> tuple:
    return (array("part", "float32", 4, "aligned"), ArrayParam("lse", "float32", 3), array("o", dtype, 4, "aligned"),
            ScalarParam("num_splits", "int32")) + tuple(ConstParam(n, val) for n, val in consts.items())


def _rope_append_params(dtype: str, consts: dict, small: str = "aligned") -> tuple:
    # The halves views (q, k, cos, sin) and the cache as the decode steps hand them: aligned (the
    # step's small arrays in the `small` layout: the 2026-12-06 candidates tried "generic").
    return tuple([array("q", dtype, 5, small), array("k", dtype, 5, small), array("v", dtype, 4, small),
                  array("cos", dtype, 4, small), array("sin", dtype, 4, small),
                  array("keys", dtype, 4, "aligned"), array("values", dtype, 4, "aligned"),
                  ArrayParam("length", "int64", 1), ArrayParam("mask", "int8", 3), array("o", dtype, 4, small),
                  array("part", "float32", 4, small), ArrayParam("lse", "float32", 3),
                  ScalarParam("scale", "float32"), ScalarParam("softcap", "float32"), ScalarParam("window", "int32"),
                  ScalarParam("num_splits", "int32")] + [ConstParam(n, val) for n, val in consts.items()])


def _matrix() -> list[VariantSpec]:
    specs = []
    for dtype in DTYPES:
        d = DTYPE_TAGS[dtype]
        for dp in HEAD_DIMS:
            configs = [(PREFILL[dp], "attention_prefill_kernel")]
            configs += [((hb, DECODE_ROWS // hb, bn), "attention_kernel") for hb in DECODE_HEADS
                        for bn in sorted({DECODE_BN[dp], DECODE_BN_LONG[dp]})]
            for (hb, bs, bn), function in configs:
                consts = {"D": dp, "HB": hb, "BS": bs, "BN": bn}
                make = _prefill_params if function == "attention_prefill_kernel" else _attention_params
                params = make(dtype, consts)
                specs.append(VariantSpec("attention", "attention", function, f"{d}.d{dp}.h{hb}.m{bs}.n{bn}", params))
            # RoPE, the cache write and decode attention in one launch: the short tile; by a length
            # (the decode graphs' plain steps) and by a boolean mask (compiled steps)
            for masked in (0, 1):
                for hb in DECODE_HEADS:
                    consts = {"D": dp, "HB": hb, "BS": DECODE_ROWS // hb, "BN": DECODE_BN[dp], "STORE_LAST": 0,
                              "MASKED": masked}
                    specs.append(VariantSpec("rope_append_attention", "attention", "rope_append_attention_kernel",
                                             f"{d}.d{dp}.h{hb}.m{DECODE_ROWS // hb}.n{DECODE_BN[dp]}"
                                             + (".mask" if masked else ""), _rope_append_params(dtype, consts)))
            consts = {"D": dp, "BS": COMBINE_BS}
            specs.append(VariantSpec("attention_combine", "attention", "attention_combine_kernel",
                                     f"{d}.d{dp}.m{COMBINE_BS}", _combine_params(dtype, consts)))
    for bs, bn in sorted({PREFILL[dp][1:] for dp in HEAD_DIMS}):  # one per prefill tile shape: int8 masks
        consts = {"BS": bs, "BN": bn}
        specs.append(VariantSpec("attention_mask_tiles", "attention", "attention_mask_tiles_kernel",
                                 f"i8.m{bs}.n{bn}", _mask_tiles_params(consts)))
    return specs


#: Every variant of this family; the decode attention's and rope_append_attention's also with
#: programmatic dependent launch, for captured decode steps (kernel_src/_pdl.py).
VARIANTS: list[VariantSpec] = with_pdl(_matrix(), ("attention_kernel", "rope_append_attention_kernel"))
