"""The compile-free decode fast path: ``generate()``'s decode steps replayed as CUDA graphs.

:func:`enable_decode_graphs` (or ``kernel_config(decode_graphs=True)`` at load) hooks three places
of transformers' ``generate`` (``generation/utils.py``, v5.22.2; the hooks are pinned):

* ``get_compiled_call``, which ``generate`` calls when the cache is static and the device a GPU,
  returns a session (:meth:`DecodeGraphs.session`) instead of ``torch.compile(model.__call__)``.
  The session runs a decode step (one new token per row) eagerly the first ``warmup`` times it
  meets a new shape, then captures it in a ``torch.cuda.CUDAGraph`` and replays that graph from then
  on: our kernels, cuBLAS, attention, the final norm and ``lm_head`` in one launch, no dynamo, no
  JIT. Prefill chunks (more than one token) run eagerly.
* ``_prepare_static_cache`` hands out one ``StaticCache`` per batch size, cache-length bucket
  (``length_bucket``), dtype, device and inference mode, reset for the next call, so that a graph
  is captured once per bucket, not per call. A call that returns its cache to the caller
  (``return_dict_in_generate``) gets a fresh one that is never reused.
* ``generate`` itself defaults to ``cache_implementation="static"`` where a static cache serves
  (one beam, no assistant, no other cache asked for).

What a graph is captured for (its key): the cache (its ``id`` and the addresses of its key and
value tensors, which beam search's ``reorder_cache`` replaces), every tensor argument's shape,
dtype, device and strides, every other argument's value, whether inference mode is on, and for
each sliding-window cache layer whether it is full (``StaticSlidingWindowLayer.update`` takes
another branch then). Arguments are copied into the graph's input buffers before each replay. A
decode step also advances plain Python integers of the cache (the sliding layers'
``cumulative_length_int``), which a replay does not run: the capture records how each changed and
every replay applies the same change. A cache's graphs are dropped when the cache is freed.

What the step runs of ours besides the model's kernels: each full-attention cache layer writes its
new keys and values with one ``kv_append`` launch (:func:`_kernel_static_update`; transformers'
``StaticLayer.update`` makes four), and so does each sliding-window layer while its window has
room (:func:`_kernel_sliding_update`); our attention reads only a full layer's filled slots, the
count read on the device (``layers/attention.py``, ``cutile_kv_len``). The full layers' lengths
(``cumulative_length``, one device integer a layer) are views of one buffer (:func:`_group_lengths`),
advanced once after the step's forward instead of once a layer (:meth:`DecodeGraphs.forward`); in
the step, each layer writes at its length and its attention reads the step's filled length.

The steps are captured inside ``dispatch.programmatic_launches`` (``pdl``, default :data:`PDL`): each
of our kernels that has a programmatic dependent launch twin (``kernel_src/_pdl.py``: it waits for
the kernel before it at its start) is captured with CUDA's programmatic stream serialization, so that
in a replay it launches while the kernel before it finishes instead of after; the same kernels in the
same order, the same bits. Warm-up and eager steps launch as always (the twins' modules load during
the capture, as the GEMV's do). ``CUTILE_KERNELS_PDL=0`` (or ``pdl=False``) turns it off.

A step called without a mask or positions (a decode loop of one's own, or the bench) over a cache
with sliding layers gets its positions and window masks made from a layer's length on the device
(:meth:`_Session._device_inputs`: a few launches outside the graph, no host work), after one check
per cache and session against transformers' masks; where that does not serve (padding, positions
passed, eager attention's additive masks, chunked attention, a model's own mask function),
``create_masks_for_generate`` makes them on the host, as ``generate`` does before each step anyway.

A hybrid model's static cache (Qwen3.5: ``LinearAttentionLayer`` beside ``StaticLayer``) is captured
too: the linear-attention conv and recurrent states live at fixed addresses and are updated in
place (by transformers' cache, and by our gated DeltaNet kernels directly).

What runs eagerly, said once per reason through ``dispatch.fallback``: a model whose weights are
on several devices (``device_map`` over GPUs), ``inputs_embeds``, a cache
that is not a ``StaticCache`` of ``StaticLayer``/``StaticSlidingWindowLayer``/``LinearAttentionLayer``,
a linear-attention layer that records its past, autograd recording, more than ``MAX_SHAPES_PER_CACHE`` shapes over
one cache, or a capture that failed or changed Python state other than integers. The sampling
step, logits processors and stopping criteria stay in ``generate``'s loop (outside the graph).

Errors instead of wrong numbers: a prompt of more than one token that does not fit the static
cache's full-attention layers raises ``ValueError`` before the prefill writes it; a session's
decode step into a full cache raises :class:`CacheFullError` (``generate`` sizes its cache so that
this does not happen; a cache passed by the user can fill). Sliding-window layers never fill: they
keep the last window, as in transformers. The session counts the cache's length on the host from
one read at its first step: it serves one generation (``generate`` asks for a new one per call),
and tokens written into the cache by other calls meanwhile are not counted.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import typing
import weakref

import torch
from transformers.utils import ModelOutput

from .. import dispatch
from ..ops.attention import rope_append_attention, rope_append_attention_takes
from ..ops.kv_cache import kv_append
from ..ops.rope import rope_append, rope_append_takes
from ._pins import Pin, holds, register
from .attention import NAMES as ATTENTION_NAMES
from .attention import PIN as STATIC_UPDATE_PIN
from .attention import SLIDING_PIN
from .attention import STEP_FILLED, STEP_PLAIN_MASKS

#: The transformers code the decode graphs reproduce (gating) or follow.
PINS = (
    SLIDING_PIN,
    # Followed, not reproduced: the hooks generate calls.
    Pin("generation.utils", "GenerationMixin._prepare_static_cache", "d48d96b8ecc7e8b3",
        "decode graphs: DecodeGraphs.prepare_static_cache takes its arguments and returns its cache", gates=False),
    Pin("modeling_utils", "PreTrainedModel.get_compiled_call", "c072e65d6dc2b97a",
        "decode graphs: generate calls it for the decode step; ours returns a DecodeGraphs session", gates=False),
    Pin("generation.utils", "GenerationMixin._valid_auto_compile_criteria", "53be41e4043d610e",
        "decode graphs: when it holds, generate asks get_compiled_call for the decode step", gates=False),
)
register(*PINS)

logger = logging.getLogger("cutile_kernels")  # the package's one logger, whichever copy this is

#: ``model`` attribute holding the :class:`DecodeGraphs` of an enabled model.
ATTR = "_cutile_decode_graphs"
#: Cache-length bucket (tokens) of the static caches handed to ``generate``.
LENGTH_BUCKET = 256
#: Static caches kept per model (least recently used dropped first, with their graphs).
MAX_CACHES = 4
#: Graphs kept over one cache; a step of yet another shape runs eagerly and says so.
MAX_SHAPES_PER_CACHE = 8
#: Whether the captured steps launch our kernels with programmatic dependent launch (the default of
#: :class:`DecodeGraphs` ``pdl``, read when one is made; ``CUTILE_KERNELS_PDL=0`` turns it off). Estimate
#: before it (Llama-3.2-1B at batch 1 on an H100, replay 1.247 ms against 1.188 ms of kernels in 156
#: launches): the gaps between launches, ~0.4 us each, f ~0.05; about two thirds of the launches are ours
#: (a kernel of ours after cuBLAS's gains less), ceiling ~1.03x. Measured (H100, 2026-12-07, alternating
#: replays in one process, docs/results.md): Llama-3.2-1B 1.186 against 1.234 ms at batch 1 (1.04x), level
#: at 16 (its projections there are cuBLAS's); Qwen3-0.6B 1.186 against 1.312 at batch 1 (1.11x: its q/k
#: norms, cache write and attention are three launches of ours).
PDL = True


class CacheFullError(RuntimeError):
    """A decode step would write past the end of a static KV cache."""


@functools.cache
def _layer_classes():
    from transformers.cache_utils import LinearAttentionLayer, StaticLayer, StaticSlidingWindowLayer

    return StaticLayer, StaticSlidingWindowLayer, LinearAttentionLayer


def _linear(layer) -> bool:
    """A linear-attention layer (gated DeltaNet's conv and recurrent states; no keys or values)."""
    return hasattr(layer, "recurrent_states")


class _Scan(typing.NamedTuple):
    """One pass over a cache's layers as they are now (:func:`_scan`)."""

    #: Why the cache cannot back a captured decode step (``filled``: after its prefill), or None.
    why: str | None
    #: The sliding-window layers (:func:`_sliding_layers`); empty where ``why`` is set.
    sliding: tuple = ()
    #: The addresses of every tensor the layers hold (keys and values, or a linear-attention layer's
    #: conv and recurrent states), layer by layer: part of a graph's key. Empty where ``why`` is set.
    storage: tuple = ()
    #: A full-attention layer (they all hold the same length and room), or None when every layer
    #: slides or is linear attention (then nothing fills: a window keeps the last tokens, a
    #: recurrent state its size).
    full: object = None


def _scan(cache, filled: bool = True) -> _Scan:
    """What a decode step needs to know of ``cache``'s layers, read in one pass at every step, not
    remembered (a layer may be replaced or reordered, or ``Cache.activate_past_recording()`` called,
    between two steps): why it cannot back a captured step, and where it can, the sliding layers,
    the storage addresses and a full layer. Linear-attention layers (a hybrid model's, e.g. Qwen3.5)
    qualify: transformers allocates their states once and updates them in place (static addresses),
    unless they record past states for a later ``crop``. One pass instead of four saves ~6 us of
    host time a step (16 layers, CPU)."""
    from transformers.cache_utils import StaticCache

    if not isinstance(cache, StaticCache):
        return _Scan(f"the cache is a {type(cache).__name__}, not a StaticCache")
    static, sliding_cls, linear_cls = _layer_classes()
    sliding, storage, full = [], [], None
    for layer in cache.layers:
        kind = type(layer)
        if kind is linear_cls:
            if layer.record_past:
                return _Scan("a linear-attention layer records past states (its conv state grows)")
            storage += [t.data_ptr() for t in (*layer.conv_states.values(), *layer.recurrent_states.values())
                        if t is not None]
            continue
        if kind is not static and kind is not sliding_cls:
            return _Scan(f"the static cache has a {kind.__name__} layer (only StaticLayer, "
                         "StaticSlidingWindowLayer and LinearAttentionLayer)")
        if not layer.is_initialized:
            if filled:
                return _Scan("the static cache is empty (a decode step comes after a prefill)")
        else:
            storage += [layer.keys.data_ptr(), layer.values.data_ptr()]
        if kind is sliding_cls:
            sliding.append(layer)
        elif full is None:
            full = layer
    return _Scan(None, tuple(sliding), tuple(storage), full)


def _sliding(layer) -> bool:
    return hasattr(layer, "cumulative_length_int")


def _sliding_layers(cache) -> list:
    """The sliding-window layers of ``cache`` as it is now (read at every step, not remembered: a
    layer replaced since would otherwise keep its old object's window state in the graph key)."""
    return [layer for layer in cache.layers if _sliding(layer)]


def _capturable_sliding_update(layer, key_states, value_states, *args, **kwargs):
    """``StaticSlidingWindowLayer.update`` (pinned) with its full-window one-token step done without
    ``torch.tensor([-1], device=...)``, a host-to-device copy that CUDA graph capture refuses: the
    window is shifted left by one and the new token written last, as ``roll`` + index assignment
    do. Every other step is the class's own."""
    if layer.is_initialized and layer.cumulative_length_int >= layer.max_cache_len and key_states.shape[-2] == 1:
        layer.cumulative_length_int += 1
        layer.keys.copy_(torch.cat((layer.keys[:, :, 1:], key_states), dim=-2))
        layer.values.copy_(torch.cat((layer.values[:, :, 1:], value_states), dim=-2))
        return layer.keys, layer.values
    return type(layer).update(layer, key_states, value_states, *args, **kwargs)


def _kernel_static_update(layer, key_states, value_states, *args, **kwargs):
    """``StaticLayer.update`` (pinned) with its writes as one ``kv_append`` launch (the slot read on
    the device) instead of ``arange``, an add and two ``index_copy_``; then ``cumulative_length``
    advances as there. The first call (lazy initialization) is the class's own."""
    if not layer.is_initialized:
        return type(layer).update(layer, key_states, value_states, *args, **kwargs)
    kv_append(layer.keys, layer.values, key_states, value_states, layer.cumulative_length)
    # A separate add: folding it into the write (kv_append_advance, one block and an atomic add)
    # made the launch 3.55 us on the H200 against 2.2 + 1.07 for the two, replay unchanged (2026-12-03).
    # In a step of ours the step advances every full layer at its end, in one launch.
    if STEP_FILLED not in layer.__dict__:
        layer.cumulative_length.add_(key_states.shape[-2])
    return layer.keys, layer.values


#: Attribute that :func:`_make_capturable` sets on a layer it gives :func:`_kernel_static_update` or
#: :func:`_kernel_sliding_update`: ``(q, k, v, cos, sin) -> (q_rot, keys, values)``, RoPE (our
#: ``apply_rope``'s formula: Llama's, partial rotary included) with the layer's update as one launch
#: (:func:`_kernel_rope_update`, :func:`_kernel_rope_sliding_update`), returning None where a step
#: is not one launch. The reproduced attention forwards take it when their RoPE is ours
#: (``layers/_direct.py``, ``rope_and_cache``).
ROPE_UPDATE = "_cutile_rope_update"


def _armed_step(layer, armed, new: int, takes, launch):
    # launch() (one launch writing `new` rows at the layer's device-side length) where the layer's
    # update is still `armed` (the one _make_capturable gave it) and takes(), then the length advanced
    # (unless the step advances it at its end: DecodeGraphs.forward); None otherwise, nothing done.
    update = layer.__dict__.get("update")
    if getattr(update, "func", None) is not armed or update.args[0] is not layer or not takes():
        return None
    out = launch()
    if STEP_FILLED not in layer.__dict__:
        layer.cumulative_length.add_(new)
    return out


def _in_window(layer, new: int, step):
    # step() for a sliding-window layer whose window has room for `new` rows (its slots are then the
    # positions), its Python count advanced with the step; None otherwise (a full window shifts).
    if not (layer.is_initialized and layer.cumulative_length_int + new <= layer.max_cache_len):
        return None
    out = step()
    if out is not None:
        layer.cumulative_length_int += new
    return out


def _rope_append_step(layer, armed, query_states, key_states, value_states, cos, sin):
    # RoPE and the writes of `armed` as one rope_append launch, then the length advanced; None where
    # rope_append does not compute what the two steps would.
    def launch():
        return (rope_append(query_states, key_states, value_states, cos, sin, layer.keys, layer.values,
                            layer.cumulative_length), layer.keys, layer.values)

    return _armed_step(layer, armed, key_states.shape[-2], lambda: rope_append_takes(
        query_states, key_states, value_states, cos, sin, layer.keys, layer.values), launch)


#: Attribute that :func:`_make_capturable` sets beside :data:`ROPE_UPDATE` while
#: :data:`ROPE_ATTEND_ON`: ``(q, k, v, cos, sin, scale, window) -> attention output (B, Hq, 1,
#: D)``, RoPE, the layer's cache write and the decode
#: attention over its filled slots as one ``rope_append_attention`` launch
#: (:func:`_kernel_rope_attend`, :func:`_kernel_rope_sliding_attend`), or None where a step is not
#: one launch. The reproduced Llama-code attention forward takes it in a plain step whose attention
#: our kernel takes (``layers/_direct.py``, ``rope_attend``).
ROPE_ATTEND = "_cutile_rope_attend"
#: Whether :func:`_make_capturable` arms :data:`ROPE_ATTEND`. On since 2026-12-06 (H100,
#: ``graph_step.py llama-3.2-1b --ab-rope-attend``, alternating replays): Llama-3.2-1B's batch-1 replay
#: 1.267 ms with the one launch against 1.326 with ``rope_append`` then ``attention``, batch 16 1.418
#: against 1.481 (``dev/microbench/rope_attend_bench.py``: 8.8 against 12.3 us a layer at batch 1). A
#: first version whose KV loop the compiler unrolled (five times the attention kernel's tensor-core
#: instructions, ``dev/sweeps/rope_attend_variants.py``) had lost, 1.382 against 1.329 ms.
ROPE_ATTEND_ON = True


def _rope_attend_step(layer, armed, query_states, key_states, value_states, cos, sin, scale, window):
    # RoPE, the writes of `armed` and the attention over the layer's filled slots as one launch, then
    # the length advanced; None where the one launch does not take the call.
    def launch():
        return rope_append_attention(query_states, key_states, value_states, cos, sin, layer.keys, layer.values,
                                     layer.cumulative_length, scale=scale, window=window)

    return _armed_step(layer, armed, 1, lambda: rope_append_attention_takes(
        query_states, key_states, value_states, cos, sin, layer.keys, layer.values), launch)


def _kernel_rope_attend(layer, query_states, key_states, value_states, cos, sin, scale, window=None):
    """:func:`_kernel_rope_update` and the decode attention over the layer's filled slots (causal,
    ``window``; no mask: a plain step's) as one ``rope_append_attention`` launch. Returns the
    attention output ``(B, Hq, 1, D)`` (laid out as ``(B, 1, Hq, D)``), or None (nothing done)
    where the layer's ``update`` is no longer the one armed or the launch does not take the call
    (:func:`~..ops.attention.rope_append_attention_takes`)."""
    return _rope_attend_step(layer, _kernel_static_update, query_states, key_states, value_states, cos, sin, scale,
                             window)


def _kernel_rope_sliding_attend(layer, query_states, key_states, value_states, cos, sin, scale, window=None):
    """:func:`_kernel_rope_attend` for a sliding-window layer whose window has room for the step
    (its slots are then the positions), both lengths advanced as :func:`_kernel_sliding_update`
    advances them; None otherwise."""
    return _in_window(layer, 1, lambda: _rope_attend_step(layer, _kernel_sliding_update, query_states, key_states,
                                                         value_states, cos, sin, scale, window))


def _kernel_rope_update(layer, query_states, key_states, value_states, cos, sin):
    """RoPE of q and k (our ``apply_rope``'s formula), then :func:`_kernel_static_update`'s writes
    of the rotated keys and the values and its advance, on one ``rope_append`` launch for a decode
    step (instead of RoPE's and ``kv_append``'s). Returns ``(q_rot, keys, values)`` as RoPE and
    ``update`` return them, or None (nothing done) where the layer's ``update`` is no longer the one
    armed with it or ``rope_append`` does not compute what the two steps would
    (:func:`~..ops.rope.rope_append_takes`)."""
    return _rope_append_step(layer, _kernel_static_update, query_states, key_states, value_states, cos, sin)


def _kernel_rope_sliding_update(layer, query_states, key_states, value_states, cos, sin):
    """:func:`_kernel_rope_update` for a sliding-window layer whose window has room for the step
    (the steps :func:`_kernel_sliding_update` writes as a full layer's, both lengths advanced as
    there); None otherwise (a full window shifts: RoPE, then the layer's update)."""
    return _in_window(layer, key_states.shape[-2], lambda: _rope_append_step(
        layer, _kernel_sliding_update, query_states, key_states, value_states, cos, sin))


def _kernel_sliding_update(layer, key_states, value_states, *args, **kwargs):
    """``StaticSlidingWindowLayer.update`` (pinned) with the writes of a window that does not fill
    past its end as one ``kv_append`` launch (transformers: ``arange``, an add and two
    ``index_copy_``), both lengths advanced as there; every other step as
    :func:`_capturable_sliding_update`."""
    new = key_states.shape[-2]
    if layer.is_initialized and layer.cumulative_length_int + new <= layer.max_cache_len:
        layer.cumulative_length_int += new
        return _kernel_static_update(layer, key_states, value_states)  # the writes a full layer makes
    return _capturable_sliding_update(layer, key_states, value_states, *args, **kwargs)


def _make_capturable(cache, cache_kernel: bool = True) -> bool:
    """Give the sliding layers of ``cache`` :func:`_capturable_sliding_update` (with ``cache_kernel``
    :func:`_kernel_sliding_update`) and, with ``cache_kernel``, the full ones
    :func:`_kernel_static_update`, where keys and values have one shape (not MLA's two head dims);
    a layer given a kernel update also gets its one-launch RoPE variant (:data:`ROPE_UPDATE`)
    (once per cache; each only while its pin holds: otherwise the
    steps stay transformers' own, said once, and a failed capture says why). Returns whether this
    call changed the cache (:func:`_restore_updates` undoes it)."""
    if getattr(cache, "_cutile_capturable", False):
        return False
    cache._cutile_capturable = True
    sliding_ok = holds(SLIDING_PIN.name)
    if not sliding_ok and _sliding_layers(cache):
        logger.warning("cutile_kernels: transformers' StaticSlidingWindowLayer.update is not the pinned one; "
                       "decode graphs leave it alone")
    full_ok = cache_kernel and holds(STATIC_UPDATE_PIN.name)
    if cache_kernel and not full_ok:
        logger.warning("cutile_kernels: transformers' StaticLayer.update is not the pinned one; decode graphs "
                       "keep its cache writes (no kv_append)")
    armed = []
    for layer in cache.layers:
        if _linear(layer):
            continue
        if _sliding(layer):
            if sliding_ok:
                kernel = cache_kernel and layer.is_initialized and layer.keys.shape == layer.values.shape
                layer.update = functools.partial(_kernel_sliding_update if kernel else _capturable_sliding_update,
                                                 layer)
                if kernel:
                    setattr(layer, ROPE_UPDATE, functools.partial(_kernel_rope_sliding_update, layer))
                    if ROPE_ATTEND_ON:
                        setattr(layer, ROPE_ATTEND, functools.partial(_kernel_rope_sliding_attend, layer))
        elif full_ok and layer.is_initialized and layer.keys.shape == layer.values.shape:
            layer.update = functools.partial(_kernel_static_update, layer)
            setattr(layer, ROPE_UPDATE, functools.partial(_kernel_rope_update, layer))
            if ROPE_ATTEND_ON:
                setattr(layer, ROPE_ATTEND, functools.partial(_kernel_rope_attend, layer))
            armed.append(layer)
    _group_lengths(cache, armed)
    return True


#: Attribute of a cache whose full layers' lengths :func:`_group_lengths` made views of one buffer:
#: ``(buffer, layers, views)``.
LENGTHS = "_cutile_lengths"


def _group_lengths(cache, layers: list) -> None:
    """Make the ``cumulative_length`` of ``layers`` (full-attention layers just given
    :func:`_kernel_static_update`) views of one int64 buffer, so that a step of ours advances them
    all in one launch (:meth:`DecodeGraphs.forward`); where they hold the same length (read once,
    on the device) and there are two or more. Each view is a tensor of its own to transformers
    (``reset`` zeroes it in place, ``update`` adds to it), marked as a static address as
    ``StaticLayer.lazy_initialization`` marks the tensor it replaces.

    Estimate, written before the change (Llama-3.2-1B's fast-path replay at batch 1, 2026-12-04
    profile): the 16 per-layer advances are ~17 us of a ~1.13-1.19 ms step (~1.07 us a launch);
    two launches instead (the step's filled length, then the one advance), f ~0.013, ceiling
    ~1.013x."""
    if len(layers) < 2:
        return
    now = [layer.cumulative_length for layer in layers]
    base = now[0]._base
    # Grouped before (a cache armed again after _restore_updates): the same buffer, so that a graph
    # captured over it stays valid.
    again = (base is not None and base.dim() == 1 and base.numel() == len(now)
             and all(t._base is base and t.dim() == 0 and t.storage_offset() == i for i, t in enumerate(now)))
    lengths = base if again else torch.stack([t.reshape(()) for t in now])
    if not bool((lengths == lengths[0]).all()):
        return
    if not again:
        for i, layer in enumerate(layers):
            layer.cumulative_length = lengths[i]
            torch._dynamo.mark_static_address(layer.cumulative_length)
    cache.__dict__[LENGTHS] = (lengths, tuple(layers), tuple(layer.cumulative_length for layer in layers))


def _grouped(cache):
    """The :func:`_group_lengths` buffer and layers of ``cache`` while each layer still holds its
    view and our :func:`_kernel_static_update` (a layer given another ``update`` since, or another
    length tensor, would be advanced twice or not at all), else None."""
    group = getattr(cache, "__dict__", {}).get(LENGTHS)
    if group is None:
        return None
    lengths, layers, views = group
    for layer, view in zip(layers, views):
        update = layer.__dict__.get("update")
        if (layer.cumulative_length is not view or getattr(update, "func", None) is not _kernel_static_update
                or update.args[0] is not layer):
            return None
    return lengths, layers


def _restore_updates(cache) -> None:
    """Undo :func:`_make_capturable`: the layers' own ``update`` again (their lengths stay views of
    the shared buffer, each advanced by its own ``update`` as before)."""
    for layer in cache.layers:
        layer.__dict__.pop("update", None)
        layer.__dict__.pop(ROPE_UPDATE, None)
        layer.__dict__.pop(ROPE_ATTEND, None)
    cache.__dict__.pop(LENGTHS, None)
    cache._cutile_capturable = False


def _python_state(cache) -> dict:
    """The plain Python values of the cache and its layers a step may change, by (object, name)."""
    state = {}
    for obj in (cache, *cache.layers):
        for name, value in vars(obj).items():
            if isinstance(value, (bool, int, float, str, type(None))):
                state[(id(obj), name)] = value
    return state


def _flatten(kwargs: dict, prefix=()) -> tuple[list, list]:
    """Split keyword arguments into (tensor paths and tensors, the rest as a hashable signature)."""
    tensors, sig = [], []
    for name in sorted(kwargs):
        value, path = kwargs[name], (*prefix, name)
        if isinstance(value, torch.Tensor):
            tensors.append((path, value))
            sig.append((path, "T", tuple(value.shape), value.dtype, value.device, value.stride()))
        elif isinstance(value, dict):
            sub_t, sub_s = _flatten(value, path)
            tensors += sub_t
            sig += sub_s
        elif isinstance(value, (bool, int, float, str, type(None))):
            sig.append((path, "V", value))
        else:  # a cache or another object: the same object
            sig.append((path, "O", id(value)))
    return tensors, sig


def _with(kwargs: dict, tensors: dict, prefix=()) -> dict:
    """``kwargs`` with the tensors at ``tensors``' paths replaced."""
    out = {}
    for name, value in kwargs.items():
        path = (*prefix, name)
        if path in tensors:
            out[name] = tensors[path]
        elif isinstance(value, dict):
            out[name] = _with(value, tensors, path)
        else:
            out[name] = value
    return out


def _clone(v):
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, (tuple, list)):
        return type(v)(_clone(x) for x in v)
    return v


def _copy_out(out, cache):
    """A model output with its tensors cloned (the graph's outputs are overwritten by the next
    replay) and ``past_key_values`` the live cache (the kept output does not hold it: see
    :func:`_kept`). A ``ModelOutput`` is filled field by field as its own ``__setitem__`` does
    (the mapping entry and the attribute), without its ``__init__`` (~15 us of host time a step)."""
    if isinstance(out, ModelOutput):
        new = type(out).__new__(type(out))
        for k, v in out.items():
            v = cache if k == "past_key_values" else _clone(v)
            collections.OrderedDict.__setitem__(new, k, v)
            object.__setattr__(new, k, v)
        return new
    if isinstance(out, dict):
        return type(out)((k, cache if k == "past_key_values" else _clone(v)) for k, v in out.items())
    return _clone(out)


def _kept(out):
    """The captured output without its cache reference (which would keep the cache alive)."""
    if isinstance(out, dict) and "past_key_values" in out:
        return type(out)(**{k: (True if k == "past_key_values" else v) for k, v in out.items()})
    return out


@dataclasses.dataclass
class _Entry:
    seen: int = 0
    graph: object = None
    inputs: dict = dataclasses.field(default_factory=dict)
    #: ``inputs``' tensors in the order :func:`_flatten` lists a step's (the key holds the paths).
    targets: list = dataclasses.field(default_factory=list)
    output: object = None
    #: (object, attribute, change per step) for the Python integers a step advances.
    deltas: list = dataclasses.field(default_factory=list)
    eager: str | None = None


class DecodeGraphs:
    """Captures and replays ``model``'s decode steps (see the module docstring).

    Args:
        model: a transformers causal LM on a CUDA device (kernelized or not).
        warmup: eager steps of a new shape before it is captured (most kernels and cuBLAS load then;
            the GEMV of patch ``gemv`` runs only in captured steps, so it loads during the capture).
        length_bucket: static caches for ``generate`` are ``max_cache_len`` rounded up to this.
        max_caches: static caches kept (and the graphs over them).
        graph_factory: makes an object with ``capture(fn)`` returning fn's output and ``replay()``;
            default :class:`CudaGraph`. Tests on a CPU pass an emulation.
        cache_kernel: write each step's keys and values with the ``kv_append`` kernel (one launch a
            layer instead of four); read when a cache is first met.
        pdl: capture the steps inside ``dispatch.programmatic_launches``: each of our kernels built
            with a programmatic dependent launch twin (``kernel_src/_pdl.py``) may start while the
            kernel before it finishes; None: :data:`PDL` unless ``CUTILE_KERNELS_PDL=0``. Read at each
            capture.
    """

    def __init__(self, model, warmup: int = 1, length_bucket: int = LENGTH_BUCKET, max_caches: int = MAX_CACHES,
                 graph_factory=None, cache_kernel: bool = True, pdl: bool | None = None):
        self.model = model
        self.warmup = warmup
        self.length_bucket = length_bucket
        self.max_caches = max_caches
        self.graph_factory = graph_factory or CudaGraph
        self.cache_kernel = cache_kernel
        self.pdl = (PDL and not dispatch.pdl_switched_off()) if pdl is None else bool(pdl)
        self.entries: dict = {}
        self.caches: collections.OrderedDict = collections.OrderedDict()
        self.captures = 0
        self.replays = 0
        self.pool = None
        self._watched: set = set()
        #: Caches whose layers' ``update`` the graphs replaced (restored by disable_decode_graphs).
        self._changed: weakref.WeakSet = weakref.WeakSet()
        #: Set by ``generate`` (ours) while the call returns its cache to the caller.
        self.returns_cache = False
        devices = sorted({str(p.device) for p in model.parameters()})
        #: Why no step of this model is captured, or None: a model split over devices (``device_map``)
        #: has work on several, and a CUDA graph captures one device's.
        self.split = (f"the model's weights are on {len(devices)} devices ({', '.join(devices)}); a CUDA graph "
                      "captures one device's work" if len(devices) > 1 else None)

    # -- the decode step ---------------------------------------------------------------------------

    def session(self) -> _Session:
        """A decode-step callable for one generation (what ``get_compiled_call`` returns): it checks
        each step against the cache's capacity, counting on the host from one read of the cache's
        length at its first step (see the module docstring for what that does not see)."""
        return _Session(self)

    def _key(self, cache, sig, plain: bool, scan: _Scan | None = None) -> tuple:
        scan = scan or _scan(cache)
        full = tuple([layer.cumulative_length_int >= layer.max_cache_len for layer in scan.sliding])
        # The storage a graph reads: beam search's reorder_cache puts new tensors in the layers.
        return (id(cache), tuple(sig), full, scan.storage, torch.is_inference_mode_enabled(), plain)

    def step(self, kwargs: dict, scan: _Scan | None = None, plain: bool = False):
        """Run one decode step: eagerly, by capture, or by replay. Returns the model output.
        ``scan``: :func:`_scan` of the step's cache as it is now (the session has it; read here
        where None). ``plain``: the step's masks are those of an unpadded batch (:meth:`forward`)."""
        cache = kwargs.get("past_key_values")
        scan = scan or _scan(cache)
        why = self._why_eager(kwargs, scan.why)
        if why is not None:
            dispatch.fallback("decode_graphs", why)
            return self.model(**kwargs)
        if _make_capturable(cache, self.cache_kernel):
            self._changed.add(cache)
        self._watch(cache)
        tensors, sig = _flatten(kwargs)
        key = self._key(cache, sig, plain, scan)
        entry = self.entries.get(key)
        if entry is None:
            if sum(k[0] == key[0] for k in self.entries) >= MAX_SHAPES_PER_CACHE:
                dispatch.fallback("decode_graphs", f"the decode steps over one cache took more than "
                                  f"{MAX_SHAPES_PER_CACHE} shapes (an argument that changes every step?)")
                return self.model(**kwargs)
            entry = self.entries[key] = _Entry()
        if entry.eager is not None:
            dispatch.fallback("decode_graphs", entry.eager)
            return self.model(**kwargs)
        if entry.seen < self.warmup:
            entry.seen += 1
            return self.graph_factory.warm(lambda: self.forward(kwargs, plain))
        if entry.graph is None:
            return self._capture(entry, kwargs, tensors, cache, plain)
        # One call for the step's inputs (token ids, positions...; one launch where they share a dtype
        # and device): host time before the replay adds to a step that waits for the one before it.
        torch._foreach_copy_(entry.targets, [t for _, t in tensors])
        entry.graph.replay()
        for obj, name, delta in entry.deltas:
            setattr(obj, name, getattr(obj, name) + delta)
        self.replays += 1
        return _copy_out(entry.output, cache)

    def forward(self, kwargs: dict, plain: bool = False):
        """``model(**kwargs)`` as a warm-up or captured decode step runs it (a replay repeats what it
        launched): where the cache's full layers share one length buffer (:func:`_grouped`), each
        layer writes at its length and its attention reads the filled length (``STEP_FILLED``,
        computed once), and the buffer advances in one launch after the forward. With ``plain``
        (the step's masks are an unpadded batch's: each query sees every filled slot of a full
        layer, and of a sliding layer whose window has room), the cache's attention layers carry
        ``STEP_PLAIN_MASKS`` through the forward: our attention forwards then attend by the layers'
        filled lengths, and where our kernel takes the call it reads no mask (``layers/attention.py``
        ``step_plain``): it loads no mask tile."""
        cache = kwargs.get("past_key_values")
        marked = [layer for layer in cache.layers if not _linear(layer)] if plain else []
        for layer in marked:
            layer.__dict__[STEP_PLAIN_MASKS] = True
        try:
            return self._forward(kwargs)
        finally:
            for layer in marked:
                layer.__dict__.pop(STEP_PLAIN_MASKS, None)

    def _forward(self, kwargs: dict):
        group = _grouped(kwargs.get("past_key_values"))
        if group is None:
            return self.model(**kwargs)
        lengths, layers = group
        new = kwargs["input_ids"].shape[1]
        filled = lengths[0] + new
        for layer in layers:
            layer.__dict__[STEP_FILLED] = filled
        try:
            out = self.model(**kwargs)
        finally:
            for layer in layers:
                layer.__dict__.pop(STEP_FILLED, None)
        lengths.add_(new)
        return out

    def _watch(self, cache) -> None:
        """Drop a cache's graphs when the cache is freed: a graph holds its tensors' addresses, and
        a later cache may get the same ``id``."""
        cid = id(cache)
        if cid not in self._watched:
            self._watched.add(cid)
            weakref.finalize(cache, _forget, weakref.ref(self), cid)

    def forget(self, cid: int) -> None:
        """Drop the graphs captured over the cache whose ``id`` is ``cid``."""
        self._watched.discard(cid)
        for key in [k for k in self.entries if k[0] == cid]:
            del self.entries[key]

    def _why_eager(self, kwargs: dict, cache_why: str | None) -> str | None:
        if self.split is not None:
            return self.split
        if kwargs.get("inputs_embeds") is not None:
            return "inputs_embeds (decode graphs take input_ids)"
        ids = kwargs.get("input_ids")
        if ids is None or ids.dim() != 2 or ids.shape[1] != 1:
            return "not a decode step (input_ids of one token per row)"
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.model.parameters()):
            return "autograd is recording (decode graphs are for inference)"
        return cache_why

    def _capture(self, entry: _Entry, kwargs: dict, tensors: list, cache, plain: bool = False):
        entry.inputs = {path: t.clone() for path, t in tensors}
        entry.targets = [entry.inputs[path] for path, _ in tensors]
        static_kwargs = _with(kwargs, entry.inputs)
        objs = {id(o): o for o in (cache, *cache.layers)}
        before = _python_state(cache)
        graph = self.graph_factory()
        try:
            with dispatch.programmatic_launches(self.pdl):
                output = graph.capture(lambda: self.forward(static_kwargs, plain), self)
        except Exception as exc:  # noqa: BLE001 - e.g. a host sync in the step; nothing ran on the device
            for (oid, name), value in before.items():
                setattr(objs[oid], name, value)
            entry.eager = f"the decode step cannot be captured ({type(exc).__name__}: {exc})"
            logger.warning("cutile_kernels: %s; this shape runs eagerly", entry.eager)
            dispatch.fallback("decode_graphs", entry.eager)
            return self.model(**kwargs)
        after = _python_state(cache)
        deltas, other = [], []
        for k in set(before) | set(after):
            b, a = before.get(k), after.get(k)
            if a == b:
                continue
            if type(a) is int and type(b) is int:
                deltas.append((objs[k[0]], k[1], a - b))
            else:
                other.append(k[1])
        if other:  # the step changed state a replay cannot reproduce: this shape stays eager
            entry.eager = f"a decode step changes the cache's {sorted(other)} (not replayable)"
            logger.warning("cutile_kernels: %s; this shape runs eagerly", entry.eager)
            graph.replay()  # the captured step is this step: its tensor work still has to run
            return _copy_out(output, cache)
        entry.graph, entry.output, entry.deltas = graph, _kept(output), deltas
        self.captures += 1
        graph.replay()  # capture records without running: this step's work runs now
        return _copy_out(output, cache)

    # -- static caches for generate ----------------------------------------------------------------

    def prepare_static_cache(self, cache_implementation: str, batch_size: int, max_cache_len: int,
                             prefill_chunk_size, model_kwargs):
        """``generate``'s ``_prepare_static_cache`` with reuse: one ``StaticCache`` per
        (batch size, ``max_cache_len`` rounded up to ``length_bucket``), reset for each call."""
        from transformers.cache_utils import StaticCache

        model = self.model
        if "offloaded" in cache_implementation or model.config.is_encoder_decoder or self.returns_cache:
            # A cache generate hands back to the caller is theirs: a fresh one, never reused.
            return type(model)._prepare_static_cache(model, cache_implementation, batch_size, max_cache_len,
                                                     prefill_chunk_size, model_kwargs)
        length = -(-max_cache_len // self.length_bucket) * self.length_bucket
        key = (batch_size, length, model.dtype, model.device, torch.is_inference_mode_enabled())
        cache = self.caches.get(key)
        if cache is None:
            cache = StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=length)
            self.caches[key] = cache
            while len(self.caches) > self.max_caches:
                _, old = self.caches.popitem(last=False)
                self.forget(id(old))
        else:
            self.caches.move_to_end(key)
            cache.reset()
        return cache


#: The layer types whose masks :func:`_window_mask` rebuilds (transformers' ``config.layer_types``).
WINDOW_MASK_TYPES = ("full_attention", "sliding_attention")


def _window_mask(width: int, length: torch.Tensor) -> torch.Tensor:
    """Boolean ``(1, 1, 1, width)``: the slots a one-token step's query sees in a sliding window of
    ``width`` slots filled from slot 0, ``length`` tokens before the step (0-d int64 tensor on the
    device): slots ``0 .. length`` until the window is full, then all (transformers rolls it)."""
    return (_slots(width, length.device) <= length.clamp(max=width - 1)).view(1, 1, 1, width)


@functools.lru_cache(maxsize=64)
def _slots(width: int, device: torch.device) -> torch.Tensor:
    return torch.arange(width, device=device)  # made once: a launch fewer each step


def _window_layout(template, length: torch.Tensor):
    """What :func:`_window_masks` rebuilds ``template`` (``create_masks_for_generate``'s output: a
    mask or a dict of masks by layer type) from: the same structure with each mask replaced by its
    width, after checking that :func:`_window_mask` gives that mask for ``length``; or a string
    saying why the masks cannot be built that way. Reads the device (once per cache)."""
    if isinstance(template, dict):
        out = {}
        for key, mask in template.items():
            if key not in WINDOW_MASK_TYPES:
                return f"masks of layer type {key!r}"
            out[key] = _window_layout(mask, length)
            if isinstance(out[key], str):
                return f"{key}: {out[key]}"
        return out
    if template is None:
        return None
    if not (isinstance(template, torch.Tensor) and template.dtype == torch.bool and template.dim() == 4
            and template.shape[1] == template.shape[2] == 1):
        return (f"a mask of dtype {getattr(template, 'dtype', type(template).__name__)} and shape "
                f"{tuple(getattr(template, 'shape', ()))}")
    if not torch.equal(_window_mask(template.shape[-1], length).expand_as(template), template):
        return "a mask other than the window's"
    return template.shape[-1]


def _window_masks(layout, length: torch.Tensor):
    """The masks of a :func:`_window_layout` for ``length`` (no host read)."""
    if isinstance(layout, dict):
        return {key: _window_masks(width, length) for key, width in layout.items()}
    return None if layout is None else _window_mask(layout, length)


def _forget(graphs_ref, cid: int) -> None:
    graphs = graphs_ref()
    if graphs is not None:
        graphs.forget(cid)


class _Session:
    """One generation's decode-step callable (see :meth:`DecodeGraphs.session`)."""

    def __init__(self, graphs: DecodeGraphs):
        self.graphs = graphs
        self.lengths: dict = {}
        #: cache id -> the :func:`_window_layout` :meth:`_device_inputs` fills, or why it cannot.
        self.device_masks: dict = {}
        #: cache id -> whether the masks passed with this generation's steps are an unpadded batch's.
        self.plain: dict = {}

    def __call__(self, input_ids=None, **kwargs):
        kwargs["input_ids"] = input_ids
        if input_ids is not None and input_ids.shape[-1] > 1:  # a prefill chunk: not a decode step
            return self.graphs.model(**kwargs)
        cache = kwargs.get("past_key_values")
        scan = _scan(cache)
        plain = False
        if scan.why is None and input_ids is not None:
            self._check_room(cache, input_ids.shape[1], scan.full)
            # With sliding layers, positions and masks come from the cache's length as a Python
            # integer: computed inside a graph, they would stay what they were at capture; a 2-D
            # mask changes shape every step. Then they are made here, as ``generate`` makes them
            # before a compiled step, when the caller did not: from the cache's length on the
            # device where :meth:`_device_inputs` can, else on the host. A cache of full layers
            # keeps its length on the device: with no mask, the graph computes both.
            mask = kwargs.get("attention_mask")
            grows = isinstance(mask, torch.Tensor) and mask.dim() == 2  # one more column a step
            made = None
            if mask is None and kwargs.get("position_ids") is None and scan.sliding:
                made = self._device_inputs(input_ids, cache, scan.full)
            if made is not None:
                kwargs["position_ids"], kwargs["attention_mask"] = made
                plain = True  # made for an unpadded batch
            else:
                if (grows or scan.sliding) and kwargs.get("position_ids") is None:
                    past = cache.get_seq_length()
                    kwargs["position_ids"] = (torch.arange(input_ids.shape[1], device=input_ids.device)
                                              + past).unsqueeze(0)
                if kwargs.get("position_ids") is not None and (mask is None or grows):
                    kwargs["attention_mask"] = self._masks(input_ids, mask, cache, kwargs["position_ids"])
                    # Made here from no mask (an unpadded batch's), or from a 2-D mask: plain if all ones.
                    plain = mask is None or self._plain(cache, lambda: bool(mask.all()))
                elif isinstance(mask, (torch.Tensor, dict)) and kwargs.get("position_ids") is not None:
                    plain = self._plain(cache, lambda: _same_masks(
                        mask, self._masks(input_ids, None, cache, kwargs["position_ids"])))
                elif mask is None:  # the step makes an unpadded batch's masks itself (cache_position's)
                    plain = True
        return self.graphs.step(kwargs, scan, plain)

    def _plain(self, cache, check) -> bool:
        """Whether the masks of this generation's steps over ``cache`` are an unpadded batch's (each
        query sees every filled slot of a full layer and the window of a sliding one: what
        :meth:`DecodeGraphs.forward`'s ``plain`` lets our attention read from the layers' lengths):
        ``check()`` at the first such step (a 2-D mask all ones; ``generate``'s 4-D masks equal to
        those transformers makes for an unpadded step at those positions: one device read a
        generation). The later steps of a generation extend the same rows (``generate`` appends a
        visible column a step), so the answer holds for them: a decode loop of one's own that later
        hides a key its first step's masks showed needs a new session
        (``model.get_compiled_call(None)``)."""
        if id(cache) not in self.plain:
            self.plain[id(cache)] = check()
        return self.plain[id(cache)]

    def _device_inputs(self, input_ids, cache, source):
        """``(position_ids, attention_mask)`` of an unpadded one-token step over a cache with
        sliding layers, made from a layer's length on the device (a few launches, no host work),
        or None where they cannot be.

        What ``sdpa_mask`` (sdpa's and our attention's masks) builds for such a step, for the
        full-attention layers and the sliding-window ones (whose windows hold the last ``W`` tokens
        from slot 0): the slots up to the new token's, all ``W`` once a window is full (transformers
        rolls it). The position is a full layer's length, or a sliding layer's while no window is
        full (transformers stops counting it then). Only the layer types ``full_attention`` and
        ``sliding_attention`` are made so (not Llama 4's chunked attention, whose mask a window's
        cannot be); the first step over each cache in a session checks them against
        ``create_masks_for_generate``'s at that length, and a model whose masks differ (its own
        mask function, another attention's masks) keeps the host masks, said once. ``source``: the
        cache's full layer (``_Scan.full``), or None."""
        model = self.graphs.model
        config = model.config.get_text_config(decoder=True)
        if model.config._attn_implementation not in ("sdpa", *ATTENTION_NAMES) or \
                getattr(config, "attention_chunk_size", None):
            return None
        if source is None:
            layers = [layer for layer in cache.layers if not _linear(layer)]
            if not layers or any(layer.cumulative_length_int >= layer.max_cache_len for layer in layers):
                return None
            source = layers[0]
        # Tokens before this step: the new token's position. A copy: an eager step advances the
        # cache's length in place during its forward.
        length = source.cumulative_length.clone()
        if id(cache) not in self.device_masks:  # the first step over this cache: check against transformers'
            theirs = self._masks(input_ids, None, cache, length.view(1, 1))
            self.device_masks[id(cache)] = _window_layout(theirs, length)
            if isinstance(self.device_masks[id(cache)], str):
                logger.info("cutile_kernels: decode graphs build this model's masks on the host (%s)",
                            self.device_masks[id(cache)])
        layout = self.device_masks[id(cache)]
        if isinstance(layout, str):
            return None
        return length.view(1, 1), _window_masks(layout, length)

    def _masks(self, input_ids, mask, cache, position_ids):
        """The masks ``prepare_inputs_for_generation`` builds before a compiled decode step."""
        from transformers.masking_utils import create_masks_for_generate

        model = self.graphs.model
        make = getattr(model, "create_masks_for_generate", create_masks_for_generate)
        b, s = input_ids.shape
        return make(config=model.config, inputs_embeds=torch.empty((b, s, 0), dtype=model.dtype, device=input_ids.device),
                    attention_mask=mask, past_key_values=cache, position_ids=position_ids)

    def _check_room(self, cache, new: int, layer) -> None:
        """Raise :class:`CacheFullError` where ``new`` tokens do not fit ``layer``, the cache's full layer
        (``_Scan.full``; None: nothing fills), counting on the host from one read a generation."""
        if layer is None:
            return
        if id(cache) not in self.lengths:  # one device read per generation
            self.lengths[id(cache)] = int(layer.cumulative_length)
        length = self.lengths[id(cache)] + new
        room = layer.max_cache_len
        if length > room:
            raise CacheFullError(f"cutile_kernels: the static KV cache is full ({room} tokens); pass a larger "
                                 f"max_cache_len (or max_new_tokens to generate) to decode further")
        self.lengths[id(cache)] = length


def _same_masks(a, b) -> bool:
    """Whether two masks as a model takes them (a boolean tensor, None, or a dict of those by layer
    type) hold the same values, a batch dimension of 1 broadcast against the other's."""
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(_same_masks(a[k], b[k]) for k in a))
    if a is None or b is None:
        return a is None and b is None
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or {a.dtype, b.dtype} != {torch.bool}:
        return False
    try:
        return bool(torch.equal(*torch.broadcast_tensors(a, b)))
    except RuntimeError:  # shapes that do not broadcast
        return False


class CudaGraph:
    """``torch.cuda.CUDAGraph`` behind the small interface :class:`DecodeGraphs` uses."""

    def __init__(self):
        self.graph = torch.cuda.CUDAGraph()

    @staticmethod
    def warm(fn):
        """Run ``fn`` eagerly on a side stream (how PyTorch asks for warm-up before a capture)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = fn()
        torch.cuda.current_stream().wait_stream(side)
        return out

    def capture(self, fn, owner: DecodeGraphs):
        if owner.pool is None:
            owner.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(self.graph, pool=owner.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


# -- switching it on and off ---------------------------------------------------------------------

def _check_prefill_fits(module, args, kwargs):
    """Forward pre-hook: a prompt longer than the room left in a static cache raises ``ValueError``
    before it is written (transformers would index past the cache, a device-side assert on CUDA)."""
    if torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return None  # no device read inside a trace or someone's graph capture
    ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    new = ids.shape[1] if ids is not None else embeds.shape[1] if embeds is not None else 0
    cache = kwargs.get("past_key_values")
    if new <= 1 or cache is None:
        return None
    scan = _scan(cache, filled=False)
    layer = scan.full
    if scan.why is not None or layer is None:
        return None
    used = int(layer.cumulative_length) if layer.is_initialized else 0
    if used + new > layer.max_cache_len:
        raise ValueError(f"cutile_kernels: {new} new tokens do not fit the static KV cache ({used} of "
                         f"{layer.max_cache_len} slots used); use a larger max_cache_len")
    return None


def enable_decode_graphs(model, warmup: int = 1, length_bucket: int = LENGTH_BUCKET, max_caches: int = MAX_CACHES,
                         graph_factory=None, cache_kernel: bool = True,
                         pdl: bool | None = None) -> DecodeGraphs | None:
    """Run ``model.generate()``'s decode steps as replayed CUDA graphs over a static KV cache.

    After this, ``model.generate(ids, ...)`` uses a ``StaticCache`` (``cache_implementation=
    "static"`` unless the call or the model's generation config names a cache or passes one) and,
    where transformers would compile the decode step, replays captured CUDA graphs instead (see the
    module docstring). Works on any
    transformers causal LM, kernelized or not; pair it with our kernels (``kernel_config()``) and
    ``attn_implementation="cutile"``. ``generate(..., disable_compile=True)`` runs eagerly;
    :func:`disable_decode_graphs` switches it off.

    Args:
        model: a transformers causal LM on a CUDA device.
        warmup, length_bucket, max_caches, graph_factory, cache_kernel, pdl: see :class:`DecodeGraphs`.

    Returns:
        The :class:`DecodeGraphs` now installed, or None (and a warning) when the model is not
        on CUDA and no ``graph_factory`` was given.
    """
    param = next(model.parameters(), None)
    if graph_factory is None and (param is None or param.device.type != "cuda"):
        # A warning: asked for by name, and nothing happens (generate() stays as it was).
        logger.warning("cutile_kernels: decode graphs need a CUDA model; this one is on %s: generate() is unchanged",
                       None if param is None else param.device.type)
        return None
    disable_decode_graphs(model)
    graphs = DecodeGraphs(model, warmup=warmup, length_bucket=length_bucket, max_caches=max_caches,
                          graph_factory=graph_factory, cache_kernel=cache_kernel, pdl=pdl)
    hook = model.register_forward_pre_hook(_check_prefill_fits, with_kwargs=True)
    model.get_compiled_call = lambda compile_config=None: graphs.session()
    model._prepare_static_cache = graphs.prepare_static_cache
    model.generate = functools.partial(_generate_static, model)
    setattr(model, ATTR, graphs)
    graphs._undo = hook
    return graphs


def _generate_static(model, *args, **kwargs):
    """``model.generate`` with ``cache_implementation="static"`` where nothing else was asked for
    and a static cache serves (greedy or sampling, one beam, no assistant: transformers refuses
    static caches for assisted decoding). The generation config is read at call time
    (``from_pretrained`` loads the checkpoint's after our kernel config ran)."""
    config = kwargs.get("generation_config") or model.generation_config

    def asked(name):
        return kwargs[name] if kwargs.get(name) is not None else getattr(config, name, None)
    plain = (asked("num_beams") or 1) == 1 and kwargs.get("assistant_model") is None and \
        asked("prompt_lookup_num_tokens") is None and kwargs.get("custom_generate") is None and \
        asked("use_cache") is not False
    # A checkpoint's "hybrid" (Gemma 2 and 3 ship it) is what transformers 5.22 itself reads as
    # nothing asked for (it unsets it and picks its default cache): ours is the static one.
    if (plain and kwargs.get("cache_implementation") is None and kwargs.get("past_key_values") is None
            and getattr(config, "cache_implementation", None) in (None, "hybrid")):
        kwargs["cache_implementation"] = "static"
    graphs = getattr(model, ATTR)
    graphs.returns_cache = bool(asked("return_dict_in_generate"))
    try:
        return type(model).generate(model, *args, **kwargs)
    finally:
        graphs.returns_cache = False


def disable_decode_graphs(model) -> bool:
    """Undo :func:`enable_decode_graphs` (graphs and the static caches it kept are freed; caches the
    caller still holds get their layers' own ``update`` back). Returns whether it was enabled."""
    graphs = model.__dict__.get(ATTR)
    if graphs is None:
        return False
    graphs._undo.remove()
    for name in ("get_compiled_call", "_prepare_static_cache", "generate", ATTR):
        model.__dict__.pop(name, None)
    for cache in list(graphs._changed):  # a cache the caller keeps writes as transformers does again
        _restore_updates(cache)
    graphs.entries.clear()
    graphs.caches.clear()
    return True
