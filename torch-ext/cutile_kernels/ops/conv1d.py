"""Causal depthwise conv1d with SiLU, and its one-token update: torch custom ops, references,
dispatch, functional API.

Math in ``kernel_src/conv1d.py``: transformers' ``causal_conv1d_fn`` / ``causal_conv1d_update``
(models/qwen3_5/modeling_qwen3_5.py, v5.22.2) with ``activation="silu"`` and no bias, whose lines
:func:`causal_conv1d_reference` and :func:`causal_conv1d_update_reference` restate. The
activations are ``(B, L, C)`` here (channels innermost); transformers' functions take the
transposed ``(B, C, L)`` view of the same memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import dispatch
from ._dtypes import check_float
from ._define import define_op
from ..kernel_src.conv1d import BC, BL, KERNEL_SIZES, UPDATE_BC

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``silu(conv1d(x, weight, padding=K-1, groups=C))[:L]`` as transformers computes it: the
    convolution in ``weight``'s dtype, the SiLU on its rounded output. x: (B, L, C); weight: (C, K)."""
    L, C = x.shape[1], x.shape[2]
    y = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), padding=weight.shape[1] - 1, groups=C)
    return F.silu(y[:, :, :L]).to(x.dtype).transpose(1, 2).contiguous()


def causal_conv1d_update_reference(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                                   y: torch.Tensor) -> None:
    """transformers' ``causal_conv1d_update`` for one token: ``state`` (B, C, K) shifted left and
    ``x`` (B, C) appended, in place; ``y`` (B, C) = silu of the state convolved with ``weight``."""
    new = torch.cat([state, x.unsqueeze(-1)], dim=-1).to(weight.dtype)
    state.copy_(new[:, :, -state.shape[-1]:])
    out = F.conv1d(new, weight.unsqueeze(1), groups=x.shape[1])[:, :, -1]
    y.copy_(F.silu(out).to(y.dtype))


def unsupported(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None) -> str | None:
    """Why no kernel takes ``x``, ``weight`` (and the update's conv ``state``) (None if one does):
    dtypes and the kernel size. The hub layers ask before calling, and give such calls to
    transformers' own function."""
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        return f"dtypes x {x.dtype}, weight {weight.dtype} (one of bf16/fp16/fp32 for both)"
    if weight.shape[1] not in KERNEL_SIZES:
        return f"kernel size {weight.shape[1]} (built: {KERNEL_SIZES})"
    if state is not None and state.dtype != x.dtype:
        return f"conv state dtype {state.dtype} != {x.dtype}"
    return None


def _check(x, weight) -> None:
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        raise ValueError(f"causal_conv1d: x {tuple(x.shape)} must be (B, L, C) and weight {tuple(weight.shape)} "
                         "(C, K)")


def _conv_cuda(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    B, L, C = x.shape
    y = torch.empty(B, L, C, dtype=x.dtype, device=x.device)
    why = unsupported(x, weight)
    if y.numel() == 0:
        return y
    if why is not None:
        dispatch.fallback("causal_conv1d", why)
    elif dispatch.run("causal_conv1d", (("K", weight.shape[1]),), (x, weight, y), 2,
                      lambda consts: (-(-L // BL), -(-C // BC), B)):
        return y
    return causal_conv1d_reference(x, weight)


def _conv_fake(x, weight):
    return x.new_empty(x.shape)


def _check_update(x, state, weight, y) -> None:
    if x.dim() != 2 or state.dim() != 3 or state.shape[:2] != x.shape or weight.shape != (x.shape[1], state.shape[2]):
        raise ValueError(f"causal_conv1d_update: x {tuple(x.shape)} must be (B, C), state {tuple(state.shape)} "
                         f"(B, C, K), weight {tuple(weight.shape)} (C, K)")
    if y.shape != x.shape:
        raise ValueError(f"causal_conv1d_update: y {tuple(y.shape)} must be shaped like x {tuple(x.shape)}")


def _update_cuda(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, y: torch.Tensor) -> None:
    B, C = x.shape
    why = unsupported(x, weight, state)
    if x.numel() == 0:
        return
    if why is not None:
        dispatch.fallback("causal_conv1d_update", why)
    elif dispatch.run("causal_conv1d_update", (("K", weight.shape[1]),), (x, state, weight, y), 3,
                      lambda consts: (-(-C // UPDATE_BC), B, 1)):
        return
    causal_conv1d_update_reference(x, state, weight, y)


def _update_fake(x, state, weight, y) -> None:
    return None


_conv = define_op("causal_conv1d", _conv_cuda, reference=causal_conv1d_reference, fake=_conv_fake, check=_check,
                  backward=None)
_update = define_op("causal_conv1d_update", _update_cuda, reference=causal_conv1d_update_reference,
                    fake=_update_fake, check=_check_update, cpu=causal_conv1d_update_reference, backward=None,
                    mutates_args=("state", "y"))


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv1d with SiLU over a sequence (prefill).

    Args:
        x: ``(B, L, C)`` activations (channels innermost; any strides).
        weight: ``(C, K)`` depthwise filter (``conv1d.weight.squeeze(1)``), same dtype as ``x``.

    Returns:
        ``(B, L, C)`` contiguous, dtype of ``x``: ``y[l] = silu(sum_j weight[:, j] x[l - K + 1 + j])``
        with zeros before the start.

    On CUDA one cuTile launch (bfloat16, float16, float32; K = 4); otherwise
    :func:`causal_conv1d_reference`, logging why once. No gradient.

    Raises:
        TypeError: a tensor is not floating point.
        ValueError: the shapes do not match.
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
    """
    check_float("causal_conv1d", "x, weight", x, weight)
    return _conv(x, weight)


def causal_conv1d_update(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One decode token through the causal conv1d with SiLU; the conv state updated in place.

    Args:
        x: ``(B, C)`` the token's activations.
        state: ``(B, C, K)`` the last K inputs (transformers' ``conv_states``): shifted left by one
            and ``x`` appended, in place.
        weight: ``(C, K)``, same dtype as ``x``.

    Returns:
        ``(B, C)`` in the dtype of ``x``.

    On CUDA one cuTile launch (K = 4); otherwise :func:`causal_conv1d_update_reference`.

    Raises:
        TypeError: a tensor is not floating point.
        ValueError: the shapes do not match.
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
    """
    check_float("causal_conv1d_update", "x, state, weight", x, state, weight)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _check_update(x, state, weight, y)
    _update.call_checked(x, state, weight, y)
    return y
