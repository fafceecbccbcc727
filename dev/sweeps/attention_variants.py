"""Attention kernels for the tile sweeps (not shipped): the decode kernel with other compiler hints
and with loads issued ahead (decode_attention_sweep.py), and a pipelined prefill kernel
(attention_sweep.py)."""

from cutile_kernels.kernel_src.attention import attention_kernel

#: Eight warps, the compiler's occupancy (the decode tile sweep, decode_attention_sweep.py).
attention_w8_kernel = attention_kernel.replace_hints(num_worker_warps=8)


# ---------------------------------------------------------------------------------------------
# Decode: loads issued ahead of their use (the decode tile sweep, decode_attention_sweep.py)
# ---------------------------------------------------------------------------------------------
# Why: at batch 1 the decode kernel takes ~8 us over two KV tiles on the H200, about what a chain of
# dependent global loads costs (kv_len, then q and K, then V, then the next tile's K and V). These
# candidates issue the first tile's K and V with q before kv_len is read (tile 0 is the first one
# whenever there is no window and no split), and the next tile's while the current one is computed.

import cuda.tile as ct  # noqa: E402

from cutile_kernels.kernel_src.attention import (LOG2E, NEG_INF, ZERO, _kv_length, _kv_tile_range,  # noqa: E402
                                                 _tail_rows_zeroed)


@ct.function
def _tile_kv(k, v, b, kvh, j, TMA: ct.Constant[int], D: ct.Constant[int], BN: ct.Constant[int]):
    if TMA != 0:
        kt = ct.load(k, index=(b, kvh, 0, j), shape=(1, 1, D, BN), order=(0, 1, 3, 2), padding_mode=ZERO)
        vt = ct.load(v, index=(b, kvh, j, 0), shape=(1, 1, BN, D), padding_mode=ZERO)
    else:
        kt = ct.load(k, index=(b, kvh, 0, j), shape=(1, 1, D, BN), order=(0, 1, 3, 2), padding_mode=ZERO,
                     allow_tma=False)
        vt = ct.load(v, index=(b, kvh, j, 0), shape=(1, 1, BN, D), padding_mode=ZERO, allow_tma=False)
    return ct.reshape(kt, (D, BN)), ct.reshape(vt, (BN, D))


@ct.kernel
def attention_pf_kernel(q, k, v, mask, kv_len, o, part, lse, scale: float, softcap: float, window: int,
                        has_mask: int, has_len: int, causal: int, num_splits: int,
                        D: ct.Constant[int], HB: ct.Constant[int], BS: ct.Constant[int], BN: ct.Constant[int],
                        TMA: ct.Constant[int]):
    """``kernel_src.attention.attention_kernel`` (same arguments, grid and math) with its loads issued
    ahead: q, tile 0's K and V, then kv_len; in the loop, the next tile's K and V before the current
    tile's arithmetic (the last iteration loads its own tile again). ``TMA`` 0: plain loads."""
    M = HB * BS
    qb = ct.bid(0) // num_splits
    split = ct.bid(0) % num_splits
    nhb = q.shape[1] // HB
    b = ct.bid(1) // nhb
    hb = ct.bid(1) % nhb
    sq = q.shape[2]
    kvh = (hb * HB) // (q.shape[1] // k.shape[1])
    if TMA != 0:
        qt = ct.load(q, index=(b, hb, qb, 0), shape=(1, HB, BS, D), padding_mode=ZERO)
    else:
        qt = ct.load(q, index=(b, hb, qb, 0), shape=(1, HB, BS, D), padding_mode=ZERO, allow_tma=False)
    qt = ct.reshape(qt, (M, D))
    kt, vt = _tile_kv(k, v, b, kvh, 0, TMA, D, BN)
    skv = _kv_length(k, kv_len, has_len)
    j_lo, j_hi = _kv_tile_range(qb, sq, skv, causal, window, BS, BN)
    if num_splits > 1:
        per = ct.cdiv(j_hi - j_lo, num_splits)
        j_lo = ct.minimum(j_lo + split * per, j_hi)
        j_hi = ct.minimum(j_lo + per, j_hi)
    if j_lo != 0:
        kt, vt = _tile_kv(k, v, b, kvh, j_lo, TMA, D, BN)
    rows = ct.arange(M, dtype=ct.int32)
    pos = ct.reshape(qb * BS + rows % BS + (skv - sq), (M, 1))
    first_pos = qb * BS + (skv - sq)
    last_pos = ct.minimum(qb * BS + BS, sq) - 1 + (skv - sq)
    cols = ct.reshape(ct.arange(BN, dtype=ct.int32), (1, BN))
    mb = b % mask.shape[0]
    qk_scale = scale * LOG2E
    m_i = ct.full((M, 1), NEG_INF, dtype=ct.float32)
    l_i = ct.full((M, 1), 0.0, dtype=ct.float32)
    acc = ct.full((M, D), 0.0, dtype=ct.float32)
    for j in range(j_lo, j_hi):
        kn, vn = _tile_kv(k, v, b, kvh, ct.minimum(j + 1, j_hi - 1), TMA, D, BN)
        mt = ct.full((1, BS, BN), 1, dtype=ct.int8)
        live = has_mask == 0
        if has_mask != 0:
            mt = ct.load(mask, index=(mb, qb, j), shape=(1, BS, BN), padding_mode=ZERO)
            live = ct.max(mt) != 0
        if live:
            s = ct.mma(qt, kt, ct.full((M, BN), 0.0, dtype=ct.float32))
            if softcap > 0.0:
                s = ct.tanh(s * (scale / softcap)) * (softcap * LOG2E)
            else:
                s = s * qk_scale
            edge = (has_mask != 0) | ((j + 1) * BN > skv)
            if causal != 0:
                edge = edge | ((j + 1) * BN - 1 > first_pos)
            if window > 0:
                edge = edge | (j * BN <= last_pos - window)
            if edge:
                kidx = j * BN + cols
                valid = ct.broadcast_to(kidx < skv, (M, BN))
                if has_mask != 0:
                    valid = valid & (ct.reshape(ct.broadcast_to(mt, (HB, BS, BN)), (M, BN)) != 0)
                if causal != 0:
                    valid = valid & (kidx <= pos)
                if window > 0:
                    valid = valid & (kidx > pos - window)
                s = ct.where(valid, s, NEG_INF)
            m_new = ct.maximum(m_i, ct.max(s, axis=1, keepdims=True))
            m_use = ct.where(m_new == NEG_INF, 0.0, m_new)
            p = ct.exp2(s - m_use)
            alpha = ct.exp2(m_i - m_use)
            l_i = l_i * alpha + ct.sum(p, axis=1, keepdims=True)
            vuse = vt
            if has_len != 0:
                vuse = _tail_rows_zeroed(vt, j, skv, BN)
            acc = ct.mma(p.astype(v.dtype), vuse, acc * alpha)
            m_i = m_new
        kt = kn
        vt = vn
    out = acc / ct.where(l_i == 0.0, 1.0, l_i)
    if num_splits > 1:
        lse_rows = ct.where(l_i == 0.0, NEG_INF, m_i + ct.log2(ct.where(l_i == 0.0, 1.0, l_i)))
        bh = b * nhb + hb
        ct.store(part, index=(split, bh, qb, 0), tile=ct.reshape(out, (1, HB, BS, D)))
        ct.store(lse, index=(split, bh, qb), tile=ct.reshape(lse_rows, (1, HB, BS)))
    else:
        ct.store(o, index=(b, hb, qb, 0), tile=ct.reshape(out.astype(o.dtype), (1, HB, BS, D)))


# ---------------------------------------------------------------------------------------------
# Prefill: a loop the compiler can pipeline (the prefill tile sweep, attention_sweep.py)
# ---------------------------------------------------------------------------------------------
# Why: the shipped prefill runs _attend, whose loop body sits under a runtime branch (a tile the
# mask hides is skipped) and decides per tile whether to mask; with no mask tensor neither is
# needed. These candidates (calls without a mask tensor) split the KV tiles into three loops with
# nothing decided inside them: the window's lower-edge tiles (masked), the interior tiles (no
# element mask), the causal diagonal and KV-end tiles (masked); loads carry latency hints (constant
# LAT); REV starts the query blocks with the most tiles first (causal work grows with the block
# index). FMA keeps the scores unscaled through the row max and scales them inside the exponent's
# argument, `exp2(s * u - m)`: cuTile's rewrite makes that one FMA only when the product has no
# other use (scaling first, as the shipped loop does, leaves a multiply and a subtract per score);
# without a softcap u is the scale in log2 units, with one 1.0. Why: on the H200 the best
# candidate without it ran Llama-3.2-1B's prefill in 1.9x cuDNN's time (2026-12-05), and the
# elementwise work per score is what a head dim of 64 leaves to hide behind the two MMAs.

from cutile_kernels.kernel_src.attention import _attention_block  # noqa: E402


@ct.function
def _pf_step(qt, k, v, b, kvh, j, m_i, l_i, acc, pos, skv, qk_scale, scale, softcap, window, causal,
             MASKED: ct.Constant[int], LAT: ct.Constant[int], FMA: ct.Constant[int], D: ct.Constant[int],
             M: ct.Constant[int], BN: ct.Constant[int]):
    if LAT != 0:
        kt = ct.load(k, index=(b, kvh, 0, j), shape=(1, 1, D, BN), order=(0, 1, 3, 2), padding_mode=ZERO, latency=2)
    else:
        kt = ct.load(k, index=(b, kvh, 0, j), shape=(1, 1, D, BN), order=(0, 1, 3, 2), padding_mode=ZERO)
    s = ct.mma(qt, ct.reshape(kt, (D, BN)), ct.full((M, BN), 0.0, dtype=ct.float32))
    u = qk_scale  # with FMA: the scores' factor to log2 units, applied in the exponent
    if softcap > 0.0:
        s = ct.tanh(s * (scale / softcap)) * (softcap * LOG2E)
        u = 1.0
    elif FMA == 0:
        s = s * qk_scale
    if MASKED != 0:
        kidx = j * BN + ct.reshape(ct.arange(BN, dtype=ct.int32), (1, BN))
        valid = ct.broadcast_to(kidx < skv, (M, BN))
        if causal != 0:
            valid = valid & (kidx <= pos)
        if window > 0:
            valid = valid & (kidx > pos - window)
        s = ct.where(valid, s, NEG_INF)
    mx = ct.max(s, axis=1, keepdims=True)
    if FMA != 0:
        mx = mx * u  # u > 0: scaling commutes with the max
    m_new = ct.maximum(m_i, mx)
    m_use = m_new
    if MASKED != 0:
        m_use = ct.where(m_new == NEG_INF, 0.0, m_new)  # a row with no visible key yet
    if FMA != 0:
        p = ct.exp2(s * u - m_use, flush_to_zero=True)
    else:
        p = ct.exp2(s - m_use, flush_to_zero=True)
    alpha = ct.exp2(m_i - m_use, flush_to_zero=True)
    l_i = l_i * alpha + ct.sum(p, axis=1, keepdims=True)
    if LAT != 0:
        vt = ct.load(v, index=(b, kvh, j, 0), shape=(1, 1, BN, D), padding_mode=ZERO, latency=4)
    else:
        vt = ct.load(v, index=(b, kvh, j, 0), shape=(1, 1, BN, D), padding_mode=ZERO)
    acc = ct.mma(p.astype(v.dtype), ct.reshape(vt, (BN, D)), acc * alpha)
    return m_new, l_i, acc


@ct.function
def _pf_block(q, k, v, o, scale, softcap, window, causal, LAT: ct.Constant[int], REV: ct.Constant[int],
              FMA: ct.Constant[int], D: ct.Constant[int], HB: ct.Constant[int], BS: ct.Constant[int],
              BN: ct.Constant[int]):
    M = HB * BS
    sq = q.shape[2]
    skv = k.shape[2]
    qb = ct.bid(0)
    if REV != 0:
        qb = ct.cdiv(sq, BS) - 1 - ct.bid(0)
    nhb = ct.cdiv(q.shape[1], HB)
    b = ct.bid(1) // nhb
    hb = ct.bid(1) % nhb
    kvh = (hb * HB) // (q.shape[1] // k.shape[1])
    qt = ct.reshape(ct.load(q, index=(b, hb, qb, 0), shape=(1, HB, BS, D), padding_mode=ZERO), (M, D))
    rows = ct.arange(M, dtype=ct.int32)
    pos = ct.reshape(qb * BS + rows % BS + (skv - sq), (M, 1))
    first_pos = qb * BS + (skv - sq)
    last_pos = ct.minimum(qb * BS + BS, sq) - 1 + (skv - sq)
    j_lo, j_hi = _kv_tile_range(qb, sq, skv, causal, window, BS, BN)
    # [j_lo, a): the window's lower edge; [a, c): every key visible to every stored row; [c, j_hi):
    # the causal diagonal and the KV end.
    a = j_lo
    if window > 0:
        a = ct.minimum(ct.maximum(ct.maximum(last_pos - window + BN, 0) // BN, j_lo), j_hi)
    c = skv // BN
    if causal != 0:
        c = ct.minimum(c, (first_pos + 1) // BN)
    c = ct.minimum(ct.maximum(c, a), j_hi)
    qk_scale = scale * LOG2E
    m_i = ct.full((M, 1), NEG_INF, dtype=ct.float32)
    l_i = ct.full((M, 1), 0.0, dtype=ct.float32)
    acc = ct.full((M, D), 0.0, dtype=ct.float32)
    for j in range(j_lo, a):
        m_i, l_i, acc = _pf_step(qt, k, v, b, kvh, j, m_i, l_i, acc, pos, skv, qk_scale, scale, softcap, window,
                                 causal, 1, LAT, FMA, D, M, BN)
    for j in range(a, c):
        m_i, l_i, acc = _pf_step(qt, k, v, b, kvh, j, m_i, l_i, acc, pos, skv, qk_scale, scale, softcap, window,
                                 causal, 0, LAT, FMA, D, M, BN)
    for j in range(c, j_hi):
        m_i, l_i, acc = _pf_step(qt, k, v, b, kvh, j, m_i, l_i, acc, pos, skv, qk_scale, scale, softcap, window,
                                 causal, 1, LAT, FMA, D, M, BN)
    out = acc / ct.where(l_i == 0.0, 1.0, l_i)
    ct.store(o, index=(b, hb, qb, 0), tile=ct.reshape(out.astype(o.dtype), (1, HB, BS, D)))


@ct.kernel
def attention_pf2_kernel(q, k, v, mask, kv_len, o, part, lse, scale: float, softcap: float, window: int,
                         has_mask: int, has_len: int, causal: int, num_splits: int, D: ct.Constant[int],
                         HB: ct.Constant[int], BS: ct.Constant[int], BN: ct.Constant[int], LAT: ct.Constant[int],
                         REV: ct.Constant[int], FMA: ct.Constant[int]):
    """Prefill candidate (LAT: latency hints on the K and V loads; REV: the query blocks with the
    most tiles first; FMA: the scale applied inside the exponent's FMA); a call with a mask tensor
    runs the shipped block."""
    if has_mask != 0:
        _attention_block(q, k, v, mask, o, part, lse, k.shape[2], scale, softcap, window, has_mask, 0, causal,
                         num_splits, D, HB, BS, BN)
    else:
        _pf_block(q, k, v, o, scale, softcap, window, causal, LAT, REV, FMA, D, HB, BS, BN)


#: The same with two warpgroups (one 64-row wgmma each), with two blocks a multiprocessor, and in
#: clusters of two (TileGym's Hopper attention tiles use num_ctas up to 2).
attention_pf2_w8_kernel = attention_pf2_kernel.replace_hints(num_worker_warps=8)
attention_pf2_occ2_kernel = attention_pf2_kernel.replace_hints(occupancy=2)
attention_pf2_w8_cta2_kernel = attention_pf2_kernel.replace_hints(num_worker_warps=8, num_ctas=2)
