"""GEMV (one-row projection) candidate sweep against cuBLAS (a microbenchmark can reject, never accept).

    python -m dev.sweeps.gemv_sweep export --out .sweep-gemv      # CPU: compile the candidates (sm_90)
    python -m dev.sweeps.gemv_sweep run --dir .sweep-gemv --json out.json   # GPU: check, then time

(from the checkout's root: the variants live in ``dev.sweeps.gemv_variants``).

Why: the shipped GEMV (``kernel_src/gemv.py``) peaks near 3 TB/s on the H200 where cuBLAS reaches
3.6-4.1 TB/s on wide weights (dev/microbench/gemv_bench.py, 2026-12-03), and in the Llama-3.2-1B
fast-path profile it is the second-largest kernel time (231 us of a 1157 us replay, o_proj and
down_proj), with the stacked q/k/v still on cuBLAS at ~2 TB/s (97 us). A one-row projection is a
stream of the weight: what limits it is the bytes each multiprocessor has in flight. The candidates
vary that: the tile, the ``latency`` hint of the weight load, a per-tile row sum (a (BN,)
accumulator, so wider tiles fit in registers), two blocks a multiprocessor, eight warps; and K split
across blocks (``gemv_splitk_kernel``, SPLITK's tiles; shipped unrouted for a session, rejected in the
model on 2026-12-07), each such candidate also launched 300 more times against its first output bit
for bit, its arrival counts back at zero; and K split statically (``gemv_split3_kernel`` over (N, SPLIT,
K / SPLIT) views of the weight and the row, so each block runs the unsplit kernel's loop, SPLIT3's tiles),
beside its stream without the hand-over (``staticpart``, a diagnostic: its partial rows are checked, it
writes no output). ``export`` with ``GEMV_SWEEP_SET=splitk`` compiles the shipped kernel's tiles
(``base``), the split kernel's loop alone (``range``) and the split ones only.

``run`` takes every candidate on the presets' projections (``gemv_bench.SHAPES``, or those of the presets
``GEMV_SWEEP_PRESETS`` names, comma-separated; each call reading
another copy of the weight so that nothing comes from L2), poisons the output with NaN, checks it
against a float64 product (relative L2 error < 4e-3 and within 1.5x F.linear's own), and times it as
CUDA-graph replays next to ``F.linear`` (cuBLAS).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cutile_kernels_tools.timing import graph_us

from dev.sweeps._common import launched, main, write_rows

#: (function, module, label, tiles, latencies): the shipped kernel first (no latency hint).
EXP = "dev.sweeps.gemv_variants"
FUNCTIONS = [
    ("gemv_kernel", "gemv", "base", ((8, 512), (16, 256), (32, 256), (16, 512)), (None,)),
    ("gemv_lat_kernel", EXP, "lat", ((8, 512), (16, 256), (16, 512)), (4, 8)),
    ("gemv_rowsum_kernel", EXP, "rowsum", ((8, 512), (8, 1024), (16, 512), (16, 1024), (32, 512)), (2, 4, 8)),
    ("gemv_rowsum_occ2_kernel", EXP, "rowsum.occ2", ((8, 512), (16, 512), (8, 1024)), (4,)),
    ("gemv_rowsum_w8_kernel", EXP, "rowsum.w8", ((16, 1024), (32, 512), (32, 1024)), (4,)),
    # The split-K kernel's loop bounds alone (no split): what its loop costs apart from the hand-over.
    ("gemv_range_kernel", EXP, "range", ((8, 512), (16, 256)), (None,)),
]
#: Split-K candidates (``gemv_splitk_kernel``): (BN, BK, SPLIT); SPLIT 1 is the unsplit grid with the
#: split kernel's partial row, count and hand-over (what they cost alone).
SPLITK = ((16, 256, 1), (8, 512, 1), (16, 256, 2), (16, 256, 4), (8, 256, 4), (16, 128, 4), (32, 256, 4),
          (16, 256, 8), (8, 512, 2), (32, 128, 4), (8, 256, 8), (16, 128, 8))
#: Launches of each split-K candidate checked one by one against its first output (bit for bit), its
#: partial rows' scratch poisoned with NaN before each: a race in the last-block hand-over shows as a
#: differing launch.
STRESS = 300
#: Static split candidates (``gemv_split3_kernel`` over (N, SPLIT, K / SPLIT) views, and its stream alone
#: without the hand-over, ``gemv_split3_part_kernel``): (BN, BK, SPLIT).
SPLIT3 = ((16, 256, 2), (16, 256, 4), (16, 128, 4), (8, 256, 4), (16, 128, 8), (32, 128, 4))


def candidates():
    from cutile_kernels.kernel_src import gemv
    from cutile_kernels.kernel_src._spec import ArrayParam, ConstParam, VariantSpec

    out = []
    only_split = os.environ.get("GEMV_SWEEP_SET") == "splitk"  # the base tiles, the split loop, the split-K ones
    for function, module, label, tiles, lats in FUNCTIONS:
        if only_split and label not in ("base", "range"):
            continue
        for bn, bk in tiles:
            for lat in lats:
                # The shipped kernel takes the PDL constant (kernel_src/_pdl.py): 0, launched as always.
                consts = {"BN": bn, "BK": bk, **({"PDL": 0} if function == "gemv_kernel" else {})}
                params = gemv._params("gemv", "bfloat16", consts)
                tag = f"bf16.bn{bn}.bk{bk}.{label}"
                if lat is not None:
                    params, tag = params + (ConstParam("LAT", lat),), f"{tag}.lat{lat}"
                out.append(VariantSpec("gemv", module, function, tag, params))
    for bn, bk, split in SPLITK:
        # gemv's arrays, then the partial rows and the arrival counts
        params = (*gemv._params("gemv", "bfloat16", {})[:3], ArrayParam("part", "float32", 2),
                  ArrayParam("count", "int32", 1), ConstParam("BN", bn), ConstParam("BK", bk),
                  ConstParam("SPLIT", split))
        out.append(VariantSpec("gemv", EXP, "gemv_splitk_kernel", f"bf16.bn{bn}.bk{bk}.splitk{split}", params))
    for bn, bk, split in SPLIT3:  # tags .static<SPLIT> and .staticpart<SPLIT>
        params = (gemv.array("x", "bfloat16", 3, "aligned"), gemv.array("weight", "bfloat16", 3, "aligned"),
                  ArrayParam("out", "bfloat16", 2), ArrayParam("part", "float32", 2), ArrayParam("count", "int32", 1),
                  ConstParam("BN", bn), ConstParam("BK", bk), ConstParam("SPLIT", split))
        for function, label in (("gemv_split3_kernel", "static"), ("gemv_split3_part_kernel", "staticpart")):
            out.append(VariantSpec("gemv", EXP, function, f"bf16.bn{bn}.bk{bk}.{label}{split}", params))
    return out


def run(sweep_dir: str, json_out: str | None) -> None:
    import torch
    import torch.nn.functional as F
    from cutile_kernels import registry
    from cutile_kernels.launcher import Launcher

    from dev.microbench.gemv_bench import SHAPES, _rotating_weights

    reg = registry.Registry(registry.package_dir_of(Path(sweep_dir)))
    launcher = Launcher()
    variants = list(reg.variants("gemv", "sm_90"))
    rows = []
    presets = os.environ.get("GEMV_SWEEP_PRESETS")  # e.g. llama-3.2-1b,qwen3-0.6b (default: every preset)
    shapes = {p: SHAPES[p] for p in presets.split(",")} if presets else SHAPES
    for preset, projections in shapes.items():
        for proj, (n, k) in projections.items():
            g = torch.Generator(device="cuda").manual_seed(0)
            ws, nxt = _rotating_weights(n, k, torch.bfloat16, g)
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
            out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ ws[0].double().T
            cublas_rel = ((F.linear(x, ws[0]).double() - ref).norm() / ref.norm()).item()
            base = {"preset": preset, "proj": proj, "N": n, "K": k, "MB": round(n * k * 2 / 1e6, 1)}
            us = graph_us(lambda: F.linear(x, nxt()), reps=11)
            rows.append({**base, "tag": "cublas", "us": round(us, 2), "TB/s": round(n * k * 2 / us / 1e6, 2)})
            print(json.dumps(rows[-1]), flush=True)
            for variant in variants:
                bn, split = variant.constants["BN"], variant.constants.get("SPLIT", 0)
                grid = (-(-n // bn), max(split, 1), 1)
                static = variant.function.startswith("gemv_split3")  # (N, SPLIT, K / SPLIT) views
                diag = variant.function == "gemv_split3_part_kernel"  # writes the partial rows alone
                row = {**base, "tag": variant.tag, **({"diagnostic": True} if diag else {})}
                if static and (k % split or (k // split) % 16):
                    rows.append({**row, "skipped": f"K {k} does not split {split} ways into multiples of 16"})
                    print(json.dumps(rows[-1]), flush=True)
                    continue
                view = (lambda t: t.view(t.shape[0], split, -1)) if static else (lambda t: t)
                extra = ()
                if split:
                    extra = (torch.empty(split, n, device="cuda", dtype=torch.float32),
                             torch.zeros(grid[0], device="cuda", dtype=torch.int32))
                out.fill_(float("nan"))
                if extra:
                    extra[0].fill_(float("nan"))
                if not launched(lambda v=variant, grid=grid, w=ws[0]: launcher.launch(
                        v, grid, (view(x), view(w), out, *extra), 0), row, rows):
                    continue
                got = extra[0].sum(0, keepdim=True).to(out.dtype) if diag else out
                rel = ((got.double() - ref).norm() / ref.norm()).item()
                row["rel"] = rel
                row["ok"] = bool(torch.isfinite(got).all()) and rel < 4e-3 and rel <= 1.5 * cublas_rel + 1e-6
                if split and row["ok"] and not diag:
                    first, bad = out.clone(), torch.zeros((), device="cuda", dtype=torch.int64)
                    for _ in range(STRESS):
                        out.fill_(float("nan"))
                        extra[0].fill_(float("nan"))  # a partial row read before it is written shows
                        launcher.launch(variant, grid, (view(x), view(ws[0]), out, *extra), 0)
                        bad += (out != first).sum()
                    row["stress_bad"] = int(bad)
                    row["count_left"] = int(extra[1].abs().sum())
                    row["ok"] = row["stress_bad"] == 0 and row["count_left"] == 0
                if row["ok"]:
                    t = graph_us(lambda v=variant, grid=grid: launcher.launch(
                        v, grid, (view(x), view(nxt()), out, *extra), 0), reps=11)
                    row.update(us=round(t, 2), **{"TB/s": round(n * k * 2 / t / 1e6, 2)})
                rows.append(row)
                print(json.dumps(row), flush=True)
            del ws
    print("\n| preset | proj | N x K (MB) | cuBLAS us (TB/s) | shipped best us | best candidate us (TB/s) |")
    print("|---|---|---|---|---|---|")
    for preset, projections in shapes.items():
        for proj in projections:
            mine = [r for r in rows if r["preset"] == preset and r["proj"] == proj]
            cub = next(r for r in mine if r["tag"] == "cublas")
            ok = [r for r in mine if r.get("ok")]
            shipped = [r for r in ok if r["tag"].endswith(".base")]
            # The part-only diagnostics compute no output: not candidates.
            best = min((r for r in ok if not r.get("diagnostic")), key=lambda r: r["us"], default=None)
            sb = min(shipped, key=lambda r: r["us"]) if shipped else None
            print(f"| {preset} | {proj} | {cub['N']} x {cub['K']} ({cub['MB']}) | {cub['us']} ({cub['TB/s']}) | "
                  f"{sb['tag'] + ' ' + str(sb['us']) if sb else '-'} | "
                  f"{best['tag'] + ' ' + str(best['us']) + ' (' + str(best['TB/s']) + ')' if best else '-'} |")
    write_rows(rows, json_out)


if __name__ == "__main__":
    main(__doc__, ".sweep-gemv", candidates, run)
