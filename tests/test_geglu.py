"""GeGLU (Gemma's MLP activation, ``gelu_pytorch_tanh(gate) * up``): the op's reference against
transformers' GemmaMLP, the kernel's tile logic emulated on the CPU against float64, the opt-in
patch ``fused_gate_up_geglu`` on Gemma models, and on the GPU the kernel and the patched model
against float32 references."""

from __future__ import annotations

import math

import pytest
import torch

import cutile_kernels
import cutile_numpy
import families
from cutile_kernels import dispatch
from cutile_kernels.kernel_src import activation as kact
from cutile_kernels.ops import activation as act_ops
from launches import launched_variants
from test_rms_norm_gemma import _assert_stock_non_finite

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_reference_is_gemma_mlps_activation(dtype):
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    mlp = GemmaMLP(GemmaConfig(hidden_size=32, intermediate_size=48, hidden_act="gelu_pytorch_tanh")).to(dtype)
    x = (torch.randn(3, 5, 32) * 2).to(dtype)
    with torch.no_grad():
        gu = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
        got = mlp.down_proj(cutile_kernels.gelu_tanh_and_mul_fused(gu))
        assert torch.equal(got, mlp(x))
    assert cutile_kernels.gelu_tanh_and_mul_fused(gu).is_contiguous()
    with pytest.raises(ValueError, match="is not even"):
        cutile_kernels.gelu_tanh_and_mul_fused(torch.randn(3, 7))


def test_kernel_constants_are_torchs():
    assert kact.GELU_BETA == pytest.approx(math.sqrt(2 / math.pi), rel=1e-15) and kact.GELU_KAPPA == 0.044715


def _exact(x):
    xd = x.double()
    n = xd.shape[-1] // 2
    g, u = xd[..., :n], xd[..., n:]
    return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3))) * u


@pytest.mark.parametrize("rows,n,dtype", [(1, 100, torch.float32), (5, 1000, torch.float32), (19, 6912, torch.float16),
                                          (3, 8960, torch.float32)], ids=str)
def test_emulated_kernel_matches_float64_and_writes_only_its_output(rows, n, dtype):
    x = (torch.randn(rows, 2 * n) * 3).to(dtype)
    buf = torch.full((rows + 2, n + 40), 7.0, dtype=dtype)
    out = buf[1:rows + 1, 8:n + 8]
    out.fill_(float("nan"))
    r, b = kact.TILES["row"]
    run = cutile_numpy.emulate(kact.gelu_tanh_and_mul_fused_kernel, kact)
    run(act_ops._grid(rows, n)({"ROWS": r, "BLOCK": b}), (x.unflatten(-1, (2, n)), out, r, b))
    assert not out.isnan().any(), "an output element was not written"
    outside = torch.ones_like(buf, dtype=torch.bool)
    outside[1:rows + 1, 8:n + 8] = False
    assert (buf[outside] == 7.0).all(), "the kernel wrote outside its output"
    ref, stock = _exact(x), act_ops.gelu_tanh_and_mul_fused_reference(x)
    err = (out.double() - ref).abs().max().item()
    stock_err = (stock.double() - ref).abs().max().item()
    assert err <= 1.1 * stock_err + 4 * torch.finfo(dtype).eps * ref.abs().max().item(), (err, stock_err)


# ---------------------------------------------------------------------------------------------
# The patch on models (CPU: the reference path, so stock numbers exactly)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["gemma", "gemma3_text"])
def test_patch_fuses_every_geglu_mlp_and_keeps_stock_logits(model_type, tmp_path):
    model = families.model(model_type)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path / "stock")
    n = model.config.num_hidden_layers
    assert cutile_kernels.patch(model).changed["fused_gate_up_geglu"] == n  # a default patch
    dispatch.reset_stats()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    assert cutile_kernels.unpatch(model).changed["fused_gate_up_geglu"] == n
    assert cutile_kernels.patch(model, names=["fused_gate_up_geglu"]).changed["fused_gate_up_geglu"] == n
    dispatch.reset_stats()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    assert dispatch.stats()["reference_calls"]["gelu_tanh_and_mul_fused"] == n
    model.save_pretrained(tmp_path / "patched")
    assert ((tmp_path / "patched" / "model.safetensors").read_bytes()
            == (tmp_path / "stock" / "model.safetensors").read_bytes())


def test_swiglu_and_python_gelu_mlps_are_left_alone():
    from cutile_kernels.layers.mlp import why_not_fusable

    llama = families.model("llama")
    assert cutile_kernels.patch(llama, names=["fused_gate_up_geglu"]).changed["fused_gate_up_geglu"] == 0
    gemma = families.model("gemma", hidden_act="gelu_python_tanh")
    assert why_not_fusable(gemma.model.layers[0].mlp, "gelu_tanh").startswith("act_fn is GELUTanh, not GELUTanh on")
    # and the SwiGLU fusion still refuses Gemma's GELU, as before
    assert why_not_fusable(families.model("gemma").model.layers[0].mlp) == "act_fn is GELUTanh, not SiLU"


def test_patched_model_compiles_fullgraph_with_the_op():
    model = families.model("gemma3_text", layers=2)
    cutile_kernels.patch(model, names=["fused_gate_up_geglu", "rms_norm_gemma"])
    frames, targets, got, want = families.compile_fullgraph(model, seed=10)
    assert frames == 1
    assert any("gelu_tanh_and_mul_fused" in t for t in targets) and any("rms_norm_gemma" in t for t in targets)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("rows,n,dtype", [(1, 6912, torch.bfloat16), (16, 6912, torch.bfloat16),
                                          (2048, 6912, torch.bfloat16), (7, 9216, torch.float16),
                                          (33, 1000, torch.float32)], ids=str)
def test_gpu_kernel_matches_float64(rows, n, dtype, strict):
    x = (torch.randn(rows, 2 * n, device="cuda") * 3).to(dtype)
    before = dispatch.stats()["launches"]
    out = cutile_kernels.gelu_tanh_and_mul_fused(x)
    torch.cuda.synchronize()
    assert [v.kernel for v in launched_variants(before)] == ["gelu_tanh_and_mul_fused"]
    ref, stock = _exact(x), act_ops.gelu_tanh_and_mul_fused_reference(x)
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    stock_rel = ((stock.double() - ref).norm() / ref.norm()).item()
    assert rel <= 1.1 * stock_rel + 1e-7, (rel, stock_rel)
    poisoned = torch.full_like(out, float("nan"))
    assert act_ops.dispatch.run("gelu_tanh_and_mul_fused", act_ops._want(rows),
                                (x.view(rows, 2, n), poisoned), 1, act_ops._grid(rows, n))
    torch.cuda.synchronize()
    assert torch.equal(poisoned, out)


@pytest.mark.gpu
def test_gpu_patched_gemma_is_as_close_to_float32_as_stock(strict):
    ours_rel, stock_rel, report = families.relative_errors_vs_float32("gemma3_text",
                                                                      ["fused_gate_up_geglu", "rms_norm_gemma"])
    assert report.changed["fused_gate_up_geglu"] == 3 and report.changed["rms_norm_gemma"] > 0
    assert ours_rel <= 1.1 * stock_rel, (ours_rel, stock_rel)


def _overflowing_gate_up(rows: int, n: int, device="cpu"):
    """fp16 fused gate/up rows past fp16's range: a gate or product past 65504, gates of +-inf and
    NaN, an inf up, and a product that overflows where its factors do not."""
    x = torch.randn(rows, 2 * n, generator=torch.Generator().manual_seed(3)) * 3
    x[0, :4] = torch.tensor([6e4, -6e4, float("inf"), -float("inf")])  # gates
    x[0, n:n + 4] = torch.tensor([2.0, 2.0, 3.0, 3.0])  # their ups: 1.2e5 overflows, -0, inf, stock's -inf * 0
    x[1, 5], x[2, n + 7] = float("nan"), float("inf")
    x[3, 9], x[3, n + 9] = 300.0, 300.0  # 9e4
    return x.half().to(device)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_emulated_kernel_overflows_fp16_where_stock_does():
    """Gemma's activations overflow fp16 in stock too: the kernel gives stock's inf and NaN at the
    same places, and nowhere else."""
    rows, n = 4, 1000
    x = _overflowing_gate_up(rows, n)
    out = torch.full((rows, n), 7.0, dtype=torch.float16)
    r, b = kact.TILES["row"]
    cutile_numpy.emulate(kact.gelu_tanh_and_mul_fused_kernel, kact)(
        act_ops._grid(rows, n)({"ROWS": r, "BLOCK": b}), (x.unflatten(-1, (2, n)), out, r, b))
    _assert_stock_non_finite(out, act_ops.gelu_tanh_and_mul_fused_reference(x))


@pytest.mark.gpu
def test_gpu_kernel_overflows_fp16_where_stock_does(strict):
    x = _overflowing_gate_up(4, 6912, "cuda")  # Gemma-3-1B's intermediate size
    before = dispatch.stats()["launches"]
    out = cutile_kernels.gelu_tanh_and_mul_fused(x)
    torch.cuda.synchronize()
    assert [v.kernel for v in launched_variants(before)] == ["gelu_tanh_and_mul_fused"]
    _assert_stock_non_finite(out, act_ops.gelu_tanh_and_mul_fused_reference(x))
