"""Several GPUs, what a CPU can check (issue 19, item 3): modules, plans and launches are per
device. A launch goes to the device of its tensors, under that device and on its current stream,
whatever the current device is; operands on two devices never reach a kernel. The driver and the
device switches are recorded instead of run (the two-GPU checks need a two-GPU machine)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import cutile_kernels
from cutile_kernels import dispatch, launcher
from cutile_kernels.cubin import ArgPacker, param_info


@pytest.fixture
def two_fake_gpus(monkeypatch, built_package_dir):
    """CPU tensors take the CUDA path; ``t._fake_device`` (default 0) is the device they are on.
    Yields the list of ("load" | "launch", device index, symbol)."""
    if "sm_90" not in dispatch._registry.registry().archs:
        pytest.skip("the build has no sm_90 variants")
    events = []
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True), raising=False)
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: getattr(self, "_fake_device", 0))
    monkeypatch.setattr(dispatch, "_arch_of", lambda device_index: ((9, 0), "sm_90"))
    monkeypatch.setattr(dispatch, "_PLANS", {})
    monkeypatch.setattr(dispatch, "_LAUNCHER", launcher.Launcher())

    def load(variant, device_index):
        events.append(("load", device_index, variant.symbol))
        packer = ArgPacker(variant.params)
        assert param_info(variant.cubin.read_bytes(), variant.symbol) == packer.layout
        return launcher._Loaded(None, packer, variant)

    def launch_values(loaded, grid, values, device_index):
        events.append(("launch", device_index, loaded.variant.symbol))

    monkeypatch.setattr(dispatch._LAUNCHER, "load", load)
    monkeypatch.setattr(dispatch._LAUNCHER, "launch_values", launch_values)
    monkeypatch.setenv(dispatch.ENV_STRICT, "1")
    monkeypatch.delenv(dispatch.ENV_DISABLE, raising=False)
    yield events


def _on(device: int, *tensors):
    for t in tensors:
        t._fake_device = device
    return tensors


def _rms_args(device: int):
    x, w, out = _on(device, torch.randn(4, 1024, dtype=torch.bfloat16), torch.randn(1024, dtype=torch.bfloat16),
                    torch.empty(4, 1024, dtype=torch.bfloat16))
    return x, w, out, 1e-6


def _run_rms_norm(args) -> bool:
    return dispatch.run("rms_norm", (), args, 2, lambda consts: (args[0].shape[0], 1, 1))


def test_each_device_gets_its_own_plan_module_and_launch(two_fake_gpus):
    assert _run_rms_norm(_rms_args(0)) and _run_rms_norm(_rms_args(1)) and _run_rms_norm(_rms_args(0))
    loads = [(d, s) for kind, d, s in two_fake_gpus if kind == "load"]
    launches = [d for kind, d, _ in two_fake_gpus if kind == "launch"]
    assert [d for d, _ in loads] == [0, 1] and loads[0][1] == loads[1][1]  # one load per device, cached
    assert launches == [0, 1, 0]
    assert len(dispatch._PLANS) == 2 and {key[7] for key in dispatch._PLANS} == {0, 1}


def test_operands_on_two_devices_never_reach_a_kernel(two_fake_gpus):
    x, w, out, eps = _rms_args(0)
    _on(1, w)
    with pytest.raises(dispatch.FallbackError, match="operands on several devices"):
        _run_rms_norm((x, w, out, eps))
    assert not [e for e in two_fake_gpus if e[0] == "launch"]


@pytest.fixture
def dtensors():
    """An RMSNorm's x ``(4, 1024)`` and weight as plain tensors and as DTensors replicated over a
    one-process CPU device mesh (gloo), as tensor parallelism makes them (issue 19, item 2). Made
    before ``two_fake_gpus`` pretends every tensor is on a GPU (list this fixture first)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    x, w = torch.randn(4, 1024, dtype=torch.bfloat16), torch.randn(1024, dtype=torch.bfloat16)
    try:
        yield x, w, distribute_tensor(x, mesh, [Replicate()]), distribute_tensor(w, mesh, [Replicate()])
    finally:
        if started:
            dist.destroy_process_group()


def test_a_dtensor_operand_never_reaches_a_kernel(dtensors, two_fake_gpus, monkeypatch, caplog):
    """A DTensor's shape is the global one and its data a shard: the op refuses it with one log line
    (an error under strict mode), launches nothing, and its reference computes on the DTensors
    (their own dispatch: the stock result); a plain call after it still launches."""
    x, w, dx, dw = dtensors
    out = torch.empty_like(x)
    with pytest.raises(dispatch.FallbackError, match="DTensor operand"):
        _run_rms_norm((dx, w, out, 1e-6))
    monkeypatch.delenv(dispatch.ENV_STRICT)
    with caplog.at_level("WARNING", logger="cutile_kernels"):
        got = cutile_kernels.rms_norm(dx, dw, 1e-6)
        again = cutile_kernels.rms_norm(dx, dw, 1e-6)
    assert caplog.text.count("DTensor operand") == 1
    assert type(got).__name__ == "DTensor" and torch.equal(again.full_tensor(), got.full_tensor())
    assert torch.equal(got.full_tensor(), cutile_kernels.rms_norm_reference(x, w, 1e-6))
    assert not [e for e in two_fake_gpus if e[0] == "launch"]
    assert _run_rms_norm(_rms_args(0)) and [e[0] for e in two_fake_gpus if e[0] == "launch"] == ["launch"]


class _FakeDriver:
    """The few ``cuda.bindings.driver`` calls the launcher makes, recorded."""

    class CUresult:
        CUDA_SUCCESS = 0

    def __init__(self):
        self.calls = []

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self.calls.append(("launch", function, stream))
        return (0,)

    def cuModuleLoadData(self, data):
        self.calls.append(("module",))
        return (0, object())

    def cuModuleGetFunction(self, module, name):
        return (0, f"function-{len(self.calls)}")


def test_the_launcher_loads_per_device_and_launches_under_the_tensors_device(monkeypatch, built_package_dir):
    variant = next(v for v in dispatch._registry.registry().variants() if v.kernel == "rms_norm" and v.arch == "sm_90")
    fake = _FakeDriver()
    switched = []
    current = {"device": 0}

    @contextlib.contextmanager
    def device(index):
        switched.append(index)
        before, current["device"] = current["device"], index
        yield
        current["device"] = before

    monkeypatch.setattr(launcher, "_driver", fake)
    monkeypatch.setattr(launcher, "driver", lambda: fake)
    monkeypatch.setattr(launcher, "param_info", lambda data, symbol: ArgPacker(variant.params).layout)
    monkeypatch.setattr(launcher.torch.cuda, "device", device)
    monkeypatch.setattr(launcher, "_current_device", lambda: current["device"])
    monkeypatch.setattr(launcher, "_current_raw_stream", lambda index: f"stream-of-{index}-under-{current['device']}")
    monkeypatch.setattr(launcher.Launcher, "_make_current", lambda self, index: None)

    launch = launcher.Launcher()
    on0, on1, again = launch.load(variant, 0), launch.load(variant, 1), launch.load(variant, 0)
    assert again is on0 and on1 is not on0 and on0.function != on1.function
    assert [c for c in fake.calls if c[0] == "module"] == [("module",)] * 2 and switched == [0, 1]
    switched.clear()
    monkeypatch.setattr(launcher._Loaded, "params_address", lambda self, values: 1234)
    launch.launch_values(on1, (1, 1, 1), [], 1)  # current device 0: switch to 1 for the launch
    launch.launch_values(on0, (1, 1, 1), [], 0)  # already current: no switch
    assert switched == [1]
    assert [c[1:] for c in fake.calls if c[0] == "launch"] == [(on1.function, "stream-of-1-under-1"),
                                                               (on0.function, "stream-of-0-under-0")]
