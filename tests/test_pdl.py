"""Programmatic dependent launch (``kernel_src/_pdl.py``): the build twins, the kernels' waits (the
NumPy interpreter checks that a block touches nothing the kernel before it may still write before
its wait), the launch with programmatic stream serialization (faked driver), the dispatch's choice
inside ``dispatch.programmatic_launches`` and the decode graphs' captures, on the CPU.

GPU: a generation whose decode steps are captured with PDL gives the tokens and logits of one
without, bit for bit (the same kernels in the same order; only when each may start changes)."""

from __future__ import annotations

import dataclasses
import importlib

import cutile_kernels
import pytest
import torch
from cutile_kernels import dispatch, kernel_src, launcher
from cutile_kernels.kernel_src import _pdl
from cutile_kernels.kernel_src import activation as kact
from cutile_kernels.kernel_src import gemv as kgemv
from cutile_kernels.kernel_src import norm as knorm
from cutile_kernels.kernel_src._spec import ArrayParam, ConstParam, VariantSpec
from cutile_kernels.layers import decode_graphs as dg

from cutile_numpy import UndefinedBehaviour, emulate
from families import model as tiny_model
from test_host_path import fake_gpu  # noqa: F401 - a fixture
from test_rope_append import _cache, _step
from test_qk_norm_rope import _emulate as qk_norm_rope_emulated
from test_rope_append_attention import _emulate as rope_attention_emulated

attn_ops = importlib.import_module("cutile_kernels.ops.attention")
kattn = importlib.import_module("cutile_kernels.kernel_src.attention")
kkv = importlib.import_module("cutile_kernels.kernel_src.kv_cache")

gemv_ops = importlib.import_module("cutile_kernels.ops.gemv")  # the package exports a function of that name

#: The device functions built with programmatic dependent launch twins, by kernel name: what the decode
#: steps of the Llama-code families run of ours.
TWINNED = {"gemv": "gemv_kernel", "gemv_residual": "gemv_residual_kernel", "add_rms_norm": "add_rms_norm_kernel",
           "attention": "attention_kernel",
           "rope_append_attention": "rope_append_attention_kernel", "silu_and_mul_fused": "silu_and_mul_fused_kernel",
           "kv_append": "kv_append_kernel", "qk_norm_rope": "qk_norm_rope_kernel"}


def _takes_pdl(spec: VariantSpec) -> bool:
    # Whether the spec's device function ends in a PDL constant (its variants must set it).
    code = getattr(importlib.import_module(f"cutile_kernels.kernel_src.{spec.module}"), spec.function)._pyfunc.__code__
    return code.co_varnames[code.co_argcount - 1] == "PDL"


def test_with_pdl_appends_the_constant_in_place_and_twins_after():
    a = VariantSpec("k", "m", "f_kernel", "a", (ArrayParam("x", "bfloat16", 1), ConstParam("N", 1)))
    b = dataclasses.replace(a, tag="b")
    other = dataclasses.replace(a, function="g_kernel", tag="c")
    out = _pdl.with_pdl([a, other, b], ("f_kernel",), lambda s: s.tag == "b")
    assert [(s.tag, s.constants.get("PDL")) for s in out] == [("a", 0), ("c", None), ("b", 0), ("b.pdl", 1)]
    assert out[3].params[:-1] == b.params and isinstance(out[3].params[-1], ConstParam)


def test_every_variant_of_a_pdl_kernel_sets_it_and_each_twin_follows_its_plain_variant():
    specs = kernel_src.all_variants()
    seen = {}
    for i, s in enumerate(specs):
        assert ("PDL" in s.constants) == _takes_pdl(s), (s.kernel, s.tag)
        level = s.constants.get("PDL", 0)
        if level:
            plain = s.tag.rsplit(".", 1)[0]
            j = seen.get((s.kernel, plain))
            assert j is not None and j < i, (s.kernel, s.tag)  # a request without PDL meets the plain one first
            assert specs[j].params[:-1] == s.params[:-1] and specs[j].constants["PDL"] == 0
        else:
            seen[(s.kernel, s.tag)] = i
    twinned = {s.kernel: s.function for s in specs if s.constants.get("PDL")}
    assert twinned == TWINNED
    # Twins in both 16-bit dtypes (PDL 1); none for float32 or the generic layout.
    assert {(s.kernel, s.tag.split(".")[0], s.constants["PDL"]) for s in specs if s.constants.get("PDL")} == {
        (kernel, d, 1) for kernel in TWINNED for d in ("bf16", "fp16")}
    assert not any(s.constants.get("PDL") and ".generic" in s.tag for s in specs)
    # Every GEMV tile, every decode attention tile and every one-launch RoPE + attention tile is twinned.
    for kernel in ("gemv", "attention", "rope_append_attention"):
        plain = {s.tag for s in specs if s.kernel == kernel and s.function == TWINNED[kernel]
                 and s.constants.get("PDL") == 0}
        assert {s.tag + ".pdl" for s in specs if s.tag in plain and s.kernel == kernel} <= {
            s.tag for s in specs if s.kernel == kernel and s.constants.get("PDL") == 1}


def _gemv_case(n=40, k=272):
    g = torch.Generator().manual_seed(3)
    return torch.randn(1, k, generator=g), torch.randn(n, k, generator=g)


def test_emulated_gemv_waits_before_touching_anything():
    """Its twin touches nothing before the wait and computes what the plain variant does, on N and K
    that are not multiples of the tile; the plain variant launched as a dependent is caught (the
    check is not vacuous), even where only its weight were declared readable early."""
    x, w = _gemv_case()
    run = emulate(kgemv.gemv_kernel, kgemv)
    for bn, bk in kgemv.TILES:
        grid = (-(-w.shape[0] // bn),)
        want = torch.full((1, w.shape[0]), float("nan"))
        run(grid, (x, w, want, bn, bk, 0))
        got = torch.full_like(want, float("nan"))
        run(grid, (x, w, got, bn, bk, 1), early=())
        assert torch.equal(got, want)
        torch.testing.assert_close(got[0].double(), x[0].double() @ w.double().T, rtol=1e-5, atol=1e-5)
        with pytest.raises(UndefinedBehaviour, match="before grid_dependency_control_wait"):
            run(grid, (x, w, got, bn, bk, 0), early=(1,))


def test_emulated_add_rms_norm_and_silu_and_mul_wait_first():
    g = torch.Generator().manual_seed(4)
    x, r, w = torch.randn(3, 200, generator=g), torch.randn(3, 200, generator=g), torch.randn(200, generator=g)
    outs = []
    for pdl in (0, 1):
        y, res = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
        emulate(knorm.add_rms_norm_kernel, knorm)((3,), (x, r, w, y, res, 1e-6, 256, 1, pdl),
                                                  early=() if pdl else None)
        outs.append((y, res))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    torch.testing.assert_close(outs[1][1], x + r)
    gu = torch.randn(2, 2, 700, generator=g)
    acts = []
    for pdl in (0, 1):
        out = torch.full((2, 700), float("nan"))
        emulate(kact.silu_and_mul_fused_kernel, kact)((2, 2), (gu, out, 1, 512, pdl), early=() if pdl else None)
        acts.append(out)
    assert torch.equal(*acts)
    torch.testing.assert_close(acts[1], torch.nn.functional.silu(gu[:, 0]) * gu[:, 1])


def test_emulated_rope_append_attention_waits_first():
    """The one-launch RoPE + cache write + decode attention (Llama's group of 4, two KV tiles)."""
    q, k, v, cos, sin = _step(1, 8, 2, 1, 64, seed=7, pos0=150)
    got = []
    for pdl in (0, 1):
        keys, values = _cache(1, 2, 300, 64)
        g = torch.Generator().manual_seed(1)
        keys[:, :, :150], values[:, :, :150] = torch.randn(1, 2, 150, 64, generator=g), torch.randn(1, 2, 150, 64,
                                                                                                   generator=g)
        got.append((rope_attention_emulated(q, k, v, cos, sin, keys, values, 150, 0.125, pdl=pdl), keys, values))
    for a, b in zip(*got):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def test_emulated_qwen3_step_kernels_wait_first():
    """Qwen3's decode step apart from the GEMV and norms: q/k norm + RoPE, the cache write and the
    decode attention (a group of 2, three KV tiles, and split in 3 with its combine), twins against
    plain variants."""
    g = torch.Generator().manual_seed(9)
    q, k = torch.randn(1, 4, 1, 64, generator=g), torch.randn(1, 2, 1, 64, generator=g)
    qw, kw = torch.randn(64, generator=g), torch.randn(64, generator=g)
    cos, sin = torch.randn(1, 1, 64, generator=g), torch.randn(1, 1, 64, generator=g)
    plain, twin = (qk_norm_rope_emulated(q, k, qw, kw, 1e-6, cos, sin, pdl=p) for p in (0, 1))
    assert all(torch.equal(a, b) for a, b in zip(plain, twin))

    keys, values = torch.randn(1, 2, 300, 64, generator=g), torch.randn(1, 2, 300, 64, generator=g)
    new_k, new_v = torch.randn(1, 2, 1, 64, generator=g), torch.randn(1, 2, 1, 64, generator=g)
    caches = []
    for pdl in (0, 1):
        kc, vc = keys.clone(), values.clone()
        emulate(kkv.kv_append_kernel, kkv)((1, 2), (kc, vc, new_k, new_v, torch.tensor([200]), kkv.ROWS, 64, pdl),
                                            early=() if pdl else None)
        caches.append((kc, vc))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert torch.equal(caches[1][0][:, :, 200], new_k[:, :, 0])

    for splits in (1, 3):
        outs = []
        for pdl in (0, 1):
            out = torch.full((1, 1, 4, 64), float("nan"))
            plan = attn_ops.launches(q, keys, values, None, out, 0.125, True, None, None, splits, sms=132,
                                     kv_len=torch.tensor([200]))
            assert not isinstance(plan, str), plan
            for kernel, want, args, _n, grid in plan:
                specs = [s for s in kattn.VARIANTS if s.kernel == kernel and all(s.constants[a] == b for a, b in want)
                         and s.constants.get("PDL", 0) == (pdl if kernel == "attention" else 0)]
                emulate(getattr(kattn, specs[0].function), kattn)(
                    grid(specs[0].constants), tuple(args) + tuple(specs[0].constants.values()),
                    early=() if pdl and kernel == "attention" else None)
            outs.append(out)
        assert not outs[1].isnan().any() and torch.equal(outs[0], outs[1])


class _Driver:
    """``cuda.bindings.driver`` with both launch calls recorded; the real config types."""

    def __init__(self):
        from cuda.bindings import driver as cu

        self.cu, self.calls = cu, []
        self.CUresult, self.CUstream = cu.CUresult, cu.CUstream
        self.CUlaunchAttribute, self.CUlaunchConfig, self.CUlaunchAttributeID = (
            cu.CUlaunchAttribute, cu.CUlaunchConfig, cu.CUlaunchAttributeID)

    def cuLaunchKernel(self, *args):
        self.calls.append(("cuLaunchKernel", args))
        return (self.CUresult.CUDA_SUCCESS,)

    def cuLaunchKernelEx(self, *args):
        self.calls.append(("cuLaunchKernelEx", args))
        return (self.CUresult.CUDA_SUCCESS,)


def test_a_pdl_variant_launches_with_programmatic_serialization(monkeypatch):
    pytest.importorskip("cuda.bindings")
    fake = _Driver()
    monkeypatch.setattr(launcher, "_driver", fake)
    monkeypatch.setattr(launcher, "driver", lambda: fake)
    monkeypatch.setattr(launcher, "_current_raw_stream", lambda device_index: 0x77)
    lau = launcher.Launcher()
    lau._ctx_ready.__dict__[0] = True
    def variant(pdl, arch):
        return type("V", (), {"constants": {"BN": 16, "PDL": pdl}, "symbol": f"gemv{pdl}", "arch": arch})()

    lau._launch(launcher._Loaded("fn", None, variant(1, "sm_90")), (5, 2, 1), 1234, 0)
    lau._launch(launcher._Loaded("fn", None, variant(0, "sm_90")), (5, 2, 1), 1234, 0)
    # sm_8x has no programmatic dependent launch (tileiras drops the wait there): launched plainly
    lau._launch(launcher._Loaded("fn", None, variant(1, "sm_80")), (5, 2, 1), 1234, 0)
    assert launcher._Loaded("fn", None, variant(1, "sm_120")).pdl
    (ex_name, (config, fn, params, extra)), (name, args), (name80, _) = fake.calls
    assert (ex_name, fn, params, extra) == ("cuLaunchKernelEx", "fn", 1234, 0)
    assert (config.gridDimX, config.gridDimY, config.gridDimZ, config.blockDimX, config.numAttrs) == (5, 2, 1, 1, 1)
    assert int(config.hStream) == 0x77 and config.sharedMemBytes == 0
    attr = config.attrs[0]
    assert attr.id == fake.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attr.value.programmaticStreamSerializationAllowed == 1
    assert name == name80 == "cuLaunchKernel" and args[:4] == ("fn", 5, 2, 1)


def _pdl_of(symbol: str) -> int:
    reg = dispatch._registry.registry()
    return next(v for v in reg.variants(arch="sm_90") if v.symbol == symbol).constants.get("PDL")


def _twinned_step(fake_gpu, untwinned: bool = True):
    """A decode-step-like chain on the faked GPU (a GEMV, a fused add + RMSNorm and, with ``untwinned``, an
    RMSNorm, which has no twins); returns a callable giving each launch's ``PDL`` (None: no such constant)."""
    x, w = torch.randn(1, 2048, dtype=torch.bfloat16), torch.randn(2048, 2048, dtype=torch.bfloat16)
    rows = torch.randn(1, 2048, dtype=torch.bfloat16), torch.randn(1, 2048, dtype=torch.bfloat16)
    nw = torch.randn(2048, dtype=torch.bfloat16)

    def step():
        gemv_ops.gemv_into(x, w, None, torch.empty(1, 2048, dtype=torch.bfloat16))
        cutile_kernels.add_rms_norm(*rows, nw, 1e-6)
        if untwinned:
            cutile_kernels.rms_norm(rows[0], nw, 1e-6)
        return [_pdl_of(symbol) for symbol, _ in fake_gpu[-(3 if untwinned else 2):]]
    return step


def test_dispatch_takes_twins_only_inside_programmatic_launches(fake_gpu):  # noqa: F811 - the fixture
    step = _twinned_step(fake_gpu)
    nw = torch.randn(2048, dtype=torch.bfloat16)
    assert step() == [0, 0, None]
    with dispatch.programmatic_launches():
        assert step() == [1, 1, None]
        with dispatch.programmatic_launches(False):
            assert step() == [0, 0, None]
        assert dispatch.programmatic_launches_active()
        odd = torch.randn(1, 2049, dtype=torch.bfloat16)[:, 1:]  # a misaligned row: only a generic tile fits
        cutile_kernels.add_rms_norm(odd, odd.clone(), nw, 1e-6)
        assert _pdl_of(fake_gpu[-1][0]) == 0 and not dispatch.stats()["fallbacks"]
    assert not dispatch.programmatic_launches_active() and step() == [0, 0, None]


def test_any_capture_takes_twins_with_capture_twins_on(fake_gpu, monkeypatch):  # noqa: F811 - the fixture
    """With ``CAPTURE_TWINS`` (off by default), a launch captured into a CUDA graph outside
    ``programmatic_launches`` (inductor's compiled step, a user's ``torch.cuda.graph``: faked here) takes
    its twin; not inside ``programmatic_launches(False)``; an eager launch never."""
    step = _twinned_step(fake_gpu, untwinned=False)

    assert dispatch.CAPTURE_TWINS is False  # the default
    monkeypatch.setattr(dispatch, "_capturing", lambda: True)
    assert not dispatch.twins_now() and step() == [0, 0]
    monkeypatch.setattr(dispatch, "CAPTURE_TWINS", True)
    monkeypatch.setattr(dispatch, "_capturing", lambda: False)
    assert not dispatch.twins_now() and step() == [0, 0]  # eager
    monkeypatch.setattr(dispatch, "_capturing", lambda: True)
    assert dispatch.twins_now() and step() == [1, 1]
    with dispatch.programmatic_launches(False):
        assert not dispatch.twins_now() and step() == [0, 0]
    assert dispatch.twins_now() and step() == [1, 1]  # the switch left unset again, not off
    monkeypatch.setattr(dispatch, "CAPTURE_TWINS", False)
    assert not dispatch.twins_now() and step() == [0, 0]
    with dispatch.programmatic_launches():
        assert dispatch.twins_now() and step() == [1, 1]


class _Recording:
    """A graph factory that records whether each warm-up, capture and replay ran inside
    ``programmatic_launches``."""

    seen: list = []

    @staticmethod
    def warm(fn):
        _Recording.seen.append(("warm", dispatch.programmatic_launches_active()))
        return fn()

    def capture(self, fn, owner):
        _Recording.seen.append(("capture", dispatch.programmatic_launches_active()))
        return fn()

    def replay(self):
        _Recording.seen.append(("replay", dispatch.programmatic_launches_active()))


@pytest.mark.parametrize("pdl", [False, True, None])
def test_decode_graphs_capture_with_their_setting(pdl, monkeypatch):
    """Only the capture runs inside ``programmatic_launches``: warm-up, replays and eager steps outside;
    ``pdl=None`` is the default, on unless ``CUTILE_KERNELS_PDL=0``."""
    from transformers import StaticCache

    _Recording.seen = []
    model = tiny_model("llama")
    assert dg.enable_decode_graphs(model, graph_factory=_Recording).pdl is True  # the default
    monkeypatch.setenv(dispatch.ENV_PDL, "0")
    assert dg.enable_decode_graphs(model, graph_factory=_Recording).pdl is False
    monkeypatch.setenv(dispatch.ENV_PDL, "1")
    graphs = dg.enable_decode_graphs(model, graph_factory=_Recording, pdl=pdl)
    pdl = True if pdl is None else pdl
    assert graphs.pdl is pdl
    cache = StaticCache(config=model.config, max_cache_len=32)
    with torch.inference_mode():
        nxt = model(torch.tensor([[3, 4, 5]]), past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        step = model.get_compiled_call(None)
        for _ in range(3):
            nxt = step(nxt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    assert _Recording.seen == [("warm", False), ("capture", pdl), ("replay", False), ("replay", False)]
    assert not dispatch.programmatic_launches_active()


def test_the_switch_is_per_thread_and_nests():
    import threading

    seen = []
    inside, leave = threading.Event(), threading.Event()

    def other():
        with dispatch.programmatic_launches():
            inside.set()
            leave.wait(5)
            seen.append(dispatch.programmatic_launches_active())

    t = threading.Thread(target=other)
    t.start()
    inside.wait(5)
    assert not dispatch.programmatic_launches_active()  # the other thread's switch is its own
    with dispatch.programmatic_launches():
        with dispatch.programmatic_launches(False):
            assert not dispatch.programmatic_launches_active()
        leave.set()
        t.join(5)
        assert dispatch.programmatic_launches_active()
        with pytest.raises(RuntimeError):
            with dispatch.programmatic_launches(False):
                raise RuntimeError("a failed capture")
        assert dispatch.programmatic_launches_active()
    assert seen == [True] and not dispatch.programmatic_launches_active()


# -- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "mistral"])
def test_gpu_pdl_steps_equal_plain_ones_bit_for_bit(model_type, tmp_path, strict):
    """Greedy generation over replayed decode steps captured with programmatic dependent launch and
    without: the same tokens and logits bit for bit (prompts of 1 and 37 tokens, 40 new ones: attention
    tiles crossed; Mistral's window of 24 crossed), with our GEMV (patch ``gemv``) and attention; the
    captures with it launched the twins, those without none."""
    from launches import launched_variants
    from transformers import AutoModelForCausalLM

    fields = {"sliding_window": 24} if model_type == "mistral" else {}
    tiny_model(model_type, dtype=torch.bfloat16, layers=4, **fields).save_pretrained(tmp_path)
    results, twins = [], []
    for pdl in (False, True):
        model = AutoModelForCausalLM.from_pretrained(
            tmp_path, dtype=torch.bfloat16, device_map="cuda", attn_implementation="cutile", use_kernels=True,
            kernel_config=cutile_kernels.kernel_config(decode_graphs=True)).eval()
        getattr(model, dg.ATTR).pdl = pdl
        before = dict(dispatch.stats()["launches"])
        gen = torch.Generator().manual_seed(13)
        outs = []
        for s in (1, 37):
            ids = torch.randint(1, 256, (1, s), generator=gen).cuda()
            with torch.no_grad():
                outs.append(model.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False, pad_token_id=0,
                                           output_logits=True, return_dict_in_generate=True))
        results.append(outs)
        twins.append({(v.kernel, v.constants.get("PDL")) for v in launched_variants(before) if v.constants.get("PDL")})
    for got, want in zip(results[1], results[0]):
        assert torch.equal(got.sequences, want.sequences)
        assert all(torch.equal(g, w) for g, w in zip(got.logits, want.logits))
    assert not twins[0]
    launched = {k for k, _ in twins[1]}
    assert {"gemv", "add_rms_norm", "silu_and_mul_fused"} <= launched and launched & {"attention",
                                                                                      "rope_append_attention"}, launched


@pytest.mark.gpu
def test_gpu_a_twin_reads_what_the_slow_kernel_before_it_wrote(strict, monkeypatch):
    """A race a wait in the wrong place would lose: in a captured graph, a NaN fill, then the GEMV
    twin over a wide K (~25 us: 64 tiles deep), then the fused add + RMSNorm twin reading the GEMV's
    output, which could launch as soon as the GEMV's blocks started. 50 replays on fresh inputs, each
    against the same ops run eagerly without the attribute."""
    from launches import launched_variants

    g = torch.Generator(device="cuda").manual_seed(0)
    n, k = 2048, 16384
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / 64
    residual = torch.randn(1, n, device="cuda", dtype=torch.bfloat16, generator=g)
    nw = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)

    def step():
        y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16).fill_(float("nan"))
        assert gemv_ops.gemv_into(x, w, None, y)
        return cutile_kernels.add_rms_norm(y, residual, nw, 1e-6)

    want = step()  # plain variants; also loads them
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    before = dict(dispatch.stats()["launches"])
    with torch.cuda.stream(stream), dispatch.programmatic_launches():
        got = step()  # the twins, eagerly on a side stream (they load here)
    torch.cuda.current_stream().wait_stream(stream)
    assert {(v.kernel, v.constants.get("PDL")) for v in launched_variants(before)} == {("gemv", 1),
                                                                                     ("add_rms_norm", 1)}
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), dispatch.programmatic_launches():
        out = step()
    for i in range(50):
        x.copy_(torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g))
        residual.copy_(torch.randn(1, n, device="cuda", dtype=torch.bfloat16, generator=g))
        graph.replay()
        want = step()
        assert all(torch.equal(a, b) for a, b in zip(out, want)), i
    # With CAPTURE_TWINS, a capture without our switch (a user's torch.cuda.graph, inductor's) takes them too.
    monkeypatch.setattr(dispatch, "CAPTURE_TWINS", True)
    before = dict(dispatch.stats()["launches"])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    assert {(v.kernel, v.constants.get("PDL")) for v in launched_variants(before)} == {("gemv", 1),
                                                                                     ("add_rms_norm", 1)}
    for i in range(20):
        x.copy_(torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g))
        graph.replay()
        want = step()
        assert all(torch.equal(a, b) for a, b in zip(out, want)), i


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_gpu_compiled_steps_take_twins_in_inductors_graphs(model_type, tmp_path, strict, monkeypatch):
    """A ``torch.compile(mode="reduce-overhead")`` decode step over a static cache (the bench's
    ``cutile-compile``): inductor's CUDA graphs capture our twins (``dispatch.CAPTURE_TWINS``, no
    switch of ours around them) and replay the same logits bit for bit as the step compiled with
    ``CAPTURE_TWINS`` off, which launches none."""
    from cutile_kernels_tools.bench.worker import runtime_copies
    from launches import launched_variants
    from transformers import AutoModelForCausalLM, StaticCache

    tiny_model(model_type, dtype=torch.bfloat16, layers=4).save_pretrained(tmp_path)
    logits, twins = [], []
    for on in (False, True):
        torch._dynamo.reset()
        model = AutoModelForCausalLM.from_pretrained(
            tmp_path, dtype=torch.bfloat16, device_map="cuda", use_kernels=True,
            kernel_config=cutile_kernels.kernel_config()).eval()
        for copy in runtime_copies():  # this package's dispatch and the build copy's
            monkeypatch.setattr(copy, "CAPTURE_TWINS", on)
        step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        cache = StaticCache(config=model.config, max_cache_len=64)
        ids = torch.randint(1, 256, (1, 21), generator=torch.Generator().manual_seed(5)).cuda()
        before = dict(dispatch.stats()["launches"])
        rows = []
        with torch.inference_mode():
            out = model(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(21, device="cuda"))
            nxt = out.logits[:, -1:].argmax(-1)
            for pos in range(21, 33):  # compiles, records, then replays
                pos_t = torch.tensor([pos], device="cuda")
                out = step(nxt, past_key_values=cache, use_cache=True, cache_position=pos_t)
                rows.append(out.logits[:, -1].float().cpu())
                nxt = out.logits[:, -1:].argmax(-1).clone()
        logits.append(torch.stack(rows))
        twins.append({v.kernel for v in launched_variants(before) if v.constants.get("PDL")})
    assert torch.equal(logits[0], logits[1])
    assert not twins[0] and {"gemv", "add_rms_norm"} <= twins[1], twins

