"""The Qwen3 family, and its patch ``qk_norm_rope``: q_norm, k_norm and RoPE on one cuTile launch.

Qwen3's decoder is Llama's code except its attention, which normalises q and k per head before
RoPE; so Qwen3 gets every shared feature of the Llama family (``models/llama.py``) and this patch.

transformers' ``Qwen3Attention.forward`` (v5.22.2) runs ``q_norm`` and ``k_norm`` (two RMSNorm
launches) and then ``apply_rotary_pos_emb`` (one more) on every layer. The patch swaps the forward
of each attention module whose class's forward is ``Qwen3Attention.forward``'s code (Qwen3 and the
classes that copy it) for :func:`fused_attention_forward`, which is that forward with those three
calls replaced by one ``cutile_kernels.qk_norm_rope``; the projections, the cache update, the
attention interface (with the sliding window) and ``o_proj`` are the stock lines (the projections
through ``_direct.linear``: ``F.linear`` when their module call would run nothing else).

Conditions (else the module is left alone, with a log line per class): the class's forward is
Qwen3's code and still the pinned statements (:data:`PIN`); the module's
``apply_rotary_pos_emb`` computes Llama's formula; ``q_norm`` and ``k_norm`` are Llama-formula
RMSNorms; nobody replaced the module's forward on the instance (e.g. accelerate hooks). At run
time a call whose norms have hooks or different ``eps`` runs the stock forward instead.

With the ``fused_qkv`` patch too, the module's q/k/v projections are stacked into one GEMM
(``layers/qkv.py``, :func:`~..qkv.register_stackable`): the fused forward then projects through
``qkv_proj``. Stacking needs this patch applied first (the registry's order).

Applied by default (``kernel_config()``, ``cutile_kernels.patch(model)``) since the H200 validated
and scored it (``autokernelize qwen3-0.6b --score qk_norm_rope``: kept); leave it out with
``kernel_config(exclude=["qk_norm_rope"])``.
"""

from __future__ import annotations

import functools
import logging

from torch import nn

from ...ops.qk_norm_rope import qk_norm_rope
from .._direct import attend
from .._patching import Patch, _unhooked, modeling_globals, restore_forwards, stock_class, swap_forwards, swapped
from ..qkv import FUSED_NAME, Stackable, qkv_projections, register_stackable
from .._pins import Pin, forward_verdict
from ..norm import is_llama_norm
from ..rope import llama_rope_function
from . import Family

logger = logging.getLogger("cutile_kernels")

#: The pin of the forward :func:`fused_attention_forward` reproduces (in :data:`FAMILY`).
#: Another version's forward patches nothing.
PIN = "qwen3.Qwen3Attention.forward"

FAMILY = Family(
    name="qwen3",
    model_types=("qwen3",),
    pins=(Pin("qwen3", "Qwen3Attention.forward", "457e3a53f1f0cfb6", "patch qk_norm_rope (its fused forward)"),),
    presets=("qwen3-0.6b",),
    covered="the Llama family's kernels, and q_norm + k_norm + RoPE on one launch (qk_norm_rope)",
    not_covered="GEMMs (cuBLAS), embedding, sampling, prefill and unpadded DynamicCache decode attention (sdpa)",
)

_ATTRS = ("q_proj", "k_proj", "v_proj", "o_proj")


@functools.lru_cache(maxsize=None)
def attention_verdict(cls: type) -> str | None:
    """Why ``cls`` (an attention class) does not take the fused forward, or None if it does: its
    ``forward`` must be ``Qwen3Attention.forward``'s code, that forward must still be the 5.22.2
    statements (:data:`PIN`), and the ``apply_rotary_pos_emb`` it calls (its
    module's) must compute Llama's formula."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    why = forward_verdict(cls, PIN, Qwen3Attention.forward)
    if why is not None:
        return why
    if not llama_rope_function(cls.forward.__globals__.get("apply_rotary_pos_emb")):
        return "the apply_rotary_pos_emb it calls is not Llama's formula"
    return None


def _norms_fusable(m: nn.Module) -> bool:
    # Instance checks, cheap enough for every call: hooks on a norm would be skipped by the fused
    # op, and the op takes one eps.
    qn, kn = m.q_norm, m.k_norm
    return _unhooked(qn) and _unhooked(kn) and qn.variance_epsilon == kn.variance_epsilon


def fused_attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None,
                            **kwargs):
    """``Qwen3Attention.forward`` (5.22.2) with ``q_norm``, ``k_norm`` and ``apply_rotary_pos_emb``
    as one ``qk_norm_rope`` call, and with one stacked q/k/v GEMM when the ``fused_qkv`` patch
    stacked the module (``qkv_proj``). Same arguments and result. When the norms have hooks or
    different eps, or the patch is undone on a stacked module (whose class forward this is), the
    stock norm and RoPE lines run instead (the class's own forward if the module is not stacked)."""
    cls = type(self)
    stacked = FUSED_NAME in self._modules
    fusable = swapped(self, fused_attention_forward) and _norms_fusable(self)
    if not (fusable or stacked):
        return cls.forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
    # The stock forward's module (its attention registry, eager path and RoPE); for a stacked
    # class, the stock class's.
    glob = modeling_globals(self)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    query_states, key_states, value_states = qkv_projections(self, hidden_states)
    query_states = query_states.view(hidden_shape).transpose(1, 2)
    key_states = key_states.view(hidden_shape).transpose(1, 2)
    value_states = value_states.view(hidden_shape).transpose(1, 2)

    cos, sin = position_embeddings
    if fusable:
        query_states, key_states = qk_norm_rope(query_states, key_states, self.q_norm.weight, self.k_norm.weight,
                                                self.q_norm.variance_epsilon, cos, sin)
    else:  # the stock lines (norms on the (B, S, H, D) views, as Qwen3Attention.forward runs them)
        query_states = self.q_norm(query_states.transpose(1, 2)).transpose(1, 2)
        key_states = self.k_norm(key_states.transpose(1, 2)).transpose(1, 2)
        query_states, key_states = glob["apply_rotary_pos_emb"](query_states, key_states, cos, sin)

    return attend(self, glob, input_shape, query_states, key_states, value_states, attention_mask, past_key_values,
                  kwargs, {"sliding_window": self.sliding_window})


def _attention_verdict(m: nn.Module) -> str | None:
    # A stacked module (fused_qkv) is judged by its stock class: its class forward is ours.
    why = attention_verdict(stock_class(m))
    if why is None and not (is_llama_norm(getattr(m, "q_norm", None)) and is_llama_norm(getattr(m, "k_norm", None))):
        why = "its q_norm / k_norm are not Llama-formula RMSNorms"
    return why


def patch_qk_norm_rope(model: nn.Module) -> int:
    """Patch ``qk_norm_rope``: bind :func:`fused_attention_forward` to every attention module of
    ``model`` that meets the conditions of the module docstring. Same results as the stock forward
    on the CPU (the reference formula); on CUDA one launch instead of three per layer. Returns the
    number of modules newly patched."""
    new = swap_forwards(model, "qk_norm_rope", fused_attention_forward,
                        lambda m: hasattr(m, "o_proj") and (all(hasattr(m, a) for a in _ATTRS) or hasattr(m, FUSED_NAME)),
                        _attention_verdict,
                        "q_norm, k_norm and RoPE of {n} {cls} on one cuTile launch", modeling=True)
    return sum(new.values())


def unpatch_qk_norm_rope(model: nn.Module) -> int:
    """Undo :func:`patch_qk_norm_rope`: the class forward again. Returns the modules restored."""
    return restore_forwards(model, "qk_norm_rope", fused_attention_forward)


__all__ = ["FAMILY", "PIN", "attention_verdict", "fused_attention_forward", "patch_qk_norm_rope",
           "unpatch_qk_norm_rope"]


def _qwen3_forward():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    return Qwen3Attention.forward


# The fused forward reads a stacked projection: the fused_qkv patch may stack modules running it.
register_stackable(Stackable(reference=_qwen3_forward, forward=fused_attention_forward, verdict=_attention_verdict,
                             patch="qk_norm_rope"))

#: This module's patch row (gathered by ``layers/_registry.py``). Default since autokernelize kept it
#: on the H200 (2026-11-30, qwen3-0.6b: prefill 18.8 -> 16.7 ms, decode b16 870 -> 952 tok/s against
#: our build without it; benchmarks/results/autokernelize.tsv).
PATCH_ROWS = [Patch("qk_norm_rope", apply=patch_qk_norm_rope, undo=unpatch_qk_norm_rope,
                    description="Qwen3 attention's q_norm, k_norm and RoPE (Qwen3Attention code) on one cuTile launch")]
