"""RMSNorm and fused residual-add + RMSNorm (both rounding orders): cuTile device code and build matrix.

Math (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"), with the rounding order of
transformers' ``LlamaRMSNorm.forward`` (models/llama/modeling_llama.py at v5.22.2), which Qwen2,
Qwen3 and Mistral copy::

    h = x.float()
    h = h * rsqrt(mean(h ** 2, -1) + eps)        # float32
    y = weight * h.to(x.dtype)                    # rounded to x.dtype, then the product rounded

The fused kernel first forms ``s = x + residual`` rounded to the input dtype (what the decoder
layer's ``residual + hidden_states`` produces), writes ``s`` and normalises it.

The ``rms_norm_gemma`` kernels compute the other rounding order transformers uses, Gemma's
(``GemmaRMSNorm``, Gemma 2 and 3, Qwen3.5's ``(1 + weight)`` norms) and OLMo 2's
(``Olmo2RMSNorm``): everything in float32 and one rounding at the end, the weight shifted by a
runtime ``offset`` (1.0 for Gemma's ``1 + weight``, 0.0 for OLMo 2's ``weight``)::

    h = x.float()
    h = h * rsqrt(mean(h ** 2, -1) + eps)        # float32
    y = (h * (offset + weight.float())).to(x.dtype)

``add_rms_norm_gemma`` is the fused add with that order (Qwen3.5's decoder layer: ``residual +
hidden_states``, rounded, then its ``(1 + weight)`` post-attention norm). ``rms_norm_add_gemma`` is
the post-norm block's order (OLMo 2's decoder layer: the norm after the sublayer, then the residual
add)::

    y = residual + rms_norm_gemma(x)             # the norm rounded to x.dtype, then the add rounded

The ``rms_norm_gated`` kernel is the gated norm of gated DeltaNet's output (transformers'
``Qwen3_5RMSNormGated``, hub name ``RMSNormGated``): Llama's order, then times SiLU of a gate in
float32 (Yang et al. 2024, "Gated Delta Networks", arXiv:2412.06464)::

    y = (rms_norm(x, weight) * silu(gate.float())).to(x.dtype)   # rms_norm as above, rounded

Every tile dimension is a power of two: a row of N elements is loaded as ``BLOCK_N =
next_power_of_2(N)`` lanes with zero padding (zeros add nothing to the sum of squares, and the
mean divides by the true N). Rows longer than the largest single tile go through the chunked
kernels, which sweep the row twice in ``CHUNK``-wide tiles.
"""

from __future__ import annotations

import cuda.tile as ct

from ._pdl import pdl_wait, with_pdl
from ._spec import DECODE_DTYPES, DTYPE_TAGS, LAYOUTS, ConstParam, ScalarParam, VariantSpec, array

ZERO = ct.PaddingMode.ZERO
RN = ct.RoundingMode.RN


@ct.function
def _sum_sq(h, dtype):
    # Row sums of squares of a float32 tile. For float32 inputs they accumulate in float64, so that
    # the kernel's only float32 roundings are the ones transformers' formula has; for 16-bit inputs
    # the rounding to the output dtype dwarfs the accumulator's, and float32 is kept.
    if dtype == ct.float32:
        hd = h.astype(ct.float64)
        return ct.sum(hd * hd, axis=1, keepdims=True)
    else:
        return ct.sum(h * h, axis=1, keepdims=True)


@ct.function
def _inv_rms(sum_sq, n, eps):
    # 1 / sqrt(mean + eps), the mean rounded to float32 as torch's is, then correctly rounded sqrt
    # and division (the defaults are the approximate forms). Once per row: it costs nothing.
    ms = ct.truediv(sum_sq, n, rounding_mode=RN).astype(ct.float32)
    return ct.truediv(1.0, ct.sqrt(ms + eps, rounding_mode=RN), rounding_mode=RN)


@ct.function
def _scale(h, inv_rms, w, dtype):
    # transformers' order: normalise in float32, round to the input dtype, multiply by the weight.
    return (h * inv_rms).astype(dtype).astype(ct.float32) * w


@ct.function
def _scale_float(h, inv_rms, w, offset):
    # Gemma's / OLMo 2's order: normalise and multiply by (offset + weight) in float32, round once.
    return (h * inv_rms) * (w + offset)


# Hints from the sm_90 sweep (dev/sweeps/norm_sweep.py): occupancy 4 was the fastest RMSNorm at
# every width, 8 worker warps the fastest fused add (it moves 2.5x the bytes per row).
@ct.kernel(occupancy=4)
def rms_norm_kernel(x, weight, y, eps: float, BLOCK_N: ct.Constant[int], ROWS: ct.Constant[int]):
    """y = RMSNorm(x) * weight for ROWS rows per block. x, y: (M, N), N <= BLOCK_N; weight: (N,)."""
    bid = ct.bid(0)
    h = ct.load(x, index=(bid, 0), shape=(ROWS, BLOCK_N), padding_mode=ZERO).astype(ct.float32)
    w = ct.reshape(ct.load(weight, index=(0,), shape=(BLOCK_N,), padding_mode=ZERO).astype(ct.float32), (1, BLOCK_N))
    inv_rms = _inv_rms(_sum_sq(h, x.dtype), x.shape[1], eps)
    ct.store(y, index=(bid, 0), tile=_scale(h, inv_rms, w, x.dtype).astype(y.dtype))


@ct.kernel(occupancy=4)
def rms_norm_gemma_kernel(x, weight, y, eps: float, offset: float, BLOCK_N: ct.Constant[int],
                          ROWS: ct.Constant[int]):
    """y = (RMSNorm(x) * (offset + weight)) in float32, rounded once. Shapes as rms_norm_kernel."""
    bid = ct.bid(0)
    h = ct.load(x, index=(bid, 0), shape=(ROWS, BLOCK_N), padding_mode=ZERO).astype(ct.float32)
    w = ct.reshape(ct.load(weight, index=(0,), shape=(BLOCK_N,), padding_mode=ZERO).astype(ct.float32), (1, BLOCK_N))
    inv_rms = _inv_rms(_sum_sq(h, x.dtype), x.shape[1], eps)
    ct.store(y, index=(bid, 0), tile=_scale_float(h, inv_rms, w, offset).astype(y.dtype))


@ct.kernel(occupancy=4)
def rms_norm_gated_kernel(x, gate, weight, y, eps: float, BLOCK_N: ct.Constant[int], ROWS: ct.Constant[int]):
    """y = (RMSNorm(x) * weight, rounded) * silu(gate) in float32, rounded. x, gate, y: (M, N)."""
    bid = ct.bid(0)
    h = ct.load(x, index=(bid, 0), shape=(ROWS, BLOCK_N), padding_mode=ZERO).astype(ct.float32)
    z = ct.load(gate, index=(bid, 0), shape=(ROWS, BLOCK_N), padding_mode=ZERO).astype(ct.float32)
    w = ct.reshape(ct.load(weight, index=(0,), shape=(BLOCK_N,), padding_mode=ZERO).astype(ct.float32), (1, BLOCK_N))
    inv_rms = _inv_rms(_sum_sq(h, x.dtype), x.shape[1], eps)
    normed = _scale(h, inv_rms, w, x.dtype).astype(y.dtype).astype(ct.float32)
    silu = ct.truediv(z, 1.0 + ct.exp(-z), rounding_mode=RN)
    ct.store(y, index=(bid, 0), tile=(normed * silu).astype(y.dtype))


@ct.kernel(num_worker_warps=8)
def add_rms_norm_kernel(x, residual, weight, y, residual_out, eps: float,
                        BLOCK_N: ct.Constant[int], ROWS: ct.Constant[int], PDL: ct.Constant[int]):
    """residual_out = x + residual; y = RMSNorm(residual_out) * weight. Shapes as rms_norm_kernel.
    PDL: see kernel_src/_pdl.py."""
    pdl_wait(PDL)
    bid = ct.bid(0)
    a = ct.load(x, index=(bid, 0), shape=(ROWS, BLOCK_N), padding_mode=ZERO).astype(ct.float32)
    b = ct.load(residual, index=(bid, 0), shape=(ROWS, BLOCK_N), padding_mode=ZERO).astype(ct.float32)
    s = (a + b).astype(residual_out.dtype)
    ct.store(residual_out, index=(bid, 0), tile=s)
    h = s.astype(ct.float32)
    w = ct.reshape(ct.load(weight, index=(0,), shape=(BLOCK_N,), padding_mode=ZERO).astype(ct.float32), (1, BLOCK_N))
    inv_rms = _inv_rms(_sum_sq(h, x.dtype), x.shape[1], eps)
    ct.store(y, index=(bid, 0), tile=_scale(h, inv_rms, w, x.dtype).astype(y.dtype))


@ct.kernel(num_worker_warps=8)
def add_rms_norm_gemma_kernel(x, residual, weight, y, residual_out, eps: float, offset: float,
                              BLOCK_N: ct.Constant[int], ROWS: ct.Constant[int]):
    """residual_out = x + residual (rounded); y = rms_norm_gemma(residual_out). Shapes as
    rms_norm_kernel."""
    bid = ct.bid(0)
    a = ct.load(x, index=(bid, 0), shape=(ROWS, BLOCK_N), padding_mode=ZERO).astype(ct.float32)
    b = ct.load(residual, index=(bid, 0), shape=(ROWS, BLOCK_N), padding_mode=ZERO).astype(ct.float32)
    s = (a + b).astype(residual_out.dtype)
    ct.store(residual_out, index=(bid, 0), tile=s)
    h = s.astype(ct.float32)
    w = ct.reshape(ct.load(weight, index=(0,), shape=(BLOCK_N,), padding_mode=ZERO).astype(ct.float32), (1, BLOCK_N))
    inv_rms = _inv_rms(_sum_sq(h, x.dtype), x.shape[1], eps)
    ct.store(y, index=(bid, 0), tile=_scale_float(h, inv_rms, w, offset).astype(y.dtype))


@ct.kernel(num_worker_warps=8)
def rms_norm_add_gemma_kernel(x, residual, weight, y, eps: float, offset: float, BLOCK_N: ct.Constant[int],
                              ROWS: ct.Constant[int]):
    """y = residual + rms_norm_gemma(x), the norm rounded to x's dtype first (OLMo 2's post-norm
    block). Shapes as rms_norm_kernel."""
    bid = ct.bid(0)
    h = ct.load(x, index=(bid, 0), shape=(ROWS, BLOCK_N), padding_mode=ZERO).astype(ct.float32)
    b = ct.load(residual, index=(bid, 0), shape=(ROWS, BLOCK_N), padding_mode=ZERO).astype(ct.float32)
    w = ct.reshape(ct.load(weight, index=(0,), shape=(BLOCK_N,), padding_mode=ZERO).astype(ct.float32), (1, BLOCK_N))
    inv_rms = _inv_rms(_sum_sq(h, x.dtype), x.shape[1], eps)
    normed = _scale_float(h, inv_rms, w, offset).astype(y.dtype).astype(ct.float32)
    ct.store(y, index=(bid, 0), tile=(b + normed).astype(y.dtype))


@ct.kernel
def rms_norm_chunked_kernel(x, weight, y, eps: float, CHUNK: ct.Constant[int], ROWS: ct.Constant[int]):
    """rms_norm_kernel for rows of any length: one sweep for the sum of squares, one to write."""
    bid = ct.bid(0)
    n_chunks = ct.cdiv(x.shape[1], CHUNK)
    h = ct.load(x, index=(bid, 0), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
    acc = _sum_sq(h, x.dtype)
    for j in range(1, n_chunks):
        h = ct.load(x, index=(bid, j), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
        acc = acc + _sum_sq(h, x.dtype)
    inv_rms = _inv_rms(acc, x.shape[1], eps)
    for j in range(n_chunks):
        h = ct.load(x, index=(bid, j), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
        w = ct.reshape(ct.load(weight, index=(j,), shape=(CHUNK,), padding_mode=ZERO).astype(ct.float32), (1, CHUNK))
        ct.store(y, index=(bid, j), tile=_scale(h, inv_rms, w, x.dtype).astype(y.dtype))


@ct.kernel
def rms_norm_gemma_chunked_kernel(x, weight, y, eps: float, offset: float, CHUNK: ct.Constant[int],
                                  ROWS: ct.Constant[int]):
    """rms_norm_gemma_kernel for rows of any length: one sweep for the sum of squares, one to write."""
    bid = ct.bid(0)
    n_chunks = ct.cdiv(x.shape[1], CHUNK)
    h = ct.load(x, index=(bid, 0), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
    acc = _sum_sq(h, x.dtype)
    for j in range(1, n_chunks):
        h = ct.load(x, index=(bid, j), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
        acc = acc + _sum_sq(h, x.dtype)
    inv_rms = _inv_rms(acc, x.shape[1], eps)
    for j in range(n_chunks):
        h = ct.load(x, index=(bid, j), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
        w = ct.reshape(ct.load(weight, index=(j,), shape=(CHUNK,), padding_mode=ZERO).astype(ct.float32), (1, CHUNK))
        ct.store(y, index=(bid, j), tile=_scale_float(h, inv_rms, w, offset).astype(y.dtype))


@ct.kernel
def add_rms_norm_chunked_kernel(x, residual, weight, y, residual_out, eps: float,
                                CHUNK: ct.Constant[int], ROWS: ct.Constant[int]):
    """add_rms_norm_kernel for rows of any length. The second sweep recomputes x + residual
    instead of reading residual_out back, because reading another thread's store needs a fence."""
    bid = ct.bid(0)
    n_chunks = ct.cdiv(x.shape[1], CHUNK)
    a = ct.load(x, index=(bid, 0), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
    b = ct.load(residual, index=(bid, 0), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
    s = (a + b).astype(residual_out.dtype)
    ct.store(residual_out, index=(bid, 0), tile=s)
    acc = _sum_sq(s.astype(ct.float32), x.dtype)
    for j in range(1, n_chunks):
        a = ct.load(x, index=(bid, j), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
        b = ct.load(residual, index=(bid, j), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
        s = (a + b).astype(residual_out.dtype)
        ct.store(residual_out, index=(bid, j), tile=s)
        acc = acc + _sum_sq(s.astype(ct.float32), x.dtype)
    inv_rms = _inv_rms(acc, x.shape[1], eps)
    for j in range(n_chunks):
        a = ct.load(x, index=(bid, j), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
        b = ct.load(residual, index=(bid, j), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
        h = (a + b).astype(residual_out.dtype).astype(ct.float32)
        w = ct.reshape(ct.load(weight, index=(j,), shape=(CHUNK,), padding_mode=ZERO).astype(ct.float32), (1, CHUNK))
        ct.store(y, index=(bid, j), tile=_scale(h, inv_rms, w, x.dtype).astype(y.dtype))


@ct.kernel
def add_rms_norm_gemma_chunked_kernel(x, residual, weight, y, residual_out, eps: float, offset: float,
                                      CHUNK: ct.Constant[int], ROWS: ct.Constant[int]):
    """add_rms_norm_gemma_kernel for rows of any length (the sweeps of add_rms_norm_chunked_kernel)."""
    bid = ct.bid(0)
    n_chunks = ct.cdiv(x.shape[1], CHUNK)
    a = ct.load(x, index=(bid, 0), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
    b = ct.load(residual, index=(bid, 0), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
    s = (a + b).astype(residual_out.dtype)
    ct.store(residual_out, index=(bid, 0), tile=s)
    acc = _sum_sq(s.astype(ct.float32), x.dtype)
    for j in range(1, n_chunks):
        a = ct.load(x, index=(bid, j), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
        b = ct.load(residual, index=(bid, j), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
        s = (a + b).astype(residual_out.dtype)
        ct.store(residual_out, index=(bid, j), tile=s)
        acc = acc + _sum_sq(s.astype(ct.float32), x.dtype)
    inv_rms = _inv_rms(acc, x.shape[1], eps)
    for j in range(n_chunks):
        a = ct.load(x, index=(bid, j), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
        b = ct.load(residual, index=(bid, j), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
        h = (a + b).astype(residual_out.dtype).astype(ct.float32)
        w = ct.reshape(ct.load(weight, index=(j,), shape=(CHUNK,), padding_mode=ZERO).astype(ct.float32), (1, CHUNK))
        ct.store(y, index=(bid, j), tile=_scale_float(h, inv_rms, w, offset).astype(y.dtype))


@ct.kernel
def rms_norm_add_gemma_chunked_kernel(x, residual, weight, y, eps: float, offset: float, CHUNK: ct.Constant[int],
                                      ROWS: ct.Constant[int]):
    """rms_norm_add_gemma_kernel for rows of any length: one sweep for the sum of squares, one to write."""
    bid = ct.bid(0)
    n_chunks = ct.cdiv(x.shape[1], CHUNK)
    h = ct.load(x, index=(bid, 0), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
    acc = _sum_sq(h, x.dtype)
    for j in range(1, n_chunks):
        h = ct.load(x, index=(bid, j), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
        acc = acc + _sum_sq(h, x.dtype)
    inv_rms = _inv_rms(acc, x.shape[1], eps)
    for j in range(n_chunks):
        h = ct.load(x, index=(bid, j), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
        b = ct.load(residual, index=(bid, j), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
        w = ct.reshape(ct.load(weight, index=(j,), shape=(CHUNK,), padding_mode=ZERO).astype(ct.float32), (1, CHUNK))
        normed = _scale_float(h, inv_rms, w, offset).astype(y.dtype).astype(ct.float32)
        ct.store(y, index=(bid, j), tile=(b + normed).astype(y.dtype))


# ---------------------------------------------------------------------------------------------
# Build matrix
# ---------------------------------------------------------------------------------------------

#: Largest row held in one tile; longer rows take the chunked kernels.
MAX_BLOCK_N = 8192
#: Single-tile widths built (every power of two up to MAX_BLOCK_N; Qwen3's q/k norm is 128 wide).
BLOCK_NS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
#: Chunk width of the chunked kernels.
CHUNK = 2048
#: Rows per block of the single-tile kernels, per kernel and layout, from the sm_90 sweep
#: (dev/sweeps/norm_sweep.py): about 8192 elements per RMSNorm block and 16-32k per fused block
#: when the layout is aligned; small tiles when it is not, where big tiles ran 5-10x slower.
ROWS = {
    ("rms_norm", "aligned"): {64: 128, 128: 64, 256: 32, 512: 16, 1024: 8, 2048: 4, 4096: 2, 8192: 1},
    ("add_rms_norm", "aligned"): {64: 256, 128: 128, 256: 64, 512: 32, 1024: 16, 2048: 16, 4096: 8, 8192: 4},
    ("rms_norm", "generic"): {64: 32, 128: 16, 256: 8, 512: 4, 1024: 2, 2048: 1, 4096: 1, 8192: 1},
    ("add_rms_norm", "generic"): {64: 32, 128: 16, 256: 8, 512: 4, 1024: 2, 2048: 1, 4096: 1, 8192: 1},
}
# rms_norm_gemma moves the bytes rms_norm moves: its tiles until a sweep says otherwise.
ROWS[("rms_norm_gemma", "aligned")] = ROWS[("rms_norm", "aligned")]
ROWS[("rms_norm_gemma", "generic")] = ROWS[("rms_norm", "generic")]
# The fused Gemma-order add moves add_rms_norm's bytes: its tiles.
#: Its single-tile widths: hidden sizes only (512 and up; Gemma's and Qwen3.5's residual streams).
HIDDEN_BLOCK_NS = tuple(n for n in BLOCK_NS if n >= 512)
ROWS[("add_rms_norm_gemma", "aligned")] = ROWS[("add_rms_norm", "aligned")]
ROWS[("add_rms_norm_gemma", "generic")] = ROWS[("add_rms_norm", "generic")]
# The post-norm add reads two rows and writes one (between the two): the fused add's tiles, its
# hidden widths, and 16-bit dtypes only (OLMo 2 runs bf16; float32 models take the reference).
ROWS[("rms_norm_add_gemma", "aligned")] = ROWS[("add_rms_norm", "aligned")]
ROWS[("rms_norm_add_gemma", "generic")] = ROWS[("add_rms_norm", "generic")]
CHUNKED_ROWS = 1
#: Dtypes of the post-norm add's variants.
POST_NORM_DTYPES = ("bfloat16", "float16")
#: Widths of the gated norm (its rows are one head's values: 128 in Qwen3.5 and Qwen3-Next).
GATED_BLOCK_NS = (64, 128, 256)
ROWS[("rms_norm_gated", "aligned")] = ROWS[("rms_norm", "aligned")]
ROWS[("rms_norm_gated", "generic")] = ROWS[("rms_norm", "generic")]
#: At most this many rows (a decode step's batch), the runtime asks for one row per block
#: (``ROWS=1``): for every width and layout of :data:`DECODE_DTYPES` such a variant is built.
DECODE_MAX_ROWS = 256
#: Rows per block of the fused add + norm kinds' middle tile, for a prefill of a few hundred rows:
#: their prefill tile (16 rows at 2048 wide) gives 512 rows 32 blocks, a quarter of the SMs. The
#: sm_90 sweeps (dev/sweeps/norm_sweep.py, 2026-12-05) of add_rms_norm: 512 x 2048 best at 4 rows
#: (H100 5.06 us against 7.75 for 16 rows, 6.35 for 8, 6.73 for 1; H200 5.01 against 7.68), 512 x 3072
#: too (H100 6.86 against 8.36 for 8 rows); 1024 x 2048 a tie (H200 8.08 against 7.91 for 16 rows),
#: 2048 x 2048 16 rows (H100 10.52 against 14.66 for 4).
MID_ROWS = 4
#: The runtime takes the middle tile where its block count is nearer one wave than the prefill
#: tile's: the device's multiprocessor count (132 on the H100 and H200, where the sweeps' best tiles
#: gave 128 blocks), this where there is no device (``ops/norm.py``, ``_mid_want``).
MID_WAVE_BLOCKS = 128
#: The kinds with a middle tile (aligned layout, 16-bit dtypes, hidden widths). add_rms_norm_gemma
#: moves add_rms_norm's bytes; rms_norm_add_gemma (two rows read, one written) takes it unmeasured.
MID_KINDS = ("add_rms_norm", "add_rms_norm_gemma", "rms_norm_add_gemma")


def _params(kind: str, dtype: str, layout: str, consts: dict):
    arrays = {
        "rms_norm": ("x", "weight", "y"),
        "rms_norm_gemma": ("x", "weight", "y"),
        "add_rms_norm": ("x", "residual", "weight", "y", "residual_out"),
        "add_rms_norm_gemma": ("x", "residual", "weight", "y", "residual_out"),
        "rms_norm_add_gemma": ("x", "residual", "weight", "y"),
        "rms_norm_gated": ("x", "gate", "weight", "y"),
    }[kind]
    params = [array(a, dtype, 1 if a == "weight" else 2, layout) for a in arrays]
    params.append(ScalarParam("eps", "float32"))
    if kind in ("rms_norm_gemma", "add_rms_norm_gemma", "rms_norm_add_gemma"):
        params.append(ScalarParam("offset", "float32"))
    params += [ConstParam(k, v) for k, v in consts.items()]
    return tuple(params)


def _matrix() -> list[VariantSpec]:
    specs = []
    for kind in ("rms_norm", "add_rms_norm", "rms_norm_gemma", "add_rms_norm_gemma", "rms_norm_add_gemma",
                 "rms_norm_gated"):
        for dtype in POST_NORM_DTYPES if kind == "rms_norm_add_gemma" else ("bfloat16", "float16", "float32"):
            for layout in LAYOUTS:
                d = DTYPE_TAGS[dtype]
                rows = ROWS[(kind, layout)]
                # Decode tiles (one row per block) where the prefill tile has more than one row.
                widths = {"rms_norm_gated": GATED_BLOCK_NS, "add_rms_norm_gemma": HIDDEN_BLOCK_NS,
                          "rms_norm_add_gemma": HIDDEN_BLOCK_NS}.get(kind, BLOCK_NS)
                tiles = [(bn, rows[bn]) for bn in widths]
                if dtype in DECODE_DTYPES:
                    tiles += [(bn, 1) for bn in widths if rows[bn] != 1]
                    if kind in MID_KINDS and layout == "aligned":
                        tiles += [(bn, MID_ROWS) for bn in widths if bn in HIDDEN_BLOCK_NS and rows[bn] > MID_ROWS]
                for bn, r in tiles:
                    consts = {"BLOCK_N": bn, "ROWS": r}
                    specs.append(VariantSpec(kind, "norm", f"{kind}_kernel", f"{d}.n{bn}.r{r}.{layout}",
                                             _params(kind, dtype, layout, consts)))
                if kind == "rms_norm_gated":
                    continue
                consts = {"CHUNK": CHUNK, "ROWS": CHUNKED_ROWS}
                specs.append(VariantSpec(kind, "norm", f"{kind}_chunked_kernel",
                                         f"{d}.chunk{CHUNK}.r{CHUNKED_ROWS}.{layout}",
                                         _params(kind, dtype, layout, consts)))
    return specs


#: Every variant of this family, in the runtime's order of preference: aligned before generic (a
#: request without ``ROWS`` takes the prefill tile; one with ``ROWS=1`` the aligned decode tile, one
#: with ``ROWS=MID_ROWS`` the aligned middle tile).
#: add_rms_norm's 16-bit aligned tiles also come with programmatic dependent launch, for captured
#: decode steps (kernel_src/_pdl.py).
VARIANTS: list[VariantSpec] = with_pdl(_matrix(), ("add_rms_norm_kernel",))
