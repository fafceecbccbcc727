"""transformers' own speed recipe, timed as a user runs it: ``generate(ids, max_new_tokens=N,
cache_implementation="static")``, which compiles the decode step by itself (inductor,
``reduce-overhead``, ``fullgraph=False``), so a graph break in a kernelized layer costs speed
silently. Issue 20's reproduction.

One path per process (the ``rotary_pos_emb`` hub swap reaches every model of a modeling module in a
process, so stock would not be stock after ours), e.g. on the GPU machine::

    for p in stock cutile stock cutile; do python3 benchmarks/static_generate.py llama-3.2-1b --path $p; done

Prints one JSON line: per call seconds (the first compiles, the second records the CUDA graphs),
tokens per second of the third call and the median over calls 3.., dynamo's graph-break count and
reasons, and how many graphs it compiled.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="preset name or checkpoint directory")
    ap.add_argument("--path", default="stock", help="bench path to load with (stock, cutile, cutile-attn, ...)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--new", type=int, default=64, help="tokens generated per call")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=5, help="generate calls; the third and later are timed")
    ap.add_argument("--bench-steps", type=int, default=0, metavar="N",
                    help="then time N decode steps as the bench's compiled paths do (its Decoder: StaticCache, "
                         "torch.compile(model.forward, reduce-overhead, fullgraph=True), inference_mode)")
    ap.add_argument("--profile", type=int, default=0, metavar="K",
                    help="then profile one more call and print its K kernels of most GPU time")
    args = ap.parse_args(argv)

    from torch._dynamo.utils import counters

    from cutile_kernels_tools.bench import paths
    from cutile_kernels_tools import presets

    ckpt, _ = presets.resolve(args.model, device="cuda")
    model = paths.load(args.path, ckpt, torch.bfloat16, "cuda")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt), generator=gen).to("cuda")
    counters.clear()
    seconds = []
    for _ in range(args.calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                             cache_implementation="static", pad_token_id=0)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    assert out.shape == (args.batch, args.prompt + args.new), out.shape
    tokens = args.batch * args.new
    result = {
        "model": args.model, "path": args.path, "prompt": args.prompt, "new": args.new, "batch": args.batch,
        "seconds": [round(s, 4) for s in seconds],
        "third_call_tok_s": round(tokens / seconds[2], 1),
        "median_tok_s": round(tokens / statistics.median(seconds[2:]), 1),
        "graph_breaks": sum(counters["graph_break"].values()),
        "break_reasons": sorted({r.split("\n")[0][:160] for r in counters["graph_break"]}),
        "unique_graphs": counters["stats"]["unique_graphs"],
    }
    if args.bench_steps:
        from cutile_kernels_tools.bench.worker import Decoder, decode_run

        dec = Decoder(model, args.batch, args.prompt, 2 * args.bench_steps + 2, "cuda", True, 0)
        with torch.inference_mode():  # as the bench's worker runs it (the static cache is an inference tensor)
            decode_run(dec, args.bench_steps, args.bench_steps)  # compile and record
            _, ms = decode_run(dec, args.bench_steps, args.bench_steps)
        result["bench_step_ms"] = round(statistics.median(ms), 4)
        result["bench_host_ms"] = round(dec.timer.host_ms, 4)
    result["cudagraph"] = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}
    print(json.dumps(result))
    if args.profile:
        _profile(lambda: model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                                        cache_implementation="static", pad_token_id=0), args.profile, args.new)
    return result


def _profile(call, top: int, steps: int) -> None:
    """GPU kernels of one call (CUDA graph replays included), by total time, per generated token."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n, us = kernels.get(e.name, (0, 0.0))
            kernels[e.name] = (n + 1, us + e.device_time_total)
    total = sum(us for _, us in kernels.values())
    print(f"GPU time per generated token {total / steps:.1f} us in {sum(n for n, _ in kernels.values()) / steps:.1f} "
          f"kernels (prefill included)")
    for name, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{us / steps:9.1f} us/token {n / steps:6.1f}/token  {name[:110]}")


if __name__ == "__main__":
    main()
