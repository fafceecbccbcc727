"""Stacked q/k/v projections (``layers/qkv.py``), CPU: which attention modules fuse and why the
others do not; a fused model's logits and greedy generations (dynamic and static caches, padding,
sliding windows, biases) equal the stock model's; what the cache keeps; one copy of the weights;
stock keys and bytes through state_dict, save_pretrained and load_state_dict; unfusing; copies."""

from __future__ import annotations

import copy
import gc
import json
import pickle
import weakref

import pytest
import torch

from cutile_kernels.layers import mlp as mlp_layers
from cutile_kernels.layers import qkv as qkv_layers
from cutile_kernels.layers.qkv import (FUSED_NAME, fuse_qkv, fused_qkv_forward, is_fusable_qkv, unfuse_qkv,
                                      why_not_fusable_qkv)

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402
from transformers import (AutoModelForCausalLM, DynamicCache, LlamaConfig, MistralConfig, Qwen2Config,  # noqa: E402
                          Qwen3Config)
from transformers.models.llama.modeling_llama import LlamaAttention  # noqa: E402

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)

#: The three reproduced forwards, tiny. Mistral with a window shorter than the test sequences;
#: Qwen2 (biases on q/k/v) with its second layer sliding, so both Qwen2 branches run.
CONFIGS = {
    "llama": lambda: LlamaConfig(**SMALL),
    "mistral": lambda: MistralConfig(**SMALL, sliding_window=4),
    "qwen2": lambda: Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=4, max_window_layers=1),
}
STOCK_CLASSES = {"llama": "LlamaAttention", "mistral": "MistralAttention", "qwen2": "Qwen2Attention"}
SEQ = 11  # longer than the windows


def _model(name, dtype=torch.float32, seed=0, attn="sdpa"):
    torch.manual_seed(seed)
    cfg = CONFIGS[name]() if name in CONFIGS else Qwen3Config(**SMALL, head_dim=16)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn).eval()


def _attns(model):
    return [layer.self_attn for layer in model.model.layers]


def _batch():
    """Two rows, the first left-padded by 3 (as generate() pads for a decoder-only model)."""
    ids = torch.randint(3, SMALL["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ids[0, :3] = 0
    return ids, mask


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _storages(model) -> dict:
    return {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}


@pytest.fixture(autouse=True)
def _fresh_verdicts():
    # Verdicts are cached per forward; tests that fake another transformers must not leak into others.
    qkv_layers._forward_verdict.cache_clear()
    qkv_layers.stock_forward_parts.cache_clear()
    yield
    qkv_layers._forward_verdict.cache_clear()
    qkv_layers.stock_forward_parts.cache_clear()


# ---------------------------------------------------------------------------------------------
# Which modules fuse
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_family_attentions_are_fusable(name):
    model = _model(name)
    assert [type(m).__name__ for m in _attns(model)] == [STOCK_CLASSES[name]] * 2
    assert all(is_fusable_qkv(m) for m in _attns(model))
    assert not any(is_fusable_qkv(m) for m in model.modules() if not hasattr(m, "q_proj"))


def test_qwen3_attention_stacks_only_under_its_fused_forward(caplog):
    """Qwen3Attention's forward belongs to the qk_norm_rope patch: without it the module keeps its
    three projections and says why; with it the module stacks and its class forward is that patch's."""
    from cutile_kernels.layers.models import qwen3

    model = _model("qwen3")
    why = why_not_fusable_qkv(model.model.layers[0].self_attn)
    assert why == "its forward is Qwen3Attention's own: stacking it needs the qk_norm_rope patch"
    with caplog.at_level("INFO", logger="cutile_kernels"):
        assert fuse_qkv(model) == 0
    assert f"left 2 Qwen3Attention with separate q/k/v projections: {why}" in caplog.text
    assert all(hasattr(m, "q_proj") and not hasattr(m, FUSED_NAME) for m in _attns(model))
    assert qwen3.patch_qk_norm_rope(model) == 2
    assert fuse_qkv(model) == 2
    for m in _attns(model):
        assert type(m).__name__ == "CutileQKVQwen3Attention" and type(m).forward is qwen3.fused_attention_forward
        assert list(m._modules)[:2] == [FUSED_NAME, "o_proj"] and m._cutile_qkv_split == (64, 32)


def _qwen3_pair(attn="sdpa"):
    from cutile_kernels.layers.models import qwen3

    stock = _model("qwen3", attn=attn)
    model = copy.deepcopy(stock)
    qwen3.patch_qk_norm_rope(model)
    assert fuse_qkv(model) == 2
    return stock, model


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_stacked_qwen3_logits_equal_stock_on_a_padded_batch(attn):
    stock, model = _qwen3_pair(attn)
    ids, mask = _batch()
    with torch.no_grad():
        want = stock(ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_stacked_qwen3_generate_equals_stock(cache):
    _same_generation(*_qwen3_pair(), cache)


def test_stacked_qwen3_with_hooked_norms_runs_the_stock_lines():
    """A hook on q_norm must run (the fused op would skip it): the stacked forward then applies the
    module's own norms and RoPE to the stacked projections."""
    stock, model = _qwen3_pair()
    calls = []
    for m in (*_attns(stock), *_attns(model)):
        m.q_norm.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    ids, mask = _batch()
    with torch.no_grad():
        want = stock(ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert len(calls) == 4 and calls[0] == calls[2] == (2, SEQ, 4, 16)


def test_stacked_qwen3_keeps_stock_keys_and_unstacks():
    from cutile_kernels import dispatch
    from cutile_kernels.layers.models import qwen3

    stock, model = _qwen3_pair()
    want = stock.state_dict()
    got = model.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], v) for k, v in want.items())
    ids, mask = _batch()

    def qk_norm_rope_calls():
        dispatch.reset_stats()
        with torch.no_grad():
            torch.testing.assert_close(model(ids, attention_mask=mask).logits,
                                       stock(ids, attention_mask=mask).logits, rtol=1e-6, atol=1e-6)
        return dispatch.stats()["reference_calls"].get("qk_norm_rope", 0)

    assert qk_norm_rope_calls() == 2
    # Undoing qk_norm_rope alone: the stacked class forward runs the stock norm and RoPE lines.
    assert qwen3.unpatch_qk_norm_rope(model) == 2
    assert qk_norm_rope_calls() == 0
    assert qwen3.patch_qk_norm_rope(model) == 2  # and it can be applied again to stacked modules
    assert qk_norm_rope_calls() == 2
    assert qwen3.unpatch_qk_norm_rope(model) == 2
    assert unfuse_qkv(model) == 2
    assert all(type(m).__name__ == "Qwen3Attention" and hasattr(m, "q_proj") for m in _attns(model))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, stock(ids, attention_mask=mask).logits,
                                   rtol=0, atol=0)


def test_modules_whose_projections_cannot_stack_are_left_alone(caplog):
    cfg = LlamaConfig(**SMALL)
    hooked = LlamaAttention(cfg, layer_idx=0)
    hooked.q_proj.register_forward_hook(lambda *a: None)  # a hook that fusing would drop
    assert why_not_fusable_qkv(hooked) == "q_proj has forward or backward hooks"

    mixed_bias = LlamaAttention(LlamaConfig(**SMALL, attention_bias=True), layer_idx=0)
    assert is_fusable_qkv(mixed_bias)  # all three with a bias: fine
    mixed_bias.k_proj.register_parameter("bias", None)
    assert why_not_fusable_qkv(mixed_bias) == "q_proj, k_proj and v_proj do not all have a bias, nor all none"

    mixed_dtype = LlamaAttention(cfg, layer_idx=0)
    mixed_dtype.v_proj.to(torch.bfloat16)
    assert why_not_fusable_qkv(mixed_dtype) == "q/k/v weights differ in dtype or device"

    bad_shape = LlamaAttention(cfg, layer_idx=0)
    bad_shape.v_proj = torch.nn.Linear(SMALL["hidden_size"], 16, bias=False)  # k and v differ
    assert why_not_fusable_qkv(bad_shape).startswith("weight shapes (64, 64), (32, 64), (16, 64) are not")

    sub = LlamaAttention(cfg, layer_idx=0)
    sub.k_proj = type("MyLinear", (torch.nn.Linear,), {})(SMALL["hidden_size"], 32, bias=False)
    assert why_not_fusable_qkv(sub) == "k_proj is a MyLinear, not nn.Linear"

    replaced = LlamaAttention(cfg, layer_idx=0)
    replaced.forward = lambda *a, **k: None  # e.g. accelerate's device hook
    assert why_not_fusable_qkv(replaced).startswith("its forward is replaced on the instance")

    with torch.device("meta"):
        assert why_not_fusable_qkv(LlamaAttention(cfg, layer_idx=0)) == "q_proj has a meta weight"

    class OtherAttention(LlamaAttention):  # another forward
        def forward(self, hidden_states, *args, **kwargs):
            return super().forward(hidden_states * 2, *args, **kwargs)

    assert why_not_fusable_qkv(OtherAttention(cfg, layer_idx=0)).startswith(
        "its forward is not LlamaAttention, MistralAttention or Qwen2Attention.forward's code")

    model = _model("llama")
    model.model.layers[1].self_attn.q_proj.register_forward_pre_hook(lambda *a: None)
    with caplog.at_level("INFO", logger="cutile_kernels"):
        assert fuse_qkv(model) == 1
    assert "left 1 LlamaAttention with separate q/k/v projections: q_proj has forward or backward hooks" in caplog.text
    assert hasattr(model.model.layers[0].self_attn, FUSED_NAME)
    assert hasattr(model.model.layers[1].self_attn, "q_proj")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_changed_transformers_forward_fuses_nothing(name, monkeypatch, caplog):
    from cutile_kernels.layers import _pins

    model = _model(name)
    monkeypatch.setattr(_pins, "statements_digest", lambda fn: "0" * 16)  # another transformers
    with caplog.at_level("INFO", logger="cutile_kernels"):
        assert fuse_qkv(model) == 0
    assert (f"left 2 {STOCK_CLASSES[name]} with separate q/k/v projections: this transformers' "
            f"{STOCK_CLASSES[name]}.forward is not the one the fused forward reproduces (5.22.2)") in caplog.text
    assert not any(hasattr(m, FUSED_NAME) for m in model.modules())


def test_a_changed_digest_constant_leaves_only_that_family_alone(change_pin):
    change_pin("llama.LlamaAttention.forward")
    assert fuse_qkv(_model("llama")) == 0
    assert fuse_qkv(_model("mistral")) == 2


# ---------------------------------------------------------------------------------------------
# Same numbers as the stock model
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_logits_equal_stock_on_a_padded_batch(name, attn):
    stock = _model(name, attn=attn)
    model = copy.deepcopy(stock)
    assert fuse_qkv(model) == 2
    for m in _attns(model):
        assert type(m).__name__ == "CutileQKV" + STOCK_CLASSES[name] and type(m).forward is fused_qkv_forward
        assert isinstance(m, type(m)._cutile_qkv_unfused_class)
        assert list(m._modules) == [FUSED_NAME, "o_proj"]
        assert m._cutile_qkv_split == (64, 32)
        assert m.qkv_proj.weight.shape == (128, 64)
        assert (m.qkv_proj.bias is not None) == (name == "qwen2")
    ids, mask = _batch()
    with torch.no_grad():
        want = stock(ids, attention_mask=mask, output_attentions=attn == "eager")
        got = model(ids, attention_mask=mask, output_attentions=attn == "eager")
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-6, atol=1e-6)
    if attn == "eager":  # the recorded attention weights (transformers hooks the stock class)
        assert len(got.attentions) == 2
        for a, b in zip(got.attentions, want.attentions):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert fuse_qkv(model) == 0  # idempotent


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_attention_interface_gets_the_stock_arguments(name, monkeypatch):
    """sdpa and eager read the window from the mask; flash attention and ours read the
    ``sliding_window`` argument: a probe interface records what each forward passes."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    calls = []

    def probe(module, query, key, value, attention_mask, **kwargs):
        calls.append((module.layer_idx, tuple(query.shape), tuple(key.shape), tuple(value.shape),
                      {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "qkv_probe", probe)
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "qkv_probe", sdpa_mask)
    stock = _model(name, attn="qkv_probe")
    model = copy.deepcopy(stock)
    fuse_qkv(model)
    ids, mask = _batch()
    with torch.no_grad():
        want = stock(ids, attention_mask=mask).logits
        stock_calls, calls[:] = list(calls), []
        got = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert calls == stock_calls and len(calls) == 2
    windows = [c[-1].get("sliding_window", "absent") for c in calls]
    assert windows == {"llama": ["absent"] * 2, "mistral": [4, 4], "qwen2": [None, 4]}[name]


def test_rope_is_the_modeling_modules_current_function(monkeypatch):
    """The fused forward calls the module-level ``apply_rotary_pos_emb`` at call time, as the
    stock forward does, so a hub-kernelized or later replaced RoPE function is the one that runs."""
    from transformers.models.mistral import modeling_mistral

    model = _model("mistral")
    fuse_qkv(model)
    ids, mask = _batch()
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
    seen = []
    stock_rope = modeling_mistral.apply_rotary_pos_emb

    def rope(q, k, cos, sin):
        seen.append(q.shape)
        return stock_rope(q, k, cos, sin)

    monkeypatch.setattr(modeling_mistral, "apply_rotary_pos_emb", rope)
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
    assert seen == [(2, 4, SEQ, 16)] * 2
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _same_generation(stock, model, cache):
    """Greedy generate of both models on the padded batch over ``cache``: same tokens and logits."""
    ids, mask = _batch()
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
              return_dict_in_generate=True, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        want = stock.generate(ids, **kw)
        got = model.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert got.sequences.shape[1] == SEQ + 6
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_generate_equals_stock(name, cache):
    stock = _model(name)
    model = copy.deepcopy(stock)
    fuse_qkv(model)
    _same_generation(stock, model, cache)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_dynamic_cache_keeps_no_qkv_buffer(name):
    stock = _model(name)
    model = copy.deepcopy(stock)
    fuse_qkv(model)
    ids, mask = _batch()
    caches = []
    for m in (stock, model):
        caches.append(DynamicCache(config=m.config))
        with torch.no_grad():
            m(ids, attention_mask=mask, past_key_values=caches[-1], use_cache=True)
    qkv_bytes = 2 * SEQ * 128 * 4  # one layer's qkv buffer, float32
    for stock_layer, layer in zip(*(c.layers for c in caches)):
        for what in ("keys", "values"):
            t, ref = getattr(layer, what), getattr(stock_layer, what)
            torch.testing.assert_close(t, ref, rtol=0, atol=0)
            # The same storage as stock: exactly the tensor, except that a sliding-window layer
            # keeps the window as a slice of the full (B, Hkv, S, D) states, as stock does.
            assert t.untyped_storage().nbytes() == ref.untyped_storage().nbytes() < qkv_bytes
            if type(layer).__name__ == "DynamicLayer":
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_backward_reaches_the_stacked_weight():
    stock = _model("qwen2", torch.float64)
    model = copy.deepcopy(stock)
    fuse_qkv(model)
    ids, mask = _batch()
    stock(ids, attention_mask=mask).logits.square().sum().backward()
    model(ids, attention_mask=mask).logits.square().sum().backward()
    for a, b in zip(_attns(model), _attns(stock)):
        for what in ("weight", "bias"):
            want = torch.cat([getattr(getattr(b, n), what).grad for n in ("q_proj", "k_proj", "v_proj")])
            torch.testing.assert_close(getattr(a.qkv_proj, what).grad, want, rtol=1e-10, atol=1e-12)


def test_fused_attention_under_torch_compile_on_cpu():
    model = _model("mistral", attn="eager")
    fuse_qkv(model)
    attn = _attns(model)[0]
    x = torch.randn(2, 5, SMALL["hidden_size"])
    pe = model.model.rotary_emb(x, torch.arange(5).expand(2, 5))
    compiled = torch.compile(attn, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, pe, None)[0], attn(x, pe, None)[0], rtol=0, atol=0)


def test_stacked_qwen3_compiles_fullgraph_with_our_op():
    """Stacked Qwen3 (one qkv GEMM, then qk_norm_rope) traces in one graph with the op in it."""
    from families import compile_fullgraph

    _, model = _qwen3_pair()
    frames, targets, got, want = compile_fullgraph(model)
    assert frames == 1 and any("qk_norm_rope" in t for t in targets), targets
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Weights: one copy, stock keys and bytes
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=sorted(CONFIGS))
def ckpt(request, tmp_path_factory):
    """A tiny bf16 checkpoint of each family, its stock logits and its stock safetensors."""
    qkv_layers._forward_verdict.cache_clear()
    qkv_layers.stock_forward_parts.cache_clear()
    model = _model(request.param, torch.bfloat16, seed=7)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    ids, mask = _batch()
    stock = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = stock(ids, attention_mask=mask).logits
    return {"name": request.param, "path": path, "ids": ids, "mask": mask, "logits": logits,
            "tensors": load_file(path / "model.safetensors")}


def _load(ckpt):
    return AutoModelForCausalLM.from_pretrained(ckpt["path"]).eval()


def _logits(model, ckpt):
    with torch.no_grad():
        return model(ckpt["ids"], attention_mask=ckpt["mask"]).logits


def test_fused_weights_are_the_only_copy(ckpt):
    model = _load(ckpt)
    assert model.dtype == torch.bfloat16
    before_bytes, before = _param_bytes(model), _storages(model)
    old = [weakref.ref(p) for m in _attns(model) for n in ("q_proj", "k_proj", "v_proj")
           for p in getattr(m, n).parameters()]
    stock_sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert fuse_qkv(model) == 2
    gc.collect()
    assert all(r() is None for r in old), "an original q/k/v tensor is still alive"
    assert _param_bytes(model) == before_bytes
    after = _storages(model)
    assert sum(after.values()) == sum(before.values())
    per_module = 6 if ckpt["name"] == "qwen2" else 3  # q/k/v weights (and biases) -> 1 (or 2)
    assert len(after) == len(before) - 2 * (per_module - per_module // 3)
    sd = model.state_dict()
    for i, m in enumerate(_attns(model)):
        for n in ("q_proj", "k_proj", "v_proj"):
            for what in ("weight", "bias") if ckpt["name"] == "qwen2" else ("weight",):
                t = sd[f"model.layers.{i}.self_attn.{n}.{what}"]
                fused = getattr(m.qkv_proj, what)
                assert t.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()  # a view
                assert torch.equal(t, stock_sd[f"model.layers.{i}.self_attn.{n}.{what}"])
    torch.testing.assert_close(_logits(model, ckpt), ckpt["logits"], rtol=0, atol=0)


def test_state_dict_has_the_stock_keys_and_bytes_in_stock_order(ckpt):
    model = _load(ckpt)
    stock = model.state_dict()
    stock_keys, stock_vals = list(stock), {k: v.clone() for k, v in stock.items()}
    fuse_qkv(model)
    sd = model.state_dict()
    assert list(sd) == stock_keys
    assert all(sd[k].dtype == v.dtype and torch.equal(sd[k], v) for k, v in stock_vals.items())
    params = dict(model.named_parameters())
    assert "model.layers.0.self_attn.qkv_proj.weight" in params
    assert "model.layers.0.self_attn.q_proj.weight" not in params
    assert ("model.layers.0.self_attn.qkv_proj.bias" in params) == (ckpt["name"] == "qwen2")


def test_save_after_fusion_writes_the_stock_checkpoint(ckpt, tmp_path):
    model = _load(ckpt)
    fuse_qkv(model)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert sorted(saved) == sorted(ckpt["tensors"])
    for k, v in ckpt["tensors"].items():
        assert saved[k].dtype == v.dtype and torch.equal(saved[k].view(torch.uint8), v.view(torch.uint8)), k
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((ckpt["path"] / "config.json").read_text())
    stock = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert all(type(m).__name__ == STOCK_CLASSES[ckpt["name"]] and hasattr(m, "q_proj") for m in _attns(stock))
    torch.testing.assert_close(_logits(stock, ckpt), ckpt["logits"], rtol=0, atol=0)


def test_load_state_dict_with_stock_keys_writes_into_the_fused_weights(ckpt):
    model = _model(ckpt["name"], torch.bfloat16, seed=99)  # other weights
    fuse_qkv(model)
    fused_ptrs = [m.qkv_proj.weight.data_ptr() for m in _attns(model)]
    result = model.load_state_dict(ckpt["tensors"], strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight"}  # tied in some configs
    assert [m.qkv_proj.weight.data_ptr() for m in _attns(model)] == fused_ptrs  # in place
    with torch.no_grad():
        if "lm_head.weight" in result.missing_keys:
            model.lm_head.weight.copy_(ckpt["tensors"]["model.embed_tokens.weight"])
    torch.testing.assert_close(_logits(model, ckpt), ckpt["logits"], rtol=0, atol=0)
    # Only one of the stock keys: the other rows keep their values.
    pre = "model.layers.0.self_attn."
    before = {k: v.clone() for k, v in model.state_dict().items() if k.startswith(pre)}
    new_k = torch.randn_like(before[pre + "k_proj.weight"])
    model.load_state_dict({pre + "k_proj.weight": new_k}, strict=False)
    sd = model.state_dict()
    assert torch.equal(sd[pre + "k_proj.weight"], new_k)
    assert all(torch.equal(sd[k], v) for k, v in before.items() if k != pre + "k_proj.weight")
    # A wrong shape is reported under the stock key, as the stock module would.
    with pytest.raises(RuntimeError, match=r"size mismatch for model\.layers\.0\.self_attn\.v_proj\.weight"):
        model.load_state_dict({pre + "v_proj.weight": torch.zeros(3, 64, dtype=torch.bfloat16)}, strict=False)


def test_unfuse_restores_the_stock_modules(ckpt):
    model = _load(ckpt)
    cls = type(_attns(model)[0])
    stock_params = list(dict(model.named_parameters()))
    stock_modules = list(_attns(model)[0]._modules)
    assert fuse_qkv(model) == 2
    assert fuse_qkv(model) == 0
    assert unfuse_qkv(model) == 2
    assert unfuse_qkv(model) == 0
    for m in _attns(model):
        assert type(m) is cls and list(m._modules) == stock_modules
        assert not hasattr(m, FUSED_NAME) and "_cutile_qkv_split" not in m.__dict__
        assert len({m.q_proj.weight.untyped_storage().data_ptr(), m.k_proj.weight.untyped_storage().data_ptr(),
                    m.v_proj.weight.untyped_storage().data_ptr()}) == 3
        assert not m._state_dict_hooks and not m._load_state_dict_pre_hooks
        assert type(m.q_proj) is torch.nn.Linear and (m.q_proj.bias is not None) == (ckpt["name"] == "qwen2")
    assert list(dict(model.named_parameters())) == stock_params
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in ckpt["tensors"].items())
    torch.testing.assert_close(_logits(model, ckpt), ckpt["logits"], rtol=0, atol=0)
    assert fuse_qkv(model) == 2  # and it fuses again


def test_deepcopy_of_a_fused_model(ckpt):
    model = _load(ckpt)
    fuse_qkv(model)
    twin = copy.deepcopy(model)
    assert [type(m) for m in _attns(twin)] == [type(m) for m in _attns(model)]
    assert _attns(twin)[0].qkv_proj.weight.data_ptr() != _attns(model)[0].qkv_proj.weight.data_ptr()
    assert list(twin.state_dict()) == list(model.state_dict())
    torch.testing.assert_close(_logits(twin, ckpt), ckpt["logits"], rtol=0, atol=0)
    assert unfuse_qkv(twin) == 2  # the copy's hook handles refer to the copy's hooks
    assert all(not m._state_dict_hooks for m in _attns(twin))
    assert all(m._state_dict_hooks for m in _attns(model))


def test_a_deepcopy_of_a_fused_model_loads_stock_keys_into_itself(ckpt):
    # The load hooks hold their module weakly: a copy's must reach the copy (they reached a
    # throwaway module made while deepcopy rebuilt it, and loading raised "dead Module").
    from cutile_kernels.layers.mlp import fuse_mlp

    model = _load(ckpt)
    fuse_qkv(model)
    fuse_mlp(model)
    twin = copy.deepcopy(model)
    new = {k: torch.randn_like(v) for k, v in ckpt["tensors"].items()}
    twin.load_state_dict(new)
    assert all(torch.equal(twin.state_dict()[k], v) for k, v in new.items())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ckpt["tensors"].items())


def test_fused_attentions_pickle(ckpt, tmp_path):
    """Pickling fused attention modules. transformers 5.22 attention modules do not pickle even
    stock: ``_kernel_funcs`` holds kernels' rotary ``Func`` module, a local class; without it,
    fused modules pickle as the stock ones do."""
    model = _load(ckpt)
    with pytest.raises((pickle.PicklingError, AttributeError), match="local"):
        pickle.dumps(_attns(model)[0])
    fuse_qkv(model)
    attns = _attns(model)
    with pytest.raises((pickle.PicklingError, AttributeError), match="local"):  # the same reason
        pickle.dumps(attns[0])
    for m in attns:
        m.__dict__.pop("_kernel_funcs", None)
    torch.save(attns, tmp_path / "attns.pt")
    back = torch.load(tmp_path / "attns.pt", weights_only=False)
    x = torch.randn(2, 5, SMALL["hidden_size"], dtype=torch.bfloat16)
    pe = model.model.rotary_emb(x, torch.arange(5).expand(2, 5))
    for a, b in zip(attns, back):
        assert type(a) is type(b) and list(a.state_dict()) == list(b.state_dict())
        assert b._cutile_qkv_split == a._cutile_qkv_split
        with torch.no_grad():
            assert torch.equal(a(x, pe, None)[0], b(x, pe, None)[0])


def test_mlp_and_qkv_fusions_are_independent(ckpt):
    model = _load(ckpt)
    stock_keys = list(model.state_dict())
    assert fuse_qkv(model) == 2 and mlp_layers.fuse_mlp(model) == 2
    assert list(model.state_dict()) == stock_keys
    torch.testing.assert_close(_logits(model, ckpt), ckpt["logits"], rtol=0, atol=0)
    assert mlp_layers.unfuse_mlp(model) == 2  # the MLPs only
    assert all(hasattr(m, FUSED_NAME) for m in _attns(model))
    assert unfuse_qkv(model) == 2
    assert list(model.state_dict()) == stock_keys
    torch.testing.assert_close(_logits(model, ckpt), ckpt["logits"], rtol=0, atol=0)


def test_tiny_preset_fuses_after_from_pretrained(tmp_path):
    from cutile_kernels_tools import presets

    path = presets.materialize("tiny", out_dir=tmp_path / "tiny")
    ids = torch.randint(0, 512, (1, 17), generator=torch.Generator().manual_seed(0))
    stock = AutoModelForCausalLM.from_pretrained(path).eval()
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert fuse_qkv(model) == presets.PRESETS["tiny"].config["num_hidden_layers"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# GPU: the stacked GEMM inside real attention, with our kernels around it
# ---------------------------------------------------------------------------------------------

GPU_SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=64, vocab_size=512)
GPU_CONFIGS = {
    "llama": lambda: LlamaConfig(**GPU_SIZES),
    "mistral": lambda: MistralConfig(**GPU_SIZES, sliding_window=16),
    "qwen2": lambda: Qwen2Config(**{**GPU_SIZES, "head_dim": 32}, use_sliding_window=True, sliding_window=16,
                                 max_window_layers=1),
    "qwen3": lambda: Qwen3Config(**GPU_SIZES),  # stacked under qk_norm_rope's forward
}


def _gpu_model(name):
    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(GPU_CONFIGS[name](), dtype=torch.float32, attn_implementation="sdpa").eval()


def _generate_error(model, ref, ids, mask, cache):
    """Relative error of greedy ``generate`` scores against the fp32 model's teacher-forced logits."""
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                             cache_implementation=cache, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=0, disable_compile=True)
        full = torch.cat([mask, torch.ones(2, 6, dtype=mask.dtype, device=mask.device)], 1)
        tf = ref(out.sequences, attention_mask=full).logits[:, ids.shape[1] - 1:-1].double()
    scores = torch.stack(out.scores, 1).double()
    fin = torch.isfinite(scores)  # min_new_tokens sets EOS to -inf
    return ((scores - tf)[fin].norm() / tf[fin].norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["sdpa", "cutile"])
@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_fused_qkv_on_gpu_is_as_close_to_float32_as_stock(name, attn, strict):
    """The kernelized model (hub RoPE on q/k views of the stacked output, default patches,
    fused_qkv; sdpa or our attention) against the fp32 model, as close as stock bf16 is: logits on
    a left-padded batch, and generate() over both caches. Stock is measured before kernelize,
    which swaps the modeling module's shared RoPE function."""
    import cutile_kernels
    from cutile_kernels_tools.bench.worker import runtime_copies  # the hub RoPE runs from the build's copy

    ref = _gpu_model(name)  # float32, sdpa (our attention takes bf16 and fp16)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, ref.config.vocab_size, (2, 45), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :22], mask[1, :22] = 0, 0
    ids, mask = ids.cuda(), mask.cuda()
    valid = mask.bool()
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits.double()

    def err(logits):
        d = logits.double()[valid] - want[valid]
        return (d.norm() / want[valid].norm()).item()

    stock = copy.deepcopy(ref).to(torch.bfloat16)
    # Not a deepcopy: that would copy the module-level RoPE function into the model's
    # _kernel_funcs, and kernelize would swap the copy, not the one the forward calls.
    ours = _gpu_model(name).to(torch.bfloat16)
    ours.load_state_dict(stock.state_dict())
    with torch.no_grad():
        base = err(stock(ids, attention_mask=mask).logits)
    base_gen = {cache: _generate_error(stock, ref, ids, mask, cache) for cache in ("dynamic", "static")}
    ours.set_attn_implementation(attn)
    cutile_kernels.kernelize(ours)
    assert cutile_kernels.patch(ours, names="fused_qkv").changed["fused_qkv"] == ours.config.num_hidden_layers
    for d in runtime_copies():
        d.reset_stats()
    with torch.no_grad():
        got = err(ours(ids, attention_mask=mask).logits)
    assert got <= 1.1 * base + 1e-6, (got, base)
    launched = {s for d in runtime_copies() for s, n in d.stats()["launches"].items() if n}
    rope = "qk_norm_rope_kernel" if name == "qwen3" else "rope_kernel"
    assert any(s.startswith(rope) for s in launched), launched  # on the stacked q/k views
    for cache, stock_err in base_gen.items():
        ours_err = _generate_error(ours, ref, ids, mask, cache)
        assert ours_err <= 1.25 * stock_err + 2e-3, (cache, ours_err, stock_err)


def test_projections_that_differ_in_requires_grad_are_left_alone():
    # One stacked tensor has one requires_grad: fusing a frozen q/k with a trainable v would
    # change what trains.
    attn = _attns(_model("llama"))[0]
    attn.k_proj.weight.requires_grad_(False)
    assert "requires_grad" in why_not_fusable_qkv(attn)
