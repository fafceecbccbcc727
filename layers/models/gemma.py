"""The Gemma family (Gemma, Gemma 2, Gemma 3 text; transformers 5.22.2).

What differs from the Llama code: ``GemmaRMSNorm`` multiplies by ``1 + weight`` and rounds once,
after the multiply, in float32 (not decorated for the hub: the patch ``rms_norm_gemma`` of
``layers/norm.py`` reaches it, on the ``rms_norm_gemma`` kernel, by default since the H200 bench of
2026-12-01: gemma-3-1b decode 1.8x, prefill 1.7x over our build without it); four norms per decoder layer
(Gemma 2 and 3), GeGLU with ``gelu_pytorch_tanh`` (LlamaMLP's code with another activation: the
opt-in ``fused_gate_up_geglu`` of ``layers/mlp.py`` stacks gate and up and runs our GeGLU), the embedding scaled by sqrt(hidden), sliding
and global layers, logit softcaps (Gemma 2), q/k norms and two RoPE bases (Gemma 3). Gemma's
attention and rotary embedding are Llama's code, so the opt-in ``fused_qkv`` and ``rope_cos_sin``
apply to Gemma 1 as they are.
"""

from __future__ import annotations

from .._pins import Pin
from . import Family

_USE = "patch rms_norm_gemma (rms_norm_gemma kernel, offset 1)"

FAMILY = Family(
    name="gemma",
    model_types=("gemma", "gemma2", "gemma3_text"),
    pins=(Pin("gemma", "GemmaRMSNorm.forward", "6fae0a5e1216d30d", _USE),
          Pin("gemma", "GemmaRMSNorm._norm", "53678ba7610507ed", _USE)),
    presets=("gemma-3-1b", "gemma-2-2b"),
    covered="every RMSNorm in Gemma's order (q/k norms included), RoPE (Llama's code); opt-in "
            "(include=['fused_gate_up_geglu']): GeGLU on one fused gate/up GEMM",
    not_covered="embedding scale, softcaps, attention (sdpa), the residual adds, GEMMs",
    default=True,
)
