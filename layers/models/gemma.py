"""The Gemma family (Gemma, Gemma 2, Gemma 3 text; transformers 5.22.2).

What differs from the Llama code: ``GemmaRMSNorm`` multiplies by ``1 + weight`` and rounds once,
after the multiply, in float32 (not decorated for the hub: the patch ``rms_norm_gemma`` of
``layers/norm.py`` reaches it, on the ``rms_norm_gemma`` kernel, by default since the H200 bench of
2026-12-01: gemma-3-1b decode 1.8x, prefill 1.7x over our build without it); four norms per decoder layer
(Gemma 2 and 3), GeGLU with ``gelu_pytorch_tanh`` (LlamaMLP's code with another activation: the
opt-in ``fused_gate_up_geglu`` of ``layers/mlp.py`` stacks gate and up and runs our GeGLU), the embedding scaled by sqrt(hidden), sliding
and global layers, logit softcaps (Gemma 2), q/k norms and two RoPE bases (Gemma 3). Gemma's
attention and rotary embedding are Llama's code, so the opt-in ``fused_qkv`` and ``rope_cos_sin``
apply to Gemma 1 as they are. The opt-in patch ``gemma_add_norm`` (below) fuses Gemma 2 and 3's
attention-block residual add into the ``pre_feedforward_layernorm`` that follows it.
"""

from __future__ import annotations

import functools

from torch import nn

from ...ops.norm import add_rms_norm_gemma
from .._patching import Patch, _unhooked, restore_forwards, swap_forwards
from .._pins import Pin, forward_verdict
from ..norm import _float_norm_eps, computes_gemma_rms_norm
from . import Family

_USE = "patch rms_norm_gemma (rms_norm_gemma kernel, offset 1)"

FAMILY = Family(
    name="gemma",
    model_types=("gemma", "gemma2", "gemma3_text"),
    pins=(Pin("gemma", "GemmaRMSNorm.forward", "6fae0a5e1216d30d", _USE),
          Pin("gemma", "GemmaRMSNorm._norm", "53678ba7610507ed", _USE),
          Pin("gemma3", "Gemma3DecoderLayer.forward", "19bb15ae20d3bae5",
              "patch gemma_add_norm (its fused decoder forward; Gemma 2's is the same code)")),
    presets=("gemma-3-1b", "gemma-2-2b"),
    covered="every RMSNorm in Gemma's order (q/k norms included), RoPE (Llama's code); opt-in "
            "(include=['fused_gate_up_geglu']): GeGLU on one fused gate/up GEMM",
    not_covered="embedding scale, softcaps, attention (sdpa), the residual adds (opt-in patch gemma_add_norm fuses "
                "one per layer), GEMMs",
    default=True,
)


# ---------------------------------------------------------------------------------------------
# Patch gemma_add_norm (opt-in): norm, residual add, norm -> norm, one fused add + norm
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


#: This module's patch row (gathered by ``layers/_registry.py``): opt-in until the H200 bench times it
#: (its kernel, ``add_rms_norm_gemma``, runs by default in Qwen3.5's decoder).
PATCH_ROWS = [Patch("gemma_add_norm", apply=patch_gemma_add_norm, undo=unpatch_gemma_add_norm, default=False,
                    description="Gemma 2 / 3 decoder layers' attention residual add fused into their "
                                "pre_feedforward_layernorm")]
