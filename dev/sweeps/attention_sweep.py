"""Attention prefill tile sweep against sdpa (a microbenchmark can reject, never accept).

    python -m dev.sweeps.attention_sweep export --out .sweep-attn      # CPU: compile the candidates (sm_90)
    python -m dev.sweeps.attention_sweep run --dir .sweep-attn --json out.json   # GPU: check, then time

(from the checkout's root: the hint variants live in the ``benchmarks`` package).

Why: on the H200 our prefill kernel (one query head per block, 128 query rows x 64 keys per tile,
two warpgroups) took 127 us against sdpa's 58 us at Llama-3.2-1B's 1 x 2048 and 293 vs 52 us at
head_dim 128 (benchmarks/results/h200-2026-11-30c/attention-bench.log), which keeps
``attn_implementation="cutile"`` handing prefill to sdpa (our kernel runs it under
``"cutile_kernel"``), and with it the prefill coverage of issue 17 (60 % of the non-GEMM time is
met with our prefill attention, not without it). The shipped loop decides per KV tile whether to
run it (a mask tensor may hide it) and whether to mask it; the ``pf2`` candidates
(attention_variants.py) run a call without a mask tensor as three loops with no decision inside,
with latency hints on the K and V loads, and vary the query rows (BS), keys (BN), heads packed per
block (HB), warps, occupancy and cluster size. ``export`` keeps the ones tileiras compiles and
lists the rest.

``run`` takes each candidate on the models' prefill shapes (q, k, v as transformers passes them:
transposed views of the projections; causal, GQA; Gemma 3's window, Gemma 2's window and
softcap), poisons the output with NaN, checks it against a float64 reference (every element
written, error within twice stock's own), and times it with CUDA-graph replays next to what stock
runs there: ``F.scaled_dot_product_attention`` (``is_causal``, or the boolean mask transformers
builds for a window) or, with a softcap, transformers' eager attention. A window shape without a
softcap also runs each tile on that boolean mask alone (tag suffix ``.mask``): the kernel's mask path
on a sliding layer's prefill (H200 2026-12-05, Gemma-3-1B 1 x 2048: 175-233 us against sdpa's 132,
so ``attention.route`` keeps such prefills on sdpa). FLOPs count the visible (query, key) pairs:
``4 * B * Hq * D * pairs``.

On the H200 (2026-12-05) a row takes about a second, but one candidate after pf2's 64 x 128 row
never returned (not known which): ``ATTENTION_SWEEP_WATCHDOG=<seconds>`` prints where the process
waits and ends it. ``ATTENTION_SWEEP_SHAPES`` (comma-separated substrings of the shape names, e.g.
``qwen3-0.6b 1x2048,gemma-3``) and ``ATTENTION_SWEEP_TAGS`` (substrings of variant tags, e.g.
``pf3``) run a subset, and every row that launched carries ``elapsed_s`` (seconds since ``run``
started), ``first_launch_s`` and ``timing_s`` (its first launch, the cubin's load included, and its
timing). A candidate whose heads a block would span two KV heads is skipped.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import math
import os
import time
from pathlib import Path

from cutile_kernels_tools.timing import graph_us

from dev.sweeps._common import launched, main, write_rows

V = "dev.sweeps.attention_variants"
#: (padded head dim, HB, BS, BN, module, kernel function, label, extra constants): the shipped
#: prefill kernel (8 warps on sm_90) at its tiles and the pipelined candidates of
#: attention_variants.py (``pf2``: three loops, latency hints (LAT), heavy query blocks first (REV);
#: ``nolat`` without the hints, ``fwd`` in block order; ``pf3`` pf2 with the scale inside the
#: exponent's FMA (FMA); ``w8`` two warpgroups, ``occ2`` two blocks a multiprocessor, ``cta2``
#: clusters of two). tileiras 13.4 rejects d128 128x128 w8, d128 64x64 w4
#: (with the hints; without them it compiles) and d128 64x64 w4.occ2 (``export`` lists them; kept for
#: another tileiras); d64 64x128 w4.occ2 and d64 128x64 w8.occ2, also rejected, were taken out.
PF2 = {"LAT": 1, "REV": 1, "FMA": 0}
NOLAT = {"LAT": 0, "REV": 1, "FMA": 0}
FWD = {"LAT": 1, "REV": 0, "FMA": 0}
PF3 = {"LAT": 1, "REV": 1, "FMA": 1}
CANDIDATES = (
    [(dp, 1, 128, 64, "attention", "attention_prefill_kernel", "shipped", {}) for dp in (64, 128)]
    + [(256, 1, 64, 64, "attention", "attention_prefill_kernel", "shipped", {})]
    + [(dp, hb, bs, bn, V, f, label, extra) for dp in (64, 128) for (hb, bs, bn, f, label, extra) in (
        (1, 128, 64, "attention_pf2_w8_kernel", "pf2.w8", PF2),
        (1, 128, 128, "attention_pf2_w8_kernel", "pf2.w8", PF2),
        (2, 64, 64, "attention_pf2_w8_kernel", "pf2.w8", PF2),
        (1, 64, 64, "attention_pf2_kernel", "pf2.w4", PF2),
        (1, 64, 128, "attention_pf2_kernel", "pf2.w4", PF2),
        (1, 64, 64, "attention_pf2_occ2_kernel", "pf2.w4.occ2", PF2),
        (1, 128, 64, "attention_pf2_w8_kernel", "pf2.nolat.w8", NOLAT),
        (1, 128, 64, "attention_pf2_w8_kernel", "pf2.fwd.w8", FWD),
        (1, 64, 64, "attention_pf2_kernel", "pf2.nolat.w4", NOLAT))]
    + [(dp, 1, 128, 64, V, "attention_pf2_w8_cta2_kernel", "pf2.w8.cta2", PF2) for dp in (64, 128)]
    + [(256, 1, 64, bn, V, "attention_pf2_w8_kernel", "pf2.w8", PF2) for bn in (32, 64)]
    # The exponent's FMA (2026-12-05) on the shipped tile shapes and on two heads a block (the best
    # without it at head dim 64).
    + [(dp, hb, bs, 64, V, "attention_pf2_w8_kernel", "pf3.w8", PF3) for dp in (64, 128) for hb, bs in ((1, 128), (2, 64))]
    + [(256, 1, 64, bn, V, "attention_pf2_w8_kernel", "pf3.w8", PF3) for bn in (32, 64)])
#: (name, batch, query heads, KV heads, sequence, head_dim, window, softcap): the presets' prefills,
#: a length no tile divides, Gemma 3's sliding layers and Gemma 2's softcapped ones.
SHAPES = [("llama-3.2-1b 1x2048", 1, 32, 8, 2048, 64, 0, 0.0), ("qwen3-0.6b 1x2048", 1, 16, 8, 2048, 128, 0, 0.0),
          ("mistral-7b 1x2048", 1, 32, 8, 2048, 128, 0, 0.0), ("llama-3.2-1b 4x1024", 4, 32, 8, 1024, 64, 0, 0.0),
          ("qwen3-0.6b 1x1000", 1, 16, 8, 1000, 128, 0, 0.0),
          ("gemma-3-1b 1x2048 w512", 1, 4, 1, 2048, 256, 512, 0.0), ("gemma-3-1b 1x2048 causal", 1, 4, 1, 2048, 256, 0, 0.0),
          ("gemma-3-1b 1x512 causal", 1, 4, 1, 512, 256, 0, 0.0),
          ("gemma-2-2b 1x2048 w4096 cap50", 1, 8, 4, 2048, 256, 4096, 50.0),
          ("phi-4-mini 1x2048", 1, 24, 8, 2048, 128, 0, 0.0)]


def candidates():
    from cutile_kernels.kernel_src import attention
    from cutile_kernels.kernel_src._spec import VariantSpec

    def params(function, consts):
        shipped = function == "attention_prefill_kernel"
        return (attention._prefill_params if shipped else attention._attention_params)("bfloat16", consts)

    return [VariantSpec("attention", module, function, f"bf16.d{dp}.h{hb}.m{bs}.n{bn}.{label}",
                        params(function, {"D": dp, "HB": hb, "BS": bs, "BN": bn, **extra}))
            for dp, hb, bs, bn, module, function, label, extra in CANDIDATES]


def candidate_args(ops, q, k, v, mask, out, scale, causal=True, window=None, softcap=None) -> tuple:
    """A candidate's arguments (attention_variants.py's kernels take the short tiles' convention:
    mask, KV length, output, split buffers, then the scalars), from q, k, v of the op's layout."""
    m = ops.kernel_mask(mask)
    dp = ops.padded_head_dim(q.shape[3])
    return (q, k, v, ops._dummy("mask", q.device) if m is None else m, ops._dummy("kv_len", q.device),
            out.transpose(1, 2), ops._dummy("part", q.device, dp), ops._dummy("lse", q.device), float(scale),
            float(softcap or 0.0), int(window or 0), int(m is not None), 0, int(bool(causal)), 1)


def run(sweep_dir: str, json_out: str | None) -> None:
    import torch
    import torch.nn.functional as F
    from cutile_kernels import registry
    from cutile_kernels.launcher import Launcher
    ops = importlib.import_module("cutile_kernels.ops.attention")  # the package re-exports `attention`

    watchdog = int(os.environ.get("ATTENTION_SWEEP_WATCHDOG", "0"))
    if watchdog:  # a launch that never returns: where the process waits, printed before it is ended
        faulthandler.dump_traceback_later(watchdog, exit=True)
    reg = registry.Registry(registry.package_dir_of(Path(sweep_dir)))
    launcher = Launcher()
    torch.manual_seed(0)
    rows = []
    t0 = time.perf_counter()
    wanted = [w.strip() for w in os.environ.get("ATTENTION_SWEEP_SHAPES", "").split(",") if w.strip()]
    shapes = [shape for shape in SHAPES if not wanted or any(w in shape[0] for w in wanted)]
    if not shapes:
        raise SystemExit(f"ATTENTION_SWEEP_SHAPES={wanted} matches none of {[shape[0] for shape in SHAPES]}")
    tags = [w.strip() for w in os.environ.get("ATTENTION_SWEEP_TAGS", "").split(",") if w.strip()]
    for name, B, hq, hkv, S, D, window, softcap in shapes:
        q = torch.randn(B, S, hq, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(B, S, hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn(B, S, hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        scale = 1.0 / math.sqrt(D)
        kw = dict(scale=scale, window=window or None, softcap=softcap or None)
        ref = ops.attention_reference(q.double(), k.double(), v.double(), **kw).double()
        vis = ops.visible_mask(B, S, S, window=window or None, device="cuda")
        if softcap:  # what stock runs (sdpa has no softcap): transformers' eager attention
            def stock(q=q, k=k, v=v, vis=vis, softcap=softcap):
                kr, vr = (t.repeat_interleave(hq // hkv, 1) for t in (k, v))
                s_ = softcap * torch.tanh(torch.matmul(q, kr.transpose(-1, -2)) * scale / softcap)
                p_ = torch.softmax(s_.masked_fill(~vis, float("-inf")).float(), -1).to(q.dtype)
                return torch.matmul(p_, vr)
        elif window:  # sdpa with the boolean mask transformers builds
            def stock(q=q, k=k, v=v, vis=vis):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=vis, scale=scale, enable_gqa=True)
        else:
            def stock(q=q, k=k, v=v):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        bound = 2 * (stock().double() - ref).abs().max().item()
        flops = 4 * B * hq * D * int(vis.sum().item())  # the visible (query, key) pairs
        us = graph_us(stock)
        rows.append({"shape": name, "tag": "stock", "us": round(us, 2), "TFLOPs": round(flops / us / 1e6, 1),
                     "max_abs_err": bound / 2, "elapsed_s": round(time.perf_counter() - t0, 1)})
        print(json.dumps(rows[-1]), flush=True)
        out = torch.empty(B, S, hq, D, device="cuda", dtype=torch.bfloat16)
        shipped = ops.launches(q, k, v, None, out, scale, window=window or None, softcap=softcap or None)[0][2]
        arg_sets = [("", candidate_args(ops, q, k, v, None, out, scale, window=window, softcap=softcap))]
        if window and not softcap:  # also the boolean mask alone, no bounds (the shipped masked path: attention_bench)
            arg_sets.append((".mask", candidate_args(ops, q, k, v, vis, out, scale, causal=False)))
        for variant, (suffix, args) in ((v_, a) for v_ in reg.variants("attention", "sm_90") for a in arg_sets):
            if variant.function == "attention_prefill_kernel":
                if suffix:
                    continue
                args = shipped
            c = variant.constants
            if c["D"] != ops.padded_head_dim(D) or (hq // hkv) % c["HB"]:
                continue  # another head dim; or a block's heads would span two KV heads (Phi-4-mini's 3)
            if not variant.tag.startswith("bf16."):
                continue  # the inputs are bf16 (an fp16 variant would read them as fp16)
            if tags and not any(t in variant.tag + suffix for t in tags):
                continue  # not among the candidates asked for (ATTENTION_SWEEP_TAGS)
            grid = (-(-S // c["BS"]), B * hq // c["HB"], 1)
            out.fill_(float("nan"))
            row = {"shape": name, "tag": variant.tag + suffix}
            t1 = time.perf_counter()
            if not launched(lambda v=variant, grid=grid, args=args: launcher.launch(v, grid, args, 0), row, rows):
                continue
            row["first_launch_s"] = round(time.perf_counter() - t1, 2)  # the cubin's load included
            got = out.transpose(1, 2).double()
            row["unwritten"] = int(torch.isnan(got).sum().item())
            row["max_abs_err"] = (got - ref).abs().max().item()
            row["ok"] = row["unwritten"] == 0 and row["max_abs_err"] <= bound
            if row["ok"]:
                t1 = time.perf_counter()
                t = graph_us(lambda variant=variant, grid=grid, args=args: launcher.launch(variant, grid, args, 0))
                row.update(us=round(t, 2), TFLOPs=round(flops / t / 1e6, 1), timing_s=round(time.perf_counter() - t1, 2))
            row["elapsed_s"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\nfastest correct candidate per shape (us; stock us):")
    for name, *_ in shapes:
        mine = [r for r in rows if r["shape"] == name and r.get("ok")]
        base = next(r for r in rows if r["shape"] == name and r["tag"] == "stock")
        if mine:
            best = min(mine, key=lambda r: r["us"])
            print(f"  {name}: {best['tag']} {best['us']} us ({best['TFLOPs']} TFLOP/s); stock {base['us']} us")
    write_rows(rows, json_out)


if __name__ == "__main__":
    main(__doc__, ".sweep-attn", candidates, run)
