"""The fallback patcher: the registry, and the residual add fused into the decoder layers' RMSNorms.

On the CPU the fused op takes its reference path, which computes the stock formulas, so a patched
model's logits must equal the stock model's exactly; on the GPU they are compared with a float32
reference (the kernel rounds like the stock add and norm, but is not required to be bit-identical).
"""

from __future__ import annotations

import logging

import pytest
import torch

import cutile_kernels
from cutile_kernels import dispatch
from cutile_kernels.layers import patch as patcher
from cutile_kernels.layers.patch import Patch, PatchReport

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

LOGGER = "cutile_kernels"


def _config(model_type: str, layers: int = 3):
    if model_type == "tiny":
        from cutile_kernels_tools.presets import make_config

        return make_config("tiny")
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256)
    if model_type in ("qwen3", "mistral", "gemma"):
        kw["head_dim"] = 16
    return AutoConfig.for_model(model_type, **kw)


def _model(model_type: str, dtype=torch.float32, layers: int = 3):
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(_config(model_type, layers)).to(dtype).eval()
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:  # norm weights start at 1: make them matter
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
    return model


def _decoder_layers(model):
    return list(model.model.layers)


def _fused(layer) -> bool:
    return getattr(layer.__dict__.get("forward"), "__func__", None) is patcher._fused_decoder_forward


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw)


#: Tests of the decoder patch alone; the MLP fusion has its own tests (tests/test_mlp.py).
DEC = ["decoder_add_rms_norm"]


@pytest.fixture
def ids():
    return torch.randint(0, 256, (2, 11))


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def scratch_registry():
    """The registry, which a test may add to: restored (the same dict, every importer sees it) after."""
    saved = dict(patcher.PATCHES)
    yield patcher.PATCHES
    patcher.PATCHES.clear()
    patcher.PATCHES.update(saved)


def test_registry_has_the_decoder_patch():
    p = patcher.PATCHES["decoder_add_rms_norm"]
    assert p.apply is patcher.fuse_decoder_layers and p.undo is patcher.unfuse_decoder_layers
    assert not p.changes_weights
    assert cutile_kernels.patch is patcher.patch and cutile_kernels.unpatch is patcher.unpatch


def test_register_refuses_a_duplicate_and_unknown_names(scratch_registry):
    with pytest.raises(ValueError, match="already registered"):
        patcher.register(Patch("decoder_add_rms_norm", apply=lambda m: 0))
    patcher.register(Patch("decoder_add_rms_norm", apply=lambda m: 0), replace=True)
    with pytest.raises(KeyError, match="unknown patch"):
        patcher.patch(torch.nn.Linear(2, 2), names=["no_such_patch"])


def test_a_patch_that_does_not_apply_is_not_active(scratch_registry):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))  # no decoder layers: patch gemv leaves the Linear
    report = patcher.patch(model)
    assert isinstance(report, PatchReport)
    assert report.changed == {"gemma2_attention": 0, "cutile_attention": 0, "masked_prefill_attention": 0,
                              "decoder_add_rms_norm": 0, "fused_gate_up": 0, "fused_gate_up_geglu": 0,
                              "gemma_add_norm": 0, "gemma3_qk_norm_rope": 0, "qk_norm_rope": 0,
                              "rms_norm_gemma": 0, "rms_norm_olmo2": 0, "phi3_mlp": 0,
                              "phi3_rope": 0, "qwen3_5_add_norm": 0, "qwen3_5_rope": 0,
                              "qwen3_5_stacked_proj": 0, "dynamic_cache_prefill": 0, "gemv": 0, "olmo2_norm_add": 0,
                              "olmo2_qk_norm_rope": 0} and report.active == []
    assert patcher.applied(model) == {}


class _DoubleWeight:
    """A weight-changing patch for the tests: doubles every Linear's weight (undo halves it)."""

    def __init__(self):
        self.calls = []

    def apply(self, model):
        n = 0
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and not getattr(m, "_doubled", False):
                with torch.no_grad():
                    m.weight.mul_(2)
                m._doubled = True
                n += 1
        self.calls.append(("apply", n))
        return n

    def undo(self, model):
        n = 0
        for m in model.modules():
            if getattr(m, "_doubled", False):
                with torch.no_grad():
                    m.weight.div_(2)
                del m._doubled
                n += 1
        self.calls.append(("undo", n))
        return n


def test_weight_changing_patch_saves_the_stock_checkpoint(scratch_registry, tmp_path, ids):
    model = _model("tiny")
    model.save_pretrained(tmp_path / "stock")
    dbl = _DoubleWeight()
    patcher.register(Patch("double", apply=dbl.apply, undo=dbl.undo, changes_weights=True))
    report = cutile_kernels.patch(model)
    assert report.active == ["decoder_add_rms_norm", "fused_gate_up", "dynamic_cache_prefill", "cutile_attention",
                             "masked_prefill_attention", "gemv", "double"]
    assert report.changed["double"] > 0
    assert "save_pretrained" in model.__dict__  # the save is wrapped while a weight patch is active
    model.save_pretrained(tmp_path / "patched")
    _assert_same_checkpoint(tmp_path / "stock", tmp_path / "patched")
    assert patcher.applied(model)["double"] > 0  # re-applied after the save
    assert dbl.calls[-2:] == [("undo", dbl.calls[0][1]), ("apply", dbl.calls[0][1])]
    cutile_kernels.unpatch(model)
    assert "save_pretrained" not in model.__dict__ and patcher.applied(model) == {}
    assert dbl.calls[-1] == ("undo", dbl.calls[0][1])


def test_unpatch_leaves_a_patch_without_undo(scratch_registry, caplog):
    patcher.register(Patch("sticky", apply=lambda m: 1))
    model = torch.nn.Linear(2, 2)
    cutile_kernels.patch(model, names="sticky")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        report = cutile_kernels.unpatch(model)
    assert report.active == ["sticky"] and "cannot be undone" in caplog.text


# ---------------------------------------------------------------------------------------------
# decoder_add_rms_norm on the CPU: exact, reaches every layer, undoable, saves the stock keys
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["tiny", "llama", "mistral", "qwen2", "qwen3"])
def test_patched_logits_equal_stock(model_type, ids, caplog):
    model = _model(model_type)
    want = _logits(model, ids, output_hidden_states=True)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        report = cutile_kernels.patch(model, names=DEC)
    n = len(_decoder_layers(model))
    assert report.changed == {"decoder_add_rms_norm": n} and report.active == ["decoder_add_rms_norm"]
    assert all(_fused(layer) for layer in _decoder_layers(model))
    assert f"post_attention_layernorm in {n} {type(_decoder_layers(model)[0]).__name__}" in caplog.text
    assert f"across {n - 1} layer pairs" in caplog.text
    cutile_kernels.reset_stats()
    got = _logits(model, ids, output_hidden_states=True)
    assert torch.equal(got.logits, want.logits)
    assert all(torch.equal(a, b) for a, b in zip(got.hidden_states, want.hidden_states))
    # One fused op per layer for the attention block and one per layer pair across layers.
    assert cutile_kernels.stats()["reference_calls"] == {"add_rms_norm": 2 * n - 1}


@pytest.mark.parametrize("model_type", ["tiny", "llama", "mistral", "qwen2", "qwen3"])
def test_every_registered_patch_together_keeps_stock_logits(model_type, ids, tmp_path):
    model = _model(model_type)
    want = _logits(model, ids).logits
    model.save_pretrained(tmp_path / "stock")
    report = cutile_kernels.patch(model, names=list(patcher.PATCHES))  # the opt-in rope_cos_sin too
    n = len(_decoder_layers(model))
    qk = {"qk_norm_rope": n} if model_type == "qwen3" else {}  # Qwen3 attention only
    qkv = {"fused_qkv": n}  # Llama-code attention, and Qwen3's under qk_norm_rope's forward
    assert report.changed == {"gemma2_attention": 0, "cutile_attention": n, "masked_prefill_attention": n,
                              "olmo2_norm_add": 0, "olmo2_qk_norm_rope": 0, "decoder_add_rms_norm": n,
                              "fused_gate_up": n, "rope_cos_sin": 1, "qk_norm_rope": 0,
                              "fused_qkv": 0, "rms_norm_gemma": 0, "rms_norm_olmo2": 0, "phi3_mlp": 0, "phi3_rope": 0,
                              "fused_gate_up_geglu": 0, "qwen3_5_add_norm": 0, "qwen3_5_rope": 0,
                              "gemma_add_norm": 0, "gemma3_qk_norm_rope": 0, "qwen3_5_stacked_proj": 0,
                              "dynamic_cache_prefill": n,  # one full-attention cache layer a decoder layer
                              **qk, **qkv, "gemv": 4 * n}  # qkv_proj, o_proj, gate_up_proj, down_proj
    assert report.active == ["decoder_add_rms_norm", "fused_gate_up", "rope_cos_sin", "dynamic_cache_prefill",
                             "cutile_attention", "masked_prefill_attention", *qk, *qkv, "gemv"]
    assert torch.equal(_logits(model, ids).logits, want)
    model.save_pretrained(tmp_path / "patched")
    a = (tmp_path / "stock" / "model.safetensors").read_bytes()
    assert (tmp_path / "patched" / "model.safetensors").read_bytes() == a
    assert cutile_kernels.unpatch(model).changed == {"gemv": 4 * n, **qkv, **qk, "masked_prefill_attention": n,
                                                     "cutile_attention": n,
                                                     "dynamic_cache_prefill": n, "rope_cos_sin": 1, "fused_gate_up": n, "decoder_add_rms_norm": n}
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(_logits(model, ids).logits, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_patched_logits_equal_stock_in_16_bit(dtype, ids):
    model = _model("qwen3", dtype)
    want = _logits(model, ids).logits
    cutile_kernels.patch(model)
    assert torch.equal(_logits(model, ids).logits, want)


def test_patch_is_idempotent_and_unpatch_restores(ids):
    model = _model("llama")
    want = _logits(model, ids).logits
    assert cutile_kernels.patch(model, names=DEC).changed == {"decoder_add_rms_norm": 3}
    assert cutile_kernels.patch(model, names=DEC).changed == {"decoder_add_rms_norm": 0}
    assert patcher.applied(model) == {"decoder_add_rms_norm": 3}
    report = cutile_kernels.unpatch(model)
    assert report.changed == {"decoder_add_rms_norm": 3} and report.active == []
    for layer in _decoder_layers(model):
        assert not {"forward", "_cutile_inbox", "_cutile_next", "_cutile_check"} & set(layer.__dict__)
        assert layer.forward.__func__ is type(layer).forward
    assert cutile_kernels.unpatch(model).changed == {}
    cutile_kernels.reset_stats()
    assert torch.equal(_logits(model, ids).logits, want)
    assert cutile_kernels.stats()["reference_calls"] == {}


def test_patching_an_already_loaded_model(tmp_path, ids):
    """Loaded with from_pretrained and used first: patching afterwards reaches every layer."""
    _model("qwen2").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    want = _logits(model, ids).logits
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, do_sample=False, attention_mask=torch.ones_like(ids))
    cutile_kernels.patch(model)
    assert all(_fused(layer) for layer in _decoder_layers(model))
    assert torch.equal(_logits(model, ids).logits, want)


def test_generate_with_cache_and_left_padding_unchanged():
    model = _model("llama")
    ids = torch.randint(3, 256, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :5] = 0
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
              output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = model.generate(ids, **kw)
    cutile_kernels.patch(model)
    with torch.no_grad():
        got = model.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, want.scores))


def test_save_after_patch_writes_the_stock_checkpoint(tmp_path, ids):
    model = _model("tiny", torch.bfloat16)
    model.save_pretrained(tmp_path / "stock")
    cutile_kernels.patch(model)
    _logits(model, ids)
    model.save_pretrained(tmp_path / "patched")
    _assert_same_checkpoint(tmp_path / "stock", tmp_path / "patched")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "patched").eval()
    assert not any(_fused(layer) for layer in _decoder_layers(reloaded))


def _assert_same_checkpoint(a, b):
    want, got = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert set(got) == set(want) and any("layernorm" in k for k in got)
    for key in want:
        x, y = want[key], got[key]
        assert x.dtype == y.dtype and x.shape == y.shape, key
        assert x.contiguous().view(torch.uint8).numpy().tobytes() == y.contiguous().view(torch.uint8).numpy().tobytes(), key


def test_gradients_equal_stock():
    model = _model("llama").train()
    ids = torch.randint(0, 256, (2, 7))
    stock = {n: g for n, g in _grads(model, ids).items()}
    cutile_kernels.patch(model, names=DEC)
    got = _grads(model, ids)
    for name, g in stock.items():
        assert torch.allclose(got[name], g, rtol=1e-5, atol=1e-7), name


def _grads(model, ids):
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_skips_the_cross_layer_handoff():
    model = _model("llama").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 256, (2, 7))
    stock = _grads(model, ids)
    cutile_kernels.patch(model, names=DEC)
    cutile_kernels.reset_stats()
    got = _grads(model, ids)
    for name, g in stock.items():
        assert torch.allclose(got[name], g, rtol=1e-5, atol=1e-7), name
    # Forward + recompute: in-layer fusion only (3 layers, twice).
    assert cutile_kernels.stats()["reference_calls"] == {"add_rms_norm": 6}


def test_compile_fullgraph_matches_eager(ids):
    model = _model("llama")
    want = _logits(model, ids).logits
    cutile_kernels.patch(model)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    assert torch.equal(_logits(compiled, ids).logits, want)


# ---------------------------------------------------------------------------------------------
# What the patch leaves alone, and when it steps aside at run time
# ---------------------------------------------------------------------------------------------

def test_masked_prefill_marks_once_and_says_so(caplog):
    """Patch masked_prefill_attention marks each attention module once (idempotent, as every patch:
    a second patch() changes nothing more), logs what it does, and unpatch removes the marks."""
    from cutile_kernels.layers.attention import MASKED_PREFILL

    model = _model("llama")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        report = cutile_kernels.patch(model, names=["masked_prefill_attention"])
    assert report.changed == {"masked_prefill_attention": 3}
    assert "send a prefill with a boolean mask to our kernel" in caplog.text
    assert cutile_kernels.patch(model, names=["masked_prefill_attention"]).changed == {"masked_prefill_attention": 0}
    assert patcher.applied(model) == {"masked_prefill_attention": 3}
    attn = [m for m in model.modules() if MASKED_PREFILL in m.__dict__]
    assert len(attn) == 3 and all(type(m).__name__ == "LlamaAttention" for m in attn)
    assert cutile_kernels.unpatch(model).changed == {"masked_prefill_attention": 3}
    assert not any(MASKED_PREFILL in m.__dict__ for m in model.modules())


def test_gemma_layers_are_left_alone_with_a_log_line(ids, caplog):
    # Gemma's decoder layer has Llama's forward code, but its norms are (1 + weight) norms.
    model = _model("gemma")
    want = _logits(model, ids).logits
    with caplog.at_level(logging.INFO, logger=LOGGER):
        report = cutile_kernels.patch(model, names=list(patcher.PATCHES))
    # GELU MLP; the rotary embedding and the attention are Llama's code (rope_cos_sin, fused_qkv).
    # Its norms compute Gemma's formula: rms_norm_gemma takes all 7 (2 per layer, the final one).
    assert report.changed == {"gemma2_attention": 0, "cutile_attention": 3, "masked_prefill_attention": 3,
                              "olmo2_norm_add": 0, "olmo2_qk_norm_rope": 0,
                              "decoder_add_rms_norm": 0, "fused_gate_up": 0, "rope_cos_sin": 1, "qk_norm_rope": 0,
                              "fused_qkv": 3, "rms_norm_gemma": 7, "rms_norm_olmo2": 0, "phi3_mlp": 0,
                              "phi3_rope": 0, "fused_gate_up_geglu": 3, "qwen3_5_add_norm": 0, "qwen3_5_rope": 0,
                              "gemma_add_norm": 0, "gemma3_qk_norm_rope": 0, "qwen3_5_stacked_proj": 0,
                              "dynamic_cache_prefill": 3,
                              "gemv": 12}  # the stacked q/k/v and gate/up, o_proj, down_proj of 3 layers
    assert report.active == ["fused_gate_up_geglu", "rope_cos_sin", "dynamic_cache_prefill", "cutile_attention",
                             "masked_prefill_attention", "fused_qkv", "rms_norm_gemma", "gemv"]
    assert torch.equal(_logits(model, ids).logits, want)
    assert not any(_fused(layer) for layer in _decoder_layers(model))
    assert "leaves 3 GemmaDecoderLayer alone: its post_attention_layernorm is not a Llama-formula RMSNorm" \
        in caplog.text


class _HalvedLayer(LlamaDecoderLayer):
    # The same four parts, another forward (its output halved): not the fused forward's math.
    def forward(self, hidden_states, **kwargs):
        return 0.5 * super().forward(hidden_states, **kwargs)


def test_other_decoder_forwards_are_left_alone(ids, caplog):
    model = _model("llama")
    for layer in _decoder_layers(model):
        layer.__class__ = _HalvedLayer
    want = _logits(model, ids).logits
    with caplog.at_level(logging.INFO, logger=LOGGER):
        cutile_kernels.patch(model)
    assert not any(_fused(layer) for layer in _decoder_layers(model))
    assert "leaves 3 _HalvedLayer alone: its forward is not LlamaDecoderLayer.forward's code" in caplog.text
    assert torch.equal(_logits(model, ids).logits, want)


def test_granite_decoder_fuses_its_scaled_residual_adds(ids, change_pin):
    # Granite's layer is Llama's with each block's output times residual_multiplier before its add:
    # the fused forward multiplies first (the stock product), then our add + norm; the multiplier
    # is read at every call.
    model = _model("granite")
    for layer in _decoder_layers(model):
        layer.residual_multiplier = 0.5  # scaled branches (Granite-3.3-2B's is 0.22)
    want = _logits(model, ids).logits
    assert cutile_kernels.patch(model).changed["decoder_add_rms_norm"] == 3
    assert all(_fused(layer) for layer in _decoder_layers(model))
    assert torch.equal(_logits(model, ids).logits, want)
    with torch.inference_mode():  # the cross-layer hand-off under the verified loop
        assert torch.equal(model(ids).logits, want)
    # A hooked norm takes the module call (and the plain add before it): still the product first.
    handles = [layer.post_attention_layernorm.register_forward_hook(lambda m, i, o: None)
               for layer in _decoder_layers(model)]
    assert torch.equal(_logits(model, ids).logits, want)
    for h in handles:
        h.remove()
    for layer in _decoder_layers(model):
        layer.residual_multiplier = 0.25
    cutile_kernels.unpatch(model)
    assert not any("_cutile_scale" in layer.__dict__ for layer in _decoder_layers(model))
    want_quarter = _logits(model, ids).logits
    assert not torch.equal(want_quarter, want)
    cutile_kernels.patch(model)
    assert torch.equal(_logits(model, ids).logits, want_quarter)
    cutile_kernels.unpatch(model)
    change_pin("granite.GraniteDecoderLayer.forward")
    from cutile_kernels.layers import patch as decoder

    decoder._decoder_match.cache_clear()
    try:
        assert cutile_kernels.patch(model).changed["decoder_add_rms_norm"] == 0  # a changed forward: left alone
    finally:
        cutile_kernels.unpatch(model)
        decoder._decoder_match.cache_clear()


def test_the_four_families_have_llama_decoder_code():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.mistral.modeling_mistral import MistralDecoderLayer
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    from cutile_kernels.layers._match import statements_digest

    from cutile_kernels.layers._pins import PINS

    assert statements_digest(LlamaDecoderLayer.forward) == PINS[patcher.DECODER_PIN].digest
    for cls in (LlamaDecoderLayer, MistralDecoderLayer, Qwen2DecoderLayer, Qwen3DecoderLayer):
        assert patcher.decoder_verdict(cls) is None, cls


def test_a_layer_with_a_replaced_forward_is_left_alone():
    model = _model("llama")
    layer0 = _decoder_layers(model)[0]
    layer0.forward = lambda *a, **k: None  # e.g. accelerate's device hook
    report = cutile_kernels.patch(model, names=DEC)
    assert report.changed == {"decoder_add_rms_norm": 2} and not _fused(layer0)


def test_norm_hooks_still_run(ids):
    """A hook on a norm the fusion would bypass: the layer calls the norm module instead."""
    model = _model("llama")
    seen = []
    post = _decoder_layers(model)[1].post_attention_layernorm
    nxt = _decoder_layers(model)[2].input_layernorm
    for m in (post, nxt):
        m.register_forward_hook(lambda mod, args, out: seen.append(mod) or out * 1.5)
    want = _logits(model, ids).logits
    cutile_kernels.patch(model)
    seen.clear()
    got = _logits(model, ids).logits
    assert seen == [post, nxt] and torch.equal(got, want)


def test_handoff_is_ignored_when_the_hidden_states_are_replaced(ids):
    """Something between two layers returns a new tensor: the next layer must norm that one."""
    model = _model("llama")
    layer1 = _decoder_layers(model)[1]
    layer1.register_forward_hook(lambda mod, args, out: out + 0.25)
    want = _logits(model, ids).logits
    cutile_kernels.patch(model)
    assert torch.equal(_logits(model, ids).logits, want)
    assert all(layer._cutile_inbox is None or layer._cutile_inbox.pending is None for layer in _decoder_layers(model))


def test_kernel_config_patches_the_model_it_prepares(monkeypatch, ids):
    """The from_pretrained path: CutileKernelConfig(patch_model=True) patches a CUDA model while
    transformers prepares the mapping (the CPU model pretends to be on CUDA)."""
    import transformers.utils.kernel_config as kc

    from cutile_kernels.layers.hub import CutileKernelConfig

    monkeypatch.setattr(kc, "infer_device", lambda model: "cuda")
    model = _model("qwen3")
    want = _logits(model, ids).logits
    CutileKernelConfig({}, use_local_kernel=True).create_compatible_mapping(model)
    assert not any(_fused(layer) for layer in _decoder_layers(model))  # patch_model defaults to False
    CutileKernelConfig({}, use_local_kernel=True, patch_model=True).create_compatible_mapping(model)
    assert all(_fused(layer) for layer in _decoder_layers(model))
    assert torch.equal(_logits(model, ids).logits, want)


def test_kernelize_on_cpu_does_not_patch(ids):
    model = _model("llama")
    cutile_kernels.kernelize(model)
    assert not any(_fused(layer) for layer in _decoder_layers(model)) and patcher.applied(model) == {}


# ---------------------------------------------------------------------------------------------
# GPU: the fused kernels in real decoder layers
# ---------------------------------------------------------------------------------------------

def _error(logits, ref):
    return ((logits.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("model_type", ["tiny", "qwen3", "mistral"])
def test_patched_model_on_gpu_is_as_close_to_float32_as_stock(model_type, grad_mode, strict):
    model = _model(model_type, layers=4).to("cuda")
    ids = torch.randint(0, 256, (2, 37), device="cuda")
    ref = _logits(model, ids).logits  # float32 reference of the stock model
    model.to(torch.bfloat16)
    stock = _logits(model, ids).logits
    cutile_kernels.patch(model)
    before = dispatch.stats()["launches"]
    with getattr(torch, grad_mode)():
        got = model(ids).logits
    after = dispatch.stats()["launches"]
    fused = sum(n - before.get(s, 0) for s, n in after.items() if "add_rms_norm" in s)
    n = len(_decoder_layers(model))
    assert fused == 2 * n - 1  # every add + norm pair ran the fused kernel
    assert _error(got, ref) <= 1.1 * _error(stock, ref) + 1e-6, (_error(got, ref), _error(stock, ref))
    kl = torch.nn.functional.kl_div(got.float().log_softmax(-1), ref.float().log_softmax(-1), log_target=True,
                                    reduction="batchmean")
    kl_stock = torch.nn.functional.kl_div(stock.float().log_softmax(-1), ref.float().log_softmax(-1),
                                          log_target=True, reduction="batchmean")
    assert kl <= 1.1 * kl_stock + 1e-6, (kl.item(), kl_stock.item())


def test_profiling_ranges_do_not_turn_the_fusion_off(ids):
    """The bench's coverage hooks are transparent: the profiled model runs the same fusions as the
    timed one (on the H200 the hooks had made every patched layer take the stock path)."""
    from cutile_kernels_tools.bench import coverage

    model = _model("llama")
    cutile_kernels.patch(model, names=DEC)
    n = len(_decoder_layers(model))
    cutile_kernels.reset_stats()
    events = coverage.profile_steps(model, lambda: _logits(model, ids), "cpu")
    assert cutile_kernels.stats()["reference_calls"] == {"add_rms_norm": 2 * n - 1}
    modules = {r["module"] for r in coverage.attribute(events, "cpu")}
    assert "model.layers.1.mlp.down_proj" in modules
    assert not any(m and m.endswith("post_attention_layernorm") for m in modules)  # fused into the layer


def test_handoff_is_ignored_when_the_hidden_states_are_edited_in_place(ids):
    def bump(module, args, kwargs):
        args[0].mul_(1.5)  # in place: same object, new contents

    stock, model = _model("llama"), _model("llama")
    cutile_kernels.patch(model, names=DEC)
    for m in (stock, model):
        _decoder_layers(m)[1].register_forward_pre_hook(bump, with_kwargs=True)
    assert torch.equal(_logits(model, ids).logits, _logits(stock, ids).logits)


def test_a_patch_that_raises_part_way_can_still_be_undone(scratch_registry):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    touched = []

    def apply(m):
        touched.append(m[0])
        m[0].weight.data.mul_(2)
        raise RuntimeError("out of memory on the second module")

    def undo(m):
        for lin in touched:
            lin.weight.data.div_(2)
        n = len(touched)
        touched.clear()
        return n

    before = model[0].weight.detach().clone()
    patcher.register(Patch("half_done", apply=apply, undo=undo))
    with pytest.raises(RuntimeError, match="second module"):
        patcher.patch(model, names=["half_done"])
    assert "half_done" in patcher.applied(model)
    assert patcher.unpatch(model, names=["half_done"]).changed == {"half_done": 1}
    assert torch.equal(model[0].weight, before) and patcher.applied(model) == {}


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_inference_mode_hands_off_inside_the_verified_loop(model_type, ids):
    # Inference tensors have no version counter: the handoff relies on the owner's loop doing
    # nothing between the layers (loop_verdict) and on no hook sitting between them.
    stock, model = _model(model_type), _model(model_type)
    cutile_kernels.patch(model, names=DEC)
    n = len(_decoder_layers(model))
    assert patcher.loop_verdict(type(model.model), "layers") is None
    with torch.inference_mode():
        want = stock(ids).logits
        cutile_kernels.reset_stats()
        got = model(ids).logits
    assert torch.equal(got, want)
    assert cutile_kernels.stats()["reference_calls"] == {"add_rms_norm": 2 * n - 1}  # n in-layer, n - 1 across


@pytest.mark.parametrize("where", ["pre_hook_next", "hook_previous"])
def test_inference_mode_handoff_is_off_when_a_hook_sits_between_layers(where, ids):
    def bump_pre(module, args):
        args[0].mul_(1.5)  # in place: same object, new contents, and no version counter to tell

    def bump_out(module, args, out):
        out.mul_(1.5)

    stock, model = _model("llama"), _model("llama")
    cutile_kernels.patch(model, names=DEC)
    n = len(_decoder_layers(model))
    for m in (stock, model):
        if where == "pre_hook_next":
            _decoder_layers(m)[1].register_forward_pre_hook(bump_pre)
        else:
            _decoder_layers(m)[0].register_forward_hook(bump_out)
    with torch.inference_mode():
        want = stock(ids).logits
        cutile_kernels.reset_stats()
        got = model(ids).logits
    assert torch.equal(got, want)
    assert cutile_kernels.stats()["reference_calls"] == {"add_rms_norm": 2 * n - 2}  # one pair not handed off


def _manual_loop(m, ids, edit):
    """A user's own loop over the layers that edits the hidden states in place between them
    (steering, activation patching)."""
    inner = m.model
    h = inner.embed_tokens(ids)
    pos = torch.arange(ids.shape[1])[None]
    emb = inner.rotary_emb(h, position_ids=pos)
    for layer in inner.layers:
        h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=emb)
        if edit:
            h.mul_(0.5)
    return h


def test_inference_mode_layers_called_outside_their_loop_do_not_hand_off(ids):
    # Outside the owner's verified forward, no handoff (and the results are the stock ones).
    stock, model = _model("llama"), _model("llama")
    cutile_kernels.patch(model, names=DEC)
    with torch.inference_mode():
        want = _manual_loop(stock, ids, edit=True)
        got = _manual_loop(model, ids, edit=True)
    assert torch.equal(got, want)
    assert all(layer._cutile_inbox is None or layer._cutile_inbox.pending is None for layer in _decoder_layers(model))


def test_inference_mode_handoff_after_an_interrupted_forward(ids):
    # A KeyboardInterrupt inside a forward (Ctrl-C during generate) must not leave the model
    # believing it is still inside its loop: a user loop afterwards gets stock results.
    stock, model = _model("llama"), _model("llama")
    cutile_kernels.patch(model, names=DEC)

    def interrupt(module, args, out):
        raise KeyboardInterrupt

    handle = _decoder_layers(model)[1].mlp.register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt), torch.inference_mode():
        model(ids)
    handle.remove()
    with torch.inference_mode():
        assert torch.equal(_manual_loop(model, ids, edit=True), _manual_loop(stock, ids, edit=True))
        assert torch.equal(model(ids).logits, stock(ids).logits)


def test_inference_mode_handoff_follows_the_forward_that_runs(ids):
    # The owner's forward replaced on the instance by one that edits between layers, and a
    # verified loop followed by one more layer call after an edit: both get stock results.
    import types

    def steered(self, input_ids=None, **kwargs):
        h = self.embed_tokens(input_ids)
        pos = torch.arange(input_ids.shape[1])[None]
        emb = self.rotary_emb(h, position_ids=pos)
        for layer in self.layers[:-1]:
            h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=emb)
        h.mul_(1.5)
        h = self.layers[-1](h, attention_mask=None, position_ids=pos, position_embeddings=emb)
        return self.norm(h)

    stock, model = _model("llama"), _model("llama")
    cutile_kernels.patch(model, names=DEC)
    for m in (stock, model):
        m.model.forward = types.MethodType(steered, m.model)
    with torch.inference_mode():
        assert torch.equal(model.model(ids), stock.model(ids))

    from transformers.models.llama.modeling_llama import LlamaModel

    class Tail(LlamaModel):  # as a class forward: its loop passes the verdict; the edit and last call follow it
        forward = steered

    assert patcher.loop_verdict(Tail, "layers") is None  # the last call is outside the loop's lines
    stock2, model2 = _model("llama"), _model("llama")
    for m in (stock2, model2):
        m.model.__class__ = Tail
    cutile_kernels.patch(model2, names=DEC)
    with torch.inference_mode():
        assert torch.equal(model2.model(ids), stock2.model(ids))


def test_replaced_input_layernorm_is_not_skipped(ids):
    # The next layer's norm replaced after patching: the handed tensor was normed with the old one.
    stock, model = _model("llama"), _model("llama")
    cutile_kernels.patch(model, names=DEC)
    for m in (stock, model):
        old = _decoder_layers(m)[1].input_layernorm
        new = type(old)(old.weight.shape[0], eps=old.variance_epsilon)
        with torch.no_grad():
            new.weight.copy_(old.weight * 2)
        _decoder_layers(m)[1].input_layernorm = new
    assert torch.equal(_logits(model, ids).logits, _logits(stock, ids).logits)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, stock(ids).logits)


def test_loop_verdict_refuses_a_loop_that_does_more():
    from transformers.models.llama.modeling_llama import LlamaModel

    class Steered(LlamaModel):
        def forward(self, input_ids=None, **kwargs):
            h = self.embed_tokens(input_ids)
            for layer in self.layers:
                h = layer(h, **kwargs)
                h.add_(1.0)
            return h

    class Stepped(LlamaModel):
        def forward(self, input_ids=None, **kwargs):
            h = self.embed_tokens(input_ids)
            for layer in self.layers:
                h = layer(h, scale=float(h.mean()))  # a call evaluated between the layers
            return h

    assert "does more than call each layer" in patcher.loop_verdict(Steered, "layers")
    assert "does more than call each layer" in patcher.loop_verdict(Stepped, "layers")
    assert "0 loops over self.blocks" in patcher.loop_verdict(LlamaModel, "blocks")
    assert patcher.loop_verdict(LlamaModel, "layers") is None


def test_unpatch_leaves_no_hooks_on_the_model(ids):
    model = _model("llama")
    before = (dict(model.model._forward_pre_hooks), dict(model.model._forward_hooks))
    cutile_kernels.patch(model, names=DEC)
    assert (dict(model.model._forward_pre_hooks), dict(model.model._forward_hooks)) == before
    cutile_kernels.unpatch(model, names=DEC)
    assert not any(k.startswith("_cutile") for k in model.model.__dict__)


def test_opt_in_patch_is_applied_only_when_named(ids):
    # rope_cos_sin was discarded by autokernelize (no measured gain): patch(model), kernel_config
    # and kernelize leave it out; naming it applies it.
    assert patcher.PATCHES["rope_cos_sin"].default is False
    model = _model("llama")
    assert "rope_cos_sin" not in cutile_kernels.patch(model).active
    assert cutile_kernels.patch(model, names="rope_cos_sin").changed == {"rope_cos_sin": 1}
    assert "rope_cos_sin" in patcher.applied(model)


def test_patch_after_a_cpu_use_kernels_load_takes_the_modules_kernels_left_stock(tmp_path, built_package_dir):
    """Where ``kernels`` maps no kernel (a CPU load with ``use_kernels=True``) it binds each hub
    module's own class forward on the instance: no replacement, so ``patch(model)`` takes those
    modules as on a plain load (Qwen3.5's zero-centered norms, its stacked projections), with the
    stock logits."""
    import families

    from cutile_kernels.layers._patching import own_forward_on_instance

    families.model("qwen3_5_text").save_pretrained(tmp_path)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    model = AutoModelForCausalLM.from_pretrained(tmp_path, use_kernels=True,
                                                 kernel_config=cutile_kernels.kernel_config()).eval()
    assert any(own_forward_on_instance(m) for m in model.modules())
    changed = cutile_kernels.patch(model).changed
    assert changed["rms_norm_gemma"] > 0 and changed["qwen3_5_stacked_proj"] > 0, changed
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, stock(ids).logits)


def test_swapped_forwards_find_their_modeling_module_by_name():
    """A reproduced forward reads its modeling module's globals (attention registry, eager path, RoPE)
    through the module name the swap stored on the instance (cheap guards under torch.compile);
    unpatching drops the name with the forward."""
    from transformers.models.qwen3 import modeling_qwen3

    from cutile_kernels.layers._patching import MODELING_ATTR, modeling_globals
    from families import model as tiny_model

    model = tiny_model("qwen3")
    cutile_kernels.patch(model)
    attn = model.model.layers[0].self_attn
    assert attn.__dict__[MODELING_ATTR] == modeling_qwen3.__name__
    assert modeling_globals(attn) is vars(modeling_qwen3)
    patcher.unpatch(model)
    assert MODELING_ATTR not in attn.__dict__ and "forward" not in attn.__dict__
    assert modeling_globals(attn) is vars(modeling_qwen3)  # from the class, as before the patch


def test_modeling_globals_are_the_stock_forwards_not_the_classes_module():
    """The globals are those the stock forward reads: a subclass defined elsewhere that inherits the
    forward reads Qwen3's module; a forward whose globals are not its module's (made with exec)
    stores no name and keeps its own globals."""
    from transformers.models.qwen3 import modeling_qwen3

    from cutile_kernels.layers._patching import _modeling_name, modeling_globals
    from families import model as tiny_model

    attn = tiny_model("qwen3").model.layers[0].self_attn
    attn.__class__ = type("ElsewhereAttention", (modeling_qwen3.Qwen3Attention,), {"__module__": __name__})
    assert _modeling_name(attn) == modeling_qwen3.__name__

    scope = {"__name__": modeling_qwen3.__name__}
    exec("def forward(self, *args, **kwargs):\n    return None", scope)
    attn.__class__ = type("ExecAttention", (modeling_qwen3.Qwen3Attention,), {"forward": scope["forward"]})
    assert scope["forward"].__module__ == modeling_qwen3.__name__
    assert _modeling_name(attn) is None
    assert modeling_globals(attn) is scope
