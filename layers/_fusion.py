"""What the weight-stacking patches share (``mlp.py``: gate/up, ``qkv.py``: q/k/v): which linear
layers may be stacked, swapping children in place, pickling a module whose class was made at run
time, and stacking itself: :func:`fuse_one` / :func:`unfuse_one` and the hooks that keep the stock
``state_dict`` keys, parametrised by a :class:`Stacking`."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import nn

from ._patching import own_forward_on_instance


def linear_problem(m, bias_ok: bool = False) -> str | None:
    """Why ``m`` cannot be stacked with its siblings, or None: it must be exactly ``nn.Linear``
    (no subclass: quantized or LoRA layers; a class of ours that marks itself as computing
    ``nn.Linear``'s function, ``_cutile_as_linear``, counts as one), without hooks that stacking would drop (accelerate
    offload, PEFT), with a plain dense weight (no tensor subclass such as DTensor, not meta), and a
    bias only when ``bias_ok``."""
    if type(m) is not nn.Linear and not type(m).__dict__.get("_cutile_as_linear", False):
        return f"is a {type(m).__name__}, not nn.Linear"
    if m.bias is not None and not bias_ok:
        return "has a bias"
    if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks \
            or hasattr(m, "_hf_hook"):
        return "has forward or backward hooks"
    for what, p in (("weight", m.weight), ("bias", m.bias)):
        if p is None:
            continue
        if type(p) is not nn.Parameter or type(p.data) is not torch.Tensor:
            return f"has a {type(p.data).__name__} {what}"
        if p.is_meta:
            return f"has a meta {what}"
    return None


def replace_children(module: nn.Module, old: tuple, new: dict) -> None:
    """Put ``new`` (name -> module) where ``old[0]`` was and drop the other ``old`` children,
    keeping the order of the rest (hence the order of ``state_dict`` and ``parameters``)."""
    children = {}
    for name, child in module._modules.items():
        if name == old[0]:
            children.update(new)
        elif name not in old:
            children[name] = child
    module._modules = children


def new_fused(fused_class, base: type) -> nn.Module:
    """An empty module of the class ``fused_class(base)`` (made at run time, so pickle cannot name
    it): a fused module's ``__reduce_ex__`` returns ``(new_fused, (fused_class, base), state)``;
    pickle and deepcopy make the module first and then set its state, so references to the module
    inside its state (the weak references of its ``load_state_dict`` hooks) reach the new module."""
    cls = fused_class(base)
    return cls.__new__(cls)


def reduce_fused(module: nn.Module, spec: "Stacking", protocol) -> tuple:
    """``__reduce_ex__`` of a fused module (its class's, as ``partialmethod(reduce_fused, spec)``):
    a class made at run time cannot be pickled by name, so the module is rebuilt from its stock
    class through :func:`new_fused`, with the state third so that pickle and deepcopy set it on
    the new module."""
    return new_fused, (spec.fused_class, getattr(module, spec.unfused_attr)), module.__dict__.copy()


def rebuild_fused(fused_class, base: type, state: dict) -> nn.Module:
    """Unpickle a fused module pickled by an earlier version, whose ``__reduce_ex__`` returned
    ``(rebuild_fused, (fused_class, base, state))`` (see :func:`new_fused`)."""
    obj = new_fused(fused_class, base)
    obj.__setstate__(state)
    return obj


def shape_mismatch(keys: list, given: list, current: list) -> list:
    """What :func:`load_state_dict_pre_hook` reports for one suffix's stock keys, by default: each
    given value (``given[i]`` for ``keys[i]``, None where the state_dict lacks it) that is not a
    tensor of its rows' shape (``current[i]``), in the words of ``nn.Module.load_state_dict``. An
    empty list means the values may be stacked."""
    return [f"size mismatch for {key}: copying a param with shape {tuple(getattr(t, 'shape', ()))} from "
            f"checkpoint, the shape in current model is {tuple(want.shape)}."
            for key, t, want in zip(keys, given, current)
            if t is not None and (not isinstance(t, torch.Tensor) or t.shape != want.shape)]


@dataclasses.dataclass(frozen=True)
class Stacking:
    """How a patch stacks sibling ``nn.Linear`` children of a module into one: what :func:`fuse_one`,
    :func:`unfuse_one` and the two hooks they manage read. Module-level functions only (the hooks
    hold the instance, and a fused module must pickle).

    Attributes:
        stock: the children's names, in stacking order (their rows, first to last).
        fused: the stacked child's name; it takes ``stock[0]``'s place among the children.
        row_slices: fused module -> one ``slice`` per stock child, its rows in the stacked tensors.
        fused_class: stock class -> the class a fused module is switched to.
        unfused_attr: the fused class's attribute naming its stock class.
        hooks_attr: the module attribute holding the two hook handles while fused.
        bias: whether the children's biases are stacked too (when they have one); if not, only
            ``weight`` is, and the stacked child never has a bias.
        mismatch: ``(keys, given, current) -> messages`` for the load hook (see
            :func:`shape_mismatch`, the default).
    """

    stock: tuple[str, ...]
    fused: str
    row_slices: Callable[[nn.Module], tuple[slice, ...]]
    fused_class: Callable[[type], type]
    unfused_attr: str
    hooks_attr: str
    bias: bool = False
    mismatch: Callable[[list, list, list], list] = shape_mismatch

    @property
    def suffixes(self) -> tuple[str, ...]:
        """The parameter names stacked: ``weight``, and ``bias`` when :attr:`bias`."""
        return ("weight", "bias") if self.bias else ("weight",)


def state_dict_hook(spec: Stacking, module, state_dict, prefix, local_metadata) -> None:
    """``state_dict`` post-hook of a fused module (registered as ``partial(state_dict_hook,
    spec)``): replaces the stacked keys (``<fused>.weight``, ``<fused>.bias``) with the stock ones,
    row blocks of the stacked tensors as views (no copy), in stock order (``<stock[0]>.weight``,
    ``<stock[0]>.bias``, ``<stock[1]>.weight``, ...), before the keys that followed them."""
    fused = [f"{prefix}{spec.fused}.{s}" for s in spec.suffixes]
    if fused[0] not in state_dict:
        return
    keys = list(state_dict)
    later = [k for k in keys[keys.index(fused[0]) + 1:] if k not in fused]
    stacked = {s: state_dict.pop(k, None) for s, k in zip(spec.suffixes, fused)}
    for name, rows in zip(spec.stock, spec.row_slices(module)):
        for suffix, t in stacked.items():
            if t is not None:
                state_dict[f"{prefix}{name}.{suffix}"] = t[rows]
    for k in later:
        state_dict[k] = state_dict.pop(k)


def load_state_dict_pre_hook(spec: Stacking, module, state_dict, prefix, local_metadata, strict, missing_keys,
                             unexpected_keys, error_msgs) -> None:
    """``load_state_dict`` pre-hook of a fused module (registered as ``partial(
    load_state_dict_pre_hook, spec)``): accepts the stock keys by stacking them (the current rows
    where one is absent) into the stacked key, which the module then loads as usual. The stock
    keys of a suffix are taken out of ``state_dict`` once one is there; if ``spec.mismatch``
    reports anything, that goes to ``error_msgs`` (``load_state_dict`` raises it as a
    RuntimeError) and nothing is stacked for that suffix. Stock bias keys with no
    stacked bias stay where they are, so ``load_state_dict`` reports them as unexpected, as the
    stock module would."""
    fused = getattr(module, spec.fused)
    slices = spec.row_slices(module)
    for suffix in spec.suffixes:
        current = getattr(fused, suffix)
        keys = [f"{prefix}{name}.{suffix}" for name in spec.stock]
        if current is None or not any(k in state_dict for k in keys):
            continue
        current = current.detach()
        given = [state_dict.pop(k, None) for k in keys]
        wants = [current[rows] for rows in slices]
        errors = spec.mismatch(keys, given, wants)
        if errors:
            error_msgs.extend(errors)
            continue
        parts = [want if t is None else t for t, want in zip(given, wants)]
        device = parts[0].device  # cat needs one device; loading then copies into ours
        state_dict[f"{prefix}{spec.fused}.{suffix}"] = torch.cat([t.to(device) for t in parts], dim=0)


def fuse_one(module: nn.Module, spec: Stacking) -> None:
    """Stack ``module``'s ``spec.stock`` children (checked by the caller: plain ``nn.Linear``, one
    input size, dtype and device) into one ``nn.Linear(H, sum of their outputs)`` named
    ``spec.fused`` whose weight (bias: when ``spec.bias`` and they have one) is their ``cat``
    along rows, with the first child's ``requires_grad`` and training mode; drop them (their
    tensors are freed once nothing else refers to them), switch the class to
    ``spec.fused_class`` of it, and register :func:`state_dict_hook` and
    :func:`load_state_dict_pre_hook`, their handles kept as ``spec.hooks_attr``. Where ``kernels``
    bound the class's own forward on the instance (:func:`~._patching.own_forward_on_instance`),
    that binding goes: the fused class's forward must run."""
    if own_forward_on_instance(module):
        del module.__dict__["forward"]
    children = [getattr(module, n) for n in spec.stock]
    first = children[0]
    has_bias = spec.bias and first.bias is not None
    with torch.no_grad():
        weight = torch.cat([c.weight for c in children], dim=0)
        bias = torch.cat([c.bias for c in children], dim=0) if has_bias else None
    linear = nn.Linear(first.in_features, weight.shape[0], bias=has_bias, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=first.weight.requires_grad)
    if has_bias:
        linear.bias = nn.Parameter(bias, requires_grad=first.bias.requires_grad)
    linear.train(first.training)
    replace_children(module, spec.stock, {spec.fused: linear})
    module.__class__ = spec.fused_class(type(module))
    # partials of module-level functions, not closures: a fused module must deepcopy and pickle.
    setattr(module, spec.hooks_attr, (
        module.register_state_dict_post_hook(functools.partial(state_dict_hook, spec)),
        module.register_load_state_dict_pre_hook(functools.partial(load_state_dict_pre_hook, spec))))


def unfuse_one(module: nn.Module, spec: Stacking) -> None:
    """Undo :func:`fuse_one`: give ``module`` back its ``spec.stock`` children (copies of the row
    blocks ``spec.row_slices`` gives, after which the stacked tensors are freed), remove the hooks
    and switch the class back to ``spec.unfused_attr`` of it."""
    fused = getattr(module, spec.fused)
    w = fused.weight
    b = fused.bias if spec.bias else None  # the stacked child of a bias-free spec has none
    stock = {}
    for name, rows in zip(spec.stock, spec.row_slices(module)):
        with torch.no_grad():
            weight = w[rows].clone()
            bias = None if b is None else b[rows].clone()
        linear = nn.Linear(w.shape[1], weight.shape[0], bias=b is not None, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=w.requires_grad)
        if b is not None:
            linear.bias = nn.Parameter(bias, requires_grad=b.requires_grad)
        linear.train(fused.training)
        stock[name] = linear
    replace_children(module, (spec.fused,), stock)
    for handle in module.__dict__.pop(spec.hooks_attr, ()):
        handle.remove()
    module.__class__ = getattr(module, spec.unfused_attr)
