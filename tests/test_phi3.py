"""The Phi-3 family's patches (layers/models/phi3.py): phi3_mlp (up * silu(gate) on the fused
gate/up output), phi3_rope (partial RoPE of q and k in one launch) and decoder_add_rms_norm on its
decoder layers (the residual adds fused into the norms). CPU: stock logits exactly
(the reference paths), the ops in a fullgraph compile, what is left alone; GPU: as close to float32
as stock bf16."""

from __future__ import annotations

import logging

import pytest
import torch

import cutile_kernels
import families
from cutile_kernels import dispatch
from cutile_kernels.layers.models import phi3

PATCHES = ["phi3_mlp", "phi3_rope"]


@pytest.mark.parametrize("partial", [0.5, 0.75, 1.0])
def test_patches_keep_stock_logits_and_run_our_ops(partial):
    model = families.model("phi3", partial_rotary_factor=partial)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = model(ids).logits
    n = model.config.num_hidden_layers
    by_default = cutile_kernels.patch(model).changed  # both are default patches
    assert by_default["phi3_rope"] == n and by_default["phi3_mlp"] == n
    assert cutile_kernels.patch(model, names=PATCHES).changed == {"phi3_mlp": 0, "phi3_rope": 0}
    dispatch.reset_stats()
    with torch.no_grad():
        got = model(ids).logits
    assert torch.equal(got, want)
    calls = dispatch.stats()["reference_calls"]
    assert calls["silu_and_mul"] == n and calls["rope"] == n


def test_other_activations_and_forwards_are_left_alone(caplog):
    model = families.model("phi3", hidden_act="gelu_pytorch_tanh")
    with caplog.at_level(logging.INFO, logger="cutile_kernels"):
        report = cutile_kernels.patch(model, names=PATCHES)
    assert report.changed == {"phi3_mlp": 0, "phi3_rope": model.config.num_hidden_layers}
    assert "leaves 3 Phi3MLP alone: activation_fn is GELUTanh, not SiLU" in caplog.text
    assert phi3.mlp_verdict(torch.nn.Module) == "its forward is not Phi3MLP.forward's code"
    assert phi3.attention_verdict(torch.nn.Module) == "its forward is not Phi3Attention.forward's code"


def test_decoder_layers_take_the_fused_residual_adds(caplog):
    """Patch decoder_add_rms_norm (a default) fuses Phi-3's decoder layers, whose forward is Llama's
    with residual dropouts of p = 0: stock logits exactly, each layer's adds on add_rms_norm (in the
    layer, and into the next layer's input norm); a dropout of p > 0 keeps the stock forward."""
    model = families.model("phi3")
    n = model.config.num_hidden_layers
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(ids).logits
    assert cutile_kernels.patch(model).changed["decoder_add_rms_norm"] == n
    dispatch.reset_stats()
    with torch.no_grad():
        got = model(ids).logits
    assert torch.equal(got, want)
    assert dispatch.stats()["reference_calls"]["add_rms_norm"] == 2 * n - 1  # the last layer's add stays
    dropped = families.model("phi3", resid_pdrop=0.1)
    with caplog.at_level(logging.INFO, logger="cutile_kernels"):
        report = cutile_kernels.patch(dropped, names=["decoder_add_rms_norm"])
    assert report.changed == {"decoder_add_rms_norm": 0}
    assert "its resid_attn_dropout is not a hook-free nn.Dropout with p = 0" in caplog.text
    layer = model.model.layers[0]
    assert phi3.decoder_layer_check(layer) is None
    handle = layer.resid_mlp_dropout.register_forward_hook(lambda *a: None)
    try:
        assert "resid_mlp_dropout" in phi3.decoder_layer_check(layer)
    finally:
        handle.remove()


def test_fused_decoder_layers_follow_their_dropouts_after_patching():
    """The dropout check is asked at every call: a hook on a residual dropout added after patching
    runs (that layer takes its own forward), and a dropout turned on for training (p > 0) drops
    as stock drops, the same elements for the same seed."""
    model = families.model("phi3")
    stock = families.model("phi3")
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(6))
    cutile_kernels.patch(model, names=["decoder_add_rms_norm"])
    seen = []
    handle = model.model.layers[1].resid_attn_dropout.register_forward_hook(lambda m, a, out: seen.append(m))
    with torch.no_grad():
        got, want = model(ids).logits, stock(ids).logits
    handle.remove()
    assert len(seen) == 1 and torch.equal(got, want)
    for m in (model, stock):
        m.train()
        for layer in m.model.layers:
            layer.resid_attn_dropout.p = layer.resid_mlp_dropout.p = 0.5
    outs = []
    for m in (model, stock):
        torch.manual_seed(11)
        with torch.no_grad():
            outs.append(m(ids).logits)
    assert torch.equal(outs[0], outs[1])
    torch.manual_seed(12)
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, outs[0])  # the dropout does drop


def test_patched_model_compiles_fullgraph_with_our_ops():
    model = families.model("phi3", layers=2)
    cutile_kernels.patch(model, names=PATCHES + ["decoder_add_rms_norm"])
    frames, targets, got, want = families.compile_fullgraph(model, seed=8)
    assert frames == 1
    assert any(t.endswith("silu_and_mul.default") for t in targets) and any(t.endswith("rope.default") for t in targets)
    assert any(t.endswith("add_rms_norm.default") for t in targets)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("partial", [0.75, 1.0])
def test_gpu_patched_model_is_as_close_to_float32_as_stock(partial, strict):
    ours_rel, stock_rel, report = families.relative_errors_vs_float32("phi3", PATCHES + ["decoder_add_rms_norm"],
                                                                      seq=41, partial_rotary_factor=partial)
    assert report.changed == {"phi3_mlp": 3, "phi3_rope": 3, "decoder_add_rms_norm": 3}
    assert ours_rel <= 1.1 * stock_rel, (ours_rel, stock_rel)
