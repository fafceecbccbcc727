"""The Llama-code decoders: Llama, Mistral and Qwen2 (transformers 5.22.2).

Their modeling files are Llama's code (Mistral and Qwen2 differ in the attention's sliding window
and biases, which the reproduced forwards carry through). What we run for them is the shared
features of ``layers/``: the RMSNorm and RoPE hub layers, the decoder patch (residual add + norm
fused, direct module calls), the fused gate/up MLP and q/k/v, the RoPE cos/sin table (opt-in), and
``attn_implementation="cutile"``. The pins below are the Llama functions those features reproduce,
and the Mistral and Qwen2 attention forwards that the fused q/k/v forward reproduces.
"""

from __future__ import annotations

from .._pins import Pin
from . import Family

_ATTN_USE = "patch fused_qkv and the decoder patch's direct attention call (their reproduced forward)"

FAMILY = Family(
    name="llama",
    model_types=("llama", "mistral", "qwen2"),
    pins=(
        Pin("llama", "LlamaRMSNorm.forward", "50b8139e32eaccc8",
            "the RMSNorm hub layer and every norm fusion (rms_norm, add_rms_norm, qk_norm_rope kernels)"),
        Pin("llama", "apply_rotary_pos_emb", "257620718ecff20c", "the rotary_pos_emb hub layer (rope kernel)"),
        Pin("llama", "rotate_half", "b92c1a98279c25d0", "the rotary_pos_emb hub layer and qk_norm_rope (rope kernel)"),
        Pin("llama", "LlamaRotaryEmbedding.forward", "a002b01d1bd09ade", "patch rope_cos_sin (rope_cos_sin kernel)"),
        Pin("llama", "LlamaDecoderLayer.forward", "b139d1b607c01194", "patch decoder_add_rms_norm (its fused forward)"),
        Pin("llama", "LlamaMLP.forward", "5b8abf7af12a4b42", "patch fused_gate_up (silu_and_mul kernel)"),
        Pin("llama", "LlamaAttention.forward", "edb09e4cdb72174c", _ATTN_USE),
        Pin("mistral", "MistralAttention.forward", "ea92a9846ca1ecb5", _ATTN_USE),
        Pin("qwen2", "Qwen2Attention.forward", "992c57d97163d600", _ATTN_USE),
        # Matched, not reproduced (reported only): the model's layer loop the decoder patch's
        # cross-layer handoff relies on.
        Pin("llama", "LlamaModel.forward", "b9c0eae1e2b38972", "patch decoder_add_rms_norm's cross-layer handoff under "
            "inference_mode (its layer loop, verified when patched)", gates=False),
    ),
    presets=("llama-3.2-1b", "mistral-7b-v0.3", "qwen2.5-1.5b"),
    covered="RMSNorm (fused with the residual add), RoPE, SwiGLU on fused gate/up, fused q/k/v, static-cache and "
            "padded decode attention (patch cutile_attention), RoPE cos/sin (opt-in)",
    not_covered="GEMMs (cuBLAS), embedding, sampling, prefill and unpadded DynamicCache decode attention (sdpa)",
)
