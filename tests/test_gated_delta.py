"""Gated DeltaNet's kernels (issue 16): the gated delta rule (``ops/gated_delta.py``), the causal
conv1d and its update (``ops/conv1d.py``), the gated RMSNorm (``ops/norm.py``), and their hub layers
(``layers/gated_delta.py``, ``layers/norm.py``).

CPU: the references equal transformers' functions (the gates: ``gated_delta_gates``, and the block's
hub layer ``Qwen3_5GatedDeltaNet`` giving the stock forward's bits); the kernels' tile logic (chunks, the blocked
triangular inverse, padded lanes, rows past the end) through the NumPy interpreter against a
float64 reference; the verdicts; the hub layers leave CPU calls to the stock functions. GPU: every
kernel against a float64 reference on Qwen3.5's shapes and the edges (prompt lengths 1, 63, 64, 65,
2048 and 16384, fp16, strided views, outputs poisoned with NaN first), the chunked state equal to
the token-by-token one, in-place state updates replayed in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cutile_kernels
from cutile_kernels.kernel_src import conv1d as kconv
from cutile_kernels.kernel_src import gated_delta as kgd
from cutile_kernels.kernel_src import norm as knorm

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5 import modeling_qwen3_5 as q35  # noqa: E402


def _delta_inputs(B, T, H, dk, dv, dtype=torch.float32, device="cpu", seed=0, strided=False):
    """q, k, v, g, beta, state as Qwen3.5 makes them: q/k/v column slices of one convolution output
    when ``strided``, g = -exp(A) * softplus(a + dt) in float32, beta = sigmoid(b)."""
    gen = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen)

    if strided:
        mixed = r(B, T, H * (2 * dk + dv)).to(dtype).to(device)
        q, k, v = mixed.split([H * dk, H * dk, H * dv], dim=-1)
        q, k, v = q.view(B, T, H, dk), k.view(B, T, H, dk), v.view(B, T, H, dv)
    else:
        q, k, v = (r(B, T, H, d).to(dtype).to(device) for d in (dk, dk, dv))
    g = (-torch.rand(H, generator=gen).mul(4).exp() * F.softplus(r(B, T, H))).to(device)
    beta = torch.sigmoid(r(B, T, H)).to(dtype).to(device)
    state = (0.1 * r(B, H, dk, dv)).to(device)
    return q, k, v, g, beta, state


def _float64_rule(q, k, v, g, beta, state):
    o = torch.empty(v.shape, dtype=torch.float64, device=v.device)
    s = state.double().clone()
    cutile_kernels.gated_delta_rule_reference(q.double(), k.double(), v.double(), g.double(), beta.double(), s, o,
                                              q.shape[-1] ** -0.5)
    return o, s


# ---------------------------------------------------------------------------------------------
# CPU: references, emulated kernels, checks, verdicts, hub layers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 130])
def test_reference_is_transformers_delta_rule(T):
    q, k, v, g, beta, s0 = _delta_inputs(2, T, 3, 32, 24)
    state = s0.clone()
    out = cutile_kernels.gated_delta_rule(q, k, v, g, beta, state)
    fn = q35.torch_chunk_gated_delta_rule if T > 1 else q35.torch_recurrent_gated_delta_rule
    want, want_state = fn(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,dk,dv", [(1, 64, 64), (5, 96, 80), (63, 64, 32), (64, 128, 64), (130, 64, 40)],
                         ids=["decode", "padded-lanes", "63", "one-chunk", "three-chunks-odd-dv"])
def test_emulated_kernels_match_float64(T, dk, dv):
    """Both kernels' tile logic on the CPU: chunks and their last partial one, the blocked triangular
    inverse, padded key lanes (96 of 128) and value columns (80 = 3 blocks of 32, 40 = 2)."""
    from cutile_numpy import emulate

    B, H = 2, 2
    q, k, v, g, beta, s0 = _delta_inputs(B, T, H, dk, dv, strided=True)
    want, want_state = _float64_rule(q, k, v, g, beta, s0)
    DK = max(kgd.KEY_DIMS[0], 1 << (dk - 1).bit_length())
    state, out = s0.clone(), torch.full(v.shape, float("nan"))
    emulate(kgd.gated_delta_recurrent_kernel, kgd)((-(-dv // kgd.RECURRENT_BV), B * H),
                                                   (q, k, v, g, beta, state, out, dk ** -0.5, DK, kgd.RECURRENT_BV))
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state.double(), want_state, rtol=1e-4, atol=1e-5)
    for bt in kgd.CHUNKS:
        out, state = _chunked(q, k, v, g, beta, s0.clone(), DK, bt)
        torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state.double(), want_state, rtol=1e-4, atol=1e-5)


def _chunked(q, k, v, g, beta, state, DK, bt=kgd.CHUNK):
    """The chunked pair through the NumPy interpreter, work buffers poisoned: (o, final state)."""
    from cutile_numpy import emulate

    B, T, H, dk = q.shape
    dv = v.shape[3]
    n = -(-T // bt)
    w, u = torch.full((B, T, H, dk), float("nan")), torch.full((B, T, H, dv), float("nan"))
    attn, out = torch.full((B, H, n * bt, bt), float("nan")), torch.full(v.shape, float("nan"))
    emulate(kgd.gated_delta_prepare_kernel, kgd)((n, B * H), (q, k, v, g, beta, w, u, attn, dk ** -0.5, DK, DK,
                                                              bt, kgd.SUB))
    emulate(kgd.gated_delta_scan_kernel, kgd)((-(-dv // kgd.BV), B * H), (q, k, g, w, u, attn, state, out,
                                                                          dk ** -0.5, DK, kgd.BV, bt))
    return out, state


def test_emulated_chunk_inverse_survives_repeated_tokens():
    """Identical keys with beta = 1 and no decay (a repeated token): the UT system's entries are all
    1, the worst case of its inverse's growth; the blocked forward substitution stays exact."""
    B, T, H, dk, dv = 1, 64, 1, 64, 32
    q, k, v, g, beta, s0 = _delta_inputs(B, T, H, dk, dv)
    k = k[:, :1].expand(B, T, H, dk).contiguous()
    g, beta = torch.zeros_like(g), torch.ones_like(beta)
    want, want_state = _float64_rule(q, k, v, g, beta, s0)
    out, _ = _chunked(q, k, v, g, beta, s0.clone(), 128)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)


def test_delta_rule_checks_name_what_does_not_match():
    q, k, v, g, beta, s = _delta_inputs(1, 3, 2, 16, 8)
    with pytest.raises(ValueError, match="must be one"):
        cutile_kernels.gated_delta_rule(q, k[..., :8], v, g, beta, s)
    with pytest.raises(ValueError, match="g .* must be"):
        cutile_kernels.gated_delta_rule(q, k, v, g[:, :2], beta, s)
    with pytest.raises(ValueError, match="state .* must be"):
        cutile_kernels.gated_delta_rule(q, k, v, g, beta, s[..., :4])
    with pytest.raises(TypeError, match="cutile_kernels.gated_delta_rule: q is int64"):
        cutile_kernels.gated_delta_rule(q.long(), k, v, g, beta, s)


def test_conv_references_are_transformers_functions():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 40, 7, generator=gen)  # (B, C, L) as transformers passes it
    w = torch.randn(40, 4, generator=gen)
    want = q35.causal_conv1d_fn(x, w, None, activation="silu")
    got = cutile_kernels.causal_conv1d(x.transpose(1, 2), w).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    state, x1 = torch.randn(2, 40, 4, generator=gen), torch.randn(2, 40, 1, generator=gen)
    want_state = state.clone()
    want = q35.causal_conv1d_update(x1, want_state, w, None, "silu")
    got = cutile_kernels.causal_conv1d_update(x1[..., 0], state, w)
    torch.testing.assert_close(got, want[..., 0], rtol=0, atol=0)
    torch.testing.assert_close(state, want_state, rtol=0, atol=0)


@pytest.mark.parametrize("L", [1, 3, 33, 70])
def test_emulated_conv_kernels_match_float64(L):
    from cutile_numpy import emulate

    gen = torch.Generator().manual_seed(L)
    B, C, K = 2, 300, 4  # channels past one block, and a partial one
    x = torch.randn(B, C, L, generator=gen).double().transpose(1, 2)  # (B, L, C) strided view
    w = torch.randn(C, K, generator=gen).double()
    want = cutile_kernels.causal_conv1d_reference(x, w)
    y = torch.full((B, L, C), float("nan"), dtype=torch.float64)
    emulate(kconv.causal_conv1d_kernel, kconv)((-(-L // kconv.BL), -(-C // kconv.BC), B),
                                               (x, w, y, K, kconv.BL, kconv.BC))
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)  # the kernel accumulates in float32
    state = torch.randn(B, C, K, generator=gen).double()
    want_state, want_y = state.clone(), torch.empty(B, C, dtype=torch.float64)
    cutile_kernels.causal_conv1d_update_reference(x[:, 0], want_state, w, want_y)
    y = torch.full((B, C), float("nan"), dtype=torch.float64)
    emulate(kconv.causal_conv1d_update_kernel, kconv)((-(-C // kconv.UPDATE_BC), B),
                                                      (x[:, 0], state, w, y, K, kconv.UPDATE_BC))
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
    assert torch.equal(state, want_state)


def test_gated_norm_reference_is_transformers_and_emulated_kernel_matches():
    from cutile_numpy import emulate

    gen = torch.Generator().manual_seed(0)
    norm = q35.Qwen3_5RMSNormGated(128, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        x, z = (torch.randn(37, 128, generator=gen).to(dtype) for _ in range(2))
        m = norm.to(dtype)
        got = cutile_kernels.rms_norm_gated_reference(x, z, m.weight, m.variance_epsilon)
        assert torch.equal(got, m(x, z))
    x, z = (torch.randn(37, 128, generator=gen).double() for _ in range(2))
    w = 1 + 0.1 * torch.randn(128, generator=gen).double()
    y = torch.full((37, 128), float("nan"), dtype=torch.float64)
    rows = knorm.ROWS[("rms_norm_gated", "generic")][128]
    emulate(knorm.rms_norm_gated_kernel, knorm)((-(-37 // rows),), (x, z, w, y, 1e-6, 128, rows))
    torch.testing.assert_close(y, cutile_kernels.rms_norm_gated_reference(x, z, w, 1e-6), rtol=1e-6, atol=1e-6)


def _gate_inputs(M, H, dtype, param_dtype, device="cpu", seed=0):
    """a and b (M, H), 4 x standard normal, with the softplus edges in the first row (above the
    threshold 20, where exp underflows, where 1 + exp rounds to 1, a NaN), A_log and dt_bias as
    Qwen3.5 draws them."""
    gen = torch.Generator().manual_seed(seed)
    a, b = 4 * torch.randn(M, H, generator=gen), 4 * torch.randn(M, H, generator=gen)
    a[0, :7] = torch.tensor([25.0, 19.5, -30.0, -90.0, -16.0, 0.0, float("nan")])[:H]
    b[0, 6:7] = float("nan")  # a NaN stays a NaN in both gates, as in torch
    a_log = torch.empty(H).uniform_(0.01, 16, generator=gen).log()
    dt_bias = 0.5 * torch.randn(H, generator=gen)
    return (a.to(dtype).to(device), b.to(dtype).to(device), a_log.to(param_dtype).to(device),
            dt_bias.to(param_dtype).to(device))


def _gates_float64(a, b, a_log, dt_bias):
    a64, b64 = a.double(), b.double()
    return -a_log.double().exp() * F.softplus(a64 + dt_bias.double()), torch.sigmoid(b64)


def test_gates_reference_is_the_modules_lines_and_emulated_kernel_matches():
    """``gated_delta_gates_reference`` gives what Qwen3_5GatedDeltaNet.forward's two lines give on
    the module's own parameters; the kernel through the NumPy interpreter matches float64 on
    padded heads, a partial last block, NaN-poisoned outputs and softplus's edges."""
    from cutile_numpy import emulate

    cfg = q35.Qwen3_5TextConfig(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=6,
                                linear_key_head_dim=16, linear_value_head_dim=16, num_hidden_layers=1,
                                layer_types=["linear_attention"])
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        m = q35.Qwen3_5GatedDeltaNet(cfg, 0).to(dtype)
        a, b = torch.randn(2, 7, 6).to(dtype), torch.randn(2, 7, 6).to(dtype)
        g, beta = cutile_kernels.gated_delta_gates_reference(a, b, m.A_log, m.dt_bias)
        assert torch.equal(beta, b.sigmoid()) and beta.dtype == dtype
        assert torch.equal(g, -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)) and g.dtype == torch.float32
        assert [t.dtype for t in cutile_kernels.gated_delta_gates(a, b, m.A_log, m.dt_bias)] == [torch.float32, dtype]
    for M, H in ((1, 16), (70, 48), (300, 6)):
        a, b, a_log, dt_bias = (t.double() for t in _gate_inputs(M, H, torch.float32, torch.float32, seed=M))
        bh = next(h for h in kgd.GATE_HEADS if h >= H)
        rows = kgd.GATE_ELEMENTS // bh
        # Poisoned with 7 (no g, which is <= 0, nor beta, in [0, 1], can be 7): unwritten fails.
        g = torch.full((M, H), 7.0, dtype=torch.float64)
        beta = torch.full((M, H), 7.0, dtype=torch.float64)
        emulate(kgd.gated_delta_gates_kernel, kgd)((-(-M // rows),), (a, b, a_log, dt_bias, g, beta, rows, bh))
        want_g, want_beta = _gates_float64(a, b, a_log, dt_bias)
        # The kernel computes in float32 (exp(-90) is a float32 subnormal: fewer mantissa bits).
        torch.testing.assert_close(g, want_g, rtol=4e-6, atol=1e-37, equal_nan=True)
        torch.testing.assert_close(beta, want_beta, rtol=4e-6, atol=0, equal_nan=True)
        assert (g.isnan() == want_g.isnan()).all() and g.isnan().sum() == (H > 6)


def test_gates_check_shapes_and_say_what_the_kernel_does_not_take():
    from cutile_kernels.ops import gated_delta as ops

    a, b, a_log, dt_bias = _gate_inputs(4, 16, torch.bfloat16, torch.bfloat16)
    with pytest.raises(ValueError, match="dt_bias"):
        cutile_kernels.gated_delta_gates(a, b, a_log, dt_bias[:8])
    with pytest.raises(ValueError, match="must be one"):
        cutile_kernels.gated_delta_gates(a, b[:, :8], a_log, dt_bias)
    assert ops.gates_unsupported(a, b, a_log, dt_bias) is None
    assert ops.gates_unsupported(a, b, a_log.float(), dt_bias.float()) is None
    assert "A_log" in ops.gates_unsupported(a, b, a_log.half(), dt_bias.half())
    assert "A_log" in ops.gates_unsupported(a, b, a_log.float(), dt_bias)
    assert "dtypes" in ops.gates_unsupported(a, b.half(), a_log, dt_bias)
    wide = _gate_inputs(2, 160, torch.bfloat16, torch.bfloat16)
    assert "heads" in ops.gates_unsupported(*wide)


def _tiny_deltanet(num_k_heads=2, num_v_heads=4):
    cfg = q35.Qwen3_5TextConfig(hidden_size=64, linear_num_key_heads=num_k_heads, linear_num_value_heads=num_v_heads,
                                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                                num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(3)
    return cfg, q35.Qwen3_5GatedDeltaNet(cfg, 0).eval()


def _prefill_and_steps(layer, cfg, x, steps, mask=None):
    from transformers import DynamicCache

    cache = DynamicCache(config=cfg)
    outs = [layer(x, cache_params=cache, attention_mask=mask)]
    outs += [layer(steps[:, i:i + 1], cache_params=cache) for i in range(steps.shape[1])]
    return torch.cat(outs, 1), cache.layers[0].recurrent_states[0].clone()


@pytest.mark.parametrize("heads", [(2, 4), (4, 4)], ids=["q-k-repeated", "one-to-one"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gated_deltanet_layer_is_the_stock_forward(heads, dtype):
    """The hub layer's forward on the stock module gives the stock forward's bits (CPU: our gates
    are the reference lines there), with a cache over a prefill and decode steps, with a padding
    mask, and without a cache; the states it leaves in the cache are the stock ones."""
    from cutile_kernels.layers.gated_delta import CutileGatedDeltaNet

    cfg, layer = _tiny_deltanet(*heads)
    layer = layer.to(dtype)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 9, 64, generator=gen).to(dtype)
    steps = torch.randn(2, 3, 64, generator=gen).to(dtype)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :4] = 0
    with torch.no_grad():
        want = _prefill_and_steps(layer, cfg, x, steps, mask)
        want_nocache = layer(x)
        layer.forward = CutileGatedDeltaNet.forward.__get__(layer)
        got = _prefill_and_steps(layer, cfg, x, steps, mask)
        got_nocache = layer(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got_nocache, want_nocache)


def test_gated_deltanet_layer_keeps_other_code_and_hooked_convs(caplog):
    """A class whose forward is other code, or a module whose conv1d carries accelerate hooks (the
    stock forward fires them), runs its own forward and says so."""
    from cutile_kernels.layers import gated_delta as lgd

    cfg, layer = _tiny_deltanet()
    assert lgd.computes_gated_deltanet(q35.Qwen3_5GatedDeltaNet)
    assert not lgd.computes_gated_deltanet.judge(q35.Qwen3_5Attention)

    class Other(q35.Qwen3_5GatedDeltaNet):
        def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
            return torch.zeros_like(hidden_states)

    x = torch.randn(1, 5, 64)
    other = Other(cfg, 0)
    with caplog.at_level("WARNING", logger="cutile_kernels"):
        assert torch.equal(lgd.CutileGatedDeltaNet.forward(other, x), torch.zeros_like(x))
    assert "keeps its own forward" in caplog.text

    fired = []

    class Hook:
        def pre_forward(self, module):
            fired.append(module)

        def post_forward(self, module, output):
            return output

    layer.conv1d._hf_hook = Hook()
    with torch.no_grad():
        lgd.CutileGatedDeltaNet.forward(layer, x)
    assert fired == [layer.conv1d]


def test_gated_deltanet_layer_calls_the_functions_kernelize_bound_on_a_deep_copy():
    """``copy.deepcopy`` copies a module's ``_kernel_funcs``; kernelize binds the copies, which the
    stock forward (calling the modeling module's functions) never reaches: the block layer calls them."""
    import copy

    from cutile_kernels.layers.gated_delta import CutileGatedDeltaNet

    cfg, layer = _tiny_deltanet()
    twin = copy.deepcopy(layer)
    func = twin._kernel_funcs["causal_conv1d_fn"]
    assert func is not q35.causal_conv1d_fn
    calls = []
    stock = type(func).forward

    def recording(self, *args, **kwargs):
        calls.append(self)
        return stock(self, *args, **kwargs)

    func.forward = recording.__get__(func)
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        twin(x)
        assert calls == []  # the stock forward calls the module-level function
        got = CutileGatedDeltaNet.forward(twin, x)
    assert calls == [func] and torch.equal(got, layer(x))


def test_recurrent_layer_leaves_the_callers_state_and_the_block_updates_the_caches(monkeypatch):
    """transformers' recurrent delta rule (and flash-linear-attention's) returns a new final state
    and leaves ``initial_state`` alone; so does our hub layer, called as the function. Only the block
    layer, with our layer bound, has the kernel update the cache's buffer where it lies (one address
    for a CUDA-graph replay). The inputs are taken for CUDA ones; the op runs its reference."""
    import copy
    from types import MethodType

    from cutile_kernels.layers import gated_delta as lgd

    why_not = lgd._why_not
    monkeypatch.setattr(lgd, "_why_not", lambda verdict, cls, cuda, why: why_not(verdict, cls, True, why))
    func = q35.torch_recurrent_gated_delta_rule
    q, k, v, g, beta, s0 = _delta_inputs(2, 1, 2, 16, 16)
    kw = dict(g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_o, want_s = type(func).forward(func, q, k, v, initial_state=s0.clone(), **kw)
    before = s0.clone()
    got_o, got_s = lgd.CutileFusedRecurrentGatedDeltaRule.forward(func, q, k, v, initial_state=s0, **kw)
    assert torch.equal(s0, before) and got_s.data_ptr() != s0.data_ptr()
    torch.testing.assert_close(got_o, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_s, want_s, rtol=1e-5, atol=1e-5)
    got_o, got_s = lgd.CutileFusedRecurrentGatedDeltaRule.forward(func, q, k, v, initial_state=s0,
                                                                  state_in_place=True, **kw)
    assert got_s is s0 and not torch.equal(s0, before)
    torch.testing.assert_close(s0, want_s, rtol=1e-5, atol=1e-5)

    # The block: the state the op updates is the cache's buffer only where our layer is bound.
    cfg, layer = _tiny_deltanet()
    updated = []
    op = lgd.gated_delta_rule
    monkeypatch.setattr(lgd, "gated_delta_rule", lambda *a: updated.append(a[5]) or op(*a))
    x, steps = torch.randn(1, 5, 64), torch.randn(1, 2, 64)
    with torch.no_grad():
        want, want_state = _prefill_and_steps(layer, cfg, x, steps)
        twin = copy.deepcopy(layer)
        twin.forward = MethodType(lgd.CutileGatedDeltaNet.forward, twin)
        got, _ = _prefill_and_steps(twin, cfg, x, steps)
        assert updated == []  # the stock recurrent function in the block: its own state
        for name, layer_cls in (("fused_recurrent_gated_delta_rule", lgd.CutileFusedRecurrentGatedDeltaRule),
                                ("chunk_gated_delta_rule", lgd.CutileChunkGatedDeltaRule)):
            f = twin._kernel_funcs[name]
            f.forward = MethodType(layer_cls.forward, f)
        from transformers import DynamicCache

        cache = DynamicCache(config=cfg)
        outs = [twin(x, cache_params=cache)]
        for i in range(2):
            buffer = cache.layers[0].recurrent_states[0]
            outs.append(twin(steps[:, i:i + 1], cache_params=cache))
            assert updated[-1] is buffer  # the decode step's kernel wrote the cache's tensor
    assert len(updated) == 3 and updated[0] is not cache.layers[0].recurrent_states[0]  # prefill: a new state
    torch.testing.assert_close(torch.cat(outs, 1), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cache.layers[0].recurrent_states[0], want_state, rtol=1e-4, atol=1e-5)
    assert torch.equal(got, want)


def test_stacked_projections_keep_the_stock_bits_keys_and_refuse_what_they_cannot_stack(caplog):
    """The opt-in ``qwen3_5_stacked_proj``: in_proj_qkv, in_proj_b and in_proj_a become one
    ``nn.Linear`` whose class forward is the block layer's (CPU: the three stock GEMMs on its rows,
    the stock logits bit for bit; a deep copy too), the stock state_dict keys and values remain,
    and modules it cannot stack say why."""
    import copy
    import logging

    import families
    from cutile_kernels.layers.gated_delta import STACKED_NAME, CutileGatedDeltaNet
    from cutile_kernels.layers.models import qwen3_5 as fam

    model = families.model("qwen3_5_text", layers=4)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(8))
    want = families.prefill_and_step(model, ids)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    blocks = [m for m in model.modules() if isinstance(m, q35.Qwen3_5GatedDeltaNet)]
    hooked = blocks[1]
    hooked.conv1d._hf_hook = object()
    with caplog.at_level(logging.INFO, logger="cutile_kernels"):
        assert cutile_kernels.patch(model, names=["qwen3_5_stacked_proj"]).changed == {"qwen3_5_stacked_proj": 1}
    assert "leaves 1 Qwen3_5GatedDeltaNet alone: its conv1d has accelerate hooks" in caplog.text
    del hooked.conv1d._hf_hook
    stacked = blocks[0]
    assert STACKED_NAME in stacked._modules and not hasattr(stacked, "in_proj_b")
    assert type(stacked).forward is CutileGatedDeltaNet.forward and isinstance(stacked, q35.Qwen3_5GatedDeltaNet)
    assert torch.equal(families.prefill_and_step(model, ids), want)
    assert torch.equal(families.prefill_and_step(copy.deepcopy(model), ids), want)
    got = model.state_dict()
    assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)
    # kernelize binds the hub layer's forward on the instance: the same function, so it stacks too.
    hooked.forward = CutileGatedDeltaNet.forward.__get__(hooked)
    assert fam.patch_qwen3_5_stacked_proj(model) == 1
    assert torch.equal(families.prefill_and_step(model, ids), want)
    assert fam.unpatch_qwen3_5_stacked_proj(model) == 2
    assert all(type(m) is q35.Qwen3_5GatedDeltaNet and hasattr(m, "in_proj_b") for m in blocks)
    assert torch.equal(families.prefill_and_step(model, ids), want)
    # On CUDA kernelize binds the build's copy of the package: another function object of the same
    # code (found on the H200: the stacking refused every kernelized block).
    import types

    copied = types.FunctionType(CutileGatedDeltaNet.forward.__code__, CutileGatedDeltaNet.forward.__globals__)
    assert copied is not CutileGatedDeltaNet.forward
    for m in blocks:
        m.forward = copied.__get__(m)
    assert fam.patch_qwen3_5_stacked_proj(model) == 2
    assert torch.equal(families.prefill_and_step(model, ids), want)
    assert fam.unpatch_qwen3_5_stacked_proj(model) == 2
    for m in blocks:
        del m.forward
    other = copy.deepcopy(blocks[0])
    other.forward = lambda *args, **kwargs: None
    assert fam.stacking_verdict(other).startswith("its forward is already replaced")
    other = copy.deepcopy(blocks[0])
    other.in_proj_b = torch.nn.Linear(64, other.num_v_heads, bias=True)
    assert fam.stacking_verdict(other) == "in_proj_b has a bias"


def test_stacked_projections_compile_fullgraph():
    import families

    model = families.model("qwen3_5_text", layers=4)
    cutile_kernels.patch(model, names=["qwen3_5_stacked_proj"])
    frames, targets, got, want = families.compile_fullgraph(model, seed=11)
    assert frames == 1 and any(t.endswith("gated_delta_gates.default") for t in targets)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_changed_deltanet_pin_turns_the_block_layer_off(change_pin):
    from cutile_kernels.layers import gated_delta as lgd

    change_pin("qwen3_5.Qwen3_5GatedDeltaNet.forward")
    assert not lgd.computes_gated_deltanet.judge(q35.Qwen3_5GatedDeltaNet)


def test_verdicts_take_qwen3_5_code_only():
    from cutile_kernels.layers import gated_delta as lgd
    from cutile_kernels.layers.norm import computes_gated_rms_norm

    assert lgd.computes_chunk_gated_delta_rule(type(q35.torch_chunk_gated_delta_rule))
    assert lgd.computes_recurrent_gated_delta_rule(type(q35.torch_recurrent_gated_delta_rule))
    assert lgd.computes_causal_conv1d_fn(type(q35.causal_conv1d_fn))
    assert lgd.computes_causal_conv1d_update(type(q35.causal_conv1d_update))
    assert computes_gated_rms_norm(q35.Qwen3_5RMSNormGated)
    # Another function under the hub class of one: declined.
    assert not lgd.computes_chunk_gated_delta_rule.judge(type(q35.causal_conv1d_fn))
    assert not computes_gated_rms_norm.judge(q35.Qwen3_5RMSNorm)


def test_changed_pin_turns_the_layers_off(change_pin):
    from cutile_kernels.layers import gated_delta as lgd

    change_pin("qwen3_5.torch_chunk_gated_delta_rule")
    assert not lgd.computes_chunk_gated_delta_rule.judge(type(q35.torch_chunk_gated_delta_rule))
    assert lgd.computes_causal_conv1d_fn.judge(type(q35.causal_conv1d_fn))
    change_pin("qwen3_5.l2norm")
    assert not lgd.computes_recurrent_gated_delta_rule.judge(type(q35.torch_recurrent_gated_delta_rule))


def test_every_hub_name_of_the_model_is_mapped():
    names = {"RMSNormGated", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn",
             "causal_conv1d_update", "RMSNormZeroCentered", "Qwen3_5GatedDeltaNet"}
    assert names <= set(cutile_kernels.layers.MAPPING)


def test_variants_cover_qwen3_5_shapes():
    delta = {(s.kernel, s.params[0].dtype, s.constants["DK"], s.tag.rsplit(".", 1)[1]) for s in kgd.VARIANTS
             if s.kernel != "gated_delta_gates"}
    conv = {(s.kernel, s.params[0].dtype, s.constants["K"]) for s in kconv.VARIANTS}
    for layout in ("aligned", "generic"):
        for dtype in ("bfloat16", "float16"):
            assert {("gated_delta_prepare", dtype, 128, layout), ("gated_delta_scan", dtype, 128, layout)} <= delta
        for dtype in ("bfloat16", "float16", "float32"):
            assert ("gated_delta_recurrent", dtype, 128, layout) in delta
    for dtype in ("bfloat16", "float16", "float32"):
        assert {("causal_conv1d", dtype, 4), ("causal_conv1d_update", dtype, 4)} <= conv
    gates = {(s.params[0].dtype, s.params[2].dtype, s.constants["BH"]) for s in kgd.VARIANTS
             if s.kernel == "gated_delta_gates"}
    for dtype in ("bfloat16", "float16", "float32"):
        for param in (dtype, "float32"):
            assert {(dtype, param, 16), (dtype, param, 64)} <= gates  # 0.8B's 16 value heads, 27B's 48


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

def _close_to_float64(got, want, ref_err, what):
    """``got`` no further from the float64 ``want`` than 2x the float32 torch reference's error
    ``ref_err`` (+ a floor for 16-bit outputs' rounding)."""
    err = (got.double() - want).norm() / want.norm()
    assert torch.isfinite(got).all(), f"{what}: non-finite values (unwritten NaN poison?)"
    assert err <= 2 * ref_err + 4e-3, f"{what}: relative error {err:.3e} vs the torch reference's {ref_err:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 63, 64, 65, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_delta_rule_matches_float64(T, dtype, strict, stock_functions):
    """Qwen3.5-0.8B's linear heads (16 x 128/128), q/k/v as column slices of the conv output. The
    torch reference is transformers' own function (``stock_functions``: a model kernelized earlier in
    the process rebinds it to our layer; when that layer still updated the state in place, the
    single-token case on the H200 started from the state after the token and failed), given a copy
    of the state; our hub layer, called as that function, must leave the state alone."""
    q, k, v, g, beta, s0 = _delta_inputs(1, T, 16, 128, 128, dtype, "cuda", seed=T, strided=True)
    want, want_state = _float64_rule(q, k, v, g, beta, s0)
    fn = q35.torch_chunk_gated_delta_rule if T > 1 else q35.torch_recurrent_gated_delta_rule
    ref, ref_state = fn(q, k, v, g=g, beta=beta, initial_state=s0.clone(), output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
    ref_err = float((ref.double() - want).norm() / want.norm())
    state = s0.clone()
    out = cutile_kernels.gated_delta_rule(q, k, v, g, beta, state)
    torch.cuda.synchronize()
    _close_to_float64(out, want, ref_err, f"output T={T}")
    state_err = float((ref_state.double() - want_state).norm() / want_state.norm())
    _close_to_float64(state, want_state, state_err, f"state T={T}")
    assert cutile_kernels.stats()["fallbacks"] == {} or "gated_delta" not in str(cutile_kernels.stats()["fallbacks"])
    if T == 1:  # the decode hub layer, called as transformers' function: the same bits, s0 left alone
        from cutile_kernels.layers.gated_delta import CutileFusedRecurrentGatedDeltaRule

        before = s0.clone()
        got, got_state = CutileFusedRecurrentGatedDeltaRule.forward(fn, q, k, v, g=g, beta=beta, initial_state=s0,
                                                                    output_final_state=True,
                                                                    use_qk_l2norm_in_kernel=True)
        assert torch.equal(s0, before) and torch.equal(got, out) and torch.equal(got_state, state)


@pytest.mark.gpu
def test_gpu_delta_rule_does_not_drift_over_16k_tokens(strict):
    q, k, v, g, beta, s0 = _delta_inputs(1, 16384, 2, 128, 128, torch.bfloat16, "cuda", seed=7)
    want, want_state = _float64_rule(q, k, v, g, beta, s0)
    state = s0.clone()
    out = cutile_kernels.gated_delta_rule(q, k, v, g, beta, state)
    tail = slice(16384 - 512, None)  # the last tokens carry the accumulated error
    err = float((out[:, tail].double() - want[:, tail]).norm() / want[:, tail].norm())
    assert err < 1e-2, err
    assert float((state.double() - want_state).norm() / want_state.norm()) < 1e-3


@pytest.mark.gpu
def test_gpu_batched_long_prefill_runs_the_chunked_kernels(strict):
    """Qwen3.5-0.8B's linear heads at 2 x 4096 tokens, q/k/v sliced from the conv output: past the
    int32 bound the registry used before the flat dims (the batch stride times the tile: the PyTorch
    path then ran, or in strict mode an error), within int32 itself."""
    q, k, v, g, beta, s0 = _delta_inputs(2, 4096, 16, 128, 128, torch.bfloat16, "cuda", seed=11, strided=True)
    want, want_state = _float64_rule(q, k, v, g, beta, s0)
    state = s0.clone()
    out = cutile_kernels.gated_delta_rule(q, k, v, g, beta, state)
    assert float((out.double() - want).norm() / want.norm()) < 1e-2
    assert float((state.double() - want_state).norm() / want_state.norm()) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 3])
def test_gpu_chunked_state_equals_token_by_token(B, strict):
    q, k, v, g, beta, s0 = _delta_inputs(B, 100, 4, 128, 128, torch.bfloat16, "cuda", seed=B)
    chunked, stepped = s0.clone(), s0.clone()
    out = cutile_kernels.gated_delta_rule(q, k, v, g, beta, chunked)
    steps = [cutile_kernels.gated_delta_rule(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                             beta[:, t:t + 1], stepped) for t in range(100)]
    # The chunked products round their operands to tf32 (10-bit mantissa): 1e-3 relative.
    torch.testing.assert_close(chunked, stepped, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(out.float(), torch.cat(steps, 1).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_recurrent_step_replays_in_a_cuda_graph(strict):
    q, k, v, g, beta, s0 = _delta_inputs(16, 1, 16, 128, 128, torch.bfloat16, "cuda")
    state = s0.clone()
    cutile_kernels.gated_delta_rule(q, k, v, g, beta, state.clone())  # load the module outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cutile_kernels.gated_delta_rule(q, k, v, g, beta, state)
    want_state = s0.double().clone()
    for _ in range(3):
        graph.replay()
        o64 = torch.empty(v.shape, dtype=torch.float64, device="cuda")
        cutile_kernels.gated_delta_rule_reference(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                                  want_state, o64, 128 ** -0.5)
        torch.cuda.synchronize()
        torch.testing.assert_close(state.double(), want_state, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(out.double(), o64, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("L", [1, 3, 64, 2049, 4096])  # 2 x 4096: past the int32 bound without the flat dims
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_conv_matches_transformers(L, dtype, strict, stock_functions):
    gen = torch.Generator().manual_seed(L)
    C = 6144  # Qwen3.5-0.8B's conv channels (2 x 2048 + 2048)
    x = torch.randn(2, L, C, generator=gen).to(dtype).cuda().transpose(1, 2)  # transformers' (B, C, L) view
    w = (0.3 * torch.randn(C, 4, generator=gen)).to(dtype).cuda()
    want = q35.causal_conv1d_fn(x, w, None, activation="silu")
    got = cutile_kernels.causal_conv1d(x.transpose(1, 2), w).transpose(1, 2)
    # Both accumulate four products in float32 and round twice; the order of the sum may differ.
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 16])
def test_gpu_conv_update_matches_transformers_in_a_graph(B, strict, stock_functions):
    gen = torch.Generator().manual_seed(B)
    C = 6144
    w = (0.3 * torch.randn(C, 4, generator=gen)).to(torch.bfloat16).cuda()
    x = torch.empty(B, C, 1, dtype=torch.bfloat16, device="cuda")
    state = torch.randn(B, C, 4, generator=gen).to(torch.bfloat16).cuda()
    want_state = state.clone()
    cutile_kernels.causal_conv1d_update(x[..., 0].normal_(), state.clone(), w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cutile_kernels.causal_conv1d_update(x[..., 0], state, w)
    for _ in range(5):  # the state shifts through several steps
        x.normal_()
        want = q35.causal_conv1d_update(x, want_state, w, None, "silu")
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(state, want_state)
        torch.testing.assert_close(y, want[..., 0], rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 2048 * 16 + 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_gated_norm_matches_transformers(rows, dtype, strict):
    gen = torch.Generator().manual_seed(rows)
    norm = q35.Qwen3_5RMSNormGated(128, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1, generator=gen)
    norm = norm.to(dtype).cuda()
    x, z = (torch.randn(rows, 128, generator=gen).to(dtype).cuda() for _ in range(2))
    got = cutile_kernels.rms_norm_gated(x, z, norm.weight, norm.variance_epsilon)
    want = norm(x, z)
    # The formula rounds three times: a last-bit difference in the first rounding can move the
    # output by two ulps (seen: fp16, one element in 4M).
    ulp = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got, want, rtol=ulp, atol=ulp)


@pytest.mark.gpu
@pytest.mark.parametrize("M,H", [(1, 16), (16, 16), (2 * 2048 + 3, 16), (37, 48)])
@pytest.mark.parametrize("dtype,param", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                         (torch.float16, torch.float16), (torch.float32, torch.float32)], ids=str)
def test_gpu_gates_match_float64(M, H, dtype, param, strict, monkeypatch):
    """The gates kernel on Qwen3.5's head counts (16, 27B's 48 padded to 64), a decode row, a
    partial last block, strided rows and softplus's edges (a NaN stays a NaN), outputs poisoned
    with 7 (no gate can be 7): g within float32 rounding of float64, beta within one ulp of its
    dtype."""
    from cutile_kernels.ops import gated_delta as ops

    allocate = ops._gates_outputs
    monkeypatch.setattr(ops, "_gates_outputs", lambda *args: tuple(t.fill_(7.0) for t in allocate(*args)))
    a, b, a_log, dt_bias = _gate_inputs(M, H, dtype, param, "cuda", seed=M + H)
    a = torch.cat([a, b], -1)[:, :H]  # rows strided as a slice of a wider projection
    g, beta = cutile_kernels.gated_delta_gates(a, b, a_log, dt_bias)
    torch.cuda.synchronize()
    want_g, want_beta = _gates_float64(a, b, a_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    assert (g.isnan() == want_g.isnan()).all() and (beta.isnan() == want_beta.isnan()).all()
    torch.testing.assert_close(g.double(), want_g, rtol=1e-5, atol=1e-30, equal_nan=True)
    ulp = {torch.float32: 2e-7, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(beta.double(), want_beta, rtol=ulp, atol=ulp, equal_nan=True)


@pytest.mark.gpu
def test_gpu_qwen3_5_layer_runs_our_kernels_and_matches_stock(strict, stock_functions):
    """One Qwen3.5 gated DeltaNet layer (real sizes) through the hub layers: prefill then decode
    steps with a cache, against the same layer's stock forward in float32."""
    from cutile_kernels.layers import gated_delta as lgd
    from cutile_kernels.layers.norm import CutileRMSNormGated

    cfg = q35.Qwen3_5TextConfig(hidden_size=1024, linear_num_key_heads=16, linear_num_value_heads=16,
                                linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                                num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(0)
    layer = q35.Qwen3_5GatedDeltaNet(cfg, 0).cuda().to(torch.bfloat16).eval()
    x = torch.randn(2, 70, 1024, device="cuda", dtype=torch.bfloat16)
    steps = torch.randn(2, 3, 1024, device="cuda", dtype=torch.bfloat16)

    def run(model):
        from transformers import DynamicCache

        dtype = next(model.parameters()).dtype
        cache = DynamicCache(config=cfg)
        outs = [model(x.to(dtype), cache_params=cache)]
        outs += [model(steps[:, i:i + 1].to(dtype), cache_params=cache) for i in range(3)]
        return torch.cat(outs, 1)

    with torch.inference_mode():
        want = run(layer.float()).double()
        layer.to(torch.bfloat16)
        stock = run(layer).double()
        before = cutile_kernels.stats()["launches"]
        funcs = layer._kernel_funcs
        swaps = [(funcs[n], cls) for n, cls in (
            ("chunk_gated_delta_rule", lgd.CutileChunkGatedDeltaRule),
            ("fused_recurrent_gated_delta_rule", lgd.CutileFusedRecurrentGatedDeltaRule),
            ("causal_conv1d_fn", lgd.CutileCausalConv1dFn), ("causal_conv1d_update", lgd.CutileCausalConv1dUpdate))]
        for mod, cls in swaps:
            mod.forward = cls.forward.__get__(mod)
        layer.norm.forward = CutileRMSNormGated.forward.__get__(layer.norm)
        layer.forward = lgd.CutileGatedDeltaNet.forward.__get__(layer)
        try:
            ours = run(layer).double()
        finally:
            for mod, _ in swaps:
                del mod.forward
            del layer.norm.forward, layer.forward
        launched = {k: v - before.get(k, 0) for k, v in cutile_kernels.stats()["launches"].items()}
    for kernel in ("gated_delta_prepare", "gated_delta_scan", "gated_delta_recurrent", "causal_conv1d",
                   "causal_conv1d_update", "rms_norm_gated", "gated_delta_gates"):
        assert any(k.startswith(kernel + "_kernel") and n > 0 for k, n in launched.items()), (kernel, launched)
    stock_err = float((stock - want).norm() / want.norm())
    err = float((ours - want).norm() / want.norm())
    assert err <= 1.1 * stock_err + 1e-4, (err, stock_err)


@pytest.mark.gpu
def test_gpu_stacked_projections_are_as_close_to_float32_as_stock(strict, stock_functions):
    """``qwen3_5_stacked_proj`` on a kernelized bf16 model: one GEMM for q/k/v, b and a (strided
    views into the conv and the gates kernel), a prefill and decode steps as close to float32 as
    stock bf16; undone and applied again over the block layer kernelize bound (the build copy's)."""
    import copy

    from families import model as tiny_model

    base = tiny_model("qwen3_5_text", layers=4).cuda()
    ids = torch.randint(1, 256, (2, 40), generator=torch.Generator().manual_seed(12)).cuda()

    def run(m):
        from families import prefill_and_step

        return prefill_and_step(m, ids).double()

    want = run(base)
    stock = run(copy.deepcopy(base).to(torch.bfloat16))
    ours = cutile_kernels.kernelize(copy.deepcopy(base).to(torch.bfloat16))  # a default patch: stacked
    from cutile_kernels.layers.models import qwen3_5 as fam

    assert fam.unpatch_qwen3_5_stacked_proj(ours) == 2
    # gemv (a default, Patch.follows) covers the two new stacked projections again.
    assert cutile_kernels.patch(ours, names=["qwen3_5_stacked_proj"]).changed == {"qwen3_5_stacked_proj": 2,
                                                                                  "gemv": 2}
    got = run(ours)
    err = [float((x - want).norm() / want.norm()) for x in (got, stock)]
    assert err[0] <= 1.1 * err[1] + 1e-4, err


@pytest.mark.gpu
def test_gpu_qwen3_5_model_left_padded_row_and_256_decode_steps(strict, stock_functions):
    """The tiny Qwen3.5 model (gated DeltaNet and full-attention layers, 2 key heads under 4 value
    heads) with every layer of ours, bf16 on the GPU: 256 decode steps through the recurrent path
    after a chunked prefill stay as close to float32 as stock bf16's, and a left-padded row gives
    the logits of the row alone (pad tokens enter neither the conv nor the recurrent state)."""
    import copy

    from families import model as tiny_model
    from transformers import DynamicCache

    from cutile_kernels_tools.bench.worker import merged_stats

    base = tiny_model("qwen3_5_text", layers=4).cuda()
    gen = torch.Generator().manual_seed(21)
    prompt = torch.randint(1, 256, (1, 40), generator=gen).cuda()
    steps = torch.randint(1, 256, (1, 256), generator=gen).cuda()

    def decode(model):
        # The prompt's prefill (chunked), then one token at a time (recurrent): every step's logits.
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            out = [model(prompt, past_key_values=cache, use_cache=True).logits[:, -1:]]
            for i in range(steps.shape[1]):
                out.append(model(steps[:, i:i + 1], past_key_values=cache, use_cache=True).logits)
        return torch.cat(out, 1).double()

    # Stock first: kernelize swaps the modeling module's hub functions for every model in the process.
    assert not any("forward" in vars(f) for f in (q35.torch_chunk_gated_delta_rule, q35.causal_conv1d_fn))
    want = decode(base)
    stock = decode(copy.deepcopy(base).to(torch.bfloat16))
    # kernelize binds the build's copy of the package, which keeps its own counters: count over all.
    before = merged_stats()["launches"]
    ours_model = cutile_kernels.kernelize(copy.deepcopy(base).to(torch.bfloat16))
    ours = decode(ours_model)
    launched = {k: v - before.get(k, 0) for k, v in merged_stats()["launches"].items()}
    for kernel in ("gated_delta_prepare", "gated_delta_scan", "gated_delta_recurrent", "causal_conv1d",
                   "causal_conv1d_update", "gated_delta_gates", "add_rms_norm_gemma"):
        assert any(k.startswith(kernel + "_kernel") and n > 0 for k, n in launched.items()), (kernel, launched)
    err = [float((x - want).norm() / want.norm()) for x in (ours, stock)]
    assert err[0] <= 1.1 * err[1] + 1e-4, err

    pad = 9
    rows = torch.randint(1, 256, (2, 30), generator=gen).cuda()
    ids, mask = rows.clone(), torch.ones_like(rows)
    ids[0, :pad], mask[0, :pad] = 0, 0
    with torch.inference_mode():
        batch = ours_model(ids, attention_mask=mask).logits.float()
        alone = ours_model(rows[:1, pad:]).logits.float()
    # RoPE scores depend on relative positions only: the shift by the padding changes rounding only.
    # On the CPU, stock: 6e-7 in float32, 0.012 in bf16; pads let into the states (no mask): 0.72.
    assert float((batch[0, pad:] - alone[0]).norm() / alone[0].norm()) < 0.05


def test_prefill_layers_leave_the_call_to_the_package_transformers_resolved(monkeypatch):
    """With flash-linear-attention (causal-conv1d) importable, transformers' hub function calls it,
    and its kernels beat ours: our layer leaves it the call. The verdict reads transformers' own
    choice: a package that is present but does not import leaves the torch code, and ours runs."""
    import sys
    import types

    from transformers.integrations import use_kernel_func_from_hub_with_fallback

    from cutile_kernels.layers import gated_delta as lgd

    def hub_function(package):
        @use_kernel_func_from_hub_with_fallback("causal_conv1d_fn", package)
        def causal_conv1d_fn(x):
            return "torch"

        return causal_conv1d_fn

    good = types.ModuleType("stub_conv_ok")
    good.causal_conv1d_fn = lambda x: "package"
    monkeypatch.setitem(sys.modules, "stub_conv_ok", good)
    broken = types.ModuleType("stub_conv_broken")  # imports, has no such function: transformers keeps torch
    monkeypatch.setitem(sys.modules, "stub_conv_broken", broken)
    monkeypatch.setitem(sys.modules, "stub_conv_raises", None)  # present but its import raises
    for package, runs in (("stub_conv_ok", "package"), ("stub_conv_broken", "torch"), ("stub_conv_raises", "torch"),
                          ("no_such_package", "torch")):
        fn = hub_function(package)
        assert fn(0) == runs
        assert lgd.runs_its_package(type(fn)) == (runs == "package"), package
    assert not lgd.runs_its_package(type(q35.torch_chunk_gated_delta_rule))  # no fla here

    # A bf16 prefill our kernels would take (inputs taken for CUDA ones) returns the function's result.
    why_not = lgd._why_not
    monkeypatch.setattr(lgd, "_why_not", lambda verdict, cls, cuda, why: why_not(verdict, cls, True, why))
    monkeypatch.setattr(lgd, "runs_its_package", lambda cls: True)
    q, k, v, g, beta, s0 = _delta_inputs(1, 40, 2, 128, 128)
    q, k, v, beta = (t.bfloat16() for t in (q, k, v, beta))
    assert lgd._delta_why(q, v, g, beta, True, {}) is None  # ours would take it
    func = q35.torch_chunk_gated_delta_rule
    kw = dict(g=g, beta=beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    got, want = lgd.CutileChunkGatedDeltaRule.forward(func, q, k, v, **kw), func(q, k, v, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    x, w = torch.randn(1, 64, 40, dtype=torch.bfloat16), torch.randn(64, 4, dtype=torch.bfloat16)
    conv = q35.causal_conv1d_fn
    assert torch.equal(lgd.CutileCausalConv1dFn.forward(conv, x, w, None, "silu"), conv(x, w, None, activation="silu"))


def test_hub_layers_give_what_the_kernels_do_not_compute_to_transformers(monkeypatch, caplog):
    """Calls the kernels do not take (float32 prefill, head dims past 128, q/k not normalised in the
    kernel, packed sequences) run the wrapped function, not our slow token-by-token reference, and
    say why once; the verdicts of Qwen3.5's copies in other models hold (same code, other lines)."""
    import importlib

    from cutile_kernels.layers import gated_delta as lgd

    q, k, v, g, beta, s0 = _delta_inputs(1, 40, 2, 16, 16)
    assert lgd._delta_why(q, v, g, beta, True, {}) is not None  # float32 over 40 tokens
    assert "head dims" in lgd._delta_why(*(t.bfloat16() for t in (_delta_inputs(1, 3, 2, 160, 16)[0],
                                                                  _delta_inputs(1, 3, 2, 16, 16)[2])),
                                         g[:, :3], beta[:, :3].bfloat16(), True, {})
    assert "normalised" in lgd._delta_why(q, v, g, beta, False, {})
    assert "packed" in lgd._delta_why(q, v, g, beta, True, {"cu_seqlens": torch.tensor([0, 40])})
    qb, vb, bb = q.bfloat16(), v.bfloat16(), beta.bfloat16()
    assert lgd._delta_why(qb, vb, g, bb, True, {}) is None
    for mod in ("qwen3_5_moe", "qwen3_next"):
        m = importlib.import_module(f"transformers.models.{mod}.modeling_{mod}")
        assert lgd.computes_chunk_gated_delta_rule.judge(type(m.torch_chunk_gated_delta_rule)), mod
    # The forward, its inputs taken for CUDA ones: a float32 prefill is no call of ours, so the hub
    # layer returns transformers' result and says why.
    why_not = lgd._why_not
    monkeypatch.setattr(lgd, "_why_not", lambda verdict, cls, cuda, why: why_not(verdict, cls, True, why))
    func = q35.torch_chunk_gated_delta_rule
    kw = dict(g=g, beta=beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    with caplog.at_level("WARNING", logger="cutile_kernels"):
        got = lgd.CutileChunkGatedDeltaRule.forward(func, q, k, v, **kw)
    want = func(q, k, v, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert "float32 over 40 tokens" in caplog.text and "transformers' function runs" in caplog.text
