"""Decode attention tile sweep over a static cache (a microbenchmark can reject, never accept).

    python -m dev.sweeps.decode_attention_sweep export --out .sweep-decode   # CPU: compile the candidates (sm_90)
    python -m dev.sweeps.decode_attention_sweep run --dir .sweep-decode --json out.json   # GPU: check, then time

Why: in the Llama-3.2-1B fast-path profile (H200, 2026-12-03) the decode attention took 8.0 us a
layer at batch 1 over ~150 filled slots: 8 blocks (one per KV head, its four query heads packed),
two KV tiles of 128 keys each, a chain of dependent loads rather than a bandwidth limit. The
candidates vary the keys per tile (BN 64, 128, 256: one tile covers 256 keys, fewer round trips)
and the warps (4, 8), on the query-head packing (HB) the shipped router picks for each model.

``run`` builds, for the presets' head layouts, a bf16 static cache with ``filled`` of its ``slots``
written (the length read on the device, as the fast path passes it), poisons the output with NaN,
checks each candidate against float32 attention over the filled keys (relative L2 < 1e-2), and times
it as CUDA-graph replays: one split, and the router's split count where it chooses more than one
(the shipped combine kernel then runs after the candidate).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from cutile_kernels_tools.timing import graph_us

from dev.sweeps._common import main, write_rows

#: (function, module, label, extra constants). Eight warps (``attention_w8_kernel``) lost at every
#: shape on 2026-12-04; the loads issued ahead (``attention_pf_kernel``, with and without TMA) are
#: the candidates now.
FUNCTIONS = [("attention_kernel", "attention", "w4", {"PDL": 0}),  # the shipped kernel, launched as always
             ("attention_pf_kernel", "dev.sweeps.attention_variants", "pf1", {"TMA": 1}),
             ("attention_pf_kernel", "dev.sweeps.attention_variants", "pf0", {"TMA": 0})]
BNS = (64, 128, 256)
#: preset -> (query heads, KV heads, head_dim)
SHAPES = {"llama-3.2-1b": (32, 8, 64), "qwen3-0.6b": (16, 8, 128), "phi-4-mini": (24, 8, 128),
          "olmo-2-1b": (16, 16, 128)}
#: (filled, slots) of the static cache
LENGTHS = ((150, 169), (700, 1024), (3000, 4096))


def candidates():
    from cutile_kernels.kernel_src import attention
    from cutile_kernels.kernel_src._spec import VariantSpec

    out = []
    for dp in (64, 128):
        for hb in attention.DECODE_HEADS:
            for bn in BNS:
                for function, module, label, extra in FUNCTIONS:
                    consts = {"D": dp, "HB": hb, "BS": attention.DECODE_ROWS // hb, "BN": bn, **extra}
                    out.append(VariantSpec("attention", module, function,
                                           f"bf16.d{dp}.h{hb}.m{consts['BS']}.n{bn}.{label}",
                                           attention._attention_params("bfloat16", consts)))
    return out


def run(sweep_dir: str, json_out: str | None) -> None:
    import torch
    from cutile_kernels import dispatch, registry
    from cutile_kernels.launcher import Launcher

    from dev.microbench.decode_splits import decode_inputs
    ops = importlib.import_module("cutile_kernels.ops.attention")  # the module; ops.attention is the op

    reg = registry.Registry(registry.package_dir_of(Path(sweep_dir)))
    launcher = Launcher()
    variants = list(reg.variants("attention", "sm_90"))
    rows = []
    for preset, (hq, hkv, D) in SHAPES.items():
        dp = ops.tiles_for(D, 1, hq // hkv)[0]
        for B in (1, 16):
            for filled, slots in LENGTHS:
                q, k, v, n, scale, ref, out = decode_inputs(B, hq, hkv, D, slots, filled)
                auto = ops.launches(q, k, v, None, out, scale, True, kv_len=n)[0][2][-1]
                base = {"preset": preset, "B": B, "filled": filled, "slots": slots, "auto_splits": auto}
                for splits in sorted({1, auto}):
                    plan = ops.launches(q, k, v, None, out, scale, True, splits=splits, kv_len=n)
                    args = plan[0][2]
                    hb_shipped = dict(plan[0][1])["HB"]  # a group no HB divides runs padded (ops.padded_heads)
                    shipped = f".h{hb_shipped}.m{16 // hb_shipped}.n{ops.decode_bn(dp, slots, splits)}.w4"  # the router's
                    for variant in variants:
                        c = variant.constants
                        if c["D"] != D or c["HB"] != hb_shipped:
                            continue
                        grid = (splits, args[0].shape[0] * -(-args[0].shape[1] // c["HB"]), 1)

                        def call(variant=variant, grid=grid, args=args, plan=plan):
                            launcher.launch(variant, grid, args, 0)
                            for step in plan[1:]:
                                dispatch.run(*step)

                        row = {**base, "splits": splits, "tag": variant.tag, "shipped": variant.tag.endswith(shipped)}
                        out.fill_(float("nan"))
                        call()
                        got = out.transpose(1, 2).float()
                        row["rel"] = ((got - ref).norm() / ref.norm()).item()
                        row["ok"] = bool(torch.isfinite(got).all()) and row["rel"] < 1e-2
                        if row["ok"]:
                            row["us"] = round(graph_us(call, reps=11), 2)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    print("\n| preset | B | filled/slots | splits | the router's tile us | best candidate us |")
    print("|---|---|---|---|---|---|")
    keys = sorted({(r["preset"], r["B"], r["filled"], r["slots"], r["splits"]) for r in rows},
                  key=lambda t: (list(SHAPES).index(t[0]), t[1:]))
    for key in keys:
        mine = [r for r in rows if (r["preset"], r["B"], r["filled"], r["slots"], r["splits"]) == key and r.get("ok")]
        if not mine:
            continue
        ship = [r for r in mine if r["shipped"]]
        best = min(mine, key=lambda r: r["us"])
        print(f"| {key[0]} | {key[1]} | {key[2]}/{key[3]} | {key[4]} | {ship[0]['us'] if ship else '-'} | "
              f"{best['tag']} {best['us']} |")
    write_rows(rows, json_out)


if __name__ == "__main__":
    main(__doc__, ".sweep-decode", candidates, run)
