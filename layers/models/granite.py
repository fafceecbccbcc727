"""The Granite family (IBM Granite 3.x dense; transformers 5.22.2).

Granite's modules are Llama's code except the decoder layer and the model: the residual branches
are scaled by ``residual_multiplier``, the embedding by ``embedding_multiplier`` and the logits
divided by ``logits_scaling``; the attention's ``attention_multiplier`` is its ``scaling`` (set at
init; the forward is Llama's). So by code identity the ``RMSNorm`` and ``rotary_pos_emb`` hub layers
and ``fused_gate_up`` run as they do for Llama (and the opt-in ``fused_qkv`` and ``rope_cos_sin``);
the decoder patch refuses the scaled residual adds and says so. No function of Granite's own is
reproduced, so the family has no pin of its own: Llama's pins gate what runs.
"""

from __future__ import annotations

from . import Family

FAMILY = Family(
    name="granite",
    model_types=("granite",),
    presets=("granite-3.3-2b",),
    covered="RMSNorm, RoPE, SwiGLU on fused gate/up (Llama's code), static-cache and padded decode attention "
            "(patch cutile_attention); opt-in: fused q/k/v, RoPE cos/sin",
    not_covered="the scaled residual adds (left unfused), embedding and logit multipliers, prefill attention (sdpa), "
                "GEMMs",
)
