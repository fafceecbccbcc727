"""Shared fixtures. GPU tests carry ``@pytest.mark.gpu`` and skip cleanly without a CUDA device
or without a build that has cubins for its arch; CPU tests run everywhere."""

from __future__ import annotations

import os

import pytest
import torch


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    from cutile_kernels import registry

    reg = registry.registry()
    if reg.pkg_dir is None:
        return "no cuTile build (run `cutile-kernels build`)"
    if reg.arch_for(torch.cuda.get_device_capability()) is None:
        return f"the build has no cubins for this GPU (built: {reg.archs})"
    return None


def _jit_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    from cutile_kernels import dispatch

    return None if dispatch.jit_available() else "no cuTile JIT toolchain (tileiras)"


def pytest_collection_modifyitems(config, items):
    reasons = {}
    for item in items:
        for marker, why in (("gpu", _gpu_skip_reason), ("gpu_jit", _jit_skip_reason)):
            if marker in item.keywords:
                if marker not in reasons:
                    reasons[marker] = why() or ""
                if reasons[marker]:
                    item.add_marker(pytest.mark.skip(reason=reasons[marker]))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test that compiles kernels ahead of time skips, naming the install, where the build
    toolchain (the ``build`` extra's tileiras) is missing; as GPU tests skip without a GPU. The
    README's test command installs it, and ``.ci/run`` fails at its build step without it."""
    try:
        return (yield)
    except Exception as exc:
        if type(exc).__name__ == "ToolchainMissing" and type(exc).__module__.endswith(".aot"):
            pytest.skip(str(exc))
        raise


@pytest.fixture
def strict(monkeypatch):
    """Make every fallback raise, so a GPU test proves that a cuTile kernel ran."""
    monkeypatch.setenv("CUTILE_KERNELS_STRICT", "1")
    yield


@pytest.fixture(scope="session")
def built_package_dir():
    """The package directory of the build the tests use (skips if there is none)."""
    from cutile_kernels import registry

    pkg = registry.find_package_dir()
    if pkg is None:
        pytest.skip("no cuTile build (run `cutile-kernels build`)")
    return pkg


#: Fresh random inputs on every run; CUTILE_TEST_SEED=<n> reproduces a failing one.
SEED = int(os.environ.get("CUTILE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))


def pytest_report_header(config):
    return f"cutile-kernels test seed: CUTILE_TEST_SEED={SEED}"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(SEED)
    yield


@pytest.fixture
def change_pin(monkeypatch):
    """``change_pin(name)``: act as a transformers release whose pinned function ``name``
    (``layers/_pins.py``) has other statements than the pinned ones."""
    import dataclasses

    from cutile_kernels.layers import _pins

    def change(name: str) -> None:
        monkeypatch.setitem(_pins.PINS, name, dataclasses.replace(_pins.PINS[name], digest="0" * 16))

    return change


@pytest.fixture
def stock_functions():
    """kernelize rebinds the forwards of Qwen3.5's hub-function modules for the whole process (an
    earlier test of this process may have): transformers' own functions before the test and after.
    Where transformers calls flash-linear-attention or causal-conv1d, our prefill layers leave it
    the call: these tests of our kernels skip."""
    pytest.importorskip("transformers")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q35

    from cutile_kernels.layers.gated_delta import FUNCTIONS, runs_its_package

    funcs = [getattr(q35, name) for name in FUNCTIONS.values()]
    if any(runs_its_package(type(f)) for f in funcs):
        pytest.skip("transformers calls flash-linear-attention or causal-conv1d here: our prefill layers leave it")

    def restore():
        for f in funcs:
            f.__dict__.pop("forward", None)

    restore()
    yield
    restore()
