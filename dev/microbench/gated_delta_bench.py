"""Gated DeltaNet's kernels on a GPU against transformers' torch code and flash-linear-attention.

    python dev/microbench/gated_delta_bench.py --json gated-delta-bench.json

Qwen3.5-0.8B's linear-attention shapes (16 heads of 128/128, conv channels 6144, bf16): the delta
rule at prefill (1 x 2048) and decode (b = 1 and 16, one token over a state), the causal conv1d
and its one-token update, and the gated RMSNorm. fla is used when importable (also from the folder
``$CUTILE_BENCH_FLA_PATH`` names). Numbers: medians of CUDA-event timings of back-to-back calls
(``us``: host + GPU, as eager calls them) and of CUDA-graph replays (``graph_us``: GPU time; not for
the torch delta rule, whose prefill syncs); for the chunked delta rule also each kernel's GPU time
(``kernel_us``, torch.profiler), ours for every built chunk size and fla's. A microbenchmark can
reject a kernel, not accept one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from cutile_kernels_tools.timing import events_us, graph_us


def _fla():
    extra = os.environ.get("CUTILE_BENCH_FLA_PATH")
    if extra and extra not in sys.path:
        sys.path.insert(0, extra)
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as exc:  # noqa: BLE001 - reported, the other columns still run
        print(f"fla unavailable: {type(exc).__name__}: {exc}")
        return None, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    import cutile_kernels
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q35

    fla_chunk, fla_rec = _fla()
    dev, dt, H, D = "cuda", torch.bfloat16, 16, 128
    rows = []

    def kernel_split(case, name, fn, calls=20):
        # GPU time per call of each kernel the call launches (torch.profiler), to see the long pole.
        fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        split = {e.key[:60]: round(e.device_time_total / calls, 2) for e in prof.key_averages()
                 if e.device_type == torch.autograd.DeviceType.CUDA}
        rows.append({"case": case, "impl": name, "kernel_us": split})
        print({"case": case, "impl": name, "kernel_us": split}, flush=True)

    def row(case, name, fn, graph=True):
        r = {"case": case, "impl": name, "us": round(events_us(fn, reps=5, inner=20), 2)}
        if graph:
            r["graph_us"] = round(graph_us(fn), 2)
        rows.append(r)
        print(r, flush=True)

    for case, B, T in (("delta prefill 1x2048", 1, 2048), ("delta decode b1", 1, 1), ("delta decode b16", 16, 1)):
        q, k, v = (torch.randn(B, T, H, D, device=dev, dtype=dt) for _ in range(3))
        g = -torch.rand(B, T, H, device=dev)
        beta = torch.rand(B, T, H, device=dev).to(dt)
        s = 0.1 * torch.randn(B, H, D, D, device=dev)
        torch_fn = q35.torch_chunk_gated_delta_rule if T > 1 else q35.torch_recurrent_gated_delta_rule
        row(case, "torch", lambda: torch_fn(q, k, v, g=g, beta=beta, initial_state=s, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True), graph=T == 1)
        fla_fn = fla_chunk if T > 1 else fla_rec
        if fla_fn is not None:
            row(case, "fla", lambda: fla_fn(q, k, v, g=g, beta=beta, initial_state=s, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True))
        state = s.clone()
        from cutile_kernels.ops import gated_delta as gd_ops

        from cutile_kernels.kernel_src.gated_delta import CHUNKS

        def ours():
            return cutile_kernels.gated_delta_rule(q, k, v, g, beta, state)

        for bt in (CHUNKS if T > 1 else CHUNKS[:1]):  # every chunk size built
            gd_ops.chunk_size = bt
            name = "cutile" if T == 1 else f"cutile chunk {bt}"
            row(case, name, ours)
            if T > 1:
                kernel_split(case, name, ours)
        gd_ops.chunk_size = CHUNKS[0]
        if T > 1 and fla_fn is not None:
            kernel_split(case, "fla", lambda: fla_fn(q, k, v, g=g, beta=beta, initial_state=s, output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True))

    C = 6144
    w = 0.3 * torch.randn(C, 4, device=dev, dtype=dt)
    x = torch.randn(1, 2048, C, device=dev, dtype=dt)
    row("conv1d 1x2048", "torch", lambda: q35.causal_conv1d_fn(x.transpose(1, 2), w, None, activation="silu"))
    row("conv1d 1x2048", "cutile", lambda: cutile_kernels.causal_conv1d(x, w))
    for B in (1, 16):
        xs = torch.randn(B, C, 1, device=dev, dtype=dt)
        st = torch.randn(B, C, 4, device=dev, dtype=dt)
        row(f"conv1d update b{B}", "torch", lambda: q35.causal_conv1d_update(xs, st, w, None, "silu"))
        row(f"conv1d update b{B}", "cutile", lambda: cutile_kernels.causal_conv1d_update(xs[..., 0], st, w))
    norm = q35.Qwen3_5RMSNormGated(D).to(dev, dt)
    for n in (16, 2048 * 16):
        a, z = torch.randn(n, D, device=dev, dtype=dt), torch.randn(n, D, device=dev, dtype=dt)
        row(f"gated norm {n} rows", "torch", lambda: norm(a, z))
        row(f"gated norm {n} rows", "cutile", lambda: cutile_kernels.rms_norm_gated(a, z, norm.weight, 1e-6))
    print("fallbacks:", cutile_kernels.stats()["fallbacks"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
