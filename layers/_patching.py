"""The patch mechanism: what a patch is, the registry, applying and undoing patches, the save
wrapper, and the helpers that swap a module's forward.

transformers' hub hooks let ``kernels`` swap the forward of decorated layers and functions
(``layers.MAPPING``). Everything else is a *patch*: fusions that cross module boundaries, forwards
of undecorated classes, weight fusion at load (and un-fusion at save). Each feature module declares
its patches as a module-level ``PATCH_ROWS`` list of :class:`Patch` rows; ``layers`` gathers them in
apply order (``layers/_registry.py``), so adding one edits only its own module. :func:`patch`
applies the registered patches to a model in place, :func:`unpatch` undoes them;
``cutile_kernels.kernelize`` and ``kernel_config`` call :func:`patch` on CUDA models.

A patch is two functions (see :class:`Patch`): ``apply(model) -> int`` changes the model in place
and returns how many modules it changed (0: nothing here for it, or already applied), is
idempotent, and logs what it changed and what it left alone and why; ``undo(model) -> int``
restores what ``apply`` changed. A patch that changes parameters or buffers sets
``changes_weights``: :func:`patch` then wraps the model's ``save_pretrained`` so that a save
undoes it first and re-applies it after, and the checkpoint has the stock keys and bytes.
"""

from __future__ import annotations

import logging
import sys
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from torch import nn

logger = logging.getLogger("cutile_kernels")


@dataclass(frozen=True)
class Patch:
    """One registered patch.

    Attributes:
        name: unique key (``decoder_add_rms_norm``), used in reports and ``patch(model, names=...)``.
        apply: ``apply(model) -> int``, see the module docstring.
        undo: ``undo(model) -> int``, or None when the patch cannot be undone.
        description: one line for logs and reports.
        changes_weights: apply changes parameters or buffers; saves are wrapped (module docstring).
        default: applied by ``patch(model)`` without names (and so by ``kernel_config`` /
            ``kernelize``); False for an opt-in patch, applied only when named (one whose
            end-to-end benefit has not been shown, e.g. a candidate autokernelize discarded).
        follows: while in effect, applied again (its apply is idempotent) after any other
            patch or undo changed the model, so that modules those create (a stacked projection,
            the projections an unstacking restores) are covered too: ``gemv``.
    """

    name: str
    apply: Callable[[nn.Module], int]
    undo: Callable[[nn.Module], int] | None = None
    description: str = ""
    changes_weights: bool = False
    default: bool = True
    follows: bool = False


@dataclass
class PatchReport:
    """What one :func:`patch` or :func:`unpatch` call did.

    Attributes:
        changed: patch name -> modules changed by this call (0: nothing to do, or already done).
        active: names of the patches in effect on the model after the call, in apply order.
    """

    changed: dict[str, int] = field(default_factory=dict)
    active: list[str] = field(default_factory=list)


#: The registered patches, in apply order (undone in reverse order).
PATCHES: dict[str, Patch] = {}

#: Attribute of the model (plain, not a submodule) holding {patch name: modules changed}.
_STATE = "_cutile_patches"


def register(p: Patch, replace: bool = False) -> Patch:
    """Add a patch to the registry (appended to the apply order) and return it.

    Raises:
        ValueError: a patch of that name is registered and ``replace`` is False.
    """
    if p.name in PATCHES and not replace:
        raise ValueError(f"a patch named {p.name!r} is already registered")
    PATCHES[p.name] = p
    return p


def _select(names, defaults_only: bool = False) -> list[Patch]:
    if names is None:
        return [p for p in PATCHES.values() if p.default or not defaults_only]
    names = [names] if isinstance(names, str) else list(names)
    unknown = [n for n in names if n not in PATCHES]
    if unknown:
        raise KeyError(f"unknown patch(es) {unknown}; registered: {list(PATCHES)}")
    return [PATCHES[n] for n in PATCHES if n in names]


def _state(model: nn.Module) -> dict[str, int]:
    state = model.__dict__.get(_STATE)
    if state is None:
        state = {}
        model.__dict__[_STATE] = state
    return state


def applied(model: nn.Module) -> dict[str, int]:
    """{patch name: modules it changed} for the patches in effect on ``model``."""
    return dict(model.__dict__.get(_STATE, {}))


def patch(model: nn.Module, names=None) -> PatchReport:
    """Apply the registered patches (or only ``names``) to ``model`` in place.

    Idempotent: a patch already in effect changes nothing more; calling it again after new
    modules appeared patches those. Works on a model loaded long before (nothing is hooked into
    loading). On a CPU model the patched forwards compute the stock formulas (the ops' reference
    paths), so results do not change.

    Args:
        model: a loaded ``nn.Module`` (usually a transformers ``PreTrainedModel``).
        names: a patch name or names (default: every registered patch whose ``default`` is
            True; opt-in patches only when named).

    Returns:
        A :class:`PatchReport`.

    Raises:
        KeyError: an unknown name in ``names``.
    """
    state = _state(model)
    report = PatchReport()
    selected = _select(names, defaults_only=True)
    try:
        for p in selected:
            # Marked in effect before it runs: a patch that raises part-way has changed some
            # modules, and unpatch must still undo them (the undos scan the model).
            state.setdefault(p.name, 0)
            n = int(p.apply(model))
            report.changed[p.name] = n
            state[p.name] += n
            if not state[p.name]:
                del state[p.name]
        if any(report.changed.values()):
            _follow(model, state, report, done={p.name for p in selected})
    finally:
        _sync_save_wrapper(model)
    report.active = list(state)
    return report


def _follow(model: nn.Module, state: dict, report: PatchReport, done=()) -> None:
    """Apply again the ``follows`` patches in effect (but those in ``done``) after the model
    changed; the modules they newly cover go into the report (their count in ``applied`` stays the
    first apply's: the modules they replaced are gone)."""
    for p in PATCHES.values():
        if p.follows and p.name in state and p.name not in done:
            n = int(p.apply(model))
            if n:
                report.changed[p.name] = report.changed.get(p.name, 0) + n


def unpatch(model: nn.Module, names=None) -> PatchReport:
    """Undo the patches in effect on ``model`` (or only ``names``), in reverse apply order.

    A patch without ``undo`` stays in effect and logs a warning.

    Returns:
        A :class:`PatchReport` whose ``changed`` counts the modules restored.
    """
    state = _state(model)
    report = PatchReport()
    for p in reversed(_select(names)):
        if p.name not in state:
            continue
        if p.undo is None:
            logger.warning("cutile_kernels: patch %s cannot be undone; it stays in effect", p.name)
            continue
        report.changed[p.name] = int(p.undo(model))
        del state[p.name]
    if any(report.changed.values()):
        _follow(model, state, PatchReport())  # e.g. the projections an unstacking restored
    _sync_save_wrapper(model)
    report.active = list(state)
    return report


def _patched_save_pretrained(self, *args, **kwargs):
    # Saves the stock checkpoint: weight-changing patches are undone for the save, then re-applied.
    names = [n for n in applied(self) if PATCHES[n].changes_weights]
    unpatch(self, names)
    try:
        return type(self).save_pretrained(self, *args, **kwargs)
    finally:
        patch(self, names)


def _sync_save_wrapper(model: nn.Module) -> None:
    wants = any(PATCHES[n].changes_weights for n in applied(model) if n in PATCHES)
    current = model.__dict__.get("save_pretrained")
    ours = getattr(current, "__func__", None) is _patched_save_pretrained
    if wants and current is None and hasattr(type(model), "save_pretrained"):
        model.save_pretrained = types.MethodType(_patched_save_pretrained, model)
    elif not wants and ours:
        del model.__dict__["save_pretrained"]


#: A forward hook whose function carries this attribute (set to True) only observes, e.g. the
#: bench's profiler ranges: the fusions may skip it, as they skip the norm module it hooks.
TRANSPARENT_HOOK = "_cutile_transparent"


def _blocking(hooks) -> bool:
    # The empty dict (the usual case, per fused call and layer) is answered without a generator.
    return bool(hooks) and any(not getattr(h, TRANSPARENT_HOOK, False) for h in hooks.values())


def _unhooked(m: nn.Module) -> bool:
    # Calling the fused op instead of the norm module would skip its hooks, and accelerate's, which
    # replace the instance's forward (add_hook_to_module: cpu_offload, dispatch_model) and mark it.
    return not (_blocking(m._forward_hooks) or _blocking(m._forward_pre_hooks) or m._backward_hooks
                or _blocking(nn.modules.module._global_forward_hooks)
                or _blocking(nn.modules.module._global_forward_pre_hooks) or "_hf_hook" in m.__dict__)


def own_forward_on_instance(m: nn.Module) -> bool:
    """Whether ``m``'s instance forward is its class's own forward bound to it: what ``kernels``'
    kernelize binds where it maps no kernel (e.g. on a CPU), not a replacement to keep. A patch
    that swaps such a module's forward replaces that binding, and its undo drops the instance
    forward: the class forward runs again, which is what the binding ran."""
    fwd = m.__dict__.get("forward")
    return getattr(fwd, "__self__", None) is m and getattr(fwd, "__func__", None) is type(m).forward


def forward_replaced(m: nn.Module) -> bool:
    """Whether something replaced ``m``'s forward on the instance (e.g. accelerate's hooks, another
    patch): an instance forward other than its class's own bound to it (:func:`own_forward_on_instance`)."""
    return "forward" in m.__dict__ and not own_forward_on_instance(m)


def swapped(m: nn.Module, forward) -> bool:
    """Whether ``m``'s instance forward is ``forward`` bound to it (a patch's own swap). Spelled so that
    torch 2.11's dynamo evaluates it as eager Python does inside a traced forward: there
    ``getattr(m.__dict__.get("forward"), "__func__", None)`` gave None (Qwen3's compiled attention then
    took the stock lines; H200 and CPU, 2026-12-03)."""
    own = m.__dict__
    if "forward" not in own:
        return False
    bound = own["forward"]
    return isinstance(bound, types.MethodType) and bound.__func__ is forward


#: Instance attribute set by :func:`swap_forwards`: the name of the module whose globals the swapped
#: module's stock forward reads (its modeling module), for :func:`modeling_globals`.
MODELING_ATTR = "_cutile_modeling"


def stock_class(m: nn.Module) -> type:
    """``type(m)``, or for a module whose q/k/v ``fused_qkv`` stacked, the stock class it was switched
    from (whose forward is the stock one)."""
    return getattr(type(m), "_cutile_qkv_unfused_class", type(m))


def _stock_forward(m: nn.Module):
    return stock_class(m).forward


def _modeling_name(m: nn.Module) -> str | None:
    # Only where the name leads back to the very globals the forward reads: a forward made by exec or
    # copied into another namespace keeps __module__ but not that module's globals.
    fwd = _stock_forward(m)
    name = getattr(fwd, "__module__", None)
    mod = sys.modules.get(name) if isinstance(name, str) else None
    return name if mod is not None and getattr(fwd, "__globals__", None) is vars(mod) else None


def modeling_globals(m: nn.Module) -> dict:
    """The globals of the module that defines ``m``'s stock forward (its modeling module: the attention
    registry, eager attention and RoPE functions that forward reads), for a reproduced forward to
    read as the stock one does. Under ``torch.compile`` it is found through ``sys.modules`` by the
    name :func:`swap_forwards` stored on the instance, which dynamo guards as it guards a global:
    ``type(m).forward.__globals__`` made a guard check of a compiled 28-layer Qwen3 step some 30 us
    slower (torch 2.11, dev/diagnostics/guards.py). Falls back to that where no name was stored (a
    module stacked by ``fused_qkv`` without a swapped forward)."""
    own = m.__dict__  # indexed, not .get(): how torch 2.11's dynamo evaluates it right (see swapped)
    if MODELING_ATTR in own:
        return sys.modules[own[MODELING_ATTR]].__dict__
    return _stock_forward(m).__globals__


def swap_forwards(model: nn.Module, patch_name: str, forward, candidate, verdict, done: str,
                  prepare=None, replaceable=None, modeling: bool = False) -> Counter:
    """The mechanism of the patches that replace a module's forward: bind ``forward`` to every
    module of ``model`` that ``candidate(m)`` selects, is not swapped yet, has ``verdict(m)`` None
    (else the string says why not) and whose instance forward nobody else replaced (e.g.
    accelerate's device hooks; its class's own forward bound there, :func:`own_forward_on_instance`,
    is no replacement) unless ``replaceable(that forward)`` says it may go (a hub layer of
    ours that would run the stock code anyway); ``prepare(m)`` runs first on each. With
    ``modeling``, each swapped module also keeps the name of its stock forward's module, for
    ``forward`` to read through :func:`modeling_globals`. Logs per class
    what was done (``done`` formatted with ``n`` and ``cls``) and what was left alone and why.

    Returns:
        {class name: modules newly swapped}.
    """
    new, refused = Counter(), Counter()
    reasons: dict[str, str] = {}
    for _, m in model.named_modules():
        if not candidate(m) or swapped(m, forward):
            continue
        name = type(m).__name__
        why = verdict(m)
        if why is None and forward_replaced(m) and not (replaceable and replaceable(m.__dict__["forward"])):
            why = "its forward is already replaced on the instance (e.g. an accelerate hook)"
        if why is not None:
            refused[name] += 1
            reasons[name] = why
            continue
        if prepare is not None:
            prepare(m)
        m.forward = types.MethodType(forward, m)
        module_name = _modeling_name(m) if modeling else None
        if module_name is not None:
            m.__dict__[MODELING_ATTR] = module_name
        new[name] += 1
    for name, n in new.items():
        logger.info("cutile_kernels: patch %s: %s", patch_name, done.format(n=n, cls=name))
    for name, n in refused.items():
        logger.info("cutile_kernels: patch %s leaves %d %s alone: %s", patch_name, n, name, reasons[name])
    return new


def restore_forwards(model: nn.Module, patch_name: str, forward, attrs=(), noun: str = "modules") -> int:
    """Undo :func:`swap_forwards`: drop the instance forward (and the instance ``attrs``) of every
    module swapped to ``forward``, so the class forward runs again. Returns the modules restored."""
    n = 0
    for _, m in model.named_modules():
        if swapped(m, forward):
            for attr in ("forward", MODELING_ATTR, *attrs):
                m.__dict__.pop(attr, None)
            n += 1
    if n:
        logger.info("cutile_kernels: patch %s undone on %d %s", patch_name, n, noun)
    return n
