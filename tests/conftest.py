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
