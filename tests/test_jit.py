"""The JIT fallback: with no prebuilt variant and tileiras installed, cuda.tile compiles the kernel
(GPU with a JIT toolchain only; the marker skips elsewhere)."""

from __future__ import annotations

import pytest
import torch

import cutile_kernels
from cutile_kernels import dispatch, registry


@pytest.fixture
def no_build(monkeypatch):
    monkeypatch.setattr(registry, "registry", lambda: registry.Registry(None))
    saved = dict(dispatch._PLANS)
    dispatch._PLANS.clear()
    yield
    dispatch._PLANS.clear()
    dispatch._PLANS.update(saved)


def _rel_l2(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.gpu_jit
@pytest.mark.parametrize("rows,hidden,dtype", [(37, 1536, torch.bfloat16), (5, 896, torch.float16),
                                               (3, 12288, torch.float32)])
def test_jit_compiles_when_no_prebuilt_variant_fits(rows, hidden, dtype, no_build, strict):
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    r = torch.randn_like(x)
    w = (1 + 0.2 * torch.randn(hidden, device="cuda")).to(dtype)
    before = dict(dispatch.stats()["jit_launches"])
    y = cutile_kernels.rms_norm(x, w, 1e-6)
    y2, s = cutile_kernels.add_rms_norm(x, r, w, 1e-6)
    after = dispatch.stats()["jit_launches"]
    assert after.get("rms_norm", 0) == before.get("rms_norm", 0) + 1
    assert after.get("add_rms_norm", 0) == before.get("add_rms_norm", 0) + 1
    xd, wd = x.double(), w.double()
    exact = wd * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6))
    stock = cutile_kernels.rms_norm_reference(x, w, 1e-6)
    assert _rel_l2(y, exact) <= 1.1 * _rel_l2(stock, exact) + 1e-7
    assert torch.equal(s, x + r)
    sd = s.double()
    exact2 = wd * (sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert _rel_l2(y2, exact2) <= 1.1 * _rel_l2(cutile_kernels.rms_norm_reference(s, w, 1e-6), exact2) + 1e-7


def test_jit_can_be_switched_off(monkeypatch):
    for value in ("0", "false", "off", "no"):
        monkeypatch.setenv(dispatch.ENV_JIT, value)
        assert dispatch.jit_available() is False
