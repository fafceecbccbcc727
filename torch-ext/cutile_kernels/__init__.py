"""cutile-kernels: cuTile kernels for Hugging Face transformers models.

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, device_map="cuda",
        use_kernels=True, kernel_config=cutile_kernels.kernel_config())

Layout of the package (the same in a source checkout and in a build variant):

* ``kernel_src``: cuTile device code and build matrices (no torch);
* ``registry``, ``cubin``, ``launcher``, ``dispatch``: pick a prebuilt variant whose compiled
  assumptions the tensors satisfy and launch it through cuda-python (else JIT, else fallback);
* ``ops``: torch custom ops with fake implementations, and the functional API;
* ``layers``: ``kernels``-convention layers, the kernelize mapping, ``kernel_config``, ``kernelize``.
"""

from . import dispatch, layers, registry
from .dispatch import FallbackError, reset_stats, stats
from .layers import CacheFullError, disable_decode_graphs, enable_decode_graphs, kernel_config, kernelize
from .ops import attention, attention_reference, gelu_tanh_and_mul_fused, gelu_tanh_and_mul_fused_reference
from .ops import (apply_rope, apply_rope_cast, apply_rope_cast_reference, apply_rope_reference, rope_append,
                  rope_append_attention, rope_append_attention_reference, rope_append_reference, rope_cos_sin,
                  rope_cos_sin_reference)
from .ops import (kv_append, kv_append_reference, qk_norm_rope, qk_norm_rope_gemma, qk_norm_rope_gemma_reference,
                  qk_norm_rope_olmo2, qk_norm_rope_olmo2_reference, qk_norm_rope_reference, sigmoid_and_mul,
                  sigmoid_and_mul_reference)
from .ops import (causal_conv1d, causal_conv1d_reference, causal_conv1d_update, causal_conv1d_update_reference,
                  gated_delta_gates, gated_delta_gates_reference, gated_delta_rule, gated_delta_rule_reference,
                  gemv, gemv_geglu, gemv_geglu_reference, gemv_reference, gemv_residual, gemv_residual_reference,
                  gemv_swiglu, gemv_swiglu_reference, rms_norm_gated, rms_norm_gated_reference)
from .ops._dtypes import UnsupportedDtypeError
from .layers.patch import patch, unpatch
from .ops import (add_rms_norm, add_rms_norm_gemma, add_rms_norm_gemma_reference, add_rms_norm_reference, rms_norm,
                  rms_norm_add_gemma, rms_norm_add_gemma_reference, rms_norm_gemma, rms_norm_gemma_reference,
                  rms_norm_reference, silu, silu_and_mul,
                  silu_and_mul_fused, silu_and_mul_fused_reference, silu_and_mul_reference, silu_reference)

__version__ = "0.1.0"

__all__ = [
    "CacheFullError",
    "FallbackError",
    "UnsupportedDtypeError",
    "add_rms_norm",
    "add_rms_norm_gemma",
    "add_rms_norm_gemma_reference",
    "apply_rope",
    "apply_rope_cast",
    "apply_rope_cast_reference",
    "apply_rope_reference",
    "attention",
    "attention_reference",
    "add_rms_norm_reference",
    "causal_conv1d",
    "causal_conv1d_reference",
    "causal_conv1d_update",
    "causal_conv1d_update_reference",
    "disable_decode_graphs",
    "dispatch",
    "enable_decode_graphs",
    "gated_delta_gates",
    "gated_delta_gates_reference",
    "gated_delta_rule",
    "gated_delta_rule_reference",
    "gemv",
    "gemv_geglu",
    "gemv_geglu_reference",
    "gemv_reference",
    "gemv_residual",
    "gemv_residual_reference",
    "gemv_swiglu",
    "gemv_swiglu_reference",
    "gelu_tanh_and_mul_fused",
    "gelu_tanh_and_mul_fused_reference",
    "kernel_config",
    "kernelize",
    "kv_append",
    "kv_append_reference",
    "layers",
    "patch",
    "qk_norm_rope",
    "qk_norm_rope_gemma",
    "qk_norm_rope_gemma_reference",
    "qk_norm_rope_olmo2",
    "qk_norm_rope_olmo2_reference",
    "qk_norm_rope_reference",
    "registry",
    "reset_stats",
    "rms_norm",
    "rms_norm_gated",
    "rms_norm_gated_reference",
    "rms_norm_add_gemma",
    "rms_norm_add_gemma_reference",
    "rms_norm_gemma",
    "rms_norm_gemma_reference",
    "rms_norm_reference",
    "rope_append",
    "rope_append_attention",
    "rope_append_attention_reference",
    "rope_append_reference",
    "rope_cos_sin",
    "rope_cos_sin_reference",
    "sigmoid_and_mul",
    "sigmoid_and_mul_reference",
    "silu",
    "silu_and_mul",
    "silu_and_mul_fused",
    "silu_and_mul_fused_reference",
    "silu_and_mul_reference",
    "silu_reference",
    "stats",
    "unpatch",
]
