"""Attention prefill tile sweep against sdpa (a microbenchmark can reject, never accept).

    python -m dev.sweeps.attention_sweep export --out .sweep-attn      # CPU: compile the candidates (sm_90)
    python -m dev.sweeps.attention_sweep run --dir .sweep-attn --json out.json   # GPU: check, then time

(from the checkout's root: the hint variants live in the ``benchmarks`` package).

Why: on the H200 our prefill kernel (one query head per block, 128 query rows x 64 keys per tile,
two warpgroups) took 127 us against sdpa's 58 us at Llama-3.2-1B's 1 x 2048 and 293 vs 52 us at
head_dim 128 (benchmarks/results/h200-2026-11-30c/attention-bench.log), which keeps
``attn_implementation="cutile"`` handing prefill to sdpa (our kernel runs it under
``"cutile_kernel"``). The candidates vary the query rows (BS) and keys (BN) per tile, the warps,
the occupancy and the cluster size; ``export`` keeps the ones tileiras compiles and lists the rest.

``run`` takes each candidate on the models' prefill shapes (q, k, v as transformers passes them:
transposed views of the projections), poisons the output with NaN, checks it against a float64
reference (every element written, error within twice sdpa's own), and times it with CUDA-graph
replays next to ``F.scaled_dot_product_attention`` (causal, GQA). FLOPs count the causal half:
``4 * B * Hq * D * S * (S + 1) / 2``.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

from cutile_kernels_tools.timing import graph_us

from dev.sweeps._common import launched, main, write_rows

#: (BS query rows, BN keys) per tile, per padded head dim.
TILES = [(64, 64), (64, 128), (128, 64), (128, 128), (256, 64), (256, 128)]
#: (module, kernel function, label): the shipped prefill kernel (8 warps on sm_90), the shipped
#: decode kernel (4 warps) and the hint variants of attention_variants.py.
FUNCTIONS = [("attention", "attention_prefill_kernel", "w8"), ("attention", "attention_kernel", "w4"),
             ("dev.sweeps.attention_variants", "attention_w8_occ2_kernel", "w8.occ2"),
             ("dev.sweeps.attention_variants", "attention_w8_cta2_kernel", "w8.cta2")]
#: (name, batch, query heads, KV heads, sequence, head_dim): the presets' prefills.
SHAPES = [("llama-3.2-1b 1x2048", 1, 32, 8, 2048, 64), ("qwen3-0.6b 1x2048", 1, 16, 8, 2048, 128),
          ("mistral-7b 1x2048", 1, 32, 8, 2048, 128), ("llama-3.2-1b 4x1024", 4, 32, 8, 1024, 64)]


def candidates():
    from cutile_kernels.kernel_src import attention
    from cutile_kernels.kernel_src._spec import VariantSpec

    out = []
    for dp in (64, 128):
        for bs, bn in TILES:
            for module, function, label in FUNCTIONS:
                consts = {"D": dp, "HB": 1, "BS": bs, "BN": bn}
                out.append(VariantSpec("attention", module, function, f"bf16.d{dp}.h1.m{bs}.n{bn}.{label}",
                                       attention._attention_params("bfloat16", consts)))
    return out


def run(sweep_dir: str, json_out: str | None) -> None:
    import torch
    import torch.nn.functional as F
    from cutile_kernels import registry
    from cutile_kernels.launcher import Launcher
    ops = importlib.import_module("cutile_kernels.ops.attention")  # the package re-exports `attention`

    reg = registry.Registry(registry.package_dir_of(Path(sweep_dir)))
    launcher = Launcher()
    torch.manual_seed(0)
    rows = []
    for name, B, hq, hkv, S, D in SHAPES:
        q = torch.randn(B, S, hq, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(B, S, hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn(B, S, hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        scale = 1.0 / math.sqrt(D)
        ref = ops.attention_reference(q.double(), k.double(), v.double(), scale=scale).double()
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        bound = 2 * (sdpa.double() - ref).abs().max().item()
        flops = 4 * B * hq * D * S * (S + 1) / 2
        us = graph_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True))
        rows.append({"shape": name, "tag": "sdpa", "us": round(us, 2), "TFLOPs": round(flops / us / 1e6, 1),
                     "max_abs_err": bound / 2})
        print(json.dumps(rows[-1]), flush=True)
        out = torch.empty(B, S, hq, D, device="cuda", dtype=torch.bfloat16)
        args = ops.launches(q, k, v, None, out, scale)[0][2]
        for variant in reg.variants("attention", "sm_90"):
            c = variant.constants
            if c["D"] != D:
                continue
            grid = (-(-S // c["BS"]), B * hq // c["HB"], 1)
            out.fill_(float("nan"))
            row = {"shape": name, "tag": variant.tag}
            if not launched(lambda v=variant, grid=grid: launcher.launch(v, grid, args, 0), row, rows):
                continue
            got = out.transpose(1, 2).double()
            row["unwritten"] = int(torch.isnan(got).sum().item())
            row["max_abs_err"] = (got - ref).abs().max().item()
            row["ok"] = row["unwritten"] == 0 and row["max_abs_err"] <= bound
            if row["ok"]:
                t = graph_us(lambda variant=variant, grid=grid: launcher.launch(variant, grid, args, 0))
                row.update(us=round(t, 2), TFLOPs=round(flops / t / 1e6, 1))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\nfastest correct candidate per shape (us; sdpa us):")
    for name, *_ in SHAPES:
        mine = [r for r in rows if r["shape"] == name and r.get("ok")]
        base = next(r for r in rows if r["shape"] == name and r["tag"] == "sdpa")
        if mine:
            best = min(mine, key=lambda r: r["us"])
            print(f"  {name}: {best['tag']} {best['us']} us ({best['TFLOPs']} TFLOP/s); sdpa {base['us']} us")
    write_rows(rows, json_out)


if __name__ == "__main__":
    main(__doc__, ".sweep-attn", candidates, run)
