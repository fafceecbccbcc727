"""``rope_append_attention`` (``ops/attention.py``): a decode step's RoPE of q and k, the static KV
cache write and the attention over the filled cache in one launch. CPU: the reference is
transformers' RoPE, ``StaticLayer.update`` and sdpa over the filled slots (float64); the kernel's
tile logic through the NumPy interpreter (head blocks of 1, 2 and 4 heads, KV splits and their
combine, a window, a softcap, lengths across tile edges, the cache's last slot, NaN in the unfilled
slots and a poisoned output); what the one launch declines. GPU: the kernel against float64 and
against the two launches it replaces on real-model head layouts, fp16, splits, a captured CUDA
graph (the decode fast path's tests run it inside models: tests/test_decode_graphs.py)."""

from __future__ import annotations

import importlib
import types

import pytest
import torch
import torch.nn.functional as F

import cutile_kernels
from cutile_kernels.kernel_src import attention as kattn
from cutile_kernels.layers import decode_graphs as dg
from cutile_kernels.layers.rope import CutileRotaryPosEmb
from cutile_kernels.ops import rope as rope_ops

from families import model as tiny_model
from launches import launched_variants
from test_rope_append import _cache, _step, our_llama_rope  # noqa: F401 - a fixture

attn_ops = importlib.import_module("cutile_kernels.ops.attention")
transformers = pytest.importorskip("transformers")
from transformers.cache_utils import StaticLayer  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402


def _transformers(q, k, v, cos, sin, keys, values, n, scale, window=None, softcap=None, mask=None):
    """What the decode step computes in transformers: ``apply_rotary_pos_emb``, the cache write
    ``StaticLayer.update`` makes at slot ``n``, then attention of the rotated q over the first
    ``n + 1`` slots in float64 (sdpa's math; a window hides keys ``j <= n - window``; a boolean
    ``mask`` ``(B or 1, 1, 1, L)`` hides the keys where it is False)."""
    # transformers' formula, not the hub function (which a kernelized model in the same process binds to ours)
    c, s_ = cos.unsqueeze(1), sin.unsqueeze(1)
    q_rot = q * c + modeling_llama.rotate_half(q) * s_
    k_rot = k * c + modeling_llama.rotate_half(k) * s_
    layer = StaticLayer(keys.shape[2])
    layer.lazy_initialization(k_rot, v)
    layer.keys.copy_(keys), layer.values.copy_(values)
    layer.cumulative_length.fill_(n)
    new_keys, new_values = layer.update(k_rot, v)
    g = q.shape[1] // keys.shape[1]
    kk = new_keys[:, :, :n + 1].double().repeat_interleave(g, 1)
    vv = new_values[:, :, :n + 1].double().repeat_interleave(g, 1)
    s = q_rot.double() @ kk.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if window:
        s[..., :max(0, n + 1 - window)] = float("-inf")
    if mask is not None:
        s = s.masked_fill(~mask[..., :n + 1], float("-inf"))
    p = F.softmax(s, -1).nan_to_num()  # a row the mask hides entirely: zeros, as the kernels write it
    return p @ vv, new_keys, new_values


def test_reference_is_rope_the_cache_write_and_attention_over_the_filled_slots():
    """Float64 inputs: the op's CPU path (its reference) equals transformers' three steps, the
    unfilled slots (NaN) unread; the cache holds what ``StaticLayer.update`` wrote."""
    for window, softcap in ((None, None), (5, None), (None, 30.0)):
        q, k, v, cos, sin = _step(2, 8, 2, 1, 16, dtype=torch.float64, pos0=11)
        keys, values = _cache(2, 2, 24, 16, dtype=torch.float64)
        keys[:, :, :11], values[:, :, :11] = torch.randn(2, 2, 11, 16, dtype=torch.float64).unbind(0)[0], 0.5
        want, want_keys, want_values = _transformers(q, k, v, cos, sin, keys.nan_to_num(), values.nan_to_num(), 11,
                                                     0.25, window, softcap)
        got = attn_ops.rope_append_attention(q, k, v, cos, sin, keys, values, torch.tensor(11), scale=0.25,
                                             window=window, softcap=softcap)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert got.transpose(1, 2).is_contiguous()
        torch.testing.assert_close(keys[:, :, :12], want_keys[:, :, :12], rtol=0, atol=0)
        torch.testing.assert_close(values[:, :, :12], want_values[:, :, :12], rtol=0, atol=0)
        assert keys[:, :, 12:].isnan().all() and values[:, :, 12:].isnan().all()  # nothing past the new slot


def _emulate(q, k, v, cos, sin, keys, values, n, scale, window=0, softcap=0.0, hb=None, splits=1, pdl=0, mask=None):
    """The one launch (and with splits the combine) in the NumPy interpreter, as the op makes them;
    returns the output (B, Hq, 1, D), poisoned first. ``pdl``: the launch's PDL constant, the
    interpreter checking that nothing is touched before its wait (kernel_src/_pdl.py); ``mask``: a
    boolean (B or 1, 1, 1, L) mask, the MASKED variant reading its int8 view."""
    from cutile_numpy import emulate

    B, Hq, _, D = q.shape
    group = Hq // keys.shape[1]
    hb = hb or max(h for h in kattn.DECODE_HEADS if group % h == 0)
    out = torch.full((B, 1, Hq, D), float("nan"), dtype=q.dtype)
    o = out.transpose(1, 2)
    part = torch.full((splits, B * Hq, 1, D), float("nan"))
    lse = torch.full((splits, B * Hq, 1), float("nan"))
    consts = (D, hb, kattn.DECODE_ROWS // hb, kattn.DECODE_BN[D], 0, int(mask is not None), pdl)
    m = torch.zeros(1, 1, 1, dtype=torch.int8) if mask is None else attn_ops.kernel_mask(mask)
    args = attn_ops._rope_attention_layout((q, k, v, cos, sin, keys, values, torch.tensor([n]), m, o, part, lse,
                                            scale, softcap, window, splits))
    emulate(kattn.rope_append_attention_kernel, kattn)((splits, B * Hq // hb), args + consts,
                                                       early=() if pdl else None)
    if splits > 1:
        emulate(kattn.attention_combine_kernel, kattn)((1, B * Hq), (part, lse, o, splits, D, kattn.COMBINE_BS))
    return o


@pytest.mark.parametrize("B,hq,hkv,D,L,n,hb,splits,window,softcap", [
    (1, 8, 2, 64, 300, 150, None, 1, 0, 0.0),      # Llama's group of 4 in one block, two KV tiles
    (2, 8, 2, 64, 300, 127, 2, 1, 0, 0.0),         # two head blocks a group: one writes; the tile's last key
    (1, 4, 4, 128, 200, 64, 1, 1, 0, 0.0),         # MHA at head dim 128: the new key opens a tile
    (1, 4, 1, 128, 300, 200, None, 3, 0, 0.0),     # one KV head, three splits, their combine
    (2, 8, 4, 64, 400, 260, None, 2, 100, 0.0),    # a window over part of the cache, split
    (1, 4, 2, 256, 100, 70, None, 1, 0, 50.0),     # head dim 256 with a softcap (Gemma 2's kind)
    (1, 8, 2, 64, 20, 0, None, 1, 0, 0.0),         # an empty cache: only the new key
    (1, 8, 2, 64, 20, 19, None, 1, 0, 0.0),        # the cache's last slot
], ids=["llama-group", "two-head-blocks", "mha-d128", "splits", "window-split", "d256-softcap", "empty", "last-slot"])
def test_emulated_kernel_is_the_reference(B, hq, hkv, D, L, n, hb, splits, window, softcap):
    """The kernel's logic on the CPU (float32): the attention output against the float64
    reference, the new key rotated and written with the value at slot ``n`` of a cache whose
    unfilled slots hold NaN, and nothing else written."""
    q, k, v, cos, sin = _step(B, hq, hkv, 1, D, seed=n + D, pos0=n)
    keys, values = _cache(B, hkv, L, D)
    g = torch.Generator().manual_seed(n)
    keys[:, :, :n], values[:, :, :n] = torch.randn(B, hkv, n, D, generator=g), torch.randn(B, hkv, n, D, generator=g)
    before_keys, before_values = keys.clone(), values.clone()
    scale = D ** -0.5
    got = _emulate(q, k, v, cos, sin, keys, values, n, scale, window, softcap, hb, splits)
    want, want_keys, want_values = _transformers(q.double(), k.double(), v.double(), cos.double(), sin.double(),
                                                 before_keys.double().nan_to_num(), before_values.double().nan_to_num(),
                                                 n, scale, window or None, softcap or None)
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
    want_keys_f = before_keys.clone()
    want_keys_f[:, :, n] = (k * cos.unsqueeze(1) + modeling_llama.rotate_half(k) * sin.unsqueeze(1))[:, :, 0]
    torch.testing.assert_close(keys, want_keys_f, rtol=1e-6, atol=1e-6, equal_nan=True)
    want_values_f = before_values.clone()
    want_values_f[:, :, n] = v[:, :, 0]
    torch.testing.assert_close(values, want_values_f, rtol=0, atol=0, equal_nan=True)


def _left_padded(B, L, pads):
    """sdpa's boolean decode mask over a static cache of L slots for rows whose first ``pads[b]``
    slots are padding (a left-padded batch)."""
    mask = torch.ones(B, 1, 1, L, dtype=torch.bool)
    for b, p in enumerate(pads):
        mask[b, ..., :p] = False
    return mask


@pytest.mark.parametrize("B,hq,hkv,D,L,n,splits,pads,broadcast,past", [
    (2, 8, 2, 64, 300, 150, 1, (0, 5), False, False),       # Llama's group, one row left-padded
    (3, 4, 4, 128, 200, 64, 1, (70, 0, 64), False, False),  # MHA; a row that sees no key, one only the new one
    (2, 4, 1, 128, 300, 200, 3, (0, 130), False, False),    # one KV head, splits, one hidden to the padded row
    (3, 8, 2, 64, 40, 20, 1, (0,), True, False),            # a batch-broadcast mask (stride 0), plain
    (2, 8, 2, 256, 100, 70, 1, (3, 0), False, False),       # head dim 256
    (2, 8, 2, 64, 300, 129, 2, (0, 1), False, True),        # a mask showing unfilled slots (NaN): the length bounds
], ids=["llama-padded", "mha-pad-past-tile", "splits-padded", "broadcast", "d256", "mask-past-length"])
def test_emulated_masked_kernel_is_the_reference(B, hq, hkv, D, L, n, splits, pads, broadcast, past):
    """The MASKED variant on the CPU (float32): a compiled step's boolean mask (padding, the
    unfilled slots False) decides which of the first ``n + 1`` keys each row sees, against the
    float64 reference; the unfilled slots hold NaN, the output is poisoned; the new key is written
    whatever the mask says. A mask that shows slots past the step's (``past``) does not open them."""
    q, k, v, cos, sin = _step(B, hq, hkv, 1, D, seed=n + D + 1, pos0=n)
    keys, values = _cache(B, hkv, L, D)
    g = torch.Generator().manual_seed(n + 1)
    keys[:, :, :n], values[:, :, :n] = torch.randn(B, hkv, n, D, generator=g), torch.randn(B, hkv, n, D, generator=g)
    mask = _left_padded(B, L, pads)
    if not past:
        mask[..., n + 1:] = False  # sdpa's static-cache mask: slots past the step's are not filled
    if broadcast:
        mask = mask[:1].expand(B, 1, 1, L)
        assert attn_ops.kernel_mask(mask).shape[0] == 1  # the kernel reads one row for the batch
    before_keys, before_values = keys.clone(), values.clone()
    got = _emulate(q, k, v, cos, sin, keys, values, n, D ** -0.5, splits=splits, mask=mask)
    want, _, _ = _transformers(q.double(), k.double(), v.double(), cos.double(), sin.double(),
                               before_keys.double().nan_to_num(), before_values.double().nan_to_num(), n, D ** -0.5,
                               mask=mask)
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(values[:, :, n], v[:, :, 0], rtol=0, atol=0)
    assert keys[:, :, n + 1:].isnan().all() and keys[:, :, :n].equal(before_keys[:, :, :n])
    # the reference path of the op (CPU) agrees, and a mask that shows every filled slot is the unmasked step
    keys2, values2 = before_keys.clone(), before_values.clone()
    ref = attn_ops.rope_append_attention(q, k, v, cos, sin, keys2, values2, torch.tensor(n), mask=mask)
    torch.testing.assert_close(ref.double(), want, rtol=2e-5, atol=2e-5)


def test_compiled_steps_take_only_masks_the_kernel_reads():
    """``takes_masked_decode`` (what a compiled step asks before the one launch): our attention
    forwards, a boolean ``(B or 1, 1, 1, L)`` mask or none; not an additive float mask, a mask of
    another length, ``output_attentions``, a softcap, or transformers' sdpa."""
    from cutile_kernels.layers import attention as layer_attn

    module = types.SimpleNamespace(training=False, attention_dropout=0.0)
    q = torch.zeros(2, 8, 1, 64, dtype=torch.bfloat16, device="meta")
    keys = torch.zeros(2, 2, 40, 64, dtype=torch.bfloat16, device="meta")
    ours, mask = layer_attn.cutile_kernel_attention_forward, torch.ones(2, 1, 1, 40, dtype=torch.bool, device="meta")
    takes = layer_attn.takes_masked_decode
    assert takes(ours, module, q, keys, mask, {}) and takes(ours, module, q, keys, None, {})
    assert takes(ours, module, q, keys, mask[:1], {})
    assert not takes(ours, module, q, keys, mask.float(), {})
    assert not takes(ours, module, q, keys, mask[..., :39], {})
    assert not takes(ours, module, q, keys, mask, {"output_attentions": True})
    assert not takes(ours, module, q, keys, mask, {"softcap": 30.0})
    assert not takes(F.scaled_dot_product_attention, module, q, keys, mask, {})


def test_emulated_mask_hiding_the_new_key_or_every_key():
    """Rows whose mask hides the step's own slot attend without the new key; a row that sees no key
    at all gets zeros (the attention kernel's and the reference's rule), not NaN."""
    B, hq, hkv, D, L, n = 3, 8, 2, 64, 64, 30
    q, k, v, cos, sin = _step(B, hq, hkv, 1, D, seed=5, pos0=n)
    keys, values = _cache(B, hkv, L, D)
    keys[:, :, :n], values[:, :, :n] = torch.randn(B, hkv, n, D), torch.randn(B, hkv, n, D)
    mask = torch.zeros(B, 1, 1, L, dtype=torch.bool)
    mask[0, ..., :n + 1] = True
    mask[1, ..., :n] = True          # the new key hidden
    before = keys.clone(), values.clone()
    got = _emulate(q, k, v, cos, sin, keys, values, n, D ** -0.5, mask=mask)
    want, _, _ = _transformers(q.double(), k.double(), v.double(), cos.double(), sin.double(),
                               before[0].double().nan_to_num(), before[1].double().nan_to_num(), n, D ** -0.5,
                               mask=mask)
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
    assert got[2].eq(0).all() and got[:2].abs().sum(-1).gt(0).all()


def test_takes_decode_steps_of_whole_heads_in_one_16_bit_dtype():
    bf = torch.bfloat16
    q, k, v, cos, sin = _step(1, 8, 2, 1, 64, dtype=bf)
    keys, values = _cache(1, 2, 40, 64, bf)
    takes = attn_ops.rope_append_attention_takes
    assert takes(q, k, v, cos, sin, keys, values)
    assert not takes(q.float(), k.float(), v.float(), cos.float(), sin.float(), keys.float(), values.float())
    assert not takes(q, k, v, cos[..., :32], sin[..., :32], keys, values)  # partial rotary
    q2, k2, v2, cos2, sin2 = _step(1, 8, 2, 2, 64, dtype=bf)
    assert not takes(q2, k2, v2, cos2, sin2, keys, values)  # two positions
    q3, k3, v3, cos3, sin3 = _step(1, 6, 2, 1, 64, dtype=bf)
    assert not takes(q3, k3, v3, cos3, sin3, keys, values)  # a group of 3: attention pads it
    q4, k4, v4, cos4, sin4 = _step(1, 8, 2, 1, 80, dtype=bf)
    keys4, values4 = _cache(1, 2, 40, 80, bf)
    assert not takes(q4, k4, v4, cos4, sin4, keys4, values4)  # head dim 80
    with torch.enable_grad():
        assert not takes(q.requires_grad_(), k, v, cos, sin, keys, values)
    assert attn_ops._one_launch(q4, k4, v4, cos4, sin4, keys4, values4).startswith("head_dim 80")
    q, full = q.detach(), torch.ones(1, 1, 1, 40, dtype=torch.bool)
    strided = torch.ones(1, 1, 1, 80, dtype=torch.bool)[..., ::2]
    assert takes(q, k, v, cos, sin, keys, values, full) and takes(q, k, v, cos, sin, keys, values, strided)
    for bad in (full.to(torch.int8), full[..., :39], full.expand(1, 1, 2, 40), torch.ones(2, 1, 1, 40, dtype=bool),
                full.float()):
        assert not takes(q, k, v, cos, sin, keys, values, bad)
        with pytest.raises(ValueError, match="mask"):
            attn_ops.rope_append_attention(q, k, v, cos, sin, keys, values, torch.tensor(3), mask=bad)
    assert not takes(q, k, v, cos, sin, keys, values, full.to("meta"))  # not on the cache's device
    assert attn_ops.mask_mismatch(full.to("meta"), 1, 1, 40, keys.device) == "mask is on meta, not cpu"
    assert attn_ops.mask_mismatch([[True]], 1, 1, 40) == "mask is a list, not a boolean tensor"


def test_checks_name_what_does_not_match():
    q, k, v, cos, sin = _step(1, 8, 2, 2, 16)
    keys, values = _cache(1, 2, 8, 16)
    with pytest.raises(ValueError, match="one position"):
        attn_ops.rope_append_attention(q, k, v, cos, sin, keys, values, torch.tensor(0))
    q, k, v, cos, sin = _step(1, 8, 2, 1, 16)
    with pytest.raises(ValueError, match="rope_append_attention"):
        attn_ops.rope_append_attention(q, k, v, cos, sin, keys[:, :1], values[:, :1], torch.tensor(0))
    with pytest.raises(TypeError):
        attn_ops.rope_append_attention(q, k, v, cos, sin, keys, values, 3)


def test_variants_are_the_short_decode_tiles():
    specs = [s for s in kattn.VARIANTS if s.kernel == "rope_append_attention"]
    # by a length and by a mask, each again with programmatic dependent launch (kernel_src/_pdl.py)
    assert len(specs) == 2 * 2 * len(kattn.DTYPES) * len(kattn.HEAD_DIMS) * len(kattn.DECODE_HEADS)
    assert [s.constants["PDL"] for s in specs] == [0] * (len(specs) // 2) + [1] * (len(specs) // 2)
    assert [s.constants["MASKED"] for s in specs].count(1) == len(specs) // 2
    assert all(s.tag.endswith(".mask") == bool(s.constants["MASKED"]) for s in specs if not s.constants["PDL"])
    for s in specs:
        c = s.constants
        assert c["BN"] == kattn.DECODE_BN[c["D"]] and c["HB"] * c["BS"] == kattn.DECODE_ROWS


# ---------------------------------------------------------------------------------------------
# CPU: the decode graphs' plain steps
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def float32_one_launch(monkeypatch, our_llama_rope):
    """The one launch armed (as by default: ``decode_graphs.ROPE_ATTEND_ON``) and its dtype rule
    widened to float32, so that a CPU model of float32 (exact against stock) takes it (its
    reference); our Llama RoPE bound as ``kernelize`` binds it."""
    monkeypatch.setattr(dg, "ROPE_ATTEND_ON", True)
    monkeypatch.setattr(attn_ops, "KERNEL_DTYPES", (*attn_ops.KERNEL_DTYPES, torch.float32))
    cutile_kernels.reset_stats()
    yield


def test_decode_graphs_arm_every_kernel_layer_with_the_one_launch_when_asked(monkeypatch):
    from transformers import StaticCache

    assert dg.ROPE_ATTEND_ON  # the default
    monkeypatch.setattr(dg, "ROPE_ATTEND_ON", False)
    off = StaticCache(config=tiny_model("llama").config, max_cache_len=16)
    for layer in off.layers:
        layer.update(torch.zeros(1, 2, 2, 16), torch.zeros(1, 2, 2, 16))
    dg._make_capturable(off)
    assert all(dg.ROPE_ATTEND not in vars(layer) and dg.ROPE_UPDATE in vars(layer) for layer in off.layers)
    monkeypatch.setattr(dg, "ROPE_ATTEND_ON", True)

    cache = StaticCache(config=tiny_model("mistral", sliding_window=4).config, max_cache_len=16)
    full = StaticCache(config=tiny_model("llama").config, max_cache_len=16)
    for c in (cache, full):
        for layer in c.layers:
            layer.update(torch.zeros(1, 2, 2, 16), torch.zeros(1, 2, 2, 16))
        dg._make_capturable(c)
    assert all(vars(layer)[dg.ROPE_ATTEND].func is dg._kernel_rope_sliding_attend for layer in cache.layers)
    assert all(vars(layer)[dg.ROPE_ATTEND].func is dg._kernel_rope_attend for layer in full.layers)
    dg._restore_updates(full)
    assert all(dg.ROPE_ATTEND not in vars(layer) for layer in full.layers)


@pytest.mark.parametrize("model_type,attn,padded,fused", [
    ("llama", "cutile_kernel", False, True),
    ("llama", "cutile_kernel", True, False),    # a left-padded batch keeps its masks: three launches
    ("llama", "cutile", False, False),          # float32 under "cutile": sdpa attends (no length)
    ("llama", "sdpa", False, False),            # not our attention
    ("mistral", "cutile_kernel", False, True),  # sliding layers while their windows have room
], ids=["llama", "left-padded", "float32-cutile", "sdpa", "mistral-window"])
def test_generate_takes_the_one_launch_in_plain_steps_and_matches_stock(model_type, attn, padded, fused,
                                                                         float32_one_launch, monkeypatch):
    """generate over the emulated decode graphs: the plain steps of a model attending with our kernel
    run ``rope_append_attention`` in every layer (a Mistral window of 8 fills after 3 of the 12 steps:
    then its layers take RoPE and their own update, and the mask); tokens and logits are stock
    static-cache generate's in every case."""
    from test_decode_graphs import ReplayEmulation, _cpu_compile_config, _generate, _same

    extra = {"sliding_window": 8} if model_type == "mistral" else {}
    if model_type == "mistral":  # its own hub function: ours bound on it too, as kernelize binds it
        from transformers.models.mistral import modeling_mistral

        func = modeling_mistral.apply_rotary_pos_emb
        monkeypatch.setattr(func, "forward", types.MethodType(CutileRotaryPosEmb.forward, func), raising=False)
    model = tiny_model(model_type, attn=attn, head_dim=64, **extra)  # a head dim the one launch is built for
    ids = torch.randint(1, 256, (2, 5), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :2], mask[1, :2] = 0, 0
    want = _generate(model, ids, attention_mask=mask, cache_implementation="static", disable_compile=True)
    assert all(cutile_kernels.patch(model, names=["decoder_add_rms_norm", "fused_qkv"]).changed.values())
    dg.enable_decode_graphs(model, graph_factory=ReplayEmulation)
    cutile_kernels.reset_stats()
    got = _generate(model, ids, attention_mask=mask, compile_config=_cpu_compile_config())
    _same(got, want)
    calls = cutile_kernels.stats()["reference_calls"]
    layers = model.config.num_hidden_layers
    if not fused:
        assert calls.get("rope_append_attention", 0) == 0
    elif model_type == "mistral":  # steps at 5, 6 and 7 tokens have room in the window of 8
        assert calls.get("rope_append_attention", 0) >= 3 * layers and calls.get("rope", 0) > layers
    else:  # 11 steps; each eager step (warm-up, capture) and each emulated replay runs the forward
        assert calls.get("rope_append_attention", 0) >= 11 * layers
        assert calls.get("rope_append", 0) == 0 and calls.get("attention", 0) == layers  # the prefill's


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

#: (Hq, Hkv, D): Llama-3.2-1B, Qwen2.5-1.5B (a group of 6, which attention pads: declined),
#: Mistral-7B, OLMo-2-1B (MHA), a head dim of 256 (Gemma's).
LAYOUTS = [(32, 8, 64), (12, 2, 128), (32, 8, 128), (16, 16, 128), (8, 4, 256)]


def _gpu_case(B, hq, hkv, D, L, n, dtype, seed=0):
    q, k, v, cos, sin = _step(B, hq, hkv, 1, D, dtype=dtype, device="cuda", seed=seed, pos0=n)
    keys, values = _cache(B, hkv, L, D, dtype, "cuda")  # NaN in every unfilled slot
    g = torch.Generator(device="cuda").manual_seed(seed)
    keys[:, :, :n] = torch.randn(B, hkv, n, D, generator=g, device="cuda").to(dtype)
    values[:, :, :n] = torch.randn(B, hkv, n, D, generator=g, device="cuda").to(dtype)
    return q, k, v, cos, sin, keys, values


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("B,L,n", [(1, 169, 150), (16, 169, 63), (1, 4096, 3000), (3, 300, 0)],
                         ids=["b1", "b16", "b1-split", "empty"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_kernel_against_float64_and_the_two_launches(strict, layout, B, L, n, dtype):
    hq, hkv, D = layout
    q, k, v, cos, sin, keys, values = _gpu_case(B, hq, hkv, D, L, n, dtype)
    keys2, values2 = keys.clone(), values.clone()
    want, want_keys, want_values = _transformers(q.double(), k.double(), v.double(), cos.double(), sin.double(),
                                                 keys.double().nan_to_num(), values.double().nan_to_num(), n, D ** -0.5)
    fused = attn_ops.rope_append_attention_takes(q, k, v, cos, sin, keys, values)
    assert fused == (hq // hkv != 6)  # Qwen2.5's group of 6 is padded by attention: declined
    length = torch.tensor(n, device="cuda")
    before = dict(cutile_kernels.stats()["launches"])
    got = attn_ops.rope_append_attention(q, k, v, cos, sin, keys, values, length)
    torch.cuda.synchronize()
    launched = sorted(v.kernel for v in launched_variants(before))
    if fused:  # the one launch (and a split's combine), not its fallback
        _, splits = attn_ops._one_launch(q, k, v, cos, sin, keys, values)
        assert launched == (["attention_combine", "rope_append_attention"] if splits > 1 else ["rope_append_attention"])
    else:
        assert "rope_append_attention" not in launched
    q_rot = rope_ops.rope_append(q, k, v, cos, sin, keys2, values2, length.clone())
    two = attn_ops.attention(q_rot, keys2, values2, None, kv_len=length.view(1) + 1)
    err = (got.double() - want).abs().max().item()
    ref_err = (two.double() - want).abs().max().item()
    assert got.isfinite().all() and err <= max(2 * ref_err, 4e-3), (err, ref_err)
    assert torch.equal(keys[:, :, :n + 1], keys2[:, :, :n + 1]) and torch.equal(values[:, :, :n + 1],
                                                                                  values2[:, :, :n + 1])
    assert keys[:, :, n + 1:].isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [(32, 8, 64), (16, 8, 128), (8, 4, 256)], ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("B,L,n,pads", [(1, 169, 150, (0,)), (4, 300, 140, (0, 5, 140, 141)),
                                        (2, 4096, 3000, (0, 2500))], ids=["b1", "b4-padded", "split-padded"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_masked_kernel_against_float64_and_the_two_launches(strict, layout, B, L, n, pads, dtype):
    """The MASKED variant (a compiled step's mask: left padding, a row that sees nothing but its new
    key, one that sees nothing) against float64 and against ``rope_append`` then the attention kernel
    with the same mask; the cache bit for bit the two launches'."""
    hq, hkv, D = layout
    q, k, v, cos, sin, keys, values = _gpu_case(B, hq, hkv, D, L, n, dtype, seed=B + D)
    mask = _left_padded(B, L, pads).cuda()
    mask[..., n + 1:] = False
    keys2, values2 = keys.clone(), values.clone()
    want, _, _ = _transformers(q.double(), k.double(), v.double(), cos.double(), sin.double(),
                               keys.double().nan_to_num(), values.double().nan_to_num(), n, D ** -0.5, mask=mask)
    assert attn_ops.rope_append_attention_takes(q, k, v, cos, sin, keys, values, mask)
    length = torch.tensor(n, device="cuda")
    before = dict(cutile_kernels.stats()["launches"])
    got = attn_ops.rope_append_attention(q, k, v, cos, sin, keys, values, length, mask=mask)
    torch.cuda.synchronize()
    ran = [(v.kernel, v.constants["MASKED"]) for v in launched_variants(before) if v.kernel == "rope_append_attention"]
    assert ran == [("rope_append_attention", 1)]
    q_rot = rope_ops.rope_append(q, k, v, cos, sin, keys2, values2, length.clone())
    two = attn_ops.attention(q_rot, keys2, values2, mask, causal=False, kv_len=length.view(1) + 1)
    err = (got.double() - want).abs().max().item()
    ref_err = (two.double() - want).abs().max().item()
    assert got.isfinite().all() and err <= max(2 * ref_err, 4e-3), (err, ref_err)
    assert torch.equal(keys[:, :, :n + 1], keys2[:, :, :n + 1]) and keys[:, :, n + 1:].isnan().all()


@pytest.mark.gpu
def test_gpu_replays_in_a_cuda_graph_over_advancing_lengths(strict):
    """Captured once over a length tensor the step advances: each replay writes the next slot and
    attends over one more key, as eager calls do."""
    hq, hkv, D, L = 32, 8, 64, 300
    q, k, v, cos, sin, keys, values = _gpu_case(1, hq, hkv, D, L, 140, torch.bfloat16)
    keys2, values2 = keys.clone(), values.clone()
    length = torch.tensor(140, device="cuda")
    static = [t.clone() for t in (q, k, v, cos, sin)]
    before = dict(cutile_kernels.stats()["launches"])
    attn_ops.rope_append_attention(*static, keys.clone(), values.clone(), length.clone())  # load the variant
    assert [v.kernel for v in launched_variants(before)] == ["rope_append_attention"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn_ops.rope_append_attention(*static, keys, values, length)
        length.add_(1)
    torch.cuda.synchronize()
    keys.copy_(keys2), values.copy_(values2), length.fill_(140)
    for step in range(4):
        new = _step(1, hq, hkv, 1, D, dtype=torch.bfloat16, device="cuda", seed=step + 1, pos0=140 + step)
        for s, t in zip(static, new):
            s.copy_(t)
        graph.replay()
        want = attn_ops.rope_append_attention(*new, keys2, values2, torch.tensor(140 + step, device="cuda"))
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(keys[:, :, :144], keys2[:, :, :144], rtol=0, atol=0)
    assert int(length) == 144
