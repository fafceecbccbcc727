"""One-row linear projection (GEMV): torch custom op, reference, and the linear router.

Semantics: ``F.linear(x, weight, bias)`` (``nn.Linear``'s forward) for an ``x`` holding one row:
``(..., K)`` whose leading dimensions multiply to 1, weight ``(N, K)``, bias ``(N,)`` or None.
The kernel (``kernel_src/gemv.py``) sums in float32 and rounds once, as cuBLAS does for bf16/fp16;
the order of the sum differs, so results match ``F.linear`` to the dtype's rounding, not bitwise.

:func:`linear` is what the model's projections call (patch ``gemv``, ``layers/linear.py``): one row
of a 16-bit dtype, in a compiled or captured step, with an output width where the GEMV wins, goes to
:func:`gemv`; everything else (prefill, a decode batch, float32, eager steps, wide projections) to
``F.linear`` (cuBLAS).

:func:`gemv_swiglu` / :func:`gemv_geglu`: the down projection of a gated MLP on its stacked gate/up row,
``F.linear(silu_and_mul_fused(x), weight)`` (GeGLU: ``gelu_tanh_and_mul_fused``) in one launch, the
activation computed as the weight is swept (bit for bit the two launches it replaces, on the same
tile). :func:`glu_linear` routes as :func:`linear` does, on the tiles of :data:`GLU_TILES` (none
yet: the H200 rejected the fused kernel on Llama's shape); the fused MLP forwards
(``layers/mlp.py``) call it through ``layers/_direct.glu_linear`` where the down projection carries
patch ``gemv``.

:func:`gemv_residual`: a decoder layer's last line, ``residual + down_proj(h)`` for one row, the add in
the GEMV's epilogue (bit for bit :func:`gemv` and the 16-bit add). :func:`linear_residual` routes as
:func:`linear` does, on the tiles of :data:`RESIDUAL_TILES` (none yet: not yet run on a GPU); the fused
decoder forward calls it where a layer hands nothing to the next (``layers/mlp.residual_forward``: a
compiled step, a graph step's last layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import dispatch
from ._dtypes import check_float
from ._define import define_op
from ..kernel_src.gemv import DTYPES as _DTYPE_NAMES
from ..kernel_src.gemv import GLU
from .activation import (gelu_tanh_and_mul_fused, gelu_tanh_and_mul_fused_reference, silu_and_mul_fused,
                         silu_and_mul_fused_reference)

#: Dtypes the kernel is built for.
DTYPES = tuple(getattr(torch, d) for d in _DTYPE_NAMES)
#: Tensor classes the router sends to the op: a subclass (a quantized or sharded weight put in place
#: after the patch) keeps ``F.linear``, which dispatches to its own implementation.
_PLAIN = (torch.Tensor, torch.nn.Parameter)

#: (largest N, (BN, BK)): the tile for a projection of output width N, smallest N first; wider
#: projections stay on cuBLAS. Measured on the H200 (dev/microbench/gemv_bench.py, 2026-12-03; one
#: bf16 row, weights streamed from HBM): on N <= 2048 ours won everywhere swept (Qwen3-0.6B's o_proj
#: 1024 x 2048: cuBLAS 13.0 us, ours 3.6; Llama-3.2-1B's down_proj 2048 x 8192: 14.0 against 11.4);
#: wider, cuBLAS won on gate/up and lm_head (3.6-4.1 TB/s) and ours by at most 13 % elsewhere, with a
#: tile that then lost on the others. K is not looked at: the sweep's K ran 1024-8192 (not measured
#: beyond: Qwen2.5-1.5B's down_proj, K 8960, takes the GEMV unmeasured).
TILE_BY_N = ((1024, (8, 512)), (2048, (16, 256)))


#: (N, K) weights wider than :data:`TILE_BY_N` that the router also sends to the GEMV (its widest tile)
#: in a CUDA-graph capture with programmatic dependent launch on sm_90 or newer (:func:`~..dispatch.twins_now`:
#: the decode graphs' steps): the shapes measured so. Llama-3.2-1B's stacked q/k/v (3072 x 2048): the
#: batch-1 replay 1.177 against 1.186 ms and 1.207 against 1.219 with cuBLAS's GEMM (two A/Bs, H100,
#: 2026-12-07); without the wait (a compiled step, sm_8x) cuBLAS's 7.4 us beat the GEMV's 8.6 on it.
PDL_SHAPES = ((3072, 2048),)


def tile_for(n: int, k: int) -> tuple[int, int] | None:
    """The (BN, BK) tile launched for an (N, K) weight, or None where cuBLAS is faster (N > 2048)."""
    for limit, tile in TILE_BY_N:
        if n <= limit:
            return tile
    return None


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: what ``nn.Linear.forward`` returns (torch 2.13)."""
    return F.linear(x, weight, bias)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, name: str = "gemv") -> None:
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{name}: x {tuple(x.shape)} must be (..., K) and weight {tuple(weight.shape)} (N, K) with "
                         f"the same K (x's last dimension {x.shape[-1] if x.dim() else None})")
    if x.numel() != x.shape[-1]:
        raise ValueError(f"{name}: x {tuple(x.shape)} must hold exactly one row (its leading dimensions multiply to 1)")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{name}: bias {tuple(bias.shape)} must be (N,) = ({weight.shape[0]},)")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"{name}: x, weight{'' if bias is None else ' and bias'} must share a dtype; got {x.dtype}, "
                         f"{weight.dtype}{'' if bias is None else ', ' + str(bias.dtype)}")


def _one_row(args: tuple) -> tuple:
    # x (..., K) and out (..., N) as (1, K) and (1, N) views; weight and bias as they are.
    x, *rest, out = args
    return (x.reshape(1, x.shape[-1]), *rest, out.reshape(1, out.shape[-1]))


def gemv_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
              tile: tuple[int, int] | None = None) -> bool:
    """Launch the GEMV on CUDA ``x`` (..., K) of one row, ``weight`` (N, K), ``bias`` (N,) or None
    into a new ``out`` (..., N) of x's dtype, with the (BN, BK) ``tile`` (default :func:`tile_for`'s,
    else the last of :data:`TILE_BY_N` for a wide weight called directly). Returns False (nothing
    written, the reason logged) when no built variant takes the call; the caller then falls back."""
    if bias is None:
        return _launch("gemv", (x, weight, out), weight, tile, _one_row)
    return _launch("gemv_bias", (x, weight, bias, out), weight, tile, _one_row)


def _launch(kernel: str, args: tuple, weight: torch.Tensor, tile: tuple[int, int] | None, layout) -> bool:
    # One launch of a GEMV-family kernel over weight (N, K): a block per BN output rows; every
    # argument but the last (the output) an input. The tile as gemv_into documents it.
    n, k = weight.shape
    bn, bk = tile or tile_for(n, k) or TILE_BY_N[-1][1]
    grid = lambda c: (-(-n // c["BN"]), 1, 1)  # noqa: E731
    return dispatch.run(kernel, (("BN", bn), ("BK", bk)), args, len(args) - 1, grid, layout)


def _gemv_cuda(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    n, k = weight.shape
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand_as(out))
    if x.dtype not in DTYPES:
        dispatch.fallback("gemv", f"dtype {x.dtype} (built: {', '.join(_DTYPE_NAMES)})")
        return gemv_reference(x, weight, bias).contiguous()
    return out if gemv_into(x, weight, bias, out) else gemv_reference(x, weight, bias).contiguous()


def _gemv_fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


_gemv = define_op("gemv", _gemv_cuda, reference=gemv_reference, fake=_gemv_fake, check=_check)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for one row, on the cuTile GEMV kernel.

    Args:
        x: ``(..., K)`` holding exactly one row (e.g. ``(1, 1, K)``: one decode token), any strides
            whose row is contiguous.
        weight: ``(N, K)``, row-major (``nn.Linear.weight``), x's dtype.
        bias: ``(N,)`` of x's dtype, or None.

    Returns:
        ``(..., N)`` of x's dtype, contiguous; float32 sums rounded once to the dtype.

    On CUDA one cuTile launch for bfloat16 and float16 when the weight's rows are contiguous,
    16-byte aligned and K is a multiple of 16 (what real hidden sizes are); otherwise, or with
    ``CUTILE_KERNELS_DISABLE=1``, :func:`gemv_reference` (``F.linear``), logging the reason once.
    Under ``torch.compile`` the custom op ``<namespace>::gemv``.

    Raises:
        TypeError: a tensor is not floating point.
        ValueError: x holds more than one row, shapes or dtypes do not match.
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
    """
    check_float("gemv", "x, weight, bias", x, weight, bias, kernel_dtypes=DTYPES)
    _check(x, weight, bias)
    return _gemv.call_checked(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, with a one-row input of a 16-bit dtype on :func:`gemv` where
    that beats cuBLAS (output width N <= 2048, :data:`TILE_BY_N`; the shapes of :data:`PDL_SHAPES` in a
    capture with programmatic dependent launch) and the GPU sets the pace: while
    ``torch.compile`` traces, or while a CUDA graph is being captured (the decode fast path).

    Shapes as ``F.linear``: ``x (..., K)``, ``weight (N, K)``, ``bias (N,)`` or None; returns
    ``(..., N)``. Any other input (more than one row, float32, dtypes that differ, a wide weight, K not
    a multiple of 16, a strided last dimension, a tensor subclass such as a quantized weight) is
    ``F.linear`` itself: cuBLAS's GEMMs are the right kernels there. An eager step stays on
    ``F.linear`` too: there the host paces a batch-1 decode, and on the H200 the op's launch path cost
    more host time than its kernel saved GPU time (Llama-3.2-1B eager decode b=1 14.0 against 10.4 ms a
    step, 2026-12-03). Under ``torch.compile`` the choice is made while tracing (the row count is a
    static shape there).
    """
    if _routed(x, weight, bias):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def _routed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    # linear()'s conditions (see its docstring), for x of any last width (glu_linear's is 2K). The
    # step's kind first: an eager step (the usual call) is decided by it alone, ~1 us of host time
    # where the shape tests before it cost ~3 us a projection (32-layer eager decode: ~130 calls).
    return ((torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing()))
            and x.numel() == x.shape[-1] and x.dtype in DTYPES and weight.dim() == 2
            and (tile_for(weight.shape[0], weight.shape[1]) is not None
                 or (tuple(weight.shape) in PDL_SHAPES and not torch.compiler.is_compiling()
                     and dispatch.twins_now() and dispatch.launches_programmatic(x.device.index)))
            and weight.shape[1] % 16 == 0
            and weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype)
            and x.stride(-1) == 1 and weight.stride(-1) == 1 and type(weight) in _PLAIN and type(x) in _PLAIN
            and (bias is None or type(bias) in _PLAIN))


# ---------------------------------------------------------------------------------------------
# The MLP block's exit: the down projection with the residual add in its epilogue
# ---------------------------------------------------------------------------------------------

def gemv_residual_reference(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + F.linear(x, weight)``: ``LlamaDecoderLayer.forward``'s last line, ``residual +
    hidden_states`` after ``hidden_states = self.mlp(hidden_states)`` (transformers v5.22.2), with the
    MLP's down projection."""
    return residual + F.linear(x, weight)


def _residual_check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> None:
    _check(x, weight, None, "gemv_residual")
    if tuple(residual.shape) != (*x.shape[:-1], weight.shape[0]):
        raise ValueError(f"gemv_residual: residual {tuple(residual.shape)} must be the output's shape "
                         f"{(*x.shape[:-1], weight.shape[0])}")
    if residual.dtype != x.dtype:
        raise ValueError(f"gemv_residual: residual must be x's dtype; got {residual.dtype}, {x.dtype}")


def _residual_rows(args: tuple) -> tuple:
    # x, residual and out as one-row (1, width) views; the weight as it is.
    x, weight, residual, out = args
    return (x.reshape(1, x.shape[-1]), weight, residual.reshape(1, residual.shape[-1]), out.reshape(1, out.shape[-1]))


def _gemv_residual_cuda(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    if x.dtype not in DTYPES:
        dispatch.fallback("gemv_residual", f"dtype {x.dtype} (built: {', '.join(_DTYPE_NAMES)})")
    elif k > 0 and _launch("gemv_residual", (x, weight, residual, out), weight, None, _residual_rows):
        return out
    return gemv_residual_reference(x, weight, residual).contiguous()


def _gemv_residual_fake(x, weight, residual):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


_gemv_residual = define_op("gemv_residual", _gemv_residual_cuda, reference=gemv_residual_reference,
                           fake=_gemv_residual_fake, check=_residual_check)


def gemv_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + F.linear(x, weight)`` for one row, on one cuTile launch (the add in the GEMV's epilogue).

    Args:
        x: ``(..., K)`` holding exactly one row, its row contiguous (as :func:`gemv`).
        weight: ``(N, K)``, row-major, x's dtype.
        residual: ``(..., N)``, the output's shape, x's dtype, any strides.

    Returns:
        ``(..., N)`` of x's dtype, contiguous: the product's float32 sums rounded to the dtype, then the
        add in float32 rounded again, as the two ops round it (bit for bit where the product is).

    On CUDA for bfloat16 and float16 under :func:`gemv`'s conditions; otherwise, or with
    ``CUTILE_KERNELS_DISABLE=1``, :func:`gemv_residual_reference` (``F.linear``, then the add), logging
    the reason once. Under ``torch.compile`` the custom op ``<namespace>::gemv_residual``.

    Raises:
        TypeError: a tensor is not floating point, or residual is not a tensor.
        ValueError: x holds more than one row, shapes or dtypes do not match.
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
    """
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"gemv_residual: residual must be a tensor, got {type(residual).__name__}")
    check_float("gemv_residual", "x, weight, residual", x, weight, residual, kernel_dtypes=DTYPES)
    _residual_check(x, weight, residual)
    return _gemv_residual.call_checked(x, weight, residual)


#: The GEMV tiles on which :func:`linear_residual` adds in the GEMV's epilogue: none yet. Built and
#: checked on the CPU (the NumPy interpreter; 2026-12-07), not yet run on a GPU nor accepted by the model
#: bench (estimate: Llama-3.2-1B's compiled batch-1 step ~1.02x, its 16 separate adds gone). Add a tile
#: here once they have.
RESIDUAL_TILES: tuple = ()


def residual_tile(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (N, K)'s GEMV tile is one of :data:`RESIDUAL_TILES` and not one of
    :data:`GLU_TILES` (the activation fused into the down projection takes precedence there)."""
    tile = tile_for(weight.shape[0], weight.shape[1])
    return tile in RESIDUAL_TILES and tile not in GLU_TILES


def linear_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor) -> torch.Tensor:
    """``residual + linear(x, weight, bias)``: where :func:`linear` would send the projection to the
    GEMV (one 16-bit row, compiled or captured) on a tile of :data:`RESIDUAL_TILES`, there is no bias
    and ``residual`` is a plain tensor of the output's shape and dtype, one :func:`gemv_residual`
    launch; otherwise :func:`linear`, then the add. Returns ``(..., N)``."""
    if (bias is None and type(residual) in _PLAIN and residual.dtype == x.dtype and weight.dim() == 2
            and tile_for(weight.shape[0], weight.shape[1]) in RESIDUAL_TILES
            and tuple(residual.shape) == (*x.shape[:-1], weight.shape[0]) and _routed(x, weight, None)):
        return gemv_residual(x, weight, residual)
    return residual + linear(x, weight, bias)


# ---------------------------------------------------------------------------------------------
# The gated MLP's down projection: activation and GEMV in one launch
# ---------------------------------------------------------------------------------------------

def gemv_swiglu_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``LlamaMLP.forward``'s last step on the stacked gate/up output ``x (..., 2K)`` (gate first):
    ``down_proj(act_fn(gate) * up)`` with ``act_fn`` SiLU (transformers v5.22.2), i.e.
    ``F.linear(silu_and_mul_fused_reference(x), weight)``."""
    return F.linear(silu_and_mul_fused_reference(x), weight)


def gemv_geglu_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`gemv_swiglu_reference` with GemmaMLP's ``gelu_pytorch_tanh``:
    ``F.linear(gelu_tanh_and_mul_fused_reference(x), weight)``."""
    return F.linear(gelu_tanh_and_mul_fused_reference(x), weight)


def _glu_check(name: str):
    def check(x: torch.Tensor, weight: torch.Tensor) -> None:
        if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != 2 * weight.shape[1]:
            raise ValueError(f"{name}: x {tuple(x.shape)} must be (..., 2K), the stacked gate/up row, for weight "
                             f"{tuple(weight.shape)} (N, K)")
        if x.numel() != x.shape[-1]:
            raise ValueError(f"{name}: x {tuple(x.shape)} must hold exactly one row (its leading dimensions "
                             "multiply to 1)")
        if x.dtype != weight.dtype:
            raise ValueError(f"{name}: x and weight must share a dtype; got {x.dtype}, {weight.dtype}")
    return check


def gemv_glu_into(kernel: str, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                  tile: tuple[int, int] | None = None) -> bool:
    """Launch ``kernel`` (``"gemv_swiglu"`` or ``"gemv_geglu"``) on CUDA ``x`` (..., 2K) of one
    contiguous row and ``weight`` (N, K) into a new ``out`` (..., N), with the (BN, BK) ``tile``
    (default as :func:`gemv_into`). Returns False (nothing written, the reason logged) when no built
    variant takes the call."""
    return _launch(kernel, (x, weight, out), weight, tile, _glu_rows)


def _glu_rows(args: tuple) -> tuple:
    # x (..., 2K) as the (1, 2, K) gate/up view, out (..., N) as (1, N). A module-level function:
    # the layout is part of the plan cache's key, so a new lambda per call would re-plan every call.
    x, weight, out = args
    return (x.reshape(1, 2, weight.shape[1]), weight, out.reshape(1, out.shape[-1]))


#: The activation op each fused kernel folds in: its fallback, and the first of the two launches it replaces.
_ACTIVATION = {"gemv_swiglu": silu_and_mul_fused, "gemv_geglu": gelu_tanh_and_mul_fused}


def _glu_cuda(kernel: str):
    act = _ACTIVATION[kernel]

    def impl(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        n, k = weight.shape
        out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
        if n == 0:
            return out
        if k == 0:
            return out.zero_()
        if x.dtype not in DTYPES:
            dispatch.fallback(kernel, f"dtype {x.dtype} (built: {', '.join(_DTYPE_NAMES)})")
        elif not x.is_contiguous():
            dispatch.fallback(kernel, "x is not one contiguous row")
        elif gemv_glu_into(kernel, x, weight, out):
            return out
        # The two launches this one replaces (our activation kernel, then the GEMV or cuBLAS).
        return linear(act(x), weight).contiguous()

    impl.__name__ = f"_{kernel}_cuda"
    return impl


def _glu_fake(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


_GLU_CHECKS = {kernel: _glu_check(kernel) for kernel in GLU}
_GLU_OPS = {kernel: define_op(kernel, _glu_cuda(kernel), reference=ref, fake=_glu_fake, check=_GLU_CHECKS[kernel])
            for kernel, ref in (("gemv_swiglu", gemv_swiglu_reference), ("gemv_geglu", gemv_geglu_reference))}
assert set(_GLU_OPS) == set(GLU)


def gemv_swiglu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A SwiGLU MLP's down projection of one row, ``F.linear(silu(gate) * up, weight)``, in one launch.

    Args:
        x: ``(..., 2K)`` holding exactly one row: the stacked gate/up projection's output, gate first
            (``fused_gate_up``'s layout). A strided row takes the fallback below.
        weight: ``(N, K)``, ``down_proj.weight``, x's dtype.

    Returns:
        ``(..., N)`` of x's dtype: ``silu(gate)`` rounded to the dtype, times ``up`` rounded
        (LlamaMLP's order, as ``silu_and_mul_fused``), then float32 sums rounded once.

    On CUDA one cuTile launch for bfloat16 and float16 (aligned operands, K a multiple of 16, as
    :func:`gemv`, x contiguous); otherwise, or with ``CUTILE_KERNELS_DISABLE=1``, the activation kernel
    then the projection (on the CPU :func:`gemv_swiglu_reference`), logging the reason once. Under
    ``torch.compile`` the custom op ``<namespace>::gemv_swiglu``.

    Raises:
        TypeError: a tensor is not floating point.
        ValueError: x is not one row of width 2K, or the dtypes differ.
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
    """
    check_float("gemv_swiglu", "x, weight", x, weight, kernel_dtypes=DTYPES)
    _GLU_CHECKS["gemv_swiglu"](x, weight)
    return _GLU_OPS["gemv_swiglu"].call_checked(x, weight)


def gemv_geglu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`gemv_swiglu` with GemmaMLP's GeGLU (``gelu_pytorch_tanh(gate) * up``, rounded as
    ``gelu_tanh_and_mul_fused``). Shapes, dtypes and errors as :func:`gemv_swiglu`."""
    check_float("gemv_geglu", "x, weight", x, weight, kernel_dtypes=DTYPES)
    _GLU_CHECKS["gemv_geglu"](x, weight)
    return _GLU_OPS["gemv_geglu"].call_checked(x, weight)


#: The GEMV tiles on which :func:`glu_linear` fuses the activation into the down projection: none.
#: On the H200 (2026-12-03, dev/microbench/gemv_bench.py, graph replays) the fused kernel lost on
#: Llama-3.2-1B's down_proj (2048 x 8192, 16 x 256: 19.36 us against 13.29 for the activation
#: kernel + GEMV; each block recomputes the activation of all K, 32 tiles deep) and the decode fast
#: path went from 1.21-1.23 to 1.31-1.32 ms a step; on Qwen3-0.6B's (1024 x 3072, 8 x 512) it won,
#: 5.89 against 6.66 us, not yet measured end to end. Add a tile here once the model bench accepts it.
GLU_TILES: tuple = ()


def glu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               gelu: bool = False) -> torch.Tensor:
    """``linear(act_and_mul(x), weight, bias)``: a gated MLP's down projection on its stacked gate/up
    output ``x (..., 2K)``, ``act`` SiLU (``gelu=False``) or GELU-tanh. Where :func:`linear` would send
    the projection to the GEMV (one contiguous 16-bit row, N <= 2048, compiled or captured) on a tile of
    :data:`GLU_TILES`, and there is no bias, one :func:`gemv_swiglu` / :func:`gemv_geglu` launch;
    otherwise our activation kernel (``silu_and_mul_fused`` / ``gelu_tanh_and_mul_fused``), then
    :func:`linear`. Returns ``(..., N)``."""
    kernel = "gemv_geglu" if gelu else "gemv_swiglu"
    if (bias is None and weight.dim() == 2 and x.shape[-1] == 2 * weight.shape[1]
            and tile_for(weight.shape[0], weight.shape[1]) in GLU_TILES and _routed(x, weight, None)):
        return (gemv_geglu if gelu else gemv_swiglu)(x, weight)
    return linear(_ACTIVATION[kernel](x), weight, bias)
