"""RMSNorm tile-config sweep and microbenchmark (a microbenchmark can reject, never accept).

    python benchmarks/norm_sweep.py export --out .sweep            # CPU: compile candidates (sm_90)
    python benchmarks/norm_sweep.py run --dir .sweep --json out.json  # GPU: check, then time

Each candidate is checked against a float64 reference on fresh random inputs (output poisoned with
NaN first), then timed with CUDA events (median of repeats after warm-up). Bandwidth counts the
bytes that must move: x read once, y written once, weight read once (residual read and written
once more for the fused op).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def sweep_specs():
    from cutile_kernels.kernel_src import norm
    from cutile_kernels.kernel_src._spec import VariantSpec

    def spec(kind, function, bn, rows, layout="aligned", module="norm", label=""):
        consts = {"BLOCK_N": bn, "ROWS": rows}
        return VariantSpec(kind, module, function, f"bf16.n{bn}.r{rows}.{layout}{label}",
                           norm._params(kind, "bfloat16", layout, consts))

    exp = "benchmarks.norm_variants"
    rows = {8192: (1, 2, 4, 8), 4096: (1, 2, 4, 8, 16), 2048: (2, 4, 8, 16, 32), 1024: (4, 8, 16, 32),
            128: (32, 64, 128, 256)}
    specs = [spec("rms_norm", "rms_norm_kernel", bn, r) for bn, rs in rows.items() for r in rs]
    specs += [spec("rms_norm", "rms_norm_kernel", 4096, r, "generic") for r in (1, 4, 8)]
    specs += [spec("rms_norm", "rms_norm_notma_kernel", bn, r, module=exp, label=".notma")
              for bn, rs in ((4096, (1, 4, 8)), (2048, (8, 16)), (1024, (16, 32))) for r in rs]
    specs += [spec("rms_norm", "rms_norm_persistent_kernel", bn, r, module=exp, label=".persistent")
              for bn, rs in ((4096, (1, 2, 4)), (2048, (4, 8)), (1024, (16,))) for r in rs]
    specs += [spec("add_rms_norm", "add_rms_norm_kernel", bn, r) for bn, rs in ((4096, (2, 4, 8)), (2048, (4, 8, 16)))
              for r in rs]
    return specs


def export(out: str) -> None:
    from cutile_kernels_build import build

    m = build(out, archs=["sm_90"], specs=sweep_specs())
    print(m["build_stats"])


def _time(fn, reps=50, warmup=5):
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


def run(sweep_dir: str, json_out: str | None) -> None:
    import torch

    from cutile_kernels import ops, registry
    from cutile_kernels.launcher import Launcher

    reg = registry.Registry(registry.package_dir_of(Path(sweep_dir)))
    launcher = Launcher()
    torch.manual_seed(0)
    results = []
    shapes = [(8192, 4096), (16384, 4096), (4096, 2048), (16384, 2048), (2048, 2048), (16, 2048),
              (32768, 1024), (65536, 128), (2048, 8192)]
    for m, n in shapes:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        w = (1 + 0.1 * torch.randn(n, device="cuda")).to(torch.bfloat16)
        ref = ops.rms_norm_reference(x.double(), w.double(), 1e-6)
        ref_s = x.double() + r.double()
        for kind in ("rms_norm", "add_rms_norm"):
            bytes_moved = (2 * m * n + n) * 2 if kind == "rms_norm" else (5 * m * n + n) * 2
            cands = [v for v in reg.variants(kind, "sm_90") if v.constants.get("BLOCK_N") == registry_bn(n)]
            for v in cands:
                y = torch.full_like(x, float("nan"))
                s = torch.full_like(x, float("nan"))
                consts = v.constants
                tiles = (m + consts["ROWS"] - 1) // consts["ROWS"]
                grid = (min(tiles, 132 * 8) if "persistent" in v.function else tiles, 1, 1)
                args = (x, w, y, 1e-6) if kind == "rms_norm" else (x, r, w, y, s, 1e-6)
                fn = (lambda v=v, grid=grid, args=args: launcher.launch(v, grid, args, 0))
                fn()
                torch.cuda.synchronize()
                want = ref if kind == "rms_norm" else ops.rms_norm_reference(ref_s.to(torch.bfloat16).double(), w.double(), 1e-6)
                err = (y.double() - want).abs().max().item()
                us = _time(fn)
                row = {"kernel": kind, "tag": v.tag, "m": m, "n": n, "max_abs_err": err,
                       "nan": bool(torch.isnan(y).any()), "us": round(us, 2),
                       "GBps": round(bytes_moved / us / 1e3, 1)}
                results.append(row)
                print(json.dumps(row), flush=True)
            if kind == "rms_norm":
                for name, fn in [("torch_eager_reference", lambda: ops.rms_norm_reference(x, w, 1e-6)),
                                 ("F.rms_norm", lambda: torch.nn.functional.rms_norm(x, (n,), w, 1e-6))]:
                    us = _time(fn)
                    row = {"kernel": kind, "tag": name, "m": m, "n": n, "us": round(us, 2),
                           "GBps": round(bytes_moved / us / 1e3, 1)}
                    results.append(row)
                    print(json.dumps(row), flush=True)
    results += host_overhead()
    if json_out:
        Path(json_out).write_text(json.dumps(results, indent=1))


def host_overhead(calls: int = 2000):
    """Wall-clock microseconds per call on a decode-sized input (1 x 2048 bf16), where the
    host-side cost (dispatch, checks, packing, launch) dominates the GPU time."""
    import time

    import torch

    import cutile_kernels

    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    rows = []
    for name, fn in [("cutile_kernels.rms_norm", lambda: cutile_kernels.rms_norm(x, w, 1e-6)),
                     ("torch_eager_reference", lambda: cutile_kernels.rms_norm_reference(x, w, 1e-6)),
                     ("F.rms_norm", lambda: torch.nn.functional.rms_norm(x, (2048,), w, 1e-6))]:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        row = {"host_overhead": name, "us_per_call": round((time.perf_counter() - t0) / calls * 1e6, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def registry_bn(n: int) -> int:
    from cutile_kernels.kernel_src._spec import next_power_of_2

    return next_power_of_2(n)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("--out", default=".sweep")
    r = sub.add_parser("run")
    r.add_argument("--dir", default=".sweep")
    r.add_argument("--json")
    a = p.parse_args()
    if a.cmd == "export":
        export(a.out)
    else:
        run(a.dir, a.json)
    sys.exit(0)
