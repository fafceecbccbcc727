"""Experimental RMSNorm kernels for the tile-config sweep (not shipped; see norm_sweep.py).

Each restates ``kernel_src.norm.rms_norm_kernel`` with one change, to learn what moves the
bandwidth on sm_90: plain vector loads instead of TMA, or a persistent grid-stride loop.
"""

import cuda.tile as ct

ZERO = ct.PaddingMode.ZERO


@ct.kernel
def rms_norm_notma_kernel(x, weight, y, eps: float, BLOCK_N: ct.Constant[int], ROWS: ct.Constant[int]):
    bid = ct.bid(0)
    inv_n = 1.0 / x.shape[1]
    h = ct.load(x, index=(bid, 0), shape=(ROWS, BLOCK_N), padding_mode=ZERO, allow_tma=False).astype(ct.float32)
    ms = ct.sum(h * h, axis=1, keepdims=True) * inv_n
    h = (h * (1.0 / ct.sqrt(ms + eps))).astype(x.dtype).astype(ct.float32)
    w = ct.load(weight, index=(0,), shape=(BLOCK_N,), padding_mode=ZERO, allow_tma=False).astype(ct.float32)
    ct.store(y, index=(bid, 0), tile=(h * ct.reshape(w, (1, BLOCK_N))).astype(y.dtype), allow_tma=False)


@ct.kernel
def rms_norm_persistent_kernel(x, weight, y, eps: float, BLOCK_N: ct.Constant[int], ROWS: ct.Constant[int]):
    inv_n = 1.0 / x.shape[1]
    w = ct.load(weight, index=(0,), shape=(BLOCK_N,), padding_mode=ZERO).astype(ct.float32)
    w = ct.reshape(w, (1, BLOCK_N))
    n_tiles = ct.cdiv(x.shape[0], ROWS)
    for t in range(ct.bid(0), n_tiles, ct.num_blocks(0)):
        h = ct.load(x, index=(t, 0), shape=(ROWS, BLOCK_N), padding_mode=ZERO).astype(ct.float32)
        ms = ct.sum(h * h, axis=1, keepdims=True) * inv_n
        h = (h * (1.0 / ct.sqrt(ms + eps))).astype(x.dtype).astype(ct.float32)
        ct.store(y, index=(t, 0), tile=(h * w).astype(y.dtype))


def _shipped():
    from cutile_kernels.kernel_src import norm

    return norm.rms_norm_kernel, norm.add_rms_norm_kernel


# Compiler-hint variants of the shipped kernels: 8 worker warps (4 is the default) and occupancy.
rms_norm_w8_kernel = _shipped()[0].replace_hints(num_worker_warps=8)
rms_norm_occ4_kernel = _shipped()[0].replace_hints(occupancy=4)
add_rms_norm_w8_kernel = _shipped()[1].replace_hints(num_worker_warps=8)
rms_norm_persistent_w8_kernel = rms_norm_persistent_kernel.replace_hints(num_worker_warps=8)
rms_norm_notma_w8_kernel = rms_norm_notma_kernel.replace_hints(num_worker_warps=8)
