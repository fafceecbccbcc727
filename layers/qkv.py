"""Stacked q/k/v projections: one GEMM per attention layer instead of three.

``LlamaAttention.forward`` (transformers v5.22.2), and the Mistral and Qwen2 variants of it, project
the same ``hidden_states`` three times (``q_proj``, ``k_proj``, ``v_proj``): three GEMM launches and
three module calls per layer and step. :func:`fuse_qkv` rewrites such a module in place to one
``qkv_proj`` (``nn.Linear(H, Nq + 2 Nkv)``, weight rows ``[q; k; v]``, bias likewise when the three
have one) and switches its class to a subclass whose forward is :func:`fused_qkv_forward`: the
stock forward with the three projections replaced by one GEMM and a split of its output. RoPE (the
module's ``apply_rotary_pos_emb``, possibly a ``kernels`` hub function), the cache update, the
attention interface and ``o_proj`` are the stock lines, looked up where the stock forward looks
them up (the globals of the class's modeling module), so kernelized RoPE and any
``attn_implementation`` keep working.

Which modules (else left alone, one log line per class and reason): the class's ``forward`` has
the code (:func:`~._match.same_code`) of ``LlamaAttention.forward`` (no ``sliding_window``
argument), ``MistralAttention.forward`` (``sliding_window`` from the config) or
``Qwen2Attention.forward`` (``self.sliding_window``), and that transformers forward still has
the pinned statements (:data:`REFERENCES`); nobody replaced the forward on the instance
(accelerate hooks, another patch); q/k/v are plain ``nn.Linear`` layers without hooks, with dense
weights of one dtype and device, all three with a bias or none, of shapes ``(Hq * D, H)``,
``(Hkv * D, H)``, ``(Hkv * D, H)`` for ``D = self.head_dim``.

A family patch that reproduces another attention forward can make it stackable too
(:func:`register_stackable`): ``models/qwen3.py`` does for ``Qwen3Attention`` (q_norm / k_norm
between projection and RoPE), whose forward its ``qk_norm_rope`` patch owns. Such a module is
stacked only while that patch's forward is bound to it; its stacked class's forward is the
patch's forward, which projects through :func:`stacked_projections`.

Weights, as in ``layers/mlp.py``: the stacked weight (and bias) is the only copy (the originals
are freed); ``state_dict()`` still has the stock keys ``q_proj.weight``, ``k_proj.weight``,
``v_proj.weight`` (and ``.bias``), views of the stacked tensors in stock order, so
``save_pretrained`` writes the stock checkpoint (same keys and bytes); ``load_state_dict`` with
stock keys writes into the stacked tensors; :func:`unfuse_qkv` restores the stock modules and
class. Done on the loaded model rather than through transformers' load-time fusion hooks for the
reasons given in ``layers/mlp.py``'s docstring.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections import Counter
from typing import Callable

import torch
from torch import nn

from ._direct import attend, call, linear, rope_and_cache, rope_attend
from ._fusion import Stacking, fuse_one, linear_problem, reduce_fused, unfuse_one
from ._match import same_code
from ._patching import Patch, forward_replaced, swapped
from ._pins import TRANSFORMERS, holds

logger = logging.getLogger("cutile_kernels")

#: The stacked projection :func:`fuse_qkv` adds (weight ``(Nq + 2 Nkv, H)``, rows ``[q; k; v]``).
FUSED_NAME = "qkv_proj"
_STOCK = ("q_proj", "k_proj", "v_proj")
_ATTRS = (*_STOCK, "o_proj")

# How the reproduced forward passes ``sliding_window`` to the attention interface.
_NO_WINDOW = 0  # LlamaAttention: not at all
_CONFIG_WINDOW = 1  # MistralAttention: getattr(self.config, "sliding_window", None)
_MODULE_WINDOW = 2  # Qwen2Attention: self.sliding_window
_OWNED = 3  # a Stackable's forward: the family patch's forward handles the window itself

#: (modeling module, class) of the transformers forwards :func:`fused_qkv_forward` reproduces ->
#: how each passes ``sliding_window``. Each is pinned (``layers/_pins.py``): if transformers
#: changes one, classes with that forward's code are left alone.
REFERENCES = {
    ("llama", "LlamaAttention"): _NO_WINDOW,
    ("mistral", "MistralAttention"): _CONFIG_WINDOW,
    ("qwen2", "Qwen2Attention"): _MODULE_WINDOW,
}


@dataclasses.dataclass(frozen=True)
class Stackable:
    """An attention forward owned by a family patch that reads stacked projections.

    Attributes:
        reference: returns the transformers forward (e.g. ``Qwen3Attention.forward``) whose code a
            class's forward must have.
        forward: the patch's forward; bound to the module (the patch applied), it is what lets
            the module stack, and it becomes the stacked class's forward. It must project through
            :func:`stacked_projections` when the module has ``qkv_proj``.
        verdict: ``verdict(module)``: why the patch's forward cannot serve ``module``, or None.
        patch: the patch's name (for the log lines).
    """

    reference: Callable[[], Callable]
    forward: Callable
    verdict: Callable[[nn.Module], str | None]
    patch: str


#: Stackable forwards registered by family modules (:func:`register_stackable`).
STACKABLE: list[Stackable] = []


def register_stackable(entry: Stackable) -> None:
    """Let modules whose class forward has ``entry.reference()``'s code stack their q/k/v when
    ``entry.forward`` is bound to them (see the module docstring). Idempotent per forward and
    reference (one forward may reproduce several classes' code: OLMo 2's and OLMo 3's attention)."""
    if all(e.forward is not entry.forward or e.reference() is not entry.reference() for e in STACKABLE):
        STACKABLE.append(entry)
        _forward_verdict.cache_clear()


def _stackable_for(fwd) -> Stackable | None:
    return next((e for e in STACKABLE if same_code(fwd, e.reference())), None)


def stacked_projections(module: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(q, k, v)`` of a stacked module: one GEMM through ``qkv_proj`` and views of its output,
    each ``(..., N)`` with the stock projections' widths (``module._cutile_qkv_split``)."""
    q_out, kv_out = module._cutile_qkv_split
    return linear(module.qkv_proj, hidden_states).split((q_out, kv_out, kv_out), dim=-1)


def qkv_projections(module: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(q, k, v)`` of an attention module for a reproduced forward: :func:`stacked_projections`
    where ``fused_qkv`` stacked it, else its ``q_proj``, ``k_proj`` and ``v_proj`` (each through
    ``_direct.linear``)."""
    if FUSED_NAME in module._modules:
        return stacked_projections(module, hidden_states)
    return tuple(linear(p, hidden_states) for p in (module.q_proj, module.k_proj, module.v_proj))


def _reference_class(module_name: str, class_name: str) -> type:
    import importlib

    return getattr(importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}"), class_name)


def _class_verdict(cls: type) -> tuple[str | None, int | None]:
    # (why not, None) or (None, window mode) for the class's forward as it is now.
    return _forward_verdict(getattr(cls, "forward", None))


@functools.lru_cache(maxsize=None)
def _forward_verdict(fwd) -> tuple[str | None, int | None]:
    # (why not, None) or (None, window mode). Per function, once: the forwards do no check.
    for (module_name, class_name), window in REFERENCES.items():
        ref = _reference_class(module_name, class_name).forward
        if same_code(fwd, ref):
            if not holds(f"{module_name}.{class_name}.forward"):
                return (f"this transformers' {class_name}.forward is not the one the fused forward "
                        f"reproduces ({TRANSFORMERS})"), None
            return None, window
    if _stackable_for(fwd) is not None:
        return None, _OWNED
    return ("its forward is not LlamaAttention, MistralAttention or Qwen2Attention.forward's code, nor "
            f"one a family patch stacks (transformers {TRANSFORMERS})"), None


def attention_verdict(cls: type) -> str | None:
    """Why an attention class ``cls`` cannot take :func:`fused_qkv_forward`, or None if it can
    (its forward is the code of one of the :data:`REFERENCES` forwards, still the pinned one).
    Cached per forward function."""
    return _class_verdict(cls)[0]


def why_not_fusable_qkv(module: nn.Module) -> str | None:
    """Why :func:`fuse_qkv` leaves ``module`` alone, or None if it fuses it (see
    :func:`is_fusable_qkv`)."""
    if getattr(type(module), "_cutile_qkv_unfused_class", None) is not None:
        return "already fused"
    why, window = _class_verdict(type(module))
    if why is not None:
        return why
    if window == _OWNED:
        entry = _stackable_for(type(module).forward)
        if not swapped(module, entry.forward):
            return f"its forward is {type(module).__name__}'s own: stacking it needs the {entry.patch} patch"
        why = entry.verdict(module)
        if why is not None:
            return why
    elif forward_replaced(module):
        return "its forward is replaced on the instance (e.g. an accelerate hook or another patch)"
    for name in _STOCK:
        problem = linear_problem(getattr(module, name, None), bias_ok=True)
        if problem:
            return f"{name} {problem}"
    q, k, v = (getattr(module, n) for n in _STOCK)
    if len({lin.bias is None for lin in (q, k, v)}) > 1:
        return "q_proj, k_proj and v_proj do not all have a bias, nor all none"
    tensors = [t for lin in (q, k, v) for t in (lin.weight, lin.bias) if t is not None]
    if len({t.dtype for t in tensors}) > 1 or len({t.device for t in tensors}) > 1:
        return "q/k/v weights differ in dtype or device"
    if len({t.requires_grad for t in tensors}) > 1:
        return "q/k/v weights differ in requires_grad (one stacked tensor would train all or none)"
    head_dim = getattr(module, "head_dim", None)
    qw, kw, vw = q.weight, k.weight, v.weight
    if not (isinstance(head_dim, int) and head_dim > 0 and qw.shape[1] == kw.shape[1] == vw.shape[1]
            and kw.shape == vw.shape and qw.shape[0] % head_dim == 0 and kw.shape[0] % head_dim == 0
            and kw.shape[0] > 0 and (qw.shape[0] // head_dim) % (kw.shape[0] // head_dim) == 0):
        return (f"weight shapes {tuple(qw.shape)}, {tuple(kw.shape)}, {tuple(vw.shape)} are not "
                f"(Hq * D, H), (Hkv * D, H), (Hkv * D, H) with D = head_dim {head_dim}")
    return None


def is_fusable_qkv(module: nn.Module) -> bool:
    """True if :func:`fuse_qkv` applies to ``module``.

    That is: its class's forward is the code of ``LlamaAttention.forward``,
    ``MistralAttention.forward`` or ``Qwen2Attention.forward`` and that forward is still
    transformers 5.22.2's (:func:`attention_verdict`); the forward is not replaced on the instance;
    ``q_proj``, ``k_proj``, ``v_proj`` are plain ``nn.Linear`` layers without hooks, with dense
    weights (and biases: all three or none) of one dtype on one device, shaped ``(Hq * D, H)``,
    ``(Hkv * D, H)``, ``(Hkv * D, H)`` with ``D = module.head_dim`` and ``Hq % Hkv == 0``.
    Already fused modules are not.
    """
    return why_not_fusable_qkv(module) is None


def fused_qkv_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                      **kwargs):
    """The attention forward of a fused module (the class :func:`fuse_qkv` switches it to).

    ``LlamaAttention.forward`` / ``MistralAttention.forward`` / ``Qwen2Attention.forward``
    (transformers 5.22.2; the one the module's class computes) with ``q_proj``, ``k_proj`` and
    ``v_proj`` replaced by one ``qkv_proj`` GEMM whose output ``(..., Nq + 2 Nkv)`` is split into
    q, k, v (views; the numbers are those of the three stock GEMMs). Same arguments and result:

    Args:
        hidden_states: ``(B, S, H)``.
        position_embeddings: ``(cos, sin)``, each ``(B, S, D)``, for the module's
            ``apply_rotary_pos_emb``.
        attention_mask: what the model built for its ``attn_implementation``, or None.
        past_key_values: a transformers ``Cache`` (updated in place), or None.
        **kwargs: passed on to the attention interface, as the stock forward does.

    Returns:
        ``(attn_output, attn_weights)``: ``(B, S, H_out)`` in the weights' dtype, and whatever the
        attention interface returns as weights (None for sdpa).
    """
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    query_states, key_states, value_states = stacked_projections(self, hidden_states)
    # v stays a view of the qkv buffer (no copy launch): transformers 5.22.2's caches copy what
    # they are given (DynamicLayer concatenates, StaticLayer copies into its own storage), so no
    # cache keeps the buffer alive. A cache that kept its inputs as they are would hold the
    # (Nq + 2 Nkv) / Nkv times larger buffer: memory, not numbers (test_dynamic_cache_keeps_no_qkv_buffer).
    query_states = query_states.view(hidden_shape).transpose(1, 2)
    key_states = key_states.view(hidden_shape).transpose(1, 2)
    value_states = value_states.view(hidden_shape).transpose(1, 2)
    return _attend(self, self._cutile_qkv_globals, self._cutile_qkv_window, input_shape, query_states, key_states,
                   value_states, position_embeddings, attention_mask, past_key_values, kwargs)


def reproduced_forward(self, glob: dict, window: int, hidden_states, position_embeddings=None, attention_mask=None,
                       past_key_values=None, **kwargs):
    """The stock attention forward of a module whose class :func:`attention_verdict` accepts
    (unfused), as :func:`fused_qkv_forward` reproduces it but with the three projections: the
    same lines, the projections through :func:`._direct.linear` (``F.linear`` on a plain
    ``nn.Linear`` without hooks; the module call otherwise). ``glob`` and ``window`` are
    :func:`stock_forward_parts` of the class and its current forward. Arguments and result as the
    stock forward's."""
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_states = linear(self.q_proj, hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = linear(self.k_proj, hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = linear(self.v_proj, hidden_states).view(hidden_shape).transpose(1, 2)
    return _attend(self, glob, window, input_shape, query_states, key_states, value_states, position_embeddings,
                   attention_mask, past_key_values, kwargs)


@functools.lru_cache(maxsize=None)
def stock_forward_parts(cls: type, forward) -> tuple[dict, int] | None:
    """``(module globals, sliding-window mode)`` when ``forward``, the attention class ``cls``'s
    forward now, is one that :func:`reproduced_forward` reproduces (see :data:`REFERENCES`);
    None for another forward or a fused class. Keyed by the forward too: a class whose forward is
    replaced later (an analysis or KV-compression patch) gets a new verdict, so its forward runs."""
    if getattr(cls, "_cutile_qkv_unfused_class", None) is not None:
        return None
    why, window = _forward_verdict(forward)
    return None if why is not None or window == _OWNED else (forward.__globals__, window)


def _attend(self, glob, window, input_shape, query_states, key_states, value_states, position_embeddings,
            attention_mask, past_key_values, kwargs):
    # The stock forward from RoPE on, its globals read as it reads them.
    cos, sin = position_embeddings
    rope = glob["apply_rotary_pos_emb"]  # a kernels hub function is an nn.Module
    # Passed as the stock forward passes it (a second sliding_window in kwargs raises, as there).
    extra = {} if window == _NO_WINDOW else {"sliding_window": getattr(self.config, "sliding_window", None)
                                             if window == _CONFIG_WINDOW else self.sliding_window}
    # A plain decode-graph step, or a compiled decode step: RoPE, the cache write and the attention in one launch.
    attn_output = rope_attend(self, glob, rope, past_key_values, query_states, key_states, value_states, cos, sin,
                              extra, kwargs, attention_mask)
    if attn_output is not None:
        return linear(self.o_proj, attn_output), None
    # A decode-graph or compiled step: RoPE and the cache write in one launch where the cache layer allows it.
    written = rope_and_cache(self, rope, past_key_values, query_states, key_states, value_states, cos, sin)
    if written is not None:
        query_states, key_states, value_states = written
    else:
        query_states, key_states = (call(rope, query_states, key_states, cos, sin) if isinstance(rope, nn.Module)
                                    else rope(query_states, key_states, cos, sin))

    return attend(self, glob, input_shape, query_states, key_states, value_states, attention_mask, past_key_values,
                  kwargs, extra, cache_written=written is not None)


@functools.lru_cache(maxsize=None)
def fused_class(cls: type) -> type:
    """The subclass of ``cls`` (a class :func:`attention_verdict` accepts) that a fused module is
    switched to: :func:`fused_qkv_forward` as its forward, with the stock forward's module globals
    and ``sliding_window`` mode bound at creation (``isinstance`` checks against ``cls`` hold).

    Raises:
        ValueError: ``cls`` is not accepted by :func:`attention_verdict`.
    """
    why, window = _class_verdict(cls)
    if why is not None:
        raise ValueError(f"{cls.__name__}: {why}")
    forward = _stackable_for(cls.forward).forward if window == _OWNED else fused_qkv_forward
    return type(f"CutileQKV{cls.__name__}", (cls,), {
        "forward": forward,
        "_cutile_qkv_unfused_class": cls,
        "_cutile_qkv_globals": cls.forward.__globals__,
        "_cutile_qkv_window": window,
        "__module__": __name__,
        "__reduce_ex__": functools.partialmethod(reduce_fused, _STACKING),  # pickles via the stock class
        "__doc__": f"{cls.__name__} with q_proj, k_proj and v_proj stacked into {FUSED_NAME} (see layers.qkv).",
    })


def _row_slices(module: nn.Module) -> tuple[slice, slice, slice]:
    q_out, kv_out = module._cutile_qkv_split
    return slice(0, q_out), slice(q_out, q_out + kv_out), slice(q_out + kv_out, q_out + 2 * kv_out)


_STACKING = Stacking(stock=_STOCK, fused=FUSED_NAME, row_slices=_row_slices, fused_class=fused_class,
                     unfused_attr="_cutile_qkv_unfused_class", hooks_attr="_cutile_qkv_hooks", bias=True)


def _fuse_one(module: nn.Module) -> None:
    # The split sizes first: the forward and _row_slices (hence the hooks) read them.
    module._cutile_qkv_split = (module.q_proj.out_features, module.k_proj.out_features)
    fuse_one(module, _STACKING)


def _unfuse_one(module: nn.Module) -> None:
    unfuse_one(module, _STACKING)
    module.__dict__.pop("_cutile_qkv_split", None)


def fuse_qkv(model: nn.Module) -> int:
    """Stack ``q_proj``, ``k_proj`` and ``v_proj`` of every fusable attention module in ``model``
    (in place).

    Each module for which :func:`is_fusable_qkv` holds gets a ``qkv_proj`` ``nn.Linear(H, Nq +
    2 Nkv)`` whose weight is ``cat([q_proj.weight, k_proj.weight, v_proj.weight])`` (bias likewise,
    when they have one), in the weights' dtype and device; the three are removed (their tensors
    are freed once nothing else refers to them; at most one module's set is held twice at a time),
    the split sizes ``(Nq, Nkv)`` are kept as ``_cutile_qkv_split``, and the module's class becomes
    :func:`fused_class` of its class, whose forward is :func:`fused_qkv_forward`. ``state_dict`` and
    ``load_state_dict`` keep the stock keys (module docstring). Works on any device; results equal
    the stock forward's up to the GEMM library's choice of kernel for the wider matrix. Modules
    already fused, or not fusable, are left alone (logged per class with the reason).

    Returns:
        The number of modules fused by this call.
    """
    targets, skipped = [], Counter()
    for m in model.modules():
        why = why_not_fusable_qkv(m)
        if why is None:
            targets.append(m)
        elif why != "already fused" and all(hasattr(m, n) for n in _ATTRS):
            skipped[(type(m).__name__, why)] += 1
    for m in targets:
        _fuse_one(m)
    if targets:
        logger.info("cutile_kernels: stacked q_proj, k_proj and v_proj of %d attention modules (%s)", len(targets),
                    ", ".join(sorted({type(m)._cutile_qkv_unfused_class.__name__ for m in targets})))
    for (cls, why), n in sorted(skipped.items()):
        logger.info("cutile_kernels: left %d %s with separate q/k/v projections: %s", n, cls, why)
    return len(targets)


def unfuse_qkv(model: nn.Module) -> int:
    """Undo :func:`fuse_qkv`: give every fused attention module in ``model`` back its own
    ``q_proj``, ``k_proj`` and ``v_proj`` (copies of the row blocks, after which the stacked
    tensors are freed) and its original class. Returns the number of modules restored."""
    targets = [m for m in model.modules() if getattr(type(m), "_cutile_qkv_unfused_class", None) is not None]
    for m in targets:
        _unfuse_one(m)
    if targets:
        logger.info("cutile_kernels: unstacked q/k/v projections of %d attention modules", len(targets))
    return len(targets)


__all__ = ["FUSED_NAME", "REFERENCES", "STACKABLE", "Stackable", "attention_verdict", "qkv_projections",
           "register_stackable", "stacked_projections", "fuse_qkv", "fused_class", "fused_qkv_forward",
           "reproduced_forward", "stock_forward_parts",
           "is_fusable_qkv", "unfuse_qkv", "why_not_fusable_qkv"]


#: This module's patch row (gathered by ``layers/_registry.py``). Opt-in until the end-to-end bench
#: on the H200 accepts it (cutile+fused_qkv against cutile).
PATCH_ROWS = [Patch("fused_qkv", apply=fuse_qkv, undo=unfuse_qkv,
                    description="q_proj, k_proj and v_proj of each Llama/Mistral/Qwen2 attention (and Qwen3 under qk_norm_rope) as one GEMM",
                    default=False)]
