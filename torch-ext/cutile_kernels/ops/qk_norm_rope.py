"""Qwen3's q/k RMSNorm + RoPE in one launch, and Qwen3.5's zero-centered q/k norm + partial
RoPE in one launch: torch custom ops, fakes, functional API.

The math and rounding order are those of transformers' ``Qwen3Attention.forward`` (v5.22.2,
models/qwen3/modeling_qwen3.py) between the projections and the cache: ``q_norm`` / ``k_norm``
(``Qwen3RMSNorm``, LlamaRMSNorm's formula) then ``apply_rotary_pos_emb`` (Llama's); see
``kernel_src/qk_norm_rope.py``. :func:`qk_norm_rope_reference` is those two steps through the
existing references (:func:`~.norm.rms_norm_reference`, :func:`~.rope.apply_rope_reference`), so it
is stock by construction; it is the fallback and the tests' model of stock transformers.

:func:`qk_norm_rope_gemma` is the same for ``Qwen3_5Attention.forward`` (v5.22.2,
models/qwen3_5/modeling_qwen3_5.py): ``Qwen3_5RMSNorm`` (Gemma's float32 order with ``1 + weight``)
and the partial-rotary ``apply_rotary_pos_emb`` (the first ``cos.shape[-1]`` elements of each head
rotate); its reference chains :func:`~.norm.rms_norm_gemma_reference` and
:func:`~.rope.apply_rope_reference`.

:func:`qk_norm_rope_olmo2` is the same for ``Olmo2Attention.forward`` (v5.22.2,
models/olmo2/modeling_olmo2.py; OLMo 3's copies it): ``Olmo2RMSNorm`` over each token's whole q (and
k) projection row, then the head split and OLMo 2's ``apply_rotary_pos_emb`` (float32 cos/sin, the
result cast back); its reference chains :func:`~.norm.rms_norm_gemma_reference` (offset 0) and
:func:`~.rope.apply_rope_cast_reference`.
"""

from __future__ import annotations

import functools

import torch

from .. import dispatch
from ._dtypes import check_float
from ._define import define_op
from ..kernel_src._spec import next_power_of_2
from ..kernel_src.qk_norm_rope import BLOCKS, GEMMA_ROWS, GEMMA_TILES, OLMO2_ROWS, OLMO2_TILES
from ..registry import DECODE_TORCH_DTYPES
from .norm import rms_norm_gemma_reference, rms_norm_reference
from .rope import (_empty_like_layout, _halves, _mismatch, _result_dtype, _want, apply_rope_cast_reference,
                   apply_rope_reference)

KERNEL = "qk_norm_rope"
MAX_BLOCK = max(BLOCKS)
#: Dtypes the kernel is built for (q, k, both weights, cos and sin all of one of them).
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def qk_norm_rope_reference(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                           eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``Qwen3Attention.forward``'s q/k path (transformers v5.22.2): ``q_norm`` and ``k_norm``
    (LlamaRMSNorm's formula over the head dimension), then ``apply_rotary_pos_emb(q, k, cos, sin)``.

    The norm runs on the (B, H, S, D) views rather than on the (B, S, H, D) tensors before the
    transpose, which changes no value (it reduces the last dimension either way) and gives the
    stock memory layout (elementwise ops keep it). Shapes as :func:`qk_norm_rope`.
    """
    q = rms_norm_reference(q, q_weight, eps)
    k = rms_norm_reference(k, k_weight, eps)
    return apply_rope_reference(q, k, cos, sin)


def _check_weights(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor) -> None:
    for name, x, w in (("q_weight", q, q_weight), ("k_weight", k, k_weight)):
        if w.dim() != 1 or x.dim() < 1 or w.shape[0] != x.shape[-1]:
            raise ValueError(f"qk_norm_rope: {name} of shape {tuple(w.shape)} does not match head_dim "
                             f"{x.shape[-1] if x.dim() else None} of {tuple(x.shape)}")


def unsupported(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why the kernel does not take these inputs (already shaped as the op takes them) on CUDA,
    or None if it does."""
    d, rot = q.shape[-1], cos.shape[-1]
    if rot != d:
        return f"partial rotary (cos/sin width {rot} < head_dim {d}); the kernel rotates whole heads"
    dtypes = {t.dtype for t in (q, k, q_weight, k_weight, cos, sin)}
    if len(dtypes) != 1 or q.dtype not in DTYPES:
        return (f"dtypes {sorted(str(t) for t in dtypes)} (the kernel takes one of bfloat16, float16, float32 "
                "for q, k, both weights, cos and sin)")
    if d // 2 > MAX_BLOCK:
        return f"head_dim {d} > {2 * MAX_BLOCK} (the widest tile)"
    if len({t.device for t in (q, k, q_weight, k_weight, cos, sin)}) != 1:
        return "operands on several devices"
    return None


def _outputs(q, k, q_weight, k_weight, cos, sin):
    # The reference's dtypes (weight * normed in the weight's promotion, then RoPE's) and q's / k's
    # memory order, as eager torch lays out the stock result.
    dq = _result_dtype(torch.promote_types(q.dtype, q_weight.dtype), cos.dtype, sin.dtype)
    dk = _result_dtype(torch.promote_types(k.dtype, k_weight.dtype), cos.dtype, sin.dtype)
    return _empty_like_layout(q, dq), _empty_like_layout(k, dk)


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def qk_norm_rope_into(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                      eps: float, cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor,
                      k_out: torch.Tensor) -> bool:
    """Launch the kernel on CUDA tensors it takes (:func:`unsupported` is None): q (B, Hq, S, D),
    k (B, Hk, S, D), weights (D,), cos and sin (B or 1, S, D), into new tensors ``q_out``/``k_out``
    shaped like q and k (any strides; not aliasing the inputs, which is not checked).

    Returns False (nothing written) when no cuTile path fits; the caller then falls back.
    """
    (b, hq, s, d), hk = q.shape, k.shape[1]
    args = (q, k, q_weight, k_weight, cos, sin, q_out, k_out, float(eps))
    grid = lambda c: (_cdiv(s, c["ROWS"]), _cdiv(hq, c["HEADS"]) + _cdiv(hk, c["HEADS"]), b)  # noqa: E731
    return dispatch.run(KERNEL, _want(d // 2, s, q.dtype), args, 6, grid, _layout)


def _layout(args: tuple) -> tuple:
    # Every tensor as (..., 2, D/2) halves (the weights as (2, D/2)), eps as it is (once per plan).
    d = args[0].shape[-1]
    return (*(_halves(t, d) for t in args[:8]), args[8])


def _cuda(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
          cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The op on CUDA once shapes are checked (``_mismatch`` None, weights (D,))."""
    q_out, k_out = _outputs(q, k, q_weight, k_weight, cos, sin)
    if q_out.numel() == 0 and k_out.numel() == 0:
        return q_out, k_out
    why = unsupported(q, k, q_weight, k_weight, cos, sin)
    if why is None:
        if qk_norm_rope_into(q, k, q_weight, k_weight, eps, cos, sin, q_out, k_out):
            return q_out, k_out
    else:
        dispatch.fallback(KERNEL, why)
    return _copy_reference(q, k, q_weight, k_weight, eps, cos, sin, q_out, k_out)


def _copy_reference(q, k, q_weight, k_weight, eps, cos, sin, q_out, k_out):
    q_ref, k_ref = qk_norm_rope_reference(q, k, q_weight, k_weight, eps, cos, sin)
    return q_out.copy_(q_ref), k_out.copy_(k_ref)


def _cpu(q, k, q_weight, k_weight, eps, cos, sin):
    # The reference in the op's declared layout (q's and k's memory order).
    return _copy_reference(q, k, q_weight, k_weight, eps, cos, sin, *_outputs(q, k, q_weight, k_weight, cos, sin))


def _check(q, k, q_weight, k_weight, cos, sin) -> None:
    _check_weights(q, k, q_weight, k_weight)
    why = _mismatch(q, k, cos, sin)
    if why is not None:
        raise ValueError(f"qk_norm_rope: {why}")


def _check_op(q, k, q_weight, k_weight, eps, cos, sin) -> None:
    _check(q, k, q_weight, k_weight, cos, sin)


def _fake(q, k, q_weight, k_weight, eps, cos, sin):
    return _outputs(q, k, q_weight, k_weight, cos, sin)


_qk_norm_rope = define_op(KERNEL, _cuda, reference=qk_norm_rope_reference, fake=_fake, check=_check_op, cpu=_cpu)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k, then rotary position embedding, in one launch (Qwen3's formula).

    Args:
        q: ``(B, Hq, S, D)`` queries before ``q_norm``, any strides (transformers passes the
            projection output viewed ``(B, S, Hq, D)`` and transposed); bfloat16, float16 or float32.
        k: ``(B, Hk, S, D)`` keys before ``k_norm``, likewise (one KV head is fine).
        q_weight, k_weight: ``(D,)`` weights of ``q_norm`` and ``k_norm``.
        eps: the norms' ``variance_epsilon`` (``config.rms_norm_eps``; both norms share it).
        cos, sin: ``(B, S, D)`` or ``(1, S, D)`` as the model's rotary embedding returns them.

    Returns:
        ``(q_embed, k_embed)``: new tensors of q's and k's shapes, laid out in their memory order
        (as eager torch lays out the stock result), of the stock result's dtype.

    On CUDA this is one cuTile kernel (prebuilt, else JIT) for q and k when every tensor has one
    dtype of the three, ``cos`` is as wide as the head (full rotary) and D <= 256. Other inputs
    (partial rotary, mixed dtypes, wider heads, no build) take :func:`qk_norm_rope_reference` and
    log the reason once (``FallbackError`` instead under ``CUTILE_KERNELS_STRICT=1``). On other
    devices it is :func:`qk_norm_rope_reference`. Under ``torch.compile``, or when an input
    requires grad, it is the custom op ``<namespace>::qk_norm_rope`` (fake implementation;
    gradients from the reference formula).

    Raises:
        TypeError: a tensor is not bfloat16, float16, float32 or float64.
        ValueError: a weight is not ``(D,)``.
        RuntimeError: shapes that do not broadcast (from the reference, as transformers').
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
        CudaError: the CUDA driver failed to launch the kernel.
    """
    check_float("qk_norm_rope", "q, k, q_weight, k_weight, cos, sin", q, k, q_weight, k_weight, cos, sin)
    _check_weights(q, k, q_weight, k_weight)
    if q.dim() != 4 or k.dim() != 4 or _mismatch(q, k, cos, sin) is not None:
        return qk_norm_rope_reference(q, k, q_weight, k_weight, eps, cos, sin)  # outside the kernel's contract
    return _qk_norm_rope.call_checked(q, k, q_weight, k_weight, float(eps), cos, sin)


# ---------------------------------------------------------------------------------------------
# qk_norm_rope_gemma: Qwen3.5's (1 + weight) q/k norms and partial RoPE
# ---------------------------------------------------------------------------------------------

GEMMA_KERNEL = "qk_norm_rope_gemma"


def qk_norm_rope_gemma_reference(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                                 eps: float, cos: torch.Tensor, sin: torch.Tensor,
                                 offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``Qwen3_5Attention.forward``'s q/k path (transformers v5.22.2): ``q_norm`` and ``k_norm``
    (``Qwen3_5RMSNorm``: float32, ``offset + weight``, one rounding to the input dtype; offset 1),
    then ``apply_rotary_pos_emb(q, k, cos, sin)`` rotating the first ``cos.shape[-1]`` elements of
    each head (all of them for full rotary). On the (B, H, S, D) views, as
    :func:`qk_norm_rope_reference`. Shapes as :func:`qk_norm_rope_gemma`."""
    q = rms_norm_gemma_reference(q, q_weight, eps, offset)
    k = rms_norm_gemma_reference(k, k_weight, eps, offset)
    return apply_rope_reference(q, k, cos, sin)


@functools.lru_cache(maxsize=None)
def _gemma_tile(d: int, rot: int) -> tuple | None:
    # (BLOCK, CHUNKS) of a head of d elements with rot rotated, or None when no tile fits.
    half = rot // 2
    if d % half:
        return None
    tile = (max(min(BLOCKS), next_power_of_2(half)), max(2, next_power_of_2(d // half)))
    return tile if tile in GEMMA_TILES else None


def gemma_unsupported(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why :func:`qk_norm_rope_gemma`'s kernel does not take these inputs (shaped as the op
    takes them) on CUDA, or None if it does."""
    d, rot = q.shape[-1], cos.shape[-1]
    if _gemma_tile(d, rot) is None:
        return (f"head_dim {d} with {rot} rotated: the kernel needs head_dim a multiple of half the rotated "
                f"width and a head of at most 256 in chunks of it (tiles {GEMMA_TILES})")
    dtypes = {t.dtype for t in (q, k, q_weight, k_weight, cos, sin)}
    if len(dtypes) != 1 or q.dtype not in DTYPES:
        return (f"dtypes {sorted(str(t) for t in dtypes)} (the kernel takes one of bfloat16, float16, float32 "
                "for q, k, both weights, cos and sin)")
    if len({t.device for t in (q, k, q_weight, k_weight, cos, sin)}) != 1:
        return "operands on several devices"
    return None


def _gemma_want(d: int, rot: int, positions: int, dtype: torch.dtype) -> tuple:
    block, chunks = _gemma_tile(d, rot)
    want = (("BLOCK", block), ("CHUNKS", chunks))
    if positions < GEMMA_ROWS[(block, chunks)] and dtype in DECODE_TORCH_DTYPES:
        return (*want, ("ROWS", 1))  # a decode step: one position per block
    return want


def _gemma_layout(args: tuple) -> tuple:
    # Heads and weights as (..., D / (R/2), R/2) chunks, cos/sin as (..., 2, R/2) halves (once per plan).
    q, cos = args[0], args[4]
    half = cos.shape[-1] // 2
    chunks = q.shape[-1] // half
    heads = tuple(t.view(*t.shape[:-1], chunks, half) for t in args[:4])
    return (*heads, _halves(cos, 2 * half), _halves(args[5], 2 * half),
            *(t.view(*t.shape[:-1], chunks, half) for t in args[6:8]), *args[8:])


def qk_norm_rope_gemma_into(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                            eps: float, cos: torch.Tensor, sin: torch.Tensor, offset: float, q_out: torch.Tensor,
                            k_out: torch.Tensor) -> bool:
    """Launch the kernel on CUDA tensors it takes (:func:`gemma_unsupported` is None), into new
    tensors ``q_out``/``k_out`` shaped like q and k. Returns False (nothing written) when no
    cuTile path fits; the caller then falls back."""
    (b, hq, s, d), hk = q.shape, k.shape[1]
    args = (q, k, q_weight, k_weight, cos, sin, q_out, k_out, float(eps), float(offset))
    grid = lambda c: (_cdiv(s, c["ROWS"]), _cdiv(hq, c["HEADS"]) + _cdiv(hk, c["HEADS"]), b)  # noqa: E731
    return dispatch.run(GEMMA_KERNEL, _gemma_want(d, cos.shape[-1], s, q.dtype), args, 6, grid, _gemma_layout)


def _gemma_outputs(q, k, cos, sin):
    # Stock's dtypes and layout: the norm keeps the input dtype (``type_as(x)``), RoPE promotes with
    # cos and sin, and Qwen3.5's ``apply_rotary_pos_emb`` ends in ``torch.cat`` (contiguous
    # (B, H, S, D), even when nothing passes through).
    return (torch.empty(q.shape, dtype=_result_dtype(q.dtype, cos.dtype, sin.dtype), device=q.device),
            torch.empty(k.shape, dtype=_result_dtype(k.dtype, cos.dtype, sin.dtype), device=k.device))


def _gemma_cuda(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                cos: torch.Tensor, sin: torch.Tensor, offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    q_out, k_out = _gemma_outputs(q, k, cos, sin)
    if q_out.numel() == 0 and k_out.numel() == 0:
        return q_out, k_out
    why = gemma_unsupported(q, k, q_weight, k_weight, cos, sin)
    if why is None:
        if qk_norm_rope_gemma_into(q, k, q_weight, k_weight, eps, cos, sin, offset, q_out, k_out):
            return q_out, k_out
    else:
        dispatch.fallback(GEMMA_KERNEL, why)
    return _gemma_copy_reference(q, k, q_weight, k_weight, eps, cos, sin, offset, q_out, k_out)


def _gemma_copy_reference(q, k, q_weight, k_weight, eps, cos, sin, offset, q_out, k_out):
    q_ref, k_ref = qk_norm_rope_gemma_reference(q, k, q_weight, k_weight, eps, cos, sin, offset)
    return q_out.copy_(q_ref), k_out.copy_(k_ref)


def _gemma_cpu(q, k, q_weight, k_weight, eps, cos, sin, offset):
    return _gemma_copy_reference(q, k, q_weight, k_weight, eps, cos, sin, offset, *_gemma_outputs(q, k, cos, sin))


def _gemma_check(q, k, q_weight, k_weight, eps, cos, sin, offset) -> None:
    _check(q, k, q_weight, k_weight, cos, sin)


def _gemma_fake(q, k, q_weight, k_weight, eps, cos, sin, offset):
    return _gemma_outputs(q, k, cos, sin)


_qk_norm_rope_gemma = define_op(GEMMA_KERNEL, _gemma_cuda, reference=qk_norm_rope_gemma_reference, fake=_gemma_fake,
                                check=_gemma_check, cpu=_gemma_cpu)


def qk_norm_rope_gemma(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                       cos: torch.Tensor, sin: torch.Tensor, offset: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head zero-centered RMSNorm of q and k, then rotary position embedding of the first
    ``R = cos.shape[-1]`` elements of each head, in one launch (Qwen3.5's gated attention).

    Args:
        q: ``(B, Hq, S, D)`` queries before ``q_norm``, any strides (transformers passes the
            projection output viewed ``(B, S, Hq, D)`` and transposed); bfloat16, float16 or float32.
        k: ``(B, Hk, S, D)`` keys before ``k_norm``, likewise (one KV head is fine).
        q_weight, k_weight: ``(D,)`` weights of ``q_norm`` and ``k_norm`` (stored around 0).
        eps: the norms' ``eps`` (``config.rms_norm_eps``).
        cos, sin: ``(B, S, R)`` or ``(1, S, R)`` as the model's rotary embedding returns them;
            ``R < D`` is partial rotary (Qwen3.5: ``R = D / 4``), ``R == D`` full.
        offset: added to the weights in float32 (``Qwen3_5RMSNorm``'s ``1.0 + weight``).

    Returns:
        ``(q_embed, k_embed)``: new contiguous tensors of q's and k's shapes (as Qwen3.5's stock
        ``torch.cat`` lays them out; Gemma 3's stock RoPE keeps the projection's layout: same
        values), of the stock dtype (the input's promoted with cos's and sin's).

    On CUDA this is one cuTile kernel (prebuilt, else JIT) when every tensor has one dtype of the
    three and the head splits into chunks of ``R / 2`` in a tile (D a multiple of ``R / 2``, at
    most 256 wide; Qwen3.5's 256 with R = 64, and full rotary up to 256). Other inputs take
    :func:`qk_norm_rope_gemma_reference` and log the reason once (``FallbackError`` under
    ``CUTILE_KERNELS_STRICT=1``). On other devices it is the reference. Under ``torch.compile``,
    or when an input requires grad, it is the custom op ``<namespace>::qk_norm_rope_gemma``
    (gradients from the reference formula).

    Raises:
        TypeError: a tensor is not bfloat16, float16, float32 or float64.
        ValueError: a weight is not ``(D,)``.
        RuntimeError: shapes that do not broadcast (from the reference, as transformers').
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
        CudaError: the CUDA driver failed to launch the kernel.
    """
    check_float("qk_norm_rope_gemma", "q, k, q_weight, k_weight, cos, sin", q, k, q_weight, k_weight, cos, sin)
    _check_weights(q, k, q_weight, k_weight)
    if q.dim() != 4 or k.dim() != 4 or _mismatch(q, k, cos, sin) is not None:
        return qk_norm_rope_gemma_reference(q, k, q_weight, k_weight, eps, cos, sin, offset)
    return _qk_norm_rope_gemma.call_checked(q, k, q_weight, k_weight, float(eps), cos, sin, float(offset))


# ---------------------------------------------------------------------------------------------
# qk_norm_rope_olmo2: OLMo 2's q/k norms over the whole projection, then its float32 RoPE
# ---------------------------------------------------------------------------------------------

OLMO2_KERNEL = "qk_norm_rope_olmo2"


def qk_norm_rope_olmo2_reference(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                                 eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``Olmo2Attention.forward``'s q/k path (transformers v5.22.2): ``q_norm(q_proj(x))`` and
    ``k_norm(k_proj(x))`` (``Olmo2RMSNorm`` over the whole projection: float32, ``weight * x *
    rsqrt(mean(x ** 2) + eps)``, one rounding), the head split ``view(B, S, H, D).transpose(1, 2)``,
    then OLMo 2's ``apply_rotary_pos_emb`` (each op in ``promote_types(x, cos)``: float32 for its
    float32 cos/sin; the result cast back to the input's dtype). Returned in the projection's shape
    ``(B, S, H * D)`` (a view of the stock result transposed back: same values and memory).
    Shapes as :func:`qk_norm_rope_olmo2`."""
    d = cos.shape[-1]
    qn = rms_norm_gemma_reference(q, q_weight, eps, 0.0).unflatten(-1, (-1, d)).transpose(1, 2)
    kn = rms_norm_gemma_reference(k, k_weight, eps, 0.0).unflatten(-1, (-1, d)).transpose(1, 2)
    q_embed, k_embed = apply_rope_cast_reference(qn, kn, cos, sin)
    return q_embed.transpose(1, 2).flatten(2), k_embed.transpose(1, 2).flatten(2)


def _olmo2_mismatch(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why the arguments are not shaped as :func:`qk_norm_rope_olmo2` takes them, or None."""
    if q.dim() != 3 or k.dim() != 3 or cos.dim() != 3 or sin.shape != cos.shape:
        return (f"expected q (B, S, Hq * D), k (B, S, Hk * D), cos and sin (B or 1, S, D); got q {tuple(q.shape)}, "
                f"k {tuple(k.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    (b, s, wq), wk, d = q.shape, k.shape[-1], cos.shape[-1]
    if (k.shape[:2] != (b, s) or cos.shape[0] not in (1, b) or cos.shape[1] != s or d % 2 or d == 0
            or wq % d or wk % d):
        return (f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)} (cos/sin need "
                "batch 1 or B, q's sequence length and an even head_dim D dividing q's and k's widths)")
    if tuple(q_weight.shape) != (wq,) or tuple(k_weight.shape) != (wk,):
        return (f"q_weight {tuple(q_weight.shape)} and k_weight {tuple(k_weight.shape)} must be ({wq},) and ({wk},), "
                "the norms over the whole projections")
    return None


@functools.lru_cache(maxsize=None)
def _olmo2_tile(d: int, heads: int) -> tuple | None:
    # (BLOCK, HP) for head_dim d and the larger head count of q and k, or None when no tile fits.
    tile = (next_power_of_2(d // 2), max(8, next_power_of_2(heads)))
    return tile if tile in OLMO2_TILES else None


def olmo2_tile_reason(head_dim: int, heads: int) -> str | None:
    """Why no tile of :func:`qk_norm_rope_olmo2`'s build matrix (``OLMO2_TILES``) takes heads of
    ``head_dim`` elements, ``heads`` of them (the larger of q's and k's head counts), or None if
    one does.

    The one copy of the rule: :func:`olmo2_unsupported` asks it on each CUDA call, and the
    ``olmo2_qk_norm_rope`` patch asks it when a model is kernelized (a module no tile takes keeps
    its class forward). Shapes only: dtypes, devices and whether a build is present are not asked.
    """
    if _olmo2_tile(head_dim, heads) is None:
        return (f"head_dim {head_dim} with {heads} heads (the more of q's and k's): the kernel is built for head_dim "
                f"66 to 128 (128 in every OLMo 2 and 3) and up to 64 heads (tiles {OLMO2_TILES})")
    return None


def olmo2_unsupported(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why :func:`qk_norm_rope_olmo2`'s kernel does not take these (well-shaped) inputs on CUDA, or
    None if it does."""
    d = cos.shape[-1]
    why = olmo2_tile_reason(d, max(q.shape[-1], k.shape[-1]) // d)
    if why is not None:
        return why
    if q.dtype not in DECODE_TORCH_DTYPES or {k.dtype, q_weight.dtype, k_weight.dtype} != {q.dtype} or \
            cos.dtype != torch.float32 or sin.dtype != torch.float32:
        return (f"dtypes q {q.dtype}, k {k.dtype}, weights {q_weight.dtype} / {k_weight.dtype}, cos {cos.dtype}, sin "
                f"{sin.dtype} (the kernel takes bfloat16 or float16 q, k and weights with float32 cos and sin)")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        return "q or k has a strided last dimension (the kernel views each row as heads)"
    if len({t.device for t in (q, k, q_weight, k_weight, cos, sin)}) != 1:
        return "operands on several devices"
    return None


def _olmo2_want(d: int, heads: int, positions: int) -> tuple:
    block, hp = _olmo2_tile(d, heads)
    rows = OLMO2_ROWS[(block, hp)]
    return (("BLOCK", block), ("HP", hp), ("ROWS", 1 if positions < rows else rows))


def _olmo2_layout(args: tuple) -> tuple:
    # q, k, the outputs as (B, S, H, 2, D/2), the weights as (H, 2, D/2), cos/sin as (..., 2, D/2).
    d = args[4].shape[-1]
    heads = lambda t: t.view(*t.shape[:-1], t.shape[-1] // d, 2, d // 2)  # noqa: E731
    return (heads(args[0]), heads(args[1]), heads(args[2]), heads(args[3]), _halves(args[4], d), _halves(args[5], d),
            heads(args[6]), heads(args[7]), args[8])


def qk_norm_rope_olmo2_into(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                            eps: float, cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor,
                            k_out: torch.Tensor) -> bool:
    """Launch the kernel on CUDA tensors it takes (:func:`olmo2_unsupported` is None), into new
    tensors ``q_out``/``k_out`` shaped like q and k with a contiguous last dimension. Returns False
    (nothing written) when no cuTile path fits; the caller then falls back."""
    b, s, _ = q.shape
    d = cos.shape[-1]
    args = (q, k, q_weight, k_weight, cos, sin, q_out, k_out, float(eps))
    grid = lambda c: (_cdiv(s, c["ROWS"]), 2, b)  # noqa: E731
    return dispatch.run(OLMO2_KERNEL, _olmo2_want(d, max(q.shape[-1], k.shape[-1]) // d, s), args, 6, grid,
                        _olmo2_layout)


def _olmo2_outputs(q, k):
    # Stock's dtypes (the norm keeps the input's, the cast RoPE returns it) in the projection's shape,
    # contiguous: the stock result's memory, transposed back.
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device))


def _olmo2_copy_reference(q, k, q_weight, k_weight, eps, cos, sin, q_out, k_out):
    q_ref, k_ref = qk_norm_rope_olmo2_reference(q, k, q_weight, k_weight, eps, cos, sin)
    return q_out.copy_(q_ref), k_out.copy_(k_ref)


def _olmo2_cuda(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q_out, k_out = _olmo2_outputs(q, k)
    if q_out.numel() == 0 and k_out.numel() == 0:
        return q_out, k_out
    why = olmo2_unsupported(q, k, q_weight, k_weight, cos, sin)
    if why is None:
        if qk_norm_rope_olmo2_into(q, k, q_weight, k_weight, eps, cos, sin, q_out, k_out):
            return q_out, k_out
    else:
        dispatch.fallback(OLMO2_KERNEL, why)
    return _olmo2_copy_reference(q, k, q_weight, k_weight, eps, cos, sin, q_out, k_out)


def _olmo2_cpu(q, k, q_weight, k_weight, eps, cos, sin):
    return _olmo2_copy_reference(q, k, q_weight, k_weight, eps, cos, sin, *_olmo2_outputs(q, k))


def _olmo2_check(q, k, q_weight, k_weight, eps, cos, sin) -> None:
    why = _olmo2_mismatch(q, k, q_weight, k_weight, cos, sin)
    if why is not None:
        raise ValueError(f"qk_norm_rope_olmo2: {why}")


def _olmo2_fake(q, k, q_weight, k_weight, eps, cos, sin):
    return _olmo2_outputs(q, k)


_qk_norm_rope_olmo2 = define_op(OLMO2_KERNEL, _olmo2_cuda, reference=qk_norm_rope_olmo2_reference, fake=_olmo2_fake,
                                check=_olmo2_check, cpu=_olmo2_cpu)


def qk_norm_rope_olmo2(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                       cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OLMo 2's RMSNorm of each token's whole q and k projection rows, then rotary position
    embedding of their heads, in one launch (``Olmo2Attention.forward``'s q/k path).

    Args:
        q: ``(B, S, Hq * D)`` the q projection's output before ``q_norm`` (a view of a stacked
            q/k/v output is fine: any row strides, the last dimension contiguous); bfloat16 or
            float16 on the kernel, any float dtype on the reference.
        k: ``(B, S, Hk * D)`` the k projection's output before ``k_norm``, likewise.
        q_weight, k_weight: ``(Hq * D,)`` and ``(Hk * D,)`` weights of ``q_norm`` and ``k_norm``.
        eps: the norms' ``variance_epsilon`` (``config.rms_norm_eps``; both norms share it).
        cos, sin: ``(B, S, D)`` or ``(1, S, D)`` as OLMo 2's rotary embedding returns them (float32);
            full rotary (D is the head dim).

    Returns:
        ``(q_embed, k_embed)``: new contiguous ``(B, S, H * D)`` tensors of q's and k's dtypes,
        ``view(B, S, H, D).transpose(1, 2)`` of which is the stock ``apply_rotary_pos_emb`` result
        (values and memory layout).

    On CUDA this is one cuTile kernel (prebuilt, else JIT) when the head dim is 66 to 128 (even; 128
    in every OLMo 2 and OLMo 3 checkpoint) with at most 64 heads, q, k and the weights share a 16-bit
    dtype and cos/sin are float32. Other inputs take :func:`qk_norm_rope_olmo2_reference` and log
    the reason once (``FallbackError`` under
    ``CUTILE_KERNELS_STRICT=1``). On other devices it is the reference. Under ``torch.compile``, or
    when an input requires grad, it is the custom op ``<namespace>::qk_norm_rope_olmo2`` (gradients
    from the reference formula).

    Raises:
        TypeError: a tensor is not bfloat16, float16, float32 or float64.
        ValueError: shapes that do not fit (widths not multiples of the head dim, weights not the
            projections' widths, cos/sin of another length).
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
        CudaError: the CUDA driver failed to launch the kernel.
    """
    check_float("qk_norm_rope_olmo2", "q, k, q_weight, k_weight, cos, sin", q, k, q_weight, k_weight, cos, sin)
    return _qk_norm_rope_olmo2(q, k, q_weight, k_weight, float(eps), cos, sin)
