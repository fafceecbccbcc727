"""One-row projections (batch-1 decode): the cuTile GEMV by tile against cuBLAS (``F.linear``).

    python dev/microbench/gemv_bench.py --json gemv.json

For the projections of the presets' decoder layers as the kernelized model runs them (stacked q/k/v,
stacked gate/up, o_proj, down_proj, lm_head), one bf16 row times the weight, with every tile of
``kernel_src.gemv.TILES`` forced and with ``F.linear``, timed as CUDA-graph replays (GPU
microseconds per call). Each call reads another copy of the weight (copies totalling >= 256 MB, a
round robin), so that, as in a decode step, no weight comes from the 50 MB L2. Each tile's output is
checked first against a float64 product on an output poisoned with NaN (relative L2 error < 4e-3, and
no worse than 1.5x F.linear's own).

Then the gated MLP's down projection on the routed tile: our activation kernel
(``silu_and_mul_fused``) followed by the GEMV, two launches, against ``gemv_swiglu``, one, on the
presets' down projections that the router sends to the GEMV (the fused output checked to equal the
two launches' bit for bit first).
"""

from __future__ import annotations

import argparse
import json

#: preset -> {projection: (N, K)} as the kernelized model runs them (q/k/v and gate/up stacked).
SHAPES = {
    "llama-3.2-1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
                     "lm_head": (128256, 2048)},
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
                   "lm_head": (151936, 1024)},
    "olmo-2-1b": {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
    "gemma-2-2b": {"qkv": (4096, 2304), "o": (2304, 2048), "gate_up": (18432, 2304), "down": (2304, 9216)},
    # The 3-7B presets, whose every projection is wider than the router's 2048 (all on cuBLAS):
    # OLMo-3-7B's batch-1 fast-path step ran at ~65-70 % of the weights' read time on an H100.
    "phi-4-mini": {"qkv": (5120, 3072), "o": (3072, 3072), "gate_up": (16384, 3072), "down": (3072, 8192)},
    "olmo-3-7b": {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008),
                  "lm_head": (100278, 4096)},
}
#: Bytes of weight copies each timed case cycles through (several times the H200's 50 MB L2).
ROTATION_BYTES = 256 << 20


def _rotating_weights(n: int, k: int, dtype, g):
    """Copies of an (N, K) weight totalling >= ROTATION_BYTES (at most 64) drawn from generator ``g``,
    and ``nxt()`` handing them out round robin, so that a timed call reads its weight from HBM."""
    import torch

    copies = max(1, min(64, ROTATION_BYTES // (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k ** 0.5 for _ in range(copies)]
    it = [0]

    def nxt():
        it[0] = (it[0] + 1) % copies
        return ws[it[0]]

    return ws, nxt


def _case(preset: str, name: str, n: int, k: int, tiles, dtype_name: str):
    import torch
    import torch.nn.functional as F

    from cutile_kernels.ops.gemv import gemv_into, tile_for
    from cutile_kernels_tools.timing import graph_us

    dtype = getattr(torch, dtype_name)
    g = torch.Generator(device="cuda").manual_seed(0)
    ws, nxt = _rotating_weights(n, k, dtype, g)
    x = torch.randn(1, 1, k, device="cuda", dtype=dtype, generator=g)
    out = torch.empty(1, 1, n, device="cuda", dtype=dtype)
    ref = (x.double() @ ws[0].double().T)
    cublas_rel = ((F.linear(x, ws[0]).double() - ref).norm() / ref.norm()).item()
    row = {"preset": preset, "proj": name, "N": n, "K": k, "dtype": dtype_name, "chosen": list(tile_for(n, k) or ["cublas"]),
           "weight_MB": round(n * k * 2 / 1e6, 1), "us": {}, "rel": {}}
    row["us"]["cublas"] = round(graph_us(lambda: F.linear(x, nxt()), reps=11), 2)
    for bn, bk in tiles:
        tag = f"{bn}x{bk}"

        def launch(w, tile=(bn, bk), tag=tag):
            if not gemv_into(x, w, None, out, tile):
                raise RuntimeError(f"{preset} {name} {tag}: no gemv variant took the call")

        out.fill_(float("nan"))
        launch(ws[0])
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        if not (torch.isfinite(out).all() and rel < 4e-3 and rel <= 1.5 * cublas_rel + 1e-6):
            raise RuntimeError(f"{preset} {name} {tag}: rel {rel:.3g} to float64 (F.linear {cublas_rel:.3g})")
        row["rel"][tag] = rel
        row["us"][tag] = round(graph_us(lambda launch=launch: launch(nxt()), reps=11), 2)
    best = min((t for t in row["us"] if t != "cublas"), key=row["us"].get)
    row["best"] = best
    row["TB/s"] = {t: round(n * k * 2 / (us * 1e-6) / 1e12, 2) for t, us in row["us"].items()}
    return row


def _glu_case(preset: str, n: int, k: int, dtype_name: str):
    import torch

    from cutile_kernels.ops.activation import silu_and_mul_fused
    from cutile_kernels.ops.gemv import gemv_glu_into, gemv_into, tile_for
    from cutile_kernels_tools.timing import graph_us

    dtype = getattr(torch, dtype_name)
    tile = tile_for(n, k)
    g = torch.Generator(device="cuda").manual_seed(1)
    ws, nxt = _rotating_weights(n, k, dtype, g)
    x = torch.randn(1, 1, 2 * k, device="cuda", dtype=dtype, generator=g)
    fused = torch.full((1, 1, n), float("nan"), device="cuda", dtype=dtype)
    two = torch.full((1, 1, n), float("nan"), device="cuda", dtype=dtype)
    if not (gemv_glu_into("gemv_swiglu", x, ws[0], fused, tile) and gemv_into(silu_and_mul_fused(x), ws[0], None, two, tile)):
        raise RuntimeError(f"{preset} down: no variant took the call")
    if not (torch.isfinite(fused).all() and torch.equal(fused, two)):
        raise RuntimeError(f"{preset} down: gemv_swiglu differs from silu_and_mul_fused + gemv")
    return {"preset": preset, "N": n, "K": k, "tile": list(tile),
            "two_us": round(graph_us(lambda: gemv_into(silu_and_mul_fused(x), nxt(), None, two, tile), reps=11), 2),
            "fused_us": round(graph_us(lambda: gemv_glu_into("gemv_swiglu", x, nxt(), fused, tile), reps=11), 2)}


def main():
    from cutile_kernels.kernel_src.gemv import TILES
    from cutile_kernels.ops.gemv import tile_for

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--presets", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    args = parser.parse_args()
    rows = [_case(p, name, n, k, TILES, args.dtype) for p in args.presets for name, (n, k) in SHAPES[p].items()]
    tags = [f"{bn}x{bk}" for bn, bk in TILES]
    print("| preset | proj | N x K (MB) | cuBLAS us (TB/s) | " + " | ".join(f"{t} us" for t in tags) + " | best (TB/s) |")
    print("|---|---|---|---|" + "---|" * len(tags) + "---|")
    for r in rows:
        cells = " | ".join(f"{r['us'][t]:.2f}" for t in tags)
        print(f"| {r['preset']} | {r['proj']} | {r['N']} x {r['K']} ({r['weight_MB']}) | {r['us']['cublas']:.2f} "
              f"({r['TB/s']['cublas']}) | {cells} | {r['best']} ({r['TB/s'][r['best']]}) |")
    glu = [_glu_case(p, *SHAPES[p]["down"], args.dtype) for p in args.presets if tile_for(*SHAPES[p]["down"])]
    print("\n| preset | down N x K | tile | silu_and_mul_fused + gemv us | gemv_swiglu us |")
    print("|---|---|---|---|---|")
    for r in glu:
        print(f"| {r['preset']} | {r['N']} x {r['K']} | {r['tile'][0]}x{r['tile'][1]} | {r['two_us']:.2f} | "
              f"{r['fused_us']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gemv": rows, "glu": glu}, f, indent=1)


if __name__ == "__main__":
    main()
