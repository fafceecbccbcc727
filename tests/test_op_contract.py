"""What every public op promises whatever the device: the dtypes it takes, and a one-line error
naming the op, the argument and the supported dtypes for any other (CPU)."""

from __future__ import annotations

import pytest
import torch

import cutile_kernels


def _f(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


#: op name -> (call with the given dtype for its first float argument, that argument's name)
CALLS = {
    "rms_norm": (lambda d: cutile_kernels.rms_norm(_f(3, 64, dtype=d), _f(64)), "x"),
    "add_rms_norm": (lambda d: cutile_kernels.add_rms_norm(_f(3, 64, dtype=d), _f(3, 64), _f(64)), "x"),
    "silu": (lambda d: cutile_kernels.silu(_f(3, 64, dtype=d)), "x"),
    "silu_and_mul": (lambda d: cutile_kernels.silu_and_mul(_f(3, 64, dtype=d), _f(3, 64)), "gate"),
    "silu_and_mul_fused": (lambda d: cutile_kernels.silu_and_mul_fused(_f(3, 64, dtype=d)), "x"),
    "apply_rope": (lambda d: cutile_kernels.apply_rope(_f(1, 4, 5, 16, dtype=d), _f(1, 2, 5, 16), _f(1, 5, 16),
                                                       _f(1, 5, 16)), "q"),
    "apply_rope_cast": (lambda d: cutile_kernels.apply_rope_cast(_f(1, 4, 5, 16, dtype=d), _f(1, 2, 5, 16),
                                                                 _f(1, 5, 16), _f(1, 5, 16)), "q"),
    "qk_norm_rope": (lambda d: cutile_kernels.qk_norm_rope(_f(1, 4, 5, 16, dtype=d), _f(1, 2, 5, 16), _f(16), _f(16),
                                                           1e-6, _f(1, 5, 16), _f(1, 5, 16)), "q"),
    "qk_norm_rope_gemma": (lambda d: cutile_kernels.qk_norm_rope_gemma(_f(1, 4, 5, 16, dtype=d), _f(1, 2, 5, 16), _f(16),
                                                                       _f(16), 1e-6, _f(1, 5, 8), _f(1, 5, 8)), "q"),
    "sigmoid_and_mul": (lambda d: cutile_kernels.sigmoid_and_mul(_f(3, 64, dtype=d), _f(3, 64)), "gate"),
    "rope_cos_sin": (lambda d: cutile_kernels.rope_cos_sin(_f(8, dtype=d), torch.arange(5)[None], 1.0,
                                                           torch.float32), "inv_freq"),
    "attention": (lambda d: cutile_kernels.attention(_f(1, 4, 5, 16, dtype=d), _f(1, 2, 5, 16), _f(1, 2, 5, 16)), "q"),
    "rope_append_attention": (lambda d: cutile_kernels.rope_append_attention(
        _f(1, 4, 1, 16, dtype=d), _f(1, 2, 1, 16), _f(1, 2, 1, 16), _f(1, 1, 16), _f(1, 1, 16), _f(1, 2, 4, 16),
        _f(1, 2, 4, 16), torch.tensor(2)), "q"),
    "rope_append": (lambda d: cutile_kernels.rope_append(_f(1, 4, 1, 16, dtype=d), _f(1, 2, 1, 16), _f(1, 2, 1, 16),
                                                         _f(1, 1, 16), _f(1, 1, 16), _f(1, 2, 4, 16), _f(1, 2, 4, 16),
                                                         torch.tensor(2)), "q"),
}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64], ids=str)
@pytest.mark.parametrize("op", sorted(CALLS))
def test_other_dtypes_raise_one_line_type_error(op, dtype):
    call, arg = CALLS[op]
    with pytest.raises(TypeError) as err:
        call(dtype)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"cutile_kernels.{op}: {arg} is {str(dtype).removeprefix('torch.')}; supported: ")
    assert all(d in msg for d in ("bfloat16", "float16", "float32", "float64"))
    assert isinstance(err.value, cutile_kernels.UnsupportedDtypeError) and isinstance(err.value, ValueError)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("op", sorted(CALLS))
def test_float_dtypes_run(op, dtype):
    out = CALLS[op][0](dtype)
    outs = out if isinstance(out, tuple) else (out,)
    assert all(o.is_floating_point() and torch.isfinite(o).all() for o in outs)


def test_rope_cos_sin_checks_its_position_and_output_dtypes():
    inv = _f(8)
    with pytest.raises(TypeError, match=r"^cutile_kernels.rope_cos_sin: position_ids is float32; supported: an integer"):
        cutile_kernels.rope_cos_sin(inv, torch.zeros(1, 5), 1.0, torch.float32)
    with pytest.raises(TypeError, match=r"^cutile_kernels.rope_cos_sin: dtype is int32; supported: bfloat16"):
        cutile_kernels.rope_cos_sin(inv, torch.arange(5)[None], 1.0, torch.int32)
    with pytest.raises(TypeError, match=r"^cutile_kernels.rope_cos_sin: dtype must be a torch.dtype .*got str"):
        cutile_kernels.rope_cos_sin(inv, torch.arange(5)[None], 1.0, "float32")


def test_attention_names_its_16_bit_kernels():
    with pytest.raises(TypeError, match=r"supported: bfloat16, float16 \(cuTile kernels\) or float32, float64 \(the"):
        cutile_kernels.attention(_f(1, 2, 3, 8, dtype=torch.int64), _f(1, 2, 3, 8), _f(1, 2, 3, 8))


def test_the_dtype_check_traces_without_a_graph_break():
    fn = torch.compile(lambda x, w: cutile_kernels.rms_norm(x * 2, w), backend="eager", fullgraph=True)
    x, w = _f(3, 64), _f(64)
    torch.testing.assert_close(fn(x, w), cutile_kernels.rms_norm_reference(x * 2, w, 1e-6))


# ---------------------------------------------------------------------------------------------
# The contract every op defined through ops/_define.py passes (a new op adds one SAMPLES row).
# ---------------------------------------------------------------------------------------------

from cutile_kernels import dispatch  # noqa: E402
from cutile_kernels.ops._define import OPS  # noqa: E402


def _rope_args(dtype, device="cpu", heads=(4, 2), s=5, d=16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, s, heads[0], d, generator=g).to(dtype).transpose(1, 2)  # transformers' strided view
    k = torch.randn(1, s, heads[1], d, generator=g).to(dtype).transpose(1, 2)
    pos = torch.arange(s)[None, :, None].double()
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).double() / d)
    ang = torch.cat([pos * inv, pos * inv], dim=-1)
    return [t.to(device) for t in (q, k)], [t.to(dtype).to(device) for t in (ang.cos(), ang.sin())]


def _sample(name: str, dtype=torch.float64, device="cpu", d: int = 16) -> tuple:
    """The op's positional arguments: real-model layouts at a tiny size (rows not a tile multiple),
    head_dim ``d``."""
    g = torch.Generator().manual_seed(1)

    def f(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    if name == "rms_norm":
        return f(3, 7, 64), 1 + 0.1 * f(64), 1e-6
    if name == "rms_norm_gemma":
        return f(3, 7, 64), 0.1 * f(64), 1e-6, 1.0
    if name == "add_rms_norm":
        return f(3, 7, 64), f(3, 7, 64), 1 + 0.1 * f(64), 1e-6
    if name == "add_rms_norm_gemma":
        return f(3, 7, 64), f(3, 7, 64), 0.1 * f(64), 1e-6, 1.0
    if name == "rms_norm_add_gemma":  # OLMo 2's post-norm add: offset 0
        return f(3, 7, 64), f(3, 7, 64), 1 + 0.1 * f(64), 1e-6, 0.0
    if name == "silu":
        return (f(7, 3, 40).transpose(0, 1),)
    if name == "silu_and_mul":
        return f(7, 40), f(7, 40)
    if name == "silu_and_mul_fused":
        return (f(2, 7, 80),)
    if name == "gelu_tanh_and_mul_fused":
        return (f(2, 7, 80),)
    if name == "rope":
        (q, k), (cos, sin) = _rope_args(dtype, device, d=d)
        return q, k, cos, sin
    if name == "rope_cast":  # OLMo 2's: float32 cos/sin
        (q, k), (cos, sin) = _rope_args(dtype, device, d=d)
        return q, k, cos.float(), sin.float()
    if name == "qk_norm_rope":
        (q, k), (cos, sin) = _rope_args(dtype, device, d=d)
        return q, k, 1 + 0.1 * f(d), 1 + 0.1 * f(d), 1e-6, cos, sin
    if name == "qk_norm_rope_gemma":  # partial rotary: half of each head rotated
        (q, k), (cos, sin) = _rope_args(dtype, device, d=d)
        return q, k, 0.1 * f(d), 0.1 * f(d), 1e-6, cos[..., :d // 2], sin[..., :d // 2], 1.0
    if name == "qk_norm_rope_olmo2":  # q/k as views of a stacked projection (B, S, H * D); float32 cos/sin;
        hd = 2 * d  # head dim 2d: the kernel's tiles take 66-128 (the GPU test's d 64 gives OLMo's 128)
        (_, _), (cos, sin) = _rope_args(dtype, device, s=7, d=hd)
        qkv = f(2, 7, 8 * hd)
        return qkv[..., :4 * hd], qkv[..., 4 * hd:6 * hd], 1 + 0.1 * f(4 * hd), 1 + 0.1 * f(2 * hd), 1e-6, \
            cos.float(), sin.float()
    if name == "sigmoid_and_mul":  # the gate as the second half of each head of a wider projection
        return f(2, 7, 3, 2 * d)[..., d:], f(2, 7, 3, d)
    if name == "rope_cos_sin":
        return 1.0 / 10000 ** (torch.arange(0, d, 2).to(device, torch.float32) / d), \
            torch.arange(9, device=device).view(1, 9), 1.0, dtype
    if name == "kv_append":  # a step of 3 rows, strided (a view of a projection), into slots 4..6 of 9
        new = f(1, 3, 2, 3 * d)[..., :d].transpose(1, 2)
        return f(1, 2, 9, d), f(1, 2, 9, d), new, f(1, 2, 3, d), torch.tensor(4, device=device)
    if name == "rope_append":  # a 2-position step of stacked q/k/v views into slots 4..5 of 9
        qkv = f(1, 2, 8 * d).view(1, 2, 8, d).transpose(1, 2)
        (_, _), (cos, sin) = _rope_args(dtype, device, s=2, d=d)
        return (qkv[:, :4], qkv[:, 4:6], qkv[:, 6:], cos, sin, f(1, 2, 9, d), f(1, 2, 9, d),
                torch.tensor(4, device=device), torch.empty(1, 4, 2, d, dtype=dtype, device=device))
    if name == "rope_append_attention":  # a decode step of stacked q/k/v views into slot 4 of 9, its attention
        qkv = f(1, 1, 8 * d).view(1, 1, 8, d).transpose(1, 2)
        (_, _), (cos, sin) = _rope_args(dtype, device, s=1, d=d)
        mask = torch.ones(1, 1, 1, 9, dtype=torch.bool, device=device)
        mask[..., :1] = False  # a compiled step's mask: slot 0 padding
        return (qkv[:, :4], qkv[:, 4:6], qkv[:, 6:], cos, sin, f(1, 2, 9, d), f(1, 2, 9, d),
                torch.tensor(4, device=device), mask, torch.empty(1, 1, 4, d, dtype=dtype, device=device), d ** -0.5,
                0.0, 0)
    if name == "attention":
        mask = torch.ones(1, 1, 5, 9, dtype=torch.bool, device=device).tril(4)
        return f(1, 4, 5, d), f(1, 2, 9, d), f(1, 2, 9, d), mask, d ** -0.5, False, 0, 0.0, None
    if name == "rms_norm_gated":
        return f(3, 7, 64), f(3, 7, 64), 1 + 0.1 * f(64), 1e-6
    if name == "gated_delta_rule":  # q/k/v column slices of one projection, 5 tokens, 2 heads
        mixed = f(1, 5, 2 * (2 * d + 8))
        q, k, v = mixed.split([2 * d, 2 * d, 16], dim=-1)
        return (q.view(1, 5, 2, d), k.view(1, 5, 2, d), v.view(1, 5, 2, 8), -f(1, 5, 2).abs().float(),
                f(1, 5, 2).sigmoid(), f(1, 2, d, 8).float(), f(1, 5, 2, 8), d ** -0.5)  # float32 g and state
    if name == "causal_conv1d":
        return f(2, 40, 7).transpose(1, 2), f(40, 4)
    if name == "causal_conv1d_update":
        return f(2, 40), f(2, 40, 4), f(40, 4), f(2, 40)
    if name == "gemv":  # one decode row as a column slice of a wider projection, with a bias
        return f(1, 1, 48)[..., 16:32], f(24, 16), f(24)
    if name == "gemv_residual":  # one row as a column slice of a wider projection, a strided residual
        return f(1, 1, 48)[..., 16:32], f(24, 16), f(1, 1, 48)[..., ::2]
    if name in ("gemv_swiglu", "gemv_geglu"):  # one stacked gate/up row (K 16), down weight (24, 16)
        return f(1, 1, 32), f(24, 16)
    if name == "gated_delta_gates":  # a as a column slice of a wider projection, 5 tokens, 6 heads
        return f(2, 5, 12)[..., :6], f(2, 5, 6), f(6), f(6)
    raise KeyError(f"no contract sample for op {name!r}: add one to tests/test_op_contract.py")


def test_every_kernel_has_an_op_and_every_op_a_sample():
    from cutile_kernels import kernel_src

    # Kernels launched by an op of another name: attention_combine is the second half of the
    # split-KV attention, attention_mask_tiles the first of a masked prefill; the gated delta
    # rule's op runs its token-by-token kernel or the chunked pair;
    # gemv launches gemv_bias when given a bias; rope and rope_append their partial-rotary kernels.
    served = {"attention_combine": "attention", "attention_mask_tiles": "attention",
              "gated_delta_prepare": "gated_delta_rule",
              "gated_delta_scan": "gated_delta_rule", "gated_delta_recurrent": "gated_delta_rule",
              "gemv_bias": "gemv", "rope_pass": "rope", "rope_append_pass": "rope_append"}
    assert {served.get(s.kernel, s.kernel) for s in kernel_src.all_variants()} <= set(OPS)
    for name in OPS:
        _sample(name)
    with pytest.raises(ValueError, match="defined twice"):
        from cutile_kernels.ops._define import define_op

        define_op("rms_norm", OPS["rms_norm"]._cuda, reference=OPS["rms_norm"].reference, fake=lambda *a: None)


def _outs(out):
    return out if isinstance(out, tuple) else (out,)


def _results(name, fn, args):
    """What ``fn`` (the op, its reference, a compiled call...) gives on ``args``: its outputs, or for
    an op that writes in place, the written arguments (``fn`` runs on copies of them)."""
    mutated = OPS[name].mutated
    if not mutated:
        return _outs(fn(*args))
    args = [a.clone() if i in mutated else a for i, a in enumerate(args)]
    assert fn(*args) is None
    return tuple(args[i] for i in mutated)


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_passes_opcheck(name):
    args = _sample(name)
    utils = ["test_schema", "test_faketensor"] + (["test_autograd_registration"] if OPS[name].differentiable else [])
    torch.library.opcheck(OPS[name].op, args, test_utils=utils)


def test_rope_append_attention_without_a_mask_as_the_decode_graphs_call_it():
    """The sample passes a mask (a compiled step's call); the decode graphs pass none: the schema and
    fake tensors take ``None`` too, the CPU path is the reference, and the mask changes the result."""
    name = "rope_append_attention"
    args = list(_sample(name))
    masked = _results(name, OPS[name], args)
    args[8] = None
    torch.library.opcheck(OPS[name].op, tuple(args), test_utils=["test_schema", "test_faketensor"])
    got = _results(name, OPS[name], args)
    assert all(torch.equal(g, w) for g, w in zip(got, _results(name, OPS[name].reference, args)))
    assert not torch.equal(got[-1], masked[-1]) and torch.equal(got[0], masked[0])  # out differs; the cache write not


@pytest.mark.parametrize("name", sorted(OPS))
def test_fake_matches_the_real_output(name):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _sample(name, torch.float32)
    real = _results(name, OPS[name].op, args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = _results(name, OPS[name].op, [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    assert [(t.shape, t.dtype, t.stride()) for t in fake] == [(t.shape, t.dtype, t.stride()) for t in real]


@pytest.mark.parametrize("name", sorted(OPS))
def test_cpu_path_is_the_reference_and_counts_itself(name):
    args = _sample(name)
    dispatch.reset_stats()
    got = _results(name, OPS[name], args)
    want = _results(name, OPS[name].reference, args)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert dispatch.stats()["reference_calls"] == {name: 1}


@pytest.mark.parametrize("name", sorted(n for n in OPS if OPS[n].differentiable))
def test_gradients_are_the_references(name):
    args = [a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in _sample(name)]
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    outs = _outs(OPS[name](*args))
    cots = [torch.randn_like(o) for o in outs]
    got = torch.autograd.grad(outs, leaves, cots, allow_unused=True)
    ref_args = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args]
    ref_leaves = [a for a in ref_args if isinstance(a, torch.Tensor) and a.requires_grad]
    want = torch.autograd.grad(_outs(OPS[name].reference(*ref_args)), ref_leaves, cots, allow_unused=True)
    assert len(got) == len(want) and any(g is not None for g in got)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_compiles_fullgraph_into_one_graph(name):
    import torch._dynamo.testing

    args = _sample(name, torch.float32)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: OPS[name](*a), backend=counter, fullgraph=True)
    got = _results(name, fn, args)
    assert counter.frame_count == 1
    ops_in_graph = [n.target for gm in counter.graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert OPS[name].op._opoverload in ops_in_graph or any(getattr(t, "_name", "").endswith(f"::{name}")
                                                            for t in ops_in_graph)
    assert all(torch.equal(g, w) for g, w in zip(got, _results(name, OPS[name].run, args)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", sorted(OPS))
def test_gpu_op_replays_in_a_cuda_graph_and_disable_announces_the_fallback(name, dtype, monkeypatch):
    args = _sample(name, dtype, "cuda", d=64)
    eager = _results(name, OPS[name], args)
    mutated = OPS[name].mutated
    before = [args[i].clone() for i in mutated]
    dispatch.reset_stats()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        OPS[name](*args)  # warm-up outside capture (plans, module loads)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = OPS[name](*args)
    static = tuple(args[i] for i in mutated) if mutated else _outs(out)
    for o, b in zip(static, before if mutated else static):
        o.copy_(b) if mutated else o.fill_(float("nan"))  # poisoned (or the state before): the replay writes
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(g, w) for g, w in zip(static, eager))
    assert sum(dispatch.stats()["launches"].values()) > 0 and not dispatch.stats()["fallbacks"]
    monkeypatch.setenv(dispatch.ENV_DISABLE, "1")
    dispatch.reset_stats()
    for i, b in zip(mutated, before):
        args[i].copy_(b)
    ref = _results(name, OPS[name], args)
    assert any("disabled by" in k for k in dispatch.stats()["fallbacks"])
    for g, w in zip(ref, eager):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)


#: Ops that write an argument and still let inductor choose their inputs' layout: RoPE with the static
#: cache write, and that with the decode attention (one launch), whose cos/sin (and mask) every layer of a
#: compiled decode step reads.
FLEXIBLE_WRITERS = {"rope_append", "rope_append_attention"}


def test_flexible_ops_let_inductor_pass_their_inputs_as_they_are():
    # Inductor's default for a custom op copies an input it has not stored yet into a buffer of the
    # traced strides for every call that reads it: a compiled decode step built its attention mask
    # once per layer (test_compile.py's check of the step). An op that writes an argument keeps the
    # default (what it writes must be the caller's tensor) unless it is declared flexible.
    assert FLEXIBLE_WRITERS <= {n for n, o in OPS.items() if o.mutated}
    for name, op in OPS.items():
        tags = op.op._opoverload.tags
        want = not op.mutated or name in FLEXIBLE_WRITERS
        assert op.flexible == want and (torch.Tag.flexible_layout in tags) == want, name


def _flexible_in_a_fresh_process(extra: dict) -> tuple[set, int]:
    """The ops carrying ``flexible_layout`` and the count of ops, in a fresh interpreter with the
    layout variables (read at import) as ``extra`` sets them and no others."""
    import os
    import subprocess
    import sys

    probe = ("import torch, cutile_kernels; from cutile_kernels.ops._define import OPS; "
             "print(','.join(n for n, o in OPS.items() if torch.Tag.flexible_layout in o.op._opoverload.tags) "
             "or '-', len(OPS))")
    layout = (dispatch.ENV_FIXED_LAYOUT, dispatch.ENV_FLEXIBLE)
    env = {**{k: v for k, v in os.environ.items() if k not in layout}, **extra}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    names, count = out.stdout.split()[-2:]
    return set(names.split(",")) - {"-"}, int(count)


def test_fixed_layout_variable_gives_every_op_inductors_default():
    assert _flexible_in_a_fresh_process({dispatch.ENV_FIXED_LAYOUT: "1"}) == (set(), len(OPS))
    assert _flexible_in_a_fresh_process({}) == ({n for n, o in OPS.items() if o.flexible}, len(OPS))


def test_flexible_variable_declares_named_writers_flexible():
    # CUTILE_KERNELS_FLEXIBLE (an A/B switch, read at import) adds writers to the flexible ones;
    # CUTILE_KERNELS_FIXED_LAYOUT still takes every op back to inductor's default.
    fixed = sorted(n for n, o in OPS.items() if o.mutated and not o.flexible)
    assert fixed  # writers left with inductor's default: the variable's subject
    shipped = {n for n, o in OPS.items() if o.flexible}
    named, _ = _flexible_in_a_fresh_process({dispatch.ENV_FLEXIBLE: f"{fixed[0]}, no_such_op"})
    assert named == shipped | {fixed[0]}
    overridden, _ = _flexible_in_a_fresh_process({dispatch.ENV_FLEXIBLE: fixed[0], dispatch.ENV_FIXED_LAYOUT: "1"})
    assert overridden == set()


def _under_inductor_with_inputs_made_in_the_graph(name, dtype, device, monkeypatch, d=16, pad=False):
    """The op compiled by inductor with each float input it does not write made inside the graph (a
    product, which inductor stores in a buffer it lays out itself where the sample's may be a strided
    view): its outputs or written arguments (inductor checks each output's strides against the
    fake's), the eager op's on the sample, and the input strides the op's CPU path received.
    ``pad``: inductor's comprehensive padding on
    every stride (a GPU pads strides past 1024 elements by default; the CPU never does): the one
    layout a flexible input gets that the traced one does not."""
    args = _sample(name, dtype, device, d=d)
    seen = []
    cpu = OPS[name]._cpu

    def recording(*a):
        seen.append(tuple(x.stride() for x in a if isinstance(x, torch.Tensor)))
        return cpu(*a)

    monkeypatch.setattr(OPS[name], "_cpu", recording)

    def made(*a):  # the arguments an op writes stay the caller's tensors
        return OPS[name](*[x * 1 if isinstance(x, torch.Tensor) and x.is_floating_point() and i not in OPS[name].mutated
                           else x for i, x in enumerate(a)])

    padding = dict(comprehensive_padding=True, disable_padding_cpu=False, padding_stride_threshold=0) if pad else {}
    torch._dynamo.reset()
    with torch._inductor.config.patch(padding):
        got = _results(name, torch.compile(made, backend="inductor", fullgraph=True), args)
    torch._dynamo.reset()
    monkeypatch.setattr(OPS[name], "_cpu", cpu)
    want = _results(name, OPS[name], args)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
    return got, want, seen


@pytest.mark.parametrize("pad", [False, True], ids=["traced", "padded"])
@pytest.mark.parametrize("name", sorted(n for n in OPS if OPS[n].flexible))
def test_op_under_inductor_takes_inputs_in_the_layout_inductor_chose(name, pad, monkeypatch):
    got, want, _ = _under_inductor_with_inputs_made_in_the_graph(name, torch.float32, "cpu", monkeypatch, pad=pad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_padded_layouts_reach_the_ops_under_inductor(monkeypatch):
    # What the padded cases above exercise: RoPE's q, k, cos and sin arrive with rows padded
    # (strides the eager products do not have), so a path that assumed dense rows would fail there.
    args = [a * 1 for a in _sample("rope", torch.float32)]
    _, _, seen = _under_inductor_with_inputs_made_in_the_graph("rope", torch.float32, "cpu", monkeypatch, pad=True)
    dense = tuple(a.stride() for a in args)
    assert seen and all(s != e for s, e in zip(seen[-1], dense)), (seen, dense)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(n for n in OPS if OPS[n].flexible))
def test_gpu_op_under_inductor_takes_inputs_in_the_layout_inductor_chose(name, strict, monkeypatch):
    # The kernels (bfloat16) on the buffers inductor laid out (its default padding: these small
    # samples' strides stay unpadded), against the eager launch on the sample's own layouts; strict:
    # a launch that fell back would raise.
    got, want, _ = _under_inductor_with_inputs_made_in_the_graph(name, torch.bfloat16, "cuda", monkeypatch, d=64)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)
