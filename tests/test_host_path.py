"""The per-call host path of the ops on the CPU: the plan cache's keys, the packed parameters of a
cached plan, the aliasing check on a cached plan, the environment read of CUTILE_KERNELS_DISABLE,
and the ops' CUDA branch down to the driver call (which is faked, as in
benchmarks/host_overhead.py). Nothing here needs a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import cutile_kernels
import pytest
import torch
from cutile_kernels import dispatch, launcher
from cutile_kernels.cubin import ArgPacker, param_info
from cutile_kernels.ops import norm as norm_ops
from cutile_kernels.ops import rope as rope_ops

BF16 = torch.bfloat16
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_gpu(monkeypatch, built_package_dir):
    """CPU tensors take the ops' CUDA path down to cuLaunchKernel, which records its call instead.
    Yields the list of (symbol, values) launched."""
    if "sm_90" not in dispatch._registry.registry().archs:
        pytest.skip("the build has no sm_90 variants")
    launched = []
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True), raising=False)
    monkeypatch.setattr(dispatch, "_arch_of", lambda device_index: ((9, 0), "sm_90"))
    monkeypatch.setattr(dispatch, "_PLANS", {})
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setattr(dispatch, "_LAUNCHER", launcher.Launcher())

    def load(variant, device_index):
        packer = ArgPacker(variant.params)
        assert param_info(variant.cubin.read_bytes(), variant.symbol) == packer.layout
        return launcher._Loaded(None, packer, variant)

    def launch_values(loaded, grid, values, device_index):
        loaded.params_address(values)  # the real packing into the ctypes buffer
        launched.append((loaded.variant.symbol, list(values)))

    monkeypatch.setattr(dispatch._LAUNCHER, "load", load)
    monkeypatch.setattr(dispatch._LAUNCHER, "launch_values", launch_values)
    monkeypatch.setenv(dispatch.ENV_STRICT, "1")
    monkeypatch.delenv(dispatch.ENV_DISABLE, raising=False)
    dispatch.reset_stats()
    yield launched
    dispatch.reset_stats()


def _rms_args(rows, hidden, dtype=BF16, offset=0):
    buf = torch.randn(rows * hidden + offset, dtype=dtype)
    x = buf[offset:].view(rows, hidden)
    return (x, torch.randn(hidden, dtype=dtype), torch.empty(rows, hidden, dtype=dtype), 1e-6)


def _run_rms(args):
    return dispatch.run("rms_norm", norm_ops._want(args[0], args[0].shape[0]), args, 2, norm_ops._grid(args[0].shape[0]))


def test_plan_cache_is_keyed_by_dtype_shape_class_and_alignment(fake_gpu):
    assert _run_rms(_rms_args(3, 2048))
    assert _run_rms(_rms_args(3, 2048))  # same signature, new tensors: the cached plan
    assert len(dispatch._PLANS) == 1
    assert _run_rms(_rms_args(5, 2048))  # another row count: another plan, same variant
    assert len(dispatch._PLANS) == 2 and fake_gpu[2][0] == fake_gpu[0][0]
    assert _run_rms(_rms_args(3, 2048, torch.float16))  # another dtype: another variant
    assert _run_rms(_rms_args(3, 4096))  # another BLOCK_N
    assert _run_rms(_rms_args(3, 2048, offset=1))  # base not 16-byte aligned: the generic layout
    symbols = [s for s, _ in fake_gpu]
    assert len(set(symbols[2:])) == 4 and symbols[0] not in symbols[3:], symbols
    reg = dispatch._registry.registry()
    tags = {v.symbol: v.tag for v in reg.variants(kernel="rms_norm", arch="sm_90")}
    assert "generic" in tags[symbols[-1]] and "generic" not in tags[symbols[0]]
    assert tags[symbols[0]].startswith("bf16") and tags[symbols[3]].startswith("fp16"), tags
    assert len(dispatch._PLANS) == 5


def test_cached_plan_packs_what_a_full_pack_gives(fake_gpu):
    for _ in range(3):  # the first call makes the plan, the others reuse it with new pointers
        args = _rms_args(7, 1536)
        assert _run_rms(args)
        symbol, values = fake_gpu[-1]
        v = next(v for v in dispatch._registry.registry().variants(kernel="rms_norm") if v.symbol == symbol)
        assert values == ArgPacker(v.params).values(args)
    assert len(dispatch._PLANS) == 1


def _variant(symbol):
    return next(v for v in dispatch._registry.registry().variants() if v.symbol == symbol)


def test_layout_runs_once_per_signature_and_packs_the_call_pointers(fake_gpu):
    # (B, S, N) activations: the layout views them as (B*S, N) rows once; later calls of the same
    # signature launch their own pointers with the plan's shapes and strides.
    calls = []

    def layout(args):
        calls.append(1)
        return norm_ops._rows_layout(args)

    for _ in range(3):
        x, w = torch.randn(2, 3, 2048, dtype=BF16), torch.randn(2048, dtype=BF16)
        y = torch.empty(2, 3, 2048, dtype=BF16)
        args = (x, w, y, 1e-6)
        assert dispatch.run("rms_norm", norm_ops._tile(2048, False), args, 2, norm_ops._grid(6), layout)
        symbol, values = fake_gpu[-1]
        assert values == ArgPacker(_variant(symbol).params).values(norm_ops._rows_layout(args))
        assert values[0] == x.data_ptr()
    assert len(calls) == 1 and len(dispatch._PLANS) == 1


def _pointer_slot(symbol, laid, index):
    """The parameter slot of argument ``index``'s pointer when ``symbol`` is launched on ``laid``."""
    _, ptr_slots, _ = ArgPacker(_variant(symbol).params).template(laid)
    return next(slot for slot, i in ptr_slots if i == index)


def test_layout_that_copies_is_run_on_every_call(fake_gpu):
    # A transposed (B, S, N) input cannot be seen as rows: reshape copies it. The plan says so, and
    # each call lays out anew: the kernel reads a fresh copy of this call's x, never the first
    # call's pointer, and writes the output the op returns.
    w = torch.randn(256, dtype=BF16)
    for n in range(2):
        x = torch.randn(3, 2, 256, dtype=BF16).transpose(0, 1)  # (2, 3, 256), rows not collapsible
        out = cutile_kernels.rms_norm(x, w)
        symbol, values = fake_gpu[-1]
        laid = norm_ops._rows_layout((x, w, out, 1e-6))
        assert values[_pointer_slot(symbol, laid, 2)] == out.data_ptr()
        assert values[_pointer_slot(symbol, laid, 0)] != x.data_ptr()  # the copy
    assert list(dispatch._PLANS.values()).count(dispatch._RELAYOUT) == 1
    assert len(fake_gpu) == 2


def test_layout_that_moves_a_pointer_is_run_on_every_call(fake_gpu):
    # A layout whose view of x starts elsewhere cannot be cached as x's pointer plus the view's
    # shape: the launch must carry the view's own address.
    x, w = torch.randn(3, 2048, dtype=BF16), torch.randn(2048, dtype=BF16)
    args = (x, w, torch.empty(2, 2048, dtype=BF16), 1e-6)
    shifted = lambda a: (a[0][1:], *a[1:])  # noqa: E731
    for _ in range(2):
        assert dispatch.run("rms_norm", norm_ops._tile(2048, False), args, 2, norm_ops._grid(2), shifted)
        symbol, values = fake_gpu[-1]
        assert values[_pointer_slot(symbol, shifted(args), 0)] == x[1:].data_ptr() == x.data_ptr() + 2 * 2048
    assert dispatch._RELAYOUT in dispatch._PLANS.values()


def test_ops_pack_what_a_full_pack_of_their_kernel_arguments_gives(fake_gpu):
    x, res, w = torch.randn(2, 5, 1024, dtype=BF16), torch.randn(2, 5, 1024, dtype=BF16), torch.randn(1024, dtype=BF16)
    for _ in range(2):
        y, s = cutile_kernels.add_rms_norm(x, res, w)
        symbol, values = fake_gpu[-1]
        laid = (x.view(10, 1024), res.view(10, 1024), w, y.view(10, 1024), s.view(10, 1024), 1e-6)
        assert values == ArgPacker(_variant(symbol).params).values(laid)
    g = torch.randn(3, 1, 2 * 512, dtype=BF16)
    out = cutile_kernels.silu_and_mul_fused(g)
    symbol, values = fake_gpu[-1]
    assert values == ArgPacker(_variant(symbol).params).values((g.view(3, 2, 512), out.view(3, 512)))
    q = torch.randn(2, 5, 4, 64, dtype=BF16).transpose(1, 2)
    k = torch.randn(2, 5, 2, 64, dtype=BF16).transpose(1, 2)
    cos, sin = torch.randn(2, 5, 48, dtype=BF16), torch.randn(2, 5, 48, dtype=BF16)  # partial rotary, 16 passed
    qe, ke = cutile_kernels.apply_rope(q, k, cos, sin)
    symbol, values = fake_gpu[-1]
    assert _variant(symbol).kernel == "rope_pass"  # the pass-through copied in the launch
    laid = rope_ops._pass_layout((q, k, cos, sin, q[..., 48:], k[..., 48:], qe, ke, qe[..., 48:], ke[..., 48:]))
    assert laid[0].shape == (2, 4, 5, 2, 24) and laid[4].shape == (2, 4, 5, 16)
    assert values == ArgPacker(_variant(symbol).params).values(laid)
    q = torch.randn(2, 5, 4, 128, dtype=BF16).transpose(1, 2)
    k = torch.randn(2, 5, 2, 128, dtype=BF16).transpose(1, 2)
    cos, sin = torch.randn(2, 5, 64, dtype=BF16), torch.randn(2, 5, 64, dtype=BF16)  # 64 passed: the two copies
    qe, ke = cutile_kernels.apply_rope(q, k, cos, sin)
    symbol, values = fake_gpu[-1]
    assert _variant(symbol).kernel == "rope"
    laid = rope_ops._halves_layout((q, k, cos, sin, qe, ke))
    assert laid[0].shape == (2, 4, 5, 2, 32)
    assert values == ArgPacker(_variant(symbol).params).values(laid)
    # A decode step of Phi-4-mini's layout (96 of 128 rotated) into a static cache: rope_append_pass.
    qkv = torch.randn(2, 1, (24 + 2 * 8) * 128, dtype=BF16)
    q, k, v = (t.view(2, 1, -1, 128).transpose(1, 2) for t in qkv.split((24 * 128, 8 * 128, 8 * 128), dim=-1))
    cos, sin = torch.randn(2, 1, 96, dtype=BF16), torch.randn(2, 1, 96, dtype=BF16)
    keys, values_ = torch.zeros(2, 8, 40, 128, dtype=BF16), torch.zeros(2, 8, 40, 128, dtype=BF16)
    length = torch.tensor(5)
    qe = cutile_kernels.rope_append(q, k, v, cos, sin, keys, values_, length)
    symbol, values = fake_gpu[-1]
    assert _variant(symbol).kernel == "rope_append_pass"
    laid = rope_ops._append_pass_layout((q, k, v, cos, sin, keys, values_, length.view(1), q[..., 96:], k[..., 96:],
                                         v[..., 96:], keys[..., 96:], values_[..., 96:], qe, qe[..., 96:]))
    assert laid[0].shape == (2, 24, 1, 2, 48) and laid[8].shape == (2, 24, 1, 32)
    assert values == ArgPacker(_variant(symbol).params).values(laid)


def test_fused_glu_gemv_plans_once_and_packs_its_views(fake_gpu):
    """``gemv_swiglu``'s (1, 2, K) gate/up view: one plan for repeated calls (its layout is part of the
    plan key), the call's own pointers packed each time."""
    w = torch.randn(64, 512, dtype=BF16)
    for _ in range(3):
        x = torch.randn(1, 1, 1024, dtype=BF16)
        out = cutile_kernels.gemv_swiglu(x, w)
        symbol, values = fake_gpu[-1]
        assert values == ArgPacker(_variant(symbol).params).values((x.view(1, 2, 512), w, out.view(1, 64)))
    assert len(fake_gpu) == 3 and len(dispatch._PLANS) == 1


def test_cached_plan_still_refuses_overlapping_inputs(fake_gpu):
    assert _run_rms(_rms_args(1, 2048))
    buf = torch.randn(4096, dtype=BF16)
    x, w = buf[:2048].view(1, 2048), buf[1024:3072]  # same signature as above, but w overlaps x
    assert dispatch._signature("rms_norm", norm_ops._want(x, 1), None, (x, w, torch.empty(1, 2048, dtype=BF16), 1e-6)) \
        in dispatch._PLANS
    with pytest.raises(cutile_kernels.FallbackError, match="overlap"):
        _run_rms((x, w, torch.empty(1, 2048, dtype=BF16), 1e-6))


def test_cached_unfit_plan_still_falls_back(fake_gpu):
    args = _rms_args(2, 2048, torch.float64)
    for _ in range(2):  # the reason is cached with the signature; the fallback still announces it
        with pytest.raises(cutile_kernels.FallbackError, match="dtypes"):
            _run_rms(args)
    assert len(dispatch._PLANS) == 1


def test_optional_kernel_declines_quietly(fake_gpu, monkeypatch):
    """``optional=True`` (a fused variant whose unfused pair the caller runs instead): no fitting
    variant, disabled, or overlapping inputs give False with no fallback record, no JIT and no
    strict-mode error (the fixture sets strict mode); the same call without it still falls back."""
    args = _rms_args(2, 2048, torch.float64)
    want, grid = norm_ops._want(args[0], 2), norm_ops._grid(2)
    assert dispatch.run("rms_norm", want, args, 2, grid, optional=True) is False
    buf = torch.randn(4096, dtype=BF16)
    x, w = buf[:2048].view(1, 2048), buf[1024:3072]
    overlap = (x, w, torch.empty(1, 2048, dtype=BF16), 1e-6)
    assert dispatch.run("rms_norm", norm_ops._want(x, 1), overlap, 2, norm_ops._grid(1), optional=True) is False
    monkeypatch.setenv(dispatch.ENV_DISABLE, "1")
    assert dispatch.run("rms_norm", norm_ops._want(x, 1), _rms_args(1, 2048), 2, norm_ops._grid(1), optional=True) is False
    monkeypatch.delenv(dispatch.ENV_DISABLE)
    assert not dispatch.stats()["fallbacks"] and not fake_gpu
    with pytest.raises(cutile_kernels.FallbackError, match="dtypes"):
        dispatch.run("rms_norm", want, args, 2, grid)


def test_disabled_reads_the_environment_at_every_call(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_DISABLE, raising=False)
    assert dispatch.disabled() is False
    monkeypatch.setenv(dispatch.ENV_DISABLE, " Yes ")
    assert dispatch.disabled() is True
    os.environ[dispatch.ENV_DISABLE] = "0"  # plain assignment, as a user would
    assert dispatch.disabled() is False
    os.environ[dispatch.ENV_DISABLE] = "on"
    assert dispatch.disabled() is True
    del os.environ[dispatch.ENV_DISABLE]
    assert dispatch.disabled() is False


def test_disabled_wins_over_a_cached_plan(fake_gpu, monkeypatch):
    args = _rms_args(2, 2048)
    assert _run_rms(args)
    monkeypatch.setenv(dispatch.ENV_DISABLE, "1")
    with pytest.raises(cutile_kernels.FallbackError, match="disabled"):
        _run_rms(args)


@pytest.mark.parametrize("grad", [False, True])
def test_needs_op(grad):
    a, b = torch.ones(2), torch.ones(2, requires_grad=True)
    with torch.set_grad_enabled(grad):
        assert dispatch.needs_op(a) is False
        assert dispatch.needs_op(a, b) is grad


def test_rope_layout_cache_matches_the_uncached_rule():
    def uncached(x):
        big = [d for d in range(x.dim()) if x.shape[d] > 1]
        order = sorted(range(x.dim()), key=lambda d: -x.stride(d))
        return None if [d for d in order if x.shape[d] > 1] == big else tuple(order)

    base = torch.randn(2, 5, 4, 8)
    for x in (base, base.transpose(1, 2), base.permute(2, 0, 3, 1), base[:, :1], base.transpose(0, 3)):
        for _ in range(2):  # computed, then cached
            out = rope_ops._empty_like_layout(x, BF16)
            want = torch.empty(x.shape) if uncached(x) is None else torch.empty_permuted(x.shape, uncached(x))
            assert out.shape == x.shape and out.dtype == BF16 and out.stride() == want.stride()
    assert rope_ops._result_dtype(BF16, torch.float32, BF16) == torch.float32
    assert rope_ops._result_dtype(BF16, BF16, BF16) == BF16


def test_ops_cuda_branch_shapes_and_launches(fake_gpu):
    x, res, w = torch.randn(2, 3, 2048, dtype=BF16), torch.randn(2, 3, 2048, dtype=BF16), torch.randn(2048, dtype=BF16)
    y = cutile_kernels.rms_norm(x, w)
    assert y.shape == x.shape and y.is_contiguous() and y.dtype == BF16
    y, s = cutile_kernels.add_rms_norm(x, res, w)
    assert y.shape == s.shape == x.shape
    gate, up = torch.randn(4, 1, 512, dtype=BF16), torch.randn(4, 1, 512, dtype=BF16)
    assert cutile_kernels.silu_and_mul(gate, up).shape == gate.shape
    assert cutile_kernels.silu(gate).shape == gate.shape
    assert cutile_kernels.silu_and_mul_fused(torch.randn(3, 1024, dtype=BF16)).shape == (3, 512)
    q = torch.randn(2, 5, 4, 64, dtype=BF16).transpose(1, 2)  # (B, S, H, D) seen as (B, H, S, D)
    k = torch.randn(2, 5, 2, 64, dtype=BF16).transpose(1, 2)
    cos, sin = torch.randn(2, 5, 64, dtype=BF16), torch.randn(2, 5, 64, dtype=BF16)
    qe, ke = cutile_kernels.apply_rope(q, k, cos, sin)
    assert qe.shape == q.shape and ke.shape == k.shape and qe.stride() == q.stride() and ke.stride() == k.stride()
    reg = dispatch._registry.registry()
    kernels = [next(v.kernel for v in reg.variants() if v.symbol == s) for s, _ in fake_gpu]
    assert kernels == ["rms_norm", "add_rms_norm", "silu_and_mul", "silu", "silu_and_mul_fused", "rope"]
    # the rope launch got (B, H, S, 2, D/2) views of q, k, cos, sin and the outputs
    rope_values = fake_gpu[-1][1]
    assert rope_values[0] == q.data_ptr() and rope_values[1:6] == [2, 4, 5, 2, 32]


def test_host_overhead_harness_runs():
    env = dict(os.environ, CUTILE_KERNELS_BUILD_DIR=str(ROOT / "build"))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_overhead.py"), "--calls", "200"],
                         capture_output=True, text=True, env=env, timeout=300, check=False)
    if "no cuTile build" in out.stdout + out.stderr:
        pytest.skip("no build")
    assert out.returncode == 0, out.stderr
    assert "rms_norm" in out.stdout and "apply_rope" in out.stdout


def test_rope_launches_on_q_and_k_split_from_one_fused_projection(fake_gpu):
    # fused_qkv hands RoPE q and k as views of one (B, S, Nq + 2 Nkv) buffer: their byte ranges
    # meet, their elements do not, so the kernel takes them (before, the aliasing check sent the
    # op to its PyTorch fallback on every layer).
    qkv = torch.randn(2, 9, (8 + 2 + 2) * 64, dtype=BF16)
    q, k, _ = (t.view(2, 9, -1, 64).transpose(1, 2) for t in qkv.split((512, 128, 128), dim=-1))
    cos, sin = torch.randn(2, 9, 64, dtype=BF16), torch.randn(2, 9, 64, dtype=BF16)
    cutile_kernels.apply_rope(q, k, cos, sin)
    cutile_kernels.apply_rope(q, k, cos, sin)  # the cached plan too
    assert len(fake_gpu) == 2 and all("rope" in symbol for symbol, _ in fake_gpu)
    # k half a head into q's last head: these do alias, and the plan of the same signature refuses them.
    k_bad = qkv[..., 480:608].view(2, 9, 2, 64).transpose(1, 2)
    with pytest.raises(cutile_kernels.FallbackError, match="overlap"):
        cutile_kernels.apply_rope(q, k_bad, cos, sin)


def test_host_profile_interleave_times_every_path_against_the_first(capsys):
    sys.path.insert(0, str(ROOT / "dev" / "diagnostics"))
    try:
        import host_profile
    finally:
        sys.path.remove(str(ROOT / "dev" / "diagnostics"))
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    fast = AutoModelForCausalLM.from_config(cfg).eval()
    slow = AutoModelForCausalLM.from_config(cfg).eval()
    slow.register_forward_hook(lambda *a: __import__("time").sleep(0.05))  # 50 ms more per forward
    host_profile.interleave({"stock": fast, "slower": slow}, torch.randint(0, 64, (1, 5)), 6)
    lines = [line for line in capsys.readouterr().out.splitlines() if " host " in line]
    assert [line.split()[0] for line in lines] == ["stock", "slower"]
    ratios = [float(line.rsplit(" ", 1)[1]) for line in lines]
    assert ratios[0] == 1.0 and ratios[1] > 1.5


def test_a_later_input_copied_by_the_layout_is_copied_on_every_call(fake_gpu):
    # A residual that cannot be seen as rows is copied; the launch must read the copy's address
    # with the copy's strides, not the residual's own pointer.
    w = torch.randn(256, dtype=BF16)
    for _ in range(2):
        x = torch.randn(2, 3, 256, dtype=BF16)
        res = torch.randn(3, 2, 256, dtype=BF16).transpose(0, 1)
        y, s = cutile_kernels.add_rms_norm(x, res, w)
        symbol, values = fake_gpu[-1]
        laid = norm_ops._rows_layout((x, res, w, y, s, 1e-6))
        assert values[_pointer_slot(symbol, laid, 1)] != res.data_ptr()
        assert values[_pointer_slot(symbol, laid, 3)] == y.data_ptr()
    assert dispatch._RELAYOUT in dispatch._PLANS.values()


def test_a_layout_that_would_copy_an_output_falls_back(fake_gpu):
    x, w = torch.randn(3, 2048, dtype=BF16), torch.randn(2048, dtype=BF16)
    out = torch.empty(2048, 3, dtype=BF16).t()  # (3, 2048) with rows not contiguous
    copies = lambda a: (a[0], a[1], a[2].contiguous(), a[3])  # noqa: E731
    with pytest.raises(cutile_kernels.FallbackError, match="copies an output"):
        dispatch.run("rms_norm", norm_ops._tile(2048, False), (x, w, out, 1e-6), 2, norm_ops._grid(3), copies)
    assert fake_gpu == []
