"""Patch ``dynamic_cache_prefill`` (``layers/kv_cache.py``): a DynamicCache layer's first write on
the ``kv_append`` kernel.

CPU: with the layer's device check widened to the CPU (``kv_append`` runs its reference there, the
stock ``index_copy_``), our layers give what transformers' give, call by call (returned tensors,
their layout, the layer's state), for full, sliding and chunked layers, with and without recording
the past, windows shorter and longer than the prompt, strided values; the calls it must leave to
the stock lines; the registry while models are patched and after; a changed pin; whole models'
logits and ``generate``; a fullgraph compile of an update. GPU: the kernel's copies bit for bit
against ``torch.cat`` on poisoned buffers, on real models' head shapes and the edges.
"""

from __future__ import annotations

import gc

import pytest
import torch

import cutile_kernels
import families

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, cache_utils  # noqa: E402
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer  # noqa: E402

from cutile_kernels.layers import kv_cache as kc  # noqa: E402


@pytest.fixture
def on_cpu(monkeypatch):
    """Our layers take CPU tensors too (the op's reference path): the logic runs without a GPU."""
    monkeypatch.setattr(kc, "DEVICE_TYPES", ("cuda", "cpu"))


@pytest.fixture(autouse=True)
def _stock_registry():
    # Each test starts and ends with transformers' classes in the registry and no holder.
    kc._HOLDERS.clear()
    kc.restore_registry()
    yield
    kc._HOLDERS.clear()
    kc.restore_registry()


def _kv(B, H, S, D, dtype=torch.float32, device="cpu", strided=False):
    if strided:  # views of one (B, S, 2 * H * D) projection, transposed as transformers passes them
        kv = torch.randn(B, S, 2 * H * D).to(dtype).to(device)
        return (kv[..., :H * D].view(B, S, H, D).transpose(1, 2), kv[..., H * D:].view(B, S, H, D).transpose(1, 2))
    return torch.randn(B, H, S, D).to(dtype).to(device), torch.randn(B, H, S, D).to(dtype).to(device)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride(), (a.shape, a.stride(), b.stride())
    assert torch.equal(a, b)


def _pair(kind: str, window: int, record: bool):
    if kind == "full":
        return DynamicLayer(), kc.CutileDynamicLayer()
    stock, ours = DynamicSlidingWindowLayer(window), kc.CutileDynamicSlidingWindowLayer(window)
    if record:
        stock.activate_past_recording()
        ours.activate_past_recording()
    return stock, ours


def _check_state(stock, ours) -> None:
    assert ours.is_initialized == stock.is_initialized and ours.dtype == stock.dtype and ours.device == stock.device
    _same(ours.keys, stock.keys)
    _same(ours.values, stock.values)
    assert getattr(ours, "cumulative_length", None) == getattr(stock, "cumulative_length", None)
    assert ours.get_seq_length() == stock.get_seq_length()


@pytest.mark.parametrize("kind,window,record", [("full", 0, False), ("sliding", 5, False), ("sliding", 64, False),
                                                ("sliding", 5, True), ("sliding", 64, True)])
@pytest.mark.parametrize("B,H,S,D", [(1, 1, 1, 64), (2, 3, 9, 80), (1, 8, 37, 128), (3, 2, 17, 256)])
@pytest.mark.parametrize("strided", [False, True])
def test_layer_calls_match_transformers(on_cpu, kind, window, record, B, H, S, D, strided):
    stock, ours = _pair(kind, window, record)
    for step, new in enumerate((S, 1, 1, 3)):  # the prompt, two decode steps, a chunk
        k, v = _kv(B, H, new, D, strided=strided and step == 0)
        want = stock.update(k, v)
        got = ours.update(k, v)
        for g, w in zip(got, want):
            _same(g, w)
        _check_state(stock, ours)
    ours.reset()
    stock.reset()
    k, v = _kv(B, H, S, D)  # a reset layer's next write is a first write again
    for g, w in zip(ours.update(k, v), stock.update(k, v)):
        _same(g, w)


def test_first_write_copies_through_the_kernel_op(on_cpu, monkeypatch):
    calls = []
    real = kc.kv_append
    monkeypatch.setattr(kc, "kv_append", lambda *a: calls.append(a) or real(*a))
    layer = kc.CutileDynamicLayer()
    k, v = _kv(2, 4, 7, 64, strided=True)
    keys, values = layer.update(k, v)
    assert len(calls) == 1 and calls[0][2] is k and calls[0][3] is v and calls[0][4].item() == 0
    assert keys.is_contiguous() and values.is_contiguous() and keys.data_ptr() != k.data_ptr()
    assert torch.equal(keys, k) and torch.equal(values, v)
    layer.update(*_kv(2, 4, 1, 64))  # a decode step: the stock cat
    assert len(calls) == 1


def test_first_write_leaves_other_calls_to_the_stock_lines(on_cpu):
    k, v = _kv(1, 2, 5, 64)
    layer = kc.CutileDynamicLayer()
    assert kc.first_write(layer, k, v) is not None
    layer.update(k, v)
    assert kc.first_write(layer, k, v) is None  # initialized: the cat
    fresh = kc.CutileDynamicLayer()
    assert kc.first_write(fresh, k, v.double()) is None  # dtypes differ
    assert kc.first_write(fresh, k, v[..., :32]) is None  # shapes differ
    assert kc.first_write(fresh, *_kv(1, 2, 5, 512)) is None  # head dim over 256
    assert kc.first_write(fresh, *_kv(1, 2, 0, 64)) is None  # nothing to write
    assert kc.first_write(fresh, k.to(torch.int64), v.to(torch.int64)) is None  # no variant
    kg = k.clone().requires_grad_()
    assert kc.first_write(fresh, kg, v) is None  # autograd records: the cat has a backward
    with torch.no_grad():
        assert kc.first_write(fresh, kg, v) is not None


def test_cpu_tensors_take_the_stock_lines_by_default(monkeypatch):
    calls = []
    monkeypatch.setattr(kc, "kv_append", lambda *a: calls.append(a))
    layer = kc.CutileDynamicLayer()
    k, v = _kv(1, 2, 5, 64)
    keys, _ = layer.update(k, v)
    assert calls == [] and torch.equal(keys, k)


def test_registry_holds_our_layers_while_a_patched_model_lives():
    mapping = cache_utils.DYNAMIC_LAYER_TYPE_MAPPING
    a, b = families.model("llama"), families.model("gemma2")
    assert kc.patch_dynamic_cache(a) == a.config.num_hidden_layers
    assert mapping["full_attention"] is kc.CutileDynamicLayer
    assert mapping["sliding_attention"] is mapping["chunked_attention"] is kc.CutileDynamicSlidingWindowLayer
    assert kc.patch_dynamic_cache(a) == 0  # already patched
    assert kc.patch_dynamic_cache(b) == b.config.num_hidden_layers
    cache = DynamicCache(config=b.config)
    assert {type(x) for x in cache.layers} == {kc.CutileDynamicLayer, kc.CutileDynamicSlidingWindowLayer}
    assert kc.unpatch_dynamic_cache(a) == a.config.num_hidden_layers
    assert mapping["full_attention"] is kc.CutileDynamicLayer  # b still holds them
    assert kc.unpatch_dynamic_cache(a) == 0
    assert kc.unpatch_dynamic_cache(b) == b.config.num_hidden_layers
    assert mapping["full_attention"] is DynamicLayer and mapping["sliding_attention"] is DynamicSlidingWindowLayer
    assert {type(x) for x in cache.layers} == {kc.CutileDynamicLayer, kc.CutileDynamicSlidingWindowLayer}
    # A freed model leaves the holders (the registry keeps our layers until an unpatch or a restore).
    c = families.model("llama")
    kc.patch_dynamic_cache(c)
    del c
    gc.collect()
    assert len(kc._HOLDERS) == 0


def test_foreign_registry_entry_and_changed_pin_are_left_alone(monkeypatch, change_pin):
    class Theirs(DynamicLayer):
        pass

    monkeypatch.setitem(cache_utils.DYNAMIC_LAYER_TYPE_MAPPING, "full_attention", Theirs)
    model = families.model("llama")
    assert kc.patch_dynamic_cache(model) > 0
    assert cache_utils.DYNAMIC_LAYER_TYPE_MAPPING["full_attention"] is Theirs
    kc.unpatch_dynamic_cache(model)
    assert cache_utils.DYNAMIC_LAYER_TYPE_MAPPING["full_attention"] is Theirs
    monkeypatch.setitem(cache_utils.DYNAMIC_LAYER_TYPE_MAPPING, "full_attention", DynamicLayer)
    change_pin("cache_utils.DynamicSlidingWindowLayer.update")
    assert kc.patch_dynamic_cache(model) == 0
    assert cache_utils.DYNAMIC_LAYER_TYPE_MAPPING["full_attention"] is DynamicLayer


def test_a_model_without_attention_cache_layers_is_not_counted():
    assert kc.cache_layers(torch.nn.Linear(2, 2)) == 0


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "phi3", "olmo2", "qwen3"])
def test_models_prefill_and_generate_as_stock(on_cpu, model_type):
    model = families.model(model_type, layers=2)
    ids = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        c0 = DynamicCache(config=model.config)
        want = model(ids, past_key_values=c0, use_cache=True).logits
        gen_want = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert cutile_kernels.patch(model, names=["dynamic_cache_prefill"]).changed["dynamic_cache_prefill"] > 0
    with torch.no_grad():
        c1 = DynamicCache(config=model.config)
        got = model(ids, past_key_values=c1, use_cache=True).logits
        gen_got = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert any(isinstance(x, (kc.CutileDynamicLayer, kc.CutileDynamicSlidingWindowLayer)) for x in c1.layers)
    assert torch.equal(got, want) and torch.equal(gen_got, gen_want)
    for a, b in zip(c0.layers, c1.layers):
        _same(b.keys, a.keys)
        _same(b.values, a.values)


def test_update_traces_without_graph_break(on_cpu):
    # Under dynamo the stock lines run (no launch of ours): one graph, the stock results.
    torch._dynamo.reset()
    k, v = _kv(1, 2, 6, 64)

    def prefill(k, v):
        layer = kc.CutileDynamicLayer()
        return layer.update(k, v)

    explained = torch._dynamo.explain(prefill)(k, v)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    got = torch.compile(prefill, fullgraph=True, backend="eager")(k, v)
    assert torch.equal(got[0], k) and torch.equal(got[1], v)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def poisoned(monkeypatch):
    """The layers' new buffers start as NaN, so that an element the kernel did not write fails."""
    def nan_buffers(k):
        return (torch.full(k.shape, float("nan"), dtype=k.dtype, device=k.device),
                torch.full(k.shape, float("nan"), dtype=k.dtype, device=k.device))

    monkeypatch.setattr(kc, "new_buffers", nan_buffers)


# (B, H_kv, S, D): Llama-3.2-1B, Qwen3-0.6B, Phi-4-mini, Gemma-3-1B (one KV head), Gemma-2-2B, and edges:
# one row, lengths off the kernel's 16-row blocks, head dims 80 and 96 padded to 128.
GPU_SHAPES = [(1, 8, 2048, 64), (1, 8, 512, 128), (1, 8, 2048, 128), (1, 1, 2048, 256), (1, 4, 513, 256),
              (4, 8, 33, 64), (1, 2, 1, 64), (2, 3, 17, 80), (1, 5, 100, 96)]


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,S,D", GPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("strided", [False, True])
def test_gpu_first_write_is_torch_cat(poisoned, strict, B, H, S, D, dtype, strided):
    from cutile_kernels import dispatch

    k, v = _kv(B, H, S, D, dtype=dtype, device="cuda", strided=strided)
    before = dict(dispatch.stats()["launches"])
    layer = kc.CutileDynamicLayer()
    keys, values = layer.update(k, v)
    torch.cuda.synchronize()
    assert sum(dispatch.stats()["launches"].values()) == sum(before.values()) + 1  # one kv_append launch
    want_k = torch.cat([torch.tensor([], dtype=dtype, device="cuda"), k], dim=-2)
    want_v = torch.cat([torch.tensor([], dtype=dtype, device="cuda"), v], dim=-2)
    _same(keys, want_k)
    _same(values, want_v)
    assert layer.keys is keys and layer.get_seq_length() == S
    step_k, step_v = _kv(B, H, 1, D, dtype=dtype, device="cuda")
    keys2, _ = layer.update(step_k, step_v)  # a decode step after it: the stock cat
    _same(keys2, torch.cat([want_k, step_k], dim=-2))


@pytest.mark.gpu
@pytest.mark.parametrize("window,record", [(4096, False), (512, False), (512, True)])
def test_gpu_sliding_first_write(poisoned, strict, window, record):
    stock, ours = _pair("sliding", window, record)
    k, v = _kv(1, 4, 1000, 256, dtype=torch.bfloat16, device="cuda", strided=True)
    for g, w in zip(ours.update(k, v), stock.update(k, v)):
        _same(g, w)
    _check_state(stock, ours)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "gemma2", "phi3"])
def test_gpu_models_prefill_as_stock(model_type):
    model = families.model(model_type, dtype=torch.bfloat16, layers=2).cuda()
    ids = torch.randint(0, 256, (2, 40), device="cuda")
    with torch.no_grad():
        c0 = DynamicCache(config=model.config)
        want = model(ids, past_key_values=c0, use_cache=True).logits
        cutile_kernels.patch(model, names=["dynamic_cache_prefill"])
        c1 = DynamicCache(config=model.config)
        got = model(ids, past_key_values=c1, use_cache=True).logits
    assert torch.equal(got, want)
    for a, b in zip(c0.layers, c1.layers):
        _same(b.keys, a.keys)
        _same(b.values, a.values)
