"""The Granite family (IBM Granite 3.x dense; transformers 5.22.2).

Granite's modules are Llama's code except the decoder layer and the model: the residual branches
are scaled by ``residual_multiplier``, the embedding by ``embedding_multiplier`` and the logits
divided by ``logits_scaling``; the attention's ``attention_multiplier`` is its ``scaling`` (set at
init; the forward is Llama's). So by code identity the ``RMSNorm`` and ``rotary_pos_emb`` hub layers
and ``fused_gate_up`` run as they do for Llama (and the opt-in ``fused_qkv`` and ``rope_cos_sin``).
``GraniteDecoderLayer.forward`` is Llama's with each block's output multiplied by
``residual_multiplier`` before its residual add (``residual + hidden_states * m``): registered here
as a Llama-like decoder with that branch scale, so patch ``decoder_add_rms_norm`` fuses the adds
into the norms (the product stays PyTorch's multiply, then our ``add_rms_norm`` forms the sum
exactly as the stock add rounds it). Its pin gates that. Decoder classes with the same forward's
code take it too (by code identity: ``GraniteSWADecoderLayer``, the text decoder of Granite 4
Vision in 5.22.2).
"""

from __future__ import annotations

from .._pins import Pin
from ..patch import register_llama_like_decoder
from . import Family

DECODER_PIN = "granite.GraniteDecoderLayer.forward"

FAMILY = Family(
    name="granite",
    model_types=("granite",),
    pins=(Pin("granite", "GraniteDecoderLayer.forward", "37d37a90d9546860",
              "patch decoder_add_rms_norm (the fused forward with residual_multiplier as the branch scale)"),),
    presets=("granite-3.3-2b",),
    covered="RMSNorm fused with the residual adds (the branch scaled by residual_multiplier first), RoPE, SwiGLU on "
            "fused gate/up (Llama's code); static-cache and padded decode attention; opt-in: fused q/k/v, RoPE cos/sin",
    not_covered="the residual branches' multiply by residual_multiplier, embedding and logit multipliers, the last "
                "layer's residual add, prefill attention (sdpa), GEMMs",
)


def _decoder_reference():
    from transformers.models.granite.modeling_granite import GraniteDecoderLayer

    return GraniteDecoderLayer.forward


register_llama_like_decoder(DECODER_PIN, _decoder_reference, None, branch_scale="residual_multiplier")

__all__ = ["DECODER_PIN", "FAMILY"]
