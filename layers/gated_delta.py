"""Gated DeltaNet's functions as hub layers: the gated delta rule (chunked and recurrent) and the
causal conv1d (sequence and one-token update), the block itself (its gates on one launch), and their
mapping rows.

transformers 5.22.2 decorates four functions of the Qwen3.5 modeling code (and its copies:
Qwen3.5-MoE, Qwen3-Next, ...) with ``@use_kernel_func_from_hub_with_fallback(name, package)``:
``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule`` (package flash-linear-attention),
``causal_conv1d_fn`` and ``causal_conv1d_update`` (package causal-conv1d). As for
``rotary_pos_emb`` (``layers/rope.py``), ``kernels`` makes each an ``nn.Module`` instance listed in
the gated DeltaNet module's ``_kernel_funcs``; ``kernelize`` rebinds its ``forward`` to ours. Our
forward runs the cuTile op when the call is one the kernels compute (CUDA tensors of the dtypes and
sizes they are built for, q/k normalised in the kernel, no packed sequences, SiLU and no bias for
the convolution; ``ops.*.unsupported``) and the wrapped function is Qwen3.5's code (pinned,
``layers/models/qwen3_5.py``); any other call takes the function's own path (transformers' torch
code, or the package's when installed), said once per reason. Where transformers resolved a
prefill function (the chunked delta rule, the conv1d) to flash-linear-attention or causal-conv1d,
every call of it keeps that package (:func:`runs_its_package`): no log, nothing falls back.

The swap is process-wide: each decorated function is one module instance shared by every model of
its modeling code, so kernelizing one model changes the others (as for ``rotary_pos_emb``). Other
modeling modules' copies of these functions are taken where they compile to the same code
(transformers 5.22: the delta rules of Qwen3.5-MoE, Qwen3-Next and OLMo-hybrid; the conv functions
of about twenty Mamba-style models); their calls with other arguments (a bias, another activation)
keep their own path.

The block, hub name ``Qwen3_5GatedDeltaNet`` (:class:`CutileGatedDeltaNet`), is the pinned stock
forward with its two gate lines on one ``gated_delta_gates`` launch; it calls the functions above
through the module's ``_kernel_funcs``.

State handling: the hub layers, like transformers' functions, leave ``initial_state`` alone and
return a new final state. The block layer asks the recurrent one (when kernelize bound ours) to
update the cache's buffer in place and return it (the cache then copies it onto itself: a no-op),
so that a CUDA-graph replay of a decode step reads and writes one buffer.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from .. import dispatch
from ..ops import conv1d as conv_ops
from ..ops import gated_delta as delta_ops
from ..ops.conv1d import causal_conv1d, causal_conv1d_update
from ..ops.gated_delta import gated_delta_gates, gated_delta_rule
from ._direct import linear
from ._match import class_verdict, same_code
from ._pins import holds
from .rope import function_name, wrapped_function


@class_verdict
def runs_its_package(cls: type) -> bool:
    """True if transformers resolved the hub function the ``Func`` class ``cls`` wraps to its
    package's implementation (``use_kernel_func_from_hub_with_fallback``: flash-linear-attention or
    causal-conv1d, imported with the modeling module) rather than to its torch code. Our prefill
    layers then leave it the call: on the H200 (2026-12-02) fla's chunked delta rule took 0.11 ms of
    GPU time (0.69 ms eager) for a 1x2048 Qwen3.5 layer against our 0.98 ms (1.0 ms eager);
    causal-conv1d's kernel has not been timed against ours. Read from transformers' own choice (its
    wrapper's ``is_new_implementation``), so that a package that is present but does not import
    never sends a call to the torch code. Once per class."""
    try:
        return bool(inspect.getclosurevars(wrapped_function(cls)).nonlocals.get("is_new_implementation"))
    except TypeError:  # not a transformers wrapper
        return False


#: hub name -> the function's name in Qwen3.5's modeling module (its pin: ``qwen3_5.<name>``).
FUNCTIONS = {
    "chunk_gated_delta_rule": "torch_chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule": "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn": "causal_conv1d_fn",
    "causal_conv1d_update": "causal_conv1d_update",
}
#: The helper the two delta rules normalise q and k with (the kernels' L2 norm).
L2NORM_PIN = "qwen3_5.l2norm"


def _torch_function(cls: type):
    # The torch function under a Func class: kernels' closure holds transformers' fallback wrapper,
    # which functools.wraps the torch function.
    fn = wrapped_function(cls)
    return getattr(fn, "__wrapped__", fn)


def _computes(cls: type, name: str) -> bool:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as ref

    fn, qwen = _torch_function(cls), _torch_function(type(getattr(ref, FUNCTIONS[name])))
    if fn is None or qwen is None or not holds(f"qwen3_5.{FUNCTIONS[name]}") or not same_code(fn, qwen):
        return False
    if "delta_rule" in name:  # their q/k normalisation must be the kernels' too
        return holds(L2NORM_PIN) and same_code(fn.__globals__.get("l2norm"), ref.l2norm)
    return True


@class_verdict
def computes_chunk_gated_delta_rule(cls: type) -> bool:
    """True if the ``Func`` class ``cls`` wraps Qwen3.5's ``torch_chunk_gated_delta_rule`` code
    (pinned, with its ``l2norm``). Once per class; a constant under ``torch.compile``."""
    return _computes(cls, "chunk_gated_delta_rule")


@class_verdict
def computes_recurrent_gated_delta_rule(cls: type) -> bool:
    """True if ``cls`` wraps Qwen3.5's ``torch_recurrent_gated_delta_rule`` code (pinned)."""
    return _computes(cls, "fused_recurrent_gated_delta_rule")


@class_verdict
def computes_causal_conv1d_fn(cls: type) -> bool:
    """True if ``cls`` wraps Qwen3.5's ``causal_conv1d_fn`` code (pinned)."""
    return _computes(cls, "causal_conv1d_fn")


@class_verdict
def computes_causal_conv1d_update(cls: type) -> bool:
    """True if ``cls`` wraps Qwen3.5's ``causal_conv1d_update`` code (pinned)."""
    return _computes(cls, "causal_conv1d_update")


def _why_not(verdict: bool, cls: type, cuda: bool, why: str | None) -> str | None:
    """Why this call keeps the wrapped function (said once per reason in eager), or None: the
    class is not Qwen3.5's code, a CPU tensor (the stock function, bit for bit), or a call the
    kernels do not compute (``why``)."""
    if not verdict:
        why = f"{function_name(cls)} is not Qwen3.5's code; it keeps its own"
    elif not cuda:
        return "cpu"
    if why is not None and not torch.compiler.is_compiling():
        dispatch.fallback(cls.kernel_layer_name, f"{why}: transformers' function runs")
    return why


def _delta_why(query, value, g, beta, use_qk_l2norm_in_kernel, kwargs) -> str | None:
    # What the delta-rule kernels compute: q/k normalised inside, one sequence per row, dtypes and
    # sizes they are built for (ops/gated_delta.py's ``unsupported``).
    if not use_qk_l2norm_in_kernel:
        return "q and k not normalised in the kernel (use_qk_l2norm_in_kernel=False)"
    if kwargs.get("cu_seqlens") is not None:
        return "packed sequences (cu_seqlens)"
    if query.dim() != 4:
        return f"q of {query.dim()} dimensions"
    return delta_ops.unsupported(query, value, g, beta)


def _start_state(initial_state, key, value, in_place: bool) -> torch.Tensor:
    """The float32 ``(B, H, dk, dv)`` state the op reads and overwrites: zeros without an initial
    state; the initial state itself when ``in_place`` and it is a contiguous float32 tensor
    (transformers' cache buffer: no overlapping rows for the blocks to race on); else a copy."""
    if initial_state is None:
        B, _, H, dk = key.shape
        return torch.zeros(B, H, dk, value.shape[-1], dtype=torch.float32, device=value.device)
    if in_place and initial_state.dtype == torch.float32 and initial_state.is_contiguous():
        return initial_state
    return initial_state.to(torch.float32, copy=True)


class CutileChunkGatedDeltaRule(nn.Module):
    """``chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
    output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs)`` on the chunked cuTile
    kernel (:func:`cutile_kernels.gated_delta_rule`). Shapes: q, k ``(B, T, H, dk)`` (heads already
    repeated to the value heads), v ``(B, T, H, dv)``, g and beta ``(B, T, H)``, state ``(B, H, dk,
    dv)``; returns ``(o, final_state or None)``, o in v's dtype, the state float32."""

    can_torch_compile = True
    has_backward = False

    def forward(self, query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
        cls = type(self)
        g32 = g.float()
        if runs_its_package(cls) or _why_not(computes_chunk_gated_delta_rule(cls), cls, query.is_cuda,
                                             _delta_why(query, value, g32, beta, use_qk_l2norm_in_kernel, kwargs)):
            return cls.forward(self, query, key, value, g=g, beta=beta, chunk_size=chunk_size,
                               initial_state=initial_state, output_final_state=output_final_state,
                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
        state = _start_state(initial_state, key, value, in_place=False)
        out = gated_delta_rule(query, key, value, g32, beta, state)
        return out, (state if output_final_state else None)


class CutileFusedRecurrentGatedDeltaRule(nn.Module):
    """``fused_recurrent_gated_delta_rule(...)`` (same arguments as the chunked one, no
    ``chunk_size``) on the token-by-token cuTile kernel. Like transformers' function (and
    flash-linear-attention's), it leaves ``initial_state`` alone and returns a new float32 final
    state. One keyword more, in ``kwargs`` (kernels requires the function's signature):
    ``state_in_place=True``, which :class:`CutileGatedDeltaNet` passes with the cache's own buffer
    (a contiguous float32 ``initial_state``): the kernel then updates it in place and returns it, so
    that a CUDA-graph replay reads and writes one buffer and the cache's copy onto itself is a no-op."""

    can_torch_compile = True
    has_backward = False

    def forward(self, query, key, value, g, beta, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
        cls = type(self)
        state_in_place = kwargs.pop("state_in_place", False)
        g32 = g.float()
        if _why_not(computes_recurrent_gated_delta_rule(cls), cls, query.is_cuda,
                    _delta_why(query, value, g32, beta, use_qk_l2norm_in_kernel, kwargs)):
            return cls.forward(self, query, key, value, g=g, beta=beta, initial_state=initial_state,
                               output_final_state=output_final_state,
                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
        state = _start_state(initial_state, key, value, in_place=state_in_place and output_final_state)
        out = gated_delta_rule(query, key, value, g32, beta, state)
        return out, (state if output_final_state else None)


class CutileCausalConv1dFn(nn.Module):
    """``causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs)`` on the
    cuTile kernel: hidden_states ``(B, C, L)`` (a transposed view of ``(B, L, C)``), weight
    ``(C, K)``; returns ``(B, C, L)`` in the input's dtype (a transposed view of our contiguous
    ``(B, L, C)`` output). Only ``activation="silu"`` without bias; other calls keep the function."""

    can_torch_compile = True
    has_backward = False

    def forward(self, hidden_states, weight, bias=None, activation=None, **kwargs):
        cls = type(self)
        why = (f"activation {activation!r} and bias {bias is not None} (ours: SiLU, no bias)"
               if activation != "silu" or bias is not None else
               "packed sequences (seq_idx)" if kwargs.get("seq_idx") is not None else
               conv_ops.unsupported(hidden_states, weight))
        if runs_its_package(cls) or _why_not(computes_causal_conv1d_fn(cls), cls, hidden_states.is_cuda, why):
            return cls.forward(self, hidden_states, weight, bias, activation, **kwargs)
        return causal_conv1d(hidden_states.transpose(1, 2), weight).transpose(1, 2)


class CutileCausalConv1dUpdate(nn.Module):
    """``causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None)`` for
    one token on the cuTile kernel: hidden_states ``(B, C, 1)``, conv_state ``(B, C, K)`` updated in
    place; returns ``(B, C, 1)``. Longer inputs, a bias or another activation keep the function."""

    can_torch_compile = True
    has_backward = False

    def forward(self, hidden_states, conv_state, weight, bias=None, activation=None):
        cls = type(self)
        why = (f"activation {activation!r} and bias {bias is not None} (ours: SiLU, no bias)"
               if activation != "silu" or bias is not None else
               f"{hidden_states.shape[-1]} tokens (ours: one)" if hidden_states.shape[-1] != 1 else
               conv_ops.unsupported(hidden_states, weight, conv_state))
        if _why_not(computes_causal_conv1d_update(cls), cls, hidden_states.is_cuda, why):
            return cls.forward(self, hidden_states, conv_state, weight, bias, activation)
        return causal_conv1d_update(hidden_states[..., 0], conv_state, weight).unsqueeze(-1)


def _is_ours(func_module, layer: type) -> bool:
    """True if ``kernelize`` bound ``layer.forward`` to the hub function module ``func_module``: by
    name, as the layer may come from the build's copy of this package and the block from the
    installed one (the stacking patch's class) or the other way round."""
    bound = getattr(getattr(func_module, "forward", None), "__func__", None)
    return getattr(bound, "__qualname__", None) == layer.forward.__qualname__


#: The pin (``layers/models/qwen3_5.py``) of the forward :class:`CutileGatedDeltaNet` reproduces.
DELTANET_PIN = "qwen3_5.Qwen3_5GatedDeltaNet.forward"
#: The modeling module's functions that forward calls (the hub functions above among them), per
#: class whose forward is that code: read from the class's own module when it is judged.
_DELTANET_CALLS = ("apply_mask_to_padding_states", "causal_conv1d_update", "causal_conv1d_fn",
                   "torch_recurrent_gated_delta_rule", "torch_chunk_gated_delta_rule")
#: The hub names of the last four, as the module's ``_kernel_funcs`` holds them.
_HUB_CALLS = ("causal_conv1d_update", "causal_conv1d_fn", "fused_recurrent_gated_delta_rule",
              "chunk_gated_delta_rule")
_CALLS: dict[type, tuple] = {}
#: The stacked projection of the opt-in patch ``qwen3_5_stacked_proj`` (``layers/models/qwen3_5.py``):
#: ``in_proj_qkv``, ``in_proj_b`` and ``in_proj_a`` as one ``nn.Linear``, rows in that order.
STACKED_NAME = "in_proj_qkvba"


@class_verdict
def computes_gated_deltanet(cls: type) -> bool:
    """True if ``cls.forward`` is ``Qwen3_5GatedDeltaNet.forward``'s code (under accelerate's
    ``force_accelerate_hooks`` wrapper) and still the pinned statements; keeps the functions that
    code calls from the class's own modeling module for :class:`CutileGatedDeltaNet`. A class made
    by the stacking patch is judged by its stock class. Once per class."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    fwd = getattr(getattr(cls, "_cutile_unfused_class", cls), "forward", None)
    if fwd is None or not holds(DELTANET_PIN) or not same_code(inspect.unwrap(fwd),
                                                               inspect.unwrap(Qwen3_5GatedDeltaNet.forward)):
        return False
    calls = inspect.unwrap(fwd).__globals__
    if not all(name in calls for name in _DELTANET_CALLS):
        return False
    _CALLS[cls] = tuple(calls[name] for name in _DELTANET_CALLS)
    return True


class CutileGatedDeltaNet(nn.Module):
    """Qwen3.5's gated DeltaNet block, ``forward(hidden_states, cache_params=None,
    attention_mask=None, **kwargs)``, for the classes transformers decorates
    ``@use_kernel_forward_from_hub("Qwen3_5GatedDeltaNet")``: ``Qwen3_5GatedDeltaNet.forward``
    (v5.22.2) with its two gate lines (``beta = b.sigmoid()``, ``g = -A_log.float().exp() *
    F.softplus(a.float() + dt_bias)``: eight launches) as one :func:`~..ops.gated_delta.gated_delta_gates`
    launch. Every other statement is the stock one, the projections, the cache updates and the calls
    of the module's hub functions (the conv1d and delta-rule layers above, or the packages
    transformers resolved them to) included. Those functions are the module's ``_kernel_funcs``,
    where ``kernelize`` binds them: the stock forward calls the modeling module's own, which in a
    ``copy.deepcopy`` of a model are not the ones kernelize bound. hidden_states ``(B, T, hidden)``;
    returns ``(B, T, hidden)`` in its dtype. A class whose forward is other code, or a module whose
    ``conv1d`` has accelerate hooks (which the stock forward fires), keeps the stock forward
    (inference only). A module the opt-in patch ``qwen3_5_stacked_proj`` stacked (its
    ``in_proj_qkv``, ``in_proj_b`` and ``in_proj_a`` as one GEMM, :data:`STACKED_NAME`) always runs
    this forward, which is its class's."""

    can_torch_compile = True
    has_backward = False

    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        cls = type(self)
        # A stacked module's class forward is this one (the patch stacks only Qwen3.5's code): no
        # stock forward to fall back to, and its verdict holds.
        stacked = STACKED_NAME in self._modules
        if not computes_gated_deltanet(cls) or (not stacked and getattr(self.conv1d, "_hf_hook", None) is not None):
            if not torch.compiler.is_compiling():
                dispatch.fallback("gated_delta_gates", f"{cls.__name__}'s forward is not Qwen3.5's code, or its "
                                  "conv1d has accelerate hooks; it keeps its own forward")
            return cls.forward(self, hidden_states, cache_params, attention_mask, **kwargs)
        mask_padding, conv_update, conv_fn, recurrent_rule, chunk_rule = _CALLS[cls]
        # The hub functions kernelize bound for this module: its own ``_kernel_funcs`` (copies of
        # the module-level ones in a deep-copied model, which the stock forward would miss).
        funcs = getattr(self, "_kernel_funcs", None)
        if isinstance(funcs, dict) and all(name in funcs for name in _HUB_CALLS):
            conv_update, conv_fn, recurrent_rule, chunk_rule = (funcs[name] for name in _HUB_CALLS)
        # From here on the stock statements (5.22.2), but for the gates.
        hidden_states = mask_padding(hidden_states, attention_mask)
        batch_size, seq_len, _ = hidden_states.shape
        if cache_params is not None:
            conv_state = cache_params.get_conv_state(self.layer_idx, state_idx=0)
            recurrent_state = cache_params.get_recurrent_state(self.layer_idx, state_idx=0)
        else:
            conv_state, recurrent_state = None, None

        if stacked and hidden_states.is_cuda:  # one GEMM for q/k/v, b and a; the three are views of its output
            projected = linear(self._modules[STACKED_NAME], hidden_states)
            b = projected[..., self.conv_dim:self.conv_dim + self.num_v_heads]
            a = projected[..., self.conv_dim + self.num_v_heads:]
            mixed_qkv = projected[..., :self.conv_dim].transpose(1, 2)
        elif stacked:  # elsewhere the stock's three GEMMs on the stacked rows: the reference, stock's bits
            w = self._modules[STACKED_NAME].weight
            n, h = self.conv_dim, self.num_v_heads
            mixed_qkv = F.linear(hidden_states, w[:n]).transpose(1, 2)
            b, a = F.linear(hidden_states, w[n:n + h]), F.linear(hidden_states, w[n + h:])
        else:
            mixed_qkv = self.in_proj_qkv(hidden_states).transpose(1, 2)
            b = self.in_proj_b(hidden_states)
            a = self.in_proj_a(hidden_states)
        z = self.in_proj_z(hidden_states).reshape(batch_size, seq_len, -1, self.head_v_dim)

        if conv_state is not None and seq_len == 1 and not cache_params.is_recording_past(self.layer_idx):
            mixed_qkv = conv_update(mixed_qkv, conv_state, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                    self.activation)
        else:
            if cache_params is not None:
                mixed_qkv = cache_params.update_conv_state(mixed_qkv, self.layer_idx,
                                                           conv_kernel_size=self.conv_kernel_size)
            mixed_qkv = conv_fn(mixed_qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                activation=self.activation, **kwargs)
            if cache_params is not None:
                mixed_qkv = mixed_qkv[:, :, -seq_len:]

        mixed_qkv = mixed_qkv.transpose(1, 2)
        query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(batch_size, seq_len, -1, self.head_k_dim)
        key = key.reshape(batch_size, seq_len, -1, self.head_k_dim)
        value = value.reshape(batch_size, seq_len, -1, self.head_v_dim)

        g, beta = gated_delta_gates(a, b, self.A_log, self.dt_bias)
        if self.num_v_heads // self.num_k_heads > 1:
            query = query.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
            key = key.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)

        rule = recurrent_rule if recurrent_state is not None and seq_len == 1 else chunk_rule
        if rule is recurrent_rule and _is_ours(rule, CutileFusedRecurrentGatedDeltaRule):
            kwargs["state_in_place"] = True  # the cache's buffer, updated where it lies
        core_attn_out, last_recurrent_state = rule(query, key, value, g=g, beta=beta, initial_state=recurrent_state,
                                                   output_final_state=cache_params is not None,
                                                   use_qk_l2norm_in_kernel=True,
                                                   cu_seqlens=kwargs.pop("cu_seq_lens_q", None), **kwargs)
        if cache_params is not None:
            cache_params.update_recurrent_state(last_recurrent_state, self.layer_idx)

        core_attn_out = self.norm(core_attn_out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(core_attn_out.reshape(batch_size, seq_len, -1))


#: Hub layers mapped only with ``kernel_config(include=[...])``: none today. The prefill pair was
#: opt-in until the H200 bench of 2026-12-02 (docs/results.md, call 4) timed it end to end: a
#: Qwen3.5-0.8B prefill of 1x2048 in 29 ms against 158 ms stock and 64 ms stock with
#: flash-linear-attention (where transformers calls that package, it keeps the call:
#: :func:`runs_its_package`).
OPT_IN: tuple[str, ...] = ()

#: transformers hub layer name -> layer class in this module (gathered by ``layers.MAPPING``).
MAPPING = {
    "chunk_gated_delta_rule": "CutileChunkGatedDeltaRule",
    "fused_recurrent_gated_delta_rule": "CutileFusedRecurrentGatedDeltaRule",
    "causal_conv1d_fn": "CutileCausalConv1dFn",
    "causal_conv1d_update": "CutileCausalConv1dUpdate",
    "Qwen3_5GatedDeltaNet": "CutileGatedDeltaNet",
}
