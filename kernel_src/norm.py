"""RMSNorm and fused residual-add + RMSNorm: cuTile device code and build matrix.

Math (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"), with the rounding order of
transformers' ``LlamaRMSNorm.forward`` (models/llama/modeling_llama.py at v5.22.2), which Qwen2,
Qwen3 and Mistral copy::

    h = x.float()
    h = h * rsqrt(mean(h ** 2, -1) + eps)        # float32
    y = weight * h.to(x.dtype)                    # rounded to x.dtype, then the product rounded

The fused kernel first forms ``s = x + residual`` rounded to the input dtype (what the decoder
layer's ``residual + hidden_states`` produces), writes ``s`` and normalises it.

Every tile dimension is a power of two: a row of N elements is loaded as ``BLOCK_N =
next_power_of_2(N)`` lanes with zero padding (zeros add nothing to the sum of squares, and the
mean divides by the true N). Rows longer than the largest single tile go through the chunked
kernels, which sweep the row twice in ``CHUNK``-wide tiles.
"""

from __future__ import annotations

import cuda.tile as ct

from ._spec import DTYPE_TAGS, LAYOUTS, ConstParam, ScalarParam, VariantSpec, array

ZERO = ct.PaddingMode.ZERO


@ct.function
def _inv_rms(mean_square, eps):
    # 1 / sqrt(ms + eps) with IEEE-rounded sqrt and division: torch.rsqrt is within an ulp of
    # exact in float32, the approximate rsqrt is not. It runs once per row, so it costs nothing.
    return 1.0 / ct.sqrt(mean_square + eps)


@ct.kernel
def rms_norm_kernel(x, weight, y, eps: float, BLOCK_N: ct.Constant[int], ROWS: ct.Constant[int]):
    """y = RMSNorm(x) * weight for ROWS rows per block. x, y: (M, N), N <= BLOCK_N; weight: (N,)."""
    bid = ct.bid(0)
    inv_n = 1.0 / x.shape[1]
    h = ct.load(x, index=(bid, 0), shape=(ROWS, BLOCK_N), padding_mode=ZERO).astype(ct.float32)
    h = (h * _inv_rms(ct.sum(h * h, axis=1, keepdims=True) * inv_n, eps)).astype(x.dtype).astype(ct.float32)
    w = ct.load(weight, index=(0,), shape=(BLOCK_N,), padding_mode=ZERO).astype(ct.float32)
    ct.store(y, index=(bid, 0), tile=(h * ct.reshape(w, (1, BLOCK_N))).astype(y.dtype))


@ct.kernel
def add_rms_norm_kernel(x, residual, weight, y, residual_out, eps: float,
                        BLOCK_N: ct.Constant[int], ROWS: ct.Constant[int]):
    """residual_out = x + residual; y = RMSNorm(residual_out) * weight. Shapes as rms_norm_kernel."""
    bid = ct.bid(0)
    inv_n = 1.0 / x.shape[1]
    a = ct.load(x, index=(bid, 0), shape=(ROWS, BLOCK_N), padding_mode=ZERO).astype(ct.float32)
    b = ct.load(residual, index=(bid, 0), shape=(ROWS, BLOCK_N), padding_mode=ZERO).astype(ct.float32)
    s = (a + b).astype(residual_out.dtype)
    ct.store(residual_out, index=(bid, 0), tile=s)
    h = s.astype(ct.float32)
    h = (h * _inv_rms(ct.sum(h * h, axis=1, keepdims=True) * inv_n, eps)).astype(x.dtype).astype(ct.float32)
    w = ct.load(weight, index=(0,), shape=(BLOCK_N,), padding_mode=ZERO).astype(ct.float32)
    ct.store(y, index=(bid, 0), tile=(h * ct.reshape(w, (1, BLOCK_N))).astype(y.dtype))


@ct.kernel
def rms_norm_chunked_kernel(x, weight, y, eps: float, CHUNK: ct.Constant[int], ROWS: ct.Constant[int]):
    """rms_norm_kernel for rows of any length: one sweep for the sum of squares, one to write."""
    bid = ct.bid(0)
    n_chunks = ct.cdiv(x.shape[1], CHUNK)
    inv_n = 1.0 / x.shape[1]
    acc = ct.zeros((ROWS, CHUNK), dtype=ct.float32)
    for j in range(n_chunks):
        h = ct.load(x, index=(bid, j), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
        acc = acc + h * h
    inv_rms = _inv_rms(ct.sum(acc, axis=1, keepdims=True) * inv_n, eps)
    for j in range(n_chunks):
        h = ct.load(x, index=(bid, j), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
        h = (h * inv_rms).astype(x.dtype).astype(ct.float32)
        w = ct.load(weight, index=(j,), shape=(CHUNK,), padding_mode=ZERO).astype(ct.float32)
        ct.store(y, index=(bid, j), tile=(h * ct.reshape(w, (1, CHUNK))).astype(y.dtype))


@ct.kernel
def add_rms_norm_chunked_kernel(x, residual, weight, y, residual_out, eps: float,
                                CHUNK: ct.Constant[int], ROWS: ct.Constant[int]):
    """add_rms_norm_kernel for rows of any length. The second sweep recomputes x + residual
    instead of reading residual_out back, because reading another thread's store needs a fence."""
    bid = ct.bid(0)
    n_chunks = ct.cdiv(x.shape[1], CHUNK)
    inv_n = 1.0 / x.shape[1]
    acc = ct.zeros((ROWS, CHUNK), dtype=ct.float32)
    for j in range(n_chunks):
        a = ct.load(x, index=(bid, j), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
        b = ct.load(residual, index=(bid, j), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
        s = (a + b).astype(residual_out.dtype)
        ct.store(residual_out, index=(bid, j), tile=s)
        h = s.astype(ct.float32)
        acc = acc + h * h
    inv_rms = _inv_rms(ct.sum(acc, axis=1, keepdims=True) * inv_n, eps)
    for j in range(n_chunks):
        a = ct.load(x, index=(bid, j), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
        b = ct.load(residual, index=(bid, j), shape=(ROWS, CHUNK), padding_mode=ZERO).astype(ct.float32)
        h = (a + b).astype(residual_out.dtype).astype(ct.float32)
        h = (h * inv_rms).astype(x.dtype).astype(ct.float32)
        w = ct.load(weight, index=(j,), shape=(CHUNK,), padding_mode=ZERO).astype(ct.float32)
        ct.store(y, index=(bid, j), tile=(h * ct.reshape(w, (1, CHUNK))).astype(y.dtype))


# ---------------------------------------------------------------------------------------------
# Build matrix
# ---------------------------------------------------------------------------------------------

#: Largest row held in one tile; longer rows take the chunked kernels.
MAX_BLOCK_N = 8192
#: Single-tile widths built (every power of two up to MAX_BLOCK_N; Qwen3's q/k norm is 128 wide).
BLOCK_NS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
#: Chunk width of the chunked kernels.
CHUNK = 2048
#: Rows per block for a single-tile width: aim for about 4096 elements per block, so that short
#: rows (decode batches, per-head norms) still give each block enough bytes in flight.
ROWS_FOR_BLOCK_N = {64: 64, 128: 32, 256: 16, 512: 8, 1024: 4, 2048: 2, 4096: 1, 8192: 1}
CHUNKED_ROWS = 1


def rows_for(block_n: int) -> int:
    """Rows per block of the single-tile kernels for a given padded width."""
    return ROWS_FOR_BLOCK_N[block_n]


def _params(kind: str, dtype: str, layout: str, consts: dict):
    arrays = {
        "rms_norm": ("x", "weight", "y"),
        "add_rms_norm": ("x", "residual", "weight", "y", "residual_out"),
    }[kind]
    params = [array(a, dtype, 1 if a == "weight" else 2, layout) for a in arrays]
    params.append(ScalarParam("eps", "float32"))
    params += [ConstParam(k, v) for k, v in consts.items()]
    return tuple(params)


def _matrix() -> list[VariantSpec]:
    specs = []
    for kind in ("rms_norm", "add_rms_norm"):
        for dtype in ("bfloat16", "float16", "float32"):
            for layout in LAYOUTS:
                d = DTYPE_TAGS[dtype]
                for bn in BLOCK_NS:
                    consts = {"BLOCK_N": bn, "ROWS": rows_for(bn)}
                    specs.append(VariantSpec(kind, "norm", f"{kind}_kernel",
                                             f"{d}.n{bn}.r{consts['ROWS']}.{layout}",
                                             _params(kind, dtype, layout, consts)))
                consts = {"CHUNK": CHUNK, "ROWS": CHUNKED_ROWS}
                specs.append(VariantSpec(kind, "norm", f"{kind}_chunked_kernel",
                                         f"{d}.chunk{CHUNK}.r{CHUNKED_ROWS}.{layout}",
                                         _params(kind, dtype, layout, consts)))
    return specs


#: Every variant of this family, in the runtime's order of preference (aligned before generic).
VARIANTS: list[VariantSpec] = _matrix()
