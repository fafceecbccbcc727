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
float32-cos variants (``apply_rope_cast``). The opt-in patch ``olmo2_norm_add`` (below) runs each
post-norm block's norm and residual add as one ``rms_norm_add_gemma`` launch.

OLMo 3 (``modeling_olmo3.py``) is OLMo 2's code (``Olmo3RMSNorm``, ``apply_rotary_pos_emb``, the MLP
and the decoder forward compile to OLMo 2's, so OLMo 2's pins gate it) with sliding-window layers
(three of every four in the released 7B and 32B, a window of 4096) and a rotary embedding per layer
type; those go through transformers' masks and caches, and through the decode fast path's sliding
cache layers.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ...ops.norm import rms_norm_add_gemma
from .._patching import Patch, _unhooked, restore_forwards, swap_forwards
from .._pins import Pin, forward_verdict
from ..norm import _float_norm_eps, olmo2_formula_norm
from . import Family

FAMILY = Family(
    name="olmo2",
    model_types=("olmo2", "olmo3"),
    pins=(Pin("olmo2", "Olmo2RMSNorm.forward", "192b385f090ad22f", "patch rms_norm_olmo2 (rms_norm_gemma kernel, offset 0)"),
          Pin("olmo2", "apply_rotary_pos_emb", "1e670b93dd6109e2",
              "rotary_pos_emb hub layer (rope kernel, float32 cos/sin)"),
          Pin("olmo2", "Olmo2DecoderLayer.forward", "4a69e6dc2cbadaf9",
              "patch olmo2_norm_add (its post-norm decoder forward)")),
    presets=("olmo-2-1b", "olmo-3-7b"),
    covered="every RMSNorm in OLMo 2's float32 order (q/k norms included), RoPE (float32 cos/sin), SwiGLU on fused "
            "gate/up, static-cache and padded decode attention (patch cutile_attention)",
    not_covered="GEMMs (cuBLAS), the post-norm residual adds (opt-in patch olmo2_norm_add fuses them into the "
                "norms), prefill attention (sdpa)",
    default=True,
)


# ---------------------------------------------------------------------------------------------
# Patch olmo2_norm_add (opt-in): each post-norm block's norm and residual add in one launch
# ---------------------------------------------------------------------------------------------
#
# Estimate, written before the patch (Amdahl), OLMo-2-1B on the H200 (2026-12-03): two adds a layer,
# 32 launches of a step go. In the decode fast path (1.58 / 1.89 ms a step at b=1 / 16, ~2-3 us a
# small launch) f ~ 0.04, s -> inf for what goes: ceiling ~1.04x, which would bring b=16 from 0.95x
# to about stock-compile's time; in eager decode (host-paced, ~25 us a launch of ~12 ms) ~1.07x.

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


#: This module's patch row (gathered by ``layers/_registry.py``): opt-in until the H200 bench times it.
PATCH_ROWS = [Patch("olmo2_norm_add", apply=patch_olmo2_norm_add, undo=unpatch_olmo2_norm_add, default=False,
                    description="OLMo 2 decoder layers' post-norms and residual adds fused (rms_norm_add_gemma)")]
