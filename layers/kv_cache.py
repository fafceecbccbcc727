"""Patch ``dynamic_cache_prefill``: a DynamicCache layer's first write (the prefill) on our ``kv_append`` kernel.

transformers' ``DynamicLayer.update`` (cache_utils.py, v5.22.2) grows a layer's keys and values by
``torch.cat`` on every call; on the first call, the prompt's, that is a cat of an empty tensor
with the new keys, i.e. a copy of the keys and one of the values (two launches a layer, 17 % of
Phi-4-mini's eager prefill's non-GEMM device time on the H200, 2026-12-05). A copy it stays (the
new keys are often views of a projection's output, which the cache must not keep alive, and the
cache's tensors must have the layout stock gives them), but one ``kv_append`` launch makes both.

No hook of transformers reaches this write without changing the layers' classes, which transformers'
own code checks exactly (``integrations/executorch.py`` flattens only ``DynamicLayer`` and
``DynamicSlidingWindowLayer`` for ``torch.export``) and which a pickled cache names. So the patch
replaces the ``update`` method of those two classes while at least one model patched with it is
alive and patched: :func:`dynamic_update` and :func:`sliding_update` (the holders' table travels
with the installed functions, so every copy of this package in the process shares it). For an instance of exactly that
class whose first write :func:`first_write` takes, they copy k and v into new contiguous tensors with
one ``kv_append`` launch where ``torch.cat`` would have: the same values bit for bit, shapes, dtype
and layout; every other call (later writes, other classes, or what :func:`first_write` leaves:
off CUDA, under ``torch.compile`` or CUDA-graph capture, with autograd recording, kernels disabled or
not built for the GPU, other shapes or dtypes) runs transformers' method. The sliding layer's update
is reproduced (its pinned statements, :data:`PINS`); each replacement carries the method it replaced
as ``__wrapped__``, so the pins still read transformers' code. Where the installed transformers
changed either method, or something else replaced one, the patch changes nothing and says so.

The methods are the process's: while a patched model lives, every DynamicCache in the process gets
the first write on our kernel (a model not kernelized included: the same values). When the last
patched model is unpatched or freed, transformers' methods go back.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn
from transformers import cache_utils
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .. import dispatch
from ..ops.kv_cache import DTYPES as KV_DTYPES
from ..ops.kv_cache import kv_append
from ._patching import Patch
from ._pins import Pin, holds, register

logger = logging.getLogger("cutile_kernels")

PINS = (
    Pin("cache_utils", "DynamicLayer.update", "1cac09d084ff6b22",
        "patch dynamic_cache_prefill (dynamic_update: its first write on kv_append, other calls this method)"),
    Pin("cache_utils", "DynamicSlidingWindowLayer.update", "281c79d2b0c52a66",
        "patch dynamic_cache_prefill (sliding_update reproduces it)"),
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
    returns: the same values, shape, dtype and contiguous layout.

    Raises:
        FallbackError: ``CUTILE_KERNELS_STRICT=1`` and the op could not launch its kernel for these
            tensors (the checks above leave it the calls it has variants for)."""
    if layer.is_initialized or _compiling() or dispatch.disabled():
        return None
    # A capture would record the zero slot's fill without running it; a GPU no build of ours runs on
    # would take the op's reference, slower than the cat it replaces.
    if k.is_cuda and (torch.cuda.is_current_stream_capturing() or not dispatch.runs_on(k.device)):
        return None
    if (k.device.type not in DEVICE_TYPES or k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype
            or k.device != v.device or k.dtype not in KV_DTYPES or k.shape[-1] > MAX_HEAD_DIM or k.shape[2] == 0):
        return None
    if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
        return None
    keys, values = new_buffers(k)
    kv_append(keys, values, k, v, _zero(k.device))
    return keys, values


def dynamic_update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
    """``DynamicLayer.update`` while the patch is in effect: ``key_states``, ``value_states`` ``(B, H,
    S, D)``; returns the layer's keys and values ``(B, H, past + S, D)``. An exact ``DynamicLayer``'s
    first write copies on the kernel (:func:`first_write`); every other call is transformers' method."""
    fresh = first_write(self, key_states, value_states) if type(self) is DynamicLayer else None
    if fresh is None:
        return dynamic_update.__wrapped__(self, key_states, value_states, *args, **kwargs)
    self.lazy_initialization(key_states, value_states)
    self.keys, self.values = fresh
    return fresh


def sliding_update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
    """``DynamicSlidingWindowLayer.update`` (5.22.2, pinned) while the patch is in effect: keeps the
    last ``sliding_window - 1`` rows, returns the full states (or, recording the past, the visible
    ones). An exact ``DynamicSlidingWindowLayer``'s first write copies on the kernel
    (:func:`first_write`); every other call is transformers' method."""
    fresh = first_write(self, key_states, value_states) if type(self) is DynamicSlidingWindowLayer else None
    if fresh is None:
        return sliding_update.__wrapped__(self, key_states, value_states, *args, **kwargs)
    self.lazy_initialization(key_states, value_states)
    self.cumulative_length += key_states.shape[-2]
    full_key_states, full_value_states = fresh
    if not self.record_past:
        self.keys = full_key_states[:, :, -self.sliding_window + 1 :, :]
        self.values = full_value_states[:, :, -self.sliding_window + 1 :, :]
        return full_key_states, full_value_states
    self.keys = full_key_states
    self.values = full_value_states
    # A first write shows all of its S rows (num_visible >= S): transformers' slice, kept as it is.
    num_visible = self.sliding_window - 1 + key_states.shape[-2]
    return full_key_states[:, :, -num_visible:, :], full_value_states[:, :, -num_visible:, :]


#: The classes whose ``update`` the patch replaces -> this copy's replacement.
REPLACEMENTS = {DynamicLayer: dynamic_update, DynamicSlidingWindowLayer: sliding_update}
#: Attribute of an installed replacement: its :class:`_Holders`, shared by every copy of this
#: package through the installed function.
_HOLDERS_ATTR = "_cutile_dynamic_cache_holders"


class _Holders(dict):
    """``{id(model): weakref.finalize}`` of the patched models, with the functions installed
    (``installed``: class -> function) and the methods they replaced (``originals``)."""

    def __init__(self, installed: dict, originals: dict):
        super().__init__()
        self.installed, self.originals = installed, originals


def installed() -> _Holders | None:
    """The holders' table of the replacements in effect (this copy's or another's), or None when
    they are not (transformers' methods, or a method someone put over ours)."""
    holders = getattr(DynamicLayer.__dict__.get("update"), _HOLDERS_ATTR, None)
    if holders is None or any(cls.__dict__.get("update") is not fn for cls, fn in holders.installed.items()):
        return None
    return holders


def _restore_stale() -> None:
    # A replacement of ours left in place by a table with no holder (e.g. put back by hand after
    # a release): transformers' method again, so that the verdict sees it.
    for cls in REPLACEMENTS:
        fn = cls.__dict__.get("update")
        table = getattr(fn, _HOLDERS_ATTR, None)
        if table is not None and not table and table.installed.get(cls) is fn:
            cls.update = table.originals[cls]


#: The layer types whose DynamicCache layers are the two classes.
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def cache_layers(model: nn.Module) -> int:
    """How many layers of a ``DynamicCache(config=model.config)`` are full or sliding attention
    layers whose first write the patch serves (0 for a model without such a config)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        return 0
    try:
        types, _ = cache_utils.get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    except (AttributeError, TypeError, ValueError):  # not a decoder config transformers' caches know
        return 0
    return sum(t in LAYER_TYPES for t in types)


def verdict() -> str | None:
    """Why the replacements cannot go in (transformers' methods are not the pinned ones, or another
    library replaced one), or None."""
    for cls, pin in zip(REPLACEMENTS, PINS):
        fn = cls.__dict__.get("update")
        # A wrapped method is someone else's (ours, when in effect, is not asked about): never
        # installed over, so no replacement ever wraps another one.
        if getattr(fn, "__wrapped__", None) is not None or not holds(pin.name):
            return f"this transformers' {pin.qualname} is not the one the patch follows ({pin.name})"
    return None


def _install() -> _Holders:
    originals = {cls: cls.__dict__["update"] for cls in REPLACEMENTS}
    holders = _Holders(dict(REPLACEMENTS), originals)
    for cls, fn in REPLACEMENTS.items():
        fn.__wrapped__ = originals[cls]  # what it calls, and what the pins read through it
        setattr(fn, _HOLDERS_ATTR, holders)
        cls.update = fn
    return holders


def _release(holders: _Holders, key: int) -> None:
    # A holder unpatched or freed: with none left, transformers' methods go back where the class
    # still holds the function installed (a method put over it since is someone else's: left).
    holders.pop(key, None)
    if holders:
        return
    for cls, fn in holders.installed.items():
        if cls.__dict__.get("update") is fn:
            cls.update = holders.originals[cls]
        else:
            logger.info("cutile_kernels: patch dynamic_cache_prefill leaves %s.update as another library set it",
                        cls.__name__)


def patch_dynamic_cache(model: nn.Module) -> int:
    """Patch ``dynamic_cache_prefill`` (module docstring): the replacements in effect while ``model``
    is patched and alive. Returns the model's cache layers they serve (0: already patched, nothing
    to serve, or refused with a log line)."""
    n = cache_layers(model)
    if not n:
        return 0
    holders = installed()
    if holders is None:
        _restore_stale()
        why = verdict()
        if why is not None:
            logger.info("cutile_kernels: patch dynamic_cache_prefill leaves %s alone: %s", type(model).__name__, why)
            return 0
        holders = _install()
    key = id(model)
    if key in holders:
        return 0
    holders[key] = weakref.finalize(model, _release, holders, key)
    logger.info("cutile_kernels: patch dynamic_cache_prefill: the first write of %d DynamicCache layers of %s on "
                "the kv_append kernel", n, type(model).__name__)
    return n


def unpatch_dynamic_cache(model: nn.Module) -> int:
    """Undo :func:`patch_dynamic_cache` for ``model``; with no patched model left, transformers'
    methods go back. Returns the cache layers the model had served (0 if it was not patched)."""
    holders = installed()
    if holders is None or id(model) not in holders:
        return 0
    holders[id(model)].detach()
    _release(holders, id(model))
    return cache_layers(model)


#: This module's patch row (``layers/_registry.py``).
PATCH_ROWS = [Patch("dynamic_cache_prefill", apply=patch_dynamic_cache, undo=unpatch_dynamic_cache,
                    description="a DynamicCache layer's first write (the prefill's keys and values) in one "
                                "kv_append launch instead of two torch.cat copies")]

__all__ = ["DEVICE_TYPES", "LAYER_TYPES", "PATCH_ROWS", "PINS", "REPLACEMENTS", "cache_layers", "dynamic_update",
           "first_write", "installed", "new_buffers", "patch_dynamic_cache", "sliding_update",
           "unpatch_dynamic_cache", "verdict"]
