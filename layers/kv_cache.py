"""Patch ``dynamic_cache_prefill``: a DynamicCache layer's first write (the prefill) on our ``kv_append`` kernel.

transformers' ``DynamicLayer.update`` (cache_utils.py, v5.22.2) grows a layer's keys and values by
``torch.cat`` on every call; on the first call, the prompt's, that is a cat of an empty tensor
with the new keys, i.e. a copy of the keys and one of the values (two launches a layer, 17 % of
Phi-4-mini's eager prefill's non-GEMM device time on the H200, 2026-12-05). The cache layers of a
``DynamicCache(config=...)`` (what the models' forwards and ``generate`` build) come from
transformers' registry ``cache_utils.DYNAMIC_LAYER_TYPE_MAPPING`` (layer type -> class). This patch
puts two subclasses there:

* :class:`CutileDynamicLayer` (``"full_attention"``) and :class:`CutileDynamicSlidingWindowLayer`
  (``"sliding_attention"``, ``"chunked_attention"``). Their ``update`` runs the stock lines, except
  that the first write of an uninitialized layer copies the new keys and values into new contiguous
  tensors with one ``kv_append`` launch (:func:`first_write`) where ``torch.cat`` would have copied
  them: the same values bit for bit, the same shapes, dtype and (contiguous) layout. Later writes
  (decode steps, further chunks) are the stock ``update``: a cat of the cache with the new rows.

:func:`first_write` leaves the call to the stock lines (no launch of ours) off CUDA, under
``torch.compile`` (the stock cat traces), where autograd records (``kv_append`` has no backward),
for k and v of other shapes or dtypes, head dims over 256, and dtypes ``kv_append`` has no variant
for. The sliding layer's ``update`` is reproduced (its pinned statements, :data:`PINS`); if the
installed transformers changed either update, the patch changes nothing and says so.

The registry is process-wide: while at least one model patched through this module is alive and
patched, every ``DynamicCache(config=...)`` built in the process gets these layers (a model not
kernelized included: the same values as stock, on our kernel). :func:`unpatch_dynamic_cache`
of the last such model puts transformers' classes back; caches built meanwhile keep their layers.
A registry entry that is neither transformers' class nor ours (another library's) is left alone.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn
from transformers import cache_utils
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ..ops.kv_cache import DTYPES as KV_DTYPES
from ..ops.kv_cache import kv_append
from ._patching import Patch
from ._pins import Pin, holds, register

logger = logging.getLogger("cutile_kernels")

PINS = (
    Pin("cache_utils", "DynamicLayer.update", "1cac09d084ff6b22",
        "patch dynamic_cache_prefill (CutileDynamicLayer: its first write on kv_append, later ones its own)"),
    Pin("cache_utils", "DynamicSlidingWindowLayer.update", "281c79d2b0c52a66",
        "patch dynamic_cache_prefill (CutileDynamicSlidingWindowLayer.update reproduces it)"),
)
register(*PINS)

#: Device types whose tensors :func:`first_write` copies on the kernel (tests widen it to run the
#: ops' reference path on a CPU).
DEVICE_TYPES = ("cuda",)
#: Largest head dim ``kv_append`` is built for.
MAX_HEAD_DIM = 256
#: device -> one int64 zero on it: the first slot of a first write (made once, never written).
_ZEROS: dict = {}
_compiling = torch.compiler.is_compiling


def _zero(device: torch.device) -> torch.Tensor:
    z = _ZEROS.get(device)
    if z is None:
        z = _ZEROS[device] = torch.zeros(1, dtype=torch.int64, device=device)
    return z


def new_buffers(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's new keys and values tensors for a first write of ``k``'s shape: contiguous, as
    ``torch.cat`` lays out its result (module-level so that the GPU tests can poison them)."""
    return (torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device))


def first_write(layer: DynamicLayer, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """New contiguous copies of ``k`` and ``v`` ``(B, H, S, D)`` (any strides, one dtype) made by
    one ``kv_append`` launch into :func:`new_buffers`, when ``layer`` is not initialized yet (its
    first write, a prefill); else None and the caller runs the stock lines (see the module
    docstring for which calls those are). The copies are what ``torch.cat([empty, k], dim=-2)``
    returns: the same values, shape, dtype and contiguous layout."""
    if layer.is_initialized or _compiling():
        return None
    if (k.device.type not in DEVICE_TYPES or k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype
            or k.device != v.device or k.dtype not in KV_DTYPES or k.shape[-1] > MAX_HEAD_DIM or k.shape[2] == 0):
        return None
    if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
        return None
    keys, values = new_buffers(k)
    kv_append(keys, values, k, v, _zero(k.device))
    return keys, values


class CutileDynamicLayer(DynamicLayer):
    """transformers' ``DynamicLayer`` whose first write copies on the ``kv_append`` kernel
    (:func:`first_write`); every other call is the stock ``update``."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """``DynamicLayer.update``: ``key_states``, ``value_states`` ``(B, H, S, D)``; returns the
        layer's keys and values ``(B, H, past + S, D)``."""
        fresh = first_write(self, key_states, value_states)
        if fresh is None:
            return super().update(key_states, value_states, *args, **kwargs)
        self.lazy_initialization(key_states, value_states)
        self.keys, self.values = fresh
        return fresh


class CutileDynamicSlidingWindowLayer(DynamicSlidingWindowLayer):
    """transformers' ``DynamicSlidingWindowLayer`` whose first write copies on the ``kv_append``
    kernel (:func:`first_write`); every other call is the stock ``update``."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """``DynamicSlidingWindowLayer.update`` (5.22.2, pinned): keeps the last ``sliding_window -
        1`` rows, returns the full states (or, recording the past, the visible ones)."""
        fresh = first_write(self, key_states, value_states)
        if fresh is None:
            return super().update(key_states, value_states, *args, **kwargs)
        self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        full_key_states, full_value_states = fresh
        if not self.record_past:
            self.keys = full_key_states[:, :, -self.sliding_window + 1 :, :]
            self.values = full_value_states[:, :, -self.sliding_window + 1 :, :]
            return full_key_states, full_value_states
        self.keys = full_key_states
        self.values = full_value_states
        num_visible = self.sliding_window - 1 + key_states.shape[-2]
        return full_key_states[:, :, -num_visible:, :], full_value_states[:, :, -num_visible:, :]


#: transformers' class -> ours, and the layer types whose registry entry each takes.
OURS = {DynamicLayer: CutileDynamicLayer, DynamicSlidingWindowLayer: CutileDynamicSlidingWindowLayer}
LAYER_TYPES = {"full_attention": DynamicLayer, "sliding_attention": DynamicSlidingWindowLayer,
               "chunked_attention": DynamicSlidingWindowLayer}
_OUR_CLASSES = frozenset(c.__qualname__ for c in OURS.values())
#: The models this module patched and did not unpatch (the registry holds our classes while any is alive).
_HOLDERS: weakref.WeakSet = weakref.WeakSet()


def _ours(cls) -> bool:
    # By name: a second copy of this package (the build variant kernels loads) has its own classes.
    return isinstance(cls, type) and cls.__qualname__ in _OUR_CLASSES and issubclass(cls, tuple(OURS))


def cache_layers(model: nn.Module) -> int:
    """How many layers of a ``DynamicCache(config=model.config)`` take one of our classes (0 for a
    model without such a config or without full, sliding or chunked attention layers)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        return 0
    try:
        types, _ = cache_utils.get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    except (AttributeError, TypeError, ValueError):  # not a decoder config transformers' caches know
        return 0
    return sum(t in LAYER_TYPES for t in types)


def verdict() -> str | None:
    """Why the patch cannot register its layers in this process, or None."""
    for p in PINS:
        if not holds(p.name):
            return f"this transformers' {p.qualname} is not the one the layers follow ({p.name})"
    if not hasattr(cache_utils, "DYNAMIC_LAYER_TYPE_MAPPING"):
        return "this transformers has no DYNAMIC_LAYER_TYPE_MAPPING"
    return None


def patch_dynamic_cache(model: nn.Module) -> int:
    """Patch ``dynamic_cache_prefill`` (module docstring): our layer classes in transformers'
    registry while ``model`` is patched. Returns the model's cache layers they serve (0: already
    patched, nothing to serve, or refused with a log line)."""
    if model in _HOLDERS:
        return 0
    n = cache_layers(model)
    why = verdict() if n else None
    if why is not None:
        logger.info("cutile_kernels: patch dynamic_cache_prefill leaves %s alone: %s", type(model).__name__, why)
        return 0
    if not n:
        return 0
    mapping = cache_utils.DYNAMIC_LAYER_TYPE_MAPPING
    for layer_type, stock in LAYER_TYPES.items():
        now = mapping.get(layer_type)
        if now is stock:
            mapping[layer_type] = OURS[stock]
        elif not _ours(now):
            logger.info("cutile_kernels: patch dynamic_cache_prefill leaves the %r cache layers to %r", layer_type,
                        getattr(now, "__qualname__", now))
    _HOLDERS.add(model)
    logger.info("cutile_kernels: patch dynamic_cache_prefill: the first write of %d DynamicCache layers of %s on "
                "the kv_append kernel", n, type(model).__name__)
    return n


def unpatch_dynamic_cache(model: nn.Module) -> int:
    """Undo :func:`patch_dynamic_cache` for ``model``; with no patched model left, transformers'
    classes go back into the registry (where it still holds this copy's). Returns the cache layers
    the model had served (0 if it was not patched here)."""
    if model not in _HOLDERS:
        return 0
    _HOLDERS.discard(model)
    if not _HOLDERS:
        restore_registry()
    return cache_layers(model)


def restore_registry() -> None:
    """Put transformers' classes back where the registry holds this copy's."""
    mapping = cache_utils.DYNAMIC_LAYER_TYPE_MAPPING
    for layer_type, stock in LAYER_TYPES.items():
        if mapping.get(layer_type) is OURS[stock]:
            mapping[layer_type] = stock


#: This module's patch row (``layers/_registry.py``).
PATCH_ROWS = [Patch("dynamic_cache_prefill", apply=patch_dynamic_cache, undo=unpatch_dynamic_cache,
                    description="a DynamicCache layer's first write (the prefill's keys and values) in one "
                                "kv_append launch instead of two torch.cat copies")]

__all__ = ["CutileDynamicLayer", "CutileDynamicSlidingWindowLayer", "DEVICE_TYPES", "PATCH_ROWS", "PINS",
           "cache_layers", "first_write", "new_buffers", "patch_dynamic_cache", "restore_registry",
           "unpatch_dynamic_cache", "verdict"]
