"""Causal depthwise 1-D convolution with SiLU (gated DeltaNet's short convolution): cuTile device
code and build matrix.

Math: transformers' ``causal_conv1d_fn`` and ``causal_conv1d_update`` (models/qwen3_5/
modeling_qwen3_5.py at v5.22.2; the interface of Dao-AILab's causal-conv1d). With a weight ``w``
of shape (C, K), per channel c::

    y[l, c] = silu(sum_j w[c, j] * x[l - K + 1 + j, c])     # x[< 0] = 0 (or the conv state)

rounded to the input dtype before the SiLU (``F.conv1d`` in the input dtype), the SiLU's result
rounded again. The one-token update shifts the conv state (C, K) left by one, appends the new
token, writes the state back and convolves it.

Both kernels see the activations as (B, L, C) with channels innermost (the projection's own
layout; transformers hands over a transposed view).
"""

from __future__ import annotations

import cuda.tile as ct

from ._spec import DTYPE_TAGS, ArrayParam, ConstParam, VariantSpec

RN = ct.RoundingMode.RN


#: Per array, the dimensions every gather and scatter indexes with one value (the batch row; the state's
#: and the weight's tap): the registry's int32 bound (``registry.ArrayCheck``) counts a tile's reach
#: only along the others. Without it a batched prefill of Qwen3.5's 6144 channels was refused from
#: B=2 x 2800 tokens on (the batch stride times the tile) and took the PyTorch path.
ARRAY_FLAT_DIMS = {"x": (0,), "y": (0,), "state": (0, 2), "weight": (1,)}


@ct.function
def _silu_rounded(acc, dtype):
    # F.conv1d's output rounded to the input dtype, then SiLU in float32, rounded again.
    h = acc.astype(dtype).astype(ct.float32)
    return ct.truediv(h, 1.0 + ct.exp(-h), rounding_mode=RN).astype(dtype)


@ct.kernel
def causal_conv1d_kernel(x, weight, y, K: ct.Constant[int], BL: ct.Constant[int], BC: ct.Constant[int]):
    """y = silu(causal depthwise conv of x). x, y: (B, L, C); weight: (C, K). Grid:
    (cdiv(L, BL), cdiv(C, BC), B)."""
    lb, cb, b = ct.bid(0), ct.bid(1), ct.bid(2)
    ls = ct.reshape(lb * BL + ct.arange(BL, dtype=ct.int32), (BL, 1))
    cs = ct.reshape(cb * BC + ct.arange(BC, dtype=ct.int32), (1, BC))
    acc = ct.zeros((BL, BC), dtype=ct.float32)
    for j in ct.static_iter(range(K)):
        src = ls - (K - 1) + j
        tap = ct.gather(x, (b, src, cs), mask=src >= 0).astype(ct.float32)
        w = ct.gather(weight, (cs, j)).astype(ct.float32)
        acc = acc + tap * w
    ct.scatter(y, (b, ls, cs), _silu_rounded(acc, y.dtype))


@ct.kernel
def causal_conv1d_update_kernel(x, state, weight, y, K: ct.Constant[int], BC: ct.Constant[int]):
    """One token: state <- (state[:, 1:], x); y = silu(sum_j weight[:, j] * state[:, j]).

    x, y: (B, C); state: (B, C, K), written in place; weight: (C, K). Grid: (cdiv(C, BC), B).
    """
    cb, b = ct.bid(0), ct.bid(1)
    cs = cb * BC + ct.arange(BC, dtype=ct.int32)
    new = ct.gather(x, (b, cs))
    acc = new.astype(ct.float32) * ct.gather(weight, (cs, K - 1)).astype(ct.float32)
    # Every tap is read before any is written: each write below depends on all the reads.
    taps = ()
    for j in ct.static_iter(range(1, K)):
        taps += (ct.gather(state, (b, cs, j)),)
    for j in ct.static_iter(range(K - 1)):
        acc = acc + taps[j].astype(ct.float32) * ct.gather(weight, (cs, j)).astype(ct.float32)
    out = _silu_rounded(acc, y.dtype)
    for j in ct.static_iter(range(K - 1)):
        ct.scatter(state, (b, cs, j), taps[j])
    ct.scatter(state, (b, cs, K - 1), new.astype(state.dtype))
    ct.scatter(y, (b, cs), out)


# ---------------------------------------------------------------------------------------------
# Build matrix
# ---------------------------------------------------------------------------------------------

#: Kernel widths built (Qwen3.5, Qwen3-Next and most gated-DeltaNet / Mamba models: 4).
KERNEL_SIZES = (4,)
#: Tokens and channels per block of the prefill kernel; channels per block of the update.
BL, BC, UPDATE_BC = 32, 128, 256
DTYPES = ("bfloat16", "float16", "float32")

#: Every variant of this family (activations of any strides; the weight and the state as
#: transformers allocates them, contiguous).
VARIANTS: list[VariantSpec] = [
    VariantSpec("causal_conv1d", "conv1d", "causal_conv1d_kernel", f"{DTYPE_TAGS[dtype]}.k{k}",
                (ArrayParam("x", dtype, 3), ArrayParam("weight", dtype, 2, stride_one=(1,)),
                 ArrayParam("y", dtype, 3, stride_one=(2,)),
                 ConstParam("K", k), ConstParam("BL", BL), ConstParam("BC", BC)))
    for dtype in DTYPES for k in KERNEL_SIZES
] + [
    VariantSpec("causal_conv1d_update", "conv1d", "causal_conv1d_update_kernel", f"{DTYPE_TAGS[dtype]}.k{k}",
                (ArrayParam("x", dtype, 2), ArrayParam("state", dtype, 3, stride_one=(2,)),
                 ArrayParam("weight", dtype, 2, stride_one=(1,)), ArrayParam("y", dtype, 2, stride_one=(1,)),
                 ConstParam("K", k), ConstParam("BC", UPDATE_BC)))
    for dtype in DTYPES for k in KERNEL_SIZES
]
