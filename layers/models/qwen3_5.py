"""The Qwen3.5 family (its text decoder, ``qwen3_5_text``; transformers 5.22.2). Issue 16's model.

A hybrid: three gated-DeltaNet (linear attention) layers to one gated full-attention layer. What is
ours so far comes by code identity with other families: the MLP is Llama's code (``fused_gate_up``
by default) and ``Qwen3_5RMSNorm`` is ``GemmaRMSNorm``'s code (``(1 + weight)``, float32, one
rounding). transformers decorates it ``RMSNormZeroCentered``, so ``from_pretrained``'s kernelize
binds our hub layer for that name (``layers/norm.py``), which runs it on the ``rms_norm_gemma``
kernel, q/k norms of the full-attention layers included; ``cutile_kernels.patch`` on a model loaded
without kernels reaches it through the ``rms_norm_gemma`` patch. Not ours yet: the gated delta rule (chunked prefill, recurrent decode), its causal
depthwise convolution and gated RMSNorm (``RMSNormGated``), the gated attention's output gate, and
its partial RoPE; flash-linear-attention is the anchor to beat there. No function of Qwen3.5's own
is reproduced yet, so no pin of its own.
"""

from __future__ import annotations

from . import Family

FAMILY = Family(
    name="qwen3_5",
    model_types=("qwen3_5_text",),
    presets=("qwen3.5-0.8b",),
    covered="SwiGLU on fused gate/up, the (1 + weight) RMSNorms (hub layer RMSNormZeroCentered)",
    not_covered="gated DeltaNet (delta rule, conv1d, gated RMSNorm), gated attention, RoPE, GEMMs",
    default=False,
)
