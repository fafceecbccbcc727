"""The Gemma family (Gemma, Gemma 2, Gemma 3 text; transformers 5.22.2).

What differs from the Llama code: ``GemmaRMSNorm`` multiplies by ``1 + weight`` and rounds once,
after the multiply, in float32 (not decorated for the hub: the patch ``rms_norm_gemma`` of
``layers/norm.py`` reaches it, on the ``rms_norm_gemma`` kernel, by default since the H200 bench of
2026-12-01: gemma-3-1b decode 1.8x, prefill 1.7x over our build without it); four norms per decoder layer
(Gemma 2 and 3), GeGLU with ``gelu_pytorch_tanh`` (LlamaMLP's code with another activation: the
patch ``fused_gate_up_geglu`` of ``layers/mlp.py`` stacks gate and up and runs our GeGLU), the
embedding scaled by sqrt(hidden), sliding
and global layers, logit softcaps (Gemma 2: transformers attends eagerly, sdpa having no softcap;
the default patch ``gemma2_attention`` below runs our kernel instead), q/k norms
and two RoPE bases (Gemma 3). Gemma's
attention and rotary embedding are Llama's code, so the opt-in ``fused_qkv`` and ``rope_cos_sin``
apply to Gemma 1 as they are. The patch ``gemma_add_norm`` (below) fuses Gemma 2 and 3's
attention-block residual add into the ``pre_feedforward_layernorm`` that follows it;
``gemma3_qk_norm_rope`` runs Gemma 3 attention's ``q_norm``, ``k_norm`` and RoPE on one
``qk_norm_rope_gemma`` launch (the kernel Qwen3.5's attention runs, full rotary here). Both, with
``fused_gate_up_geglu``, are defaults since the same-run A/B of 2026-12-05 (``PATCH_ROWS``).
"""

from __future__ import annotations

import functools
import logging

from torch import nn

from ...ops.norm import add_rms_norm_gemma
from .._direct import attend, gemma_qk_norm_rope, linear
from .._patching import Patch, _unhooked, modeling_globals, restore_forwards, swap_forwards
from .._pins import Pin, forward_verdict
from ..attention import NAME as CUTILE_ATTENTION
from ..attention import prepare_devices
from ..norm import _float_norm_eps, computes_gemma_rms_norm, gemma_qk_norms_verdict
from ..rope import llama_rope_function
from . import Family, attention_modules, switch_back, switchable_verdict

logger = logging.getLogger("cutile_kernels")

_USE = "patch rms_norm_gemma (rms_norm_gemma kernel, offset 1)"

FAMILY = Family(
    name="gemma",
    model_types=("gemma", "gemma2", "gemma3_text"),
    pins=(Pin("gemma", "GemmaRMSNorm.forward", "6fae0a5e1216d30d", _USE),
          Pin("gemma", "GemmaRMSNorm._norm", "53678ba7610507ed", _USE),
          Pin("gemma3", "Gemma3DecoderLayer.forward", "19bb15ae20d3bae5",
              "patch gemma_add_norm (its fused decoder forward; Gemma 2's is the same code)"),
          Pin("gemma3", "Gemma3Attention.forward", "680c2a03b98e5ec4",
              "patch gemma3_qk_norm_rope (its attention forward)"),
          Pin("gemma2", "Gemma2Attention.forward", "f1ef0bcee80badb9",
              "patch gemma2_attention (the attention interface gets its softcap, window and scaling)")),
    presets=("gemma-3-1b", "gemma-2-2b"),
    covered="every RMSNorm in Gemma's order (q/k norms included), RoPE (Llama's code); GeGLU on one fused "
            "gate/up GEMM (patch fused_gate_up_geglu); the attention residual add fused into the next norm "
            "(patch gemma_add_norm); Gemma 3's q/k norms + RoPE in one launch (patch gemma3_qk_norm_rope); Gemma "
            "2's attention with its softcap and windows (patch gemma2_attention); Gemma 1 and 3's static-cache and "
            "padded decode attention (patch cutile_attention) and masked prefill attention (their sliding layers; "
            "patch masked_prefill_attention)",
    not_covered="embedding scale, the final logit softcap, Gemma 1 and 3's unmasked prefill attention (sdpa), the "
                "MLP block's residual add, GEMMs",
    default=True,
)


# ---------------------------------------------------------------------------------------------
# Patch gemma2_attention (default): Gemma 2, which can only attend eagerly, attends with our kernel
# ---------------------------------------------------------------------------------------------
#
# Estimate, written before the patch (Amdahl), Gemma-2-2B on the H200 (2026-12-02 bench: eager
# prefill 1 x 2048 45.7 ms stock, 42.9 ms ours, the host setting the pace): transformers' eager
# attention is about eleven launches a layer (repeat_kv's copies, QK^T, the scale, the softcap's
# divide, tanh and multiply, the mask add, softmax, the cast, PV, the transpose) where the kernel is
# one, and its float32 (Hq, S, S) scores go: ~260 of ~850 launches of a forward, f ~ 0.3 of a
# host-paced step, s large, ceiling ~1.4x on eager prefill and decode.

#: The pin (in :data:`FAMILY`) of the attention forward whose calls the patch hands to our kernel.
ATTN2_PIN = "gemma2.Gemma2Attention.forward"
#: Attribute of a model the patch switched (plain, in its ``__dict__``): the implementation it had.
_SWITCHED = "_cutile_gemma2_attention"


@functools.lru_cache(maxsize=None)
def gemma2_attention_verdict(cls: type) -> str | None:
    """Why attention class ``cls`` may not attend with our kernel under patch ``gemma2_attention``,
    or None: its forward must be ``Gemma2Attention.forward``'s code (causal self-attention that
    passes ``scaling``, ``sliding_window`` and ``softcap`` to the attention interface), still the
    pinned one."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention

    return forward_verdict(cls, ATTN2_PIN, Gemma2Attention.forward)


def eager_gemma2_verdict(model: nn.Module) -> str | None:
    """Why ``model`` keeps its attention implementation under patch ``gemma2_attention``, or None
    when it takes ours: a transformers decoder-only model without sub-models (a multimodal wrapper's
    sub-configs would not all switch), attending with ``"eager"`` because its class has no sdpa path
    (``_supports_sdpa`` False: a class that has one attends eagerly because it was asked to), whose
    every attention module is causal and has ``Gemma2Attention.forward``'s code (pinned)."""
    why = switchable_verdict(model, "eager")
    if why is not None:
        return why
    if getattr(type(model), "_supports_sdpa", True):
        return "its class supports sdpa, so eager attention was asked for"
    attn = attention_modules(model)
    if not attn:
        return "it has no attention module"
    for m in attn:
        why = gemma2_attention_verdict(type(m))
        if why is None and getattr(m, "is_causal", False) is not True:
            why = "it is not causal"
        if why is not None:
            return f"its {type(m).__name__}: {why}"
    return None


def patch_gemma2_attention(model: nn.Module) -> int:
    """Patch ``gemma2_attention``: a Gemma 2 model attending eagerly (:func:`eager_gemma2_verdict`)
    attends with ``"cutile"`` instead, through transformers' own ``model.set_attn_implementation``:
    the masks sdpa would get, the logit softcap, the sliding windows and the scale in the kernel.
    Attention weights are then not returned (``output_attentions`` gives none, as with sdpa);
    ``kernel_config(exclude=["gemma2_attention"])`` keeps eager. Returns the attention modules
    switched (0: already switched, or left alone with a log line)."""
    if _SWITCHED in model.__dict__:
        if model.config._attn_implementation == CUTILE_ATTENTION:
            prepare_devices(model)  # as patch_cutile_attention: this copy's forwards, their arrays
            return 0
        del model.__dict__[_SWITCHED]  # switched away since (e.g. to eager for attention weights)
    why = eager_gemma2_verdict(model)
    if why is not None:
        logger.info("cutile_kernels: patch gemma2_attention leaves %s alone: %s", type(model).__name__, why)
        return 0
    before = model.config._attn_implementation
    model.set_attn_implementation(CUTILE_ATTENTION)
    prepare_devices(model)
    model.__dict__[_SWITCHED] = before
    n = len(attention_modules(model))
    logger.info("cutile_kernels: patch gemma2_attention: %s attends with %r instead of eager (%d attention modules)",
                type(model).__name__, CUTILE_ATTENTION, n)
    return n


def unpatch_gemma2_attention(model: nn.Module) -> int:
    """Undo :func:`patch_gemma2_attention`: the implementation the model had, unless it was switched
    away since. Returns the attention modules switched back."""
    return switch_back(model, _SWITCHED)


# ---------------------------------------------------------------------------------------------
# Patch gemma_add_norm (a default since 2026-12-05): norm, residual add, norm -> norm, one fused add + norm
# ---------------------------------------------------------------------------------------------

#: The pin (in :data:`FAMILY`) of the decoder forward :func:`fused_decoder_forward` reproduces.
DECODER_PIN = "gemma3.Gemma3DecoderLayer.forward"


@functools.lru_cache(maxsize=None)
def decoder_verdict(cls: type) -> str | None:
    """Why ``cls`` (a decoder layer class) does not take :func:`fused_decoder_forward`, or None if
    it does: its forward must be ``Gemma3DecoderLayer.forward``'s code (Gemma 2's is the same),
    still the pinned one."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer

    return forward_verdict(cls, DECODER_PIN, Gemma3DecoderLayer.forward)


def _decoder_verdict(m: nn.Module) -> str | None:
    why = decoder_verdict(type(m))
    if why is None and not computes_gemma_rms_norm(type(m.pre_feedforward_layernorm)):
        why = "its pre_feedforward_layernorm is not the (1 + weight) RMSNorm (GemmaRMSNorm's code)"
    return why


def fused_decoder_forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None,
                          past_key_values=None, **kwargs):
    """``Gemma3DecoderLayer.forward`` (5.22.2; Gemma 2's is the same code) with the attention
    block's residual add fused into ``pre_feedforward_layernorm``: one ``add_rms_norm_gemma``
    launch (the sum rounded to the activations' dtype as the stock add rounds it, then the stock
    norm's formula) instead of an add and a norm. Same arguments and result; in float16 the sum
    overflows exactly where the stock add does. A pre-feed-forward norm with hooks takes the stock
    lines."""
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, position_embeddings=position_embeddings,
                                      attention_mask=attention_mask, position_ids=position_ids,
                                      past_key_values=past_key_values, **kwargs)
    hidden_states = self.post_attention_layernorm(hidden_states)
    pre = self.pre_feedforward_layernorm
    if _unhooked(pre):
        hidden_states, residual = add_rms_norm_gemma(hidden_states, residual, pre.weight, _float_norm_eps(pre), 1.0)
    else:
        residual = residual + hidden_states
        hidden_states = pre(residual)
    hidden_states = self.mlp(hidden_states)
    hidden_states = self.post_feedforward_layernorm(hidden_states)
    return residual + hidden_states


def patch_gemma_add_norm(model: nn.Module) -> int:
    """Patch ``gemma_add_norm``: bind :func:`fused_decoder_forward` to every decoder layer whose
    class's forward is Gemma 3's (pinned; Gemma 2's is the same code) and whose
    ``pre_feedforward_layernorm`` computes the ``(1 + weight)`` norm; others are left alone with a
    log line per class. The feed-forward block's add stays a plain add. Returns the layers newly
    patched."""
    new = swap_forwards(model, "gemma_add_norm", fused_decoder_forward,
                        lambda m: all(hasattr(m, a) for a in ("input_layernorm", "post_attention_layernorm",
                                                              "pre_feedforward_layernorm", "mlp")),
                        _decoder_verdict, "residual add fused into pre_feedforward_layernorm in {n} {cls}")
    return sum(new.values())


def unpatch_gemma_add_norm(model: nn.Module) -> int:
    """Undo :func:`patch_gemma_add_norm`: the class forward again. Returns the layers restored."""
    return restore_forwards(model, "gemma_add_norm", fused_decoder_forward, noun="layers")


# ---------------------------------------------------------------------------------------------
# Patch gemma3_qk_norm_rope (a default since 2026-12-05): Gemma 3 attention's q_norm, k_norm and RoPE on one launch
# ---------------------------------------------------------------------------------------------
#
# Estimate, written before the patch (Amdahl), Gemma-3-1B on the H200 (2026-12-01 bench: eager decode
# ~20 ms a step, host-bound): per layer q_norm and k_norm (rms_norm_gemma, 2 launches) and RoPE (the
# rotary_pos_emb hub layer, 1) become 1 launch, 52 fewer a step in 26 layers at ~25 us each: f ~ 6 %,
# s -> inf for what goes, ceiling ~1.07 on eager decode; under CUDA graphs well under 1 %.

#: The pin (in :data:`FAMILY`) of the attention forward :func:`qk_norm_rope_attention_forward` reproduces.
ATTN_PIN = "gemma3.Gemma3Attention.forward"


@functools.lru_cache(maxsize=None)
def attention_verdict(cls: type) -> str | None:
    """Why ``cls`` (an attention class) does not take :func:`qk_norm_rope_attention_forward`, or
    None if it does: its forward must be ``Gemma3Attention.forward``'s code, still the pinned one,
    and the ``apply_rotary_pos_emb`` it calls Llama's formula."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention

    why = forward_verdict(cls, ATTN_PIN, Gemma3Attention.forward)
    if why is None and not llama_rope_function(cls.forward.__globals__.get("apply_rotary_pos_emb")):
        why = "the apply_rotary_pos_emb it calls is not Llama's formula"
    return why


def _attention_verdict(m: nn.Module) -> str | None:
    # Patch time: the class, and q_norm / k_norm computing GemmaRMSNorm's formula with one eps.
    return attention_verdict(type(m)) or gemma_qk_norms_verdict(m)


def qk_norm_rope_attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                                   past_key_values=None, **kwargs):
    """``Gemma3Attention.forward`` (5.22.2) with ``q_norm``, ``k_norm`` and ``apply_rotary_pos_emb``
    as one ``qk_norm_rope_gemma`` launch for q and k (full rotary). The projections, the cache
    update, the attention interface with the sliding window and ``o_proj`` are the stock lines
    (``_direct.attend``). Same arguments and result; q and k leave contiguous where stock keeps
    the projection's layout (same values). A call whose norms have hooks runs the stock lines."""
    glob = modeling_globals(self)  # the stock forward's module: its attention registry, eager path, RoPE
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    query_states = linear(self.q_proj, hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = linear(self.k_proj, hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = linear(self.v_proj, hidden_states).view(hidden_shape).transpose(1, 2)

    cos, sin = position_embeddings
    fused = gemma_qk_norm_rope(self, query_states, key_states, cos, sin)
    if fused is not None:
        query_states, key_states = fused
    else:  # the stock lines: the norm modules (their hooks fire), then the module's RoPE
        query_states, key_states = glob["apply_rotary_pos_emb"](self.q_norm(query_states), self.k_norm(key_states),
                                                                cos, sin)
    return attend(self, glob, input_shape, query_states, key_states, value_states, attention_mask, past_key_values,
                  kwargs, {"sliding_window": self.sliding_window})


def patch_gemma3_qk_norm_rope(model: nn.Module) -> int:
    """Patch ``gemma3_qk_norm_rope``: bind :func:`qk_norm_rope_attention_forward` to every attention
    module whose class's forward is Gemma 3's (pinned) calling Llama's RoPE, with ``q_norm`` /
    ``k_norm`` of ``GemmaRMSNorm``'s formula and one eps. Returns the modules newly patched."""
    new = swap_forwards(model, "gemma3_qk_norm_rope", qk_norm_rope_attention_forward,
                        lambda m: all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm",
                                                              "k_norm")),
                        _attention_verdict, "q_norm, k_norm and RoPE of {n} {cls} on one cuTile launch",
                        modeling=True)
    return sum(new.values())


def unpatch_gemma3_qk_norm_rope(model: nn.Module) -> int:
    """Undo :func:`patch_gemma3_qk_norm_rope`: the class forward again. Returns the modules restored."""
    return restore_forwards(model, "gemma3_qk_norm_rope", qk_norm_rope_attention_forward)


#: This module's patch rows (gathered by ``layers/_registry.py``): gemma2_attention by default since
#: the H200 bench of 2026-12-03 (gemma-2-2b 1.6-2.3x stock eager); gemma_add_norm and
#: gemma3_qk_norm_rope (with layers/mlp.py's fused_gate_up_geglu) since the same-run A/B of
#: 2026-12-05 on an H100 (gemma-3-1b, the three against our build without them: eager prefill
#: interleaved in one process 18.04 against 19.99 ms; per round, host-paced, decode faster in all
#: five rounds of two runs at batch 1 and 16, prefill in four of five (2.5 % slower in one); the coverage
#: pass's non-GEMM device time 1950 against 2101 us at a 512-token prefill, 4851 against 5526 over
#: four decode steps; benchmarks/results/h100-2026-12-05e).
PATCH_ROWS = [Patch("gemma2_attention", apply=patch_gemma2_attention, undo=unpatch_gemma2_attention,
                    description="Gemma 2 (no sdpa path: its softcap) attends with our kernel instead of eager"),
              Patch("gemma_add_norm", apply=patch_gemma_add_norm, undo=unpatch_gemma_add_norm,
                    description="Gemma 2 / 3 decoder layers' attention residual add fused into their "
                                "pre_feedforward_layernorm"),
              Patch("gemma3_qk_norm_rope", apply=patch_gemma3_qk_norm_rope, undo=unpatch_gemma3_qk_norm_rope,
                    description="Gemma 3 attention's q_norm, k_norm and RoPE in one cuTile launch")]
