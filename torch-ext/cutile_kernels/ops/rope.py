"""Rotary position embedding of q and k in one launch: torch custom ops, fakes, functional API.

The math and rounding order are those of transformers' ``apply_rotary_pos_emb`` (see
``kernel_src/rope.py``), taking the ``cos``/``sin`` that the model's rotary embedding returns, so
every scaling type (default, linear, dynamic, yarn, llama3, ...) is already in them.
:func:`apply_rope_reference` restates Llama's formula in PyTorch; it is the fallback and the
tests' model of what stock transformers computes. :func:`apply_rope_cast` is OLMo 2's variant of
it (float32 cos/sin with 16-bit q and k: the math in float32, each result cast back), on the same
kernel.
"""

from __future__ import annotations

import functools
import logging

import torch

from .. import dispatch
from ._dtypes import check_float
from ._define import define_op
from ..kernel_src._spec import next_power_of_2
from ..kernel_src.rope import BLOCKS, PASS_BLOCKS, PBLOCK, ROWS
from ..registry import DECODE_TORCH_DTYPES
from .kv_cache import _check as kv_check
from .kv_cache import kv_append, kv_append_reference
from .kv_cache import mismatch as kv_mismatch

MIN_BLOCK = min(BLOCKS)
#: The kernels of partial rotary in one launch (the pass-through copied by the kernel).
PASS_KERNEL = "rope_pass"
APPEND_PASS_KERNEL = "rope_append_pass"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    # (x1, x2) -> (-x2, x1) over the last dimension, halves split at D // 2 as transformers does.
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    if rot in (1, x.shape[-1]):  # the transformers formula (cos broadcasts over the last dim)
        return x * cos + _rotate_half(x) * sin
    rotated = x[..., :rot] * cos + _rotate_half(x[..., :rot]) * sin
    return torch.cat((rotated, x[..., rot:]), dim=-1)


def apply_rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE exactly as transformers' ``apply_rotary_pos_emb`` computes it (Llama, v5.22.2).

    ``cos``/``sin`` get a head axis at ``unsqueeze_dim`` and broadcast against ``q``/``k``; each
    tensor becomes ``x * cos + rotate_half(x) * sin``, every op rounded to the result dtype
    (``promote_types(x.dtype, cos.dtype)``). When cos's last dimension R is smaller than the
    head dimension D (partial rotary, ``partial_rotary_factor < 1``), the first R elements are
    rotated and the other D - R pass through unchanged (the GPT-NeoX / GLM convention).
    """
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _mismatch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why q, k, cos, sin are not shaped as the kernel takes them, or None if they are."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return (f"expected q (B, Hq, S, D), k (B, Hkv, S, D), cos and sin (B or 1, S, R); got q {tuple(q.shape)}, "
                f"k {tuple(k.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    (b, _, s, d), rot = q.shape, cos.shape[-1]
    if (k.shape[0] != b or k.shape[2] != s or k.shape[3] != d or cos.shape[0] not in (1, b)
            or cos.shape[1] != s or rot % 2 or not 2 <= rot <= d):
        return (f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)} (cos/sin "
                "need batch 1 or B, q's sequence length, and an even last dim <= D)")
    return None


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    why = _mismatch(q, k, cos, sin)
    if why is not None:
        raise ValueError(f"rope: {why}")


def _memory_order(shape: tuple, stride: tuple) -> tuple | None:
    """The dims of a tensor by decreasing stride, or None when that is the dims' own order (for
    the dims longer than 1, the only ones whose stride matters)."""
    order = list(range(len(shape)))
    for i in range(1, len(order)):  # insertion sort, stable (ties keep dim order): dynamo traces its
        j = i                       # comparisons of symbolic strides, where sorted() with a key fails
        while j > 0 and stride[order[j - 1]] < stride[order[j]]:
            order[j - 1], order[j] = order[j], order[j - 1]
            j -= 1
    big = [d for d in range(len(shape)) if shape[d] > 1]
    return None if [d for d in order if shape[d] > 1] == big else tuple(order)


#: (shape, strides) -> _memory_order of it: a pure function of the key, cached because it runs on
#: every call (a few us of Python) for the handful of layouts a model has.
_ORDERS: dict = {}


def _empty_like_layout(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor of x's shape laid out in x's memory order, as torch's elementwise ops lay out
    their result: transformers' q/k are (B, S, H, D) buffers seen as (B, H, S, D), and stock RoPE
    returns that layout, so attention and the KV cache get what they get without us."""
    shape, stride = x.shape, x.stride()
    key = (shape, stride)
    try:
        order = _ORDERS.get(key, False)
    except TypeError:  # symbolic sizes (torch.compile's fake tensors) do not hash: not cached
        order = _memory_order(tuple(shape), stride)
    if order is False:
        order = _memory_order(tuple(shape), stride)
        if len(_ORDERS) >= 1024:
            _ORDERS.clear()
        _ORDERS[key] = order
    if order is None:
        # sizes as separate ints: a torch.Size as one argument costs the parser ~1.5 us more
        return torch.empty(*shape, dtype=dtype, device=x.device) if shape else torch.empty((), dtype=dtype, device=x.device)
    return torch.empty_permuted(shape, order, dtype=dtype, device=x.device)


def _traced_like_layout(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`_empty_like_layout` for code dynamo traces, which must not read its cache (a lookup is a
    guard, and an eager call's insert then recompiles the step): the order computed afresh (static
    or symbolic strides)."""
    shape = tuple(x.shape)
    order = _memory_order(shape, x.stride())
    if order is None:
        return torch.empty(shape, dtype=dtype, device=x.device)
    return torch.empty_permuted(shape, order, dtype=dtype, device=x.device)


def _promoted(x: torch.dtype, cos: torch.dtype, sin: torch.dtype) -> torch.dtype:
    return torch.promote_types(torch.promote_types(x, cos), sin)


#: :func:`_promoted`, cached for eager calls (code that dynamo traces calls :func:`_dtype_of`, which
#: takes the plain function there: dynamo warns on every lru_cache it meets).
_result_dtype = functools.lru_cache(maxsize=None)(_promoted)


def _dtype_of(x: torch.dtype, cos: torch.dtype, sin: torch.dtype) -> torch.dtype:
    return (_promoted if torch.compiler.is_compiling() else _result_dtype)(x, cos, sin)


def _outputs(q, k, cos, sin):
    dq = _result_dtype(q.dtype, cos.dtype, sin.dtype)
    dk = _result_dtype(k.dtype, cos.dtype, sin.dtype)
    return _empty_like_layout(q, dq), _empty_like_layout(k, dk)


@functools.lru_cache(maxsize=None)
def _tiles(half: int) -> tuple:
    # (prefill request, decode request, the prefill tile's positions) for R/2 = half.
    block = max(MIN_BLOCK, next_power_of_2(half))
    return (("BLOCK", block),), (("BLOCK", block), ("ROWS", 1)), ROWS.get(block, 0)


def _want(half: int, positions: int, dtype: torch.dtype) -> tuple:
    """The tile to ask for (rope's and qk_norm_rope's, which share them): ``half`` (R/2) padded to
    a BLOCK; one position per block for a decode step (fewer ``positions`` than the prefill tile's
    rows) of a dtype with decode tiles."""
    prefill, decode, rows = _tiles(half)
    return decode if positions < rows and dtype in DECODE_TORCH_DTYPES else prefill


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _halves(x: torch.Tensor, rot: int) -> torch.Tensor:
    # (..., D) -> (..., 2, R/2) view of the rotated part: each half is one tile along the last axis.
    # (view with int sizes: splitting one dim is always a view, and it is the cheapest call; the
    # slice only when R < D.)
    *lead, d = x.shape
    return (x if rot == d else x[..., :rot]).view(*lead, 2, rot // 2)


def _halves_layout(args: tuple) -> tuple:
    # q, k, cos, sin, q_out, k_out as the kernel takes them, R = cos's last size (once per plan).
    rot = args[2].shape[-1]
    return tuple(_halves(t, rot) for t in args)


def _pass_fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether a partial-rotary call (R < D) takes the kernels that copy the pass-through in the
    same launch: D - R <= PBLOCK, R/2 within the built half-widths, one 16-bit dtype throughout
    (other partial calls rotate with the RoPE kernel and copy the rest with two ``copy_``)."""
    d, rot = q.shape[-1], cos.shape[-1]
    return (rot < d and d - rot <= PBLOCK and max(MIN_BLOCK, next_power_of_2(rot // 2)) <= max(PASS_BLOCKS)
            and q.dtype in DECODE_TORCH_DTYPES and q.dtype == k.dtype == cos.dtype == sin.dtype)


#: Positions of rope_pass_kernel's arguments seen as (..., 2, R/2) halves (q, k, cos, sin, q_out,
#: k_out); the others are the pass-through views, taken as they are.
_PASS_HALVES = (0, 1, 2, 3, 6, 7)


def _pass_layout(args: tuple) -> tuple:
    rot = args[2].shape[-1]
    return tuple(_halves(t, rot) if i in _PASS_HALVES else t for i, t in enumerate(args))


def rope_into(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              q_out: torch.Tensor, k_out: torch.Tensor) -> bool:
    """Launch the RoPE kernel on CUDA tensors shaped as the op takes them (q (B, Hq, S, D), k
    (B, Hkv, S, D), cos and sin (B or 1, S, R); already checked).

    ``q_out``/``k_out`` must be new tensors shaped like ``q``/``k`` (any strides; they must not
    alias the inputs, which is not checked). Returns False (nothing written) when no cuTile path
    fits; the caller then falls back.
    """
    (b, hq, s, d), hk, rot = q.shape, k.shape[1], cos.shape[-1]
    grid = lambda c: (_cdiv(s, c["ROWS"]), _cdiv(hq, c["HEADS"]) + _cdiv(hk, c["HEADS"]), b)  # noqa: E731
    if rot < d and _pass_fits(q, k, cos, sin):  # partial rotary, the pass-through copied in the launch
        args = (q, k, cos, sin, q[..., rot:], k[..., rot:], q_out, k_out, q_out[..., rot:], k_out[..., rot:])
        if dispatch.run(PASS_KERNEL, _want(rot // 2, s, q.dtype) + (("PBLOCK", PBLOCK),), args, 6, grid, _pass_layout,
                        optional=True):  # else the RoPE kernel and the copies below
            return True
    if not dispatch.run("rope", _want(rot // 2, s, q.dtype), (q, k, cos, sin, q_out, k_out), 4, grid, _halves_layout):
        return False
    if rot < d:  # partial rotary: the rest of each head passes through
        q_out[..., rot:].copy_(q[..., rot:])
        k_out[..., rot:].copy_(k[..., rot:])
    return True


def _rope_cuda(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q_out, k_out = _outputs(q, k, cos, sin)
    if q_out.numel() == 0 and k_out.numel() == 0:
        return q_out, k_out
    if rope_into(q, k, cos, sin, q_out, k_out):
        return q_out, k_out
    return _copy_reference(q, k, cos, sin, q_out, k_out)


def _copy_reference(q, k, cos, sin, q_out, k_out):
    q_ref, k_ref = apply_rope_reference(q, k, cos, sin)
    return q_out.copy_(q_ref), k_out.copy_(k_ref)


def _rope_cpu(q, k, cos, sin):
    # The reference in the op's declared layout (q's and k's memory order).
    return _copy_reference(q, k, cos, sin, *_outputs(q, k, cos, sin))


def _rope_fake(q, k, cos, sin):
    return _outputs(q, k, cos, sin)


_rope = define_op("rope", _rope_cuda, reference=apply_rope_reference, fake=_rope_fake, check=_check, cpu=_rope_cpu)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of ``q`` and ``k`` in one launch (transformers' formula).

    Args:
        q: ``(B, Hq, S, D)`` queries (``unsqueeze_dim=1``) or ``(B, S, Hq, D)`` (``unsqueeze_dim=2``),
            any strides (transformers passes transposed views); bfloat16, float16 or float32.
        k: keys, shaped like ``q`` with ``Hkv`` heads (one KV head is fine).
        cos, sin: ``(B, S, R)`` or ``(1, S, R)`` as the model's rotary embedding returns them
            (scaling already applied; per-row positions, e.g. left padding, are rows of B), same
            dtype as q for the cuTile kernel. ``R == D``, or ``R < D`` (even) for partial rotary:
            the first R elements of each head are rotated, the rest pass through.
        unsqueeze_dim: where cos/sin get their head axis, as in transformers (1 or 2 for the
            layouts above).

    Inputs outside these shapes (but that transformers' formula broadcasts) take
    :func:`apply_rope_reference`, which raises where transformers raises.

    Returns:
        ``(q_embed, k_embed)``: new tensors of q's and k's shapes, laid out in their memory order
        (as eager torch lays out the stock result), dtype ``promote_types(x.dtype, cos.dtype)``.

    On CUDA this runs one cuTile kernel for both tensors (prebuilt, else JIT) for head halves up
    to 128 (D <= 256); partial rotary copies the pass-through in the same launch where ``D - R <=
    32``, ``R <= 128`` and every tensor has one 16-bit dtype, else with two ``copy_`` after it.
    Other inputs take :func:`apply_rope_reference` and log the reason once. On other
    devices it is :func:`apply_rope_reference`. Under ``torch.compile``, or when an input requires
    grad, it is the custom op ``<namespace>::rope`` (fake implementation; gradients from the
    reference formula).

    Raises:
        TypeError: a tensor is not bfloat16, float16, float32 or float64.
        RuntimeError: shapes that do not broadcast (from the reference, as transformers').
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
        CudaError: the CUDA driver failed to launch the kernel.
    """
    check_float("apply_rope", "q, k, cos, sin", q, k, cos, sin)
    return _apply(_rope, apply_rope_reference, q, k, cos, sin, unsqueeze_dim)


def _apply(op, reference, q, k, cos, sin, unsqueeze_dim):
    # The op on the layouts the kernel takes ((B, S, H, D) as (B, H, S, D) views), else the reference.
    if unsqueeze_dim not in (1, 2) or q.dim() != 4 or k.dim() != 4:
        return reference(q, k, cos, sin, unsqueeze_dim)
    if unsqueeze_dim == 2:  # (B, S, H, D): the same kernel on (B, H, S, D) views
        q_embed, k_embed = _apply(op, reference, q.transpose(1, 2), k.transpose(1, 2), cos, sin, 1)
        return q_embed.transpose(1, 2), k_embed.transpose(1, 2)
    if _mismatch(q, k, cos, sin) is not None:  # shapes outside the kernel's contract
        return reference(q, k, cos, sin, unsqueeze_dim)
    return op.call_checked(q, k, cos, sin)  # _mismatch was None above


def apply_rope_cast_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE as OLMo 2's ``apply_rotary_pos_emb`` computes it (models/olmo2/modeling_olmo2.py,
    v5.22.2; OLMo, OLMo 3, OLMo-hybrid, FlexOlmo and Beam copy it): :func:`apply_rope_reference` (each op rounded to
    ``promote_types(x.dtype, cos.dtype)``: float32 for OLMo 2's float32 cos/sin), then each result
    cast back to its input's dtype."""
    q_embed, k_embed = apply_rope_reference(q, k, cos, sin, unsqueeze_dim)
    return q_embed.to(q.dtype), k_embed.to(k.dtype)


def _cast_outputs(q, k):
    return _empty_like_layout(q, q.dtype), _empty_like_layout(k, k.dtype)


def _rope_cast_cuda(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q_out, k_out = _cast_outputs(q, k)
    if q_out.numel() == 0 and k_out.numel() == 0:
        return q_out, k_out
    if rope_into(q, k, cos, sin, q_out, k_out):
        return q_out, k_out
    q_ref, k_ref = apply_rope_cast_reference(q, k, cos, sin)
    return q_out.copy_(q_ref), k_out.copy_(k_ref)


def _rope_cast_cpu(q, k, cos, sin):
    q_out, k_out = _cast_outputs(q, k)
    q_ref, k_ref = apply_rope_cast_reference(q, k, cos, sin)
    return q_out.copy_(q_ref), k_out.copy_(k_ref)


def _rope_cast_fake(q, k, cos, sin):
    return _cast_outputs(q, k)


_rope_cast = define_op("rope_cast", _rope_cast_cuda, reference=apply_rope_cast_reference, fake=_rope_cast_fake,
                       check=_check, cpu=_rope_cast_cpu)


def apply_rope_cast(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """OLMo 2's RoPE of ``q`` and ``k`` in one launch: :func:`apply_rope_cast_reference`.

    Args:
        q, k, cos, sin, unsqueeze_dim: as :func:`apply_rope`, but cos/sin may be float32 with
            bfloat16 or float16 q and k (OLMo 2's rotary embedding returns float32): the cuTile
            kernel then rounds each op to float32 and stores q's dtype. cos/sin of q's dtype give
            :func:`apply_rope`'s numbers.

    Returns:
        ``(q_embed, k_embed)``: new tensors of q's and k's shapes, dtypes and memory order.

    On CUDA one cuTile kernel for both tensors (head halves up to 128); other inputs take
    :func:`apply_rope_cast_reference` and log the reason once; on other devices that reference.
    Under ``torch.compile``, or when an input requires grad, the custom op
    ``<namespace>::rope_cast`` (fake implementation; gradients from the reference).

    Raises:
        TypeError: a tensor is not bfloat16, float16, float32 or float64.
        RuntimeError: shapes that do not broadcast (from the reference, as transformers').
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
        CudaError: the CUDA driver failed to launch the kernel.
    """
    check_float("apply_rope_cast", "q, k, cos, sin", q, k, cos, sin)
    return _apply(_rope_cast, apply_rope_cast_reference, q, k, cos, sin, unsqueeze_dim)


# ---------------------------------------------------------------------------------------------
# RoPE and the static KV cache write of a decode step in one launch
# ---------------------------------------------------------------------------------------------

APPEND_KERNEL = "rope_append"
#: Reasons :func:`rope_append` took two launches for a decode step, logged once each.
_SAID: set = set()
logger = logging.getLogger("cutile_kernels")


def rope_append_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether :func:`rope_append` computes what :func:`apply_rope` followed by the cache write would
    for these arguments: shapes in RoPE's kernel contract and in the cache write's
    (:func:`~.kv_cache.mismatch`), the cache of the rotated keys' dtype, and no gradient asked for
    (the op has none; ``apply_rope`` keeps one). A caller that gets False runs the two steps itself."""
    if _mismatch(q, k, cos, sin) is not None or kv_mismatch(keys, values, k, v) is not None:
        return False
    if keys.dtype != _dtype_of(k.dtype, cos.dtype, sin.dtype):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, cos, sin)))


def rope_append_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor, q_out: torch.Tensor) -> None:
    """:func:`apply_rope_reference` of q and k, then ``StaticLayer.update``'s writes of the rotated k
    and of v (:func:`~.kv_cache.kv_append_reference`): ``q_out`` receives the rotated q. Shapes as
    :func:`rope_append`."""
    q_rot, k_rot = apply_rope_reference(q, k, cos, sin)
    q_out.copy_(q_rot)
    kv_append_reference(keys, values, k_rot, v, length)


def _append_check(q, k, v, cos, sin, keys, values, length, q_out) -> None:
    _check(q, k, cos, sin)
    kv_check(keys, values, k, v, length)
    if q_out.shape != q.shape or q_out.dtype != _result_dtype(q.dtype, cos.dtype, sin.dtype):
        raise ValueError(f"rope_append: q_out {tuple(q_out.shape)} {q_out.dtype} must have q's shape "
                         f"{tuple(q.shape)} and the result dtype {_result_dtype(q.dtype, cos.dtype, sin.dtype)}")
    if keys.dtype != _result_dtype(k.dtype, cos.dtype, sin.dtype):
        raise ValueError(f"rope_append: the cache ({keys.dtype}) must hold the rotated keys' dtype "
                         f"{_result_dtype(k.dtype, cos.dtype, sin.dtype)}")


def _append_layout(args: tuple) -> tuple:
    # Every tensor but the length as (..., 2, R/2) halves (R = D).
    rot = args[3].shape[-1]
    return tuple(t if i == 7 else _halves(t, rot) for i, t in enumerate(args))


#: Positions of rope_append_pass_kernel's arguments seen as (..., 2, R/2) halves (q, k, v, cos,
#: sin, keys, values, q_out); the length and the pass-through views are taken as they are.
_APPEND_PASS_HALVES = (0, 1, 2, 3, 4, 5, 6, 13)


def _append_pass_layout(args: tuple) -> tuple:
    rot = args[3].shape[-1]
    return tuple(_halves(t, rot) if i in _APPEND_PASS_HALVES else t for i, t in enumerate(args))


def _unfused_reason(q, k, cos, sin, keys) -> str | None:
    # Why the one-launch kernels do not take the call (the two launches do), or None.
    (_, _, s, d), rot = q.shape, cos.shape[-1]
    if rot != d and not _pass_fits(q, k, cos, sin):
        return (f"partial rotary ({rot} of {d} elements; one launch takes 16-bit tensors of one dtype, "
                f"D - R <= {PBLOCK} and R <= {2 * max(PASS_BLOCKS)})")
    if len({q.dtype, k.dtype, cos.dtype, keys.dtype}) != 1 or q.dtype not in DECODE_TORCH_DTYPES:
        return f"dtypes q {q.dtype}, cos {cos.dtype}, cache {keys.dtype} (one of bfloat16/float16 taken)"
    if _want(rot // 2, s, q.dtype) != _tiles(rot // 2)[1]:
        return f"{s} positions (a prefill: RoPE's wider tile, then the cache write)"
    return None


def _rope_append_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor, q_out: torch.Tensor) -> None:
    (b, hq, s, d), hk = q.shape, k.shape[1]
    if s == 0:
        return
    why = _unfused_reason(q, k, cos, sin, keys)
    if why is None:
        grid = lambda c: (s, _cdiv(hq, c["HEADS"]) + _cdiv(hk, c["HEADS"]), b)  # noqa: E731
        rot = cos.shape[-1]
        if rot == d:
            launched = dispatch.run(APPEND_KERNEL, _tiles(d // 2)[1],
                                    (q, k, v, cos, sin, keys, values, length.view(1), q_out), 8, grid, _append_layout)
        else:  # partial rotary: the pass-through copied in the same launch
            args = (q, k, v, cos, sin, keys, values, length.view(1), q[..., rot:], k[..., rot:], v[..., rot:],
                    keys[..., rot:], values[..., rot:], q_out, q_out[..., rot:])
            launched = dispatch.run(APPEND_PASS_KERNEL, _tiles(rot // 2)[1] + (("PBLOCK", PBLOCK),), args, 13, grid,
                                    _append_pass_layout, optional=True)  # else the two launches below
        if launched:
            return
        if rot != d:
            _two_launches(f"no {APPEND_PASS_KERNEL} variant fits these tensors")
    elif s < _tiles(cos.shape[-1] // 2)[2]:  # a decode step the one launch does not serve
        _two_launches(why)
    # Two launches: RoPE into a new k, then the cache write (each with its own fallback).
    k_rot = _empty_like_layout(k, _result_dtype(k.dtype, cos.dtype, sin.dtype))
    if not rope_into(q, k, cos, sin, q_out, k_rot):
        _copy_reference(q, k, cos, sin, q_out, k_rot)
    kv_append(keys, values, k_rot, v, length)


def _two_launches(why: str) -> None:
    # Not a fallback: our two kernels run (each says so if it cannot). Logged once per reason.
    if why not in _SAID:
        _SAID.add(why)
        logger.info("cutile_kernels: rope_append runs RoPE and the cache write as two launches: %s", why)


def _rope_append_fake(q, k, v, cos, sin, keys, values, length, q_out) -> None:
    return None


_rope_append = define_op(APPEND_KERNEL, _rope_append_cuda, reference=rope_append_reference, fake=_rope_append_fake,
                         check=_append_check, cpu=rope_append_reference, backward=None,
                         mutates_args=("keys", "values", "q_out"), flexible=True)


def rope_append(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """RoPE of a step's q and k with the rotated k and v written into a static KV cache: what
    :func:`apply_rope` followed by transformers' ``StaticLayer.update`` (cache_utils.py, v5.22.2;
    its writes, :func:`~.kv_cache.kv_append`) compute, in one launch.

    Args:
        q: ``(B, Hq, S, D)`` queries, any strides (views of a stacked projection are fine).
        k, v: ``(B, Hkv, S, D)`` new keys (rotated here) and values.
        cos, sin: ``(B or 1, S, R)`` as the model's rotary embedding returns them.
        keys, values: ``(B, Hkv, L, D)`` the cache layer's tensors, written at slots
            ``length + [0, S)`` (on CUDA slots ``>= L`` are not written, as :func:`~.kv_cache.kv_append`;
            the reference raises there, as ``StaticLayer.update``'s ``index_copy_`` does).
        length: one int64 element on the cache's device: the first slot (read on the device, not
            advanced: the caller adds ``S``, as ``update`` does).

    Returns:
        The rotated q: a new tensor of q's shape and memory order (as :func:`apply_rope`).

    The one launch (cuTile ``rope_append_kernel``; ``rope_append_pass_kernel`` for partial rotary,
    the other ``D - R`` elements of q, k and v copied through in it) takes bfloat16 or float16 with
    q, k, v, cos, sin and the cache of one dtype, the whole head rotated (``R == D <= 256``) or
    ``D - R <= 32`` with ``R <= 128`` (Phi-4-mini's 96 of 128), and a decode step (fewer positions
    than RoPE's prefill tile). Other calls run the RoPE kernel and the cache-write kernel (two
    launches, each with its own fallback; a decode step says why once); on other
    devices :func:`rope_append_reference`. Under ``torch.compile`` the custom op
    ``<namespace>::rope_append`` (mutating the cache and a new q), which has no backward (the
    decode graphs' and compiled steps run without autograd; the CPU reference records the stock ops').

    Raises:
        TypeError: a tensor is not floating point, or ``length`` is not a tensor.
        ValueError: shapes or dtypes do not match (RoPE's and the cache write's checks).
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
    """
    check_float("rope_append", "q, k, v, cos, sin, keys, values", q, k, v, cos, sin, keys, values)
    dtype = _dtype_of(q.dtype, cos.dtype, sin.dtype)
    q_out = _traced_like_layout(q, dtype) if torch.compiler.is_compiling() else _empty_like_layout(q, dtype)
    _rope_append(q, k, v, cos, sin, keys, values, length, q_out)
    return q_out
