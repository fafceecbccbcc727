"""Rotary position embedding (RoPE) of q and k in one launch: cuTile device code and build matrix.

Math (Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding"), in the
form and rounding order of transformers' ``apply_rotary_pos_emb`` (models/llama/modeling_llama.py
at v5.22.2), with ``cos``/``sin`` as the model's rotary embedding returns them (already scaled,
in the model dtype). Each row ``x`` of R rotated elements is two halves ``x1 = x[:R/2]``,
``x2 = x[R/2:]``; ``rotate_half(x) = (-x2, x1)``; so, per half::

    out1 = round(round(x1 * cos1) - round(x2 * sin1))
    out2 = round(round(x2 * cos2) + round(x1 * sin2))

where ``round`` rounds to the input dtype, as eager torch rounds each elementwise op (the
products and the sum are separate kernels there; the sum is formed in float32). Both halves of
cos and sin are read (Llama's are equal, but nothing here relies on it).

OLMo 2's ``apply_rotary_pos_emb`` (models/olmo2/modeling_olmo2.py, v5.22.2; OLMo, OLMo 3,
OLMo-hybrid, FlexOlmo and Beam copy it) takes float32 cos/sin with 16-bit q and k: torch promotes, so every op above
rounds to float32, and the result is cast back to the input's dtype. The kernel rounds to cos's
dtype (the promoted one: cos is q's dtype or float32) and stores in the output's, so the variants
with float32 cos/sin and 16-bit outputs compute that formula.

Layout handed to the kernel: the host views the last dimension of q, k (``(B, H, S, R)``) and of
cos, sin (``(B or 1, S, R)``) as ``(2, R/2)``, so a half is a tile along the last axis and the
kernel never gathers. ``R/2`` is loaded as the next power of two with zero padding; the padded
lanes are masked on store. Strides are arbitrary (transformers passes transposed views).

Partial rotary (``R < D``, Phi-4-mini's 96 of 128): the halves views cover the first R elements;
``rope_pass_kernel`` and ``rope_append_pass_kernel`` also take ``(..., D - R)`` views of the rest
and copy them in the same launch (the GPT-NeoX convention transformers' partial-rotary models use).
"""

from __future__ import annotations

import cuda.tile as ct

from ._spec import DECODE_DTYPES, DTYPE_TAGS, LAYOUTS, ArrayParam, ConstParam, VariantSpec, array

ZERO = ct.PaddingMode.ZERO


@ct.function
def _rounded_mul(a, b, dtype):
    # One product rounded to `dtype`, as torch's elementwise mul. For 16-bit inputs the float32
    # product of two 16-bit values is exact, so one rounding remains. For float32 the product is
    # formed exactly in float64 and rounded once: a float32 multiply feeding the add would be
    # contracted into an FMA by cuTile, which rounds differently from torch's two kernels.
    if dtype == ct.float32:
        return (a.astype(ct.float64) * b.astype(ct.float64)).astype(ct.float32)
    else:
        return (a * b).astype(dtype).astype(ct.float32)


@ct.function
def _rotate(x, out, b, h, s, os, c1, c2, s1, s2, rdtype, BLOCK: ct.Constant[int], ROWS: ct.Constant[int],
            HEADS: ct.Constant[int]):
    # x: (B, H, S, 2, R/2), out: (B, H, S or L, 2, R/2); (b, h, s) index tiles of (1, HEADS, ROWS) of
    # x, (b, h, os) of out; c*, s*: (1, ROWS, BLOCK) float32 tiles of cos and sin, shared by the
    # HEADS heads; rdtype: what each op rounds to.
    shape = (1, HEADS, ROWS, 1, BLOCK)
    x1 = ct.reshape(ct.load(x, index=(b, h, s, 0, 0), shape=shape, padding_mode=ZERO),
                    (HEADS, ROWS, BLOCK)).astype(ct.float32)
    x2 = ct.reshape(ct.load(x, index=(b, h, s, 1, 0), shape=shape, padding_mode=ZERO),
                    (HEADS, ROWS, BLOCK)).astype(ct.float32)
    o1 = _rounded_mul(x1, c1, rdtype) - _rounded_mul(x2, s1, rdtype)
    o2 = _rounded_mul(x2, c2, rdtype) + _rounded_mul(x1, s2, rdtype)
    ct.store(out, index=(b, h, os, 0, 0), tile=ct.reshape(o1.astype(out.dtype), shape))
    ct.store(out, index=(b, h, os, 1, 0), tile=ct.reshape(o2.astype(out.dtype), shape))


@ct.function
def _half(t, b, s, i, BLOCK: ct.Constant[int], ROWS: ct.Constant[int]):
    # Half `i` of ROWS positions of cos or sin ((B or 1, S, 2, R/2)) as a float32 (1, ROWS, BLOCK) tile.
    tile = ct.load(t, index=(b, s, i, 0), shape=(1, ROWS, 1, BLOCK), padding_mode=ZERO)
    return ct.reshape(tile, (1, ROWS, BLOCK)).astype(ct.float32)


@ct.function
def _cos_sin(cos, sin, b, s, BLOCK: ct.Constant[int], ROWS: ct.Constant[int]):
    # The halves (cos1, cos2, sin1, sin2) of ROWS positions' cos/sin for batch row b as float32
    # (1, ROWS, BLOCK) tiles; cos/sin of batch 1 serve every row (position_ids of batch 1).
    cb = b % cos.shape[0]
    return (_half(cos, cb, s, 0, BLOCK, ROWS), _half(cos, cb, s, 1, BLOCK, ROWS),
            _half(sin, cb, s, 0, BLOCK, ROWS), _half(sin, cb, s, 1, BLOCK, ROWS))


@ct.kernel
def rope_kernel(q, k, cos, sin, q_out, k_out, BLOCK: ct.Constant[int], ROWS: ct.Constant[int],
                HEADS: ct.Constant[int]):
    """Rotate ROWS positions of HEADS heads of q or of k per block.

    q, q_out: (B, Hq, S, 2, R/2); k, k_out: (B, Hkv, S, 2, R/2); cos, sin: (B or 1, S, 2, R/2);
    R/2 <= BLOCK. Grid: (cdiv(S, ROWS), cdiv(Hq, HEADS) + cdiv(Hkv, HEADS), B); the first
    cdiv(Hq, HEADS) head tiles are q's, the rest k's. The cos/sin tiles are loaded once per block
    and serve all its heads. Each op rounds to cos's dtype (q's, or float32 for OLMo 2's formula).
    """
    s = ct.bid(0)
    h = ct.bid(1)
    b = ct.bid(2)
    c1, c2, s1, s2 = _cos_sin(cos, sin, b, s, BLOCK, ROWS)
    q_tiles = ct.cdiv(q.shape[1], HEADS)
    if h < q_tiles:
        _rotate(q, q_out, b, h, s, s, c1, c2, s1, s2, cos.dtype, BLOCK, ROWS, HEADS)
    else:
        _rotate(k, k_out, b, h - q_tiles, s, s, c1, c2, s1, s2, cos.dtype, BLOCK, ROWS, HEADS)


@ct.function
def _append_rotated(k, v, keys, values, b, hk, s, slot, c1, c2, s1, s2, rdtype, BLOCK: ct.Constant[int],
                    ROWS: ct.Constant[int], HEADS: ct.Constant[int]):
    # The rotated k and the unchanged v of tile (b, hk, s) into the cache's slot tile `slot`.
    _rotate(k, keys, b, hk, s, slot, c1, c2, s1, s2, rdtype, BLOCK, ROWS, HEADS)
    shape = (1, HEADS, ROWS, 2, BLOCK)
    ct.store(values, index=(b, hk, slot, 0, 0), tile=ct.load(v, index=(b, hk, s, 0, 0), shape=shape,
                                                              padding_mode=ZERO))


@ct.kernel
def rope_append_kernel(q, k, v, cos, sin, keys, values, length, q_out, BLOCK: ct.Constant[int],
                       ROWS: ct.Constant[int], HEADS: ct.Constant[int]):
    """RoPE of q and k as :func:`rope_kernel`, with the rotated k and the unchanged v written into a
    static KV cache at the device-side length (``kernel_src/kv_cache.py``'s slots) instead of a
    k_out: the decode step's RoPE and cache write in one launch.

    q, q_out: (B, Hq, S, 2, D/2); k, v: (B, Hkv, S, 2, D/2); cos, sin: (B or 1, S, 2, D/2) (the
    whole head rotated: R = D); keys, values: (B, Hkv, L, 2, D/2), the cache; length: (1,) int64,
    the slot of position 0. ROWS must be 1 (a block's tile is one position, so that a slot is a tile
    index); slots >= L are not written. Grid: (S, cdiv(Hq, HEADS) + cdiv(Hkv, HEADS), B).
    """
    s = ct.bid(0)
    h = ct.bid(1)
    b = ct.bid(2)
    c1, c2, s1, s2 = _cos_sin(cos, sin, b, s, BLOCK, ROWS)
    q_tiles = ct.cdiv(q.shape[1], HEADS)
    if h < q_tiles:
        _rotate(q, q_out, b, h, s, s, c1, c2, s1, s2, cos.dtype, BLOCK, ROWS, HEADS)
    else:
        hk = h - q_tiles
        slot = ct.gather(length, 0).astype(ct.int32) + s
        if slot < keys.shape[2]:  # a tile wholly past the cache's end is not stored (undefined)
            _append_rotated(k, v, keys, values, b, hk, s, slot, c1, c2, s1, s2, cos.dtype, BLOCK, ROWS, HEADS)


@ct.function
def _pass(x, out, b, h, s, os, ROWS: ct.Constant[int], HEADS: ct.Constant[int], PBLOCK: ct.Constant[int]):
    # Partial rotary: the P = D - R elements of each head after the rotated ones, copied unchanged.
    # x: (B, H, S, P), out: (B, H, S or L, P); (b, h, s) index tiles of (1, HEADS, ROWS) of x,
    # (b, h, os) of out. P is loaded as PBLOCK lanes with zero padding; the padding is not stored.
    shape = (1, HEADS, ROWS, PBLOCK)
    ct.store(out, index=(b, h, os, 0), tile=ct.load(x, index=(b, h, s, 0), shape=shape, padding_mode=ZERO))


@ct.kernel
def rope_pass_kernel(q, k, cos, sin, q_pass, k_pass, q_out, k_out, q_pass_out, k_pass_out, BLOCK: ct.Constant[int],
                     ROWS: ct.Constant[int], HEADS: ct.Constant[int], PBLOCK: ct.Constant[int]):
    """:func:`rope_kernel` for partial rotary (``R < D``), the pass-through elements copied in the
    same launch: q, k, q_out, k_out are the ``(..., 2, R/2)`` halves views of the first R elements
    of each head (as there); q_pass, k_pass, q_pass_out, k_pass_out ``(B, H, S, D - R)`` views of
    the rest, ``D - R <= PBLOCK``. Grid as :func:`rope_kernel`'s."""
    s = ct.bid(0)
    h = ct.bid(1)
    b = ct.bid(2)
    c1, c2, s1, s2 = _cos_sin(cos, sin, b, s, BLOCK, ROWS)
    q_tiles = ct.cdiv(q.shape[1], HEADS)
    if h < q_tiles:
        _rotate(q, q_out, b, h, s, s, c1, c2, s1, s2, cos.dtype, BLOCK, ROWS, HEADS)
        _pass(q_pass, q_pass_out, b, h, s, s, ROWS, HEADS, PBLOCK)
    else:
        _rotate(k, k_out, b, h - q_tiles, s, s, c1, c2, s1, s2, cos.dtype, BLOCK, ROWS, HEADS)
        _pass(k_pass, k_pass_out, b, h - q_tiles, s, s, ROWS, HEADS, PBLOCK)


@ct.kernel
def rope_append_pass_kernel(q, k, v, cos, sin, keys, values, length, q_pass, k_pass, v_pass, keys_pass, values_pass,
                            q_out, q_pass_out, BLOCK: ct.Constant[int], ROWS: ct.Constant[int],
                            HEADS: ct.Constant[int], PBLOCK: ct.Constant[int]):
    """:func:`rope_append_kernel` for partial rotary (``R < D``): q, k, v, keys, values, q_out are
    the ``(..., 2, R/2)`` halves views of the first R elements of each head; q_pass, k_pass, v_pass,
    keys_pass, values_pass, q_pass_out ``(..., D - R)`` views of the rest (``D - R <= PBLOCK``),
    copied unchanged (k's and v's into the cache at the same slots). ROWS must be 1; slots ``>= L``
    are not written. Grid as :func:`rope_append_kernel`'s."""
    s = ct.bid(0)
    h = ct.bid(1)
    b = ct.bid(2)
    c1, c2, s1, s2 = _cos_sin(cos, sin, b, s, BLOCK, ROWS)
    q_tiles = ct.cdiv(q.shape[1], HEADS)
    if h < q_tiles:
        _rotate(q, q_out, b, h, s, s, c1, c2, s1, s2, cos.dtype, BLOCK, ROWS, HEADS)
        _pass(q_pass, q_pass_out, b, h, s, s, ROWS, HEADS, PBLOCK)
    else:
        hk = h - q_tiles
        slot = ct.gather(length, 0).astype(ct.int32) + s
        if slot < keys.shape[2]:
            _append_rotated(k, v, keys, values, b, hk, s, slot, c1, c2, s1, s2, cos.dtype, BLOCK, ROWS, HEADS)
            _pass(k_pass, keys_pass, b, hk, s, slot, ROWS, HEADS, PBLOCK)
            _pass(v_pass, values_pass, b, hk, s, slot, ROWS, HEADS, PBLOCK)


# ---------------------------------------------------------------------------------------------
# Build matrix
# ---------------------------------------------------------------------------------------------

#: Per array, the dimensions every tile of this family's kernels indexes with extent 1 (see
#: ``registry.ArrayCheck``'s int32 bound): the batch everywhere, and the half index of the rotated
#: arrays (each half is its own tile). The cache's slot dim is not declared: the append tiles are one
#: position, but its stride is below the head's, which the bound counts anyway.
ARRAY_FLAT_DIMS = {**{a: (0, 3) for a in ("q", "k", "q_out", "k_out", "keys")},
                   **{a: (0,) for a in ("v", "values", "q_pass", "k_pass", "v_pass", "q_pass_out", "k_pass_out",
                                        "keys_pass", "values_pass")}}

#: Half-widths built (R/2 padded up to one of them): 32 serves head_dim <= 64, 64 serves 80, 96
#: and 128, 128 serves 256. Wider rotary dims take the PyTorch path.
BLOCKS = (32, 64, 128)
#: Heads per tile: the block's cos/sin tiles are read once for all of them (cos and sin are half
#: of q's bytes per position at 4 heads, twice them at 1).
HEADS = 4
#: Positions per tile: 4096 elements of q or k per tile (HEADS * ROWS * 2 * BLOCK).
ROWS = {32: 16, 64: 8, 128: 4}


def _params(dtype: str, layout: str, consts: dict, cos_dtype: str | None = None):
    params = [array(a, dtype, 5, layout) for a in ("q", "k")]
    params += [array(a, cos_dtype or dtype, 4, layout) for a in ("cos", "sin")]
    params += [array(a, dtype, 5, layout) for a in ("q_out", "k_out")]
    params += [ConstParam(k, v) for k, v in consts.items()]
    return tuple(params)


def _float_cos_params(dtype: str, layout: str, consts: dict):
    # OLMo 2's formula: 16-bit q, k and outputs, float32 cos and sin.
    return _params(dtype, layout, consts, cos_dtype="float32")


def tile_matrix(kernel: str, function: str, params, dtypes=("bfloat16", "float16", "float32"),
                dtype_suffix: str = "") -> list[VariantSpec]:
    """The variants of ``kernel`` (module of the same name) on these tiles: every dtype of
    ``dtypes``, layout (aligned before generic, the runtime's order of preference) and BLOCK, with
    ``params(dtype, layout, consts)`` its parameters and ``dtype_suffix`` after the dtype in their
    tags (another operand's dtype); for
    :data:`~._spec.DECODE_DTYPES` also a decode tile of one position (``ROWS=1``) per BLOCK, which
    the runtime asks for when S is below the prefill tile's rows. qk_norm_rope's kernel shares the
    tiles, so it shares this."""
    specs = []
    for dtype in dtypes:
        for layout in LAYOUTS:
            tiles = [(block, ROWS[block]) for block in BLOCKS]
            if dtype in DECODE_DTYPES:
                tiles += [(block, 1) for block in BLOCKS]
            for block, rows in tiles:
                consts = {"BLOCK": block, "ROWS": rows, "HEADS": HEADS}
                specs.append(VariantSpec(kernel, kernel, function,
                                         f"{DTYPE_TAGS[dtype]}{dtype_suffix}.h{block}.t{HEADS}x{rows}.{layout}",
                                         params(dtype, layout, consts)))
    return specs


def _append_params(dtype: str, layout: str, consts: dict):
    # q, k, v, cos, sin, keys, values, length, q_out, all but the length in ``layout`` (a head half
    # not a multiple of 16 elements, e.g. head_dim 80, takes the generic one).
    params = [array(a, dtype, 5, layout) for a in ("q", "k", "v")]
    params += [array(a, dtype, 4, layout) for a in ("cos", "sin")]
    params += [array(a, dtype, 5, layout) for a in ("keys", "values")]
    params += [ArrayParam("length", "int64", 1), array("q_out", dtype, 5, layout)]
    params += [ConstParam(k, v) for k, v in consts.items()]
    return tuple(params)


#: The decode tiles (one position a block) of :func:`rope_append_kernel`, per dtype, layout and BLOCK.
APPEND_VARIANTS: list[VariantSpec] = [
    VariantSpec("rope_append", "rope", "rope_append_kernel", f"{DTYPE_TAGS[dtype]}.h{block}.t{HEADS}x1.{layout}",
                _append_params(dtype, layout, {"BLOCK": block, "ROWS": 1, "HEADS": HEADS}))
    for dtype in DECODE_DTYPES for layout in LAYOUTS for block in BLOCKS
]

#: Partial rotary in one launch: the half-widths built (R <= 128: Phi-4-mini's 96 of 128) and the
#: pass-through lanes (D - R <= 32: Phi-4-mini's 32). Other partial layouts copy the pass-through
#: with two ``copy_`` launches after the RoPE kernel.
PASS_BLOCKS = (32, 64)
PBLOCK = 32


def _pass_params(dtype: str, layout: str, consts: dict):
    # Inputs before outputs (the runtime's aliasing check covers the leading inputs): q, k, cos,
    # sin, the pass-through views q_pass, k_pass (B, H, S, D - R), then q_out, k_out, q_pass_out,
    # k_pass_out.
    rot = _params(dtype, layout, {})
    passes = {a: array(a, dtype, 4, layout) for a in ("q_pass", "k_pass", "q_pass_out", "k_pass_out")}
    params = [*rot[:4], passes["q_pass"], passes["k_pass"], *rot[4:6], passes["q_pass_out"], passes["k_pass_out"]]
    return tuple(params + [ConstParam(k, v) for k, v in consts.items()])


def _append_pass_params(dtype: str, layout: str, consts: dict):
    # rope_append's q, k, v, cos, sin, keys, values, length, the pass-through views q_pass, k_pass,
    # v_pass, keys_pass, values_pass, then the outputs q_out and q_pass_out.
    rot = _append_params(dtype, layout, {})
    passes = [array(a, dtype, 4, layout) for a in ("q_pass", "k_pass", "v_pass", "keys_pass", "values_pass")]
    params = [*rot[:8], *passes, rot[8], array("q_pass_out", dtype, 4, layout)]
    return tuple(params + [ConstParam(k, v) for k, v in consts.items()])


#: The partial-rotary variants of rope (prefill and decode tiles) and rope_append (decode tiles),
#: per 16-bit dtype, layout and BLOCK.
PASS_VARIANTS: list[VariantSpec] = [
    VariantSpec("rope_pass", "rope", "rope_pass_kernel",
                f"{DTYPE_TAGS[dtype]}.h{block}.p{PBLOCK}.t{HEADS}x{rows}.{layout}",
                _pass_params(dtype, layout, {"BLOCK": block, "ROWS": rows, "HEADS": HEADS, "PBLOCK": PBLOCK}))
    for dtype in DECODE_DTYPES for layout in LAYOUTS for block in PASS_BLOCKS for rows in (ROWS[block], 1)
] + [
    VariantSpec("rope_append_pass", "rope", "rope_append_pass_kernel",
                f"{DTYPE_TAGS[dtype]}.h{block}.p{PBLOCK}.t{HEADS}x1.{layout}",
                _append_pass_params(dtype, layout, {"BLOCK": block, "ROWS": 1, "HEADS": HEADS, "PBLOCK": PBLOCK}))
    for dtype in DECODE_DTYPES for layout in LAYOUTS for block in PASS_BLOCKS
]

#: Every variant of this family, in the runtime's order of preference (aligned before generic).
#: OLMo 2's float32 cos/sin after them (the runtime takes the first whose dtypes fit).
VARIANTS: list[VariantSpec] = (tile_matrix("rope", "rope_kernel", _params)
                               + tile_matrix("rope", "rope_kernel", _float_cos_params, ("bfloat16", "float16"), "c32")
                               + APPEND_VARIANTS + PASS_VARIANTS)
