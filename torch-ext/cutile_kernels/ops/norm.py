"""RMSNorm and fused residual-add + RMSNorm: torch custom ops, fake implementations, functional API.

The math and rounding order are those of transformers' ``LlamaRMSNorm`` (see
``kernel_src/norm.py``); :func:`rms_norm_reference` restates them in PyTorch and is both the
fallback and the test oracle's model. :func:`rms_norm_gemma` is the other order transformers uses
(``GemmaRMSNorm``, ``Olmo2RMSNorm``): float32 throughout, one rounding at the end;
:func:`rms_norm_add_gemma` adds the residual after it (OLMo 2's post-norm blocks).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .. import dispatch
from ._dtypes import check_float
from ._define import contiguous, define_op
from ..kernel_src._spec import next_power_of_2
from ..kernel_src.norm import (BLOCK_NS, CHUNK, DECODE_MAX_ROWS, GATED_BLOCK_NS, HIDDEN_BLOCK_NS, MAX_BLOCK_N,
                               MID_ROWS, MID_WAVE_BLOCKS, ROWS)
from ..registry import DECODE_TORCH_DTYPES

MIN_BLOCK_N = min(BLOCK_NS)

def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm exactly as transformers' ``LlamaRMSNorm.forward`` computes it (v5.22.2).

    Normalises in float32, rounds to ``x.dtype``, then multiplies by ``weight`` (so the result
    has ``torch.promote_types(weight.dtype, x.dtype)``).
    """
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (the decoder layer's residual add), then ``(rms_norm(s), s)``."""
    s = x + residual
    return rms_norm_reference(s, weight, eps), s


def rms_norm_gemma_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """RMSNorm as transformers' ``GemmaRMSNorm.forward`` computes it (v5.22.2; Gemma 2 and 3 and
    Qwen3.5's norms copy it) with ``offset=1.0``, and as ``Olmo2RMSNorm.forward`` with ``offset=0.0``:
    normalise in float32, multiply by ``offset + weight`` in float32, round once to ``x.dtype``."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (offset + weight.float())).to(x.dtype)


def add_rms_norm_gemma_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                 offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (the decoder layer's residual add), then ``(rms_norm_gemma(s), s)``:
    Qwen3.5's ``residual + hidden_states`` and ``post_attention_layernorm`` (v5.22.2)."""
    s = x + residual
    return rms_norm_gemma_reference(s, weight, eps, offset), s


def rms_norm_add_gemma_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                 offset: float) -> torch.Tensor:
    """``residual + rms_norm_gemma(x)``: OLMo 2's post-norm block, ``post_attention_layernorm`` (or
    ``post_feedforward_layernorm``) of the sublayer's output, then ``residual + hidden_states``
    (``Olmo2DecoderLayer.forward``, v5.22.2; ``offset=0.0``)."""
    return residual + rms_norm_gemma_reference(x, weight, eps, offset)


def rms_norm_gated_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm exactly as transformers' ``Qwen3_5RMSNormGated.forward`` computes it (v5.22.2;
    hub name ``RMSNormGated``): :func:`rms_norm_reference`, then times ``silu(gate.float())``,
    rounded to ``x.dtype``."""
    return (rms_norm_reference(x, weight, eps) * F.silu(gate.to(torch.float32))).to(x.dtype)


def _check_shapes(x: torch.Tensor, weight: torch.Tensor, name: str) -> None:
    if x.dim() < 1:
        raise ValueError(f"{name}: input of shape {tuple(x.shape)} has no hidden dimension to normalise")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{name}: weight of shape {tuple(weight.shape)} does not match hidden size "
                         f"{x.shape[-1]} of input {tuple(x.shape)}")


def _check_pair(x: torch.Tensor, other: torch.Tensor, weight: torch.Tensor, name: str, what: str) -> None:
    # The norm's checks, and a second input of x's shape (the residual, or the gate).
    _check_shapes(x, weight, name)
    if other.shape != x.shape:
        raise ValueError(f"{name}: {what} shape {tuple(other.shape)} != input shape {tuple(x.shape)}")


@functools.lru_cache(maxsize=None)
def _tile(n: int, decode: bool, min_block: int = MIN_BLOCK_N) -> tuple:
    if n > MAX_BLOCK_N:
        return (("CHUNK", CHUNK),)
    block = (("BLOCK_N", max(min_block, next_power_of_2(n))),)
    return block + (("ROWS", 1),) if decode else block


def _want(x: torch.Tensor, rows: int, min_block: int = MIN_BLOCK_N) -> tuple:
    """The constants to ask for: the row width's tile, at least ``min_block`` lanes (a kernel built
    for wide rows only runs a narrower row padded); one row per block for a decode step's few rows
    (``DECODE_MAX_ROWS``) of a 16-bit dtype, whose prefill tile would be mostly padding."""
    return _tile(x.shape[-1], rows <= DECODE_MAX_ROWS and x.dtype in DECODE_TORCH_DTYPES, min_block)


def _mid_want(kind: str, x: torch.Tensor, rows: int, min_block: int) -> tuple | None:
    """The middle tile's constants (``ROWS=MID_ROWS``) for a fused add + norm of ``rows`` rows (a
    prefill of a few hundred tokens) where its block count is nearer one wave than the prefill
    tile's (a CUDA tensor's device's multiprocessor count; ``MID_WAVE_BLOCKS`` elsewhere), for a
    16-bit dtype and a hidden width it is built for; else None."""
    if rows <= DECODE_MAX_ROWS or x.dtype not in DECODE_TORCH_DTYPES:
        return None
    wave = dispatch.sm_count(x.get_device()) if x.is_cuda else MID_WAVE_BLOCKS
    return _mid_tile(kind, x.shape[-1], rows, min_block, wave)


@functools.lru_cache(maxsize=4096)
def _mid_tile(kind: str, n: int, rows: int, min_block: int, wave: int) -> tuple | None:
    # _mid_want's choice for a row width, row count and wave (once per shape: prefill lengths repeat).
    block = _tile(n, False, min_block)
    bn = block[0][1] if block[0][0] == "BLOCK_N" else None
    if bn not in HIDDEN_BLOCK_NS or ROWS[(kind, "aligned")][bn] <= MID_ROWS:
        return None
    prefill, mid = -(-rows // ROWS[(kind, "aligned")][bn]), -(-rows // MID_ROWS)
    if abs(mid - wave) >= abs(prefill - wave):
        return None
    return block + (("ROWS", MID_ROWS),)


def _grid(rows: int):
    return lambda consts: ((rows + consts["ROWS"] - 1) // consts["ROWS"], 1, 1)


def _rows_layout(args: tuple) -> tuple:
    # (..., N) tensors as the kernels' (M, N) rows, the weight and eps as they are (once per plan).
    return tuple(a.reshape(-1, a.shape[-1]) if isinstance(a, torch.Tensor) and a.dim() != 1 else a for a in args)


def _run_fused(kind: str, x: torch.Tensor, rows: int, args: tuple, min_block: int = MIN_BLOCK_N,
               layout=_rows_layout) -> bool:
    """``dispatch.run`` of a fused add + norm kind (``kernel_src.norm.MID_KINDS``) over ``rows`` rows,
    its arguments laid out by ``layout`` (None: already ``(rows, N)``): the middle tile where
    :func:`_mid_want` asks for it and an aligned variant takes the operands (tried quietly: a
    generic layout then takes its own tile), else the usual tile."""
    mid = _mid_want(kind, x, rows, min_block)
    if mid is not None and dispatch.run(kind, mid, args, 3, _grid(rows), layout, optional=True):
        return True
    return dispatch.run(kind, _want(x, rows, min_block), args, 3, _grid(rows), layout)


def _check_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    _check_shapes(x, weight, "rms_norm")


def _check_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    _check_pair(x, residual, weight, "add_rms_norm", "residual")


def _rms_norm_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() == 1:
        return _rms_norm_cuda(x.view(1, -1), weight, eps).view_as(x)
    # The output has x's shape (sizes as separate ints: a torch.Size argument costs torch's
    # argument parser ~1.5 us more per call); the rows views are made once per call signature.
    y = torch.empty(*x.shape, dtype=x.dtype, device=x.device)
    rows = y.numel() // x.shape[-1]
    if y.numel() == 0 or dispatch.run("rms_norm", _want(x, rows), (x, weight, y, float(eps)), 2, _grid(rows),
                                      _rows_layout):
        return y
    return rms_norm_reference(x, weight, eps).contiguous()


def rms_norm_into(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, eps: float) -> bool:
    """Launch the RMSNorm kernel on CUDA tensors ``x`` (M, N), ``weight`` (N,) into ``y`` (M, N).

    ``y`` must be a new tensor of x's dtype (it is not checked, and must not alias the inputs).
    Returns False (nothing written) when no cuTile path fits; the caller then falls back.
    """
    return dispatch.run("rms_norm", _want(x, x.shape[0]), (x, weight, y, float(eps)), 2, _grid(x.shape[0]))


def _add_rms_norm_cuda(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() == 1:
        y, s = _add_rms_norm_cuda(x.view(1, -1), residual.view(1, -1), weight, eps)
        return y.view_as(x), s.view_as(x)
    y = torch.empty(*x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(*x.shape, dtype=x.dtype, device=x.device)
    rows = y.numel() // x.shape[-1]
    if y.numel() == 0 or _run_fused("add_rms_norm", x, rows, (x, residual, weight, y, s, float(eps))):
        return y, s
    return contiguous(add_rms_norm_reference(x, residual, weight, eps))


def add_rms_norm_into(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, y: torch.Tensor,
                      residual_out: torch.Tensor, eps: float) -> bool:
    """Launch the fused kernel on CUDA tensors: ``x``, ``residual``, ``y``, ``residual_out`` (M, N),
    ``weight`` (N,). The outputs must be new tensors of x's dtype (not checked). Returns False
    (nothing written) when no cuTile path fits."""
    return _run_fused("add_rms_norm", x, x.shape[0], (x, residual, weight, y, residual_out, float(eps)), layout=None)


def _check_rms_norm_gemma(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> None:
    _check_shapes(x, weight, "rms_norm_gemma")


def _rms_norm_gemma_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    if x.dim() == 1:
        return _rms_norm_gemma_cuda(x.view(1, -1), weight, eps, offset).view_as(x)
    y = torch.empty(*x.shape, dtype=x.dtype, device=x.device)
    rows = y.numel() // x.shape[-1]
    if y.numel() == 0 or dispatch.run("rms_norm_gemma", _want(x, rows), (x, weight, y, float(eps), float(offset)), 2,
                                      _grid(rows), _rows_layout):
        return y
    return rms_norm_gemma_reference(x, weight, eps, offset).contiguous()


def _check_add_rms_norm_gemma(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                              offset: float) -> None:
    _check_pair(x, residual, weight, "add_rms_norm_gemma", "residual")


def _add_rms_norm_gemma_cuda(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                             offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() == 1:
        y, s = _add_rms_norm_gemma_cuda(x.view(1, -1), residual.view(1, -1), weight, eps, offset)
        return y.view_as(x), s.view_as(x)
    y = torch.empty(*x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(*x.shape, dtype=x.dtype, device=x.device)
    rows = y.numel() // x.shape[-1]
    # Its tiles start at 512 lanes (hidden sizes): a tiny model's narrower rows run padded.
    if y.numel() == 0 or _run_fused("add_rms_norm_gemma", x, rows,
                                    (x, residual, weight, y, s, float(eps), float(offset)), HIDDEN_BLOCK_NS[0]):
        return y, s
    return contiguous(add_rms_norm_gemma_reference(x, residual, weight, eps, offset))


def _check_rms_norm_add_gemma(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                              offset: float) -> None:
    _check_pair(x, residual, weight, "rms_norm_add_gemma", "residual")


def _rms_norm_add_gemma_cuda(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                             offset: float) -> torch.Tensor:
    if x.dim() == 1:
        return _rms_norm_add_gemma_cuda(x.view(1, -1), residual.view(1, -1), weight, eps, offset).view_as(x)
    y = torch.empty(*x.shape, dtype=x.dtype, device=x.device)
    rows = y.numel() // x.shape[-1]
    # Hidden-size tiles (512 lanes and up) as the fused add's; 16-bit variants only.
    if y.numel() == 0 or _run_fused("rms_norm_add_gemma", x, rows, (x, residual, weight, y, float(eps), float(offset)),
                                    HIDDEN_BLOCK_NS[0]):
        return y
    return rms_norm_add_gemma_reference(x, residual, weight, eps, offset).contiguous()


def _check_rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    _check_pair(x, gate, weight, "rms_norm_gated", "gate")


def _rms_norm_gated_cuda(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() == 1:
        return _rms_norm_gated_cuda(x.view(1, -1), gate.view(1, -1), weight, eps).view_as(x)
    y = torch.empty(*x.shape, dtype=x.dtype, device=x.device)
    rows = y.numel() // x.shape[-1]
    if y.numel() == 0:
        return y
    if x.shape[-1] > GATED_BLOCK_NS[-1]:
        dispatch.fallback("rms_norm_gated", f"rows of {x.shape[-1]} > {GATED_BLOCK_NS[-1]}")
    elif dispatch.run("rms_norm_gated", _want(x, rows), (x, gate, weight, y, float(eps)), 3, _grid(rows),
                      _rows_layout):
        return y
    return rms_norm_gated_reference(x, gate, weight, eps).contiguous()


def _rms_norm_add_gemma_fake(x, residual, weight, eps, offset):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))


def _rms_norm_gated_fake(x, gate, weight, eps):
    return x.new_empty(x.shape)


def _rms_norm_gemma_fake(x, weight, eps, offset):
    return x.new_empty(x.shape)


def _rms_norm_fake(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))


def _add_rms_norm_fake(x, residual, weight, eps):
    s_dtype = torch.promote_types(x.dtype, residual.dtype)
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, s_dtype)), x.new_empty(x.shape, dtype=s_dtype)


def _add_rms_norm_gemma_fake(x, residual, weight, eps, offset):
    s_dtype = torch.promote_types(x.dtype, residual.dtype)
    return x.new_empty(x.shape, dtype=s_dtype), x.new_empty(x.shape, dtype=s_dtype)


_rms_norm = define_op("rms_norm", _rms_norm_cuda, reference=rms_norm_reference, fake=_rms_norm_fake,
                      check=_check_rms_norm)
_rms_norm_gemma = define_op("rms_norm_gemma", _rms_norm_gemma_cuda, reference=rms_norm_gemma_reference,
                            fake=_rms_norm_gemma_fake, check=_check_rms_norm_gemma)
_rms_norm_gated = define_op("rms_norm_gated", _rms_norm_gated_cuda, reference=rms_norm_gated_reference,
                            fake=_rms_norm_gated_fake, check=_check_rms_norm_gated)
_add_rms_norm = define_op("add_rms_norm", _add_rms_norm_cuda, reference=add_rms_norm_reference,
                          fake=_add_rms_norm_fake, check=_check_add_rms_norm)
_add_rms_norm_gemma = define_op("add_rms_norm_gemma", _add_rms_norm_gemma_cuda, reference=add_rms_norm_gemma_reference,
                                fake=_add_rms_norm_gemma_fake, check=_check_add_rms_norm_gemma)
_rms_norm_add_gemma = define_op("rms_norm_add_gemma", _rms_norm_add_gemma_cuda, reference=rms_norm_add_gemma_reference,
                                fake=_rms_norm_add_gemma_fake, check=_check_rms_norm_add_gemma)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension, with transformers' ``LlamaRMSNorm`` rounding order.

    Args:
        x: ``(..., N)`` activations, any N, any number of rows, rows may be strided;
            bfloat16, float16 or float32.
        weight: ``(N,)`` scale, same dtype as ``x`` for the cuTile kernel.
        eps: added to the mean square before the reciprocal square root.

    Returns:
        ``(..., N)`` contiguous tensor of dtype ``promote_types(weight.dtype, x.dtype)``.

    On CUDA this runs a cuTile kernel (prebuilt, else JIT); inputs the kernels cannot take (mixed
    dtypes, float64, aliasing operands, no build for the GPU) take :func:`rms_norm_reference` and
    log the reason once. On other devices it is :func:`rms_norm_reference`. Under
    ``torch.compile``, or when an input requires grad, it is the custom op
    ``<namespace>::rms_norm`` (fake implementation; gradients from the reference formula).

    Raises:
        TypeError: a tensor is not bfloat16, float16, float32 or float64.
        ValueError: ``weight`` is not ``(N,)``.
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
        CudaError: the CUDA driver failed to launch the kernel.
    """
    check_float("rms_norm", "x, weight", x, weight)
    return _rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm: ``s = x + residual``; returns ``(rms_norm(s, weight), s)``.

    ``s`` is rounded to the input dtype before it is normalised, as the decoder layer's separate
    add does. Shapes and dtypes as :func:`rms_norm`, with ``residual`` shaped like ``x``; both
    outputs are new contiguous tensors.

    Raises:
        TypeError: a tensor is not bfloat16, float16, float32 or float64.
        ValueError: mismatched shapes.
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
        CudaError: the CUDA driver failed to launch the kernel.
    """
    check_float("add_rms_norm", "x, residual, weight", x, residual, weight)
    return _add_rms_norm(x, residual, weight, eps)


def rms_norm_gemma(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 1.0) -> torch.Tensor:
    """RMSNorm in Gemma's rounding order: ``((x / rms(x)) * (offset + weight)).to(x.dtype)``, all
    in float32 (transformers' ``GemmaRMSNorm``; ``Olmo2RMSNorm`` with ``offset=0.0``).

    Args:
        x: ``(..., N)`` activations, any N and rows, rows may be strided; bfloat16, float16 or
            float32.
        weight: ``(N,)``; same dtype as ``x`` for the cuTile kernel. Gemma stores ``weight``
            around 0 and multiplies by ``1 + weight`` (``offset=1.0``); OLMo 2 multiplies by
            ``weight`` (``offset=0.0``).
        eps: added to the mean square (Gemma's ``self.eps``, OLMo 2's ``variance_epsilon``).
        offset: added to the weight in float32 before the multiply.

    Returns:
        ``(..., N)`` contiguous tensor of ``x.dtype``.

    On CUDA this runs a cuTile kernel (prebuilt, else JIT); other inputs (mixed dtypes, float64,
    no build) take :func:`rms_norm_gemma_reference` and log the reason once. Under
    ``torch.compile`` or when an input requires grad it is the custom op
    ``<namespace>::rms_norm_gemma`` (gradients from the reference).

    Raises:
        TypeError: a tensor is not bfloat16, float16, float32 or float64.
        ValueError: ``weight`` is not ``(N,)``.
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
        CudaError: the CUDA driver failed to launch the kernel.
    """
    check_float("rms_norm_gemma", "x, weight", x, weight)
    return _rms_norm_gemma(x, weight, float(eps), float(offset))


def add_rms_norm_gemma(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                       offset: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm in Gemma's rounding order: ``s = x + residual``; returns
    ``(rms_norm_gemma(s, weight, eps, offset), s)``.

    ``s`` is rounded to the input dtype before it is normalised, as the decoder layer's separate
    add does (Qwen3.5's ``hidden_states = residual + hidden_states`` then its ``(1 + weight)``
    ``post_attention_layernorm``). Shapes, dtypes and ``offset`` as :func:`rms_norm_gemma`, with
    ``residual`` shaped like ``x`` (the kernel: of x's dtype; rows narrower than 512 run padded
    in its narrowest tile); both outputs are new contiguous tensors of the dtype ``x + residual``
    has.

    Raises:
        TypeError: a tensor is not bfloat16, float16, float32 or float64.
        ValueError: mismatched shapes.
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
        CudaError: the CUDA driver failed to launch the kernel.
    """
    check_float("add_rms_norm_gemma", "x, residual, weight", x, residual, weight)
    return _add_rms_norm_gemma(x, residual, weight, float(eps), float(offset))


def rms_norm_add_gemma(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                       offset: float = 0.0) -> torch.Tensor:
    """Fused RMSNorm + residual add in the post-norm order: ``residual + rms_norm_gemma(x, weight,
    eps, offset)``, the norm rounded to ``x.dtype`` before the add, as OLMo 2's decoder layer
    computes ``residual + post_attention_layernorm(hidden_states)`` (``Olmo2DecoderLayer``,
    transformers v5.22.2; Xiong et al. 2020, "On Layer Normalization in the Transformer
    Architecture", for the post-norm block).

    Args:
        x: ``(..., N)`` sublayer output, any N and rows, rows may be strided; bfloat16 or float16
            for the kernel (float32 takes the reference).
        residual: shaped like ``x``, same dtype for the kernel.
        weight: ``(N,)``, same dtype as ``x`` for the kernel.
        eps: added to the mean square (OLMo 2's ``variance_epsilon``).
        offset: added to the weight in float32 (OLMo 2: 0.0; Gemma's ``1 + weight``: 1.0).

    Returns:
        ``(..., N)`` contiguous tensor of the dtype ``x + residual`` has: the new residual stream.

    On CUDA a cuTile kernel (rows narrower than 512 run padded in its narrowest tile); other inputs
    take :func:`rms_norm_add_gemma_reference` and log the reason once. Under ``torch.compile`` the
    custom op ``<namespace>::rms_norm_add_gemma`` (gradients from the reference).

    Raises:
        TypeError: a tensor is not bfloat16, float16, float32 or float64.
        ValueError: mismatched shapes.
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
        CudaError: the CUDA driver failed to launch the kernel.
    """
    check_float("rms_norm_add_gemma", "x, residual, weight", x, residual, weight)
    return _rms_norm_add_gemma(x, residual, weight, float(eps), float(offset))


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Gated RMSNorm (gated DeltaNet's output norm): ``(rms_norm(x, weight) * silu(gate)).to(x.dtype)``,
    the norm in Llama's rounding order, the gate's SiLU and the product in float32 (transformers'
    ``Qwen3_5RMSNormGated``, hub name ``RMSNormGated``; Yang et al. 2024, arXiv:2412.06464).

    Args:
        x: ``(..., N)`` activations (N <= 256 for the kernel: one head's values); bfloat16,
            float16 or float32.
        gate: shaped like ``x`` (the ``z`` projection).
        weight: ``(N,)``, same dtype as ``x`` for the kernel.
        eps: added to the mean square.

    Returns:
        ``(..., N)`` contiguous tensor of ``x.dtype``.

    On CUDA a cuTile kernel; otherwise, or for other dtypes and widths,
    :func:`rms_norm_gated_reference`, logging the reason once. Under ``torch.compile`` the custom
    op ``<namespace>::rms_norm_gated`` (gradients from the reference).

    Raises:
        TypeError: a tensor is not bfloat16, float16, float32 or float64.
        ValueError: ``weight`` is not ``(N,)`` or ``gate`` is not shaped like ``x``.
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
    """
    check_float("rms_norm_gated", "x, gate, weight", x, gate, weight)
    return _rms_norm_gated(x, gate, weight, eps)
