"""RoPE cos/sin tables in one launch: torch custom op, fake, functional API.

The math is transformers' ``LlamaRotaryEmbedding.forward`` at v5.22.2 (see
``kernel_src/rope_cos_sin.py``): the rotary embedding's ``inv_freq`` and ``attention_scaling``
carry every RoPE scaling type, so one formula serves them all. :func:`rope_cos_sin_reference`
restates it in PyTorch; it is the fallback and the tests' model of what stock transformers computes.
"""

from __future__ import annotations

import functools
import numbers

import torch

from .. import dispatch
from ._dtypes import FLOAT_DTYPES, SUPPORTED, UnsupportedDtypeError, check_float, dtype_name
from ._define import define_op
from ..kernel_src._spec import next_power_of_2
from ..kernel_src.rope_cos_sin import BLOCKS

KERNEL = "rope_cos_sin"
MIN_BLOCK, MAX_BLOCK = min(BLOCKS), max(BLOCKS)
#: Output dtypes the kernel is built for.
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def rope_cos_sin_reference(inv_freq: torch.Tensor, position_ids: torch.Tensor, attention_scaling: float,
                           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as transformers' ``LlamaRotaryEmbedding.forward`` computes them (v5.22.2,
    models/llama/modeling_llama.py), with ``x.dtype`` given as ``dtype``: the positions as float32
    times ``inv_freq`` in float32, concatenated with itself, cos and sin in float32 times
    ``attention_scaling``, then cast to ``dtype``. Shapes as :func:`rope_cos_sin`."""
    freqs = position_ids[..., None].float() * inv_freq.to(device=position_ids.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * attention_scaling
    sin = emb.sin() * attention_scaling
    return cos.to(dtype=dtype), sin.to(dtype=dtype)


def _check(inv_freq: torch.Tensor, position_ids: torch.Tensor) -> None:
    check_float("rope_cos_sin", "inv_freq", inv_freq)
    if inv_freq.dim() != 1 or inv_freq.shape[0] < 1:
        raise ValueError(f"rope_cos_sin: inv_freq must be a non-empty 1-D float tensor, got {inv_freq.dtype} "
                         f"{tuple(inv_freq.shape)}")
    if position_ids.is_floating_point() or position_ids.is_complex() or position_ids.dtype == torch.bool:
        raise UnsupportedDtypeError(f"cutile_kernels.rope_cos_sin: position_ids is {dtype_name(position_ids.dtype)}; "
                                    "supported: an integer tensor (int64 for the kernel)")


def _outputs(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype):
    # Contiguous (..., R), as the stock cat/cos/cast chain returns them.
    shape = (*position_ids.shape, 2 * inv_freq.shape[0])
    return (torch.empty(shape, dtype=dtype, device=position_ids.device),
            torch.empty(shape, dtype=dtype, device=position_ids.device))


def unsupported(inv_freq: torch.Tensor, position_ids: torch.Tensor, attention_scaling, dtype: torch.dtype) -> str | None:
    """Why the kernel does not take these (already checked) inputs on CUDA, or None if it does."""
    if inv_freq.device != position_ids.device:
        return f"inv_freq on {inv_freq.device}, position_ids on {position_ids.device}"
    if position_ids.dtype != torch.int64:
        return f"position_ids are {position_ids.dtype} (the kernel takes int64)"
    if dtype not in DTYPES:
        return f"output dtype {dtype} (built: bfloat16, float16, float32)"
    if inv_freq.shape[0] > MAX_BLOCK:
        return f"rotary dim {2 * inv_freq.shape[0]} > {2 * MAX_BLOCK} (the widest tile)"
    if not isinstance(attention_scaling, numbers.Real) or isinstance(attention_scaling, bool):
        return f"attention_scaling is a {type(attention_scaling).__name__}, not a Python number"
    return None


@functools.lru_cache(maxsize=None)
def _want(half: int) -> tuple:
    return (("BLOCK", max(MIN_BLOCK, next_power_of_2(half))),)


def rope_cos_sin_into(inv_freq: torch.Tensor, position_ids: torch.Tensor, attention_scaling: float,
                      cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Launch the kernel on CUDA tensors the kernel takes (:func:`unsupported` is None): ``inv_freq``
    (H,) float32, ``position_ids`` (...) int64, into new contiguous ``cos``/``sin`` (..., 2H).

    Returns False (nothing written) when no cuTile path fits; the caller then falls back.
    """
    half = inv_freq.shape[0]
    pos = position_ids.reshape(-1)  # a view for the (B, S) tensors transformers makes
    n = pos.shape[0]
    args = (inv_freq, pos, cos.view(n, 2, half), sin.view(n, 2, half), float(attention_scaling))
    return dispatch.run(KERNEL, _want(half), args, 2, lambda c: ((n + c["ROWS"] - 1) // c["ROWS"], 1, 1))


def _rope_cos_sin_cuda(inv_freq: torch.Tensor, position_ids: torch.Tensor, attention_scaling: float,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = _outputs(inv_freq, position_ids, dtype)
    if cos.numel() == 0:
        return cos, sin
    why = unsupported(inv_freq, position_ids, attention_scaling, dtype)
    if why is None:
        if rope_cos_sin_into(inv_freq.float(), position_ids, attention_scaling, cos, sin):
            return cos, sin
    else:
        dispatch.fallback(KERNEL, why)
    ref_cos, ref_sin = rope_cos_sin_reference(inv_freq, position_ids, attention_scaling, dtype)
    return cos.copy_(ref_cos), sin.copy_(ref_sin)


def _check_op(inv_freq, position_ids, attention_scaling, dtype) -> None:
    _check(inv_freq, position_ids)


def _fake(inv_freq, position_ids, attention_scaling, dtype):
    return _outputs(inv_freq, position_ids, dtype)


# No gradient: transformers computes the tables under no_grad (rope_cos_sin sends a caller that
# wants one to the reference). The positions pick the device.
_rope_cos_sin = define_op(KERNEL, _rope_cos_sin_cuda, reference=rope_cos_sin_reference, fake=_fake, check=_check_op,
                          backward=None, device_arg=1)


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, attention_scaling: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos/sin tables of rotary position embedding in one launch (transformers' formula).

    Args:
        inv_freq: ``(H,)`` inverse frequencies (radians per position), H = R / 2 for a rotary
            dimension R (``head_dim``, or ``head_dim * partial_rotary_factor``); float32 as the
            rotary embedding holds them (other float dtypes are converted, as transformers does).
        position_ids: ``(B, S)`` (or any shape) integer positions, on the device of the result;
            per-row positions (left padding) and large positions are fine (converted to float32
            as transformers converts them: exact up to 2**24).
        attention_scaling: the rotary embedding's ``attention_scaling`` (1.0 unless yarn /
            longrope scaling sets it); multiplied in float32.
        dtype: the model dtype (transformers passes ``x.dtype``).

    Returns:
        ``(cos, sin)``: contiguous ``(*position_ids.shape, R)`` tensors of ``dtype``, each row
        ``cat(f, f)`` of its H values ``f``.

    On CUDA this runs one cuTile kernel (prebuilt, else JIT) for int64 positions, R <= 256 and
    bfloat16 / float16 / float32 results; other inputs take :func:`rope_cos_sin_reference` and log
    the reason once. On other devices it is :func:`rope_cos_sin_reference` (counted in
    ``stats()["reference_calls"]``). Under ``torch.compile`` it is the custom op
    ``<namespace>::rope_cos_sin`` with a fake implementation; no gradients (transformers computes
    these under ``no_grad``): an input that requires grad takes the reference formula.

    Raises:
        UnsupportedDtypeError: (a ``TypeError`` and ``ValueError``) ``inv_freq`` or ``dtype`` is not
            bfloat16, float16, float32 or float64, or ``position_ids`` is not an integer tensor.
        ValueError: ``inv_freq`` is not a non-empty 1-D tensor.
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
        CudaError: the CUDA driver failed to launch the kernel.
    """
    _check(inv_freq, position_ids)
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedDtypeError(f"cutile_kernels.rope_cos_sin: dtype must be a torch.dtype (torch.bfloat16, ...), "
                                    f"got {type(dtype).__name__} {dtype!r}")
    if dtype not in FLOAT_DTYPES:
        raise UnsupportedDtypeError(f"cutile_kernels.rope_cos_sin: dtype is {dtype_name(dtype)}; supported: {SUPPORTED}")
    if torch.is_grad_enabled() and inv_freq.requires_grad:
        return rope_cos_sin_reference(inv_freq, position_ids, attention_scaling, dtype)
    if torch.compiler.is_compiling():
        if not isinstance(attention_scaling, numbers.Real):
            return rope_cos_sin_reference(inv_freq, position_ids, attention_scaling, dtype)
        attention_scaling = float(attention_scaling)
    return _rope_cos_sin.call_checked(inv_freq, position_ids, attention_scaling, dtype)
