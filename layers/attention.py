"""``attn_implementation="cutile"``: the cuTile attention kernel as a transformers attention function.

:func:`register_attention` (run when ``cutile_kernels`` is imported) registers two attention
functions with ``AttentionInterface``, each with transformers' own ``sdpa_mask`` in
``AttentionMaskInterface``, so that::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="cutile", ...)

builds exactly the masks ``"sdpa"`` would:

* ``"cutile"`` (:func:`cutile_attention_forward`, what the default patch ``cutile_attention``
  (``models/__init__.py``) and ``gemma2_attention`` (``models/gemma.py``) switch models to): our
  kernel where it is faster than transformers' sdpa on the H200, sdpa where it is not, as a
  declared route (:func:`route`). Ours: decode (``Sq <= DECODE_MAX_SQ``) over a static cache
  (``cutile_kv_len``: only the filled slots are read; or sdpa's boolean mask, whose hidden tiles
  are skipped, where sdpa expands the mask and reads every slot: 3-36x, H200 2026-12-02b call 4),
  decode of a padded batch (a boolean mask), prefill with a boolean mask at head dims 64 and 256
  (patch ``masked_prefill_attention``: the mask's tiles classified first; from a tie at 512 tokens to
  3x sdpa's masked kernel, H100 2026-12-05), and every call with a logit softcap (sdpa has none).
  sdpa's (cuDNN / flash, 2-5x our prefill kernel and 1.2-2.5x our decode kernel over an unmasked
  DynamicCache): unmasked prefill (``Sq > DECODE_MAX_SQ``), masked prefill at head dim 128, unmasked
  decode without a filled length, every
  call off the GPU or in a dtype or head dim the kernel has no variant for, and what the kernel does
  not take (dropout, additive masks, ``position_bias``), sdpa's arguments passed as they came.
* ``"cutile_kernel"`` (:func:`cutile_kernel_attention_forward`): the kernel on every call it can
  take (what the kernel's tests and sweeps run, and a kernel author's switch to time the prefill
  kernel inside a model); what it cannot take goes to the model's eager attention.

How transformers' arguments map onto the kernel (``ops.attention``), mirroring
``sdpa_attention_forward`` (integrations/sdpa_attention.py, v5.22.2):

* ``attention_mask`` None: the model is causal and ``sdpa_mask`` proved that a plain causal mask
  is exact (no padding; ``Sq == Skv``, ``Sq == 1``, or a prefill into an empty static cache). The
  kernel's causal mask is used; for ``Sq > 1`` and ``Skv > Sq`` (the empty static cache) the keys
  are cut to the first ``Sq`` as sdpa does, so that the causal diagonal starts at key 0.
  ``sliding_window`` is applied (a no-op whenever ``sdpa_mask`` skipped the mask).
* a boolean ``(B or 1, 1, Sq, Skv)`` mask (padding, sliding window, static-cache slots not yet
  filled, packed sequences): the mask alone decides, as in sdpa; the kernel skips KV tiles the
  mask hides entirely (so a causal mask still skips the upper triangle), and at prefill reads no
  mask on tiles it shows entirely (``ops.attention.launches``: its tiles classified first).
* ``cutile_kv_len`` (passed by our reproduced attention forwards, ``_direct.attend``, for a
  ``StaticLayer`` of a static cache: its ``cumulative_length`` after the update): the kernel reads
  only the filled slots, the count read on the device (so a replayed CUDA graph follows it), and
  the empty slots of the static cache cost nothing.
* anything else (an additive float mask, per-head masks, dropout while training, attention sinks,
  ``position_bias``): under ``"cutile"`` sdpa where it takes them (not attention sinks), else the
  model's own ``eager_attention_forward`` with an additive mask; one warning per reason (an error
  under ``CUTILE_KERNELS_STRICT=1``).
"""

from __future__ import annotations

import functools
import logging
import sys

import torch

from .. import dispatch
from ..ops.attention import (DECODE_MAX_SQ, HEAD_DIMS, KERNEL_DTYPES, attention, mask_mismatch, padded_head_dim,
                             prepare, visible_mask)
from ._pins import Pin, holds, register

logger = logging.getLogger("cutile_kernels")

#: ``cutile_kv_len`` relies on a StaticLayer counting its filled slots in ``cumulative_length``
#: (updated before ``update`` returns) and writing them from slot 0 on.
PIN = Pin("cache_utils", "StaticLayer.update", "3f3c0040cf17c086",
          "attention: a StaticLayer's cumulative_length after update is the filled slots the kernel reads (kv_len); "
          "decode graphs: _kernel_static_update reproduces its writes with kv_append")
#: ``cutile_kv_len`` for a sliding-window layer relies on its update writing slots 0, 1, ... in
#: order and advancing ``cumulative_length`` with ``cumulative_length_int`` while the window has
#: room (the branch every update takes until the Python count passes the window).
SLIDING_PIN = Pin("cache_utils", "StaticSlidingWindowLayer.update", "ac666cc2c7f97556",
                  "attention: while cumulative_length_int <= the window its cumulative_length is the filled slots "
                  "(kv_len); decode graphs: its full-window one-token step, reproduced without the "
                  "host-to-device copy a CUDA graph cannot capture (_capturable_sliding_update)")
register(PIN, SLIDING_PIN)


def cache_layer(module: torch.nn.Module, past_key_values):
    """The layer of ``past_key_values`` (a transformers ``Cache``) that attention module ``module``
    writes (its ``layer_idx``), or None (no cache, no such layer, a module without an index)."""
    layers = getattr(past_key_values, "layers", None)
    idx = getattr(module, "layer_idx", None)
    if layers is None or idx is None or idx >= len(layers):
        return None
    return layers[idx]


def full_static_layer(module: torch.nn.Module, past_key_values):
    """The layer of ``past_key_values`` that attention module ``module`` writes when it is exactly
    transformers' ``StaticLayer`` while its ``update`` is the pinned one (:data:`PIN`; known once our
    attention registered), else None."""
    layer = cache_layer(module, past_key_values)
    return layer if _STATIC_LAYER is not None and type(layer) is _STATIC_LAYER else None


#: Instance attribute of a ``StaticLayer`` during a decode-graph step that advances the lengths of
#: the cache's full-attention layers once, after every layer has run (``decode_graphs``,
#: ``DecodeGraphs.forward``): the layer's filled length once this step's tokens are written (a 0-d
#: int64 device tensor), which its ``cumulative_length`` reaches only at the step's end.
STEP_FILLED = "_cutile_step_filled"


def static_kv_length(layer, implementation: str | None) -> dict:
    """``{"cutile_kv_len": length}`` for an attention call (after its cache update) when the model
    attends with ``"cutile"`` (``implementation``: its config's ``_attn_implementation``, read once by
    the caller) and the module's cache layer ``layer`` (:func:`cache_layer`) is a ``StaticLayer``
    (the pinned one): its ``cumulative_length``, a device tensor (in a decode-graph step that
    advances it at the end, :data:`STEP_FILLED`); or a ``StaticSlidingWindowLayer`` (pinned,
    :data:`SLIDING_PIN`) whose window has not passed full with this update
    (``cumulative_length_int`` at most its slots: its ``cumulative_length`` is then the filled
    slots; past that it rolls, and returns more keys than it holds while a chunk crosses the end).
    Else ``{}``. The window's own mask still applies where one is passed; the length only spares
    the kernel the slots not yet written."""
    if _STATIC_LAYER is None or implementation not in NAMES:
        return {}
    kind = type(layer)
    if kind is _SLIDING_LAYER and layer.cumulative_length_int <= layer.max_cache_len:
        return {"cutile_kv_len": layer.cumulative_length}
    if kind is not _STATIC_LAYER:
        return {}
    filled = layer.__dict__.get(STEP_FILLED)
    return {"cutile_kv_len": layer.cumulative_length if filled is None else filled}


#: Instance attribute of a cache layer during a decode-graph step whose masks are an unpadded
#: batch's (``decode_graphs``, ``DecodeGraphs.forward``): where the layer's filled length goes to our
#: attention (:func:`static_kv_length`), the mask hides nothing the length, causality and the window
#: do not: where the kernel takes the call it reads no mask tile (:func:`step_plain`).
STEP_PLAIN_MASKS = "_cutile_step_plain_masks"


def step_plain(layer, length: dict) -> dict:
    """``{"cutile_plain_mask": True}`` for an attention call where a filled length goes along
    (``length``, :func:`static_kv_length`'s result) and the step's masks are plain
    (:data:`STEP_PLAIN_MASKS` on the module's cache layer ``layer``), else ``{}``. The mask itself is
    passed as given: only a call the kernel takes drops it (``_attend``); sdpa and the eager fallback,
    which take no length, keep it."""
    if not length:
        return {}
    return {"cutile_plain_mask": True} if layer.__dict__.get(STEP_PLAIN_MASKS) else {}


#: transformers' StaticLayer while :data:`PIN` holds (set by :func:`register_attention`, so that no
#: check runs inside a forward), else None.
_STATIC_LAYER = None
#: transformers' StaticSlidingWindowLayer while :data:`SLIDING_PIN` holds too, else None.
_SLIDING_LAYER = None

#: The name to pass as ``attn_implementation``: our kernel where it is faster, sdpa elsewhere.
NAME = "cutile"
#: The name of the kernel on every call it can take.
KERNEL_NAME = "cutile_kernel"
#: Both names (a model attending with either runs our attention forwards' filled-length path).
NAMES = (NAME, KERNEL_NAME)

#: transformers' ``sdpa_attention_forward`` (bound by :func:`register_attention`).
_SDPA = None
#: Devices on which :func:`route` may choose the kernel (the CPU tests add "cpu").
_KERNEL_DEVICES = ("cuda",)

_UNSUPPORTED_KWARGS = {"s_aux": "attention sinks", "sinks": "attention sinks", "position_bias": "position_bias"}
#: Arguments transformers' sdpa attention would ignore (so it cannot take the call either).
_SINK_KWARGS = ("s_aux", "sinks")


def _eager_fallback(module, query, key, value, attention_mask, reason: str, causal: bool, **kwargs):
    """The model's own eager attention (transformers' Llama one if its module has none), with the
    mask made additive and, when there is none, the causal / window mask sdpa would apply."""
    _announce(reason)
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        if kwargs.get("softcap"):  # Llama's eager attention has no softcap: it would be wrong
            raise NotImplementedError(f"cutile_kernels: attention cannot run here ({reason}) and "
                                      f"{type(module).__name__}'s module has no eager attention with softcap")
        from transformers.models.llama.modeling_llama import eager_attention_forward as eager
    mask = attention_mask
    if mask is None:
        sq, skv = query.shape[2], key.shape[2]
        if causal and sq > 1 and skv > sq:
            key, value = key[:, :, :sq], value[:, :, :sq]
            skv = sq
        mask = visible_mask(1, sq, skv, None, causal and sq > 1, kwargs.get("sliding_window"), device=query.device)
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, mask, **kwargs)


def _announce(reason: str) -> None:
    # Eager only: dynamo cannot trace the logging (fullgraph would fail, else the graph would break).
    if not torch.compiler.is_compiling():
        dispatch.fallback("attention", reason)


@functools.lru_cache(maxsize=None)
def _no_weights_warning() -> None:
    # Once a process, as sdpa's: the model's output then holds no attention weights.
    logger.warning("cutile_kernels: attention %r returns no attention weights (output_attentions=True); attend "
                   "with \"eager\" for them (Gemma 2: kernel_config(exclude=[\"gemma2_attention\"]))", NAME)


def _bool_mask_fits(mask, query: torch.Tensor, key: torch.Tensor) -> bool:
    return mask_mismatch(mask, query.shape[0], query.shape[2], key.shape[2]) is None


def _kernel_cannot(module, query, key, value, attention_mask, dropout, kwargs) -> str | None:
    """Why the kernel cannot take this call, or None."""
    reason = None
    if dropout and module.training:
        reason = "attention dropout while training"
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            reason = what
    if attention_mask is not None and not _bool_mask_fits(attention_mask, query, key):
        reason = (f"attention_mask of dtype {getattr(attention_mask, 'dtype', type(attention_mask).__name__)} "
                  f"and shape {tuple(getattr(attention_mask, 'shape', ()))} (the kernel takes sdpa's boolean "
                  "(B, 1, Sq, Skv) masks)")
    if query.shape[3] != value.shape[3] or query.shape[3] != key.shape[3]:
        reason = "query, key and value head dims differ"
    return reason


#: Attribute (in an attention module's ``__dict__``) set by patch ``masked_prefill_attention``:
#: :func:`route` takes that module's masked prefills to the kernel.
MASKED_PREFILL = "_cutile_masked_prefill"


def route(query: torch.Tensor, attention_mask: torch.Tensor | None, softcap: float | None,
          cutile_kv_len: torch.Tensor | None, masked_prefill: bool = False) -> bool:
    """Whether ``"cutile"`` gives a call the kernel takes to the kernel (True) or to transformers'
    sdpa (False), by the H200 measurements in the module docstring: the kernel for a logit softcap
    (sdpa has none), for decode (``query`` ``(B, H, Sq, D)`` with ``Sq <= DECODE_MAX_SQ``) with a
    boolean mask or a static cache's filled length, and (``masked_prefill``: the module's patch
    ``masked_prefill_attention``) for a prefill with a boolean mask (padding, a sliding window) at
    the padded head dims of ``MASKED_PREFILL_HEAD_DIMS``, whose tiles the kernel classifies first
    (under torch.compile before torch 2.14 transformers keeps even a plain causal mask, so a
    compiled prefill takes this route too); sdpa for unmasked prefill (cuDNN's flash kernel, 2-3x
    ours) and unmasked decode over a DynamicCache; sdpa for every call off the GPU (where the op
    would compute its reference: a CPU model keeps stock's exact numbers) or in a dtype or head dim
    the kernel has no variant for (float32, head_dim > 256), but a softcap's. Device, dtype, shapes
    and None-ness only: under torch.compile it is decided at trace time."""
    if softcap:
        return True
    if (query.device.type not in _KERNEL_DEVICES or query.dtype not in KERNEL_DTYPES
            or query.shape[3] > HEAD_DIMS[-1]):
        return False
    if query.shape[2] > DECODE_MAX_SQ:
        return (masked_prefill and attention_mask is not None
                and padded_head_dim(query.shape[3]) in MASKED_PREFILL_HEAD_DIMS)
    return attention_mask is not None or cutile_kv_len is not None


#: Padded head dims (``ops.attention.padded_head_dim``) whose masked prefill (a boolean mask, its
#: tiles classified first) runs on the kernel under ``"cutile"`` and patch
#: ``masked_prefill_attention``: where it beat sdpa's masked kernel (H100, 2026-12-05,
#: ``dev/microbench/attention_bench.py --prefill``, us a call in CUDA graphs, ours / sdpa's). Head dim
#: 256 (Gemma-3-1B's layout): 1 x 2048 with a window of 512 44.1 / 132.3, a causal mask 99.8 / 131.9,
#: 1 x 512 33.5 / 41.0, 4 x 1024 left-padded 70.1 / 90.2; head dim 64 (Llama-3.2-1B's): 124.9 / 174.7,
#: 159.8 / 176.5, a tie at 512 (28.1 / 27.8), 158.4 / 204.3. Head dim 128 (Qwen3-0.6B's) lost every
#: case (e.g. a causal mask at 2048 313.8 / 151.6): sdpa keeps it.
MASKED_PREFILL_HEAD_DIMS = frozenset({64, 256})


def takes_plain_decode(forward, module: torch.nn.Module, query: torch.Tensor, kwargs: dict) -> bool:
    """Whether ``forward``, the attention function ``module``'s forward would call, is ours and gives
    a plain decode step (one position per row, the layer's filled length passed, the mask dropped:
    :func:`step_plain`) of ``query`` ``(B, Hq, 1, D)`` with these keyword arguments to our kernel,
    as :func:`_attend` decides it: then a caller may attend that step with the kernel itself
    (``_direct.rope_attend``: RoPE, the cache write and the attention in one launch). The module's
    scale and window go along; no softcap, dropout, attention sinks, ``position_bias`` or
    ``output_attentions``."""
    if forward is cutile_kernel_attention_forward:
        routed = False
    elif forward is cutile_attention_forward:
        routed = True
    else:
        return False
    if query.shape[2] != 1 or (module.training and getattr(module, "attention_dropout", 0.0)):
        return False
    if kwargs.get("output_attentions") or kwargs.get("softcap") or any(kwargs.get(k) is not None
                                                                       for k in _UNSUPPORTED_KWARGS):
        return False
    return not routed or route(query, None, None, query)  # query stands for the length (None-ness only)


def takes_masked_decode(forward, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                        attention_mask, kwargs: dict) -> bool:
    """:func:`takes_plain_decode` for a decode step whose mask goes along (a compiled step's, which
    cannot tell a padded batch from a plain one): ``attention_mask`` None (the kernel's causal
    bound over the filled length), or sdpa's boolean ``(B or 1, 1, 1, Skv)`` mask over ``key``'s
    ``Skv`` slots, which our kernel reads (:func:`_attend` gives such a call to the kernel)."""
    if attention_mask is not None and not _bool_mask_fits(attention_mask, query, key):
        return False
    return takes_plain_decode(forward, module, query, kwargs)


def _attend(module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap, is_causal,
            cutile_kv_len, routed: bool, kwargs: dict, plain: bool = False) -> tuple[torch.Tensor, None]:
    reason = _kernel_cannot(module, query, key, value, attention_mask, dropout, kwargs)
    sdpa_takes = not softcap and not any(kwargs.get(k) is not None for k in _SINK_KWARGS)
    if routed and sdpa_takes and (reason is not None or not route(query, attention_mask, softcap, cutile_kv_len,
                                                                  getattr(module, MASKED_PREFILL, False))):
        if reason is not None:
            _announce(f"{reason}; transformers' sdpa attends")
        return _SDPA(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     is_causal=is_causal, sliding_window=sliding_window, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if reason is not None:
        return _eager_fallback(module, query, key, value, attention_mask, reason, causal, scaling=scaling,
                               dropout=dropout, sliding_window=sliding_window, softcap=softcap, **kwargs)
    window = sliding_window
    if plain and cutile_kv_len is not None and query.shape[2] <= DECODE_MAX_SQ:
        attention_mask = None  # the kernel's length, causal bound and window show the same keys (STEP_PLAIN_MASKS)
    if attention_mask is None:
        sq, skv = query.shape[2], key.shape[2]
        if causal and sq > 1 and skv > sq:  # sdpa's upper-left is_causal on an empty static cache
            key, value = key[:, :, :sq], value[:, :, :sq]
            cutile_kv_len = None
    else:
        causal, window = False, None  # the mask holds the causal and window patterns
        if query.shape[2] > DECODE_MAX_SQ:
            cutile_kv_len = None  # sdpa_mask already hides a static cache's unfilled slots from a prefill
    if kwargs.get("output_attentions"):
        _no_weights_warning()
    out = attention(query, key, value, attention_mask, scale=scaling, causal=causal, window=window, softcap=softcap,
                    kv_len=cutile_kv_len)
    return out.transpose(1, 2), None


def cutile_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                             sliding_window: int | None = None, softcap: float | None = None,
                             is_causal: bool | None = None, cutile_kv_len: torch.Tensor | None = None,
                             cutile_plain_mask: bool = False, **kwargs) -> tuple[torch.Tensor, None]:
    """``"cutile"``: attention for transformers' ``AttentionInterface`` (the signature of
    ``sdpa_attention_forward``), our kernel where :func:`route` says it is faster, transformers'
    ``sdpa_attention_forward`` (v5.22.2) elsewhere.

    Args:
        module: the attention module (its ``is_causal``, ``training`` and, for sdpa,
            ``num_key_value_groups`` are read).
        query: ``(B, Hq, Sq, D)``; key, value: ``(B, Hkv, Skv, D)``, the cache already updated;
            bfloat16, float16 or float32.
        attention_mask: None or what ``sdpa_mask`` built (see the module docstring).
        scaling: logit scale (default ``1 / sqrt(D)``).
        dropout: attention dropout; > 0 while training goes to sdpa.
        sliding_window: the layer's window (Mistral, Qwen2/3 sliding layers), or None.
        softcap: logit soft-cap (Gemma 2 style), or None: always the kernel (sdpa has none).
        is_causal: overrides ``module.is_causal``.
        cutile_kv_len: a static cache layer's filled length (one int64 on the device), from
            :func:`static_kv_length`: the keys past it are not read.
        cutile_plain_mask: the mask is an unpadded batch's (:func:`step_plain`): where the kernel
            takes a decode call with ``cutile_kv_len``, it attends by the length, causality and the
            window without reading the mask; sdpa and the eager fallback get the mask as given.

    Returns:
        ``(attn_output, None)``, ``attn_output`` the contiguous ``(B, Sq, Hq, D)`` tensor.

    Raises:
        NotImplementedError: a softcap with inputs the kernel cannot take, in a module without an
            eager attention of its own. ``FallbackError`` under ``CUTILE_KERNELS_STRICT=1`` for
            inputs the kernel cannot take (not for :func:`route`'s choice of sdpa).
    """
    return _attend(module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap, is_causal,
                   cutile_kv_len, True, kwargs, cutile_plain_mask)


def cutile_kernel_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                    value: torch.Tensor, attention_mask: torch.Tensor | None,
                                    scaling: float | None = None, dropout: float = 0.0,
                                    sliding_window: int | None = None, softcap: float | None = None,
                                    is_causal: bool | None = None, cutile_kv_len: torch.Tensor | None = None,
                                    cutile_plain_mask: bool = False, **kwargs) -> tuple[torch.Tensor, None]:
    """``"cutile_kernel"``: :func:`cutile_attention_forward` with the kernel on every call it can take
    (prefill and unmasked decode too); what it cannot take goes to the model's own eager attention.
    Arguments, returns and errors as there."""
    return _attend(module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap, is_causal,
                   cutile_kv_len, False, kwargs, cutile_plain_mask)


def _gpus(model: torch.nn.Module) -> set:
    return {p.device for p in model.parameters() if p.device.type == "cuda"}


def prepare_devices(model: torch.nn.Module) -> None:
    """At patch time, for a model switched to our attention: this copy's attention forwards
    registered (:func:`register_attention`), then ``ops.attention.prepare`` on every GPU holding a
    parameter of ``model``, so that the forwards transformers calls launch with stand-in arrays
    made outside any forward (a compiled decode step whose first kernel call runs in torch.compile's
    CUDA-graph warm-up then keeps no array of ours in the graphs' pool) and allocate none per call.

    Registering here matters when a process holds two copies of this package: the source package
    and the build variant ``kernels`` loads at kernelize (``_cutile_kernels_cuda_<hash>``), each
    with its own arrays. With the patch's copy's arrays prepared and the other copy's forwards
    registered (the build's import registered its own then), each attention call made three arrays
    of its own: 48 fill kernels a compiled Llama-3.2-1B decode step (H200, 2026-12-04)."""
    register_attention()
    for device in _gpus(model):
        prepare(device)


def kernel_missing_on(model: torch.nn.Module) -> str | None:
    """Why the kernel cannot run on a GPU holding ``model`` (no built variant for its compute
    capability and no JIT toolchain), or None (also for a model off the GPU: ``route`` keeps it on
    sdpa there)."""
    for device in _gpus(model):
        if not dispatch.runs_on(device):
            return f"no build of ours runs on {device} (compute capability " \
                   f"{torch.cuda.get_device_capability(device)}) and cuda.tile cannot JIT here"
    return None


def _another_copys(forward) -> bool:
    # Our forward as another copy of this package defines it (same name, other module).
    return (getattr(forward, "__qualname__", None) == cutile_attention_forward.__qualname__
            and getattr(forward, "__module__", "").endswith(".layers.attention")
            and forward is not cutile_attention_forward)


def register_attention(replace: bool = True) -> None:
    """Register ``"cutile"`` and ``"cutile_kernel"`` with transformers' ``AttentionInterface`` and
    ``AttentionMaskInterface`` (idempotent). Runs when ``cutile_kernels`` is imported with
    ``replace=False``: a second copy of the package imported later (the build variant ``kernels``
    loads at kernelize, ``_cutile_kernels_cuda_<hash>``) leaves the first copy's forwards
    registered; the attention patches register their own copy's (:func:`prepare_devices`)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    global _SDPA, _STATIC_LAYER, _SLIDING_LAYER
    _SDPA = sdpa_attention_forward
    if replace or not _another_copys(AttentionInterface._global_mapping.get(NAME)):
        for name, forward in ((NAME, cutile_attention_forward), (KERNEL_NAME, cutile_kernel_attention_forward)):
            AttentionInterface.register(name, forward)
            AttentionMaskInterface.register(name, sdpa_mask)
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    _STATIC_LAYER = StaticLayer if holds(PIN.name) else None
    _SLIDING_LAYER = StaticSlidingWindowLayer if _STATIC_LAYER is not None and holds(SLIDING_PIN.name) else None
    if _STATIC_LAYER is None:
        logger.info(
            "cutile_kernels: transformers' StaticLayer.update is not the pinned one; our attention reads every "
            "static cache slot (no filled length)")


#: transformers hub layer name -> layer class in this module: none, attention is an interface.
MAPPING: dict[str, str] = {}
