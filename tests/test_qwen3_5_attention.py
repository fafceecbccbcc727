"""The Qwen3.5 family's patch ``qwen3_5_rope`` (layers/models/qwen3_5.py): gated attention's q/k
norms and partial RoPE of q and k on one ``qk_norm_rope_gemma`` launch, its output gate on one ``sigmoid_and_mul``. CPU: stock logits exactly
over a prefill and cached decode steps (the reference path), hooked norms, the op in a fullgraph
compile, what is left alone, undo; GPU: as close to float32 as stock bf16, the kernel launched."""

from __future__ import annotations

import logging

import pytest
import torch

import cutile_kernels
import families
from cutile_kernels import dispatch
from cutile_kernels.layers.models import qwen3_5 as fam

pytest.importorskip("transformers")


def _attention(model):
    return [m for m in model.modules() if type(m).__name__ == "Qwen3_5Attention"]


@pytest.mark.parametrize("partial", [0.25, 0.5, 1.0])
def test_patch_keeps_stock_logits_runs_the_rope_op_and_undoes(partial):
    model = families.model("qwen3_5_text", layers=4, partial_rotary_factor=partial)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(4))
    want = families.prefill_and_step(model, ids)
    n = len(_attention(model))
    assert n and cutile_kernels.patch(model, names=["qwen3_5_rope"]).changed == {"qwen3_5_rope": n}
    assert cutile_kernels.patch(model).changed["qwen3_5_rope"] == 0  # a default: already applied
    dispatch.reset_stats()
    assert torch.equal(families.prefill_and_step(model, ids), want)
    assert dispatch.stats()["reference_calls"]["qk_norm_rope_gemma"] == 2 * n  # the prefill and the step
    assert "rope" not in dispatch.stats()["reference_calls"]
    assert dispatch.stats()["reference_calls"]["sigmoid_and_mul"] == 2 * n  # the output gate
    assert fam.unpatch_qwen3_5_rope(model) == n
    assert not any("forward" in vars(m) for m in _attention(model))


def test_hooked_norms_run_the_norm_modules_and_other_norms_are_refused(caplog):
    model = families.model("qwen3_5_text", layers=4)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(5))
    want = families.prefill_and_step(model, ids)
    cutile_kernels.patch(model, names=["qwen3_5_rope"])
    seen = []
    handle = _attention(model)[0].k_norm.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    dispatch.reset_stats()
    assert torch.equal(families.prefill_and_step(model, ids), want)
    handle.remove()
    assert len(seen) == 2  # the hook fired in the prefill and the step
    calls = dispatch.stats()["reference_calls"]
    assert calls["rope"] == 2 and calls["qk_norm_rope_gemma"] == 2 * len(_attention(model)) - 2
    fam.unpatch_qwen3_5_rope(model)
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    attn = _attention(model)[0]
    attn.q_norm = LlamaRMSNorm(attn.head_dim)
    assert fam._rope_attention_verdict(attn) == "its q_norm / k_norm are not GemmaRMSNorm-formula norms"
    attn = _attention(model)[1]
    attn.k_norm.eps = 1e-3
    assert "are not one float" in fam._rope_attention_verdict(attn)
    attn.k_norm.eps = attn.q_norm.eps
    assert fam._rope_attention_verdict(attn) is None
    # A forward replaced on the instance (an offload hook, a wrapper) is not the formula's: refused;
    # our hub layer's forward bound there (kernelize's) is.
    from cutile_kernels.layers.norm import CutileZeroCenteredRMSNorm

    attn.q_norm.forward = lambda x: x
    assert fam._rope_attention_verdict(attn) == "its q_norm / k_norm are not GemmaRMSNorm-formula norms"
    attn.q_norm.forward = CutileZeroCenteredRMSNorm.forward.__get__(attn.q_norm)
    assert fam._rope_attention_verdict(attn) is None
    with caplog.at_level(logging.INFO, logger="cutile_kernels"):  # the Llama-norm layer refused, the other taken
        assert cutile_kernels.patch(model, names=["qwen3_5_rope"]).changed == {"qwen3_5_rope": 1}
    assert "its q_norm / k_norm are not GemmaRMSNorm-formula norms" in caplog.text


def test_other_attention_code_and_rope_are_left_alone(caplog, change_pin):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    assert fam.attention_verdict(Qwen3Attention) == "its forward is not Qwen3_5Attention.forward's code"
    model = families.model("qwen3", layers=2)
    with caplog.at_level(logging.INFO, logger="cutile_kernels"):
        assert cutile_kernels.patch(model, names=["qwen3_5_rope"]).changed == {"qwen3_5_rope": 0}
    change_pin("qwen3_5.apply_rotary_pos_emb")
    fam.attention_verdict.cache_clear()
    try:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention

        assert "is not the one reproduced" in fam.attention_verdict(Qwen3_5Attention)
    finally:
        fam.attention_verdict.cache_clear()


def test_patched_model_compiles_fullgraph_with_the_op():
    model = families.model("qwen3_5_text", layers=4)
    cutile_kernels.patch(model, names=["qwen3_5_rope"])
    frames, targets, got, want = families.compile_fullgraph(model, seed=9)
    assert frames == 1
    assert any(t.endswith("qk_norm_rope_gemma.default") for t in targets)
    assert any(t.endswith("sigmoid_and_mul.default") for t in targets)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.gpu
def test_gpu_patched_model_is_as_close_to_float32_as_stock(strict, stock_functions):
    before = dispatch.stats()["launches"]
    ours_rel, stock_rel, report = families.relative_errors_vs_float32("qwen3_5_text", ["qwen3_5_rope"], seq=41,
                                                                      layers=4)
    assert report.changed == {"qwen3_5_rope": 2}  # the tiny config alternates linear and full attention
    assert any(k.startswith("qk_norm_rope_gemma_kernel") and n > before.get(k, 0)
               for k, n in dispatch.stats()["launches"].items())
    assert ours_rel <= 1.1 * stock_rel, (ours_rel, stock_rel)
