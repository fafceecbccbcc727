"""The OLMo 2 family (OLMo 2 and OLMo 3; transformers 5.22.2).

What differs from the Llama code: the decoder normalises after attention and after the MLP
(``post_attention_layernorm`` / ``post_feedforward_layernorm`` on the block outputs, before the
residual add), the q/k norms run over the whole projection before the head split, and
``Olmo2RMSNorm`` computes in float32 and rounds once. The ``RMSNorm`` hub layer leaves that norm
stock (Llama's order only); the patch ``rms_norm_olmo2`` (``layers/norm.py``, default) runs it, and
every class with its code (Olmo3, GptOss, DeepseekV4, ...), on the ``rms_norm_gemma`` kernel with
offset 0. The MLP is Llama's code, so ``fused_gate_up`` applies by default. Its
``apply_rotary_pos_emb`` (hub function ``rotary_pos_emb``) takes the rotary embedding's float32
cos/sin and casts each result back to q's dtype: the RoPE hub layer runs it on the rope kernel's
float32-cos variants (``apply_rope_cast``). The patch ``olmo2_norm_add`` (below, default) runs each
post-norm block's norm and residual add as one ``rms_norm_add_gemma`` launch; the patch
``olmo2_qk_norm_rope`` (below, default) runs the attention's ``q_norm``, ``k_norm`` and RoPE as one
``qk_norm_rope_olmo2`` launch and lets ``fused_qkv`` (opt-in; ``decode_graphs=True``) stack its q/k/v
projections.

OLMo 3 (``modeling_olmo3.py``) is OLMo 2's code (``Olmo3RMSNorm``, ``apply_rotary_pos_emb``, the MLP
and the decoder forward compile to OLMo 2's, so OLMo 2's pins gate it) with sliding-window layers
(three of every four in the released 7B and 32B, a window of 4096) and a rotary embedding per layer
type; those go through transformers' masks and caches, and through the decode fast path's sliding
cache layers.
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch import nn

from ...ops.norm import rms_norm_add_gemma
from ...ops.qk_norm_rope import olmo2_tile_reason, qk_norm_rope_olmo2
from .._direct import attend
from .._patching import (Patch, _unhooked, modeling_globals, restore_forwards, stock_class, swap_forwards,
                         swapped)
from .._pins import Pin, forward_verdict
from ..norm import _float_norm_eps, olmo2_formula_norm
from ..qkv import FUSED_NAME, Stackable, qkv_projections, register_stackable
from ..rope import olmo2_rope_function
from . import Family

FAMILY = Family(
    name="olmo2",
    model_types=("olmo2", "olmo3"),
    pins=(Pin("olmo2", "Olmo2RMSNorm.forward", "192b385f090ad22f", "patch rms_norm_olmo2 (rms_norm_gemma kernel, offset 0)"),
          Pin("olmo2", "apply_rotary_pos_emb", "1e670b93dd6109e2",
              "rotary_pos_emb hub layer (rope kernel, float32 cos/sin)"),
          Pin("olmo2", "Olmo2DecoderLayer.forward", "4a69e6dc2cbadaf9",
              "patch olmo2_norm_add (its post-norm decoder forward)"),
          Pin("olmo2", "Olmo2Attention.forward", "be77593368b7c6ef",
              "patch olmo2_qk_norm_rope (its fused attention forward)"),
          Pin("olmo3", "Olmo3Attention.forward", "3fb6768815405c9f",
              "patch olmo2_qk_norm_rope (its fused attention forward, with OLMo 3's sliding window)")),
    presets=("olmo-2-1b", "olmo-3-7b"),
    covered="every RMSNorm in OLMo 2's float32 order (q/k norms with RoPE in one launch), the post-norms with "
            "their residual adds, SwiGLU on fused gate/up, static-cache and padded decode attention (patch "
            "cutile_attention)",
    not_covered="GEMMs (cuBLAS), prefill attention (sdpa)",
    default=True,
)


# ---------------------------------------------------------------------------------------------
# Patch olmo2_norm_add (default): each post-norm block's norm and residual add in one launch
# ---------------------------------------------------------------------------------------------
#
# Estimate, written before the patch (Amdahl), OLMo-2-1B on the H200 (2026-12-03): two adds a layer,
# 32 launches of a step go. In the decode fast path (1.58 / 1.89 ms a step at b=1 / 16, ~2-3 us a
# small launch) f ~ 0.04, s -> inf for what goes: ceiling ~1.04x, which would bring b=16 from 0.95x
# to about stock-compile's time; in eager decode (host-paced, ~25 us a launch of ~12 ms) ~1.07x.
# Measured (H100, 2026-12-05, over olmo2_qk_norm_rope): fast path 1.04x / 1.05x (1.67 -> 1.61 ms,
# 2.05 -> 1.96); eager, with olmo2_qk_norm_rope, faster in every round at prefill and both batches.

#: The pin (in :data:`FAMILY`) of the decoder forward :func:`post_norm_decoder_forward` reproduces.
DECODER_PIN = "olmo2.Olmo2DecoderLayer.forward"


@functools.lru_cache(maxsize=None)
def decoder_verdict(cls: type) -> str | None:
    """Why ``cls`` (a decoder layer class) does not take :func:`post_norm_decoder_forward`, or None
    if it does: its forward must be ``Olmo2DecoderLayer.forward``'s code, still the pinned one."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2DecoderLayer

    return forward_verdict(cls, DECODER_PIN, Olmo2DecoderLayer.forward)


def _decoder_layer_verdict(m: nn.Module) -> str | None:
    why = decoder_verdict(type(m))
    if why is None and not all(olmo2_formula_norm(getattr(m, a, None))
                               for a in ("post_attention_layernorm", "post_feedforward_layernorm")):
        why = "its post-norms are not Olmo2RMSNorm-formula norms (an (N,) weight, a float eps, their own forward)"
    return why


def _norm_add(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    # A norm with hooks runs as a module (its hooks fire), then the stock add.
    if _unhooked(norm):
        return rms_norm_add_gemma(x, residual, norm.weight, _float_norm_eps(norm), 0.0)
    return residual + norm(x)


def post_norm_decoder_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                              use_cache=False, position_embeddings=None, **kwargs):
    """``Olmo2DecoderLayer.forward`` (5.22.2) with each post-norm block's ``post_*_layernorm`` and
    residual add as one ``rms_norm_add_gemma`` launch (the norm rounded to the activations' dtype,
    then the add rounded, as the stock lines do: same result, bit for bit). Same arguments and
    result."""
    residual = hidden_states
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                      position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache,
                                      position_embeddings=position_embeddings, **kwargs)
    hidden_states = _norm_add(self.post_attention_layernorm, hidden_states, residual)
    residual = hidden_states
    hidden_states = self.mlp(hidden_states)
    return _norm_add(self.post_feedforward_layernorm, hidden_states, residual)


def patch_olmo2_norm_add(model: nn.Module) -> int:
    """Patch ``olmo2_norm_add``: bind :func:`post_norm_decoder_forward` to every decoder layer whose
    class's forward is OLMo 2's (pinned) and whose two post-norms compute ``Olmo2RMSNorm``'s
    formula; others are left alone with a log line per class. Returns the layers newly patched."""
    new = swap_forwards(model, "olmo2_norm_add", post_norm_decoder_forward,
                        lambda m: all(hasattr(m, a) for a in ("self_attn", "mlp", "post_attention_layernorm",
                                                              "post_feedforward_layernorm")),
                        _decoder_layer_verdict, "post-norms and residual adds of {n} {cls} fused")
    return sum(new.values())


def unpatch_olmo2_norm_add(model: nn.Module) -> int:
    """Undo :func:`patch_olmo2_norm_add`: the class forward again. Returns the layers restored."""
    return restore_forwards(model, "olmo2_norm_add", post_norm_decoder_forward, noun="layers")


# ---------------------------------------------------------------------------------------------
# Patch olmo2_qk_norm_rope (default): q_norm, k_norm and RoPE on one launch; q/k/v stackable
# ---------------------------------------------------------------------------------------------
#
# Estimate, written before the patch: see kernel_src/qk_norm_rope.py's OLMo 2 section (the decode
# fast path with fused_qkv: ceiling ~1.10x at b=1, ~1.12x at b=16 on OLMo-2-1B). Measured (H100,
# 2026-12-05, docs/results.md): 1.07x / 1.07x (1.80 -> 1.67 ms, 2.21 -> 2.05).

#: The attention forwards :func:`fused_attention_forward` reproduces, by (modeling module, class),
#: and whether the class passes ``sliding_window=self.sliding_window`` to the attention function
#: (OLMo 3's; OLMo 2's passes none). Each is pinned in :data:`FAMILY`.
ATTENTION_REFERENCES = {("olmo2", "Olmo2Attention"): False, ("olmo3", "Olmo3Attention"): True}
#: Instance attribute the patch sets: whether the module's stock forward passes its sliding window.
WINDOW_ATTR = "_cutile_olmo_window"
_ATTRS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


def _reference(module: str, name: str) -> type:
    return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)


@functools.lru_cache(maxsize=None)
def attention_window(cls: type) -> bool | str:
    """For an attention class whose forward is one of :data:`ATTENTION_REFERENCES`' code (still the
    pinned statements) calling OLMo 2's ``apply_rotary_pos_emb``: whether that forward passes its
    sliding window; else why ``cls`` does not take :func:`fused_attention_forward` (a string)."""
    reasons = []
    for (module, name), window in ATTENTION_REFERENCES.items():
        ref = _reference(module, name).forward
        why = forward_verdict(cls, f"{module}.{name}.forward", ref)
        if why is None:
            if not olmo2_rope_function(cls.forward.__globals__.get("apply_rotary_pos_emb")):
                return "the apply_rotary_pos_emb it calls is not OLMo 2's formula"
            return window
        reasons.append(why)
    return "; ".join(reasons)


def _norms_fusable(m: nn.Module) -> bool:
    # Instance checks, cheap enough for every call: hooks on a norm would be skipped by the fused
    # op, and the op takes one eps.
    qn, kn = m.q_norm, m.k_norm
    return _unhooked(qn) and _unhooked(kn) and _float_norm_eps(qn) == _float_norm_eps(kn)


def fused_attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None,
                            **kwargs):
    """``Olmo2Attention.forward`` (5.22.2; ``Olmo3Attention.forward``, which passes its sliding
    window) with ``q_norm``, ``k_norm`` and ``apply_rotary_pos_emb`` as one ``qk_norm_rope_olmo2``
    call, and with one stacked q/k/v GEMM when the ``fused_qkv`` patch stacked the module
    (``qkv_proj``). Same arguments and result. When the norms have hooks or different eps, or the
    patch is undone on a stacked module (whose class forward this is), the stock norm and RoPE lines
    run instead (the class's own forward if the module is not stacked)."""
    cls = type(self)
    stacked = FUSED_NAME in self._modules
    fusable = swapped(self, fused_attention_forward) and _norms_fusable(self)
    if not (fusable or stacked):
        return cls.forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
    glob = modeling_globals(self)  # the stock forward's module: its attention registry, eager path, RoPE
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    query_states, key_states, value_states = qkv_projections(self, hidden_states)
    cos, sin = position_embeddings
    if fusable:  # the norms over the whole projections, then the heads' RoPE: one launch
        query_states, key_states = qk_norm_rope_olmo2(query_states, key_states, self.q_norm.weight,
                                                      self.k_norm.weight, _float_norm_eps(self.q_norm), cos, sin)
        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
    else:  # the stock lines
        query_states = self.q_norm(query_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_norm(key_states).view(hidden_shape).transpose(1, 2)
        query_states, key_states = glob["apply_rotary_pos_emb"](query_states, key_states, cos, sin)
    value_states = value_states.view(hidden_shape).transpose(1, 2)

    own = self.__dict__  # indexed, as _patching.swapped reads an instance attribute under dynamo
    window = {"sliding_window": self.sliding_window} if WINDOW_ATTR in own and own[WINDOW_ATTR] else {}
    return attend(self, glob, input_shape, query_states, key_states, value_states, attention_mask, past_key_values,
                  kwargs, window)


def _attention_verdict(m: nn.Module) -> str | None:
    # A stacked module (fused_qkv) is judged by its stock class: its class forward is ours.
    window = attention_window(stock_class(m))
    if isinstance(window, str):
        return window
    if not (olmo2_formula_norm(getattr(m, "q_norm", None)) and olmo2_formula_norm(getattr(m, "k_norm", None))):
        return "its q_norm / k_norm are not Olmo2RMSNorm-formula norms (an (N,) weight, a float eps, their own forward)"
    return _tile_verdict(m)


def _tile_verdict(m: nn.Module) -> str | None:
    # Whether a tile of the kernel takes the module's heads, so that no forward falls back: head_dim
    # and the larger head count of q and k, from the norms' widths (the op's q_weight / k_weight,
    # which are the projections' widths; a stacked module keeps its norms but not q_proj / k_proj).
    d = getattr(m, "head_dim", None)
    widths = (m.q_norm.weight.shape[0], m.k_norm.weight.shape[0])
    if not (isinstance(d, int) and d > 0 and all(w % d == 0 for w in widths)):
        return f"its q_norm / k_norm widths {widths} are not multiples of its head_dim {d}"
    return olmo2_tile_reason(d, max(widths) // d)


def _set_window(m: nn.Module) -> None:
    m.__dict__[WINDOW_ATTR] = attention_window(stock_class(m)) is True


def patch_olmo2_qk_norm_rope(model: nn.Module) -> int:
    """Patch ``olmo2_qk_norm_rope``: bind :func:`fused_attention_forward` to every attention module
    whose class's forward is OLMo 2's or OLMo 3's (pinned) calling OLMo 2's RoPE, with
    ``Olmo2RMSNorm``-formula q/k norms and heads a tile of the kernel takes
    (:func:`~cutile_kernels.ops.qk_norm_rope.olmo2_tile_reason`: head_dim 66 to 128, at most 64
    heads); others are left alone with a log line per class. Returns the modules newly patched."""
    new = swap_forwards(model, "olmo2_qk_norm_rope", fused_attention_forward,
                        lambda m: all(hasattr(m, a) for a in _ATTRS[3:]) and
                        (all(hasattr(m, a) for a in _ATTRS[:3]) or hasattr(m, FUSED_NAME)),
                        _attention_verdict, "q_norm, k_norm and RoPE of {n} {cls} on one cuTile launch",
                        prepare=_set_window, modeling=True)
    return sum(new.values())


def unpatch_olmo2_qk_norm_rope(model: nn.Module) -> int:
    """Undo :func:`patch_olmo2_qk_norm_rope`: the class forward again. Returns the modules restored.
    A module ``fused_qkv`` still stacks keeps its window attribute: its class forward is
    :func:`fused_attention_forward` until it is unstacked, and passes the window as stock does."""
    n = restore_forwards(model, "olmo2_qk_norm_rope", fused_attention_forward)
    for m in model.modules():
        if WINDOW_ATTR in m.__dict__ and FUSED_NAME not in m._modules:
            del m.__dict__[WINDOW_ATTR]
    return n


# The fused forward reads a stacked projection: the fused_qkv patch may stack modules running it.
def _reference_forward(module: str, name: str):
    return _reference(module, name).forward


for _module, _name in ATTENTION_REFERENCES:
    register_stackable(Stackable(reference=functools.partial(_reference_forward, _module, _name),
                                 forward=fused_attention_forward, verdict=_attention_verdict,
                                 patch="olmo2_qk_norm_rope"))

#: This module's patch rows (gathered by ``layers/_registry.py``): defaults since the H100 bench of
#: 2026-12-05 (docs/results.md): OLMo-2-1B eager prefill 15.72 / 18.16 -> 13.29 / 16.55 ms and decode
#: faster at b=1 and b=16 in both rounds, the decode fast path 1.78 -> 1.61 ms (b=1), 2.21 -> 1.96 (b=16).
PATCH_ROWS = [Patch("olmo2_norm_add", apply=patch_olmo2_norm_add, undo=unpatch_olmo2_norm_add, default=True,
                    description="OLMo 2 decoder layers' post-norms and residual adds fused (rms_norm_add_gemma)"),
              Patch("olmo2_qk_norm_rope", apply=patch_olmo2_qk_norm_rope, undo=unpatch_olmo2_qk_norm_rope,
                    default=True, description="OLMo 2 / OLMo 3 attention's q_norm, k_norm (over the whole "
                    "projections) and RoPE on one cuTile launch; q/k/v stackable by fused_qkv")]
