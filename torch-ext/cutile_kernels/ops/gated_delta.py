"""The gated delta rule (gated DeltaNet): torch custom op, reference, dispatch, functional API.

Math in ``kernel_src/gated_delta.py`` (Yang, Kautz & Hatamizadeh 2024, arXiv:2412.06464; the
formulas of transformers' ``torch_recurrent_gated_delta_rule`` / ``torch_chunk_gated_delta_rule``,
v5.22.2, with q and k L2-normalised inside: their ``use_qk_l2norm_in_kernel=True``).
:func:`gated_delta_rule_reference` is the definition, token by token, in the inputs' precision
(float32 for 16-bit inputs, float64 for float64): the fallback and the tests' oracle.

Up to :data:`RECURRENT_MAX_LEN` tokens a call runs the token-by-token kernel (decode); longer
sequences the chunked pair (prefill): ``gated_delta_prepare`` computes every chunk's state-free part
in parallel into float32 work buffers, ``gated_delta_scan`` walks the chunks with the state. Both
paths read the recurrent state from ``state`` and leave the final state in it (in place: a decode
step updates the cache's state, and a CUDA graph replays on the same memory).

:func:`gated_delta_gates` computes the rule's two gates, ``g`` and ``beta``, from the model's ``a``
and ``b`` projections in one launch (Qwen3.5's forward computes them in eight).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import dispatch
from ._dtypes import check_float
from ._define import define_op
from ..kernel_src._spec import next_power_of_2
from ..kernel_src.gated_delta import CHUNK, CHUNK_DTYPES, GATE_HEADS, KEY_DIMS

#: Sequences up to this many tokens take the token-by-token kernel, longer ones the chunked pair.
RECURRENT_MAX_LEN = 16
#: Tokens per chunk of the chunked pair (``kernel_src.gated_delta.CHUNKS`` are built; the
#: microbenchmark compares them by setting this).
chunk_size = CHUNK
#: Dtypes of q, k, v, beta and the output the kernels are built for (g and the state: float32).
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CHUNK_DTYPES_TORCH = tuple(getattr(torch, d) for d in CHUNK_DTYPES)


def gated_delta_rule_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor, o: torch.Tensor, scale: float) -> None:
    """The gated delta rule token by token (the module doc's formula), writing ``o`` and the final
    state into ``state``. Computed in float32 (float64 when ``state`` is float64). Shapes as
    :func:`gated_delta_rule`."""
    dt = torch.float64 if state.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * scale  # transformers' l2norm eps
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    s = state.to(dt)
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", s, k[:, t])) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        o[:, t] = torch.einsum("bhkv,bhk->bhv", s, q[:, t]).to(o.dtype)
    state.copy_(s)


def _check(q, k, v, g, beta, state, o, scale) -> None:
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"gated_delta_rule: q {tuple(q.shape)} and k {tuple(k.shape)} must be one (B, T, H, dk)")
    B, T, H, _ = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"gated_delta_rule: v {tuple(v.shape)} must be (B, T, H, dv) with q's B, T, H {(B, T, H)}")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (B, T, H):
            raise ValueError(f"gated_delta_rule: {name} {tuple(t.shape)} must be (B, T, H) = {(B, T, H)}")
    if tuple(state.shape) != (B, H, q.shape[3], v.shape[3]):
        raise ValueError(f"gated_delta_rule: state {tuple(state.shape)} must be (B, H, dk, dv) = "
                         f"{(B, H, q.shape[3], v.shape[3])}")
    if o.shape != v.shape:
        raise ValueError(f"gated_delta_rule: o {tuple(o.shape)} must be shaped like v {tuple(v.shape)}")


#: The launch grid's y dimension (batch x heads) is at most this in CUDA.
MAX_GRID_Y = 65535


def unsupported(q: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state_dtype: torch.dtype = torch.float32) -> str | None:
    """Why no kernel of this op takes these inputs (None if one does): dtypes, head dims, batch x
    heads. The hub layers ask before calling, and give such calls to transformers' own function."""
    B, T, H, dk = q.shape
    if T > RECURRENT_MAX_LEN and q.dtype not in CHUNK_DTYPES_TORCH:
        return f"{q.dtype} over {T} tokens (the chunked kernels are built for bfloat16 and float16)"
    if q.dtype not in DTYPES or len({q.dtype, v.dtype, beta.dtype}) != 1:
        return f"dtypes q {q.dtype}, v {v.dtype}, beta {beta.dtype} (one of bf16/fp16/fp32 for all)"
    if g.dtype != torch.float32 or state_dtype != torch.float32:
        return f"g {g.dtype} and state {state_dtype} (float32 for both)"
    if max(KEY_DIMS[0], next_power_of_2(max(dk, v.shape[3]))) not in KEY_DIMS:
        return f"head dims {dk}/{v.shape[3]} > {KEY_DIMS[-1]}"
    if B * H > MAX_GRID_Y:
        return f"batch x heads {B * H} > {MAX_GRID_Y}"
    return None


def _gated_delta_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, o: torch.Tensor, scale: float) -> None:
    B, T, H, dk = q.shape
    dv = v.shape[3]
    if o.numel() == 0:
        return
    chunked = T > RECURRENT_MAX_LEN
    kernel = "gated_delta_scan" if chunked else "gated_delta_recurrent"
    dp = max(KEY_DIMS[0], next_power_of_2(max(dk, dv)))
    why = unsupported(q, v, g, beta, state.dtype)
    if why is None and o.dtype != q.dtype:
        why = f"output dtype {o.dtype} != {q.dtype}"
    if why is not None:
        dispatch.fallback(kernel, why)
    elif not chunked:
        if dispatch.run(kernel, (("DK", dp),), (q, k, v, g, beta, state, o, float(scale)), 6,
                        lambda consts: (-(-dv // consts["BV"]), B * H, 1)):
            return
    else:
        # The state-free part of every chunk into float32 work buffers, then the scan.
        bt = chunk_size
        n_chunks = -(-T // bt)
        w = torch.empty(B, T, H, dk, dtype=torch.float32, device=q.device)
        u = torch.empty(B, T, H, dv, dtype=torch.float32, device=q.device)
        attn = torch.empty(B, H, n_chunks * bt, bt, dtype=torch.float32, device=q.device)
        want = (("DK", dp), ("BT", bt))
        if (dispatch.run("gated_delta_prepare", want, (q, k, v, g, beta, w, u, attn, float(scale)), 5,
                         lambda consts: (n_chunks, B * H, 1))
                and dispatch.run(kernel, want, (q, k, g, w, u, attn, state, o, float(scale)), 7,
                                 lambda consts: (-(-dv // consts["BV"]), B * H, 1))):
            return
    gated_delta_rule_reference(q, k, v, g, beta, state, o, scale)


def _gated_delta_fake(q, k, v, g, beta, state, o, scale) -> None:
    return None


_gated_delta = define_op("gated_delta_rule", _gated_delta_cuda, reference=gated_delta_rule_reference,
                         fake=_gated_delta_fake, check=_check, cpu=gated_delta_rule_reference, backward=None,
                         mutates_args=("state", "o"))


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The gated delta rule with L2-normalised q and k; the recurrent state updated in place.

    Args:
        q, k: ``(B, T, H, dk)`` queries and keys (normalised inside: transformers'
            ``use_qk_l2norm_in_kernel=True``); any strides (views of the convolution's output).
        v: ``(B, T, H, dv)`` values.
        g: ``(B, T, H)`` float32 log decay (<= 0): the state is multiplied by ``exp(g)`` per token.
        beta: ``(B, T, H)`` write strength in [0, 1], the dtype of ``q``.
        state: ``(B, H, dk, dv)`` float32 recurrent state: read as the initial state, overwritten
            with the final one.
        scale: query scale (default ``dk ** -0.5``, the reference's).

    Returns:
        ``(B, T, H, dv)`` output in the dtype of ``v``.

    On CUDA the token-by-token cuTile kernel up to :data:`RECURRENT_MAX_LEN` tokens (bfloat16,
    float16, float32), the chunked path's two kernels beyond (bfloat16, float16); head dims <= 128. Otherwise, or for other
    dtypes, :func:`gated_delta_rule_reference`, logging the reason once. Under ``torch.compile``
    the custom op ``<namespace>::gated_delta_rule`` (mutating ``state``). No gradient.

    Raises:
        TypeError: a tensor is not floating point.
        ValueError: the shapes do not match.
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
    """
    check_float("gated_delta_rule", "q, k, v, g, beta, state", q, k, v, g, beta, state)
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    _check(q, k, v, g, beta, state, o, scale)
    _gated_delta.call_checked(q, k, v, g, beta, state, o, scale)
    return o


# ---------------------------------------------------------------------------------------------
# The gates: g and beta from the a and b projections
# ---------------------------------------------------------------------------------------------

def gated_delta_gates_reference(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                                dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two gate lines of ``Qwen3_5GatedDeltaNet.forward`` (transformers v5.22.2), as written
    there: ``beta = b.sigmoid()`` and ``g = -A_log.float().exp() * F.softplus(a.float() +
    dt_bias)`` (Mamba-2's discretised decay, Dao & Gu 2024, arXiv:2405.21060). Shapes as
    :func:`gated_delta_gates`; returns ``(g, beta)``."""
    beta = b.sigmoid()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, beta


def gates_unsupported(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> str | None:
    """Why the gates kernel does not take these inputs (None if it does): dtypes, heads, devices."""
    if a.dtype not in DTYPES or b.dtype != a.dtype:
        return f"dtypes a {a.dtype}, b {b.dtype} (one of bf16/fp16/fp32 for both)"
    if a_log.dtype != dt_bias.dtype or a_log.dtype not in (a.dtype, torch.float32):
        return f"A_log {a_log.dtype} and dt_bias {dt_bias.dtype} (both {a.dtype} or both float32)"
    if a.shape[-1] > GATE_HEADS[-1]:
        return f"{a.shape[-1]} heads > {GATE_HEADS[-1]}"
    if len({t.device for t in (a, b, a_log, dt_bias)}) != 1:
        return "operands on several devices"
    return None


def _check_gates(a, b, a_log, dt_bias) -> None:
    if a.dim() < 1 or b.shape != a.shape or a_log.shape != (a.shape[-1],) or dt_bias.shape != a_log.shape:
        raise ValueError(f"gated_delta_gates: a {tuple(a.shape)} and b {tuple(b.shape)} must be one (..., H), "
                         f"A_log {tuple(a_log.shape)} and dt_bias {tuple(dt_bias.shape)} (H,)")


def _gates_outputs(a, b, a_log, dt_bias):
    # The reference's dtypes: g in float32 (float64 with float64 parameters), beta in b's.
    g = torch.empty(a.shape, dtype=torch.promote_types(torch.float32, dt_bias.dtype), device=a.device)
    return g, torch.empty(b.shape, dtype=b.dtype, device=b.device)


def _gates_rows(args: tuple) -> tuple:
    # (..., H) activations and gates seen as (M, H) rows; the per-head parameters as they are.
    a, b, a_log, dt_bias, g, beta = args
    h = a.shape[-1]
    return a.reshape(-1, h), b.reshape(-1, h), a_log, dt_bias, g.view(-1, h), beta.view(-1, h)


def _gates_cuda(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g, beta = _gates_outputs(a, b, a_log, dt_bias)
    if g.numel() == 0:
        return g, beta
    why = gates_unsupported(a, b, a_log, dt_bias)
    if why is not None:
        dispatch.fallback("gated_delta_gates", why)
    else:
        rows = g.numel() // g.shape[-1]
        bh = next(h for h in GATE_HEADS if h >= a.shape[-1])  # the smallest tile built that holds the heads
        if dispatch.run("gated_delta_gates", (("BH", bh),), (a, b, a_log, dt_bias, g, beta), 4,
                        lambda consts: (-(-rows // consts["ROWS"]), 1, 1), _gates_rows):
            return g, beta
    g_ref, beta_ref = gated_delta_gates_reference(a, b, a_log, dt_bias)
    return g.copy_(g_ref), beta.copy_(beta_ref)


def _gates_fake(a, b, a_log, dt_bias):
    return _gates_outputs(a, b, a_log, dt_bias)


_gates = define_op("gated_delta_gates", _gates_cuda, reference=gated_delta_gates_reference, fake=_gates_fake,
                   check=_check_gates)


def gated_delta_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                      dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's gates from its projections, in one launch (Qwen3.5's formula).

    Args:
        a: ``(..., H)`` the ``in_proj_a`` output (decay pre-activation), one value per value head;
            bfloat16, float16 or float32, any strides.
        b: ``(..., H)`` the ``in_proj_b`` output (write-strength pre-activation), a's dtype.
        a_log: ``(H,)`` the module's ``A_log`` (log of the decay rate A).
        dt_bias: ``(H,)`` the module's ``dt_bias``, A_log's dtype.

    Returns:
        ``(g, beta)``: ``g`` ``(..., H)`` float32 (float64 with float64 ``dt_bias``, as the
        reference promotes), ``-exp(A_log) * softplus(a + dt_bias)`` (the log decay, <= 0); ``beta`` ``(..., H)`` in b's dtype, ``sigmoid(b)``. New contiguous tensors.

    On CUDA one cuTile launch when a and b share a dtype of the three, A_log and dt_bias are both
    that dtype or both float32, and H <= 128; otherwise :func:`gated_delta_gates_reference` (the
    model's own lines), logging why once. On other devices the reference. When an input requires
    grad, the custom op ``<namespace>::gated_delta_gates`` with gradients from the reference.

    Raises:
        TypeError: a tensor is not floating point.
        ValueError: the shapes do not match.
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
    """
    check_float("gated_delta_gates", "a, b, a_log, dt_bias", a, b, a_log, dt_bias)
    _check_gates(a, b, a_log, dt_bias)
    return _gates.call_checked(a, b, a_log, dt_bias)
