"""The gated delta rule (gated DeltaNet's linear attention): cuTile device code and build matrix.

Math (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule",
arXiv:2412.06464; transformers' ``torch_recurrent_gated_delta_rule`` and
``torch_chunk_gated_delta_rule``, models/qwen3_5/modeling_qwen3_5.py at v5.22.2). Per (batch,
head), with q and k L2-normalised (``x * rsqrt(sum(x^2) + 1e-6)``), q scaled by ``dk ** -0.5`` and
a state ``S`` of shape (dk, dv) in float32, for each token t::

    S   = S * exp(g_t)                       # g: log decay, <= 0
    S   = S + k_t (beta_t (v_t - S^T k_t))^T  # the delta rule: write the correction only
    o_t = S^T q_t

``gated_delta_recurrent_kernel`` runs that loop token by token (decode: one token, the state
updated in place). The chunked path computes the same over chunks of ``BT`` tokens (the UT / WY
form of the DeltaNet paper, Yang et al. 2024, arXiv:2406.06484) in two kernels:
``gated_delta_prepare_kernel`` does each chunk's state-free part, all chunks in parallel (w, u,
attn below, to float32 work buffers), ``gated_delta_scan_kernel`` walks the chunks in order with
the state. Inside a chunk, with ``c = cumsum(g)`` and ``D_ij = exp(c_i - c_j)`` for ``i >= j``::

    A    = strictly_lower((k * beta) k^T * D)        T = (I + A)^-1 (blocked forward substitution)
    w    = T ((k * beta) * exp(c))                   u = T (v * beta)      attn = lower(q k^T * D)
    v'   = u - w S                                   o = (q * exp(c)) S + attn v'
    S    = S * exp(c_last) + (k * exp(c_last - c))^T v'

The chunk's products run on the tensor cores with tf32 operands and float32 accumulation (the
reference computes in float32; flash-linear-attention rounds the same operands to bfloat16); the
triangular inverse's small products and the recurrent kernel stay in float32.
A head's value columns are independent, so a block owns ``BV`` of them and the grid spreads a
head over ``dv / BV`` blocks; q and k are padded to ``DK`` lanes with zeros (zero lanes add
nothing). Rows past the sequence load as zeros with ``beta = g = 0``: they change neither the
state nor the decay, and are not stored.

``gated_delta_gates_kernel`` computes the two gates from the model's projections in one launch,
as Qwen3.5's ``Qwen3_5GatedDeltaNet.forward`` does in eight (``beta = b.sigmoid()``, ``g =
-A_log.float().exp() * F.softplus(a.float() + dt_bias)``): float32 throughout, beta rounded once.
"""

from __future__ import annotations

import cuda.tile as ct

from ._spec import DTYPE_TAGS, LAYOUTS, ArrayParam, ConstParam, ScalarParam, VariantSpec, array

ZERO = ct.PaddingMode.ZERO
RN = ct.RoundingMode.RN
#: transformers' (and flash-linear-attention's) epsilon inside the L2 norm of q and k.
L2_EPS = 1e-6


#: Per array, the dimensions every tile indexes with extent 1 (batch and head; see
#: ``registry.ArrayCheck``'s int32 bound). g and beta are (B, T, H) in the delta-rule kernels but
#: (rows, H) tiles of ROWS rows in the gates kernel: declared for those three kernels only.
ARRAY_FLAT_DIMS = {**{a: (0, 2) for a in ("q", "k", "v", "o", "w", "u")}, "state": (0, 1), "attn": (0, 1),
                   **{(f"gated_delta_{kernel}_kernel", a): (0, 2) for kernel in ("recurrent", "prepare", "scan")
                      for a in ("g", "beta")}}


@ct.function
def _l2_normalize(x):
    # Rows of a float32 (R, DK) tile over the last axis: x * rsqrt(sum(x^2) + 1e-6).
    return x * ct.rsqrt(ct.sum(x * x, axis=1, keepdims=True) + L2_EPS)


@ct.function
def _head_rows(arr, b, t, h, R: ct.Constant[int], D: ct.Constant[int], d):
    # Rows [t * R, t * R + R) of arr[b, :, h, d * D : d * D + D] as a float32 (R, D) tile.
    tile = ct.load(arr, index=(b, t, h, d), shape=(1, R, 1, D), padding_mode=ZERO)
    return ct.reshape(tile, (R, D)).astype(ct.float32)


@ct.function
def _head_gates(arr, b, t, h, R: ct.Constant[int]):
    # Rows [t * R, t * R + R) of arr[b, :, h] (g or beta) as a float32 (R, 1) tile.
    tile = ct.load(arr, index=(b, t, h), shape=(1, R, 1), padding_mode=ZERO)
    return ct.reshape(tile, (R, 1)).astype(ct.float32)


# Small blocks, many of them: a head's 128 value columns over 16 blocks of 8 (a decode step has
# only B x H heads of work), each block's (128, 8) state in registers.
@ct.kernel(occupancy=16)
def gated_delta_recurrent_kernel(q, k, v, g, beta, state, o, scale: float,
                                 DK: ct.Constant[int], BV: ct.Constant[int]):
    """The gated delta rule token by token; the state read and written in place.

    q, k: (B, T, H, dk); v, o: (B, T, H, dv); g (float32, log decay) and beta: (B, T, H); state:
    (B, H, dk, dv) float32. Any strides. Grid: (cdiv(dv, BV), B * H).
    """
    vb = ct.bid(0)
    b = ct.bid(1) // state.shape[1]
    h = ct.bid(1) % state.shape[1]
    s = ct.reshape(ct.load(state, index=(b, h, 0, vb), shape=(1, 1, DK, BV), padding_mode=ZERO), (DK, BV))
    for t in range(q.shape[1]):
        qt = ct.reshape(_l2_normalize(_head_rows(q, b, t, h, 1, DK, 0)) * scale, (DK, 1))
        kt = ct.reshape(_l2_normalize(_head_rows(k, b, t, h, 1, DK, 0)), (DK, 1))
        vt = _head_rows(v, b, t, h, 1, BV, vb)
        s = s * ct.exp(_head_gates(g, b, t, h, 1))
        delta = (vt - ct.sum(s * kt, axis=0, keepdims=True)) * _head_gates(beta, b, t, h, 1)
        s = s + kt * delta
        ot = ct.sum(s * qt, axis=0, keepdims=True)
        ct.store(o, index=(b, t, h, vb), tile=ct.reshape(ot.astype(o.dtype), (1, 1, 1, BV)))
    ct.store(state, index=(b, h, 0, vb), tile=ct.reshape(s, (1, 1, DK, BV)))


@ct.function
def _mm(x, y, M: ct.Constant[int], N: ct.Constant[int]):
    # x @ y for float32 tiles on the tensor cores: operands rounded to tf32 (10-bit mantissa),
    # products accumulated in float32.
    return ct.mma(x.astype(ct.tfloat32), y.astype(ct.tfloat32), ct.zeros((M, N), dtype=ct.float32))


@ct.function
def _unit_lower_inverse(a, a_diag, BT: ct.Constant[int], SB: ct.Constant[int]):
    # (I + a)^-1 for a strictly lower triangular float32 (BT, BT) tile whose SB x SB diagonal
    # blocks are also given batched, a_diag (BT // SB, SB, SB). Forward substitution inverts every
    # diagonal block at once (a runtime loop over rows: a small kernel to compile), then block rows
    # top to bottom: T_i = (I + a_ii)^-1 (E_i - a[i, :i] T[:i]).
    rs = ct.reshape(ct.arange(SB, dtype=ct.int32), (1, SB, 1))
    cs = ct.reshape(ct.arange(SB, dtype=ct.int32), (1, 1, SB))
    eye = ct.broadcast_to((rs == cs).astype(ct.float32), (BT // SB, SB, SB))
    t_diag = eye
    for j in range(1, SB):
        t_diag = ct.where(rs == j, eye - a_diag @ t_diag, t_diag)
    r2 = ct.reshape(ct.arange(SB, dtype=ct.int32), (SB, 1))
    cols = ct.reshape(ct.arange(BT, dtype=ct.int32), (1, BT))
    inv = ct.zeros((BT, BT), dtype=ct.float32)
    for i in ct.static_iter(range(BT // SB)):
        t_ii = ct.reshape(ct.extract(t_diag, (i, 0, 0), shape=(1, SB, SB)), (SB, SB))
        # a[i, :i]: the block row left of the diagonal block (all of it zero for the first).
        a_i = ct.where(cols < i * SB, ct.extract(a, (i, 0), shape=(SB, BT)), 0.0)
        rows = (cols == r2 + i * SB).astype(ct.float32) - a_i @ inv
        inv = ct.insert(inv, (i, 0), t_ii @ rows)
    return inv


@ct.function
def _chunk_decay(g, b, c, h, BT: ct.Constant[int]):
    # The chunk's cumulative log decay (BT, 1), its last value (1, 1), and D (BT, BT) with
    # D_ij = exp(cum_i - cum_j) for i >= j, else 0 (exp only there: above the diagonal the
    # difference is positive and may overflow).
    rows = ct.reshape(ct.arange(BT, dtype=ct.int32), (BT, 1))
    cols = ct.reshape(ct.arange(BT, dtype=ct.int32), (1, BT))
    cum = ct.cumsum(_head_gates(g, b, c, h, BT), axis=0)
    last = ct.sum(ct.where(rows == BT - 1, cum, 0.0), axis=0, keepdims=True)
    decay = ct.where(rows >= cols, ct.exp(ct.where(rows >= cols, cum - ct.transpose(cum), 0.0)), 0.0)
    return cum, last, decay


@ct.kernel
def gated_delta_prepare_kernel(q, k, v, g, beta, w, u, attn, scale: float,
                               DK: ct.Constant[int], DV: ct.Constant[int], BT: ct.Constant[int],
                               SB: ct.Constant[int]):
    """What each chunk computes without the state (module doc), all chunks in parallel:
    w = T ((k * beta) * exp(c)), u = T (v * beta) and attn = lower(q k^T * D).

    q, k: (B, T, H, dk); v: (B, T, H, dv); g (float32), beta: (B, T, H); w: (B, T, H, dk),
    u: (B, T, H, dv) and attn: (B, H, T, BT), all float32 (T rounded up to BT for attn). Grid:
    (cdiv(T, BT), B * H).
    """
    c = ct.bid(0)
    b = ct.bid(1) // q.shape[2]
    h = ct.bid(1) % q.shape[2]
    rows = ct.reshape(ct.arange(BT, dtype=ct.int32), (BT, 1))
    cols = ct.reshape(ct.arange(BT, dtype=ct.int32), (1, BT))
    qc = _l2_normalize(_head_rows(q, b, c, h, BT, DK, 0)) * scale
    kc = _l2_normalize(_head_rows(k, b, c, h, BT, DK, 0))
    bc = _head_gates(beta, b, c, h, BT)
    cum, last, decay = _chunk_decay(g, b, c, h, BT)
    kt = ct.transpose(kc)
    kb = kc * bc
    a = ct.where(rows > cols, _mm(kb, kt, BT, BT) * decay, 0.0)
    # The same products on the diagonal blocks, batched (BT // SB, SB, SB) for the inverse.
    cum3 = ct.reshape(cum, (BT // SB, SB, 1))
    below = ct.reshape(ct.arange(SB, dtype=ct.int32), (1, SB, 1)) > ct.reshape(ct.arange(SB, dtype=ct.int32),
                                                                                (1, 1, SB))
    d3 = ct.where(below, ct.exp(ct.where(below, cum3 - ct.permute(cum3, (0, 2, 1)), 0.0)), 0.0)
    a_diag = (ct.reshape(kb, (BT // SB, SB, DK)) @ ct.permute(ct.reshape(kc, (BT // SB, SB, DK)), (0, 2, 1))) * d3
    inv = _unit_lower_inverse(a, a_diag, BT, SB)
    ct.store(w, index=(b, c, h, 0), tile=ct.reshape(_mm(inv, kb * ct.exp(cum), BT, DK), (1, BT, 1, DK)))
    vb = _head_rows(v, b, c, h, BT, DV, 0) * bc
    ct.store(u, index=(b, c, h, 0), tile=ct.reshape(_mm(inv, vb, BT, DV), (1, BT, 1, DV)))
    ct.store(attn, index=(b, h, c, 0), tile=ct.reshape(_mm(qc, kt, BT, BT) * decay, (1, 1, BT, BT)))


@ct.kernel
def gated_delta_scan_kernel(q, k, g, w, u, attn, state, o, scale: float,
                            DK: ct.Constant[int], BV: ct.Constant[int], BT: ct.Constant[int]):
    """The chunks in order, carrying the state (module doc): v' = u - w S; o = (q * exp(c)) S +
    attn v'; S = S * exp(c_last) + (k * exp(c_last - c))^T v'. The state read at the start and
    overwritten with the final state.

    Shapes as gated_delta_prepare_kernel; state: (B, H, dk, dv) float32; o: (B, T, H, dv). Grid:
    (cdiv(dv, BV), B * H).
    """
    vb = ct.bid(0)
    b = ct.bid(1) // state.shape[1]
    h = ct.bid(1) % state.shape[1]
    s = ct.reshape(ct.load(state, index=(b, h, 0, vb), shape=(1, 1, DK, BV), padding_mode=ZERO), (DK, BV))
    for c in range(ct.cdiv(q.shape[1], BT)):
        qc = _l2_normalize(_head_rows(q, b, c, h, BT, DK, 0)) * scale
        kc = _l2_normalize(_head_rows(k, b, c, h, BT, DK, 0))
        cum, last, decay = _chunk_decay(g, b, c, h, BT)
        v_new = _head_rows(u, b, c, h, BT, BV, vb) - _mm(_head_rows(w, b, c, h, BT, DK, 0), s, BT, BV)
        a = ct.reshape(ct.load(attn, index=(b, h, c, 0), shape=(1, 1, BT, BT), padding_mode=ZERO), (BT, BT))
        out = _mm(qc * ct.exp(cum), s, BT, BV) + _mm(a, v_new, BT, BV)
        ct.store(o, index=(b, c, h, vb), tile=ct.reshape(out.astype(o.dtype), (1, BT, 1, BV)))
        s = s * ct.exp(last) + _mm(ct.transpose(kc * ct.exp(last - cum)), v_new, DK, BV)
    ct.store(state, index=(b, h, 0, vb), tile=ct.reshape(s, (1, 1, DK, BV)))


@ct.function
def _log1p(x):
    # log(1 + x) for x >= 0, accurate where 1 + x rounds (Goldberg 1991, "What every computer
    # scientist should know about floating-point arithmetic", theorem 4): cuTile has no log1p.
    u = 1.0 + x
    d = u - 1.0
    return ct.where(d == 0.0, x, ct.log(u) * ct.truediv(x, ct.where(d == 0.0, 1.0, d), rounding_mode=RN))


@ct.kernel
def gated_delta_gates_kernel(a, b, a_log, dt_bias, g, beta, ROWS: ct.Constant[int], BH: ct.Constant[int]):
    """Gated DeltaNet's gates for ROWS tokens per block, all heads at once::

        g    = -exp(a_log) * softplus(a + dt_bias)     # float32; softplus(x) = x above 20
        beta = sigmoid(b)                              # float32, rounded to beta's dtype

    a, b, beta: (M, H); g: (M, H) float32; a_log, dt_bias: (H,); H <= BH. Grid: (cdiv(M, ROWS),).
    """
    bid = ct.bid(0)
    x = ct.load(a, index=(bid, 0), shape=(ROWS, BH), padding_mode=ZERO).astype(ct.float32)
    z = ct.load(b, index=(bid, 0), shape=(ROWS, BH), padding_mode=ZERO).astype(ct.float32)
    decay = ct.exp(ct.load(a_log, index=(0,), shape=(BH,), padding_mode=ZERO).astype(ct.float32))
    bias = ct.load(dt_bias, index=(0,), shape=(BH,), padding_mode=ZERO).astype(ct.float32)
    x = x + ct.reshape(bias, (1, BH))
    # torch's softplus (beta 1, threshold 20); the clamp keeps exp finite in the unselected lanes
    # and a NaN a NaN (ct.minimum would drop it).
    softplus = ct.where(x > 20.0, x, _log1p(ct.exp(ct.where(x > 20.0, 20.0, x))))
    ct.store(g, index=(bid, 0), tile=(-ct.reshape(decay, (1, BH)) * softplus).astype(g.dtype))
    ct.store(beta, index=(bid, 0), tile=ct.truediv(1.0, 1.0 + ct.exp(-z), rounding_mode=RN).astype(beta.dtype))


# ---------------------------------------------------------------------------------------------
# Build matrix
# ---------------------------------------------------------------------------------------------

#: Padded key (and value) head dim built: Qwen3.5 and Qwen3-Next use 128; smaller ones pad to it.
KEY_DIMS = (128,)
#: Value columns per block of the chunked kernel (a head of 128 over 4 blocks) and of the
#: token-by-token one (over 16).
BV, RECURRENT_BV = 32, 8
#: Tokens per chunk of the chunked pair (on the H200, 1x2048 over Qwen3.5's 16 heads: 0.77 ms with
#: 32, 1.10 ms with 64), and rows of the triangular inverse's diagonal blocks.
CHUNK, CHUNKS, SUB = 32, (32,), 16
#: The token-by-token kernel's dtypes; the chunked kernel (the slow compile) is built for the
#: 16-bit ones models prefill in (float32 sequences take the reference, announced).
DTYPES = ("bfloat16", "float16", "float32")
CHUNK_DTYPES = ("bfloat16", "float16")


def _arrays(dtype: str, layout: str, names: str) -> tuple:
    # q/k/v are column slices of the convolution's output, g is float32 (computed from A_log and
    # dt_bias in float32 by the model), beta in the activations' dtype; w, u and attn are the
    # chunked path's float32 work buffers (contiguous). "aligned": q/k/v/o and the state with the
    # last dimension contiguous and rows 16-byte aligned (the model's layout: slices at multiples
    # of 128 columns of a contiguous projection; the cache's contiguous state); "generic": any.
    kinds = {"q": (dtype, layout), "k": (dtype, layout), "v": (dtype, layout), "o": (dtype, layout),
             "state": ("float32", layout), "w": ("float32", "aligned"), "u": ("float32", "aligned"),
             "attn": ("float32", "aligned")}
    out = []
    for name in names.split():
        if name == "g":
            out.append(ArrayParam("g", "float32", 3))
        elif name == "beta":
            out.append(ArrayParam("beta", dtype, 3))
        else:
            out.append(array(name, kinds[name][0], 4, kinds[name][1]))
    return tuple(out)


def _variant(kernel: str, names: str, dtype: str, layout: str, consts: dict) -> VariantSpec:
    tag = ".".join([DTYPE_TAGS[dtype], *(f"{k.lower()}{v}" for k, v in consts.items()), layout])
    return VariantSpec(kernel, "gated_delta", f"{kernel}_kernel", tag,
                       (*_arrays(dtype, layout, names), ScalarParam("scale", "float32"),
                        *(ConstParam(n, val) for n, val in consts.items())))


#: Every variant of this family, aligned before generic (the runtime's order of preference).
VARIANTS: list[VariantSpec] = [
    _variant("gated_delta_recurrent", "q k v g beta state o", dtype, layout, {"DK": dk, "BV": RECURRENT_BV})
    for layout in LAYOUTS for dtype in DTYPES for dk in KEY_DIMS
] + [
    _variant("gated_delta_prepare", "q k v g beta w u attn", dtype, layout,
             {"DK": dk, "DV": dk, "BT": bt, "SB": SUB})
    for layout in LAYOUTS for dtype in CHUNK_DTYPES for dk in KEY_DIMS for bt in CHUNKS
] + [
    _variant("gated_delta_scan", "q k g w u attn state o", dtype, layout, {"DK": dk, "BV": BV, "BT": bt})
    for layout in LAYOUTS for dtype in CHUNK_DTYPES for dk in KEY_DIMS for bt in CHUNKS
]

#: Heads per gates tile (the value heads, padded: Qwen3.5-0.8B has 16, -27B 48; a model's heads
#: take the smallest that holds them, up to 128) and its tokens per block (about 1024 elements:
#: the whole kernel moves a few bytes per token).
GATE_HEADS = (16, 64, 128)
GATE_ELEMENTS = 1024


def _gates_variant(dtype: str, param_dtype: str, bh: int) -> VariantSpec:
    # a, b and beta in the activations' dtype; A_log and dt_bias in theirs (the model's dtype, or
    # float32 where a checkpoint keeps them so); g float32. Any strides (the projections' outputs).
    rows = GATE_ELEMENTS // bh
    return VariantSpec("gated_delta_gates", "gated_delta", "gated_delta_gates_kernel",
                       f"{DTYPE_TAGS[dtype]}.p{DTYPE_TAGS[param_dtype]}.h{bh}.r{rows}",
                       (ArrayParam("a", dtype, 2), ArrayParam("b", dtype, 2), ArrayParam("a_log", param_dtype, 1),
                        ArrayParam("dt_bias", param_dtype, 1), ArrayParam("g", "float32", 2),
                        ArrayParam("beta", dtype, 2), ConstParam("ROWS", rows), ConstParam("BH", bh)))


VARIANTS += [_gates_variant(dtype, param, bh) for dtype in DTYPES for param in sorted({dtype, "float32"})
             for bh in GATE_HEADS]
