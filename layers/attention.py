"""``attn_implementation="cutile"``: the cuTile attention kernel as a transformers attention function.

:func:`register_attention` (run when ``cutile_kernels`` is imported) registers
:func:`cutile_attention_forward` with ``AttentionInterface`` and transformers' own ``sdpa_mask``
with ``AttentionMaskInterface`` under the name ``"cutile"``, so that::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="cutile", ...)

builds exactly the masks ``"sdpa"`` would, and attends with the kernel. The default patch
``gemma2_attention`` (``models/gemma.py``) switches Gemma 2, which transformers can only run
eagerly, to it.

How transformers' arguments map onto the kernel (``ops.attention``), mirroring
``sdpa_attention_forward`` (integrations/sdpa_attention.py, v5.22.2):

* ``attention_mask`` None: the model is causal and ``sdpa_mask`` proved that a plain causal mask
  is exact (no padding; ``Sq == Skv``, ``Sq == 1``, or a prefill into an empty static cache). The
  kernel's causal mask is used; for ``Sq > 1`` and ``Skv > Sq`` (the empty static cache) the keys
  are cut to the first ``Sq`` as sdpa does, so that the causal diagonal starts at key 0.
  ``sliding_window`` is applied (a no-op whenever ``sdpa_mask`` skipped the mask).
* a boolean ``(B or 1, 1, Sq, Skv)`` mask (padding, sliding window, static-cache slots not yet
  filled, packed sequences): the mask alone decides, as in sdpa; the kernel skips KV tiles the
  mask hides entirely (so a causal mask still skips the upper triangle).
* ``cutile_kv_len`` (passed by our reproduced attention forwards, ``_direct.attend``, for a
  ``StaticLayer`` of a static cache: its ``cumulative_length`` after the update): the kernel reads
  only the filled slots, the count read on the device (so a replayed CUDA graph follows it), and
  the empty slots of the static cache cost nothing.
* anything else (an additive float mask, per-head masks, dropout while training, attention sinks,
  ``position_bias``): the model's own ``eager_attention_forward`` with an additive mask, and one
  warning per reason (an error under ``CUTILE_KERNELS_STRICT=1``).
"""

from __future__ import annotations

import functools
import logging
import sys

import torch

from .. import dispatch
from ..ops.attention import DECODE_MAX_SQ, attention, visible_mask
from ._pins import Pin, holds, register

logger = logging.getLogger("cutile_kernels")

#: ``cutile_kv_len`` relies on a StaticLayer counting its filled slots in ``cumulative_length``
#: (updated before ``update`` returns) and writing them from slot 0 on.
PIN = Pin("cache_utils", "StaticLayer.update", "3f3c0040cf17c086",
          "attention: a StaticLayer's cumulative_length after update is the filled slots the kernel reads (kv_len); "
          "decode graphs: _kernel_static_update reproduces its writes with kv_append")
register(PIN)


def static_kv_length(module: torch.nn.Module, past_key_values) -> dict:
    """``{"cutile_kv_len": length}`` for the attention call of ``module`` (after its cache update)
    when the model attends with ``"cutile"`` and the module's cache layer is a ``StaticLayer``
    (the pinned one): its ``cumulative_length``, a device tensor. Else ``{}``."""
    if _STATIC_LAYER is None or getattr(module.config, "_attn_implementation", None) != NAME:
        return {}
    layers = getattr(past_key_values, "layers", None)
    idx = getattr(module, "layer_idx", None)
    if layers is None or idx is None or idx >= len(layers) or type(layers[idx]) is not _STATIC_LAYER:
        return {}
    return {"cutile_kv_len": layers[idx].cumulative_length}


#: transformers' StaticLayer while :data:`PIN` holds (set by :func:`register_attention`, so that no
#: check runs inside a forward), else None.
_STATIC_LAYER = None

#: The name to pass as ``attn_implementation``.
NAME = "cutile"

_UNSUPPORTED_KWARGS = {"s_aux": "attention sinks", "sinks": "attention sinks", "position_bias": "position_bias"}


def _eager_fallback(module, query, key, value, attention_mask, reason: str, causal: bool, **kwargs):
    """The model's own eager attention (transformers' Llama one if its module has none), with the
    mask made additive and, when there is none, the causal / window mask sdpa would apply."""
    dispatch.fallback("attention", reason)
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


@functools.lru_cache(maxsize=None)
def _no_weights_warning() -> None:
    # Once a process, as sdpa's: the model's output then holds no attention weights.
    logger.warning("cutile_kernels: attention %r returns no attention weights (output_attentions=True); attend "
                   "with \"eager\" for them (Gemma 2: kernel_config(exclude=[\"gemma2_attention\"]))", NAME)


def _bool_mask_fits(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> bool:
    return (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[0] in (1, query.shape[0])
            and mask.shape[1] == 1 and mask.shape[2] == query.shape[2] and mask.shape[3] == key.shape[2])


def cutile_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                             sliding_window: int | None = None, softcap: float | None = None,
                             is_causal: bool | None = None, cutile_kv_len: torch.Tensor | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """Attention for transformers' ``AttentionInterface`` (the signature of ``sdpa_attention_forward``).

    Args:
        module: the attention module (its ``is_causal`` and ``training`` are read).
        query: ``(B, Hq, Sq, D)``; key, value: ``(B, Hkv, Skv, D)``, the cache already updated.
        attention_mask: None or what ``sdpa_mask`` built (see the module docstring).
        scaling: logit scale (default ``1 / sqrt(D)``).
        dropout: attention dropout; > 0 while training takes the eager fallback.
        sliding_window: the layer's window (Mistral, Qwen2/3 sliding layers), or None.
        softcap: logit soft-cap (Gemma 2 style), or None.
        is_causal: overrides ``module.is_causal``.
        cutile_kv_len: a static cache layer's filled length (one int64 on the device), from
            :func:`static_kv_length`: the keys past it are not read.

    Returns:
        ``(attn_output, None)``, ``attn_output`` the contiguous ``(B, Sq, Hq, D)`` tensor.
    """
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    reason = None
    if dropout and module.training:
        reason = "attention dropout while training"
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            reason = what
    if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor)
                                           and _bool_mask_fits(attention_mask, query, key)):
        reason = (f"attention_mask of dtype {getattr(attention_mask, 'dtype', type(attention_mask).__name__)} "
                  f"and shape {tuple(getattr(attention_mask, 'shape', ()))} (the kernel takes sdpa's boolean "
                  "(B, 1, Sq, Skv) masks)")
    if query.shape[3] != value.shape[3] or query.shape[3] != key.shape[3]:
        reason = "query, key and value head dims differ"
    if reason is not None:
        return _eager_fallback(module, query, key, value, attention_mask, reason, causal, scaling=scaling,
                               dropout=dropout, sliding_window=sliding_window, softcap=softcap, **kwargs)
    window = sliding_window
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


def register_attention() -> None:
    """Register ``"cutile"`` with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``
    (idempotent; runs when ``cutile_kernels`` is imported)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, cutile_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    global _STATIC_LAYER
    from transformers.cache_utils import StaticLayer

    _STATIC_LAYER = StaticLayer if holds(PIN.name) else None
    if _STATIC_LAYER is None:
        logger.info(
            "cutile_kernels: transformers' StaticLayer.update is not the pinned one; our attention reads every "
            "static cache slot (no filled length)")


#: transformers hub layer name -> layer class in this module: none, attention is an interface.
MAPPING: dict[str, str] = {}
