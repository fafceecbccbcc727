"""``rope_append`` (``ops/rope.py``): a decode step's RoPE of q and k with the rotated keys and the
values written into a static KV cache, one launch. CPU: the reference is transformers' RoPE
followed by ``StaticLayer.update``; the kernel's tile logic through the NumPy interpreter (slots
across the cache, padded head-dim lanes, one KV head, a full cache); the decode graphs arm full
layers with it and the reproduced attention forward takes it only with our Llama RoPE; generate
over the emulated graphs gives eager's tokens. GPU: the kernel against float64 and bit for bit
against the two launches it replaces, on real-model head layouts, poisoned outputs, stacked q/k/v
views, fp16, in a replayed CUDA graph (the decode fast path's GPU tests, tests/test_decode_graphs.py,
run it inside kernelized Llama and Mistral checkpoints)."""

from __future__ import annotations

import types

import pytest
import torch

import cutile_kernels
from cutile_kernels.kernel_src import rope as krope
from cutile_kernels.layers import _direct
from cutile_kernels.layers import decode_graphs as dg
from cutile_kernels.layers.rope import CutileRotaryPosEmb
from cutile_kernels.ops import rope as rope_ops

from families import model as tiny_model
from launches import launched_variants

transformers = pytest.importorskip("transformers")
from transformers import StaticCache  # noqa: E402
from transformers.cache_utils import StaticLayer  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402


def _step(B, hq, hkv, S, D, dtype=torch.float32, device="cpu", seed=0, pos0=7):
    """q, k, v as views of one stacked (B, S, (hq + 2 hkv) D) projection, transposed as
    transformers passes them, and Llama's cos/sin (B, S, D) for positions pos0..pos0+S-1."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, S, (hq + 2 * hkv) * D, generator=g).to(dtype)
    q, k, v = qkv.split((hq * D, hkv * D, hkv * D), dim=-1)
    q, k, v = (t.reshape(B, S, -1, D).transpose(1, 2) for t in (q, k, v))
    pos = (pos0 + torch.arange(S)).double()[None, :, None].expand(B, S, 1)
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2).double() / D)
    ang = torch.cat([pos * inv, pos * inv], dim=-1)
    return [t.to(device) for t in (q, k, v, ang.cos().to(dtype), ang.sin().to(dtype))]


def _cache(B, hkv, L, D, dtype=torch.float32, device="cpu"):
    return (torch.full((B, hkv, L, D), float("nan"), dtype=dtype, device=device),
            torch.full((B, hkv, L, D), float("nan"), dtype=dtype, device=device))


# ---------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------

def test_reference_is_transformers_rope_then_static_layer_update():
    """Over a prefill, single steps and a chunk: the rotated q and the cache equal
    ``apply_rotary_pos_emb`` followed by ``StaticLayer.update`` (bit for bit, float32)."""
    layer = StaticLayer(16)
    keys, values = _cache(2, 2, 16, 8)
    keys.zero_(), values.zero_()
    length, at = torch.tensor(0), 0
    for new in (5, 1, 1, 3):
        q, k, v, cos, sin = _step(2, 4, 2, new, 8, seed=new, pos0=at)
        got = cutile_kernels.rope_append(q, k, v, cos, sin, keys, values, length)
        want_q, want_k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
        layer.update(want_k, v)
        length += new
        at += new
        assert torch.equal(got, want_q) and got.stride() == want_q.stride()
        assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)
    assert int(length) == 10  # not advanced by the op: the caller adds


def test_checks_name_what_does_not_match():
    q, k, v, cos, sin = _step(1, 4, 2, 1, 16)
    keys, values = _cache(1, 2, 8, 16)
    with pytest.raises(ValueError, match="cache's B, H and D"):
        cutile_kernels.rope_append(q, k, v, cos, sin, keys[:, :1], values[:, :1], torch.tensor(0))
    with pytest.raises(ValueError, match="rope: shapes do not match"):
        cutile_kernels.rope_append(q, k, v, cos.repeat(1, 2, 1), sin.repeat(1, 2, 1), keys, values, torch.tensor(0))
    with pytest.raises(ValueError, match="share a dtype"):
        cutile_kernels.rope_append(q, k, v, cos, sin, keys.double(), values.double(), torch.tensor(0))
    with pytest.raises(TypeError, match="length must be a one-element int64 tensor"):
        cutile_kernels.rope_append(q, k, v, cos, sin, keys, values, 3)


def _emulate(q, k, v, cos, sin, keys, values, at):
    from cutile_numpy import emulate

    B, hq, S, D = q.shape
    block = max(rope_ops.MIN_BLOCK, 1 << (D // 2 - 1).bit_length())
    q_out = torch.full_like(q, float("nan"))
    args = rope_ops._append_layout((q, k, v, cos, sin, keys, values, torch.tensor([at]), q_out))
    grid = (S, -(-hq // krope.HEADS) + -(-k.shape[1] // krope.HEADS), B)
    emulate(krope.rope_append_kernel, krope)(grid, (*args, block, 1, krope.HEADS))
    return q_out


@pytest.mark.parametrize("B,hq,hkv,S,D,L,at", [
    (1, 32, 8, 1, 64, 40, 17),    # Llama-3.2-1B's layout, a decode step
    (2, 16, 8, 3, 128, 40, 37),   # Qwen3-0.6B's, a 3-token chunk up to the last slot
    (3, 4, 1, 1, 80, 20, 0),      # one KV head; head_dim 80 (40 of 64 lanes a half); slot 0
    (1, 8, 2, 2, 64, 10, 9),      # the cache's last slot, then one past its end
    (1, 8, 2, 1, 64, 10, 10),     # a full cache: nothing written
], ids=["llama-decode", "qwen3-chunk-to-the-end", "one-kv-head-hd80", "across-the-end", "full"])
def test_emulated_kernel_is_the_reference(B, hq, hkv, S, D, L, at):
    """The kernel's logic on the CPU (NumPy interpreter, float32): q rotated into a poisoned
    output; the rotated keys and the values at slots ``at..`` of a NaN-poisoned cache, slots past its
    end dropped and nothing else written."""
    q, k, v, cos, sin = _step(B, hq, hkv, S, D, seed=S + D)
    keys, values = _cache(B, hkv, L, D)
    got_q = _emulate(q, k, v, cos, sin, keys, values, at)
    want_keys, want_values = _cache(B, hkv, L, D)
    want_q, want_k = rope_ops.apply_rope_reference(q, k, cos, sin)
    n = max(0, min(S, L - at))
    want_keys[:, :, at:at + n], want_values[:, :, at:at + n] = want_k[:, :, :n], v[:, :, :n]
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(keys, want_keys, rtol=1e-6, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(values, want_values, rtol=0, atol=0, equal_nan=True)


def test_variants_are_the_decode_tiles_of_the_16_bit_dtypes():
    tags = {s.tag for s in krope.APPEND_VARIANTS}
    assert len(tags) == len(krope.APPEND_VARIANTS) == 2 * 2 * len(krope.BLOCKS)
    assert all(s.constants["ROWS"] == 1 and s.kernel == "rope_append" for s in krope.APPEND_VARIANTS)
    assert {s.params[0].dtype for s in krope.APPEND_VARIANTS} == {"bfloat16", "float16"}


def test_unfused_reasons():
    q, k, v, cos, sin = _step(1, 4, 2, 1, 64, dtype=torch.bfloat16)
    keys, _ = _cache(1, 2, 8, 64, torch.bfloat16)
    assert rope_ops._unfused_reason(q, k, cos, sin, keys) is None
    assert rope_ops._unfused_reason(q, k, cos[..., :32], sin[..., :32], keys) is None  # 32 lanes passed: one launch
    assert "dtypes" in rope_ops._unfused_reason(q.float(), k.float(), cos.float(), sin.float(), keys.float())
    q, k, v, cos, sin = _step(1, 4, 2, 1, 128, dtype=torch.bfloat16)
    keys, _ = _cache(1, 2, 8, 128, torch.bfloat16)
    assert "partial rotary" in rope_ops._unfused_reason(q, k, cos[..., :64], sin[..., :64], keys)  # 64 passed
    q, k, v, cos, sin = _step(1, 4, 2, 64, 64, dtype=torch.bfloat16)
    assert "a prefill" in rope_ops._unfused_reason(q, k, cos, sin, keys)


def _partial(cos, sin, rot):
    # Llama's cos/sin for a rotary part of `rot` elements (both halves of each at rot/2 frequencies).
    half = cos.shape[-1] // 2
    pick = torch.cat([torch.arange(rot // 2), half + torch.arange(rot // 2)])
    return cos[..., pick], sin[..., pick]


def _emulate_pass(q, k, v, cos, sin, keys, values, at):
    from cutile_numpy import emulate

    B, hq, S, D = q.shape
    rot = cos.shape[-1]
    block = max(rope_ops.MIN_BLOCK, 1 << (rot // 2 - 1).bit_length())
    q_out = torch.full_like(q, float("nan"))
    args = rope_ops._append_pass_layout((q, k, v, cos, sin, keys, values, torch.tensor([at]), q[..., rot:],
                                         k[..., rot:], v[..., rot:], keys[..., rot:], values[..., rot:], q_out,
                                         q_out[..., rot:]))
    grid = (S, -(-hq // krope.HEADS) + -(-k.shape[1] // krope.HEADS), B)
    emulate(krope.rope_append_pass_kernel, krope)(grid, (*args, block, 1, krope.HEADS, krope.PBLOCK))
    return q_out


@pytest.mark.parametrize("B,hq,hkv,S,D,rot,L,at", [
    (1, 24, 8, 1, 128, 96, 40, 17),   # Phi-4-mini's layout, a decode step
    (3, 24, 8, 1, 128, 96, 20, 19),   # batch 3 into the cache's last slot
    (2, 4, 1, 2, 80, 64, 10, 9),      # 16 lanes passed, one KV head, the last slot then one past the end
    (1, 8, 2, 1, 64, 32, 8, 8),       # a full cache: nothing written
], ids=["phi4-decode", "phi4-b3-last-slot", "hd80-across-the-end", "full"])
def test_emulated_pass_kernel_is_the_reference(B, hq, hkv, S, D, rot, L, at):
    """Partial rotary in one launch, on the CPU (NumPy interpreter, float32): the first R elements
    of q and k rotated, the rest of q, k and v copied through, k and v at slots ``at..`` of a
    NaN-poisoned cache, slots past its end dropped and nothing else written."""
    q, k, v, cos, sin = _step(B, hq, hkv, S, D, seed=S + D + rot)
    cos, sin = _partial(cos, sin, rot)
    keys, values = _cache(B, hkv, L, D)
    got_q = _emulate_pass(q, k, v, cos, sin, keys, values, at)
    want_keys, want_values = _cache(B, hkv, L, D)
    want_q, want_k = rope_ops.apply_rope_reference(q, k, cos, sin)
    n = max(0, min(S, L - at))
    want_keys[:, :, at:at + n], want_values[:, :, at:at + n] = want_k[:, :, :n], v[:, :, :n]
    assert torch.equal(got_q, want_q)
    assert torch.equal(keys.nan_to_num(7.0), want_keys.nan_to_num(7.0))
    assert torch.equal(values.nan_to_num(7.0), want_values.nan_to_num(7.0))


@pytest.fixture
def our_llama_rope():
    """Llama's hub ``apply_rotary_pos_emb`` module with our forward bound, as ``kernelize`` binds it."""
    func = modeling_llama.apply_rotary_pos_emb
    func.forward = types.MethodType(CutileRotaryPosEmb.forward, func)
    yield func
    func.__dict__.pop("forward", None)


def _armed_layer(B=1, hkv=2, L=16, D=8):
    cache = StaticCache(config=tiny_model("llama").config, max_cache_len=L)
    layer = cache.layers[0]
    layer.update(torch.zeros(B, hkv, 2, D), torch.zeros(B, hkv, 2, D))  # initialized, 2 slots filled
    dg._make_capturable(cache)
    return cache, layer


def test_decode_graphs_arm_full_layers_and_disarm_them():
    cache, layer = _armed_layer()
    assert vars(layer)[dg.ROPE_UPDATE].func is dg._kernel_rope_update
    dg._restore_updates(cache)
    assert dg.ROPE_UPDATE not in vars(layer) and "update" not in vars(layer)
    sliding = StaticCache(config=tiny_model("mistral", sliding_window=4).config, max_cache_len=16)
    for lay in sliding.layers:
        lay.update(torch.zeros(1, 2, 2, 16), torch.zeros(1, 2, 2, 16))
    dg._make_capturable(sliding)
    assert all(vars(lay)[dg.ROPE_UPDATE].func is dg._kernel_rope_sliding_update for lay in sliding.layers)
    dg._restore_updates(sliding)
    assert all(dg.ROPE_UPDATE not in vars(lay) for lay in sliding.layers)


def test_sliding_layer_takes_one_launch_while_its_window_has_room():
    """A sliding-window layer (Phi-4-mini's cache is all of them; Mistral's with a window): the one
    launch while the step fits in the window, both lengths advanced as the layer's update advances
    them; None once it would shift (RoPE, then the layer's own update), nothing written."""
    cache = StaticCache(config=tiny_model("mistral", sliding_window=4).config, max_cache_len=16)
    layer = cache.layers[0]
    layer.update(torch.zeros(1, 2, 2, 16), torch.zeros(1, 2, 2, 16))  # 2 of the window's 4 slots
    dg._make_capturable(cache)
    rope_update = vars(layer)[dg.ROPE_UPDATE]
    for at in (2, 3):
        q, k, v, cos, sin = _step(1, 4, 2, 1, 16, seed=at, pos0=at)
        want_q, want_k = rope_ops.apply_rope_reference(q, k, cos, sin)
        got = rope_update(q, k, v, cos, sin)
        assert got is not None and torch.equal(got[0], want_q) and got[1] is layer.keys
        assert torch.equal(layer.keys[:, :, at:at + 1], want_k) and torch.equal(layer.values[:, :, at:at + 1], v)
        assert layer.cumulative_length_int == int(layer.cumulative_length) == at + 1
    keys = layer.keys.clone()
    q, k, v, cos, sin = _step(1, 4, 2, 1, 16, seed=9, pos0=4)
    assert rope_update(q, k, v, cos, sin) is None  # a full window: it shifts
    assert torch.equal(layer.keys, keys) and layer.cumulative_length_int == 4


def test_rope_and_cache_takes_only_our_llama_rope(our_llama_rope):
    """The armed layer's one-launch path: with Llama's hub module running our forward, it writes
    the cache, advances the length and returns what RoPE and ``update`` return; with the stock
    function, a hooked module or a Func of another formula, None (the stock lines run)."""
    cache, layer = _armed_layer()
    attn = types.SimpleNamespace(layer_idx=0)
    q, k, v, cos, sin = _step(1, 4, 2, 1, 8, pos0=2)
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    got = _direct.rope_and_cache(attn, our_llama_rope, cache, q, k, v, cos, sin)
    assert got is not None and torch.equal(got[0], want_q)
    assert got[1] is layer.keys and torch.equal(layer.keys[:, :, 2:3], want_k) and int(layer.cumulative_length) == 3
    ours = our_llama_rope.__dict__.pop("forward")  # the hub module with its own forward (the stock code)
    try:
        assert _direct.rope_and_cache(attn, our_llama_rope, cache, q, k, v, cos, sin) is None
    finally:
        our_llama_rope.forward = ours
    plain = modeling_llama.rotate_half  # not a module at all
    assert _direct.rope_and_cache(attn, plain, cache, q, k, v, cos, sin) is None
    handle = our_llama_rope.register_forward_hook(lambda *a: None)
    try:
        assert _direct.rope_and_cache(attn, our_llama_rope, cache, q, k, v, cos, sin) is None
    finally:
        handle.remove()
    from transformers.models.olmo2 import modeling_olmo2

    olmo = modeling_olmo2.apply_rotary_pos_emb  # OLMo 2's formula: our forward bound, another op
    olmo.forward = types.MethodType(CutileRotaryPosEmb.forward, olmo)
    try:
        assert _direct.rope_and_cache(attn, olmo, cache, q, k, v, cos, sin) is None
    finally:
        olmo.__dict__.pop("forward", None)
    dg._restore_updates(cache)
    assert _direct.rope_and_cache(attn, our_llama_rope, cache, q, k, v, cos, sin) is None  # disarmed
    assert int(layer.cumulative_length) == 3  # no declined call wrote or advanced anything


def test_rope_and_cache_declines_what_the_two_steps_would_do_otherwise(our_llama_rope):
    """None, nothing written, where the one launch would not do what RoPE and the cache's update
    do: a gradient asked for (the op has none), the layer's update replaced after arming, a cache
    class with its own update, mismatched dtypes."""
    attn = types.SimpleNamespace(layer_idx=0)
    q, k, v, cos, sin = _step(1, 4, 2, 1, 8, pos0=2)
    cache, layer = _armed_layer()
    with torch.enable_grad():
        assert _direct.rope_and_cache(attn, our_llama_rope, cache, q.requires_grad_(), k, v, cos, sin) is None
    q = q.detach()
    assert _direct.rope_and_cache(attn, our_llama_rope, cache, q, k, v, cos.double(), sin.double()) is None
    layer.update = lambda *a, **kw: None  # someone else's update since
    assert _direct.rope_and_cache(attn, our_llama_rope, cache, q, k, v, cos, sin) is None

    class OwnUpdate(StaticCache):
        def update(self, *args, **kwargs):
            return super().update(*args, **kwargs)

    own = OwnUpdate(config=tiny_model("llama").config, max_cache_len=16)
    own.layers[0].update(torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8))
    dg._make_capturable(own)
    assert dg.ROPE_UPDATE in vars(own.layers[0])
    assert _direct.rope_and_cache(attn, our_llama_rope, own, q, k, v, cos, sin) is None
    assert int(layer.cumulative_length) == 2 and int(own.layers[0].cumulative_length) == 2


def test_generate_over_emulated_graphs_takes_one_launch_and_matches_eager(our_llama_rope):
    """A tiny Llama with the decoder-layer patch (its attention through the reproduced forward):
    generate over the emulated decode graphs calls rope_append for every decode step of every
    layer and gives stock static-cache generate's tokens and logits."""
    from test_decode_graphs import ReplayEmulation, _cpu_compile_config, _generate, _same

    model = tiny_model("llama")
    ids = torch.randint(1, 256, (2, 5), generator=torch.Generator().manual_seed(3))
    want = _generate(model, ids, cache_implementation="static", disable_compile=True)
    assert all(cutile_kernels.patch(model, names=["decoder_add_rms_norm", "fused_qkv"]).changed.values())
    dg.enable_decode_graphs(model, graph_factory=ReplayEmulation)
    cutile_kernels.reset_stats()
    got = _generate(model, ids, compile_config=_cpu_compile_config())
    _same(got, want)
    calls = cutile_kernels.stats()["reference_calls"]
    # 11 decode steps: each eager step (warm-up, capture) and each emulated replay runs the forward.
    assert calls.get("rope_append", 0) >= 11 * model.config.num_hidden_layers
    assert calls.get("rope", 0) == model.config.num_hidden_layers  # the prefill only (no armed layer yet)


@pytest.mark.parametrize("window", [None, 64, 8], ids=["full-layers", "sliding-with-room", "sliding-window-fills"])
def test_phi3_generate_over_emulated_graphs_takes_one_launch_and_matches_eager(window):
    """Phi-3's partial rotary (phi3_rope's reproduced forward, which calls our RoPE itself): generate
    over the emulated decode graphs calls rope_append for every decode step of every layer (full
    layers, or sliding ones while the window has room: Phi-4-mini's cache) and gives stock
    static-cache generate's tokens and logits, also once a window fills and shifts."""
    from test_decode_graphs import ReplayEmulation, _cpu_compile_config, _generate, _same

    from transformers.cache_utils import StaticSlidingWindowLayer

    model = tiny_model("phi3", sliding_window=window)
    assert model.config.partial_rotary_factor < 1
    layers = StaticCache(config=model.config, max_cache_len=32).layers
    assert all(isinstance(lay, StaticSlidingWindowLayer) == (window is not None) for lay in layers)
    ids = torch.randint(2, 256, (2, 5), generator=torch.Generator().manual_seed(4))
    want = _generate(model, ids, cache_implementation="static", disable_compile=True)
    assert all(cutile_kernels.patch(model, names=["phi3_rope"]).changed.values())
    dg.enable_decode_graphs(model, graph_factory=ReplayEmulation)
    cutile_kernels.reset_stats()
    got = _generate(model, ids, compile_config=_cpu_compile_config())
    _same(got, want)
    calls = cutile_kernels.stats()["reference_calls"]
    if window == 8:  # 5 prompt tokens: 3 steps fit, the rest shift the window (RoPE, then the update)
        assert calls.get("rope_append", 0) >= 3 * model.config.num_hidden_layers
        assert calls.get("rope", 0) > model.config.num_hidden_layers
    else:
        assert calls.get("rope_append", 0) >= 11 * model.config.num_hidden_layers
        assert calls.get("rope", 0) == model.config.num_hidden_layers  # the prefill only


def test_rope_and_cache_without_a_hub_module_is_for_our_own_forwards():
    """``rope=None`` (a reproduced forward that calls our RoPE itself, e.g. Phi-3's): the armed
    layer's one launch, with the partial rotary's pass-through; still None where unarmed."""
    cache, layer = _armed_layer(D=8)
    attn = types.SimpleNamespace(layer_idx=0)
    q, k, v, cos, sin = _step(1, 4, 2, 1, 8, pos0=2)
    cos, sin = _partial(cos, sin, 4)
    want_q, want_k = rope_ops.apply_rope_reference(q, k, cos, sin)
    got = _direct.rope_and_cache(attn, None, cache, q, k, v, cos, sin)
    assert got is not None and torch.equal(got[0], want_q) and torch.equal(layer.keys[:, :, 2:3], want_k)
    assert torch.equal(layer.values[:, :, 2:3], v) and int(layer.cumulative_length) == 3
    dg._restore_updates(cache)
    assert _direct.rope_and_cache(attn, None, cache, q, k, v, cos, sin) is None


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

#: (B, Hq, Hkv, S, D, R): Llama-3.2-1B, Qwen3-0.6B, Phi-4-mini-like (24 q heads), Gemma's head_dim
#: 256 with one KV head, head_dim 80 (padded lanes), a 3-token chunk, batch 16, all rotated; then
#: Phi-4-mini's partial rotary (96 of 128: rope_append_pass) and 16 lanes passed of a 32-lane tile.
GPU_CASES = [(1, 32, 8, 1, 64, 64), (16, 32, 8, 1, 64, 64), (1, 16, 8, 1, 128, 128), (2, 24, 8, 1, 128, 128),
             (3, 8, 1, 1, 256, 256), (2, 4, 2, 1, 80, 80), (2, 16, 8, 3, 128, 128),
             (1, 24, 8, 1, 128, 96), (16, 24, 8, 1, 128, 96), (2, 4, 1, 1, 80, 64), (2, 24, 8, 3, 128, 96)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_kernel_is_the_two_launches_bit_for_bit(case, dtype, strict):
    """One launch (rope_append, or rope_append_pass for partial rotary) against float64 RoPE
    (within one 16-bit rounding) and bit for bit against the RoPE kernel followed by kv_append, on a
    NaN-poisoned cache and stacked q/k/v views; slots across a tile boundary; the pass-through lanes
    copied; only the new slots written."""
    B, hq, hkv, S, D, rot = case
    L, at = 300, 127
    q, k, v, cos, sin = _step(B, hq, hkv, S, D, dtype, "cuda", pos0=at)
    if rot < D:
        cos, sin = _partial(cos, sin, rot)
    keys, values = _cache(B, hkv, L, D, dtype, "cuda")
    before = dict(cutile_kernels.stats()["launches"])
    got = cutile_kernels.rope_append(q, k, v, cos, sin, keys, values, torch.tensor(at, device="cuda"))
    torch.cuda.synchronize()
    assert [v.kernel for v in launched_variants(before)] == ["rope_append" if rot == D else "rope_append_pass"]
    want_q, want_k = cutile_kernels.apply_rope(q, k, cos, sin)
    assert torch.equal(got, want_q) and got.stride() == want_q.stride()
    assert torch.equal(keys[:, :, at:at + S], want_k) and torch.equal(values[:, :, at:at + S], v)
    assert torch.equal(got[..., rot:], q[..., rot:]) and torch.equal(keys[:, :, at:at + S, rot:], k[..., rot:])
    rest = torch.ones(L, dtype=torch.bool)
    rest[at:at + S] = False
    assert torch.isnan(keys[:, :, rest].float()).all() and torch.isnan(values[:, :, rest].float()).all()
    q64, k64 = rope_ops.apply_rope_reference(q.double(), k.double(), cos.double(), sin.double())
    tol = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    torch.testing.assert_close(got.double(), q64, rtol=tol, atol=tol * 4)
    torch.testing.assert_close(keys[:, :, at:at + S].double(), k64, rtol=tol, atol=tol * 4)


@pytest.mark.gpu
def test_gpu_slots_past_the_end_are_not_written(strict):
    q, k, v, cos, sin = _step(2, 8, 2, 3, 64, torch.bfloat16, "cuda")
    keys, values = _cache(2, 2, 10, 64, torch.bfloat16, "cuda")
    cutile_kernels.rope_append(q, k, v, cos, sin, keys, values, torch.tensor(8, device="cuda"))
    torch.cuda.synchronize()
    _, want_k = cutile_kernels.apply_rope(q, k, cos, sin)
    assert torch.equal(keys[:, :, 8:], want_k[:, :, :2]) and torch.equal(values[:, :, 8:], v[:, :, :2])
    assert torch.isnan(keys[:, :, :8].float()).all() and torch.isnan(values[:, :, :8].float()).all()


@pytest.mark.gpu
def test_gpu_appends_into_a_long_cache_in_one_launch(strict):
    # OLMo-3-7B's layout at batch 16 over 8192 slots: past the int32 bound the registry used before the
    # flat dims (the batch stride times 64 lanes), within int32 itself; strict mode raises on a fallback.
    q, k, v, cos, sin = _step(16, 32, 32, 1, 128, torch.bfloat16, "cuda", pos0=8000)
    keys, values = _cache(16, 32, 8192, 128, torch.bfloat16, "cuda")
    before = dict(cutile_kernels.stats()["launches"])
    got = cutile_kernels.rope_append(q, k, v, cos, sin, keys, values, torch.tensor(8000, device="cuda"))
    torch.cuda.synchronize()
    assert [v.kernel for v in launched_variants(before)] == ["rope_append"]
    want_q, want_k = cutile_kernels.apply_rope(q, k, cos, sin)
    assert torch.equal(got, want_q)
    assert torch.equal(keys[:, :, 8000:8001], want_k) and torch.equal(values[:, :, 8000:8001], v)
    assert torch.isnan(keys[:, :, 8001:].float()).all() and torch.isnan(values[:, :, :8000].float()).all()


@pytest.mark.gpu
def test_gpu_graph_replay_writes_at_the_length_it_finds(strict):
    q, k, v, cos, sin = _step(4, 32, 8, 1, 64, torch.bfloat16, "cuda")
    keys, values = _cache(4, 8, 64, 64, torch.bfloat16, "cuda")
    keys.zero_(), values.zero_()
    length = torch.tensor(0, device="cuda")
    cutile_kernels.rope_append(q, k, v, cos, sin, keys, values, length)  # load the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cutile_kernels.rope_append(q, k, v, cos, sin, keys, values, length)
        length.add_(1)
    keys.zero_(), values.zero_()
    length.fill_(0)
    for step in range(5):
        k.copy_(torch.randn_like(k))
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        want_q, want_k = cutile_kernels.apply_rope(q, k, cos, sin)
        assert torch.equal(out, want_q) and torch.equal(keys[:, :, step:step + 1], want_k) and int(length) == step + 1
        assert torch.equal(values[:, :, step:step + 1], v)
    assert not keys[:, :, 5:].any() and not values[:, :, 5:].any()


@pytest.mark.gpu
def test_gpu_wider_pass_through_takes_two_launches_and_says_so(caplog):
    """64 lanes passed (more than the one launch's 32): RoPE then kv_append, logged once (not a
    fallback: our two kernels run)."""
    q, k, v, cos, sin = _step(1, 4, 2, 1, 128, torch.bfloat16, "cuda")
    cos, sin = _partial(cos, sin, 64)
    keys, values = _cache(1, 2, 8, 128, torch.bfloat16, "cuda")
    rope_ops._SAID.clear()
    before = dict(cutile_kernels.stats()["launches"])
    fallbacks = dict(cutile_kernels.stats()["fallbacks"])  # earlier tests' count too
    with caplog.at_level("INFO", logger="cutile_kernels"):
        got = cutile_kernels.rope_append(q, k, v, cos, sin, keys, values, torch.tensor(3, device="cuda"))
    launched = sorted(v.kernel for v in launched_variants(before))
    want_q, want_k = cutile_kernels.apply_rope(q, k, cos, sin)
    assert torch.equal(got, want_q) and torch.equal(keys[:, :, 3:4], want_k) and torch.equal(values[:, :, 3:4], v)
    assert "partial rotary" in caplog.text and dict(cutile_kernels.stats()["fallbacks"]) == fallbacks
    assert launched == ["kv_append", "rope"]
