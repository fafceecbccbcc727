"""What the weight-stacking patches share (``mlp.py``: gate/up, ``qkv.py``: q/k/v): which linear
layers may be stacked, swapping children in place, and pickling a module whose class was made at
run time."""

from __future__ import annotations

import torch
from torch import nn


def linear_problem(m, bias_ok: bool = False) -> str | None:
    """Why ``m`` cannot be stacked with its siblings, or None: it must be exactly ``nn.Linear``
    (no subclass: quantized or LoRA layers), without hooks that stacking would drop (accelerate
    offload, PEFT), with a plain dense weight (no tensor subclass such as DTensor, not meta), and a
    bias only when ``bias_ok``."""
    if type(m) is not nn.Linear:
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


def rebuild_fused(fused_class, base: type, state: dict) -> nn.Module:
    """Unpickle a module of the class ``fused_class(base)`` (made at run time, so pickle cannot
    name it): a fused module's ``__reduce_ex__`` returns ``(rebuild_fused, (fused_class, base,
    state))``, and torch.save, deepcopy and multiprocessing rebuild it through the stock class."""
    cls = fused_class(base)
    obj = cls.__new__(cls)
    obj.__setstate__(state)
    return obj
