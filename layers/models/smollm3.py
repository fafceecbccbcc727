"""The SmolLM3 family (transformers 5.22.2).

SmolLM3's decoder layer, norms, MLP and rotary embedding are Llama's code; its attention skips RoPE
on every ``no_rope_layer_interval``-th layer (NoPE layers, ``use_rope`` per layer). By code identity
the ``RMSNorm`` hub layer, the decoder patch (residual adds fused into the norms), ``fused_gate_up``
and, on the RoPE layers, the ``rotary_pos_emb`` hub layer run as they do for Llama. The attention
forward is its own (``fused_qkv`` refuses it). No function of SmolLM3's own is reproduced: Llama's
pins gate what runs.
"""

from __future__ import annotations

from . import Family

FAMILY = Family(
    name="smollm3",
    model_types=("smollm3",),
    presets=("smollm3-3b",),
    covered="RMSNorm fused with the residual adds, RoPE on the RoPE layers, SwiGLU on fused gate/up, static-cache "
            "and padded decode attention (patch cutile_attention)",
    not_covered="q/k/v projections (its own attention forward), prefill attention (sdpa), GEMMs",
)
