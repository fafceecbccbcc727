"""GEMV kernels for the GEMV sweep (not shipped; see gemv_sweep.py): load-latency hints, a per-tile
row sum and other compiler hints; K split across blocks with a last-block hand-over (float32 partial
rows, int32 arrival counts, atomics), its loop bounds alone, and a static split over (N, SPLIT,
K / SPLIT) views with its stream alone. Same math as
``kernel_src.gemv.gemv_kernel``: one row ``x`` (1, K) times ``weight`` (N, K), float32 products and
sums, one rounding at the store."""

import cuda.tile as ct

ZERO = ct.PaddingMode.ZERO


@ct.kernel
def gemv_lat_kernel(x, weight, out, BN: ct.Constant[int], BK: ct.Constant[int], LAT: ct.Constant[int]):
    """The shipped kernel (a (BN, BK) float32 product tile summed once at the end) with
    ``latency=LAT`` on the weight load: how many loads the compiler keeps in flight ahead.
    x: (1, K), weight: (N, K), out: (1, N), one 16-bit dtype. Grid: (cdiv(N, BN),)."""
    bid = ct.bid(0)
    acc = ct.zeros((BN, BK), dtype=ct.float32)
    for j in range(ct.cdiv(weight.shape[1], BK)):
        w = ct.load(weight, index=(bid, j), shape=(BN, BK), padding_mode=ZERO, latency=LAT)
        v = ct.load(x, index=(0, j), shape=(1, BK), padding_mode=ZERO)
        acc = acc + w.astype(ct.float32) * v.astype(ct.float32)
    ct.store(out, index=(0, bid), tile=ct.reshape(ct.sum(acc, axis=1), (1, BN)).astype(out.dtype))


@ct.kernel
def gemv_rowsum_kernel(x, weight, out, BN: ct.Constant[int], BK: ct.Constant[int], LAT: ct.Constant[int]):
    """Each weight tile's products summed along K as it is loaded: a (BN,) accumulator instead of
    (BN, BK), so wider tiles (more bytes in flight a block) fit in registers. Arguments and grid as
    :func:`gemv_lat_kernel`."""
    bid = ct.bid(0)
    acc = ct.zeros((BN,), dtype=ct.float32)
    for j in range(ct.cdiv(weight.shape[1], BK)):
        w = ct.load(weight, index=(bid, j), shape=(BN, BK), padding_mode=ZERO, latency=LAT)
        v = ct.load(x, index=(0, j), shape=(1, BK), padding_mode=ZERO)
        acc = acc + ct.sum(w.astype(ct.float32) * v.astype(ct.float32), axis=1)
    ct.store(out, index=(0, bid), tile=ct.reshape(acc, (1, BN)).astype(out.dtype))


#: Two blocks a multiprocessor asked for (the shipped kernels leave occupancy to the compiler).
gemv_rowsum_occ2_kernel = gemv_rowsum_kernel.replace_hints(occupancy=2)
#: Eight warps a block (the default is four): more loads in flight per block.
gemv_rowsum_w8_kernel = gemv_rowsum_kernel.replace_hints(num_worker_warps=8)


@ct.function
def _run_dot(x, weight, bid, s, SPLIT: ct.Constant[int], BN: ct.Constant[int], BK: ct.Constant[int]):
    # Rows [bid * BN, bid * BN + BN) of weight times x[0] over the s-th of SPLIT runs of
    # cdiv(cdiv(K, BK), SPLIT) K tiles (the last run shorter, or empty), as a (BN,) float32 tile.
    tiles = ct.cdiv(weight.shape[1], BK)
    start = s * ct.cdiv(tiles, SPLIT)
    stop = start + ct.cdiv(tiles, SPLIT)
    if stop > tiles:
        stop = tiles
    acc = ct.zeros((BN, BK), dtype=ct.float32)
    for j in range(start, stop):
        w = ct.load(weight, index=(bid, j), shape=(BN, BK), padding_mode=ZERO)
        v = ct.load(x, index=(0, j), shape=(1, BK), padding_mode=ZERO)
        acc = acc + w.astype(ct.float32) * v.astype(ct.float32)
    return ct.sum(acc, axis=1)


@ct.kernel
def gemv_range_kernel(x, weight, out, BN: ct.Constant[int], BK: ct.Constant[int]):
    """The shipped kernel with ``gemv_splitk_kernel``'s loop (``_run_dot`` of one run): the K tiles
    run from a start to a stop computed from the block's second index (grid (cdiv(N, BN), 1)), so
    the trip count is not the weight's shape alone. Times what the split-K kernel's loop costs
    without its partial rows and hand-over. x: (1, K), weight: (N, K), out: (1, N), one 16-bit dtype."""
    bid = ct.bid(0)
    y = _run_dot(x, weight, bid, ct.bid(1), 1, BN, BK)
    ct.store(out, index=(0, bid), tile=ct.reshape(y, (1, BN)).astype(out.dtype))


@ct.function
def _hand_over(y, out, part, count, bid, s, BN: ct.Constant[int], SPLIT: ct.Constant[int]):
    # Block (bid, s)'s partial row y (BN,) into part[s], one arrival counted in count[bid]; the block
    # that arrives last adds the SPLIT partial rows in index order, stores them rounded once into
    # out and sets the count back to 0. Plain stores and loads of the partial rows, no TMA: the
    # atomic's release and acquire order them (on sm_90 the store, a block barrier, a GPU-scope
    # fence, the atomic, an L1 invalidate, the loads).
    ct.store(part, index=(s, bid), tile=ct.reshape(y, (1, BN)), allow_tma=False)
    if ct.atomic_add(count, bid, 1) == SPLIT - 1:
        total = ct.sum(ct.load(part, index=(0, bid), shape=(SPLIT, BN), padding_mode=ZERO, allow_tma=False), axis=0)
        ct.store(out, index=(0, bid), tile=ct.reshape(total, (1, BN)).astype(out.dtype))
        ct.atomic_xchg(count, bid, 0)


@ct.kernel
def gemv_splitk_kernel(x, weight, out, part, count, BN: ct.Constant[int], BK: ct.Constant[int],
                       SPLIT: ct.Constant[int]):
    """The shipped kernel with K split ``SPLIT`` ways. x: (1, K), weight: (N, K), out: (1, N); part:
    (SPLIT, N) float32 scratch; count: (cdiv(N, BN),) int32, all zero before the launch and left zero
    after it. Grid: (cdiv(N, BN), SPLIT).

    Block (i, s) sums the s-th run of ``cdiv(cdiv(K, BK), SPLIT)`` K tiles (the last run shorter, or
    empty) of rows [i * BN, i * BN + BN) into ``part[s]``, then adds one to ``count[i]``
    (acquire-release, device scope: its partial row is visible before the count is). The block that
    finds ``SPLIT - 1`` there arrived last: it adds the ``SPLIT`` partial rows in index order (the
    same sum whatever the arrival order), stores the result rounded once, and puts ``count[i]`` back
    to 0 for the next launch: one launch, no memset, no second kernel. Shipped for one session
    (2026-12-07) and rejected in the model: see ``kernel_src/gemv.py``'s ``TILES``. The sweep's
    diagnostics (H100, 2026-12-07) put the cost in the hand-over: with SPLIT 1 the kernel is 2.1-3.4x
    the shipped one, the added time growing with the weight's bytes, while the loop bounds alone cost
    nothing."""
    bid = ct.bid(0)
    s = ct.bid(1)
    _hand_over(_run_dot(x, weight, bid, s, SPLIT, BN, BK), out, part, count, bid, s, BN, SPLIT)


@ct.function
def _split_dot(x, weight, bid, s, BN: ct.Constant[int], BK: ct.Constant[int]):
    # Rows [bid * BN, bid * BN + BN) of the (N, SPLIT, K / SPLIT) weight view times x's (1, SPLIT,
    # K / SPLIT) view over the s-th part of K, as a (BN,) float32 tile. The trip count is the view's
    # last dimension: a loop of the unsplit kernel's form, no computed bounds.
    acc = ct.zeros((BN, BK), dtype=ct.float32)
    for j in range(ct.cdiv(weight.shape[2], BK)):
        w = ct.reshape(ct.load(weight, index=(bid, s, j), shape=(BN, 1, BK), padding_mode=ZERO), (BN, BK))
        v = ct.reshape(ct.load(x, index=(0, s, j), shape=(1, 1, BK), padding_mode=ZERO), (1, BK))
        acc = acc + w.astype(ct.float32) * v.astype(ct.float32)
    return ct.sum(acc, axis=1)


@ct.kernel
def gemv_split3_kernel(x, weight, out, part, count, BN: ct.Constant[int], BK: ct.Constant[int],
                       SPLIT: ct.Constant[int]):
    """``gemv_splitk_kernel`` with K split statically: x a (1, SPLIT, K / SPLIT) view, weight an (N,
    SPLIT, K / SPLIT) view of the (N, K) tensors (K / SPLIT a multiple of 16), so block (i, s) runs
    the unsplit kernel's loop over its view (:func:`_split_dot`); the same partial rows, arrival
    count and last-block hand-over. out: (1, N); part: (SPLIT, N) float32; count: (cdiv(N, BN),)
    int32, zero before and after. Grid: (cdiv(N, BN), SPLIT)."""
    bid = ct.bid(0)
    s = ct.bid(1)
    _hand_over(_split_dot(x, weight, bid, s, BN, BK), out, part, count, bid, s, BN, SPLIT)


@ct.kernel
def gemv_split3_part_kernel(x, weight, out, part, count, BN: ct.Constant[int], BK: ct.Constant[int],
                            SPLIT: ct.Constant[int]):
    """Diagnostic (its ``out`` is not the product): ``gemv_split3_kernel``'s split stream and partial
    rows without the arrival count and hand-over, so the two costs show apart. Arguments and grid as
    there; ``out`` and ``count`` are not touched."""
    y = _split_dot(x, weight, ct.bid(0), ct.bid(1), BN, BK)
    ct.store(part, index=(ct.bid(1), ct.bid(0)), tile=ct.reshape(y, (1, BN)), allow_tma=False)
