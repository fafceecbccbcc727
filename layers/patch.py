"""Patch ``decoder_add_rms_norm``: the decoder layers' residual adds fused into the RMSNorms that
follow them (see :func:`fuse_decoder_layers`), and the patch API.

The mechanism (``Patch``, the registry, :func:`patch` / :func:`unpatch`, the save wrapper) lives in
``layers/_patching.py``; each feature module declares its patches (``PATCH_ROWS``) and
``layers/_registry.py`` gathers them in apply order: ``decoder_add_rms_norm`` (here),
``fused_gate_up`` (``mlp.py``), ``rope_cos_sin`` (``rope_cos_sin.py``), ``dynamic_cache_prefill``
(``kv_cache.py``), ``cutile_attention`` (``models/__init__.py``), the families' own
(``models/``), ``fused_qkv`` (``qkv.py``), the float-order norms (``norm.py``), ``gemv`` (``linear.py``,
applied again after any later change: ``Patch.follows``). This module re-exports the API
(``cutile_kernels.patch`` is :func:`patch`), so ``cutile_kernels.layers.patch`` keeps working.
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import sys
import textwrap
import typing

import torch
from torch import nn

from ..ops.norm import add_rms_norm, rms_norm
from ._direct import _dynamo_compiling, _plain_call, call, compiled_cache_writes, direct_ok
from ._patching import (PATCHES, TRANSPARENT_HOOK, Patch, PatchReport, _blocking, _unhooked, applied, patch,
                        register, restore_forwards, swap_forwards, swapped, unpatch)
from ._pins import forward_verdict
from .mlp import residual_forward
from .norm import is_llama_norm
from .qkv import reproduced_forward, stock_forward_parts

logger = logging.getLogger("cutile_kernels")


# ---------------------------------------------------------------------------------------------
# decoder_add_rms_norm: residual add + RMSNorm in Llama-style decoder layers
# ---------------------------------------------------------------------------------------------

#: The pin (``layers/_pins.py``) of the forward :func:`_fused_decoder_forward` computes (pre-norm
#: attention and MLP blocks, each added back to the residual stream). Another transformers
#: version's forward must be re-read before it is fused.
DECODER_PIN = "llama.LlamaDecoderLayer.forward"

_FORWARD_ATTRS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


class _Loop:
    """Where a verified decoder loop runs (see :func:`loop_verdict`): the code object of its owner's
    ``forward`` and the absolute line span of the loop. A layer whose caller's frame runs that code
    on a line of that span is being called by the loop itself: frames are per thread and per call,
    so an interrupted forward, another thread, or a loop of the user's own never qualifies."""

    __slots__ = ("code", "first", "last")

    def __init__(self, code, first: int, last: int):
        self.code, self.first, self.last = code, first, last


#: How many frames up from the check the owner's loop may be: the check's callers in this module,
#: then Module._call_impl, _wrapped_call_impl and GradientCheckpointingLayer.__call__ (5.22.2).
_MAX_FRAMES = 10


def _in_loop(loop: "_Loop | None") -> bool:
    """Whether the decoder forward that called this is being called from ``loop``'s line span."""
    if loop is None:
        return False
    f = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if f is None:
            return False
        if f.f_code is loop.code:
            return loop.first <= f.f_lineno <= loop.last
        f = f.f_back
    return False


class _Inbox:
    """The normed input one layer leaves for the next: ``pending = (s, rms_norm(s), version)``,
    where ``s`` is the tensor the first layer returned and ``version`` its version counter then
    (None for inference tensors, which have none: then both layers must be called from the verified
    loop, see :func:`_may_hand_off`).
    The next layer uses it only if it is called with exactly ``s`` (the same object), unchanged
    since, so anything in between that replaces or edits the hidden states in place is safe.
    ``layer`` is that next layer; ``loop`` the :class:`_Loop` of the loop that calls both, or None
    when the owner's loop is not verified."""

    __slots__ = ("norm", "pending", "layer", "loop")

    def __init__(self, norm: nn.Module, layer: nn.Module, loop: "_Loop | None"):
        self.norm = norm
        self.pending = None
        self.layer = layer
        self.loop = loop


def _loop_call(node: ast.For, attr: str) -> ast.Call | None:
    """The call of ``for layer in self.<attr>...: x = layer(x, ...)`` (or ``for i, layer in
    enumerate(...)``), or None when the loop body is anything more."""
    if not any(isinstance(n, ast.Attribute) and n.attr == attr and isinstance(n.value, ast.Name)
               and n.value.id == "self" for n in ast.walk(node.iter)):
        return None
    target = node.target
    if isinstance(target, ast.Tuple) and len(target.elts) == 2:
        target = target.elts[1]
    if not isinstance(target, ast.Name) or node.orelse or len(node.body) != 1:
        return None
    stmt = node.body[0]
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None
    call = stmt.value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == target.id
            and call.args and isinstance(call.args[0], ast.Name) and call.args[0].id == stmt.targets[0].id):
        return None
    # The other arguments are evaluated between the layers: no call among them (only names,
    # attributes, subscripts), so nothing there can touch the hidden states.
    rest = call.args[1:] + [k.value for k in call.keywords]
    if any(isinstance(n, ast.Call) for a in rest for n in ast.walk(a)):
        return None
    return call


@functools.lru_cache(maxsize=None)
def _loop_span(cls: type, attr: str) -> tuple[str | None, "_Loop | None"]:
    # (why not, None) or (None, the loop's _Loop); once per class.
    try:
        fn = inspect.unwrap(cls.forward)
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        code = fn.__code__
    except (OSError, TypeError, SyntaxError, AttributeError):
        return "its forward's source cannot be read", None
    loops = [n for n in ast.walk(tree) if isinstance(n, ast.For)
             and any(isinstance(a, ast.Attribute) and a.attr == attr for a in ast.walk(n.iter))]
    if len(loops) != 1:
        return f"its forward has {len(loops)} loops over self.{attr}, not one", None
    node = loops[0]
    if not (tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef))
            and any(stmt is node for stmt in tree.body[0].body)):
        return f"its loop over self.{attr} is nested in another statement", None
    if _loop_call(node, attr) is None:
        return f"its loop over self.{attr} does more than call each layer on the previous one's output", None
    # Line 1 of the source is the code's first line (the first decorator's, if any).
    return None, _Loop(code, code.co_firstlineno + node.lineno - 1, code.co_firstlineno + node.end_lineno - 1)


def loop_verdict(cls: type, attr: str) -> str | None:
    """Why the decoder loop of ``cls.forward`` over ``self.<attr>`` is not verified, or None if it is.

    Verified means the forward's source (decorators unwrapped) has exactly one ``for`` statement
    over ``self.<attr>``, at the top level of the function, and its body is only ``hidden =
    layer(hidden, <names, attributes or subscripts>)``: from one layer returning to the next being
    called inside that loop, no code of the model can edit the hidden states in place. Llama,
    Mistral, Qwen2 and Qwen3 (5.22.2) loop that way. (An attribute or subscript could still run a
    property or ``__getitem__`` of the model's own; the classes checked here use plain ones.)
    """
    return _loop_span(cls, attr)[0]


#: Decoder-layer forwards other than Llama's whose math :func:`_fused_decoder_forward` computes on
#: the layers their check accepts: pin name -> (a function returning the transformers forward, a
#: check of a layer giving why it may not take the fused forward or None, the name of the layer
#: attribute each block's output is multiplied by before its residual add or None). Family modules
#: add theirs with :func:`register_llama_like_decoder` (Phi-3's: Llama's blocks with a residual
#: dropout after each, the identity at p = 0; Granite's: each block's output times
#: ``residual_multiplier``).
LLAMA_LIKE_DECODERS: dict = {}


def register_llama_like_decoder(pin: str, reference, check, branch_scale: str | None = None) -> None:
    """Let patch ``decoder_add_rms_norm`` fuse layers whose forward is pinned ``pin``'s code
    (``reference()`` returns the transformers function) and that ``check(layer)`` accepts (None;
    ``check`` may be None): a forward that computes ``LlamaDecoderLayer.forward``'s math on such
    layers, with each block's output multiplied by ``getattr(layer, branch_scale)`` before its
    residual add where ``branch_scale`` is given (``residual + block(x) * layer.residual_multiplier``,
    Granite's). A family module registers it at import, before any verdict is asked."""
    LLAMA_LIKE_DECODERS[pin] = (reference, check, branch_scale)
    _decoder_match.cache_clear()


@functools.lru_cache(maxsize=None)
def _decoder_match(cls: type) -> tuple:
    # (why cls's forward is none of the fused forward's, the matched Llama-like forward's layer
    # check or None, its branch-scale attribute or None; both None for Llama's own).
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    why = forward_verdict(cls, DECODER_PIN, LlamaDecoderLayer.forward)
    if why is None:
        return None, None, None
    for pin, (reference, check, branch_scale) in LLAMA_LIKE_DECODERS.items():
        if forward_verdict(cls, pin, reference()) is None:
            return None, check, branch_scale
    return why, None, None


def decoder_verdict(cls: type) -> str | None:
    """Why ``cls`` (a decoder layer class) cannot take the fused forward, or None if it can:
    its ``forward`` must be ``LlamaDecoderLayer.forward``'s code, and that must still be the
    pinned forward (:data:`DECODER_PIN`), or the code of a pinned forward registered as computing
    the same math (:data:`LLAMA_LIKE_DECODERS`; its layer check is asked per layer)."""
    return _decoder_match(cls)[0]


def _fused_decoder_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                           use_cache=False, position_embeddings=None, **kwargs):
    """``LlamaDecoderLayer.forward`` (5.22.2) with the attention block's residual add fused into
    ``post_attention_layernorm`` and, when the next layer waits for it, the MLP block's residual
    add fused into the next layer's ``input_layernorm``, else (a compiled step, the last layer) into
    the MLP's down projection where ``ops.gemv.RESIDUAL_TILES`` routes it (``mlp.residual_forward``); for a
    registered forward with a branch scale (Granite's), each block's output multiplied by it first,
    as that forward does. Same arguments and result."""
    # Under torch.compile nothing is handed across layers (_may_hand_off), so nothing is read for it:
    # each attribute a traced forward reads is a guard that every compiled call checks on the host.
    compiling = _dynamo_compiling()
    inbox = None if compiling else self._cutile_inbox
    handed = None
    if inbox is not None:
        handed, inbox.pending = inbox.pending, None
    check = self._cutile_check
    if check is not None and check(self) is not None:
        # A Llama-like layer whose check no longer holds (e.g. Phi-3's residual dropout turned on or
        # hooked since): its own forward, which normalises its input itself and hands nothing on.
        return type(self).forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                  past_key_values=past_key_values, use_cache=use_cache,
                                  position_embeddings=position_embeddings, **kwargs)
    residual = hidden_states
    # Only exactly the tensor the previous layer returned, unchanged since, may skip this norm, and
    # only for the norm it was computed with: an in-place edit between the layers bumps the version
    # counter; inference tensors have none (version None), so both layers must be called by the
    # owner's verified loop, with nothing of the model's code between them (_may_hand_off).
    if (handed is not None and handed[0] is hidden_states and inbox.norm is self.input_layernorm
            and (hidden_states._version == handed[2] if handed[2] is not None else _in_loop(inbox.loop))):
        hidden_states = handed[1]
    elif compiling and type(self.input_layernorm) is self._cutile_input_norm and _unhooked(self.input_layernorm):
        # The norm's op without its module call (whose instance-bound forward, kernels' hub layer,
        # would add guards on its function and __self__): a Llama-formula RMSNorm, checked at patch time
        # (a forward replaced on the instance since is seen where accelerate marks it: _unhooked).
        norm = self.input_layernorm
        hidden_states = rms_norm(hidden_states, norm.weight, norm.variance_epsilon)
    else:
        hidden_states = self.input_layernorm(hidden_states)
    scale = self._cutile_scale  # a branch-scale attribute's name (Granite's residual_multiplier), or None
    attn = self.self_attn
    # The attention and MLP forwards without the module calls when no hook would run (_direct); a
    # stock attention of a verified class through its reproduction, whose projections skip theirs
    # (under dynamo too, so that a compiled step writes a static cache on our kernels: _traced_parts).
    cls = type(attn)
    parts = None
    if "forward" not in attn.__dict__:
        parts = stock_forward_parts(cls, cls.forward) if direct_ok(attn) else _traced_parts(self, attn)
    if parts is not None:
        hidden_states, _ = reproduced_forward(attn, *parts, hidden_states=hidden_states, attention_mask=attention_mask,
                                              position_ids=position_ids, past_key_values=past_key_values,
                                              use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    else:
        hidden_states, _ = call(attn, hidden_states=hidden_states, attention_mask=attention_mask,
                                position_ids=position_ids, past_key_values=past_key_values,
                                use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    if scale is not None:  # the stock forward's `residual + hidden_states * m`: the product first
        hidden_states = hidden_states * getattr(self, scale)
    post = self.post_attention_layernorm
    if _unhooked(post):
        hidden_states, residual = add_rms_norm(hidden_states, residual, post.weight, post.variance_epsilon)
    else:
        residual = residual + hidden_states
        hidden_states = post(residual)
    nxt = None if compiling else self._cutile_next
    if nxt is None and scale is None:
        # Nothing handed on (a compiled step, the last layer): the add in the down projection's GEMV
        # where a one-row compiled or captured step runs it (a stacked-gate/up MLP of ours).
        out = residual_forward(self.mlp, hidden_states, residual)
        if out is not None:
            return out
    hidden_states = call(self.mlp, hidden_states)
    if scale is not None:
        hidden_states = hidden_states * getattr(self, scale)
    if nxt is not None and _may_hand_off(self, nxt, hidden_states):
        normed, out = add_rms_norm(hidden_states, residual, nxt.norm.weight, nxt.norm.variance_epsilon)
        nxt.pending = (out, normed, None if torch.is_inference_mode_enabled() else out._version)
        return out
    return residual + hidden_states


def _traced_parts(layer: nn.Module, attn: nn.Module) -> tuple[dict, int] | None:
    """While dynamo traces: the reproduced attention forward's ``(globals, window)`` for ``attn`` as
    :func:`_prepare_decoder` found them, where ``attn`` has no hooks and its class's forward is still
    the one found; else None (the module call). The globals are reached through ``sys.modules``, as
    dynamo guards a global (:func:`~._patching.modeling_globals`), so that the compiled step writes its
    static cache on our kernels (``_direct.rope_and_cache``) where the stock forward would not."""
    found = layer._cutile_attn_parts
    if (found is None or not compiled_cache_writes() or not _dynamo_compiling() or not _plain_call(attn)
            or type(attn).forward is not found.forward):
        return None
    module = sys.modules.get(found.module)
    return None if module is None else (module.__dict__, found.window)


class _AttentionParts(typing.NamedTuple):
    """What :func:`_traced_parts` needs of a decoder layer's attention, found at patch time."""

    forward: typing.Callable  # the attention class's forward then
    module: str  # the name of its modeling module, whose globals the reproduction reads
    window: int  # qkv.stock_forward_parts's sliding-window mode


def _attention_parts(layer: nn.Module) -> _AttentionParts | None:
    # Where the reproduced forward reproduces the layer's attention (qkv.stock_forward_parts) and its
    # modeling module's globals are the forward's.
    attn = getattr(layer, "self_attn", None)
    if not isinstance(attn, nn.Module):
        return None
    forward = type(attn).forward
    parts = stock_forward_parts(type(attn), forward)
    name = getattr(forward, "__module__", None)
    module = sys.modules.get(name) if isinstance(name, str) else None
    if parts is None or module is None or module.__dict__ is not parts[0]:
        return None
    return _AttentionParts(forward, name, parts[1])


def _may_hand_off(layer: nn.Module, nxt: _Inbox, hidden_states: torch.Tensor) -> bool:
    """Whether ``layer`` may leave the next layer its normed input (see :class:`_Inbox`)."""
    # Not under torch.compile: dynamo cannot read version counters, and a layer compiled on its own
    # returns to eager code that could edit its output in place unseen.
    if (torch.compiler.is_compiling() or layer.training and getattr(layer, "gradient_checkpointing", False)
            or nxt.norm.weight.device != hidden_states.device or not _unhooked(nxt.norm)):
        return False
    if not torch.is_inference_mode_enabled():
        return True
    # Inference tensors keep no version counter, so the next layer could not see an in-place edit
    # of this one's output: hand off only when the owner's verified loop calls this layer (the
    # next one checks the same for itself) and no hook sits between the two layers (this one's
    # forward hooks, the next one's pre-hooks; global hooks are checked with the norm's).
    return (not _blocking(layer._forward_hooks) and not _blocking(nxt.layer._forward_pre_hooks)
            and _in_loop(nxt.loop))


def _is_fused(layer: nn.Module) -> bool:
    return swapped(layer, _fused_decoder_forward)


def _decoder_verdict(m: nn.Module) -> str | None:
    why, check, _ = _decoder_match(type(m))
    if why is None and check is not None:
        why = check(m)
    if why is None and not is_llama_norm(m.post_attention_layernorm):
        why = "its post_attention_layernorm is not a Llama-formula RMSNorm"
    return why


def _prepare_decoder(m: nn.Module) -> None:
    m.__dict__["_cutile_inbox"] = None
    m.__dict__["_cutile_next"] = None
    # A Llama-like forward's layer check, asked again at every call (what it reads, a dropout's p
    # or hooks, may change after patching); None for Llama's own forward.
    m.__dict__["_cutile_check"] = _decoder_match(type(m))[1]
    m.__dict__["_cutile_scale"] = _decoder_match(type(m))[2]
    m.__dict__["_cutile_attn_parts"] = _attention_parts(m)
    # The input norm's class when it is a Llama-formula RMSNorm (its op may then run in its place under
    # torch.compile, where a module of another class put there later is called as a module).
    m.__dict__["_cutile_input_norm"] = type(m.input_layernorm) if is_llama_norm(m.input_layernorm) else None


def fuse_decoder_layers(model: nn.Module) -> int:
    """Patch ``decoder_add_rms_norm``: fuse the decoder layers' residual adds into their RMSNorms.

    A stock Llama-style layer computes ``h = x + attn(norm1(x)); out = h + mlp(norm2(h))`` and
    the next layer starts with its own ``norm1(out)``. Patched layers (instance ``forward``
    replaced) compute ``norm2(x + a)`` and ``x + a`` in one ``add_rms_norm`` (in-layer), and
    ``next.norm1(h + m)`` and ``h + m`` in one more, handing the normed tensor to the next layer
    (cross-layer), which uses it only when called with exactly the tensor this layer returned.
    Results equal the stock ones: each sum is rounded once to the activation dtype, as the stock
    add rounds it, and the norm is the stock formula.

    Applies to layers whose class's forward is ``LlamaDecoderLayer.forward``'s code (Llama,
    Mistral, Qwen2, Qwen3 and ~60 more in 5.22.2; see :func:`decoder_verdict`) or a registered
    forward of the same math on the layers its check accepts (Phi-3's with its residual dropouts at
    p = 0: ``layers/models/phi3.py``; Granite's, each block's output times ``residual_multiplier``
    before the fused add: ``layers/models/granite.py``), whose
    ``post_attention_layernorm`` is a Llama-formula RMSNorm, and whose forward nobody else has
    replaced (e.g. accelerate's device hooks). Cross-layer handoff links consecutive patched layers
    of one ``ModuleList`` whose next ``input_layernorm`` is a Llama-formula RMSNorm; it is skipped
    at run time under gradient checkpointing, across devices, and when that norm has hooks. Under
    ``torch.inference_mode`` (no version counters) it runs only when both layers are called from
    the verified loop of the module that owns the list (:func:`loop_verdict`; checked on the
    calling frames) and no hook sits between them; under ``torch.compile`` it does not run. The
    last layer's final add stays a plain add (the model's final norm is not a decoder layer).
    Layers of other classes are left alone, with a log line per class.

    Returns:
        The number of layers newly patched.
    """
    new = swap_forwards(model, "decoder_add_rms_norm", _fused_decoder_forward,
                        lambda m: all(hasattr(m, a) for a in _FORWARD_ATTRS), _decoder_verdict,
                        "residual add fused into post_attention_layernorm in {n} {cls}", prepare=_prepare_decoder)
    links = _link_layers(model)
    if new:
        logger.info("cutile_kernels: patch decoder_add_rms_norm: residual add fused into the next "
                    "layer's input_layernorm across %d layer pairs", links)
    return sum(new.values())


def _loop_of(owner: nn.Module | None, attr: str) -> _Loop | None:
    # Where the owner's verified loop runs; None (with a log line) when it is not verified.
    if owner is None:
        return None
    why, loop = _loop_span(type(owner), attr)
    if why is not None:
        logger.info("cutile_kernels: patch decoder_add_rms_norm: no cross-layer handoff under inference_mode "
                    "in %s: %s", type(owner).__name__, why)
    return loop


def _link_layers(model: nn.Module) -> int:
    # (Re)link consecutive fused layers of every ModuleList for the cross-layer handoff.
    links = 0
    modules = dict(model.named_modules())
    for name, seq in modules.items():
        if not isinstance(seq, nn.ModuleList):
            continue
        parent, _, attr = name.rpartition(".")
        owner = modules.get(parent) if name else None
        layers = list(seq)
        for a, b in zip(layers, layers[1:]):
            if _is_fused(a) and _is_fused(b) and is_llama_norm(b.input_layernorm):
                inbox = b.__dict__["_cutile_inbox"]
                if inbox is None or inbox.norm is not b.input_layernorm:
                    inbox = _Inbox(b.input_layernorm, b, _loop_of(owner, attr))
                    b.__dict__["_cutile_inbox"] = inbox
                a.__dict__["_cutile_next"] = inbox
                links += 1
    return links


def unfuse_decoder_layers(model: nn.Module) -> int:
    """Undo :func:`fuse_decoder_layers`: restore the class forward of every patched layer.

    Returns:
        The number of layers restored.
    """
    return restore_forwards(model, "decoder_add_rms_norm", _fused_decoder_forward,
                            attrs=("_cutile_inbox", "_cutile_next", "_cutile_check", "_cutile_scale",
                                   "_cutile_attn_parts", "_cutile_input_norm"), noun="layers")


#: This module's patch row (gathered by ``layers/_registry.py``).
PATCH_ROWS = [Patch("decoder_add_rms_norm", apply=fuse_decoder_layers, undo=unfuse_decoder_layers,
                    description="residual add + RMSNorm fused in Llama-style decoder layers, within and across layers")]

__all__ = ["PATCHES", "TRANSPARENT_HOOK", "Patch", "PatchReport", "applied", "decoder_verdict", "fuse_decoder_layers",
           "loop_verdict", "patch", "register", "register_llama_like_decoder", "restore_forwards", "swap_forwards",
           "swapped", "unfuse_decoder_layers", "unpatch"]
