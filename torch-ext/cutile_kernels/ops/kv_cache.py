"""Appending a step's keys and values to a static KV cache, in place: custom op, reference, dispatch.

Semantics: the writes of transformers' ``StaticLayer.update`` (cache_utils.py, v5.22.2) for new
rows ``k``, ``v`` of shape ``(B, H, S, D)`` into a cache ``keys``, ``values`` of shape
``(B, H, L, D)``: row ``s`` goes to slot ``length + s``, ``length`` a one-element int64 tensor on
the cache's device (the layer's ``cumulative_length``), read on the device. ``length`` itself is
not advanced (the caller adds ``S``, as ``update`` does after its writes). One launch replaces
``update``'s four (``arange``, an add, two ``index_copy_``); a replayed CUDA graph writes each step
at the slot the device holds. :func:`kv_append_reference` is ``update``'s own lines.

Rows whose slot would be ``>= L`` are not written by the kernel (``index_copy_`` raises a device-side
assert there); the caller keeps count (``layers/decode_graphs.py`` raises ``CacheFullError`` first).
"""

from __future__ import annotations

import torch

from .. import dispatch
from ._dtypes import check_float
from ._define import define_op
from ..kernel_src._spec import next_power_of_2
from ..kernel_src.kv_cache import HEAD_DIMS, ROWS

KERNEL = "kv_append"
#: Dtypes the kernel is built for (the cache and the new rows all of one).
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def kv_append_reference(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        length: torch.Tensor) -> None:
    """``StaticLayer.update``'s writes (transformers v5.22.2): ``index_copy_`` along the sequence
    dimension at ``arange(S) + length``. Shapes as :func:`kv_append`."""
    slots = torch.arange(k.shape[2], device=keys.device) + length.reshape(())
    keys.index_copy_(2, slots, k)
    values.index_copy_(2, slots, v)


def mismatch(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why new rows ``k``, ``v`` do not fit the cache ``keys``, ``values`` (shapes as
    :func:`kv_append` takes them, one dtype), or None if they do."""
    if keys.dim() != 4 or keys.shape != values.shape:
        return f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must be one (B, H, L, D) shape"
    if k.shape != v.shape or k.dim() != 4 or k.shape[:2] != keys.shape[:2] or k.shape[3] != keys.shape[3]:
        return (f"k {tuple(k.shape)} and v {tuple(v.shape)} must be (B, H, S, D) with the cache's B, H and D "
                f"{tuple(keys.shape)}")
    if len({keys.dtype, values.dtype, k.dtype, v.dtype}) != 1:
        return f"keys, values, k and v must share a dtype; got {keys.dtype}, {values.dtype}, {k.dtype}, {v.dtype}"
    return None


def _check(keys, values, k, v, length) -> None:
    why = mismatch(keys, values, k, v)
    if why is not None:
        raise ValueError(f"kv_append: {why}")
    if not isinstance(length, torch.Tensor):
        raise TypeError(f"kv_append: length must be a one-element int64 tensor on the cache's device, not a "
                        f"{type(length).__name__} (a host number would freeze in a captured graph)")
    if length.numel() != 1 or length.dtype != torch.int64 or length.device != keys.device:
        raise ValueError(f"kv_append: length must be one int64 element on the cache's device; got {length.dtype} "
                         f"of shape {tuple(length.shape)} on {length.device}")


def _kv_append_cuda(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    length: torch.Tensor) -> None:
    B, H, S, D = k.shape
    if S == 0:
        return
    dp = max(HEAD_DIMS[0], next_power_of_2(D))
    if keys.dtype not in DTYPES:
        dispatch.fallback(KERNEL, f"dtype {keys.dtype}")
    elif dp not in HEAD_DIMS:
        dispatch.fallback(KERNEL, f"head_dim {D} > {HEAD_DIMS[-1]}")
    elif dispatch.run(KERNEL, (("D", dp),), (keys, values, k, v, length.view(1)), 5,
                      lambda consts: (-(-S // ROWS), B * H, 1)):
        return
    kv_append_reference(keys, values, k, v, length)


def _kv_append_fake(keys, values, k, v, length) -> None:
    return None


_kv_append = define_op(KERNEL, _kv_append_cuda, reference=kv_append_reference, fake=_kv_append_fake, check=_check,
                       cpu=kv_append_reference, backward=None, mutates_args=("keys", "values"))


def kv_append(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              length: torch.Tensor) -> None:
    """Write new keys and values into a static KV cache at the device-side length (in place).

    Args:
        keys, values: ``(B, H, L, D)`` cache tensors (a ``StaticLayer``'s ``keys`` / ``values``).
        k, v: ``(B, H, S, D)`` new rows, same dtype, any strides (views of a projection are fine).
        length: one int64 element on the cache's device: the first slot written (not advanced).

    On CUDA one cuTile launch (bfloat16, float16, float32; head_dim <= 256); otherwise, or with
    ``CUTILE_KERNELS_DISABLE=1``, :func:`kv_append_reference` (``index_copy_``), logging the reason
    once. Under ``torch.compile`` the custom op ``<namespace>::kv_append`` (mutating ``keys`` and
    ``values``).

    Raises:
        TypeError: a tensor is not floating point, or ``length`` is not a tensor.
        ValueError: shapes, dtypes or ``length`` do not match.
        FallbackError: a fallback was needed and ``CUTILE_KERNELS_STRICT=1``.
    """
    check_float("kv_append", "keys, values, k, v", keys, values, k, v)
    _check(keys, values, k, v, length)
    _kv_append.call_checked(keys, values, k, v, length)
