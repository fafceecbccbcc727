"""Calling a child module's forward without ``nn.Module.__call__`` when the call would run nothing else.

On a GPU machine whose CPU sets the pace of an eager forward, each module call costs the host two
Python frames (``_wrapped_call_impl``, ``_call_impl``) and its checks; a decoder layer makes about
ten. ``nn.Module._call_impl`` (read in torch 2.11 and 2.13) runs exactly ``module.forward(*args)``
when the module has no forward, pre-forward or backward hooks of its own, no global ones are
registered, no JIT trace is recording, and ``module.compile()`` did not install a compiled call.
:func:`call` checks those conditions, and that the module's class calls through
``nn.Module.__call__`` unchanged (no ``__call__`` of its own, no ``torch.fx`` trace), and calls
``forward`` itself; otherwise it makes the module call, so hooks (profilers, transformers' output
capture) always run. Under ``torch.compile``
the module calls stay (dynamo traces through them at no run-time cost), except the down projection
that :func:`glu_linear` and :func:`residual_linear` call without its module call (and the MLP whose
parts ``mlp.residual_forward`` calls), and the attention that patch
``decoder_add_rms_norm`` runs through its reproduction (``patch._traced_parts``; both hookless,
checked while tracing), so that :func:`rope_and_cache` can write a static cache; the helpers
test ``torch.compiler.is_compiling()`` (``_plain_call``: dynamo's alone) before their eager-only
checks, which dynamo would otherwise turn into guards that every compiled call checks on the host.
:func:`linear` does the same for an exact ``nn.Linear``, whose forward is ``F.linear(x, weight, bias)``.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module
from transformers.cache_utils import Cache

from .. import dispatch
from ..ops.activation import gelu_tanh_and_mul_fused, sigmoid_and_mul, silu_and_mul_fused
from ..ops.attention import rope_append_attention, rope_append_attention_takes
from ..ops.qk_norm_rope import qk_norm_rope_gemma
from ..ops.gemv import glu_linear as gemv_glu_linear
from ..ops.gemv import linear as gemv_linear
from ..ops.gemv import linear_residual as gemv_linear_residual
from ..ops.rope import rope_append, rope_append_takes
from ._patching import _unhooked
from .attention import (STEP_PLAIN_MASKS, cache_layer, full_static_layer, static_kv_length, step_plain,
                        takes_masked_decode, takes_plain_decode)
from .decode_graphs import ROPE_ATTEND, ROPE_UPDATE
from .linear import CutileGemvLinear, gemv_linear_forward
from .norm import _float_norm_eps
from .rope import ROPE_FORWARD_MARK, computes_llama_rope

# The registries torch mutates in place (register_module_forward_hook & co.).
_GLOBAL_HOOKS = (_module._global_forward_hooks, _module._global_forward_pre_hooks,
                 _module._global_backward_hooks, _module._global_backward_pre_hooks)
_tracing = torch._C._get_tracing_state
_compiling = torch.compiler.is_compiling
# Dynamo only: a non-strict torch.export also "compiles" but runs this Python with fx's module call,
# whose module stack it records.
_dynamo_compiling = torch.compiler.is_dynamo_compiling
# What a call runs when nobody replaced it: a class with its own __call__ (a checkpointing
# wrapper), torch.fx's symbolic trace (it patches Module.__call__) or code that replaces
# nn.Linear.forward for every Linear must keep being called.
_MODULE_CALL = nn.Module.__call__
_LINEAR_FORWARD = nn.Linear.forward

#: Whether compiled steps write static caches on our kernels (:func:`compiled_static_layer`);
#: ``CUTILE_KERNELS_STOCK_CACHE_WRITES=1`` at import keeps transformers' writes (an A/B switch).
COMPILED_CACHE_WRITES = not dispatch.stock_cache_writes()


def compiled_cache_writes() -> bool:
    """:data:`COMPILED_CACHE_WRITES` (a function: dynamo guards the global it reads as one of this
    module's, where a module object reached from another module costs duplicate-input guards)."""
    return COMPILED_CACHE_WRITES


def _plain_call(m: nn.Module) -> bool:
    # No hooks (its own or global), no compiled call, no JIT trace, nn.Module.__call__ itself.
    g0, g1, g2, g3 = _GLOBAL_HOOKS
    if (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
            or g0 or g1 or g2 or g3):
        return False
    # While dynamo traces, only the hooks decide (it traces a module's __call__ and any compiled call
    # of it; JIT tracing does not run there): the checks below would be guards paid on the host by
    # every compiled call, the class's __call__ most of all (torch 2.11, a 28-layer tiny Qwen3's
    # fused MLP + GEMV: 111 us a guard check with them, 83 without).
    return _dynamo_compiling() or not (m._compiled_call_impl is not None or _tracing()
                                or type(m).__call__ is not _MODULE_CALL)


def direct_ok(m: nn.Module) -> bool:
    """Whether ``m(*args)`` would run exactly ``m.forward(*args)`` (see the module docstring)."""
    # Compiling first: dynamo folds it to a constant and traces none of the checks after it, each of
    # which would add guards that every compiled call evaluates on the host.
    return not _compiling() and _plain_call(m)


def call(m: nn.Module, *args, **kwargs):
    """``m(*args, **kwargs)``, through ``m.forward`` when nothing else would run."""
    if direct_ok(m):
        return m.forward(*args, **kwargs)
    return m(*args, **kwargs)


def linear(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``m(x)`` for a projection child: ``F.linear`` on its weight and bias when ``m`` is exactly
    ``nn.Linear`` (a subclass such as a PEFT, LoRA or quantized layer keeps its own forward), whose
    forward is still torch's (not replaced on the class, nor on the instance as accelerate does),
    and nothing else would run (:func:`direct_ok`); the ``gemv`` patch's class
    (:class:`.linear.CutileGemvLinear`) is called the same way, on the GEMV op."""
    if direct_ok(m):
        if type(m) is nn.Linear and nn.Linear.forward is _LINEAR_FORWARD and "forward" not in m.__dict__:
            return F.linear(x, m.weight, m.bias)
        if _gemv_patched(m):
            return gemv_linear(x, m.weight, m.bias)
    return m(x)


def _gemv_patched(m: nn.Module) -> bool:
    # A module of the gemv patch's class, its forward still ours and not replaced on the instance.
    return type(m) is CutileGemvLinear and CutileGemvLinear.forward is gemv_linear_forward and "forward" not in m.__dict__


def glu_linear(m: nn.Module, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """``m(act_and_mul(x))`` for the down projection ``m`` of a stacked gate/up MLP, ``x (..., 2I)``
    the gate/up output, ``act`` SiLU or (``gelu``) GELU-tanh. Where ``m`` carries patch ``gemv`` and
    nothing else would run on its call (no hooks; also while compiling, where the call is traced
    away), :func:`~..ops.gemv.glu_linear`: one-row steps on the fused activation + GEMV kernel where
    its tile table routes them (none yet), else the two launches. Otherwise our activation kernel,
    then :func:`linear`."""
    if _gemv_patched(m) and _plain_call(m):
        return gemv_glu_linear(x, m.weight, m.bias, gelu)
    return linear(m, (gelu_tanh_and_mul_fused if gelu else silu_and_mul_fused)(x))


def residual_linear(m: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + m(x)`` for a projection child ``m`` whose output a residual add takes (the MLP's
    down projection at the decoder layer's end). Where ``m`` carries patch ``gemv`` and nothing else
    would run on its call (as :func:`glu_linear`), :func:`~..ops.gemv.linear_residual`: a one-row
    compiled or captured step adds in the GEMV's epilogue (one launch, the same bits); otherwise
    :func:`linear`, then the add."""
    if _gemv_patched(m) and _plain_call(m):
        return gemv_linear_residual(x, m.weight, m.bias, residual)
    return residual + linear(m, x)


def gemma_qk_norm_rope(self: nn.Module, query_states: torch.Tensor, key_states: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor):
    """``self.q_norm`` / ``self.k_norm`` (``GemmaRMSNorm``'s formula, checked when patched:
    :func:`~.norm.gemma_qk_norms_verdict`) and RoPE of the first ``cos.shape[-1]`` elements of each
    head, for q ``(B, Hq, S, D)`` and k ``(B, Hk, S, D)``, on one ``qk_norm_rope_gemma`` launch.
    Returns ``(q, k)``, or None when a norm has hooks (the caller runs its stock lines, which fire them)."""
    qn, kn = self.q_norm, self.k_norm
    if not (_unhooked(qn) and _unhooked(kn)):
        return None
    return qk_norm_rope_gemma(query_states, key_states, qn.weight, kn.weight, _float_norm_eps(qn), cos, sin, 1.0)


_CACHE_UPDATE = Cache.update
_OUR_ROPE = "CutileRotaryPosEmb.forward"


def rope_and_cache(self: nn.Module, rope, past_key_values, query_states: torch.Tensor, key_states: torch.Tensor,
                   value_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """RoPE of q and k and the cache update of attention module ``self`` as one ``rope_append``
    launch, where the RoPE is our ``apply_rope`` formula: ``rope``, the ``apply_rotary_pos_emb``
    its forward calls, is the ``kernels`` hub module running our RoPE on Llama's formula (bound by
    ``kernelize``: by name, as it may be the build's copy) with nothing else on its call (no hooks);
    or ``rope`` is None for a reproduced forward that calls :func:`~..ops.rope.apply_rope` itself
    (Phi-3's partial rotary, its formula checked when patched). Two cases take the step: the decode
    graphs armed its cache layer (``decode_graphs.ROPE_UPDATE``: a full-attention static layer they
    write with our kernel, or a sliding one while its window has room; eager steps, captured), or
    dynamo is tracing and the layer is a static cache's full-attention layer
    (:func:`compiled_static_layer`; the write's bound asserted as transformers' ``index_copy_``
    asserts it: :func:`_advance`). Shapes as ``apply_rotary_pos_emb`` and ``Cache.update`` take them.

    Returns ``(q_rot, keys, values)`` (the cache written and advanced), or None: the caller runs
    RoPE and ``past_key_values.update`` as the stock forward does. None for a cache class with an
    ``update`` of its own or an offloaded cache (``Cache.update`` does more than the layer's update
    then), and where the layer declines (``decode_graphs._kernel_rope_update``: its ``update``
    replaced since, a gradient asked for, shapes RoPE's kernel does not take)."""
    armed = _armed(self, rope, past_key_values, ROPE_UPDATE)
    if armed is not None:
        return armed[1](query_states, key_states, value_states, cos, sin)
    if not _dynamo_compiling():  # an eager step (every layer's, on the host path) goes no further
        return None
    layer = compiled_static_layer(self, past_key_values)
    if (layer is None or not _our_rope(rope)
            or not rope_append_takes(query_states, key_states, value_states, cos, sin, layer.keys, layer.values)):
        return None
    q_rot = rope_append(query_states, key_states, value_states, cos, sin, layer.keys, layer.values,
                        layer.cumulative_length)
    _advance(layer, key_states.shape[-2])
    return q_rot, layer.keys, layer.values


def _our_rope(rope) -> bool:
    # None (the forward runs apply_rope itself), or the hub module running our RoPE on Llama's formula
    # with no hooks on its call (verdicts cached: constants while dynamo traces).
    if rope is None:
        return True
    if not isinstance(rope, nn.Module) or not _plain_call(rope):
        return False
    own = rope.__dict__  # spelled as _patching.swapped, which dynamo evaluates as eager Python does
    if "forward" not in own:
        return False
    bound = own["forward"]
    if not isinstance(bound, types.MethodType):
        return False
    # The mark, or in eager the name (a build made before the mark kept its fused paths).
    ours = getattr(bound.__func__, ROPE_FORWARD_MARK, False) or (
        not _dynamo_compiling() and getattr(bound.__func__, "__qualname__", None) == _OUR_ROPE)
    return ours and computes_llama_rope(type(rope))


def _armed(self: nn.Module, rope, past_key_values, attr: str):
    # (cache layer, step): the one-launch step `attr` (ROPE_UPDATE, ROPE_ATTEND) that the decode graphs
    # gave the cache layer of attention module `self`, where rope_and_cache's conditions hold; else None.
    if (_compiling() or past_key_values is None or type(past_key_values).update is not _CACHE_UPDATE
            or getattr(past_key_values, "offloading", False)):
        return None
    layer = cache_layer(self, past_key_values)
    step = None if layer is None else layer.__dict__.get(attr)
    if step is None or not _our_rope(rope):
        return None
    return layer, step


def compiled_static_layer(self: nn.Module, past_key_values):
    """While dynamo traces (``torch.compile``), the layer of ``past_key_values`` that attention
    module ``self`` writes when it is exactly transformers' ``StaticLayer`` (while its ``update`` is
    the pinned one, :data:`.attention.PIN`, known once our attention registered), initialized,
    with the class's ``update`` (not one the decode graphs gave it), in a cache whose ``update`` is
    ``Cache.update`` and which does not offload; else None (also outside dynamo, whose tests here
    are constants or guards of the compiled step). Its writes may then go to our kernels with the
    RoPE before them (:func:`rope_and_cache`); a write alone stays transformers' (on an H100 one
    ``kv_append`` took 2.9 us where inductor's two ``index_copy_`` kernels took 2.2: Qwen3-0.6B's
    compiled step lost 20 us of kernel time, 2026-12-06)."""
    if (not COMPILED_CACHE_WRITES or not _dynamo_compiling() or past_key_values is None
            or type(past_key_values).update is not _CACHE_UPDATE or getattr(past_key_values, "offloading", False)):
        return None
    layer = full_static_layer(self, past_key_values)
    if layer is None or "update" in layer.__dict__ or not layer.is_initialized:
        return None
    return layer


def _advance(layer, new: int) -> None:
    # StaticLayer.update's advance of the filled length by the `new` rows just written. Its
    # index_copy_ asserts on the device when a row's slot is past the cache's end (inductor compiles
    # that bound check into the write's kernel); ours skip such slots, so the step asserts the same
    # bound here, which inductor fuses into the advance's kernel (no launch of its own).
    torch._assert_async(layer.cumulative_length <= layer.keys.shape[2] - new,
                        "cutile_kernels: a static KV cache write past the cache's end (max_cache_len)")
    layer.cumulative_length.add_(new)


def rope_attend(self: nn.Module, glob: dict, rope, past_key_values, query_states: torch.Tensor,
                key_states: torch.Tensor, value_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                window: dict, kwargs: dict, attention_mask=None) -> torch.Tensor | None:
    """RoPE, the cache update and the attention of attention module ``self`` as one
    ``rope_append_attention`` launch, for a decode step of the decode graphs whose masks are an
    unpadded batch's (``decode_graphs.ROPE_ATTEND`` armed on the module's cache layer and
    :data:`~.attention.STEP_PLAIN_MASKS` on it): where :func:`rope_and_cache` would take the step,
    and the attention function the config names (``glob``, as the forward reads it) is ours and
    would attend the step on our kernel without its mask (:func:`.attention.takes_plain_decode`).
    A compiled decode step takes it with its ``attention_mask`` (:func:`compiled_rope_attend`).
    ``window`` is the ``sliding_window`` keyword as the stock forward passes it. Shapes as
    :func:`rope_and_cache` takes them, one position.

    Returns the attention output ``(B, 1, Hq * D)`` (before ``o_proj``), or None: the caller runs
    :func:`rope_and_cache` and :func:`attend` (the same numbers in three launches)."""
    armed = _armed(self, rope, past_key_values, ROPE_ATTEND)
    if armed is None:  # switch and tracing read here first: an eager step's layers make no further call
        return None if not (COMPILED_ROPE_ATTEND and _dynamo_compiling()) else compiled_rope_attend(
            self, glob, rope, past_key_values, query_states, key_states, value_states, cos, sin, window, kwargs,
            attention_mask)
    if not armed[0].__dict__.get(STEP_PLAIN_MASKS) or query_states.shape[2] != 1:
        return None
    step = armed[1]
    forward = glob["ALL_ATTENTION_FUNCTIONS"].get_interface(self.config._attn_implementation,
                                                              glob["eager_attention_forward"])
    if not takes_plain_decode(forward, self, query_states, kwargs):
        return None
    out = step(query_states, key_states, value_states, cos, sin, self.scaling, window.get("sliding_window"))
    return None if out is None else out.transpose(1, 2).reshape(query_states.shape[0], 1, -1)


#: Compiled decode steps run RoPE, the static cache write and the attention as one
#: ``rope_append_attention`` launch that reads the step's boolean mask (:func:`compiled_rope_attend`);
#: off: ``rope_append`` then the attention kernel with the mask (two launches). Estimate before the
#: A/B (H100, Llama-3.2-1B's compiled b=1 step, 2026-12-07e profile): the two took about 15 us a layer
#: against the decode graphs' one launch's 6.5, f ~0.13 of the step, s ~1.5-2, ceiling ~1.05-1.07x.
#: On since 2026-12-07 (H100, Llama-3.2-1B's compiled step, on and off alternating in one process:
#: 2.271 against 2.313 ms at batch 1, 2.533 against 2.557 at batch 16; docs/results.md).
COMPILED_ROPE_ATTEND = True


def compiled_rope_attend(self: nn.Module, glob: dict, rope, past_key_values, query_states: torch.Tensor,
                         key_states: torch.Tensor, value_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         window: dict, kwargs: dict, attention_mask) -> torch.Tensor | None:
    """While dynamo traces a decode step (one position) over a static cache layer that
    :func:`rope_and_cache` would write (:func:`compiled_static_layer`, our RoPE), and the attention
    function the config names is ours and would give the step to our kernel with this mask
    (:func:`.attention.takes_masked_decode`): RoPE, the cache write, the attention over the filled
    slots as the mask shows them (a padded batch's too; without a mask, causal over them and the
    window) and the cache's advance, as ``rope_append_attention`` with ``mask`` (one launch, then
    :func:`_advance`). Arguments as :func:`rope_attend`'s. Returns the attention output ``(B, 1, Hq
    * D)``, or None (also with :data:`COMPILED_ROPE_ATTEND` off): the caller's two launches
    (``rope_append``, then the attention)."""
    if not COMPILED_ROPE_ATTEND or not _dynamo_compiling() or query_states.shape[2] != 1:
        return None
    layer = compiled_static_layer(self, past_key_values)
    if layer is None or not _our_rope(rope):
        return None
    forward = glob["ALL_ATTENTION_FUNCTIONS"].get_interface(self.config._attn_implementation,
                                                              glob["eager_attention_forward"])
    if (not takes_masked_decode(forward, self, query_states, layer.keys, attention_mask, kwargs)
            or not rope_append_attention_takes(query_states, key_states, value_states, cos, sin, layer.keys,
                                               layer.values, attention_mask)):
        return None
    # With a mask the mask alone decides (as the attention op with one): no window of its own.
    out = rope_append_attention(query_states, key_states, value_states, cos, sin, layer.keys, layer.values,
                                layer.cumulative_length, scale=self.scaling, mask=attention_mask,
                                window=window.get("sliding_window") if attention_mask is None else None)
    _advance(layer, 1)
    return out.transpose(1, 2).reshape(query_states.shape[0], 1, -1)


def attend(self: nn.Module, glob: dict, input_shape, query_states: torch.Tensor, key_states: torch.Tensor,
           value_states: torch.Tensor, attention_mask, past_key_values, kwargs: dict, window: dict,
           gate: torch.Tensor | None = None, cache_written: bool = False):
    """The tail of transformers' Llama-style attention forward after RoPE, as the reproduced forwards
    (``qkv``, ``qwen3``, ``phi3``, ``qwen3_5``) run it: the KV cache update, the attention function
    the config names (``glob``: the class's modeling module, read as its forward reads it), then
    ``o_proj`` through :func:`linear`. ``window`` is the ``sliding_window`` keyword as the stock
    forward passes it (``{}`` where it passes none). ``gate`` ``(B, S, heads, head_dim)`` (any
    strides whose rows collapse, e.g. the gate half of each head of Qwen3.5's q projection) or
    ``(B, S, heads * head_dim)``: the output gate of gated attention (Qwen3.5's ``attn_output *
    torch.sigmoid(gate)`` before ``o_proj``), on the ``sigmoid_and_mul`` kernel. With our
    attention over a static cache layer, the layer's filled length goes along
    (:func:`.attention.static_kv_length`), and in a decode-graph step whose masks are an unpadded
    batch's, word that the kernel may attend without the mask (:func:`.attention.step_plain`).
    ``cache_written``: ``key_states`` / ``value_states`` are already the cache layer's tensors,
    updated (:func:`rope_and_cache`). Returns ``(attn_output (B,
    S, hidden), attn_weights)``."""
    # Read once: each read of a config attribute adds guards that a compiled step checks on the host.
    implementation = self.config._attn_implementation
    length = {}
    if past_key_values is not None:
        if not cache_written:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
        layer = cache_layer(self, past_key_values)
        length = static_kv_length(layer, implementation)
        length.update(step_plain(layer, length))

    attention_interface = glob["ALL_ATTENTION_FUNCTIONS"].get_interface(implementation, glob["eager_attention_forward"])
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **window, **kwargs,
        **length,
    )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    if gate is not None:  # one sigmoid_and_mul launch, the gate read in place
        attn_output = sigmoid_and_mul(gate, attn_output.view(gate.shape)).view(*input_shape, -1)
    return linear(self.o_proj, attn_output), attn_weights
