"""The Phi-3 family (Phi-3, Phi-3.5, Phi-4-mini; transformers 5.22.2), and its opt-in patches
``phi3_mlp`` and ``phi3_rope``.

What differs from the Llama code: q/k/v and gate/up are fused in the checkpoint (``qkv_proj``,
``gate_up_proj``), RoPE may be partial (``partial_rotary_factor``: Phi-4-mini rotates 3/4 of each
head) with its own ``apply_rotary_pos_emb``, and LongRoPE scales the frequencies past
``original_max_position_embeddings`` (inside the rotary embedding, which is Llama's code: the cos/sin
tables carry the scaling, so the kernels need nothing of it). The norms are Llama's code: the
``RMSNorm`` hub layer runs them by default.

* ``decoder_add_rms_norm`` (the Llama code's patch, ``layers/patch.py``) takes Phi-3's decoder
  layers too: their forward is Llama's with a residual dropout after each block, the identity at
  ``p = 0`` (:func:`decoder_layer_check`), so each residual add runs fused into the next RMSNorm.
* ``phi3_mlp``: ``Phi3MLP.forward`` with ``up * silu(gate)`` on our ``silu_and_mul`` kernel, which
  reads both halves of the fused GEMM output in one pass (the product commutes exactly, so the
  rounding is stock's).
* ``phi3_rope``: ``Phi3Attention.forward`` with its ``apply_rotary_pos_emb`` (the first R elements
  of each head rotated, the rest passed through) as one ``apply_rope`` launch for q and k (the
  pass-through copied in it where ``D - R <= 32``: Phi-4-mini); in the decode graphs' and compiled
  steps RoPE and the static cache write as one ``rope_append`` launch (``_direct.rope_and_cache``).

Both check the class's code against the pinned statements when patching and leave any other class
alone with a log line. Both are on by default: ``phi3_rope`` since the H200 bench of 2026-12-01
accepted it (phi-3-mini-4k decode b=1 2.0x, prefill 1.3x over our build without it), ``phi3_mlp``
since that of 2026-12-05 (Phi-4-mini over stock eager, our build with it against without, per
round: prefill 1.41x and 1.41x against 1.33x and 1.34x, decode b=16 1.15x and 1.15x against 1.00x
and 1.14x, b=1 1.20x and 1.00x against 0.94x and 1.18x; its prefill's non-GEMM device time in our
kernels 58 % against 31 %). On phi-3-mini-4k it had been mixed (2026-12-01, one round: b=1 1.17x,
b=16 0.93x).
"""

from __future__ import annotations

import functools

from torch import nn

from ...ops.activation import silu_and_mul
from ...ops.rope import apply_rope
from .._direct import attend, linear, rope_and_cache
from .._match import same_code
from .._patching import Patch, _unhooked, modeling_globals, restore_forwards, swap_forwards
from .._pins import TRANSFORMERS, Pin, holds
from ..patch import register_llama_like_decoder
from ..rope import partial_rope_attention_verdict
from . import Family

MLP_PIN, ATTN_PIN, ROPE_PIN = ("phi3.Phi3MLP.forward", "phi3.Phi3Attention.forward", "phi3.apply_rotary_pos_emb")

FAMILY = Family(
    name="phi3",
    model_types=("phi3",),
    pins=(Pin("phi3", "Phi3MLP.forward", "3d1e633d3a91c93e", "patch phi3_mlp (silu_and_mul kernel)"),
          Pin("phi3", "Phi3Attention.forward", "3d29f7a1c8d3bd49", "patch phi3_rope (its reproduced forward)"),
          Pin("phi3", "apply_rotary_pos_emb", "53f4abb0b4b23f1f", "patch phi3_rope (rope kernel, partial rotary)"),
          Pin("phi3", "Phi3DecoderLayer.forward", "49dc13ee8c789647",
              "patch decoder_add_rms_norm (Llama's fused forward, the residual dropouts at p = 0)")),
    presets=("phi-3-mini-4k", "phi-4-mini"),
    covered="RMSNorm (Llama's code) with the residual adds fused in (patch decoder_add_rms_norm, where the "
            "residual dropouts are p = 0), partial RoPE of q and k in one launch (the pass-through copied in it; in "
            "the decode graphs with the cache write), static-cache and padded decode attention (patch "
            "cutile_attention), SwiGLU on the fused gate/up output (patch phi3_mlp)",
    not_covered="GEMMs (cuBLAS), prefill attention (sdpa), the last layer's residual add",
    default=True,
)


# ---------------------------------------------------------------------------------------------
# decoder_add_rms_norm on Phi-3's decoder layers
# ---------------------------------------------------------------------------------------------

DECODER_PIN = "phi3.Phi3DecoderLayer.forward"


def _decoder_reference():
    from transformers.models.phi3.modeling_phi3 import Phi3DecoderLayer

    return Phi3DecoderLayer.forward


def decoder_layer_check(layer: nn.Module) -> str | None:
    """Why a Phi-3 decoder layer does not compute ``LlamaDecoderLayer.forward``'s math, which patch
    ``decoder_add_rms_norm``'s fused forward computes, or None if it does: ``Phi3DecoderLayer.forward``
    is Llama's with ``resid_attn_dropout`` / ``resid_mlp_dropout`` applied to each block's output
    before its residual add, so both must be hook-free ``nn.Dropout`` of ``p = 0`` (the identity,
    in training too; Phi-3 and Phi-4-mini ship ``resid_pdrop = 0.0``). Checked when patched: a ``p``
    set later is not seen."""
    for name in ("resid_attn_dropout", "resid_mlp_dropout"):
        drop = getattr(layer, name, None)
        if type(drop) is not nn.Dropout or drop.p != 0 or not _unhooked(drop):
            return f"its {name} is not a hook-free nn.Dropout with p = 0 (the fused forward has no dropout)"
    return None


register_llama_like_decoder(DECODER_PIN, _decoder_reference, decoder_layer_check)


# ---------------------------------------------------------------------------------------------
# phi3_mlp
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def mlp_verdict(cls: type) -> str | None:
    """Why MLP class ``cls`` does not take :func:`fused_mlp_forward`, or None if it does."""
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    if not holds(MLP_PIN):
        return f"this transformers' Phi3MLP.forward is not the one the patch reproduces ({TRANSFORMERS})"
    if not same_code(getattr(cls, "forward", None), Phi3MLP.forward):
        return "its forward is not Phi3MLP.forward's code"
    return None


def _mlp_verdict(m: nn.Module) -> str | None:
    from transformers.activations import SiLUActivation

    why = mlp_verdict(type(m))
    if why is None and type(getattr(m, "activation_fn", None)) not in (SiLUActivation, nn.SiLU):
        why = f"activation_fn is {type(getattr(m, 'activation_fn', None)).__name__}, not SiLU"
    return why


def fused_mlp_forward(self, hidden_states):
    """``Phi3MLP.forward`` (5.22.2) with ``up * silu(gate)`` as one ``silu_and_mul`` launch on the two
    halves of ``gate_up_proj``'s output. Same arguments and result."""
    gate, up = linear(self.gate_up_proj, hidden_states).chunk(2, dim=-1)
    return linear(self.down_proj, silu_and_mul(gate, up))


def patch_phi3_mlp(model: nn.Module) -> int:
    """Patch ``phi3_mlp`` (module docstring). Returns the number of MLPs newly patched."""
    new = swap_forwards(model, "phi3_mlp", fused_mlp_forward,
                        lambda m: hasattr(m, "gate_up_proj") and hasattr(m, "down_proj"), _mlp_verdict,
                        "up * silu(gate) of {n} {cls} on one cuTile launch")
    return sum(new.values())


def unpatch_phi3_mlp(model: nn.Module) -> int:
    """Undo :func:`patch_phi3_mlp`. Returns the modules restored."""
    return restore_forwards(model, "phi3_mlp", fused_mlp_forward)


# ---------------------------------------------------------------------------------------------
# phi3_rope
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def attention_verdict(cls: type) -> str | None:
    """Why attention class ``cls`` does not take :func:`rope_attention_forward`, or None if it does:
    its forward must be ``Phi3Attention.forward``'s code calling Phi-3's ``apply_rotary_pos_emb``,
    both still the pinned statements."""
    from transformers.models.phi3 import modeling_phi3

    return partial_rope_attention_verdict(cls, (ATTN_PIN, ROPE_PIN), modeling_phi3.Phi3Attention.forward,
                                          modeling_phi3.apply_rotary_pos_emb, "Phi-3's partial-rotary formula")


def rope_attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
    """``Phi3Attention.forward`` (5.22.2) with ``apply_rotary_pos_emb`` as one ``apply_rope`` launch
    for q and k (partial rotary: the first ``cos.shape[-1]`` elements of each head), or with the
    static cache update too as one ``rope_append`` launch in a decode graph's or a compiled step
    (:func:`~.._direct.rope_and_cache`). Same arguments and result."""
    glob = modeling_globals(self)  # the stock forward's module: its attention registry, eager path, RoPE
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    qkv = linear(self.qkv_proj, hidden_states)
    query_pos = self.config.num_attention_heads * self.head_dim
    query_states = qkv[..., :query_pos]
    key_states = qkv[..., query_pos : query_pos + self.num_key_value_heads * self.head_dim]
    value_states = qkv[..., query_pos + self.num_key_value_heads * self.head_dim :]

    query_states = query_states.view(hidden_shape).transpose(1, 2)
    key_states = key_states.view(hidden_shape).transpose(1, 2)
    value_states = value_states.view(hidden_shape).transpose(1, 2)

    cos, sin = position_embeddings
    # A decode-graph or compiled step: RoPE and the cache write in one launch where the layer allows it.
    written = rope_and_cache(self, None, past_key_values, query_states, key_states, value_states, cos, sin)
    if written is not None:
        query_states, key_states, value_states = written
    else:
        query_states, key_states = apply_rope(query_states, key_states, cos, sin)

    return attend(self, glob, input_shape, query_states, key_states, value_states, attention_mask, past_key_values,
                  kwargs, {"sliding_window": getattr(self.config, "sliding_window", None)},
                  cache_written=written is not None)


def patch_phi3_rope(model: nn.Module) -> int:
    """Patch ``phi3_rope`` (module docstring). Returns the number of attention modules newly patched."""
    new = swap_forwards(model, "phi3_rope", rope_attention_forward,
                        lambda m: hasattr(m, "qkv_proj") and hasattr(m, "o_proj"),
                        lambda m: attention_verdict(type(m)),
                        "RoPE of q and k of {n} {cls} on one cuTile launch", modeling=True)
    return sum(new.values())


def unpatch_phi3_rope(model: nn.Module) -> int:
    """Undo :func:`patch_phi3_rope`. Returns the modules restored."""
    return restore_forwards(model, "phi3_rope", rope_attention_forward)


#: This module's patch rows (gathered by ``layers/_registry.py``), judged by the H200 bench
#: (``cutile-kernels bench phi-4-mini --paths stock cutile~phi3_mlp cutile cutile~phi3_rope``, docs/results.md).
PATCH_ROWS = [
    Patch("phi3_mlp", apply=patch_phi3_mlp, undo=unpatch_phi3_mlp, default=True,
          description="Phi-3 MLP's up * silu(gate) on the fused gate/up output, one cuTile launch"),
    Patch("phi3_rope", apply=patch_phi3_rope, undo=unpatch_phi3_rope, default=True,
          description="Phi-3 attention's partial RoPE of q and k in one cuTile launch"),
]

__all__ = ["ATTN_PIN", "FAMILY", "MLP_PIN", "ROPE_PIN", "attention_verdict", "fused_mlp_forward", "mlp_verdict",
           "patch_phi3_mlp", "patch_phi3_rope", "rope_attention_forward", "unpatch_phi3_mlp", "unpatch_phi3_rope"]
