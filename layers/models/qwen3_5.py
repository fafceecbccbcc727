"""The Qwen3.5 family (its text decoder, ``qwen3_5_text``; transformers 5.22.2). Issue 16's model.

A hybrid: three gated-DeltaNet (linear attention) layers to one gated full-attention layer.

Ours, through transformers' own hub names (``kernelize`` binds them for ``use_kernels=True``):
the gated DeltaNet's decode functions ``fused_recurrent_gated_delta_rule`` (the cache's state
updated in place) and ``causal_conv1d_update``, its prefill functions ``chunk_gated_delta_rule`` and
``causal_conv1d_fn``, and its output norm ``RMSNormGated`` (``layers/gated_delta.py``,
``layers/norm.py``), each on a cuTile kernel, for the functions pinned below; and the block's own
forward (hub name ``Qwen3_5GatedDeltaNet``), the stock statements with its gates ``g`` and ``beta``
on one kernel instead of eight launches. Where other models'
copies compile to the same code they are taken too (transformers 5.22: the delta rules, conv
functions and gated norms of Qwen3.5-MoE, Qwen3-Next and OLMo-hybrid, the conv functions of
Mamba-style models; benched on Qwen3.5 only). By code identity with other families: the MLP is Llama's
code (``fused_gate_up`` by default) and ``Qwen3_5RMSNorm`` is ``GemmaRMSNorm``'s (hub name
``RMSNormZeroCentered``, the ``rms_norm_gemma`` kernel, q/k norms included). Its own patches:
``qwen3_5_add_norm`` fuses the token mixer's residual add into ``post_attention_layernorm``; the
``qwen3_5_rope`` runs the gated attention's q/k norms and partial RoPE of q and k on one
``qk_norm_rope_gemma`` launch and its sigmoid output gate on one ``sigmoid_and_mul`` launch;
``qwen3_5_stacked_proj`` stacks the gated DeltaNet's ``in_proj_qkv``, ``in_proj_b`` and
``in_proj_a`` into one GEMM (all three default). Not ours yet: the MLP block's residual add.
flash-linear-attention is the anchor to beat (bench path ``stock+fla``).
"""

from __future__ import annotations

import functools
import logging
from collections import Counter

import torch
from torch import nn

from ...ops.norm import add_rms_norm_gemma
from ...ops.rope import apply_rope
from .._direct import attend, gemma_qk_norm_rope, linear
from .._fusion import Stacking, fuse_one, linear_problem, reduce_fused, unfuse_one
from .._patching import Patch, _unhooked, modeling_globals, own_forward_on_instance, restore_forwards, swap_forwards
from .._pins import Pin, forward_verdict
from ..gated_delta import STACKED_NAME, CutileGatedDeltaNet, computes_gated_deltanet
from ..norm import _float_norm_eps, computes_gemma_rms_norm, gemma_qk_norms_verdict
from ..rope import partial_rope_attention_verdict
from . import Family

logger = logging.getLogger("cutile_kernels")

_USE = "the gated DeltaNet hub layers (layers/gated_delta.py, layers/norm.py)"

FAMILY = Family(
    name="qwen3_5",
    model_types=("qwen3_5_text",),
    pins=(Pin("qwen3_5", "torch_chunk_gated_delta_rule", "d34a65ad3dc11ef5", _USE),
          Pin("qwen3_5", "torch_recurrent_gated_delta_rule", "ef7d50478944ddb9", _USE),
          Pin("qwen3_5", "causal_conv1d_fn", "7ddda1f7a343e530", _USE),
          Pin("qwen3_5", "causal_conv1d_update", "2b276ec2aa0eccac", _USE),
          Pin("qwen3_5", "l2norm", "77030f67029093a9", _USE),
          Pin("qwen3_5", "Qwen3_5RMSNormGated.forward", "97e83e4eb4774929", _USE),
          Pin("qwen3_5", "Qwen3_5GatedDeltaNet.forward", "19465e347e2f257d",
              "the gated DeltaNet hub layer (layers/gated_delta.py: its gates on one launch)"),
          Pin("qwen3_5", "Qwen3_5DecoderLayer.forward", "3e22f5284a113a68",
              "patch qwen3_5_add_norm (its fused decoder forward)"),
          Pin("qwen3_5", "Qwen3_5Attention.forward", "475c60b3e5e177fb", "patch qwen3_5_rope (its attention forward)"),
          Pin("qwen3_5", "apply_rotary_pos_emb", "f01c1a539cf87fe4",
              "patch qwen3_5_rope (qk_norm_rope_gemma kernel, partial rotary)")),
    presets=("qwen3.5-0.8b", "qwen3.5-27b"),
    covered="gated DeltaNet's delta rule (chunked prefill, recurrent decode), causal conv1d and its update, "
            "its gates (g, beta) and its gated RMSNorm (hub layers); SwiGLU on fused gate/up; the (1 + weight) "
            "RMSNorms (hub layer RMSNormZeroCentered), the post-attention one fused with the residual add; "
            "the attention's q/k norms and partial RoPE in one launch and its output gate in one; three input "
            "projections as one GEMM",
    not_covered="the MLP block's residual add, the embedding, prefill attention (sdpa), GEMMs",
    default=True,
)


# ---------------------------------------------------------------------------------------------
# Patch qwen3_5_add_norm: the token mixer's residual add fused into post_attention_layernorm
# ---------------------------------------------------------------------------------------------

#: The pin (in :data:`FAMILY`) of the decoder forward :func:`fused_decoder_forward` reproduces.
DECODER_PIN = "qwen3_5.Qwen3_5DecoderLayer.forward"


@functools.lru_cache(maxsize=None)
def decoder_verdict(cls: type) -> str | None:
    """Why ``cls`` (a decoder layer class) does not take :func:`fused_decoder_forward`, or None if
    it does: its forward must be ``Qwen3_5DecoderLayer.forward``'s code, still the pinned one."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    return forward_verdict(cls, DECODER_PIN, Qwen3_5DecoderLayer.forward)


def _decoder_verdict(m: nn.Module) -> str | None:
    why = decoder_verdict(type(m))
    if why is None and not computes_gemma_rms_norm(type(m.post_attention_layernorm)):
        why = "its post_attention_layernorm is not the (1 + weight) RMSNorm (GemmaRMSNorm's code)"
    return why


def fused_decoder_forward(self, hidden_states, position_embeddings, attention_mask=None, position_ids=None,
                          past_key_values=None, **kwargs):
    """``Qwen3_5DecoderLayer.forward`` (5.22.2) with the token mixer's residual add fused into
    ``post_attention_layernorm``: one ``add_rms_norm_gemma`` launch (the sum rounded to the
    activations' dtype, as the stock add rounds it, then the stock norm's formula) instead of an add
    and a norm. Same arguments and result. A post norm with hooks takes the stock lines."""
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    if self.block_type == "linear_attention":
        hidden_states = self.linear_attn(hidden_states=hidden_states, cache_params=past_key_values,
                                         attention_mask=attention_mask, **kwargs)
    elif self.block_type == "full_attention":
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                          position_ids=position_ids, past_key_values=past_key_values,
                                          position_embeddings=position_embeddings, **kwargs)
    post = self.post_attention_layernorm
    if _unhooked(post):
        hidden_states, residual = add_rms_norm_gemma(hidden_states, residual, post.weight, _float_norm_eps(post), 1.0)
    else:
        residual = residual + hidden_states
        hidden_states = post(residual)
    hidden_states = self.mlp(hidden_states)
    return residual + hidden_states


def patch_qwen3_5_add_norm(model: nn.Module) -> int:
    """Patch ``qwen3_5_add_norm``: bind :func:`fused_decoder_forward` to every decoder layer whose
    class's forward is Qwen3.5's (pinned) and whose ``post_attention_layernorm`` computes the
    ``(1 + weight)`` norm; others are left alone with a log line per class. The MLP block's add stays
    a plain add (no hand-off to the next layer's norm, unlike Llama's ``decoder_add_rms_norm``).
    Returns the layers newly patched."""
    new = swap_forwards(model, "qwen3_5_add_norm", fused_decoder_forward,
                        lambda m: all(hasattr(m, a) for a in ("block_type", "input_layernorm",
                                                              "post_attention_layernorm", "mlp")),
                        _decoder_verdict, "residual add fused into post_attention_layernorm in {n} {cls}")
    return sum(new.values())


def unpatch_qwen3_5_add_norm(model: nn.Module) -> int:
    """Undo :func:`patch_qwen3_5_add_norm`: the class forward again. Returns the layers restored."""
    return restore_forwards(model, "qwen3_5_add_norm", fused_decoder_forward, noun="layers")


# ---------------------------------------------------------------------------------------------
# Patch qwen3_5_rope (opt-in): gated attention's partial RoPE of q and k on one launch
# ---------------------------------------------------------------------------------------------

#: The pins (in :data:`FAMILY`) of the attention forward and the RoPE :func:`rope_attention_forward`
#: reproduces.
ATTN_PIN = "qwen3_5.Qwen3_5Attention.forward"
ROPE_PIN = "qwen3_5.apply_rotary_pos_emb"


@functools.lru_cache(maxsize=None)
def attention_verdict(cls: type) -> str | None:
    """Why attention class ``cls`` does not take :func:`rope_attention_forward`, or None if it does:
    its forward must be ``Qwen3_5Attention.forward``'s code calling Qwen3.5's partial-rotary
    ``apply_rotary_pos_emb`` (with Llama's ``rotate_half``), both still the pinned statements."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return partial_rope_attention_verdict(cls, (ATTN_PIN, ROPE_PIN), modeling_qwen3_5.Qwen3_5Attention.forward,
                                          modeling_qwen3_5.apply_rotary_pos_emb, "Qwen3.5's partial-rotary formula")


def _rope_attention_verdict(m: nn.Module) -> str | None:
    return attention_verdict(type(m)) or gemma_qk_norms_verdict(m)


def rope_attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None,
                           **kwargs):
    """``Qwen3_5Attention.forward`` (5.22.2) with ``q_norm``, ``k_norm`` and the partial-rotary
    ``apply_rotary_pos_emb`` as one ``qk_norm_rope_gemma`` launch for q and k (the first
    ``cos.shape[-1]`` elements of each head rotate, the rest pass through), instead of about
    fourteen. The output gate and the rest are the stock lines. Same arguments and result. A call
    whose norms have hooks runs the norm modules and one ``apply_rope`` instead."""
    glob = modeling_globals(self)  # the stock forward's module: its attention registry, eager path, RoPE
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    # The gate stays a (B, S, H, D) view of the projection: attend's sigmoid_and_mul reads it in place
    # (stock reshapes it, a copy).
    query_states, gate = torch.chunk(linear(self.q_proj, hidden_states).view(*input_shape, -1, self.head_dim * 2),
                                     2, dim=-1)
    query_states = query_states.view(hidden_shape).transpose(1, 2)
    key_states = linear(self.k_proj, hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = linear(self.v_proj, hidden_states).view(hidden_shape).transpose(1, 2)

    cos, sin = position_embeddings
    fused = gemma_qk_norm_rope(self, query_states, key_states, cos, sin)
    if fused is not None:
        query_states, key_states = fused
    else:  # the norm modules (their hooks fire) on the (B, S, H, D) views, as the stock forward runs them
        query_states = self.q_norm(query_states.transpose(1, 2)).transpose(1, 2)
        key_states = self.k_norm(key_states.transpose(1, 2)).transpose(1, 2)
        query_states, key_states = apply_rope(query_states, key_states, cos, sin)
    return attend(self, glob, input_shape, query_states, key_states, value_states, attention_mask, past_key_values,
                  kwargs, {}, gate=gate)


def patch_qwen3_5_rope(model: nn.Module) -> int:
    """Patch ``qwen3_5_rope``: bind :func:`rope_attention_forward` to every attention module whose
    class passes :func:`attention_verdict` and whose ``q_norm`` / ``k_norm`` compute
    ``Qwen3_5RMSNorm``'s formula with one eps. Returns the modules newly patched."""
    new = swap_forwards(model, "qwen3_5_rope", rope_attention_forward,
                        lambda m: all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm")),
                        _rope_attention_verdict,
                        "q/k norms and partial RoPE of {n} {cls} on one cuTile launch", modeling=True)
    return sum(new.values())


def unpatch_qwen3_5_rope(model: nn.Module) -> int:
    """Undo :func:`patch_qwen3_5_rope`. Returns the modules restored."""
    return restore_forwards(model, "qwen3_5_rope", rope_attention_forward)


# ---------------------------------------------------------------------------------------------
# Patch qwen3_5_stacked_proj (opt-in): in_proj_qkv, in_proj_b and in_proj_a as one GEMM
# ---------------------------------------------------------------------------------------------

_STACKED_STOCK = ("in_proj_qkv", "in_proj_b", "in_proj_a")


def _stacked_rows(module: nn.Module) -> tuple[slice, slice, slice]:
    # q/k/v rows (the conv channels), then b's and a's (one per value head).
    n, h = module.conv_dim, module.num_v_heads
    return slice(0, n), slice(n, n + h), slice(n + h, n + 2 * h)


@functools.lru_cache(maxsize=None)
def stacked_class(cls: type) -> type:
    """The subclass of ``cls`` a stacked gated DeltaNet module is switched to: its forward is
    :class:`~..gated_delta.CutileGatedDeltaNet`'s, which projects through the stacked weight."""
    return type(f"CutileStacked{cls.__name__}", (cls,), {
        "forward": CutileGatedDeltaNet.forward,
        "_cutile_unfused_class": cls,
        "__module__": __name__,
        "__reduce_ex__": functools.partialmethod(reduce_fused, _STACKING),  # pickles via the stock class
        "__doc__": f"{cls.__name__} with in_proj_qkv, in_proj_b and in_proj_a stacked into {STACKED_NAME}.",
    })


_STACKING = Stacking(stock=_STACKED_STOCK, fused=STACKED_NAME, row_slices=_stacked_rows, fused_class=stacked_class,
                     unfused_attr="_cutile_unfused_class", hooks_attr="_cutile_fusion_hooks")


def _stackable_forward(m: nn.Module) -> bool:
    """Whether ``m``'s forward may give way to the stacked class's: its class's (also as kernels
    binds it on the instance) or our block layer's, which kernelize binds from the build's copy of
    this package (the same code, judged by name)."""
    bound = m.__dict__.get("forward")
    return (bound is None or own_forward_on_instance(m)
            or getattr(getattr(bound, "__func__", None), "__qualname__", "") == CutileGatedDeltaNet.forward.__qualname__)


def stacking_verdict(m: nn.Module) -> str | None:
    """Why gated DeltaNet module ``m`` is not stacked, or None: its class must compute Qwen3.5's
    block (pinned), its forward must be its class's or our hub layer's (nobody else replaced it),
    its conv1d without accelerate hooks (the stacked forward does not fire them), and the three
    projections plain bias-free ``nn.Linear`` layers of one dtype and device (``_fusion``'s rules)."""
    if STACKED_NAME in m._modules:
        return "already stacked"
    if not computes_gated_deltanet(type(m)):
        return "its forward is not Qwen3_5GatedDeltaNet.forward's code"
    if not _stackable_forward(m):
        return "its forward is already replaced on the instance (e.g. an accelerate hook)"
    if getattr(m.conv1d, "_hf_hook", None) is not None:
        return "its conv1d has accelerate hooks"
    layers = [getattr(m, n, None) for n in _STACKED_STOCK]
    for name, layer in zip(_STACKED_STOCK, layers):
        why = linear_problem(layer)
        if why is not None:
            return f"{name} {why}"
    if len({(l.weight.dtype, l.weight.device, l.in_features) for l in layers}) != 1:
        return "its projections differ in dtype, device or input size"
    return None


def patch_qwen3_5_stacked_proj(model: nn.Module) -> int:
    """Patch ``qwen3_5_stacked_proj``: stack ``in_proj_qkv``, ``in_proj_b`` and ``in_proj_a`` of every
    gated DeltaNet module that :func:`stacking_verdict` allows into one ``nn.Linear``
    (:data:`~..gated_delta.STACKED_NAME`, weight rows in that order) and switch its class to
    :func:`stacked_class` (forward: our block layer's, one GEMM instead of three; ``in_proj_z`` stays
    apart, its rows would need a copy before the gated norm). ``state_dict`` keeps the stock keys and
    bytes (``layers/_fusion.py``). Returns the modules newly stacked."""
    done, refused = [], Counter()
    for m in model.modules():
        if not all(hasattr(m, a) for a in ("in_proj_z", "conv1d", "A_log", "dt_bias")):
            continue
        why = stacking_verdict(m)
        if why is None:
            fuse_one(m, _STACKING)
            done.append(type(m).__name__)
        elif why != "already stacked":
            refused[(type(m).__name__, why)] += 1
    if done:
        logger.info("cutile_kernels: patch qwen3_5_stacked_proj: stacked in_proj_qkv, in_proj_b and in_proj_a of "
                    "%d %s", len(done), ", ".join(sorted(set(done))))
    for (cls, why), n in sorted(refused.items()):
        logger.info("cutile_kernels: patch qwen3_5_stacked_proj leaves %d %s alone: %s", n, cls, why)
    return len(done)


def unpatch_qwen3_5_stacked_proj(model: nn.Module) -> int:
    """Undo :func:`patch_qwen3_5_stacked_proj`: the three stock projections (copies of the row
    blocks) and the stock class again. Returns the modules restored."""
    targets = [m for m in model.modules() if STACKED_NAME in m._modules
               and getattr(type(m), "_cutile_unfused_class", None) is not None]
    for m in targets:
        unfuse_one(m, _STACKING)
    return len(targets)


#: This module's patch rows (gathered by ``layers/_registry.py``). ``qwen3_5_add_norm`` is a default
#: since the H200 bench of 2026-12-02 (docs/results.md, fifth session); ``qwen3_5_rope`` and
#: ``qwen3_5_stacked_proj`` since the sixth session's (a quarter fewer launches, prefill 0.72x).
PATCH_ROWS = [Patch("qwen3_5_add_norm", apply=patch_qwen3_5_add_norm, undo=unpatch_qwen3_5_add_norm,
                    description="Qwen3.5 decoder layers' residual add fused into their (1 + weight) "
                                "post_attention_layernorm"),
              Patch("qwen3_5_rope", apply=patch_qwen3_5_rope, undo=unpatch_qwen3_5_rope,
                    description="Qwen3.5 gated attention's q/k norms and partial RoPE in one cuTile launch, "
                                "its sigmoid output gate in one"),
              Patch("qwen3_5_stacked_proj", apply=patch_qwen3_5_stacked_proj, undo=unpatch_qwen3_5_stacked_proj,
                    description="Qwen3.5 gated DeltaNet's in_proj_qkv, in_proj_b and in_proj_a as one GEMM")]
