"""RMSNorm tile-config sweep and microbenchmark (a microbenchmark can reject, never accept).

    python dev/sweeps/norm_sweep.py export --out .sweep            # CPU: compile candidates (sm_90)
    python dev/sweeps/norm_sweep.py run --dir .sweep --json out.json  # GPU: check, then time

``NORM_SWEEP_SHAPES`` / ``NORM_SWEEP_KINDS`` run a subset (see :func:`subset`); on the device,
``benchmarks/device_session.sh normsweep`` runs the export carried as ``.device/norm-sweep.tgz``.

Each candidate is checked against a float64 reference on fresh random inputs (output poisoned with
NaN first), then timed with CUDA events (median of repeats after warm-up). Bandwidth counts the
bytes that must move: x read once, y written once, weight read once (residual read and written
once more for the fused op).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from cutile_kernels_tools.timing import graph_us


def sweep_specs():
    from cutile_kernels.kernel_src import norm
    from cutile_kernels.kernel_src._spec import VariantSpec

    def spec(kind, function, bn, rows, layout="aligned", module="norm", label=""):
        consts = {"BLOCK_N": bn, "ROWS": rows}
        if function in ("add_rms_norm_kernel", "add_rms_norm_w8_kernel"):  # the shipped code (w8: other hints)
            consts["PDL"] = 0  # its programmatic dependent launch constant (kernel_src/_pdl.py): launched as always
        return VariantSpec(kind, module, function, f"bf16.n{bn}.r{rows}.{layout}{label}",
                           norm._params(kind, "bfloat16", layout, consts))

    exp = "dev.sweeps.norm_variants"
    specs = []
    grid = {4096: (1, 2, 4, 8), 2048: (2, 4, 8, 16), 1024: (4, 8, 16, 32), 128: (64, 128, 256)}
    for fn, module, label in [("rms_norm_kernel", "norm", ""), ("rms_norm_w8_kernel", exp, ".w8"),
                              ("rms_norm_occ4_kernel", exp, ".occ4"), ("rms_norm_notma_kernel", exp, ".notma"),
                              ("rms_norm_notma_w8_kernel", exp, ".notma.w8"),
                              ("rms_norm_persistent_kernel", exp, ".persistent"),
                              ("rms_norm_persistent_w8_kernel", exp, ".persistent.w8")]:
        for bn, rs in grid.items():
            for r in rs:
                specs.append(spec("rms_norm", fn, bn, r, module=module, label=label))
    # One and two rows a block too: at a few hundred rows (a 512-token prefill) the shipped 16-row tile
    # at 2048 wide gives 32 blocks, and ran 8.5 us against 5.8 for rms_norm + an add (H200, 2026-12-05).
    for fn, module, label in [("add_rms_norm_kernel", "norm", ""), ("add_rms_norm_w8_kernel", exp, ".w8")]:
        for bn, rs in ((4096, (1, 2, 4, 8)), (2048, (1, 2, 4, 8, 16)), (1024, (8, 16, 32))):
            for r in rs:
                specs.append(spec("add_rms_norm", fn, bn, r, module=module, label=label))
    return specs


def export(out: str) -> None:
    from cutile_kernels_build import build

    m = build(out, archs=["sm_90"], specs=sweep_specs())
    print(m["build_stats"])




KINDS = ("rms_norm", "add_rms_norm")


def subset(shapes: list, shapes_env: str, kinds_env: str) -> tuple[list, tuple]:
    """The ``(rows, width)`` shapes and kernels a run times: all, or those named by
    ``NORM_SWEEP_SHAPES`` (comma-separated ``ROWSxWIDTH``, e.g. ``512x2048,512x3072``) and
    ``NORM_SWEEP_KINDS`` (``rms_norm``, ``add_rms_norm``).

    Raises:
        SystemExit: a name that is no shape or kernel of the sweep.
    """
    want = [w.strip() for w in shapes_env.split(",") if w.strip()]
    names = {f"{m}x{n}": (m, n) for m, n in shapes}
    if any(w not in names for w in want):
        raise SystemExit(f"NORM_SWEEP_SHAPES={want}: the sweep's shapes are {list(names)}")
    kinds = tuple(k.strip() for k in kinds_env.split(",") if k.strip()) or KINDS
    if any(k not in KINDS for k in kinds):
        raise SystemExit(f"NORM_SWEEP_KINDS={list(kinds)}: the sweep's kernels are {list(KINDS)}")
    return ([names[w] for w in want] if want else shapes), kinds


def run(sweep_dir: str, json_out: str | None) -> None:
    import torch
    from cutile_kernels import ops, registry
    from cutile_kernels.kernel_src._spec import next_power_of_2
    from cutile_kernels.launcher import Launcher

    reg = registry.Registry(registry.package_dir_of(Path(sweep_dir)))
    launcher = Launcher()
    torch.manual_seed(0)
    results = []
    shapes = [(8192, 4096), (2048, 2048), (16384, 2048), (2048, 1024), (32768, 1024), (16, 2048),
              (65536, 128), (32768, 128), (512, 2048), (1024, 2048), (512, 3072)]
    shapes, kinds = subset(shapes, os.environ.get("NORM_SWEEP_SHAPES", ""), os.environ.get("NORM_SWEEP_KINDS", ""))
    for m, n in shapes:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        w = (1 + 0.1 * torch.randn(n, device="cuda")).to(torch.bfloat16)
        ref = ops.rms_norm_reference(x.double(), w.double(), 1e-6)
        ref_s = x.double() + r.double()
        for kind in kinds:
            bytes_moved = (2 * m * n + n) * 2 if kind == "rms_norm" else (5 * m * n + n) * 2
            # bf16 variants only (the inputs'): a shipped build's fp16/fp32 variants would read them as another dtype
            cands = [v for v in reg.variants(kind, "sm_90") if v.constants.get("BLOCK_N") == next_power_of_2(n)
                     and v.tag.startswith("bf16.")]
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
                us = graph_us(fn)
                row = {"kernel": kind, "tag": v.tag, "m": m, "n": n, "max_abs_err": err,
                       "nan": bool(torch.isnan(y).any()), "us": round(us, 2),
                       "GBps": round(bytes_moved / us / 1e3, 1)}
                results.append(row)
                print(json.dumps(row), flush=True)
            if kind == "rms_norm":
                for name, fn in [("torch_eager_reference", lambda: ops.rms_norm_reference(x, w, 1e-6)),
                                 ("F.rms_norm", lambda: torch.nn.functional.rms_norm(x, (n,), w, 1e-6))]:
                    us = graph_us(fn)
                    row = {"kernel": kind, "tag": name, "m": m, "n": n, "us": round(us, 2),
                           "GBps": round(bytes_moved / us / 1e3, 1)}
                    results.append(row)
                    print(json.dumps(row), flush=True)
    results += host_overhead()
    if json_out:
        Path(json_out).write_text(json.dumps(results, indent=1))


def headline(json_out: str | None = None) -> list:
    """The shipped build through the public ops against torch, on model-sized inputs: median
    microseconds per call (graph replays), two input sets alternating so that repeated calls do not
    hit L2, and bandwidth over the bytes that must move (inputs read once, outputs written once)."""
    import cutile_kernels
    import torch

    rows = []
    for m, n in [(8192, 4096), (2048, 2048), (2048, 1024), (16384, 2048), (65536, 128), (4096, 896), (4096, 5120)]:
        xs = [torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        rs = [torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        w = (1 + 0.1 * torch.randn(n, device="cuda")).to(torch.bfloat16)
        it = {"i": 0}

        def alt(f):
            def call():
                it["i"] ^= 1
                return f(it["i"])
            return call

        cases = [
            ("rms_norm", "cutile", (2 * m * n + n) * 2, alt(lambda i: cutile_kernels.rms_norm(xs[i], w, 1e-6))),
            ("rms_norm", "F.rms_norm", (2 * m * n + n) * 2,
             alt(lambda i: torch.nn.functional.rms_norm(xs[i], (n,), w, 1e-6))),
            ("rms_norm", "hf_eager", (2 * m * n + n) * 2, alt(lambda i: cutile_kernels.rms_norm_reference(xs[i], w, 1e-6))),
            ("add_rms_norm", "cutile", (5 * m * n + n) * 2,
             alt(lambda i: cutile_kernels.add_rms_norm(xs[i], rs[i], w, 1e-6))),
            ("add_rms_norm", "hf_eager", (5 * m * n + n) * 2,
             alt(lambda i: cutile_kernels.add_rms_norm_reference(xs[i], rs[i], w, 1e-6))),
        ]
        for op, impl, nbytes, fn in cases:
            us = graph_us(fn)
            row = {"headline": op, "impl": impl, "m": m, "n": n, "bytes": nbytes, "us": round(us, 2),
                   "GBps": round(nbytes / us / 1e3, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if json_out:
        Path(json_out).write_text(json.dumps(rows, indent=1))
    return rows


def host_overhead(calls: int = 2000):
    """Wall-clock microseconds per call on a decode-sized input (1 x 2048 bf16), where the
    host-side cost dominates, split into its parts: the public op, the dispatch into a preallocated
    output, the cuda-python launch of a pre-packed variant, and torch baselines."""
    import time

    import cutile_kernels
    import torch
    from cutile_kernels import dispatch
    from cutile_kernels.ops import norm

    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    dispatch._PLANS.clear()
    cutile_kernels.rms_norm(x, w, 1e-6)  # the op's plan for this signature (its tile and layout)
    plan = next(p for k, p in dispatch._PLANS.items() if k[0] == "rms_norm")
    values = list(plan.values)
    for slot, i in plan.ptr_slots:
        values[slot] = (x, w, y)[i].data_ptr()
    for slot, i in plan.scalar_slots:
        values[slot] = 1e-6
    launcher = dispatch._LAUNCHER
    rows = []
    for name, fn in [("cutile_kernels.rms_norm", lambda: cutile_kernels.rms_norm(x, w, 1e-6)),
                     ("rms_norm_into (dispatch.run)", lambda: norm.rms_norm_into(x, w, y, 1e-6)),
                     ("launcher.launch_values (pre-packed)", lambda: launcher.launch_values(plan.loaded, plan.grid, values, 0)),
                     ("dispatch._signature", lambda: dispatch._signature("rms_norm", (("BLOCK_N", 2048),), (x, w, y, 1e-6))),
                     ("torch.empty", lambda: torch.empty((1, 2048), device="cuda", dtype=torch.bfloat16)),
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


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("--out", default=".sweep")
    r = sub.add_parser("run")
    r.add_argument("--dir", default=".sweep")
    r.add_argument("--json")
    h = sub.add_parser("headline", help="the shipped build vs torch, plus host overhead")
    h.add_argument("--json")
    a = p.parse_args()
    if a.cmd == "export":
        export(a.out)
    elif a.cmd == "run":
        run(a.dir, a.json)
    else:
        headline(a.json)
        host_overhead()
    sys.exit(0)
