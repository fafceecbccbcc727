"""Patch ``dynamic_cache_prefill`` (``layers/kv_cache.py``): a DynamicCache layer's first write on
the ``kv_append`` kernel.

CPU: with the device check widened to the CPU (``kv_append`` runs its reference there, the stock
``index_copy_``), the replaced ``update`` methods give what transformers' give, call by call
(returned tensors, their layout, the layer's state), for full and sliding layers, with and without
recording the past, windows shorter and longer than the prompt, strided values; the calls they must
leave to transformers' methods; the methods while models are patched, unpatched and freed; a
changed pin and a foreign replacement; transformers' export flattening; whole models' logits and
``generate``; a fullgraph compile (the cat in the graph, not our op). GPU: the kernel's copies bit
for bit against ``torch.cat`` on poisoned buffers, on real models' head shapes and the edges.
"""

from __future__ import annotations

import functools
import gc
import pickle

import pytest
import torch

import cutile_kernels
import families

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer  # noqa: E402

from cutile_kernels.layers import kv_cache as kc  # noqa: E402
from cutile_kernels.layers._pins import holds  # noqa: E402


def _stock(cls):
    """transformers' own ``update`` of ``cls`` (the method the patch replaced, if it is in effect)."""
    fn = cls.__dict__["update"]
    return getattr(fn, "__wrapped__", fn)


@pytest.fixture
def on_cpu(monkeypatch):
    """The replacements take CPU tensors too (the op's reference path): the logic runs without a GPU."""
    monkeypatch.setattr(kc, "DEVICE_TYPES", ("cuda", "cpu"))


@pytest.fixture
def kv_calls(monkeypatch):
    """The calls the replacements make to ``kv_append`` (each still runs)."""
    calls = []
    real = kc.kv_append
    monkeypatch.setattr(kc, "kv_append", lambda *a: calls.append(a) or real(*a))
    return calls


@pytest.fixture
def held():
    """The replacements in effect for the test (a tiny patched model holds them)."""
    model = families.model("llama", layers=1)
    kc.patch_dynamic_cache(model)
    assert kc.installed() is not None and id(model) in kc.installed()
    yield model
    kc.unpatch_dynamic_cache(model)


@pytest.fixture
def clean():
    """No patched model alive (earlier tests' models freed): transformers' methods in place."""
    gc.collect()
    if kc.installed():
        pytest.skip("a patched model of another test is still referenced")
    assert DynamicLayer.__dict__["update"] is _stock(DynamicLayer)


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
        return DynamicLayer(), DynamicLayer()
    stock, ours = DynamicSlidingWindowLayer(window), DynamicSlidingWindowLayer(window)
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
    if hasattr(stock, "_sliding_window_tensor"):  # moved to the keys' device by lazy_initialization
        assert ours._sliding_window_tensor.device == stock._sliding_window_tensor.device


@pytest.mark.parametrize("kind,window,record", [("full", 0, False), ("sliding", 5, False), ("sliding", 64, False),
                                                ("sliding", 5, True), ("sliding", 64, True)])
@pytest.mark.parametrize("B,H,S,D", [(1, 1, 1, 64), (2, 3, 9, 80), (1, 8, 37, 128), (3, 2, 17, 256)])
@pytest.mark.parametrize("strided", [False, True])
def test_layer_calls_match_transformers(on_cpu, held, kind, window, record, B, H, S, D, strided):
    stock, ours = _pair(kind, window, record)
    for step, new in enumerate((S, 1, 1, 3)):  # the prompt, two decode steps, a chunk
        k, v = _kv(B, H, new, D, strided=strided and step == 0)
        want = _stock(type(stock))(stock, k, v)
        got = ours.update(k, v)
        for g, w in zip(got, want):
            _same(g, w)
        _check_state(stock, ours)
    ours.reset()
    stock.reset()
    k, v = _kv(B, H, S, D)  # a reset layer's next write is a first write again
    for g, w in zip(ours.update(k, v), _stock(type(stock))(stock, k, v)):
        _same(g, w)


def test_first_write_copies_through_the_kernel_op(on_cpu, held, kv_calls):
    calls = kv_calls
    layer = DynamicLayer()
    k, v = _kv(2, 4, 7, 64, strided=True)
    keys, values = layer.update(k, v)
    assert len(calls) == 1 and calls[0][2] is k and calls[0][3] is v and calls[0][4].item() == 0
    assert keys.is_contiguous() and values.is_contiguous() and keys.data_ptr() != k.data_ptr()
    assert torch.equal(keys, k) and torch.equal(values, v)
    layer.update(*_kv(2, 4, 1, 64))  # a decode step: the stock cat
    assert len(calls) == 1

    class Theirs(DynamicLayer):  # a subclass inherits the replacement, which leaves it its own lines
        pass

    Theirs().update(*_kv(2, 4, 7, 64))
    assert len(calls) == 1


def test_first_write_leaves_other_calls_to_the_stock_lines(on_cpu, monkeypatch):
    k, v = _kv(1, 2, 5, 64)
    layer = DynamicLayer()
    assert kc.first_write(layer, k, v) is not None
    _stock(DynamicLayer)(layer, k, v)
    assert kc.first_write(layer, k, v) is None  # initialized: the cat
    fresh = DynamicLayer()
    assert kc.first_write(fresh, k, v.double()) is None  # dtypes differ
    assert kc.first_write(fresh, k, v[..., :32]) is None  # shapes differ
    assert kc.first_write(fresh, k, v.to("meta")) is None  # devices differ
    assert kc.first_write(fresh, *_kv(1, 2, 5, 512)) is None  # head dim over 256
    assert kc.first_write(fresh, *_kv(1, 2, 0, 64)) is None  # nothing to write
    assert kc.first_write(fresh, k.to(torch.int64), v.to(torch.int64)) is None  # no variant
    kg = k.clone().requires_grad_()
    assert kc.first_write(fresh, kg, v) is None  # autograd records: the cat has a backward
    with torch.no_grad():
        assert kc.first_write(fresh, kg, v) is not None
    monkeypatch.setenv("CUTILE_KERNELS_DISABLE", "1")  # kernels off: transformers' cat, not our reference
    assert kc.first_write(DynamicLayer(), k, v) is None


def test_cpu_tensors_take_the_stock_lines_by_default(held, monkeypatch):
    calls = []
    monkeypatch.setattr(kc, "kv_append", lambda *a: calls.append(a))
    layer = DynamicLayer()
    k, v = _kv(1, 2, 5, 64)
    keys, _ = layer.update(k, v)
    assert calls == [] and torch.equal(keys, k)


def test_methods_are_replaced_while_a_patched_model_lives(clean):
    stock_full, stock_sliding = _stock(DynamicLayer), _stock(DynamicSlidingWindowLayer)
    a, b = families.model("llama"), families.model("gemma2")
    assert kc.patch_dynamic_cache(a) == a.config.num_hidden_layers
    assert DynamicLayer.update is kc.dynamic_update and DynamicSlidingWindowLayer.update is kc.sliding_update
    assert kc.dynamic_update.__wrapped__ is stock_full and kc.sliding_update.__wrapped__ is stock_sliding
    assert all(holds(p.name) for p in kc.PINS)  # the pins read transformers' methods through __wrapped__
    assert kc.patch_dynamic_cache(a) == 0  # already patched
    assert kc.patch_dynamic_cache(b) == b.config.num_hidden_layers
    cache = DynamicCache(config=b.config)
    assert {type(x) for x in cache.layers} == {DynamicLayer, DynamicSlidingWindowLayer}  # transformers' classes
    assert kc.unpatch_dynamic_cache(a) == a.config.num_hidden_layers
    assert DynamicLayer.update is kc.dynamic_update  # b still holds them
    assert kc.unpatch_dynamic_cache(a) == 0
    assert kc.unpatch_dynamic_cache(b) == b.config.num_hidden_layers
    assert DynamicLayer.__dict__["update"] is stock_full and DynamicSlidingWindowLayer.__dict__["update"] is stock_sliding
    # A freed model releases them too.
    c = families.model("llama")
    cutile_kernels.patch(c, names=["dynamic_cache_prefill"])
    assert DynamicLayer.update is kc.dynamic_update
    del c
    gc.collect()
    assert kc.installed() is None and DynamicLayer.__dict__["update"] is stock_full


def test_export_flattening_and_pickling_see_transformers_classes(on_cpu, held):
    from transformers.integrations import executorch

    model = families.model("gemma2", layers=2)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 7)), past_key_values=cache, use_cache=True)
    flat = executorch._get_cache_dict(cache)  # raises for any other layer class
    assert len(flat["key_cache"]) == 2
    again = pickle.loads(pickle.dumps(cache))
    assert [type(x) for x in again.layers] == [type(x) for x in cache.layers]
    assert torch.equal(again.layers[0].keys, cache.layers[0].keys)


def test_a_changed_pin_or_a_foreign_method_is_left_alone(clean, monkeypatch, change_pin):
    model = families.model("llama")

    def theirs(self, key_states, value_states, *args, **kwargs):
        return key_states, value_states

    monkeypatch.setattr(DynamicLayer, "update", theirs)
    assert kc.patch_dynamic_cache(model) == 0
    assert DynamicLayer.__dict__["update"] is theirs
    wrapped = functools.wraps(_stock(DynamicLayer))(lambda self, *a, **kw: theirs(self, *a, **kw))
    monkeypatch.setattr(DynamicLayer, "update", wrapped)  # a wrapper of transformers' method: refused too
    assert kc.patch_dynamic_cache(model) == 0
    monkeypatch.undo()
    change_pin("cache_utils.DynamicSlidingWindowLayer.update")
    assert kc.patch_dynamic_cache(model) == 0
    assert kc.installed() is None


def test_a_method_put_over_ours_is_left_and_never_wrapped(clean):
    stock_full, stock_sliding = _stock(DynamicLayer), _stock(DynamicSlidingWindowLayer)
    model = families.model("llama")
    kc.patch_dynamic_cache(model)
    ours = DynamicLayer.update

    @functools.wraps(ours)  # another tool's wrapper over ours: it copies our attributes
    def theirs(self, *args, **kwargs):
        return ours(self, *args, **kwargs)

    try:
        DynamicLayer.update = theirs
        assert kc.installed() is None  # ours is not in place any more
        assert kc.unpatch_dynamic_cache(model) == 0
        assert kc.patch_dynamic_cache(model) == 0  # refused: a wrapped method is someone else's
        assert DynamicLayer.__dict__["update"] is theirs
        DynamicLayer.update = ours
        assert id(model) in kc.installed()
        DynamicLayer.update = theirs
        del model
        gc.collect()  # the last holder freed: the sliding method goes back, theirs stays
        assert DynamicLayer.__dict__["update"] is theirs
        assert DynamicSlidingWindowLayer.__dict__["update"] is stock_sliding
        DynamicLayer.update = ours  # ours put back by hand, with no holder: taken back at the next patch
        other = families.model("llama")
        assert kc.patch_dynamic_cache(other) > 0 and id(other) in kc.installed()
        assert kc.unpatch_dynamic_cache(other) > 0
        assert DynamicLayer.__dict__["update"] is stock_full
    finally:
        DynamicLayer.update, DynamicSlidingWindowLayer.update = stock_full, stock_sliding


def test_sliding_subclasses_keep_their_own_lines(on_cpu, held, kv_calls):
    calls = kv_calls

    class Theirs(DynamicSlidingWindowLayer):
        pass

    k, v = _kv(1, 2, 9, 64)
    got = Theirs(4).update(k, v)
    want = _stock(DynamicSlidingWindowLayer)(DynamicSlidingWindowLayer(4), k, v)
    assert calls == [] and all(torch.equal(g, w) for g, w in zip(got, want))
    DynamicSlidingWindowLayer(4).update(k, v)
    assert len(calls) == 1


def test_a_model_without_attention_cache_layers_is_not_counted():
    assert kc.cache_layers(torch.nn.Linear(2, 2)) == 0


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "phi3", "olmo2", "qwen3"])
def test_models_prefill_and_generate_as_stock(on_cpu, model_type, monkeypatch, kv_calls):
    model = families.model(model_type, layers=2)
    ids = torch.randint(0, 256, (2, 11))
    monkeypatch.setenv("CUTILE_KERNELS_DISABLE", "1")  # transformers' cat, even if another test's model holds ours
    with torch.no_grad():
        c0 = DynamicCache(config=model.config)
        want = model(ids, past_key_values=c0, use_cache=True).logits
        gen_want = model.generate(ids, max_new_tokens=4, do_sample=False)
    monkeypatch.delenv("CUTILE_KERNELS_DISABLE")
    assert kv_calls == []
    try:
        assert cutile_kernels.patch(model, names=["dynamic_cache_prefill"]).changed["dynamic_cache_prefill"] > 0
        with torch.no_grad():
            c1 = DynamicCache(config=model.config)
            got = model(ids, past_key_values=c1, use_cache=True).logits
            gen_got = model.generate(ids, max_new_tokens=4, do_sample=False)
    finally:
        cutile_kernels.unpatch(model, names=["dynamic_cache_prefill"])
    assert len(kv_calls) >= 2 * model.config.num_hidden_layers  # both prefills' first writes, every layer
    assert torch.equal(got, want) and torch.equal(gen_got, gen_want)
    for a, b in zip(c0.layers, c1.layers):
        _same(b.keys, a.keys)
        _same(b.values, a.values)


def test_update_traces_the_cat_under_compile(on_cpu, held):
    # Under dynamo transformers' lines run (no launch of ours): one graph, the cat in it.
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    k, v = _kv(1, 2, 6, 64)

    def prefill(k, v):
        layer = DynamicLayer()
        return layer.update(k, v)

    got = torch.compile(prefill, fullgraph=True, backend=backend)(k, v)
    assert torch.equal(got[0], k) and torch.equal(got[1], v)
    assert len(graphs) == 1
    code = graphs[0].code
    assert "cat" in code and "kv_append" not in code


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
def test_gpu_first_write_is_torch_cat(held, poisoned, strict, B, H, S, D, dtype, strided):
    from cutile_kernels import dispatch

    k, v = _kv(B, H, S, D, dtype=dtype, device="cuda", strided=strided)
    before = dict(dispatch.stats()["launches"])
    layer = DynamicLayer()
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
def test_gpu_sliding_first_write(held, poisoned, strict, window, record):
    stock, ours = _pair("sliding", window, record)
    k, v = _kv(1, 4, 1000, 256, dtype=torch.bfloat16, device="cuda", strided=True)
    for g, w in zip(ours.update(k, v), _stock(DynamicSlidingWindowLayer)(stock, k, v)):
        _same(g, w)
    _check_state(stock, ours)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "gemma2", "phi3"])
def test_gpu_models_prefill_as_stock(model_type, monkeypatch):
    model = families.model(model_type, dtype=torch.bfloat16, layers=2).cuda()
    ids = torch.randint(0, 256, (2, 40), device="cuda")
    with torch.no_grad():
        monkeypatch.setenv("CUTILE_KERNELS_DISABLE", "1")  # transformers' cat, even if another model holds ours
        c0 = DynamicCache(config=model.config)
        want = model(ids, past_key_values=c0, use_cache=True).logits
        monkeypatch.delenv("CUTILE_KERNELS_DISABLE")
        cutile_kernels.patch(model, names=["dynamic_cache_prefill"])
        c1 = DynamicCache(config=model.config)
        got = model(ids, past_key_values=c1, use_cache=True).logits
    assert torch.equal(got, want)
    for a, b in zip(c0.layers, c1.layers):
        _same(b.keys, a.keys)
        _same(b.values, a.values)
