"""GEMV kernels with load-latency hints, a per-tile row sum and other compiler hints, for the GEMV
sweep (not shipped; see gemv_sweep.py). Same math as ``kernel_src.gemv.gemv_kernel``: one row ``x``
(1, K) times ``weight`` (N, K), float32 products and sums, one rounding at the store."""

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
