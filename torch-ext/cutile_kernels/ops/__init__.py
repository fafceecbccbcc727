"""Torch custom ops over the cuTile kernels, one module per op family, and their functional API."""

from .activation import (gelu_tanh_and_mul_fused, gelu_tanh_and_mul_fused_reference, sigmoid_and_mul,
                         sigmoid_and_mul_reference, silu, silu_and_mul, silu_and_mul_fused, silu_and_mul_fused_reference,
                         silu_and_mul_reference, silu_reference)
from .attention import attention, attention_reference, rope_append_attention, rope_append_attention_reference
from .conv1d import causal_conv1d, causal_conv1d_reference, causal_conv1d_update, causal_conv1d_update_reference
from .gemv import (gemv, gemv_geglu, gemv_geglu_reference, gemv_reference, gemv_residual, gemv_residual_reference,
                   gemv_swiglu, gemv_swiglu_reference, glu_linear, linear, linear_residual)
from .gated_delta import gated_delta_gates, gated_delta_gates_reference, gated_delta_rule, gated_delta_rule_reference
from .kv_cache import kv_append, kv_append_reference
from .norm import (add_rms_norm, add_rms_norm_gemma, add_rms_norm_gemma_reference, add_rms_norm_reference, rms_norm,
                   rms_norm_add_gemma, rms_norm_add_gemma_reference, rms_norm_gated, rms_norm_gated_reference,
                   rms_norm_gemma, rms_norm_gemma_reference, rms_norm_reference)
from .qk_norm_rope import (qk_norm_rope, qk_norm_rope_gemma, qk_norm_rope_gemma_reference, qk_norm_rope_olmo2,
                           qk_norm_rope_olmo2_reference, qk_norm_rope_reference)
from .rope import (apply_rope, apply_rope_cast, apply_rope_cast_reference, apply_rope_reference, rope_append,
                   rope_append_reference)
from .rope_cos_sin import rope_cos_sin, rope_cos_sin_reference

__all__ = ["attention", "attention_reference", "rope_append_attention", "rope_append_attention_reference", "causal_conv1d", "causal_conv1d_reference", "causal_conv1d_update",
           "causal_conv1d_update_reference", "gated_delta_gates", "gated_delta_gates_reference", "gemv", "gemv_geglu", "gemv_geglu_reference", "gemv_reference",
           "gemv_residual", "gemv_residual_reference", "gemv_swiglu", "gemv_swiglu_reference", "glu_linear", "linear", "linear_residual", "gated_delta_rule", "gated_delta_rule_reference", "rms_norm_gated",
           "rms_norm_gated_reference", "kv_append", "kv_append_reference", "gelu_tanh_and_mul_fused", "gelu_tanh_and_mul_fused_reference", "add_rms_norm", "add_rms_norm_gemma", "add_rms_norm_gemma_reference",
           "add_rms_norm_reference", "rms_norm", "rms_norm_add_gemma", "rms_norm_add_gemma_reference", "rms_norm_gemma",
           "rms_norm_gemma_reference", "rms_norm_reference",
           "apply_rope", "apply_rope_cast", "apply_rope_cast_reference", "apply_rope_reference", "qk_norm_rope", "qk_norm_rope_gemma",
           "qk_norm_rope_gemma_reference", "qk_norm_rope_olmo2", "qk_norm_rope_olmo2_reference", "qk_norm_rope_reference", "rope_append", "rope_append_reference", "rope_cos_sin", "rope_cos_sin_reference",
           "sigmoid_and_mul", "sigmoid_and_mul_reference", "silu", "silu_and_mul", "silu_and_mul_fused", "silu_and_mul_fused_reference",
           "silu_and_mul_reference", "silu_reference"]
