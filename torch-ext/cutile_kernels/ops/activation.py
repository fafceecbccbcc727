"""SiLU and SiLU-and-mul: torch custom ops, fake implementations, functional API.

The math and rounding order are those of transformers' ``LlamaMLP`` (see
``kernel_src/activation.py``): ``act_fn(gate) * up`` with ``act_fn`` = ``nn.functional.silu``.
The ``*_reference`` functions restate it in PyTorch; they are the fallback and the tests' model of
what stock transformers computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import dispatch
from ._dtypes import check_float
from ._define import define_op
from ..kernel_src.activation import TILES


def silu_reference(x: torch.Tensor) -> torch.Tensor:
    """``nn.functional.silu(x)``: what transformers' ``SiLUActivation.forward`` returns (v5.22.2)."""
    return F.silu(x)


def silu_and_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` exactly as ``LlamaMLP.forward`` computes it: silu rounded to gate's
    dtype first, then the product (of dtype ``promote_types(gate.dtype, up.dtype)``)."""
    return F.silu(gate) * up


def silu_and_mul_fused_reference(x: torch.Tensor) -> torch.Tensor:
    """:func:`silu_and_mul_reference` of the two halves of ``x`` (..., 2N): gate first, then up.

    The gate half is made contiguous first, as the stock ``gate_proj`` output is: on the CPU,
    torch's vectorised and strided silu loops differ in the last float32 bit.
    """
    gate, up = x.chunk(2, dim=-1)
    return silu_and_mul_reference(gate.contiguous(), up)


def gelu_tanh_and_mul_fused_reference(x: torch.Tensor) -> torch.Tensor:
    """GeGLU of the two halves of ``x`` (..., 2N) exactly as ``GemmaMLP.forward`` (LlamaMLP's code
    with ``act_fn`` ``gelu_pytorch_tanh``, v5.22.2) computes it on the two GEMM outputs:
    ``gelu(gate, approximate="tanh")`` rounded to gate's dtype, then times ``up``. The gate half is
    made contiguous first, as the stock ``gate_proj`` output is."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate.contiguous(), approximate="tanh") * up


def sigmoid_and_mul_reference(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x * torch.sigmoid(gate)`` as ``Qwen3_5Attention.forward`` computes its output gate
    (v5.22.2): the sigmoid rounded to gate's dtype, then the product (of the promoted dtype). The
    gate is made contiguous first, as stock's ``reshape`` of the strided half makes it (torch's CPU
    sigmoid rounds a strided float32 input differently from a contiguous one)."""
    return x * torch.sigmoid(gate.contiguous())


def _want(rows: int) -> tuple:
    r, b = TILES["row"]  # the one config, at every row count (see kernel_src.activation.TILES)
    return (("ROWS", r), ("BLOCK", b))


def _grid(rows: int, n: int):
    return lambda c: ((rows + c["ROWS"] - 1) // c["ROWS"], (n + c["BLOCK"] - 1) // c["BLOCK"], 1)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])  # a view whenever the leading dims collapse, else a copy


def fused_view(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """The (M, 2, N) view ``x`` of one tensor with ``x[:, 0] == gate`` and ``x[:, 1] == up``, when
    ``gate`` and ``up`` (both (M, N)) are equally strided windows of the same storage with ``up``
    after ``gate`` (e.g. the two halves of a fused gate/up GEMM output); else None."""
    if (gate.dim() != 2 or gate.shape != up.shape or gate.stride() != up.stride() or gate.dtype != up.dtype
            or gate.device != up.device or gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr()):
        return None
    step = up.storage_offset() - gate.storage_offset()
    if step <= 0:
        return None
    (m, n), (s0, s1) = gate.shape, gate.stride()
    return gate.as_strided((m, 2, n), (s0, step, s1), gate.storage_offset())


def silu_and_mul_into(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> bool:
    """Launch SiLU-and-mul on CUDA tensors ``gate``, ``up`` (M, N) into ``out`` (M, N).

    When ``gate`` and ``up`` are the halves of one fused tensor (:func:`fused_view`) this launches
    the fused kernel on that tensor. ``out`` must be a new tensor of gate's dtype (not checked).
    Returns False (nothing written) when no cuTile path fits; the caller then falls back.
    """
    x = fused_view(gate, up)
    if x is not None:
        return silu_and_mul_fused_into(x, out)
    m, n = gate.shape
    return dispatch.run("silu_and_mul", _want(m), (gate, up, out), 2, _grid(m, n))


def silu_and_mul_fused_into(x: torch.Tensor, out: torch.Tensor) -> bool:
    """Launch the fused kernel on a CUDA ``x`` (M, 2, N) (``x[:, 0]`` gate, ``x[:, 1]`` up) into a
    new ``out`` (M, N) of x's dtype. Returns False (nothing written) when no cuTile path fits."""
    m, _, n = x.shape
    return dispatch.run("silu_and_mul_fused", _want(m), (x, out), 1, _grid(m, n))


def silu_into(x: torch.Tensor, out: torch.Tensor) -> bool:
    """Launch SiLU on a CUDA ``x`` (M, N) into a new ``out`` (M, N) of x's dtype. Returns False
    (nothing written) when no cuTile path fits."""
    m, n = x.shape
    return dispatch.run("silu", _want(m), (x, out), 1, _grid(m, n))


def _check_silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape or gate.dim() < 1:
        raise ValueError(f"silu_and_mul: gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")


def _halves_check(name: str):
    def check(x: torch.Tensor) -> None:
        if x.dim() < 1 or x.shape[-1] % 2:
            raise ValueError(f"{name}: last dimension of {tuple(x.shape)} is not even (gate and up halves)")

    return check


def _halves_cuda(kernel: str, reference):
    """The CUDA implementation of an activation-and-mul op on the two halves of ``x`` (..., 2N)."""

    def cuda(x: torch.Tensor) -> torch.Tensor:
        *lead, n2 = x.shape
        n = n2 // 2
        out = torch.empty(*lead, n, dtype=x.dtype, device=x.device)
        m = out.numel() // n if n else 0
        if m * n == 0 or dispatch.run(kernel, _want(m), (x, out), 1, _grid(m, n), _fused_rows_layout):
            return out
        return reference(x).contiguous()

    return cuda


def _silu_and_mul_cuda(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.dtype != up.dtype:
        dispatch.fallback("silu_and_mul", f"gate and up dtypes differ ({gate.dtype}, {up.dtype})")
        return silu_and_mul_reference(gate, up).contiguous()
    g, u = _rows(gate), _rows(up)
    m, n = g.shape  # separate ints and view_as: a torch.Size argument costs the parser ~1.5 us
    out = torch.empty(m, n, dtype=gate.dtype, device=gate.device)
    if m * n == 0 or silu_and_mul_into(g, u, out):
        return out.view_as(gate)
    return silu_and_mul_reference(gate, up).contiguous()


def _fused_rows_layout(args: tuple) -> tuple:
    # x (..., 2N) as (M, 2, N) gate/up rows, out (..., N) as (M, N) (once per plan).
    x, out = args
    n = out.shape[-1]
    return _rows(x).view(-1, 2, n), _rows(out)


def _silu_cuda(x: torch.Tensor) -> torch.Tensor:
    if not x.dim():
        return _silu_cuda(x.view(1)).view_as(x)
    out = torch.empty(*x.shape, dtype=x.dtype, device=x.device)
    n = x.shape[-1]
    m = out.numel() // n if n else 0
    if m * n == 0 or dispatch.run("silu", _want(m), (x, out), 1, _grid(m, n), _rows_layout):
        return out
    return silu_reference(x).contiguous()


def _rows_layout(args: tuple) -> tuple:
    # (..., N) input and output as (M, N) rows (once per plan).
    return tuple(_rows(t) for t in args)


def _check_sigmoid_and_mul(gate: torch.Tensor, x: torch.Tensor) -> None:
    if gate.shape != x.shape or gate.dim() < 1:
        raise ValueError(f"sigmoid_and_mul: gate shape {tuple(gate.shape)} != x shape {tuple(x.shape)}")


def _sigmoid_and_mul_cuda(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if gate.dtype != x.dtype:
        dispatch.fallback("sigmoid_and_mul", f"gate and x dtypes differ ({gate.dtype}, {x.dtype})")
        return sigmoid_and_mul_reference(gate, x).contiguous()
    out = torch.empty(*x.shape, dtype=x.dtype, device=x.device)
    n = x.shape[-1]
    m = out.numel() // n if n else 0
    if m * n == 0 or dispatch.run("sigmoid_and_mul", _want(m), (gate, x, out), 2, _grid(m, n), _rows_layout):
        return out
    return sigmoid_and_mul_reference(gate, x).contiguous()


def _silu_and_mul_fake(gate, up):
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


def _silu_and_mul_fused_fake(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _silu_fake(x):
    return x.new_empty(x.shape)


_silu_and_mul = define_op("silu_and_mul", _silu_and_mul_cuda, reference=silu_and_mul_reference,
                          fake=_silu_and_mul_fake, check=_check_silu_and_mul)
_silu_and_mul_fused = define_op("silu_and_mul_fused",
                                _halves_cuda("silu_and_mul_fused", silu_and_mul_fused_reference),
                                reference=silu_and_mul_fused_reference, fake=_silu_and_mul_fused_fake,
                                check=_halves_check("silu_and_mul_fused"))
_silu = define_op("silu", _silu_cuda, reference=silu_reference, fake=_silu_fake)
_sigmoid_and_mul = define_op("sigmoid_and_mul", _sigmoid_and_mul_cuda, reference=sigmoid_and_mul_reference,
                             fake=_silu_and_mul_fake, check=_check_sigmoid_and_mul)
_gelu_tanh_and_mul_fused = define_op("gelu_tanh_and_mul_fused",
                                     _halves_cuda("gelu_tanh_and_mul_fused", gelu_tanh_and_mul_fused_reference),
                                     reference=gelu_tanh_and_mul_fused_reference, fake=_silu_and_mul_fused_fake,
                                     check=_halves_check("gelu_tanh_and_mul_fused"))


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation ``silu(gate) * up``, with transformers' ``LlamaMLP`` rounding order.

    Args:
        gate: ``(..., N)`` gate projection, any N and rows; bfloat16, float16 or float32. Strided
            rows are fine; the two halves of one fused ``(..., 2N)`` GEMM output (``x[..., :N]``,
            ``x[..., N:]``) are recognised and read in one pass by the fused kernel.
        up: ``(..., N)`` up projection, same shape (and, for the kernel, dtype) as ``gate``.

    Returns:
        ``(..., N)`` contiguous tensor of dtype ``promote_types(gate.dtype, up.dtype)``:
        ``silu(gate)`` computed in float32 and rounded to the dtype, times ``up``, rounded.

    On CUDA this runs a cuTile kernel (prebuilt, else JIT); inputs the kernels cannot take (mixed
    dtypes, float64, overlapping inputs, no build for the GPU) take :func:`silu_and_mul_reference`
    and log the reason once. On other devices it is the reference. Under ``torch.compile`` or
    when an input requires grad it is the custom op ``<namespace>::silu_and_mul`` (fake
    implementation; gradients from the reference formula).

    Raises:
        TypeError: a tensor is not bfloat16, float16, float32 or float64.
        ValueError: ``gate`` and ``up`` differ in shape.
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
        CudaError: the CUDA driver failed to launch the kernel.
    """
    check_float("silu_and_mul", "gate, up", gate, up)
    return _silu_and_mul(gate, up)


def silu_and_mul_fused(x: torch.Tensor) -> torch.Tensor:
    """:func:`silu_and_mul` of the halves of ``x`` (..., 2N): ``silu(x[..., :N]) * x[..., N:]``.

    ``x`` is what one GEMM on the fused weight ``[gate; up]`` returns (vLLM's ``SiluAndMul``
    convention). Returns a contiguous ``(..., N)`` tensor of x's dtype.

    Raises:
        TypeError: ``x`` is not bfloat16, float16, float32 or float64.
        ValueError: the last dimension is odd.
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
        CudaError: the CUDA driver failed to launch the kernel.
    """
    check_float("silu_and_mul_fused", "x", x)
    return _silu_and_mul_fused(x)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``nn.functional.silu(x)`` (transformers' ``SiLUActivation``): float32 math, one rounding.

    ``x``: any shape, bfloat16, float16 or float32 for the kernel (others take the reference).
    Returns a contiguous tensor of x's shape and dtype. Raises as :func:`silu_and_mul`.
    """
    check_float("silu", "x", x)
    return _silu(x)


def gelu_tanh_and_mul_fused(x: torch.Tensor) -> torch.Tensor:
    """GeGLU on a fused gate/up GEMM output: ``gelu(x[..., :N], approximate="tanh") * x[..., N:]``,
    with Gemma's MLP rounding order (the activation rounded to the dtype, then the product).

    Args:
        x: ``(..., 2N)``, gate half first; bfloat16, float16 or float32 for the kernel.

    Returns:
        A contiguous ``(..., N)`` tensor of x's dtype.

    On CUDA this runs a cuTile kernel (prebuilt, else JIT); other inputs take
    :func:`gelu_tanh_and_mul_fused_reference` and log the reason once. Under ``torch.compile`` or
    when an input requires grad it is the custom op ``<namespace>::gelu_tanh_and_mul_fused``
    (gradients from the reference).

    Raises:
        TypeError: ``x`` is not bfloat16, float16, float32 or float64.
        ValueError: the last dimension is odd.
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
        CudaError: the CUDA driver failed to launch the kernel.
    """
    check_float("gelu_tanh_and_mul_fused", "x", x)
    return _gelu_tanh_and_mul_fused(x)


def sigmoid_and_mul(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Gated attention's output gate ``x * sigmoid(gate)`` in one launch, with the rounding order
    of transformers' ``Qwen3_5Attention.forward`` (v5.22.2): the sigmoid computed in float32 and
    rounded to the dtype, then the product rounded (Qiu et al. 2025, "Gated Attention for Large
    Language Models").

    Args:
        gate: ``(..., N)`` gate, any rows whose leading dims collapse to one stride (Qwen3.5 passes
            the gate half of each head of the q projection, ``(B, S, H, D)`` with row stride 2D, read
            in place); bfloat16, float16 or float32.
        x: ``(..., N)`` the attention output, same shape (and, for the kernel, dtype) as ``gate``.

    Returns:
        ``(..., N)`` contiguous tensor of dtype ``promote_types(gate.dtype, x.dtype)``.

    On CUDA this runs a cuTile kernel (prebuilt, else JIT); other inputs (mixed dtypes, float64,
    rows that do not collapse, no build) take :func:`sigmoid_and_mul_reference` and log the reason
    once. On other devices it is the reference. Under ``torch.compile`` or when an input requires
    grad it is the custom op ``<namespace>::sigmoid_and_mul`` (gradients from the reference).

    Raises:
        TypeError: a tensor is not bfloat16, float16, float32 or float64.
        ValueError: ``gate`` and ``x`` differ in shape.
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
        CudaError: the CUDA driver failed to launch the kernel.
    """
    check_float("sigmoid_and_mul", "gate, x", gate, x)
    return _sigmoid_and_mul(gate, x)
