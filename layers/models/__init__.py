"""One module per model family: what we claim for it, the transformers code it reproduces, its patches.

A family module (``llama.py``, ``qwen3.py``, ...) declares a :class:`Family` as ``FAMILY`` (the
``model_type`` values it covers, its :class:`~.._pins.Pin` rows, the benchmark presets of its real
checkpoints) and, when it has forwards of its own to reproduce, their patch rows as ``PATCH_ROWS``.
Modules here are found by name, as the kernel families are: adding a family is adding its module
(and its tiny-config row in ``tests/families.py``). ``layers/_registry.py`` registers the pins and
patch rows of every family at import.

Features shared by several families (the RMSNorm and RoPE hub layers, the fused MLP and q/k/v, the
decoder's residual-add + norm handoff) stay in their feature modules under ``layers/``; each checks
per class, at patch time, that the class computes the formula it reproduces (a pin of some family).
The one patch that needs the list of families lives here: ``cutile_attention``, which switches a
model of a claimed family from transformers' sdpa to our attention (``layers/attention.py``).
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import types
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from .._patching import Patch
from .._pins import Pin
from ..attention import NAME as CUTILE_ATTENTION
from ..attention import NAMES as CUTILE_ATTENTIONS
from ..attention import MASKED_PREFILL, MASKED_PREFILL_HEAD_DIMS, kernel_missing_on, prepare_devices

logger = logging.getLogger("cutile_kernels")


@dataclass(frozen=True)
class Family:
    """A model family we claim.

    Attributes:
        name: the family (its module's name).
        model_types: transformers ``model_type`` values of the family (each has a tiny config in the
            tests and a row in the README's coverage table).
        pins: the transformers functions the family's code paths reproduce, with their digests
            (none for a family whose modules are another family's code: those pins gate it).
        presets: benchmark presets (``tools/presets.py``) from the configs of real checkpoints.
        covered: one line: what runs in our kernels for this family.
        not_covered: one line: what still runs stock code.
        default: whether the package claims it by default (its own kernels run under
            ``kernel_config()`` as is); False while they are opt-in patches
            (``kernel_config(include=[...])``) the GPU bench has not accepted yet. What a family
            shares with another's code (OLMo 2's MLP is Llama's) runs by default either way.
    """

    name: str
    model_types: tuple[str, ...]
    pins: tuple[Pin, ...] = ()
    presets: tuple[str, ...] = ()
    covered: str = ""
    not_covered: str = ""
    default: bool = True


def discover() -> tuple[str, ...]:
    """The family modules of this package, by name (no list to keep)."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])
                        if not m.name.startswith("_")))


def modules() -> list:
    """The family modules, imported, in name order."""
    return [importlib.import_module(f"{__name__}.{name}") for name in discover()]


# The three helpers here are defined before the family modules are imported: Gemma's uses them.
def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules of ``model``: transformers names their classes ``...Attention``."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention")]


def switchable_verdict(model: nn.Module, impl: str) -> str | None:
    """What both attention-switching patches (``cutile_attention``, Gemma's ``gemma2_attention``)
    ask first: why ``model`` is not a transformers decoder-only model without sub-models (a
    multimodal wrapper's sub-configs would not all switch) attending with ``impl``, or None."""
    cls, cfg = type(model), getattr(model, "config", None)
    if not hasattr(cls, "set_attn_implementation") or cfg is None:
        return "it is not a transformers PreTrainedModel"
    if getattr(cfg, "is_encoder_decoder", False) or getattr(cfg, "sub_configs", None):
        return "it is an encoder-decoder or holds sub-models"
    current = getattr(cfg, "_attn_implementation", None)
    if current != impl:
        return f"it attends with {current!r}, not {impl}"
    return None


def switch_back(model: nn.Module, marker: str) -> int:
    """Undo an attention switch recorded under ``model.__dict__[marker]`` (the implementation the
    model had): that implementation again, unless the model was switched away from ``"cutile"``
    since. Returns the attention modules switched back."""
    before = model.__dict__.pop(marker, None)
    if before is None or model.config._attn_implementation != CUTILE_ATTENTION:
        return 0
    model.set_attn_implementation(before)
    return len(attention_modules(model))


#: family name -> Family, of every family module.
FAMILIES: dict[str, Family] = {m.FAMILY.name: m.FAMILY for m in modules()}


def claimed_model_types(opt_in: bool = False) -> tuple[str, ...]:
    """Every ``model_type`` of the families the default ``kernel_config()`` accelerates (with
    ``opt_in``: also those whose kernels are opt-in patches), in family order."""
    return tuple(t for f in FAMILIES.values() if f.default or opt_in for t in f.model_types)


def family_of(model_type: str) -> Family | None:
    """The family that claims ``model_type``, or None."""
    return next((f for f in FAMILIES.values() if model_type in f.model_types), None)


# ---------------------------------------------------------------------------------------------
# Patch cutile_attention (default): a claimed family attends with "cutile" instead of sdpa
# ---------------------------------------------------------------------------------------------
#
# Estimate, written before the patch (Amdahl), from the H200 runs of 2026-12-02b (attention bench)
# and 2026-12-04c (graph_step, bench). Compiled static-cache decode, Qwen3-0.6B b=16: sdpa's mask
# expansion + cuDNN are 1.80 of the step's 3.20 ms of kernels (f ~ 0.56); ours over the filled slots
# 27-50 us a layer against ~720 (s ~ 5 on that part); ceiling ~1.8x on the step's kernels (the bench
# with "cutile" loaded by hand: 1.13-1.19x stock-compile end to end). Eager prefill and unmasked
# DynamicCache decode stay on sdpa (``attention.route``): f = 0 there, nothing won or lost. A padded
# eager decode batch takes the kernel with the mask (sdpa expands the mask and repeats K/V).

#: Attribute of a model the patch switched (plain, in its ``__dict__``): the implementation it had.
_SWITCHED = "_cutile_attention"


def sdpa_attention_verdict(model: nn.Module) -> str | None:
    """Why ``model`` keeps its attention implementation under patch ``cutile_attention``, or None
    when it takes ours: a transformers decoder-only model without sub-models (a multimodal wrapper's
    sub-configs would not all switch), attending with ``"sdpa"``, of a ``model_type`` a family here
    claims (tested with our attention), whose every attention module is causal, on no GPU our kernel
    cannot run on."""
    why = switchable_verdict(model, "sdpa")
    if why is not None:
        return why
    if family_of(getattr(model.config, "model_type", None)) is None:
        return f"no family here claims model_type {getattr(model.config, 'model_type', None)!r}"
    attn = attention_modules(model)
    if not attn:
        return "it has no attention module"
    for m in attn:
        if getattr(m, "is_causal", False) is not True:
            return f"its {type(m).__name__} is not causal"
    return kernel_missing_on(model)


def _continuous_batching_on_stock_attention(self, *args, **kwargs):
    # transformers' continuous batching takes only sdpa, eager and flash attention (it raises for
    # another name): a model this patch switched goes back first, said once.
    before = self.__dict__.pop(_SWITCHED, None)
    if before is not None and self.config._attn_implementation == CUTILE_ATTENTION:
        self.set_attn_implementation(before)
        logger.warning("cutile_kernels: continuous batching takes sdpa, eager or flash attention: %s attends with "
                       "%r again (cutile_kernels.patch(model) switches it back)", type(self).__name__, before)
    return type(self).init_continuous_batching(self, *args, **kwargs)


def patch_cutile_attention(model: nn.Module) -> int:
    """Patch ``cutile_attention``: a model :func:`sdpa_attention_verdict` accepts attends with
    ``"cutile"`` (our kernel for decode over a static cache and for padded decode, transformers' sdpa
    for prefill and unmasked DynamicCache decode: ``attention.route``), through transformers' own
    ``model.set_attn_implementation``. ``kernel_config(exclude=["cutile_attention"])`` keeps sdpa.
    A model attending with ours (switched now or loaded so) gets the kernel's stand-in arrays made
    on its GPUs (``attention.prepare_devices``). transformers' continuous batching
    (``init_continuous_batching``, ``generate_batch``) accepts no other attention than sdpa, eager
    and flash: a switched model goes back to sdpa when it starts, with a warning. Returns the
    attention modules switched (0: already switched or attending with ours, or left alone with a
    log line)."""
    if getattr(getattr(model, "config", None), "_attn_implementation", None) in CUTILE_ATTENTIONS:
        prepare_devices(model)
        return 0
    model.__dict__.pop(_SWITCHED, None)  # switched away since
    why = sdpa_attention_verdict(model)
    if why is not None:
        logger.info("cutile_kernels: patch cutile_attention leaves %s alone: %s", type(model).__name__, why)
        return 0
    before = model.config._attn_implementation
    model.set_attn_implementation(CUTILE_ATTENTION)
    if model.config._attn_implementation != CUTILE_ATTENTION:  # transformers may refuse, with a warning
        logger.info("cutile_kernels: patch cutile_attention: transformers kept %s on %r", type(model).__name__,
                    model.config._attn_implementation)
        return 0
    prepare_devices(model)
    model.__dict__[_SWITCHED] = before
    if hasattr(type(model), "init_continuous_batching"):
        model.__dict__["init_continuous_batching"] = types.MethodType(_continuous_batching_on_stock_attention, model)
    n = len(attention_modules(model))
    logger.info("cutile_kernels: patch cutile_attention: %s attends with %r instead of %r (%d attention modules: "
                "our kernel for static-cache and padded decode, sdpa for unmasked prefill)", type(model).__name__,
                CUTILE_ATTENTION, before, n)
    return n


def unpatch_cutile_attention(model: nn.Module) -> int:
    """Undo :func:`patch_cutile_attention`: the implementation the model had, unless it was switched
    away since. Returns the attention modules switched back."""
    model.__dict__.pop("init_continuous_batching", None)
    return switch_back(model, _SWITCHED)


# ---------------------------------------------------------------------------------------------
# Patch masked_prefill_attention (default): "cutile" takes masked prefills to the kernel
# ---------------------------------------------------------------------------------------------
#
# Estimate, written before the patch: Gemma-3-1B's sliding layers (22 of 26) pass a boolean mask at
# prefill; sdpa then runs its masked kernel, 132 us a layer at 1 x 2048 with a window of 512 (H200,
# 2026-12-05), against 46 us for our kernel given the window's bounds; with the mask's tiles
# classified first (a few us) the kernel should come near the latter for any mask. At 2048 tokens
# f ~ 22 x 132 us of a ~24 ms prefill ~ 0.12, s ~ 2.5: ceiling ~1.08x; at a 512-token prefill
# (the coverage pass), sdpa's masked attention is ~36 % of the non-GEMM device time.


def patch_masked_prefill_attention(model: nn.Module) -> int:
    """Patch ``masked_prefill_attention``: under ``"cutile"`` a prefill given a boolean mask
    (padding, a sliding window) runs on our kernel (``attention.route``; the mask's tiles are
    classified first, so hidden tiles cost nothing and full ones no mask read) instead of sdpa's
    masked kernel. ``kernel_config(exclude=["masked_prefill_attention"])`` keeps such prefills on
    sdpa. Marks each attention module (a mark only ``"cutile"`` reads, so a model attending
    otherwise is unaffected); returns how many were not marked yet (0 when already applied)."""
    new = [m for m in attention_modules(model) if not m.__dict__.get(MASKED_PREFILL)]
    for m in new:
        m.__dict__[MASKED_PREFILL] = True
    if new:
        logger.info("cutile_kernels: patch masked_prefill_attention: %d attention modules of %s send a prefill "
                    "with a boolean mask to our kernel under %r (head dims %s), sdpa otherwise", len(new),
                    type(model).__name__, CUTILE_ATTENTION, sorted(MASKED_PREFILL_HEAD_DIMS))
    return len(new)


def unpatch_masked_prefill_attention(model: nn.Module) -> int:
    """Undo :func:`patch_masked_prefill_attention`. Returns the attention modules unmarked."""
    return sum(m.__dict__.pop(MASKED_PREFILL, None) is not None for m in attention_modules(model))


#: This module's patch rows (gathered by ``layers/_registry.py``).
PATCH_ROWS = [Patch("cutile_attention", apply=patch_cutile_attention, undo=unpatch_cutile_attention,
                    description="a claimed family attends with our kernel where it beats sdpa (static-cache and "
                                "padded decode), sdpa elsewhere"),
              Patch("masked_prefill_attention", apply=patch_masked_prefill_attention,
                    undo=unpatch_masked_prefill_attention,
                    description="under \"cutile\", a prefill with a boolean mask (padding, sliding window) runs on our "
                                "kernel, the mask's tiles classified first")]

__all__ = ["FAMILIES", "PATCH_ROWS", "Family", "attention_modules", "claimed_model_types", "discover", "family_of",
           "modules", "patch_cutile_attention", "patch_masked_prefill_attention", "sdpa_attention_verdict",
           "switch_back", "switchable_verdict", "unpatch_cutile_attention", "unpatch_masked_prefill_attention"]
