"""One-row linear projection (GEMV) for batch-1 decode: cuTile device code and build matrix.

Math: ``nn.Linear``'s ``y = x W^T + b`` (``F.linear``) for a single row ``x`` (1, K), weight ``W``
(N, K) row-major as ``nn.Linear`` stores it, optional bias ``b`` (N,). Products and sums in float32,
the result rounded once to the dtype, as cuBLAS's bf16/fp16 GEMMs accumulate (the order of the sum
differs, so results agree to float32 rounding before the final cast, not bit for bit).

Why: a batch-1 decode step reads every weight once; the step is bound by that read (2.47 GB for
Llama-3.2-1B, ~0.58 ms at the H200's copy rate). On the H200 the cuBLAS kernels torch picks for
one row ran the small projections far below it (Llama-3.2-1B decode graph, b=1: q/k/v and o_proj
~5.8 us each for 12.6 / 8.4 MB, ~1.8 TB/s; down_proj 12.8 us for 33.5 MB with split-K and its
reduce, ~2.6 TB/s; gate/up 17.9 us for 67 MB, ~3.7 TB/s; benchmarks/results/h200-2026-12-03c).

Estimate, written before the kernel (Amdahl, Llama-3.2-1B decode graph b=1, 1.26 ms a replay): the
three projections that run below 3 TB/s take f ~ 0.31 (390 us); at ~3.8 TB/s they would take ~225
us, s ~ 1.7: ceiling 1 / (1 - 0.31 + 0.31 / 1.7) ~ 1.15x.

Each block owns ``BN`` output features and sweeps K in ``BK``-wide tiles, multiplying the weight
tile by the broadcast row and keeping the ``(BN, BK)`` float32 products (one add a tile, no
reduction in the loop); one sum along K at the end. About one block per SM (N / BN near the SM
count) did best on the H200. Loads past K or N are zero-padded and the store is bounds-checked, so
any N and K are covered; the variants assume K a multiple of 16 and 16-byte aligned rows (checked
on the tensors before every launch, else the declared fallback).

``gemv_swiglu`` / ``gemv_geglu``: the down projection of a gated MLP on the stacked gate/up output,
``y = W_down @ (act(gate) * up)`` (``LlamaMLP.forward``, ``act`` SiLU; GemmaMLP's ``gelu_pytorch_tanh``),
with the activation computed tile by tile as the K sweep loads it, in ``silu_and_mul``'s rounding
order (``kernel_src/activation.py``): the activation product is rounded to the dtype before the
multiply-add, so the result equals the unfused ``silu_and_mul_fused`` + ``gemv`` launches bit for
bit on the same tile. Each block recomputes the activation for all K (a few thousand exps: nothing
beside the weight read).

Estimate, written before the kernel (Amdahl, Llama-3.2-1B decode graph b=1 with the GEMV, ~1.22 ms a
step, benchmarks/results/h200-2026-12-03c profile): the 16 ``silu_and_mul_fused`` launches take
~26 us of kernel time plus ~0.3 us of gap each, f ~ 0.026; fused, they cost nothing beside the down
projection's weight read (s large): ceiling ~1.027x. Small, but it also applies to the compiled
step (``cutile-compile`` b=1) and to Gemma's GeGLU. Measured (H200, 2026-12-03): the recomputed
activation is not free: Llama-3.2-1B's down_proj (2048 x 8192, 16 x 256) 19.36 us against 13.29 for
the two launches, and the fast path slowed from 1.21-1.23 to 1.31-1.32 ms a step; Qwen3-0.6B's
(1024 x 3072, 8 x 512) 5.89 against 6.66 us. Not routed (``ops/gemv.py``, ``GLU_TILES``).

``gemv_residual``: the MLP block's residual add in the down projection's epilogue,
``residual + down_proj(h)`` (``LlamaDecoderLayer.forward``'s last line), rounded as the two ops round
(the product to the dtype, then the 16-bit add). For a compiled decode step, where the decoder layers
hand nothing across (``layers/patch.py``) and inductor runs each layer's add as a kernel of its own.

Estimate, written before the kernel (Amdahl, Llama-3.2-1B compiled step b=1 on an H100, ~1.86 ms,
benchmarks/results/h100-2026-12-06e profile): the 16 ``triton_poi_fused_add`` launches take ~1.3 us of
kernel time and ~1 us of gap each, f ~ 0.02; in the epilogue they cost a (1, BN) load a block (s
large): ceiling ~1.02x.
"""

from __future__ import annotations

import cuda.tile as ct

from ._pdl import decode_tile, pdl_wait, with_pdl
from ._spec import DTYPE_TAGS, ArrayParam, ConstParam, VariantSpec, array
from .activation import _gelu_tanh_and_mul, _silu_and_mul

ZERO = ct.PaddingMode.ZERO


@ct.function
def _row_dot(x, weight, bid, BN: ct.Constant[int], BK: ct.Constant[int], PDL: ct.Constant[int]):
    # Rows [bid * BN, bid * BN + BN) of weight times x[0], as a (BN,) float32 tile (PDL: _pdl.py).
    pdl_wait(PDL)
    acc = ct.zeros((BN, BK), dtype=ct.float32)
    for j in range(ct.cdiv(weight.shape[1], BK)):
        w = ct.load(weight, index=(bid, j), shape=(BN, BK), padding_mode=ZERO)
        v = ct.load(x, index=(0, j), shape=(1, BK), padding_mode=ZERO)
        acc = acc + w.astype(ct.float32) * v.astype(ct.float32)
    return ct.sum(acc, axis=1)


@ct.kernel
def gemv_kernel(x, weight, out, BN: ct.Constant[int], BK: ct.Constant[int], PDL: ct.Constant[int]):
    """out[0, n] = sum_k x[0, k] * weight[n, k]. x: (1, K), weight: (N, K), out: (1, N). Grid: (cdiv(N, BN),).
    PDL: see kernel_src/_pdl.py."""
    bid = ct.bid(0)
    y = _row_dot(x, weight, bid, BN, BK, PDL)
    ct.store(out, index=(0, bid), tile=ct.reshape(y, (1, BN)).astype(out.dtype))


@ct.kernel
def gemv_bias_kernel(x, weight, bias, out, BN: ct.Constant[int], BK: ct.Constant[int], PDL: ct.Constant[int]):
    """gemv_kernel plus bias (N,), added in float32 before the one rounding. PDL: see kernel_src/_pdl.py."""
    bid = ct.bid(0)
    y = _row_dot(x, weight, bid, BN, BK, PDL)
    y = y + ct.load(bias, index=(bid,), shape=(BN,), padding_mode=ZERO).astype(ct.float32)
    ct.store(out, index=(0, bid), tile=ct.reshape(y, (1, BN)).astype(out.dtype))


@ct.kernel
def gemv_residual_kernel(x, weight, residual, out, BN: ct.Constant[int], BK: ct.Constant[int],
                         PDL: ct.Constant[int]):
    """out[0, n] = residual[0, n] + (x W^T)[0, n], the product rounded to out's dtype first, then the
    sum in float32 rounded again: ``residual + F.linear(x, weight)`` in 16 bits, bit for bit where the
    product is. residual, out: (1, N). Grid: (cdiv(N, BN),). PDL: see kernel_src/_pdl.py."""
    bid = ct.bid(0)
    y = _row_dot(x, weight, bid, BN, BK, PDL)  # waits first where PDL: the residual is read after
    y = ct.reshape(y, (1, BN)).astype(out.dtype).astype(ct.float32)
    r = ct.load(residual, index=(0, bid), shape=(1, BN), padding_mode=ZERO).astype(ct.float32)
    ct.store(out, index=(0, bid), tile=(y + r).astype(out.dtype))


@ct.kernel
def gemv_glu_kernel(x, weight, out, BN: ct.Constant[int], BK: ct.Constant[int], GELU: ct.Constant[int]):
    """out[0, n] = sum_k act_and_mul(x)[k] * weight[n, k], act SiLU (GELU 0) or GELU-tanh (GELU 1).
    x: (1, 2, K) view of the stacked gate/up row (x[0, 0] gate, x[0, 1] up), weight: (N, K),
    out: (1, N). Grid: (cdiv(N, BN),)."""
    bid = ct.bid(0)
    acc = ct.zeros((BN, BK), dtype=ct.float32)
    for j in range(ct.cdiv(weight.shape[1], BK)):
        w = ct.load(weight, index=(bid, j), shape=(BN, BK), padding_mode=ZERO)
        g = ct.reshape(ct.load(x, index=(0, 0, j), shape=(1, 1, BK), padding_mode=ZERO), (1, BK))
        u = ct.reshape(ct.load(x, index=(0, 1, j), shape=(1, 1, BK), padding_mode=ZERO), (1, BK))
        if GELU != 0:
            h = _gelu_tanh_and_mul(g, u, x.dtype)
        else:
            h = _silu_and_mul(g, u, x.dtype)
        acc = acc + w.astype(ct.float32) * h.astype(ct.float32)  # zero-padded: act(0) * 0 = 0
    y = ct.sum(acc, axis=1)
    ct.store(out, index=(0, bid), tile=ct.reshape(y, (1, BN)).astype(out.dtype))


# ---------------------------------------------------------------------------------------------
# Build matrix
# ---------------------------------------------------------------------------------------------

#: 16-bit dtypes only: a float32 model's decode is not what this kernel is for (cuBLAS runs it).
DTYPES = ("bfloat16", "float16")
#: (BN, BK) tiles built: what the router launches (``ops/gemv.py``, ``TILE_BY_N``). On the H200
#: (dev/microbench/gemv_bench.py, 2026-12-03) fewer, fatter blocks won: about one block per SM with the
#: whole K each (8 x 512 for N <= 1024, 16 x 256 up to 2048). Swept and dropped: 4 x 1024, 8 x 1024,
#: 16 x 512 (never the best by more than 3 %) and 32 x 256 (best on the wide projections, ahead of
#: cuBLAS on two of them by 7-13 %, behind on gate/up and lm_head; not routed, so not built). Swept
#: again with a ``latency`` hint on the weight load, a per-tile row sum with wider tiles, two blocks a
#: multiprocessor and eight warps (dev/sweeps/gemv_sweep.py, 2026-12-04): none better by more than 4 %
#: on the projections the router sends here (the row sum won 3-6 % on lm_head and Gemma-2-2B's down_proj,
#: which stay on cuBLAS, faster still). K split across blocks (the last block of an output tile adding
#: the partial rows; dev/sweeps/gemv_variants.py) slowed the model's step on an H100 (2026-12-07):
#: Llama-3.2-1B's batch-1 replay 1.94 ms with 16 x 256 split 4 ways, 1.83 with 2, against 1.32 unsplit.
TILES = ((8, 512), (16, 256))


def _params(kind: str, dtype: str, consts: dict) -> tuple:
    # x and the weight aligned (contiguous rows, K a multiple of 16: every real hidden size); the
    # output and bias generic (N need not be a multiple of 16).
    arrays = [array("x", dtype, 3 if kind in GLU else 2, "aligned"), array("weight", dtype, 2, "aligned")]
    if kind == "gemv_bias":
        arrays.append(ArrayParam("bias", dtype, 1))
    if kind == "gemv_residual":
        arrays.append(ArrayParam("residual", dtype, 2))
    arrays.append(ArrayParam("out", dtype, 2))
    return (*arrays, *(ConstParam(n, v) for n, v in consts.items()))


#: The gated-MLP down projections: kernel name -> GELU constant of ``gemv_glu_kernel``.
GLU = {"gemv_swiglu": 0, "gemv_geglu": 1}

#: Every variant of this family; ``gemv``'s and ``gemv_residual``'s also with programmatic dependent
#: launch, for captured decode steps (kernel_src/_pdl.py).
VARIANTS: list[VariantSpec] = with_pdl([
    VariantSpec(kind, "gemv", f"{kind}_kernel", f"{DTYPE_TAGS[dtype]}.bn{bn}.bk{bk}",
                _params(kind, dtype, {"BN": bn, "BK": bk}))
    for kind in ("gemv", "gemv_bias", "gemv_residual") for dtype in DTYPES for bn, bk in TILES
], ("gemv_kernel", "gemv_bias_kernel", "gemv_residual_kernel"),
    lambda s: s.kernel in ("gemv", "gemv_residual") and decode_tile(s)) + [
    VariantSpec(kind, "gemv", "gemv_glu_kernel", f"{DTYPE_TAGS[dtype]}.bn{bn}.bk{bk}",
                _params(kind, dtype, {"BN": bn, "BK": bk, "GELU": gelu}))
    for kind, gelu in GLU.items() for dtype in DTYPES for bn, bk in TILES
]
