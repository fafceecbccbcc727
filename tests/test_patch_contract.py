"""The contract every registered patch keeps, alone, on every model family (tests/families.py; CPU).

On the families a patch claims it changes modules; on every family the patched model's logits equal
the stock model's (the CPU runs the reference formulas, which are the stock ones), save_pretrained
writes the stock checkpoint byte for byte, and unpatch leaves the stock model: the same logits, no
instance forward and no hook of ours. A new patch adds its row to CLAIMS (the test fails until it
does).
"""

from __future__ import annotations

import pytest
import torch

import cutile_kernels
import families
from cutile_kernels.layers._patching import PATCHES
from cutile_kernels.layers.models import claimed_model_types

#: patch -> the model types whose models it changes (the rest it must leave alone). A patch checks
#: code identity per class, so it also takes unclaimed families that copy the code it reproduces.
CLAIMS = {
    "gemma2_attention": {"gemma2"},  # the one family here without an sdpa path
    "cutile_attention": set(families.FAMILIES) - {"gemma2"},  # every claimed family attending with sdpa
    "masked_prefill_attention": set(families.FAMILIES),  # a mark on every attention module ("cutile" reads it)
    "decoder_add_rms_norm": {"llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3", "granite"},  # Phi-3: dropouts p = 0
    "fused_gate_up": {"llama", "mistral", "qwen2", "qwen3", "olmo2", "olmo3", "granite", "smollm3", "qwen3_5_text"},  # LlamaMLP
    "rope_cos_sin": {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "granite", "smollm3", "phi3"},  # Llama's rotary
    "qk_norm_rope": {"qwen3"},  # Qwen3Attention's code only
    "fused_qkv": {"llama", "mistral", "qwen2", "gemma", "granite"},  # Llama-code attention (Qwen3's: qk_norm_rope)
    "rms_norm_gemma": {"gemma", "gemma2", "gemma3_text", "qwen3_5_text"},  # GemmaRMSNorm's code
    "rms_norm_olmo2": {"olmo2", "olmo3"},  # Olmo2RMSNorm's code (Olmo3RMSNorm copies it)
    "olmo2_norm_add": {"olmo2", "olmo3"},  # Olmo2DecoderLayer's code (Olmo3's is the same)
    "olmo2_qk_norm_rope": {"olmo2", "olmo3"},  # Olmo2Attention's and Olmo3Attention's code
    "phi3_mlp": {"phi3"},
    "fused_gate_up_geglu": {"gemma", "gemma2", "gemma3_text"},  # LlamaMLP's code with GELUTanh
    "phi3_rope": {"phi3"},
    "qwen3_5_add_norm": {"qwen3_5_text"},  # Qwen3_5DecoderLayer's code
    "qwen3_5_rope": {"qwen3_5_text"},  # Qwen3_5Attention's code
    "gemma_add_norm": {"gemma2", "gemma3_text"},  # Gemma3DecoderLayer's code (Gemma 2's is the same)
    "qwen3_5_stacked_proj": {"qwen3_5_text"},  # Qwen3_5GatedDeltaNet's code
    "gemma3_qk_norm_rope": {"gemma3_text"},  # Gemma3Attention's code
    "gemv": set(families.FAMILIES),  # every decoder layer's nn.Linear projections
    "dynamic_cache_prefill": set(families.FAMILIES),  # every family's full or sliding DynamicCache layers
}

#: patch -> {model type: config fields over its tiny row} where the row's shapes are ones the patch
#: declines: olmo2_qk_norm_rope's kernel has no tile for head_dim 16 (tests/test_qk_norm_rope_olmo2.py
#: checks that it leaves those alone).
FIELDS = {"olmo2_qk_norm_rope": {"olmo2": families.OLMO_KERNEL_HEADS, "olmo3": families.OLMO_KERNEL_HEADS}}

#: Patches whose CPU path is not the stock arithmetic: gemma2_attention's attention reference forms
#: the softmax in another order than eager's (tests/test_attention.py holds it to the kernel).
NOT_BITWISE = {"gemma2_attention"}


def test_every_patch_has_a_claims_row():
    assert set(CLAIMS) == set(PATCHES)
    claimed = set(families.CLAIMED)
    for name, types in CLAIMS.items():
        assert types <= set(families.FAMILIES), name
        # every patch covers some family the package claims (by default or through opt-in patches)
        assert types & (claimed if PATCHES[name].default else set(claimed_model_types(opt_in=True))), name


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _ours(model) -> list[str]:
    """Modules carrying an instance forward or a hook: what a patch may leave behind."""
    left = [n for n, m in model.named_modules() if "forward" in m.__dict__]
    left += [n for n, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]
    return left


@pytest.mark.parametrize("model_type", sorted(families.FAMILIES))
@pytest.mark.parametrize("name", sorted(PATCHES))
def test_patch_alone_keeps_stock_logits_and_checkpoint_and_undoes(name, model_type, tmp_path):
    model = families.model(model_type, **FIELDS.get(name, {}).get(model_type, {}))
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    want = _logits(model, ids)
    model.save_pretrained(tmp_path / "stock")
    assert _ours(model) == []

    report = cutile_kernels.patch(model, names=[name])
    changed = report.changed[name]
    assert (changed > 0) == (model_type in CLAIMS[name]), (name, model_type, changed)
    if name in NOT_BITWISE and changed:
        torch.testing.assert_close(_logits(model, ids), want, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(_logits(model, ids), want)
    model.save_pretrained(tmp_path / "patched")
    assert ((tmp_path / "patched" / "model.safetensors").read_bytes()
            == (tmp_path / "stock" / "model.safetensors").read_bytes())

    assert cutile_kernels.unpatch(model, names=[name]).changed.get(name, 0) == changed
    assert _ours(model) == []
    assert torch.equal(_logits(model, ids), want)


@pytest.mark.parametrize("model_type", sorted(families.FAMILIES))
def test_no_patch_is_lost_to_kernelize(model_type):
    # from_pretrained applies the patches, then kernelize rebinds the forward of every hub-decorated
    # module: to our layer where the hub name is ours, else to the class forward. A patched forward
    # on a decorated module survives only through our layer (the float-norm mark, or a hub layer of
    # the same kernel): its hub name must be ours.
    from cutile_kernels import layers

    model = families.model(model_type)
    cutile_kernels.patch(model, names=list(PATCHES))
    at_risk = {type(m).kernel_layer_name for m in model.modules()
               if "forward" in m.__dict__ and hasattr(type(m), "kernel_layer_name")}
    assert at_risk <= set(layers.MAPPING), at_risk - set(layers.MAPPING)
