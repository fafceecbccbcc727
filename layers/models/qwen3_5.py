"""The Qwen3.5 family (its text decoder, ``qwen3_5_text``; transformers 5.22.2). Issue 16's model.

A hybrid: three gated-DeltaNet (linear attention) layers to one gated full-attention layer.

Ours, through transformers' own hub names (``kernelize`` binds them for ``use_kernels=True``):
the gated DeltaNet's decode functions ``fused_recurrent_gated_delta_rule`` (the cache's state
updated in place) and ``causal_conv1d_update``, its prefill functions ``chunk_gated_delta_rule`` and
``causal_conv1d_fn``, and its output norm ``RMSNormGated`` (``layers/gated_delta.py``,
``layers/norm.py``), each on a cuTile kernel, for the functions pinned below. Where other models'
copies compile to the same code they are taken too (transformers 5.22: the delta rules, conv
functions and gated norms of Qwen3.5-MoE, Qwen3-Next and OLMo-hybrid, the conv functions of
Mamba-style models; benched on Qwen3.5 only). By code identity with other families: the MLP is Llama's
code (``fused_gate_up`` by default) and ``Qwen3_5RMSNorm`` is ``GemmaRMSNorm``'s (hub name
``RMSNormZeroCentered``, the ``rms_norm_gemma`` kernel, q/k norms included). Not ours yet: the
projections' split and the gates' elementwise math (``g``, ``beta``), the gated attention's output
gate and its partial RoPE. flash-linear-attention is the anchor to beat (bench path ``stock+fla``).
"""

from __future__ import annotations

from .._pins import Pin
from . import Family

_USE = "the gated DeltaNet hub layers (layers/gated_delta.py, layers/norm.py)"

FAMILY = Family(
    name="qwen3_5",
    model_types=("qwen3_5_text",),
    pins=(Pin("qwen3_5", "torch_chunk_gated_delta_rule", "d34a65ad3dc11ef5", _USE),
          Pin("qwen3_5", "torch_recurrent_gated_delta_rule", "ef7d50478944ddb9", _USE),
          Pin("qwen3_5", "causal_conv1d_fn", "7ddda1f7a343e530", _USE),
          Pin("qwen3_5", "causal_conv1d_update", "2b276ec2aa0eccac", _USE),
          Pin("qwen3_5", "l2norm", "77030f67029093a9", _USE),
          Pin("qwen3_5", "Qwen3_5RMSNormGated.forward", "97e83e4eb4774929", _USE)),
    presets=("qwen3.5-0.8b", "qwen3.5-27b"),
    covered="gated DeltaNet's delta rule (chunked prefill, recurrent decode), causal conv1d and its update, "
            "and its gated RMSNorm (hub layers); SwiGLU on fused gate/up; the (1 + weight) RMSNorms (hub "
            "layer RMSNormZeroCentered)",
    not_covered="the q/k/v/z/b/a projections' split and gates (g, beta), gated attention's output gate, "
                "partial RoPE, GEMMs",
    default=True,
)
