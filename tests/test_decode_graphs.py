"""The CUDA-graph decode fast path (``layers/decode_graphs.py``): ``generate()`` replays captured
decode steps and returns what the eager model returns.

CPU: a graph emulation (:class:`ReplayEmulation`) that behaves as a CUDA graph does where it
matters for correctness. Capturing runs the step's Python once (its side effects on Python state
happen) while the device work is not done (the cache tensors are put back); a replay does the
device work again on the captured input buffers with the Python state as it was at capture
(values a graph bakes in stay frozen), writes the captured output tensors in place, and runs no
Python side effect (the decode graphs apply the recorded integer changes). A bookkeeping error (a
Python integer not advanced, a mask built from a frozen length, a stale key, a graph replayed over
tensors a layer no longer holds) then gives other tokens than eager generation, which these tests
compare on every family with a static cache: sliding-window caches crossing their window, a
left-padded batch, rows that stop early, several batch sizes, a reordered cache, a growing 2-D
mask, chunked prefill; the pool of static caches (a returned cache is the caller's, inference mode
and dtype apart, graphs of freed caches dropped); and the errors (prompt longer than the cache, a
cache that fills).

GPU: the same comparisons with real CUDA graphs through ``from_pretrained(..., use_kernels=True,
kernel_config=kernel_config(decode_graphs=True))``, our kernels and attention in the graphs.
"""

from __future__ import annotations

import functools
import importlib
import logging
import weakref

import pytest
import torch

import cutile_kernels
from cutile_kernels.layers import decode_graphs as dg
from cutile_kernels.layers.hub import DECODE_GRAPH_PATCHES

from families import model as tiny_model

transformers = pytest.importorskip("transformers")
from transformers import StaticCache  # noqa: E402
from transformers.generation import CompileConfig  # noqa: E402


class ReplayEmulation:
    """A CUDA graph's replay semantics on a CPU (see the module docstring)."""

    captured = 0

    @staticmethod
    def warm(fn):
        return fn()

    def capture(self, fn, owner, cache=None):
        static_kwargs = _static_kwargs(fn)
        cache = static_kwargs["past_key_values"]
        # Held weakly, as a CUDA graph holds addresses, not the cache object. A replay repeats the
        # step as the owner ran it (DecodeGraphs.forward: the grouped lengths' one advance included).
        self.cache_ref, self.owner = weakref.ref(cache), owner
        self.plain = _closure(fn, "plain", False)  # a replay repeats the captured step's mask choice
        self.static = {k: v for k, v in static_kwargs.items() if k != "past_key_values"}
        tensors = _cache_tensors(cache)
        saved = [t.clone() for t in tensors]
        self.state0 = dg._python_state(cache)
        # A graph reads and writes the tensors that existed at capture, whatever a layer holds later.
        self.storage = [_held(layer) for layer in cache.layers]
        out = fn()
        for t, s in zip(tensors, saved):  # a capture does no device work
            t.copy_(s)
        self.output = dg._kept(out)  # its tensors are the graph's outputs, written in place by a replay
        ReplayEmulation.captured += 1
        return out

    def replay(self):
        cache = self.cache_ref()
        objs = {id(o): o for o in (cache, *cache.layers)}
        now = dg._python_state(cache)
        for (oid, name), value in self.state0.items():
            setattr(objs[oid], name, value)
        held = [_held(layer) for layer in cache.layers]
        for layer, kv in zip(cache.layers, self.storage):
            _hold(layer, kv)
        fresh = self.owner.forward({**self.static, "past_key_values": cache}, self.plain)
        for layer, kv in zip(cache.layers, held):
            _hold(layer, kv)
        for (oid, name), value in now.items():
            setattr(objs[oid], name, value)
        for key, value in self.output.items():
            if isinstance(value, torch.Tensor):
                value.copy_(fresh[key])


def _closure(fn, name, default=None):
    names = fn.__code__.co_freevars
    return fn.__closure__[names.index(name)].cell_contents if name in names else default


def _static_kwargs(fn):
    return _closure(fn, "static_kwargs")


def _cache_of(fn):
    return _static_kwargs(fn)["past_key_values"]


def _held(layer):
    # A layer's key and value tensors (a linear-attention layer's states never move: None).
    return None if dg._linear(layer) else (layer.keys, layer.values)


def _hold(layer, kv):
    if kv is not None:
        layer.keys, layer.values = kv


def _cache_tensors(cache):
    out = []
    for layer in cache.layers:
        if dg._linear(layer):
            out += [t for t in (*layer.conv_states.values(), *layer.recurrent_states.values()) if t is not None]
        else:
            out += [layer.keys, layer.values, layer.cumulative_length]
    return out


def _cpu_compile_config():
    cfg = CompileConfig()
    cfg._compile_all_devices = True  # transformers asks for a compiled decode on a GPU only, by default
    return cfg


def _generate(model, ids, new=12, logits=True, **kw):
    """Greedy ``new`` tokens; with ``logits`` a dict output with the step logits (then generate
    returns its cache, which decode graphs never reuse), else the sequences alone."""
    if logits:
        kw.update(output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, **kw)


def _same(got, want):
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.logits, want.logits):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.fixture
def emulated():
    def enable(model, **kw):
        graphs = dg.enable_decode_graphs(model, graph_factory=ReplayEmulation, **kw)
        assert graphs is not None
        return graphs
    return enable


# ---------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------

# Sliding windows of 4 (Gemma 3's and OLMo 3's every second layer) and 6 (Mistral, every layer): 12
# new tokens after a 5-token prompt cross them.
@pytest.mark.parametrize("model_type,fields", [("llama", {}), ("qwen3", {}), ("mistral", {"sliding_window": 6}),
                                               ("gemma3_text", {}), ("gemma2", {"sliding_window": 6}), ("phi3", {}),
                                               ("olmo3", {}), ("qwen3_5_text", {})],
                         ids=["llama", "qwen3", "mistral-window6", "gemma3-window4", "gemma2-window6", "phi3",
                              "olmo3-window4", "qwen3_5-linear-attention"])
def test_generate_replays_and_matches_eager(model_type, fields, emulated):
    model = tiny_model(model_type, **fields)
    ids = torch.randint(1, 256, (2, 5), generator=torch.Generator().manual_seed(3))
    want = _generate(model, ids, cache_implementation="static", disable_compile=True)
    graphs = emulated(model)
    got = _generate(model, ids, compile_config=_cpu_compile_config())
    _same(got, want)
    assert graphs.captures >= 1 and graphs.replays >= 6  # 11 decode steps; a window crossing costs 2 more eager
    assert not graphs.caches  # that call returned its cache: a fresh one, not pooled
    # Calls that keep their cache inside reuse one pooled cache and its graphs: once every shape
    # has been captured (a window's first state may only have been warmed up), nothing is again.
    for _ in range(2):
        assert torch.equal(_generate(model, ids, logits=False, compile_config=_cpu_compile_config()), want.sequences)
    captures = graphs.captures
    assert torch.equal(_generate(model, ids, logits=False, compile_config=_cpu_compile_config()), want.sequences)
    assert graphs.captures == captures and len(graphs.caches) == 1


@pytest.mark.parametrize("model_type,fields,patches", [
    ("qwen3_5_text", {}, ["qwen3_5_rope", "qwen3_5_stacked_proj"]),
    ("gemma3_text", {"sliding_window": 6}, ["gemma_add_norm", "gemma3_qk_norm_rope"]),
    # head_dim 128: qk_norm_rope_olmo2's tiles (the patch, and so fused_qkv, leaves the tiny 16 alone)
    ("olmo3", {"head_dim": 128}, ["olmo2_qk_norm_rope", "fused_qkv", "olmo2_norm_add"])],
    ids=["qwen3_5", "gemma3", "olmo3"])
def test_family_patches_replay_and_match_eager(model_type, fields, patches, emulated):
    """Patches in the replayed decode steps, against the stock model's static-cache generate:
    Qwen3.5's qwen3_5_rope (q/k norms + partial RoPE, the output gate) and qwen3_5_stacked_proj (one
    GEMM for in_proj_qkv / b / a), defaults; Gemma 3's gemma_add_norm (the attention residual
    add in pre_feedforward_layernorm) and gemma3_qk_norm_rope (q/k norms + RoPE in one launch),
    defaults, over sliding and global layers with the window crossed; OLMo 3's olmo2_qk_norm_rope
    with its q/k/v stacked (fused_qkv) and olmo2_norm_add, defaults (fused_qkv opt-in), over its
    sliding and full layers. On the GPU:
    test_gpu_generate_replays_cuda_graphs_and_matches_eager[qwen3_5_text-*] and [gemma3_text-*]."""
    model = tiny_model(model_type, **fields)
    ids = torch.randint(1, 256, (2, 5), generator=torch.Generator().manual_seed(4))
    want = _generate(model, ids, cache_implementation="static", disable_compile=True)
    changed = cutile_kernels.patch(model, names=patches).changed
    assert all(changed.values()), changed
    graphs = emulated(model)
    got = _generate(model, ids, compile_config=_cpu_compile_config())
    _same(got, want)
    assert graphs.captures >= 1 and graphs.replays >= 6


def test_sliding_layers_are_captured_once_per_state(emulated):
    """Mistral with a window of 6: one graph before its cache is full, one after."""
    model = tiny_model("mistral", sliding_window=6)
    emulated(model)
    graphs = getattr(model, dg.ATTR)
    _generate(model, torch.randint(1, 256, (1, 3)), new=14, logits=False, compile_config=_cpu_compile_config())
    fulls = sorted(key[2] for key in graphs.entries)
    assert fulls == [(False,) * 3, (True,) * 3] and graphs.captures == 2


def test_left_padded_batch_and_rows_that_stop_early(emulated):
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (3, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0  # row 0 left-padded by 3
    ids[1, :1], mask[1, :1] = 0, 0
    eos = int(_generate(model, ids, new=4, attention_mask=mask, cache_implementation="static",
                        disable_compile=True).sequences[2, -2])  # row 2 stops after its third new token
    kw = dict(attention_mask=mask, eos_token_id=eos, new=10)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=10, do_sample=False, cache_implementation="static",
                              disable_compile=True, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    emulated(model)
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=10, do_sample=False, attention_mask=mask, eos_token_id=eos,
                             pad_token_id=0, compile_config=_cpu_compile_config())
    assert torch.equal(got, want) and (want[2, 7 + 3:] == 0).all()
    del kw


def test_batch_sizes_get_their_own_cache_and_graph(emulated):
    model = tiny_model("qwen3")
    graphs = emulated(model)
    outs = {}
    for b in (1, 3, 1):
        ids = torch.randint(1, 256, (b, 6), generator=torch.Generator().manual_seed(b))
        outs.setdefault(b, []).append(_generate(model, ids, new=6, logits=False, compile_config=_cpu_compile_config()))
        want = _generate(model, ids, new=6, logits=False, cache_implementation="static", disable_compile=True)
        assert torch.equal(outs[b][-1], want)
    assert sorted(k[:2] for k in graphs.caches) == [(1, dg.LENGTH_BUCKET), (3, dg.LENGTH_BUCKET)]
    assert graphs.captures == 2


def test_cache_pool_keeps_at_most_max_caches(emulated):
    model = tiny_model("llama")
    graphs = emulated(model, max_caches=2, length_bucket=8)
    for new in (4, 12, 20):  # lengths 10, 18, 26 -> buckets 16, 24, 32
        _generate(model, torch.randint(1, 256, (1, 6)), new=new, logits=False, compile_config=_cpu_compile_config())
    assert [k[:2] for k in graphs.caches] == [(1, 24), (1, 32)]
    live = {id(c) for c in graphs.caches.values()}
    assert {k[0] for k in graphs.entries} <= live


def test_graphs_over_a_freed_cache_are_dropped(emulated):
    """A graph holds its cache's addresses: when the cache is freed its graphs go, so a new cache
    that gets the same id is captured afresh instead of replaying over freed memory."""
    import gc

    model = tiny_model("llama")
    graphs = emulated(model)
    step = model.get_compiled_call(None)

    def run(cache):
        with torch.no_grad():
            nxt = model(torch.randint(1, 256, (1, 4)), past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for _ in range(3):
                nxt = step(nxt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)

    cache = StaticCache(config=model.config, max_cache_len=32)
    run(cache)
    assert len(graphs.entries) == 1 and graphs.captures == 1
    del cache
    gc.collect()
    assert not graphs.entries and not graphs._watched
    run(StaticCache(config=model.config, max_cache_len=32))
    assert graphs.captures == 2


def _decode(model, step, ids, cache, n, between=None, mask=None, positions=False):
    """Prefill ``ids`` into ``cache``, then ``n`` greedy steps through ``step`` (``between(i)``
    before step i; ``mask``: a 2-D mask grown by a column each step; ``positions``: the positions
    passed too, those the mask gives as ``generate`` does, else the prompt's length on); returns
    the step logits."""
    logits = []
    with torch.no_grad():
        nxt = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for i in range(n):
            if between is not None:
                between(i)
            kw = {}
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                kw["attention_mask"] = mask
            if positions:
                kw["position_ids"] = (mask.sum(-1, keepdim=True) - 1 if mask is not None
                                      else torch.tensor([[ids.shape[1] + i]], device=ids.device))
            out = step(nxt, past_key_values=cache, use_cache=True, **kw).logits
            logits.append(out)
            nxt = out[:, -1:].argmax(-1)
    return logits


def test_a_cache_whose_tensors_are_replaced_is_captured_again(emulated):
    """Beam search's reorder_cache puts new key/value tensors in the layers: a graph over the old
    ones must not be replayed (the key holds the storage addresses)."""
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (2, 4), generator=torch.Generator().manual_seed(2))
    swap = torch.tensor([1, 0])

    def between(i):
        if i == 4:
            cache.reorder_cache(swap)

    cache = StaticCache(config=model.config, max_cache_len=32)
    want = _decode(model, model, ids, cache, 8, between)
    graphs = emulated(model)
    cache = StaticCache(config=model.config, max_cache_len=32)
    got = _decode(model, model.get_compiled_call(None), ids, cache, 8, between)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert graphs.captures == 2


@pytest.mark.parametrize("positions", [False, True], ids=["mask", "mask-and-positions"])
def test_a_growing_2d_mask_is_made_outside_and_replays(positions, emulated):
    """A 2-D mask (one more column a step) never enters the graph: the session makes the 4-D masks
    from it, with the positions given or its own; one capture, then replays."""
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (2, 5), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    want = _decode(model, model, ids, StaticCache(config=model.config, max_cache_len=32), 8, mask=mask,
                   positions=positions)
    graphs = emulated(model)
    got = _decode(model, model.get_compiled_call(None), ids, StaticCache(config=model.config, max_cache_len=32), 8,
                  mask=mask, positions=positions)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert graphs.captures == 1 and graphs.replays == 6


def test_a_returned_cache_is_the_callers(emulated):
    model = tiny_model("llama")
    graphs = emulated(model)
    ids = torch.randint(1, 256, (1, 5))
    first = _generate(model, ids, new=4, compile_config=_cpu_compile_config())
    kept = [t.clone() for t in _cache_tensors(first.past_key_values)]
    second = _generate(model, ids, new=4, compile_config=_cpu_compile_config())
    _generate(model, ids, new=4, logits=False, compile_config=_cpu_compile_config())
    assert second.past_key_values is not first.past_key_values and len(graphs.caches) == 1
    assert all(torch.equal(t, k) for t, k in zip(_cache_tensors(first.past_key_values), kept))


def test_pooled_caches_follow_inference_mode_and_dtype(emulated):
    model = tiny_model("llama")
    graphs = emulated(model)
    ids = torch.randint(1, 256, (1, 5))
    with torch.inference_mode():
        a = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0, compile_config=_cpu_compile_config())
    b = _generate(model, ids, new=5, logits=False, compile_config=_cpu_compile_config())  # no_grad: no inference tensors
    model.double()
    c = _generate(model, ids, new=5, logits=False, compile_config=_cpu_compile_config())
    assert torch.equal(a, b) and len(graphs.caches) == 3
    assert {k[2] for k in graphs.caches} == {torch.float32, torch.float64}
    assert c.shape == (1, 10)


def test_chunked_prefill_is_pooled_and_not_a_fallback(emulated, monkeypatch):
    monkeypatch.setenv("CUTILE_KERNELS_STRICT", "1")  # a fallback would raise
    model = tiny_model("llama")
    graphs = emulated(model)
    ids = torch.randint(1, 256, (1, 7), generator=torch.Generator().manual_seed(8))
    want = _generate(model, ids, new=6, logits=False, cache_implementation="static", disable_compile=True)
    captures = []
    for _ in range(3):  # chunks of 3, 3 and 1 tokens (the last a one-token step: warmed up, then captured)
        got = _generate(model, ids, new=6, logits=False, prefill_chunk_size=3, compile_config=_cpu_compile_config())
        assert torch.equal(got, want)
        captures.append(graphs.captures)
    assert len(graphs.caches) == 1 and captures[0] >= 1 and captures[2] == captures[1]


def test_prompt_longer_than_the_cache_raises_before_writing(emulated):
    model = tiny_model("llama")
    emulated(model)
    cache = StaticCache(config=model.config, max_cache_len=8)
    with torch.no_grad(), pytest.raises(ValueError, match="do not fit the static KV cache"):
        model(torch.randint(1, 256, (1, 9)), past_key_values=cache, use_cache=True)
    with torch.no_grad():
        model(torch.randint(1, 256, (1, 8)), past_key_values=cache, use_cache=True)  # exactly fits


def test_a_full_cache_raises_instead_of_writing_past_it(emulated):
    model = tiny_model("llama")
    graphs = emulated(model)
    cache = StaticCache(config=model.config, max_cache_len=9)
    step = model.get_compiled_call(None)
    with torch.no_grad():
        out = model(torch.randint(1, 256, (1, 6)), past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(3):  # positions 6, 7, 8: the last slots
            nxt = step(nxt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        with pytest.raises(dg.CacheFullError, match="static KV cache is full"):
            step(nxt, past_key_values=cache, use_cache=True)
    assert graphs.captures == 1


def _direct_steps(model, step, ids, steps=10, max_cache_len=32, positions=False):
    """Greedy steps called as the bench calls them (no mask; with ``positions`` the positions
    passed) after a prompt, over a new static cache: their logits."""
    return _decode(model, step, ids, StaticCache(config=model.config, max_cache_len=max_cache_len), steps,
                   positions=positions)


def _count_host_masks(monkeypatch) -> list:
    calls = []
    real = dg._Session._masks
    monkeypatch.setattr(dg._Session, "_masks", lambda self, *a: (calls.append(1), real(self, *a))[1])
    return calls


@pytest.mark.parametrize("model_type,attn,device_steps", [
    ("gemma3_text", "sdpa", 10),   # full layers give the position: every step's masks on the device
    ("mistral", "sdpa", 1),        # every layer slides: the device masks end when the window fills
    ("gemma3_text", "eager", 0)])  # additive masks: made on the host
def test_direct_steps_without_a_mask_match_eager_across_a_window(model_type, attn, device_steps, emulated,
                                                                 monkeypatch):
    """The bench calls the step with no mask: a mask built inside the graph would freeze the
    sliding layers' offset at capture, so the session makes the positions and masks outside it,
    from a layer's length on the device where it can (one host-built check per cache), else on
    the host; the same logits as eager across windows of 4 and the cache writes of the sliding
    layers through kv_append until their window fills."""
    model = tiny_model(model_type, sliding_window=4, attn=attn)
    ids = torch.randint(1, 256, (2, 3), generator=torch.Generator().manual_seed(9))
    want = _direct_steps(model, model, ids)
    graphs = emulated(model)
    host = _count_host_masks(monkeypatch)
    writes = []
    real = dg.kv_append
    monkeypatch.setattr(dg, "kv_append", lambda *a: (writes.append(a[0].shape[2]), real(*a))[1])
    session = model.get_compiled_call(None)
    got = _direct_steps(model, session, ids)
    assert graphs.replays > 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert len(host) == 10 - device_steps + (device_steps > 0)  # + the first step's check
    layout = next(iter(session.device_masks.values()), None)
    if device_steps:
        assert layout == ({"sliding_attention": 4, "full_attention": 32} if model_type == "gemma3_text" else 4)
        assert 4 in writes  # a sliding layer's slots (4) written by the kernel, before its window filled
    else:
        assert layout is None


@pytest.mark.parametrize("model_type", ["gemma3_text", "mistral"])
def test_direct_steps_with_positions_but_no_mask_get_host_masks(model_type, emulated, monkeypatch):
    """Positions passed without a mask: the masks are made on the host every step (inside the
    graph a sliding layer's offsets would freeze at capture), and the logits are eager's."""
    model = tiny_model(model_type, sliding_window=4)
    ids = torch.randint(1, 256, (2, 3), generator=torch.Generator().manual_seed(9))
    want = _direct_steps(model, model, ids, positions=True)
    graphs = emulated(model)
    host = _count_host_masks(monkeypatch)
    session = model.get_compiled_call(None)
    got = _direct_steps(model, session, ids, positions=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert len(host) == 10 and not session.device_masks and graphs.replays > 0


def test_chunked_attention_keeps_host_masks():
    """Llama 4's chunked layers sit in sliding-window cache layers but are masked by chunk, which a
    window's mask is not (it agrees until the first chunk boundary): their masks stay the host's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama4_text", hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                                  num_hidden_layers=4, attention_chunk_size=4, num_local_experts=2,
                                  num_experts_per_tok=1)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ids = torch.randint(1, 256, (2, 2), generator=torch.Generator().manual_seed(9))
    want = _direct_steps(model, model, ids)
    graphs = dg.enable_decode_graphs(model, graph_factory=ReplayEmulation)
    session = model.get_compiled_call(None)
    got = _direct_steps(model, session, ids)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert not session.device_masks and graphs.replays > 0


def _attention_calls(monkeypatch) -> list:
    """The one-query calls of the attention op (its reference on the CPU): (mask passed, length passed)."""
    attn_ops = importlib.import_module("cutile_kernels.ops.attention")  # the package exports the function too
    calls, real = [], attn_ops.attention_reference

    def spy(q, k, v, mask=None, scale=None, causal=True, window=None, softcap=None, kv_len=None):
        if q.shape[2] == 1:
            calls.append((mask is not None, kv_len is not None))
        return real(q, k, v, mask, scale, causal, window, softcap, kv_len)

    monkeypatch.setattr(attn_ops, "attention_reference", spy)
    return calls


@pytest.mark.parametrize("model_type", ["mistral", "gemma3_text"])
def test_plain_steps_attend_by_length_without_the_mask(model_type, emulated, monkeypatch):
    """Steps of an unpadded batch (the bench's: no mask, made on the device): our attention forwards
    pass the layers' filled lengths and no mask while each layer has one (a sliding layer until its
    window of 12 fills); the logits are eager's."""
    from transformers import StaticCache

    model = tiny_model(model_type, sliding_window=12, attn="cutile_kernel")
    cutile_kernels.patch(model)
    ids = torch.randint(1, 256, (2, 3), generator=torch.Generator().manual_seed(9))
    want = _direct_steps(model, model, ids)
    graphs = emulated(model)
    calls = _attention_calls(monkeypatch)
    session = model.get_compiled_call(None)
    steps = []  # the attention calls of each step (a capture runs the step twice)
    got = _decode(model, session, ids, StaticCache(config=model.config, max_cache_len=32), 10,
                  between=lambda i: (steps.append(list(calls)), calls.clear()))
    steps = steps[1:] + [calls]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert graphs.replays > 0 and session.device_masks
    # Until the windows fill (the steps to 12 tokens), every layer by length, no mask; then the
    # sliding layers keep their (all-visible) masks and the full ones go on by length.
    sliding = [layer.is_sliding for layer in StaticCache(config=model.config, max_cache_len=32).layers]
    assert all(set(step) == {(False, True)} for step in steps[:9])
    assert steps[9] == [(True, False) if s else (False, True) for s in sliding] and any(sliding)


def test_steps_without_a_mask_over_full_layers_attend_by_length(emulated, monkeypatch):
    """Steps called without a mask over a cache of full layers (the bench's Llama steps): the step
    makes transformers' masks itself, from cache_position, an unpadded batch's; our attention reads
    the layers' filled lengths and no mask (before, each call got the mask and the length); the
    logits are eager's."""
    model = tiny_model("llama", attn="cutile_kernel")
    cutile_kernels.patch(model)
    ids = torch.randint(1, 256, (2, 3), generator=torch.Generator().manual_seed(9))
    want = _direct_steps(model, model, ids, steps=6)
    graphs = emulated(model)
    calls = _attention_calls(monkeypatch)
    got = _direct_steps(model, model.get_compiled_call(None), ids, steps=6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert graphs.replays > 0 and calls and set(calls) == {(False, True)}


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_generate_drops_the_masks_of_an_unpadded_batch(padded, emulated, monkeypatch):
    """generate() passes its 4-D masks to every step: the session compares the first step's with an
    unpadded batch's (one device read) and, where they agree, our attention reads the layers'
    lengths without them; a left-padded batch keeps its masks. Tokens and logits are stock's."""
    model = tiny_model("llama", attn="cutile_kernel")
    cutile_kernels.patch(model)
    ids = torch.randint(1, 256, (2, 5), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :2], mask[1, :2] = 0, 0
    want = _generate(model, ids, attention_mask=mask, cache_implementation="static", disable_compile=True)
    emulated(model)
    calls = _attention_calls(monkeypatch)
    got = _generate(model, ids, attention_mask=mask, compile_config=_cpu_compile_config())
    _same(got, want)
    assert set(calls) == ({(True, True)} if padded else {(False, True)})


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_plain_steps_that_sdpa_takes_keep_their_masks(model_type, emulated, monkeypatch):
    """``"cutile"`` routes a float32 call to sdpa (no kernel variant), which takes no filled length:
    in a plain step it must still get the mask, or it attends to the static cache's empty slots."""
    from cutile_kernels.layers import attention as lattn

    monkeypatch.setattr(lattn, "_KERNEL_DEVICES", ("cuda", "cpu"))  # only the dtype decides the route
    model = tiny_model(model_type, attn="cutile", **({"sliding_window": 12} if model_type == "mistral" else {}))
    cutile_kernels.patch(model)
    ids = torch.randint(1, 256, (2, 5), generator=torch.Generator().manual_seed(3))
    want = _generate(model, ids, attention_mask=torch.ones_like(ids), cache_implementation="static",
                     disable_compile=True)
    graphs = emulated(model)
    got = _generate(model, ids, attention_mask=torch.ones_like(ids), compile_config=_cpu_compile_config())
    _same(got, want)
    assert graphs.replays > 0


def test_same_masks_compares_values_dicts_and_broadcast_batches():
    one = torch.tensor([True, True, False]).view(1, 1, 1, 3)
    assert dg._same_masks(one, one.expand(2, 1, 1, 3).clone())
    assert not dg._same_masks(one, torch.tensor([True, False, False]).view(1, 1, 1, 3))
    assert dg._same_masks({"full_attention": one, "sliding_attention": None},
                          {"full_attention": one.clone(), "sliding_attention": None})
    assert not dg._same_masks({"full_attention": one}, one)
    assert not dg._same_masks(one, one.float())  # an additive mask is not compared
    assert not dg._same_masks(one, torch.ones(1, 1, 1, 4, dtype=torch.bool))


def test_window_layout_takes_only_full_and_sliding_layer_types():
    length = torch.tensor(2)
    mask = dg._window_mask(4, length)
    assert dg._window_layout({"sliding_attention": mask, "full_attention": None}, length) == \
        {"sliding_attention": 4, "full_attention": None}
    assert "chunked_attention" in dg._window_layout({"chunked_attention": mask}, length)
    assert "other than the window" in dg._window_layout(dg._window_mask(4, torch.tensor(1)), length)
    assert "dtype" in dg._window_layout(torch.zeros(1, 1, 1, 4), length)


def test_masks_other_than_the_windows_stay_on_the_host(emulated, monkeypatch, caplog):
    """A model whose masks are not the window's (here: a wrong rebuild) keeps the host masks, said once."""
    model = tiny_model("gemma3_text", sliding_window=4)
    ids = torch.randint(1, 256, (2, 3), generator=torch.Generator().manual_seed(9))
    want = _direct_steps(model, model, ids)
    emulated(model)
    monkeypatch.setattr(dg, "_window_mask", lambda width, length: torch.ones(1, 1, 1, width, dtype=torch.bool))
    host = _count_host_masks(monkeypatch)
    session = model.get_compiled_call(None)
    with caplog.at_level(logging.INFO, logger="cutile_kernels"):
        got = _direct_steps(model, session, ids)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert len(host) == 11 and isinstance(next(iter(session.device_masks.values())), str)
    assert sum("masks on the host" in r.getMessage() for r in caplog.records) == 1


def test_window_mask_is_transformers_sliding_mask():
    """The rebuilt mask against sdpa_mask's for a one-token step, before, at and after the window fills."""
    from transformers.cache_utils import StaticSlidingWindowLayer

    model = tiny_model("mistral", sliding_window=4)
    for before in range(0, 9):
        cache = StaticCache(config=model.config, max_cache_len=32)
        assert isinstance(cache.layers[0], StaticSlidingWindowLayer)
        with torch.no_grad():
            model(torch.randint(1, 256, (1, before + 1)), past_key_values=cache, use_cache=True)
        theirs = dg._Session(dg.DecodeGraphs(model))._masks(torch.ones(1, 1, dtype=torch.long), None, cache,
                                                              torch.tensor([[before + 1]]))
        n = before + 1  # tokens before the step
        mine = dg._window_mask(4, torch.tensor(n))
        assert torch.equal(mine.expand_as(theirs), theirs), n


def test_outputs_are_not_overwritten_by_the_next_replay(emulated):
    model = tiny_model("llama")
    emulated(model)
    cache = StaticCache(config=model.config, max_cache_len=32)
    step = model.get_compiled_call(None)
    with torch.no_grad():
        nxt = model(torch.randint(1, 256, (1, 4)), past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        outs = [step(nxt, past_key_values=cache, use_cache=True).logits for _ in range(4)]
    kept = [o.clone() for o in outs]
    assert all(torch.equal(o, k) for o, k in zip(outs, kept)) and not torch.equal(outs[2], outs[3])


def test_what_cannot_be_captured_runs_eagerly_and_says_so(emulated, caplog, monkeypatch):
    from transformers import DynamicCache

    model = tiny_model("llama")
    emulated(model)
    step = model.get_compiled_call(None)
    cache = DynamicCache(config=model.config)
    cutile_kernels.reset_stats()
    with torch.no_grad():
        out = model(torch.randint(1, 256, (1, 4)), past_key_values=cache, use_cache=True)
        step(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    assert any(k.startswith("decode_graphs: ") and "DynamicCache" in k for k in cutile_kernels.stats()["fallbacks"])
    monkeypatch.setenv("CUTILE_KERNELS_STRICT", "1")
    with torch.no_grad(), pytest.raises(cutile_kernels.FallbackError, match="decode_graphs"):
        step(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)


def test_a_model_split_over_devices_decodes_eagerly_and_says_so(emulated, monkeypatch):
    """A CUDA graph captures one device's work: a model whose weights are on two devices (here a
    CPU model with one weight moved to ``meta``) never captures; every step says why."""
    model = tiny_model("llama")
    model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.lm_head.weight, device="meta"))
    graphs = emulated(model)
    reasons = []
    monkeypatch.setattr(dg.dispatch, "fallback", lambda name, why: reasons.append((name, why)))
    monkeypatch.setattr(model, "forward", lambda **kw: "eager step")
    cache = StaticCache(config=model.config, max_cache_len=8)
    assert graphs.step({"input_ids": torch.ones(1, 1, dtype=torch.long), "past_key_values": cache}, None) == "eager step"
    assert reasons == [("decode_graphs", "the model's weights are on 2 devices (cpu, meta); a CUDA graph captures "
                                         "one device's work")]
    assert graphs.captures == 0 and not graphs.entries


def test_a_failing_capture_runs_eagerly_with_python_state_restored(emulated, monkeypatch, caplog):
    class Failing(ReplayEmulation):
        def capture(self, fn, owner, cache=None):
            tensors = _cache_tensors(_cache_of(fn))
            saved = [t.clone() for t in tensors]
            fn()  # the Python side effects happen, then the capture fails (e.g. a host sync) ...
            for t, s in zip(tensors, saved):  # ... and nothing ran on the device
                t.copy_(s)
            raise RuntimeError("operation not permitted when stream is capturing")

    model = tiny_model("mistral", sliding_window=4)
    ids = torch.randint(1, 256, (1, 3))
    want = _generate(model, ids, new=8, cache_implementation="static", disable_compile=True)
    graphs = dg.enable_decode_graphs(model, graph_factory=Failing)
    with caplog.at_level(logging.WARNING):
        got = _generate(model, ids, new=8, compile_config=_cpu_compile_config())
    _same(got, want)
    assert graphs.captures == 0 and "cannot be captured" in caplog.text


def test_capturable_sliding_update_is_transformers_update():
    """The full-window step without the host-to-device copy: the same cache and return values."""
    from transformers.cache_utils import StaticSlidingWindowLayer

    gen = torch.Generator().manual_seed(4)
    ours, theirs = StaticSlidingWindowLayer(16, 4), StaticSlidingWindowLayer(16, 4)
    for step in range(9):  # fills the window of 4 at step 4, then slides
        k, v = torch.randn(2, 3, 1, 8, generator=gen), torch.randn(2, 3, 1, 8, generator=gen)
        got = dg._capturable_sliding_update(ours, k, v)
        want = theirs.update(k.clone(), v.clone())
        assert ours.cumulative_length_int == theirs.cumulative_length_int == step + 1
        assert all(torch.equal(g, w) for g, w in zip(got, want)), step
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_kernel_sliding_update_is_transformers_update():
    """kv_append while the window has room, then transformers' steps: the same cache, both lengths
    and return values as StaticSlidingWindowLayer.update over a prefill, steps that fill the window
    and slide it, and a chunk into a full window."""
    from transformers.cache_utils import StaticSlidingWindowLayer

    gen = torch.Generator().manual_seed(6)
    ours, theirs = StaticSlidingWindowLayer(16, 6), StaticSlidingWindowLayer(16, 6)
    total = 0
    for new in (2, 1, 3, 1, 1, 2):  # the window of 6 filled by the third update's last slot
        k, v = torch.randn(2, 3, new, 8, generator=gen), torch.randn(2, 3, new, 8, generator=gen)
        got = dg._kernel_sliding_update(ours, k, v)
        want = theirs.update(k.clone(), v.clone())
        total += new
        assert ours.cumulative_length_int == theirs.cumulative_length_int == total
        assert int(ours.cumulative_length) == int(theirs.cumulative_length)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), new
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_kernel_static_update_is_transformers_update():
    """One kv_append launch and the length's add: the same cache, length and return values as
    StaticLayer.update, over a prefill, single steps and a chunk."""
    from transformers.cache_utils import StaticLayer

    gen = torch.Generator().manual_seed(5)
    ours, theirs = StaticLayer(16), StaticLayer(16)
    total = 0
    for new in (5, 1, 1, 3, 1, 5):  # fills the 16 slots exactly
        k, v = torch.randn(2, 3, new, 8, generator=gen), torch.randn(2, 3, new, 8, generator=gen)
        got = dg._kernel_static_update(ours, k.transpose(2, 3).contiguous().transpose(2, 3), v)  # a strided k
        want = theirs.update(k.clone(), v.clone())
        total += new
        assert int(ours.cumulative_length) == int(theirs.cumulative_length) == total
        assert got[0] is ours.keys and all(torch.equal(g, w) for g, w in zip(got, want)), new
    assert torch.equal(ours.keys[:, :, 15], k[:, :, -1])


def test_full_layers_write_through_kv_append_and_can_opt_out(emulated, monkeypatch):
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (2, 5), generator=torch.Generator().manual_seed(6))
    want = _generate(model, ids, logits=False, cache_implementation="static", disable_compile=True)
    writes = []
    real = dg.kv_append
    monkeypatch.setattr(dg, "kv_append", lambda *a: (writes.append(tuple(a[2].shape)), real(*a))[1])
    graphs = emulated(model)
    assert torch.equal(_generate(model, ids, logits=False, compile_config=_cpu_compile_config()), want)
    (cache,) = graphs.caches.values()
    assert all(vars(layer)["update"].func is dg._kernel_static_update for layer in cache.layers)
    assert writes and set(writes) == {(2, model.config.num_key_value_heads, 1, model.config.head_dim)}
    writes.clear()
    graphs = emulated(model, cache_kernel=False)
    assert torch.equal(_generate(model, ids, logits=False, compile_config=_cpu_compile_config()), want)
    (cache,) = graphs.caches.values()
    assert not writes and all("update" not in vars(layer) for layer in cache.layers)


def test_cache_writes_are_restored_on_disable_and_left_alone_for_two_head_dims(emulated):
    """A cache the caller passed keeps our update only while decode graphs are on; a layer whose
    keys and values differ in shape (MLA: two head dims) keeps transformers' update."""
    from transformers.cache_utils import StaticLayer

    model = tiny_model("llama")
    emulated(model)
    ids = torch.randint(1, 256, (1, 5))
    cache = StaticCache(config=model.config, max_cache_len=32)
    _generate(model, ids, new=4, logits=False, past_key_values=cache, compile_config=_cpu_compile_config())
    assert all(vars(layer)["update"].func is dg._kernel_static_update for layer in cache.layers)
    dg.disable_decode_graphs(model)
    assert all("update" not in vars(layer) for layer in cache.layers) and not cache._cutile_capturable
    mla = StaticCache(config=model.config, max_cache_len=8)
    for layer in mla.layers:
        layer.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 8))  # value head dim 8, key 16
    assert dg._make_capturable(mla)
    assert all(type(layer) is StaticLayer and "update" not in vars(layer) for layer in mla.layers)


def _grouped_llama_cache(emulated, new=4, prompt=5):
    """A tiny Llama with decode graphs on, after a greedy generate over a static cache it passed:
    (model, graphs, cache, the eager tokens)."""
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (1, prompt), generator=torch.Generator().manual_seed(8))
    want = _generate(model, ids, new=new, logits=False, cache_implementation="static", disable_compile=True)
    graphs = emulated(model)
    cache = StaticCache(config=model.config, max_cache_len=32)
    got = _generate(model, ids, new=new, logits=False, past_key_values=cache, compile_config=_cpu_compile_config())
    assert torch.equal(got, want)
    return model, graphs, cache, got


def test_full_layers_lengths_are_one_buffer_advanced_once_a_step(emulated, monkeypatch):
    """The full layers' lengths are views of one buffer (each still its own tensor to transformers);
    in a step of ours every layer writes at the length the step began with, the lengths advance
    together after the forward, and the layers keep no step attribute."""
    model, graphs, cache, tokens = _grouped_llama_cache(emulated)
    buffer, layers, views = vars(cache)[dg.LENGTHS]
    assert layers == tuple(cache.layers) and graphs.replays >= 1
    assert all(layer.cumulative_length is v and v._base is buffer for layer, v in zip(cache.layers, views))
    written = tokens.shape[1] - 1  # the prompt and every decoded token but the last
    assert buffer.tolist() == [written] * len(cache.layers)
    # One more step by hand: what each write sees of the first layer's length and its own slot.
    seen = []
    real = dg.kv_append
    monkeypatch.setattr(dg, "kv_append", lambda *a: (seen.append((int(a[4]), int(cache.layers[0].cumulative_length))),
                                                      real(*a))[1])
    step = {"input_ids": tokens[:, -1:], "past_key_values": cache, "use_cache": True}
    with torch.no_grad():
        graphs.forward(step)
    assert seen == [(written, written)] * len(cache.layers)
    assert buffer.tolist() == [written + 1] * len(cache.layers)
    assert not any(dg.STEP_FILLED in vars(layer) for layer in cache.layers)
    last = cache.layers[-1].keys  # the step's keys went to its slot, nothing past it
    assert last[:, :, written].abs().sum() > 0 and last[:, :, written + 1:].abs().sum() == 0


def test_the_kernel_attention_reads_the_steps_filled_length(emulated):
    """With ``attn_implementation="cutile_kernel"`` every call runs the attention op, whose CPU
    reference reads only the first ``kv_len`` keys, and the stacked (fused_qkv) Llama forward passes
    the static layer's filled length: a step's filled length off by one would change the logits."""
    model = tiny_model("llama", attn="cutile_kernel")
    assert cutile_kernels.patch(model, names=["fused_qkv"]).changed["fused_qkv"] == len(model.model.layers)
    ids = torch.randint(1, 256, (2, 5), generator=torch.Generator().manual_seed(9))
    want = _generate(model, ids, cache_implementation="static", disable_compile=True)
    graphs = emulated(model)
    got = _generate(model, ids, compile_config=_cpu_compile_config())
    _same(got, want)
    assert graphs.replays >= 6


def test_a_cache_armed_again_keeps_its_length_buffer(emulated):
    """Disarmed (_restore_updates) and armed again, a cache keeps the buffer its lengths view: a
    graph captured over it (another DecodeGraphs over the same cache) reads what it captured."""
    model, graphs, cache, tokens = _grouped_llama_cache(emulated)
    buffer = vars(cache)[dg.LENGTHS][0]
    dg._restore_updates(cache)
    assert dg.LENGTHS not in vars(cache)
    assert dg._make_capturable(cache)
    assert vars(cache)[dg.LENGTHS][0] is buffer
    assert all(layer.cumulative_length._base is buffer for layer in cache.layers)


def test_a_layer_changed_since_the_grouping_is_advanced_by_its_own_update(emulated):
    """A grouped layer given another ``update``, or another length tensor, turns the one advance off
    for the step (each layer advances itself: none twice, none skipped); disabling drops the group."""
    model, graphs, cache, tokens = _grouped_llama_cache(emulated)
    buffer = vars(cache)[dg.LENGTHS][0]
    written = int(buffer[0])
    theirs = cache.layers[1].update
    cache.layers[1].update = lambda *a, **k: theirs(*a, **k)  # e.g. another tool's wrapper
    assert dg._grouped(cache) is None
    step = {"input_ids": tokens[:, -1:], "past_key_values": cache, "use_cache": True}
    with torch.no_grad():
        graphs.forward(step)
    assert [int(layer.cumulative_length) for layer in cache.layers] == [written + 1] * len(cache.layers)
    cache.layers[1].update = theirs
    assert dg._grouped(cache) is not None
    cache.layers[2].cumulative_length = cache.layers[2].cumulative_length.clone()
    assert dg._grouped(cache) is None
    dg.disable_decode_graphs(model)
    assert dg.LENGTHS not in vars(cache)


def test_layers_of_different_lengths_are_not_grouped():
    model = tiny_model("llama")
    cache = StaticCache(config=model.config, max_cache_len=16)
    for i, layer in enumerate(cache.layers):
        layer.update(torch.zeros(1, 2, 3 + (i == 1), 16), torch.zeros(1, 2, 3 + (i == 1), 16))
    assert dg._make_capturable(cache)
    assert dg.LENGTHS not in vars(cache) and all(vars(layer)["update"].func is dg._kernel_static_update
                                                 for layer in cache.layers)


def test_attention_reads_the_steps_filled_length(monkeypatch):
    """In a step that advances the lengths at its end, our attention's ``cutile_kv_len`` is the
    step's filled length, not the layer's length (still the step's start)."""
    from transformers.cache_utils import StaticLayer

    from cutile_kernels.layers import attention

    monkeypatch.setattr(attention, "_STATIC_LAYER", StaticLayer)
    module = torch.nn.Module()
    module.layer_idx, module.config = 0, type("C", (), {"_attn_implementation": "cutile"})()
    layer = StaticLayer(8)
    layer.update(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4))
    cache = type("Cache", (), {"layers": [layer]})()
    found = attention.cache_layer(module, cache)
    assert found is layer and attention.static_kv_length(found, "cutile")["cutile_kv_len"] is layer.cumulative_length
    assert attention.static_kv_length(found, "sdpa") == {}
    filled = layer.cumulative_length + 1
    layer.__dict__[attention.STEP_FILLED] = filled
    assert attention.static_kv_length(found, "cutile")["cutile_kv_len"] is filled


def test_sliding_layers_keep_their_update_when_the_pin_fails(monkeypatch, caplog):
    model = tiny_model("mistral", sliding_window=4)
    cache = StaticCache(config=model.config, max_cache_len=16)
    monkeypatch.setattr(dg, "holds", lambda name: False)
    with caplog.at_level(logging.WARNING):
        dg._make_capturable(cache)
    assert "not the pinned one" in caplog.text and all("update" not in vars(layer) for layer in cache.layers)
    monkeypatch.setattr(dg, "holds", lambda name: True)
    other = StaticCache(config=model.config, max_cache_len=16)
    dg._make_capturable(other)
    assert all(isinstance(vars(layer)["update"], functools.partial) for layer in other.layers)


def test_generate_defaults_to_a_static_cache_and_disable_restores_stock(emulated):
    model = tiny_model("llama")
    cls_call, cls_generate = type(model).get_compiled_call, type(model).generate
    graphs = emulated(model)
    model.generation_config.cache_implementation = None  # what from_pretrained may load after our config ran
    ids = torch.randint(1, 256, (1, 4))
    out = _generate(model, ids, new=5, compile_config=_cpu_compile_config())
    assert type(out.past_key_values).__name__ == "StaticCache" and graphs.captures == 1
    beams = _generate(model, ids, new=3, num_beams=2)  # beam search and assisted decoding keep their default
    assert type(beams.past_key_values).__name__ == "DynamicCache"
    looked = _generate(model, torch.randint(1, 256, (1, 8)), new=3, logits=False, prompt_lookup_num_tokens=2)
    assert looked.shape == (1, 11)
    assert _generate(model, ids, new=2, use_cache=False).past_key_values is None  # no cache asked: none
    dyn = _generate(model, ids, new=5, cache_implementation="dynamic", compile_config=_cpu_compile_config())
    assert type(dyn.past_key_values).__name__ == "DynamicCache" and graphs.captures == 1  # asked for: kept
    assert isinstance(model.get_compiled_call(None), dg._Session)
    assert dg.disable_decode_graphs(model) and not dg.disable_decode_graphs(model)
    assert model.get_compiled_call.__func__ is cls_call and model.generate.__func__ is cls_generate
    assert not model._forward_pre_hooks
    assert type(_generate(model, ids, new=2).past_key_values).__name__ == "DynamicCache"


def test_a_checkpoints_hybrid_cache_default_gets_the_fast_path(emulated):
    """Gemma 2 and 3 checkpoints ship generation_config.cache_implementation="hybrid", which
    transformers treats as unset: the fast path's static cache serves them too."""
    model = tiny_model("gemma3_text")
    ids = torch.randint(1, 256, (1, 5), generator=torch.Generator().manual_seed(8))
    want = _generate(model, ids, new=6, logits=False, cache_implementation="static", disable_compile=True)
    graphs = emulated(model)
    model.generation_config.cache_implementation = "hybrid"
    got = _generate(model, ids, new=6, logits=False, compile_config=_cpu_compile_config())
    assert torch.equal(got, want) and graphs.captures >= 1 and graphs.replays >= 1


def test_enable_on_a_cpu_model_without_an_emulation_does_nothing(caplog):
    model = tiny_model("llama")
    with caplog.at_level(logging.WARNING, logger="cutile_kernels"):
        assert dg.enable_decode_graphs(model) is None
    assert dg.ATTR not in model.__dict__ and "need a CUDA model" in caplog.text  # said at WARNING: asked by name


def test_kernel_config_carries_the_switch(built_package_dir):
    on = cutile_kernels.kernel_config(decode_graphs=True)
    assert on.decode_graphs and "fused_qkv" in on.include_patches  # the fast path stacks q/k/v
    assert set(on.include_patches) == {"fused_qkv"}  # Gemma's three, which it applied too, are defaults now
    assert "fused_qkv" not in cutile_kernels.kernel_config(decode_graphs=True, exclude=["fused_qkv"]).include_patches
    assert not cutile_kernels.kernel_config().decode_graphs
    assert "fused_qkv" not in cutile_kernels.kernel_config().include_patches
    with pytest.raises(TypeError, match="True or False"):
        cutile_kernels.kernel_config(decode_graphs="no")


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for model_type, fields in (("llama", {}), ("qwen3", {}), ("mistral", {"sliding_window": 24}),
                               ("gemma3_text", {"sliding_window": 24}), ("qwen3_5_text", {}),
                               ("gemma2", {"sliding_window": 24, "attn_logit_softcapping": 0.5}),
                               ("olmo2", {"head_dim": 128}),  # qk_norm_rope_olmo2's tiles: head_dim 128
                               # Phi-4-mini's layout: partial rotary, every layer sliding with room (rope_append_pass)
                               ("phi3", {"sliding_window": 256})):
        path = tmp_path_factory.mktemp(model_type)
        tiny_model(model_type, dtype=torch.bfloat16, layers=4, **fields).save_pretrained(path)
        out[model_type] = path
    return out


def _load(path, attn, graphs: bool, include=(), exclude=("gemv",)):
    """The checkpoint kernelized, with decode graphs or not; the eager one gets the patches that
    ``decode_graphs=True`` adds, so that both compute the same (some are not bit for bit stock).
    Patch ``gemv`` is left out by default: it runs only in captured steps (an eager step keeps
    ``F.linear``), so with it the two would differ in rounding (its own test below). ``attn="sdpa"``
    keeps sdpa (without the default patch ``cutile_attention``)."""
    from transformers import AutoModelForCausalLM

    if attn == "sdpa":
        exclude = (*exclude, "cutile_attention")
    if not graphs:
        include = [*include, *DECODE_GRAPH_PATCHES]
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, device_map="cuda", attn_implementation=attn, use_kernels=True,
        kernel_config=cutile_kernels.kernel_config(decode_graphs=graphs, include=include, exclude=exclude)).eval()


@pytest.mark.gpu
@pytest.mark.parametrize("model_type,attn", [
    *((t, a) for t in ("llama", "qwen3", "mistral", "gemma3_text", "qwen3_5_text", "phi3")
      for a in ("sdpa", "cutile")),
    ("olmo2", "cutile"),
    ("gemma2", None)])  # no sdpa: the default eager, which patch gemma2_attention turns into ours
def test_gpu_generate_replays_cuda_graphs_and_matches_eager(model_type, attn, checkpoints, strict):
    """Real CUDA graphs of our kernels: the same tokens as the eager kernelized model with a static
    cache, over prompts of 1, 37 and 70 tokens and 40 new ones (windows of 24 crossed; cache
    lengths crossing attention tile boundaries), batch 1 and a left-padded batch of 3; with the
    patches ``decode_graphs=True`` adds (Gemma 3's and GeGLU's among them), and OLMo 2 with its
    fused q/k norms + RoPE and post-norm adds (stacked q/k/v in both), in eager and in the graphs
    alike; Gemma 2 with its softcaps;
    Phi-3 with partial rotary over sliding layers that have room (one rope_append_pass launch a
    layer and step)."""
    path = checkpoints[model_type]
    eager = _load(path, attn, graphs=False)
    model = _load(path, attn, graphs=True)
    graphs = getattr(model, dg.ATTR)
    for block in (m for m in model.modules() if "fused_recurrent_gated_delta_rule" in getattr(m, "_kernel_funcs", {})):
        # The recurrent step updates the cache's state where it lies: no copy in the replayed graph.
        names = block.forward.__func__.__globals__
        assert names["_is_ours"](block._kernel_funcs["fused_recurrent_gated_delta_rule"],
                                 names["CutileFusedRecurrentGatedDeltaRule"])
    gen = torch.Generator().manual_seed(11)
    for b, s in ((1, 1), (1, 37), (3, 70)):
        ids = torch.randint(1, 256, (b, s), generator=gen).cuda()
        mask = torch.ones_like(ids)
        if b > 1:
            mask[0, :20] = 0
            ids[0, :20] = 0
        want = _generate(eager, ids, new=40, attention_mask=mask, cache_implementation="static",
                         disable_compile=True)
        got = _generate(model, ids, new=40, attention_mask=mask)
        assert torch.equal(got.sequences, want.sequences), (b, s)
        for g, w in zip(got.logits, want.logits):
            torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
    # One graph per batch size: the two batch-1 calls share a cache bucket and its graph.
    assert graphs.captures >= 2 and graphs.replays >= 3 * 30


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2"])
def test_gpu_graphs_with_the_gemv_follow_eager_but_at_near_ties(model_type, checkpoints, strict):
    """With patch ``gemv`` (a default: batch-1 projections on our GEMV inside the captured steps,
    ``F.linear`` in eager ones) the replayed steps' logits stay within bf16 rounding of the eager
    model's, and a greedy token differs only where eager's two best logits are within that rounding
    (the GEMV sums in another order than cuBLAS); the sequences are compared up to that step."""
    path = checkpoints[model_type]
    attn = None if model_type == "gemma2" else "cutile"
    eager = _load(path, attn, graphs=False, exclude=())
    model = _load(path, attn, graphs=True, exclude=())
    def gemv_launches():
        return sum(v for key, v in cutile_kernels.stats()["launches"].items() if "gemv" in key)

    before = gemv_launches()
    gen = torch.Generator().manual_seed(5)
    for s in (1, 37):
        ids = torch.randint(1, 256, (1, s), generator=gen).cuda()
        want = _generate(eager, ids, new=40, cache_implementation="static", disable_compile=True)
        got = _generate(model, ids, new=40)
        for step, (g, w) in enumerate(zip(got.logits, want.logits)):
            torch.testing.assert_close(g, w, rtol=5e-2, atol=5e-2)
            if got.sequences[0, s + step] != want.sequences[0, s + step]:
                top2 = w[0].float().topk(2).values
                assert float(top2[0] - top2[1]) < 0.1, (s, step)
                break
    assert gemv_launches() > before  # the captures launched our GEMV


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["sdpa", "cutile"])
def test_gpu_direct_steps_make_window_masks_on_the_device(attn, checkpoints, strict):
    """Steps called without a mask (as the bench calls them) on Gemma 3, its windows of 24 crossed:
    positions and masks from the cache's length on the device, the sliding layers' writes by
    kv_append until their window fills; the same tokens as the eager kernelized model."""
    eager = _load(checkpoints["gemma3_text"], attn, graphs=False)
    model = _load(checkpoints["gemma3_text"], attn, graphs=True)
    ids = torch.randint(1, 256, (2, 20), generator=torch.Generator().manual_seed(12)).cuda()
    want = _direct_steps(eager, eager, ids, steps=30, max_cache_len=64)
    session = model.get_compiled_call(None)
    got = _direct_steps(model, session, ids, steps=30, max_cache_len=64)
    assert isinstance(next(iter(session.device_masks.values())), dict)
    assert getattr(model, dg.ATTR).replays >= 25
    for g, w in zip(got, want):
        assert torch.equal(g.argmax(-1), w.argmax(-1))
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_full_cache_and_long_prompt_raise(checkpoints):
    model = _load(checkpoints["llama"], "cutile", graphs=True)
    cache = StaticCache(config=model.config, max_cache_len=40)
    step = model.get_compiled_call(None)
    with torch.no_grad():
        with pytest.raises(ValueError, match="do not fit"):
            model(torch.randint(1, 256, (1, 41), device="cuda"), past_key_values=cache, use_cache=True)
        nxt = model(torch.randint(1, 256, (1, 36), device="cuda"), past_key_values=cache,
                    use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(4):
            nxt = step(nxt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        with pytest.raises(dg.CacheFullError):
            step(nxt, past_key_values=cache, use_cache=True)
    torch.cuda.synchronize()  # no device-side assert happened


@pytest.mark.gpu
def test_gpu_switching_back_to_eager(checkpoints):
    model = _load(checkpoints["qwen3"], "cutile", graphs=True)
    ids = torch.randint(1, 256, (2, 9), device="cuda")
    got = _generate(model, ids, new=16)
    assert cutile_kernels.disable_decode_graphs(model)
    again = _generate(model, ids, new=16, cache_implementation="static", disable_compile=True)
    assert torch.equal(got.sequences, again.sequences)


@pytest.mark.parametrize("model_type,extra", [
    ("llama", {}), ("olmo3", {}), ("gemma3_text", {}), ("mistral", {"sliding_window": 4}), ("qwen3_5_text", {}),
])
def test_one_scan_of_the_cache_names_its_layers_and_every_address(model_type, extra):
    """``_scan`` reads a filled cache's layers in one pass: the sliding-window layers exactly, the
    first full-attention layer (None where every layer slides or is linear attention), and the
    addresses a graph is keyed on layer by layer (keys and values, or a linear-attention layer's
    conv and recurrent states), which follow a state tensor replaced in place of another."""
    from transformers.cache_utils import LinearAttentionLayer, StaticLayer, StaticSlidingWindowLayer

    model = tiny_model(model_type, **extra)
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(torch.randint(1, 256, (1, 3)), past_key_values=cache, use_cache=True)
    scan = dg._scan(cache)
    assert scan.why is None
    assert scan.sliding == tuple(layer for layer in cache.layers if type(layer) is StaticSlidingWindowLayer)
    assert scan.full is next((layer for layer in cache.layers if type(layer) is StaticLayer), None)
    want = []
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionLayer):
            want += [t.data_ptr() for t in (*layer.conv_states.values(), *layer.recurrent_states.values())
                     if t is not None]
        else:
            want += [layer.keys.data_ptr(), layer.values.data_ptr()]
    assert scan.storage == tuple(want) and len(set(want)) == len(want) > 0
    linear = [layer for layer in cache.layers if isinstance(layer, LinearAttentionLayer)]
    if model_type == "qwen3_5_text":  # a hybrid: the states are in the key
        assert linear and scan.full is not None
        key = next(k for k, t in linear[0].recurrent_states.items() if t is not None)
        before = linear[0].recurrent_states[key].data_ptr()
        linear[0].recurrent_states[key] = linear[0].recurrent_states[key].clone()  # as a beam reorder does
        after = dg._scan(cache).storage
        assert before in scan.storage and before not in after
        assert linear[0].recurrent_states[key].data_ptr() in after
    if model_type == "mistral":  # every layer slides: nothing fills, no room to check
        assert scan.full is None and len(scan.sliding) == len(cache.layers)


def test_the_cache_check_and_the_graph_key_follow_the_cache_as_it_is_now():
    """The per-step cache check (``_scan``'s verdict) and the addresses a graph is keyed on are read
    afresh at every step: an empty cache and another cache class are refused, a filled one passes
    until a layer is replaced by one of another class or a hybrid cache starts recording its past
    (``activate_past_recording``), and the addresses follow a layer's new tensors (beam search's
    reorder) and a replaced layer, as the window state in the key follows a replaced sliding layer."""
    import copy

    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    model = tiny_model("llama")
    cache = StaticCache(config=model.config, max_cache_len=16)
    assert "empty" in dg._scan(cache).why and dg._scan(cache, filled=False).why is None
    assert "DynamicCache" in dg._scan(DynamicCache(config=model.config)).why
    with torch.no_grad():
        model(torch.randint(1, 256, (1, 4)), past_key_values=cache, use_cache=True)
    assert dg._scan(cache).why is None
    before = dg._scan(cache).storage
    assert before == tuple(p for layer in cache.layers for p in (layer.keys.data_ptr(), layer.values.data_ptr()))
    cache.layers[1].keys = cache.layers[1].keys.clone()
    assert dg._scan(cache).storage[2] == cache.layers[1].keys.data_ptr() != before[2]
    cache.layers[0] = copy.deepcopy(cache.layers[0])
    assert dg._scan(cache).storage[0] == cache.layers[0].keys.data_ptr() != before[0]
    cache.layers[2] = DynamicLayer()
    assert "DynamicLayer" in dg._scan(cache).why

    # A replaced sliding-window layer: the graph key's window state is the new layer's.
    windowed = tiny_model("olmo3")
    cache = StaticCache(config=windowed.config, max_cache_len=16)
    with torch.no_grad():
        windowed(torch.randint(1, 256, (1, 2)), past_key_values=cache, use_cache=True)
    graphs = dg.DecodeGraphs(windowed)
    assert graphs._key(cache, (), False)[2] == (False, False)  # two sliding layers of 4 slots, 2 filled
    cache.layers[0] = copy.deepcopy(cache.layers[0])
    cache.layers[0].cumulative_length_int = cache.layers[0].max_cache_len
    assert graphs._key(cache, (), False)[2] == (True, False)

    hybrid = tiny_model("qwen3_5_text")
    cache = StaticCache(config=hybrid.config, max_cache_len=16)
    with torch.no_grad():
        hybrid(torch.randint(1, 256, (1, 4)), past_key_values=cache, use_cache=True)
    assert dg._scan(cache).why is None
    cache.activate_past_recording()
    assert "records past" in dg._scan(cache).why
