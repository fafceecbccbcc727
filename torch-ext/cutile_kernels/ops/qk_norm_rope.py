"""Qwen3's q/k RMSNorm + RoPE in one launch: torch custom op, fake, functional API.

The math and rounding order are those of transformers' ``Qwen3Attention.forward`` (v5.22.2,
models/qwen3/modeling_qwen3.py) between the projections and the cache: ``q_norm`` / ``k_norm``
(``Qwen3RMSNorm``, LlamaRMSNorm's formula) then ``apply_rotary_pos_emb`` (Llama's); see
``kernel_src/qk_norm_rope.py``. :func:`qk_norm_rope_reference` is those two steps through the
existing references (:func:`~.norm.rms_norm_reference`, :func:`~.rope.apply_rope_reference`), so it
is stock by construction; it is the fallback and the tests' model of stock transformers.
"""

from __future__ import annotations

import torch

from .. import dispatch
from ._dtypes import check_float
from ._define import define_op
from ..kernel_src.qk_norm_rope import BLOCKS
from .norm import rms_norm_reference
from .rope import _empty_like_layout, _halves, _mismatch, _result_dtype, _want, apply_rope_reference

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
