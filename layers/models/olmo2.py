"""The OLMo 2 family (OLMo 2; transformers 5.22.2).

What differs from the Llama code: the decoder normalises after attention and after the MLP
(``post_attention_layernorm`` / ``post_feedforward_layernorm`` on the block outputs, before the
residual add), the q/k norms run over the whole projection before the head split, and
``Olmo2RMSNorm`` computes in float32 and rounds once. The ``RMSNorm`` hub layer leaves that norm
stock (Llama's order only); the patch ``rms_norm_olmo2`` (``layers/norm.py``, default) runs it, and
every class with its code (Olmo3, GptOss, DeepseekV4, ...), on the ``rms_norm_gemma`` kernel with
offset 0. The MLP is Llama's code, so ``fused_gate_up`` applies by default. Its
``apply_rotary_pos_emb`` (hub function ``rotary_pos_emb``) takes the rotary embedding's float32
cos/sin and casts each result back to q's dtype: the RoPE hub layer runs it on the rope kernel's
float32-cos variants (``apply_rope_cast``).
"""

from __future__ import annotations

from .._pins import Pin
from . import Family

FAMILY = Family(
    name="olmo2",
    model_types=("olmo2",),
    pins=(Pin("olmo2", "Olmo2RMSNorm.forward", "192b385f090ad22f", "patch rms_norm_olmo2 (rms_norm_gemma kernel, offset 0)"),
          Pin("olmo2", "apply_rotary_pos_emb", "1e670b93dd6109e2", "rotary_pos_emb hub layer (rope kernel, float32 cos/sin)")),
    presets=("olmo-2-1b",),
    covered="every RMSNorm in OLMo 2's float32 order (q/k norms included), RoPE (float32 cos/sin), SwiGLU on fused gate/up",
    not_covered="GEMMs (cuBLAS), the post-norm residual adds, attention (sdpa)",
    default=True,
)
