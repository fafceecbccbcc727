"""Qwen3's per-head q/k RMSNorm fused with RoPE, for q and k in one launch, and the same for
Qwen3.5's zero-centered norms with partial RoPE (``qk_norm_rope_gemma``) and for OLMo 2's norms over
the whole projection with its float32 RoPE (``qk_norm_rope_olmo2``), sections below: cuTile device
code and build matrix.

Math: what transformers' ``Qwen3Attention.forward`` (models/qwen3/modeling_qwen3.py at v5.22.2)
does between the projections and the KV cache, with its rounding order::

    q = q_norm(q_proj(x).view(B, S, Hq, D)).transpose(1, 2)     # Qwen3RMSNorm = LlamaRMSNorm's formula
    k = k_norm(k_proj(x).view(B, S, Hk, D)).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)                  # Llama's formula

i.e. per head row ``x`` of D elements, with ``round`` = round to the input dtype::

    n   = round(weight * round(x * rsqrt(mean(x ** 2) + eps)))    # normalised in float32 (norm.py)
    out = rope(n, cos, sin)                                        # each op rounded as torch (rope.py)

The device code is norm.py's helpers (``_sum_sq``, ``_inv_rms``, ``_scale``) and rope.py's
(``_cos_sin``, ``_rounded_mul``), so the two formulas are the ones those kernels already reproduce;
the only new thing is that the normalised head never leaves the registers. Full rotary only
(cos/sin as wide as the head); partial rotary is a declared fallback on the host (for this
kernel: ``qk_norm_rope_gemma`` below rotates part of the head).

Layout handed to the kernel, as rope.py: q (B, Hq, S, D) and k (B, Hk, S, D) as transformers
passes them (the projection output, a (B, S, H, D) buffer, seen transposed) viewed as
(..., 2, D/2); cos/sin (B or 1, S, 2, D/2); the weights (2, D/2). The row's sum of squares is
the sum over both halves. ``D/2`` is loaded as the next power of two with zero padding (zeros add
nothing to the sum; the mean divides by the true D); padded lanes, rows and heads are masked on
store.

Estimate, written before the kernel (Amdahl, ``1 / (1 - f + f / s)``), from the H200 profile of
Qwen3-0.6B (bench coverage):

* Device time: q_norm + k_norm (our rms_norm kernel, 2 launches per layer) are 8.5 % of it and
  RoPE (our rope kernel, 1 launch) 4.5 %, so f = 13 %. Fused, the head rows are read and written
  once instead of twice (the norms' output is RoPE's input): about half the bytes, s ~= 1.5-2,
  ceiling on device time 1 / (1 - 0.13 + 0.13 / 1.5) ~= 1.045, i.e. ~1.04.
* Host time (eager decode, host-bound): 2 of the 3 launches per layer go, 56 launches of ~25 us
  each on a 28-layer model out of a ~20 ms step: f ~= 7 % of the step, s -> inf for what is
  removed, ceiling ~= 1 / (1 - 0.07) ~= 1.075 on decode tokens/s; less under CUDA graphs or
  torch.compile, where the host cost is gone.
"""

from __future__ import annotations

import cuda.tile as ct

from ._pdl import pdl_wait, with_pdl
from ._spec import DECODE_DTYPES, DTYPE_TAGS, LAYOUTS, ConstParam, ScalarParam, VariantSpec, array
# The helpers are the norm and rope kernels' own (one formula each); the builder hashes the modules
# a family imports into its variants (builder/aot.py, kernel_sources), so a change there rebuilds this kernel.
from .norm import _inv_rms, _scale, _scale_float, _sum_sq
from .rope import BLOCKS, HEADS, ROWS, _cos_sin, _rounded_mul, tile_matrix

ZERO = ct.PaddingMode.ZERO
RN = ct.RoundingMode.RN  # read by norm.py's helpers when they are compiled in this module's scope


@ct.function
def _norm_rotate(x, w, out, b, h, s, c1, c2, s1, s2, eps, BLOCK: ct.Constant[int], ROWS: ct.Constant[int],
                 HEADS: ct.Constant[int]):
    # x, out: (B, H, S, 2, D/2); w: (2, D/2); (b, h, s) index tiles of (1, HEADS, ROWS); c*, s*:
    # (1, ROWS, BLOCK) float32 tiles of cos and sin shared by the HEADS heads.
    shape = (1, HEADS, ROWS, 1, BLOCK)
    rows = (HEADS * ROWS, BLOCK)  # one head row per tile row: norm.py's helpers reduce axis 1
    x1 = ct.reshape(ct.load(x, index=(b, h, s, 0, 0), shape=shape, padding_mode=ZERO), rows).astype(ct.float32)
    x2 = ct.reshape(ct.load(x, index=(b, h, s, 1, 0), shape=shape, padding_mode=ZERO), rows).astype(ct.float32)
    w1 = ct.load(w, index=(0, 0), shape=(1, BLOCK), padding_mode=ZERO).astype(ct.float32)
    w2 = ct.load(w, index=(1, 0), shape=(1, BLOCK), padding_mode=ZERO).astype(ct.float32)
    inv_rms = _inv_rms(_sum_sq(x1, x.dtype) + _sum_sq(x2, x.dtype), x.shape[3] * x.shape[4], eps)
    # The normed head rounded to the dtype (the q_norm module's output), back to float32 for RoPE.
    heads = (HEADS, ROWS, BLOCK)
    n1 = ct.reshape(_scale(x1, inv_rms, w1, x.dtype).astype(x.dtype).astype(ct.float32), heads)
    n2 = ct.reshape(_scale(x2, inv_rms, w2, x.dtype).astype(x.dtype).astype(ct.float32), heads)
    o1 = _rounded_mul(n1, c1, x.dtype) - _rounded_mul(n2, s1, x.dtype)
    o2 = _rounded_mul(n2, c2, x.dtype) + _rounded_mul(n1, s2, x.dtype)
    ct.store(out, index=(b, h, s, 0, 0), tile=ct.reshape(o1.astype(out.dtype), shape))
    ct.store(out, index=(b, h, s, 1, 0), tile=ct.reshape(o2.astype(out.dtype), shape))


@ct.kernel
def qk_norm_rope_kernel(q, k, q_weight, k_weight, cos, sin, q_out, k_out, eps: float, BLOCK: ct.Constant[int],
                        ROWS: ct.Constant[int], HEADS: ct.Constant[int], PDL: ct.Constant[int]):
    """RMSNorm then RoPE of ROWS positions of HEADS heads of q or of k per block.

    q, q_out: (B, Hq, S, 2, D/2); k, k_out: (B, Hk, S, 2, D/2); q_weight, k_weight: (2, D/2);
    cos, sin: (B or 1, S, 2, D/2); D/2 <= BLOCK. Grid: (cdiv(S, ROWS), cdiv(Hq, HEADS) +
    cdiv(Hk, HEADS), B), the first cdiv(Hq, HEADS) head tiles q's, the rest k's (as rope_kernel).
    PDL: see kernel_src/_pdl.py.
    """
    pdl_wait(PDL)
    s = ct.bid(0)
    h = ct.bid(1)
    b = ct.bid(2)
    c1, c2, s1, s2 = _cos_sin(cos, sin, b, s, BLOCK, ROWS)
    q_tiles = ct.cdiv(q.shape[1], HEADS)
    if h < q_tiles:
        _norm_rotate(q, q_weight, q_out, b, h, s, c1, c2, s1, s2, eps, BLOCK, ROWS, HEADS)
    else:
        _norm_rotate(k, k_weight, k_out, b, h - q_tiles, s, c1, c2, s1, s2, eps, BLOCK, ROWS, HEADS)


# ---------------------------------------------------------------------------------------------
# Zero-centered q/k norms and partial RoPE (Qwen3.5's gated attention; Gemma 3's q/k norms)
# ---------------------------------------------------------------------------------------------
#
# Qwen3_5Attention.forward (models/qwen3_5/modeling_qwen3_5.py at v5.22.2) norms each head with
# Qwen3_5RMSNorm, Gemma's order: ``round(x * rsqrt(mean(x ** 2) + eps) * (1 + weight))`` all in
# float32, rounded once (norm.py's ``_scale_float`` with offset 1), then rotates only the first R =
# cos.shape[-1] elements of each head (partial rotary: R = D / 4 there) with Llama's formula; the
# other D - R elements are the normed head as it is. The host views every head (B, H, S, D) as
# (B, H, S, D / (R/2), R/2) chunks of R/2, so chunk 0 and chunk 1 are the rotated halves and the
# rest pass through; one (CHUNKS, BLOCK) tile holds the whole head (CHUNKS, BLOCK: D / (R/2) and
# R/2 padded up to powers of two), and the halves are loaded again as (1, BLOCK) tiles of the same
# array. One store writes the head: the rotated halves selected into chunks 0 and 1 with ``where``.
# Full rotary (R = D, Gemma 3) is CHUNKS = 2: nothing passes through.
#
# Estimate, written before the kernel (Amdahl), Qwen3.5-0.8B on the H200 (session 14's bench): a
# full-attention layer's q_norm and k_norm (our rms_norm_gemma, 2 launches) and the partial RoPE
# (``qwen3_5_rope``: 1 launch and 2 copies of the pass-through part) become 1 launch; 4 of ~22
# launches per step in 6 of 24 layers: host-bound eager decode f ~ 4 % of an ~18 ms step, s -> inf
# for what is removed, ceiling ~1.04; device time in the fast path well under 1 % (ceiling ~1.0).


@ct.function
def _norm_rotate_float(x, w, out, b, h, s, c1, c2, s1, s2, eps, offset, BLOCK: ct.Constant[int],
                       CHUNKS: ct.Constant[int], ROWS: ct.Constant[int], HEADS: ct.Constant[int]):
    # x, out: (B, H, S, D/(R/2), R/2); w: (D/(R/2), R/2); (b, h, s) index tiles of (1, HEADS, ROWS);
    # c*, s*: (1, ROWS, BLOCK) float32 tiles of cos and sin shared by the HEADS heads.
    n_rows = HEADS * ROWS
    head = (1, HEADS, ROWS, CHUNKS, BLOCK)
    whole = ct.reshape(ct.load(x, index=(b, h, s, 0, 0), shape=head, padding_mode=ZERO),
                       (n_rows, CHUNKS * BLOCK)).astype(ct.float32)
    inv_rms = _inv_rms(_sum_sq(whole, x.dtype), x.shape[3] * x.shape[4], eps)  # (n_rows, 1)
    w_all = ct.reshape(ct.load(w, index=(0, 0), shape=(CHUNKS, BLOCK), padding_mode=ZERO).astype(ct.float32),
                       (1, CHUNKS * BLOCK))
    normed = ct.reshape(_scale_float(whole, inv_rms, w_all, offset).astype(x.dtype).astype(ct.float32),
                        (n_rows, CHUNKS, BLOCK))
    # The rotated halves: chunks 0 and 1 again, as rope.py's (HEADS, ROWS, BLOCK) tiles.
    half = (1, HEADS, ROWS, 1, BLOCK)
    rows = (n_rows, BLOCK)
    heads = (HEADS, ROWS, BLOCK)
    x1 = ct.reshape(ct.load(x, index=(b, h, s, 0, 0), shape=half, padding_mode=ZERO), rows).astype(ct.float32)
    x2 = ct.reshape(ct.load(x, index=(b, h, s, 1, 0), shape=half, padding_mode=ZERO), rows).astype(ct.float32)
    w1 = ct.load(w, index=(0, 0), shape=(1, BLOCK), padding_mode=ZERO).astype(ct.float32)
    w2 = ct.load(w, index=(1, 0), shape=(1, BLOCK), padding_mode=ZERO).astype(ct.float32)
    n1 = ct.reshape(_scale_float(x1, inv_rms, w1, offset).astype(x.dtype).astype(ct.float32), heads)
    n2 = ct.reshape(_scale_float(x2, inv_rms, w2, offset).astype(x.dtype).astype(ct.float32), heads)
    o1 = ct.reshape(_rounded_mul(n1, c1, x.dtype) - _rounded_mul(n2, s1, x.dtype), (n_rows, 1, BLOCK))
    o2 = ct.reshape(_rounded_mul(n2, c2, x.dtype) + _rounded_mul(n1, s2, x.dtype), (n_rows, 1, BLOCK))
    chunk = ct.reshape(ct.arange(CHUNKS, dtype=ct.int32), (1, CHUNKS, 1))
    result = ct.where(chunk == 0, o1, ct.where(chunk == 1, o2, normed))
    ct.store(out, index=(b, h, s, 0, 0), tile=ct.reshape(result.astype(out.dtype), head))


@ct.kernel
def qk_norm_rope_gemma_kernel(q, k, q_weight, k_weight, cos, sin, q_out, k_out, eps: float, offset: float,
                              BLOCK: ct.Constant[int], CHUNKS: ct.Constant[int], ROWS: ct.Constant[int],
                              HEADS: ct.Constant[int]):
    """(offset + weight) RMSNorm in float32, then RoPE of the first R elements, of ROWS positions of
    HEADS heads of q or of k per block.

    q, q_out: (B, Hq, S, D/(R/2), R/2); k, k_out: (B, Hk, S, D/(R/2), R/2); q_weight, k_weight:
    (D/(R/2), R/2); cos, sin: (B or 1, S, 2, R/2); R/2 <= BLOCK, D/(R/2) <= CHUNKS. Grid as
    qk_norm_rope_kernel's.
    """
    s = ct.bid(0)
    h = ct.bid(1)
    b = ct.bid(2)
    c1, c2, s1, s2 = _cos_sin(cos, sin, b, s, BLOCK, ROWS)
    q_tiles = ct.cdiv(q.shape[1], HEADS)
    if h < q_tiles:
        _norm_rotate_float(q, q_weight, q_out, b, h, s, c1, c2, s1, s2, eps, offset, BLOCK, CHUNKS, ROWS, HEADS)
    else:
        _norm_rotate_float(k, k_weight, k_out, b, h - q_tiles, s, c1, c2, s1, s2, eps, offset, BLOCK, CHUNKS, ROWS,
                           HEADS)


# ---------------------------------------------------------------------------------------------
# OLMo 2's q/k norms over the whole projection, then its float32 RoPE
# ---------------------------------------------------------------------------------------------
#
# Olmo2Attention.forward (models/olmo2/modeling_olmo2.py at v5.22.2; OLMo 3's attention copies it)
# norms the q projection's output ``(B, S, Hq * D)`` as one row per token (``Olmo2RMSNorm``:
# float32, ``weight * x * rsqrt(mean(x ** 2) + eps)``, one rounding: norm.py's ``_scale_float`` with
# offset 0), k's likewise, and only then splits heads and rotates them with OLMo 2's
# ``apply_rotary_pos_emb``: float32 cos/sin against 16-bit q and k, so every op rounds to float32 and
# the result is cast back once (rope.py's formula with cos's dtype as the rounding dtype). The host
# views q and k ``(B, S, H * D)`` as ``(B, S, H, 2, D/2)`` and the weights as ``(H, 2, D/2)``: one
# block holds ROWS tokens' whole rows as two ``(ROWS, HP * BLOCK)`` halves (HP: the heads padded to a
# power of two, zeros on load, masked on store), sums both for the norm, and rotates each head with
# the position's cos/sin broadcast over the heads. Outputs in the projection's layout ``(B, S, H * D)``.
#
# Estimate, written before the kernel (Amdahl), OLMo-2-1B's decode fast path on the H200 (eighth
# session: 1.58 / 1.89 ms a step at b=1 / 16, stock-compile 1.60 / 1.79): q_norm, k_norm and RoPE are
# 3 launches a layer (~2.5 us each in a replayed graph) that become 1 (~3 us); with the attention
# forward that calls it, q/k/v also stack into one GEMM (``fused_qkv``: 3 launches of ~5-6 us into one
# of ~10). Per layer ~12 us of ~19 us go, 16 layers: f ~0.16 at b=16, s ~3, ceiling ~1.12x
# (b=1 f ~0.14, ceiling ~1.10x). In eager prefill the three launches' bytes are read and written
# once instead of three times (coverage unchanged: all three were ours).


@ct.function
def _olmo2_norm_rotate(x, w, out, b, s, c1, c2, s1, s2, eps, rdtype, BLOCK: ct.Constant[int], HP: ct.Constant[int],
                       ROWS: ct.Constant[int]):
    # x, out: (B, S, H, 2, D/2); w: (H, 2, D/2); c*, s*: (ROWS, 1, BLOCK) float32 tiles of cos and sin;
    # rdtype: what each op of the rotation rounds to.
    half = (1, ROWS, HP, 1, BLOCK)
    flat = (ROWS, HP * BLOCK)  # one token's row per tile row: norm.py's helpers reduce axis 1
    x1 = ct.reshape(ct.load(x, index=(b, s, 0, 0, 0), shape=half, padding_mode=ZERO), flat).astype(ct.float32)
    x2 = ct.reshape(ct.load(x, index=(b, s, 0, 1, 0), shape=half, padding_mode=ZERO), flat).astype(ct.float32)
    w1 = ct.reshape(ct.load(w, index=(0, 0, 0), shape=(HP, 1, BLOCK), padding_mode=ZERO), (1, HP * BLOCK))
    w2 = ct.reshape(ct.load(w, index=(0, 1, 0), shape=(HP, 1, BLOCK), padding_mode=ZERO), (1, HP * BLOCK))
    inv_rms = _inv_rms(_sum_sq(x1, x.dtype) + _sum_sq(x2, x.dtype), x.shape[2] * x.shape[3] * x.shape[4], eps)
    # The normed row rounded to the dtype (the q_norm module's output), back to float32 for RoPE.
    heads = (ROWS, HP, BLOCK)
    n1 = ct.reshape(_scale_float(x1, inv_rms, w1.astype(ct.float32), 0.0).astype(x.dtype).astype(ct.float32), heads)
    n2 = ct.reshape(_scale_float(x2, inv_rms, w2.astype(ct.float32), 0.0).astype(x.dtype).astype(ct.float32), heads)
    o1 = _rounded_mul(n1, c1, rdtype) - _rounded_mul(n2, s1, rdtype)
    o2 = _rounded_mul(n2, c2, rdtype) + _rounded_mul(n1, s2, rdtype)
    ct.store(out, index=(b, s, 0, 0, 0), tile=ct.reshape(o1.astype(out.dtype), half))
    ct.store(out, index=(b, s, 0, 1, 0), tile=ct.reshape(o2.astype(out.dtype), half))


@ct.kernel
def qk_norm_rope_olmo2_kernel(q, k, q_weight, k_weight, cos, sin, q_out, k_out, eps: float,
                              BLOCK: ct.Constant[int], HP: ct.Constant[int], ROWS: ct.Constant[int]):
    """OLMo 2's RMSNorm over each token's whole q (or k) row, then RoPE of its heads, for ROWS
    tokens of q or of k per block.

    q, q_out: (B, S, Hq, 2, D/2); k, k_out: (B, S, Hk, 2, D/2); q_weight: (Hq, 2, D/2); k_weight:
    (Hk, 2, D/2); cos, sin: (B or 1, S, 2, D/2); D/2 <= BLOCK, Hq and Hk <= HP. Each op of the
    rotation rounds to cos's dtype (float32 for OLMo 2's). Grid: (cdiv(S, ROWS), 2, B), q's blocks
    at 0 on axis 1, k's at 1.
    """
    s = ct.bid(0)
    which = ct.bid(1)
    b = ct.bid(2)
    c1, c2, s1, s2 = _cos_sin(cos, sin, b, s, BLOCK, ROWS)
    by_head = (ROWS, 1, BLOCK)
    c1, c2, s1, s2 = (ct.reshape(c1, by_head), ct.reshape(c2, by_head), ct.reshape(s1, by_head),
                      ct.reshape(s2, by_head))
    if which == 0:
        _olmo2_norm_rotate(q, q_weight, q_out, b, s, c1, c2, s1, s2, eps, cos.dtype, BLOCK, HP, ROWS)
    else:
        _olmo2_norm_rotate(k, k_weight, k_out, b, s, c1, c2, s1, s2, eps, cos.dtype, BLOCK, HP, ROWS)


# ---------------------------------------------------------------------------------------------
# Build matrix
# ---------------------------------------------------------------------------------------------

# The tiles are rope.py's (BLOCKS: D/2 padded up to 32, 64 or 128, i.e. head_dim <= 256; HEADS
# heads share one block's cos/sin tiles; ROWS positions: 4096 elements of q or k per tile): the
# norm adds only a per-row sum over the same tile.


def _params(dtype: str, layout: str, consts: dict):
    params = [array(a, dtype, 5, layout) for a in ("q", "k")]
    params += [array(a, dtype, 2, layout) for a in ("q_weight", "k_weight")]
    params += [array(a, dtype, 4, layout) for a in ("cos", "sin")]
    params += [array(a, dtype, 5, layout) for a in ("q_out", "k_out")]
    params.append(ScalarParam("eps", "float32"))
    params += [ConstParam(k, v) for k, v in consts.items()]
    return tuple(params)


def _gemma_params(dtype: str, layout: str, consts: dict):
    params = [array(a, dtype, 5, layout) for a in ("q", "k")]
    params += [array(a, dtype, 2, layout) for a in ("q_weight", "k_weight")]
    params += [array(a, dtype, 4, layout) for a in ("cos", "sin")]
    params += [array(a, dtype, 5, layout) for a in ("q_out", "k_out")]
    params += [ScalarParam("eps", "float32"), ScalarParam("offset", "float32")]
    params += [ConstParam(k, v) for k, v in consts.items()]
    return tuple(params)


#: qk_norm_rope_gemma's (BLOCK, CHUNKS) tiles: R/2 padded to BLOCK, D / (R/2) to CHUNKS, the head
#: (BLOCK * CHUNKS) at most 256 wide. Qwen3.5 (D 256, R 64) is (32, 8); Gemma 3 (D 256, full
#: rotary) (128, 2).
GEMMA_TILES = tuple((block, chunks) for block in BLOCKS for chunks in (2, 4, 8) if block * chunks <= 256)
#: Positions per prefill tile: 4096 elements of q or k per tile (HEADS * ROWS * CHUNKS * BLOCK).
GEMMA_ROWS = {(block, chunks): 4096 // (HEADS * block * chunks) for block, chunks in GEMMA_TILES}


def _gemma_matrix() -> list[VariantSpec]:
    specs = []
    for dtype in ("bfloat16", "float16", "float32"):
        for layout in LAYOUTS:
            tiles = [(bc, GEMMA_ROWS[bc]) for bc in GEMMA_TILES]
            if dtype in DECODE_DTYPES:
                tiles += [(bc, 1) for bc in GEMMA_TILES]
            for (block, chunks), rows in tiles:
                consts = {"BLOCK": block, "CHUNKS": chunks, "ROWS": rows, "HEADS": HEADS}
                specs.append(VariantSpec("qk_norm_rope_gemma", "qk_norm_rope", "qk_norm_rope_gemma_kernel",
                                         f"{DTYPE_TAGS[dtype]}.h{block}.c{chunks}.t{HEADS}x{rows}.{layout}",
                                         _gemma_params(dtype, layout, consts)))
    return specs


def _olmo2_params(dtype: str, layout: str, consts: dict):
    # 16-bit q, k, weights and outputs; cos and sin float32 (OLMo 2's rotary embedding returns them so).
    params = [array(a, dtype, 5, layout) for a in ("q", "k")]
    params += [array(a, dtype, 3, layout) for a in ("q_weight", "k_weight")]
    params += [array(a, "float32", 4, layout) for a in ("cos", "sin")]
    params += [array(a, dtype, 5, layout) for a in ("q_out", "k_out")]
    params.append(ScalarParam("eps", "float32"))
    params += [ConstParam(k, v) for k, v in consts.items()]
    return tuple(params)


#: qk_norm_rope_olmo2's (BLOCK, HP) tiles: head halves of 33 to 64 lanes padded to 64 (head_dim 128
#: in every OLMo 2 and OLMo 3 checkpoint) with up to 64 heads padded to 8-64, i.e. q or k rows of up
#: to 8192 (OLMo-2-1B 2048, OLMo-3-7B 4096, 13B and 32B's 40 heads padded to 64). Other head dims
#: take the three launches it replaces.
OLMO2_TILES = tuple((64, hp) for hp in (8, 16, 32, 64))
#: Tokens per prefill tile: about 8192 elements of q or k (ROWS * HP * 2 * BLOCK), at least one.
OLMO2_ROWS = {(block, hp): max(1, 8192 // (2 * block * hp)) for block, hp in OLMO2_TILES}


def _olmo2_matrix() -> list[VariantSpec]:
    specs = []
    for dtype in DECODE_DTYPES:
        for layout in LAYOUTS:
            for block, hp in OLMO2_TILES:
                for rows in sorted({OLMO2_ROWS[(block, hp)], 1}, reverse=True):  # prefill tile, then decode
                    consts = {"BLOCK": block, "HP": hp, "ROWS": rows}
                    specs.append(VariantSpec("qk_norm_rope_olmo2", "qk_norm_rope", "qk_norm_rope_olmo2_kernel",
                                             f"{DTYPE_TAGS[dtype]}.h{block}.p{hp}.r{rows}.{layout}",
                                             _olmo2_params(dtype, layout, consts)))
    return specs


#: Every variant of the three families, in the runtime's order of preference (aligned before generic);
#: qk_norm_rope's 16-bit aligned ones also with programmatic dependent launch, for captured decode steps
#: (kernel_src/_pdl.py).
VARIANTS: list[VariantSpec] = with_pdl(
    tile_matrix("qk_norm_rope", "qk_norm_rope_kernel", _params) + _gemma_matrix() + _olmo2_matrix(),
    ("qk_norm_rope_kernel",))

#: The tiles (BLOCKS, HEADS, ROWS) are rope.py's, exported here as this family's own.
__all__ = ["BLOCKS", "GEMMA_ROWS", "GEMMA_TILES", "HEADS", "OLMO2_ROWS", "OLMO2_TILES", "ROWS", "VARIANTS",
           "qk_norm_rope_gemma_kernel", "qk_norm_rope_kernel", "qk_norm_rope_olmo2_kernel"]
