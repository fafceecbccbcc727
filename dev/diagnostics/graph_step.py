"""Where a decode-graph step's time goes (the decode fast path, ``layers/decode_graphs.py``).

For a preset and a bench path with decode graphs (``cutile-graphs``, ``stock-graphs``), after a
prompt of ``--prompt`` tokens: the step as the bench times it (session call + greedy pick, CUDA
events), its host time, the captured graph's replay alone (CUDA events over back-to-back
replays: the GPU's time), and the kernels of a few replays by device time (torch.profiler).
A step much slower than its replay is host-bound. On the GPU machine::

    python3 dev/diagnostics/graph_step.py llama-3.2-1b --path cutile-graphs --batch 1 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="preset name or checkpoint directory")
    ap.add_argument("--path", default="cutile-graphs")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--top", type=int, default=25, help="kernels listed from the profile")
    args = ap.parse_args(argv)

    from transformers import StaticCache

    from cutile_kernels.layers import decode_graphs as dg
    from cutile_kernels_tools import presets
    from cutile_kernels_tools.bench import paths

    ckpt, _ = presets.resolve(args.model, device="cuda")
    model = paths.load(args.path, ckpt, torch.bfloat16, "cuda")
    graphs = getattr(model, dg.ATTR)
    for batch in args.batch:
        ids = torch.randint(1, model.config.vocab_size, (batch, args.prompt), device="cuda")
        cache = StaticCache(config=model.config, max_cache_len=args.prompt + 4 * args.steps + 64)
        step = model.get_compiled_call(None)
        with torch.inference_mode():
            nxt = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for _ in range(3):  # warm-up, capture, one replay
                nxt = step(nxt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            ev_ms, host_ms = [], []
            for _ in range(args.steps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                t0 = time.perf_counter()
                nxt = step(nxt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                host_ms.append((time.perf_counter() - t0) * 1e3)
                b.record()
                b.synchronize()
                ev_ms.append(a.elapsed_time(b))
            entry = next(e for k, e in graphs.entries.items() if k[0] == id(cache) and e.graph is not None)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(args.steps):
                entry.graph.replay()
            b.record()
            b.synchronize()
            replay_ms = a.elapsed_time(b) / args.steps
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    entry.graph.replay()
                torch.cuda.synchronize()
        rows = sorted(((e.key, e.device_time_total / 5, e.count / 5) for e in prof.key_averages()),
                      key=lambda r: -r[1])
        total = sum(r[1] for r in rows)
        print(json.dumps({"model": args.model, "path": args.path, "batch": batch, "step_ms": statistics.median(ev_ms),
                          "step_host_ms": statistics.median(host_ms), "replay_ms": replay_ms,
                          "profiled_device_us_per_replay": total}))
        for name, us, n in rows[:args.top]:
            print(f"  {us:8.1f} us {us / total:6.1%} x{n:5.1f}  {name[:110]}")


if __name__ == "__main__":
    main()
