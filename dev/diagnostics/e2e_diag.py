"""Which of our changes moves a model's end-to-end time? One checkpoint, stock and ours, with
each of our patches switched off in turn, timed in alternating rounds in one process.

    python dev/diagnostics/e2e_diag.py llama-3.2-1b [--rounds 3] [--json out.json]

Configs: ``stock``; ``ours`` (kernel_config: hub layers RMSNorm + rotary_pos_emb, and every
registered patch); ``ours -<patch>`` (that patch undone); ``hub only`` (every patch undone).
Per config: prefill 1x2048 ms and decode ms per step at batch 1 and 16 (CUDA events, medians),
and our dispatch counters (a fallback shows up here).
"""

import argparse
import json
import statistics

import cutile_kernels
import torch
from cutile_kernels.layers import patch as patcher
from cutile_kernels_tools import presets
from cutile_kernels_tools.bench.worker import Decoder, Timer, decode_run
from transformers import AutoModelForCausalLM

_ms = Timer("cuda")


@torch.inference_mode()
def prefill(model, ids, n=5):
    model(ids, use_cache=False)
    return statistics.median(_ms(lambda: model(ids, use_cache=False)) for _ in range(n))


def decode(model, batch, steps=16, warm=3):
    """Median ms per greedy decode step after a 128-token prompt (the bench's eager Decoder)."""
    dec = Decoder(model, batch, 128, warm + steps, "cuda", compiled=False, seed=0)
    return statistics.median(decode_run(dec, warm, steps)[1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--profile", action="store_true", help="also print the top ops of a profiled decode")
    a = p.parse_args()
    ckpt, _ = presets.resolve(a.model, device="cuda")
    load = lambda **kw: AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device_map="cuda", **kw).eval()
    stock = load()
    ours = load(use_kernels=True, kernel_config=cutile_kernels.kernel_config())
    as_loaded = load(use_kernels=True, kernel_config=cutile_kernels.kernel_config())
    print("as loaded: patches", patcher.applied(as_loaded), "params",
          sorted({(str(p.dtype), str(p.device)) for p in as_loaded.parameters()}))
    names = list(patcher.PATCHES)
    configs = {"stock": (stock, None), "ours as loaded": (as_loaded, None), "ours": (ours, names)}
    for n in names:
        configs[f"ours -{n}"] = (ours, [m for m in names if m != n])
    configs["hub only"] = (ours, [])
    ids = torch.randint(0, stock.config.vocab_size, (1, 2048), device="cuda")
    res = {k: {"prefill": [], "b1": [], "b16": []} for k in configs}
    stats = {}
    for r in range(a.rounds):
        for name, (model, want) in configs.items():
            if want is not None:
                patcher.unpatch(model)
                patcher.patch(model, names=want)
            cutile_kernels.reset_stats()
            res[name]["prefill"].append(prefill(model, ids))
            res[name]["b1"].append(decode(model, 1))
            res[name]["b16"].append(decode(model, 16))
            stats[name] = cutile_kernels.stats()
    rows = []
    for name, r in res.items():
        row = {"config": name, **{k: statistics.median(v) for k, v in r.items()},
               "rounds": r, "launches": sum(stats[name]["launches"].values()),
               "fallbacks": stats[name]["fallbacks"], "reference_calls": stats[name]["reference_calls"]}
        rows.append(row)
        print(f"{name:28s} prefill {row['prefill']:7.2f} ms  decode b1 {row['b1']:6.2f} ms  b16 {row['b16']:6.2f} ms"
              f"  launches {row['launches']}  fallbacks {row['fallbacks']}  reference {row['reference_calls']}")
    from torch.profiler import ProfilerActivity, profile

    for name in ("stock", "ours") if a.profile else ():
        model, want = configs[name]
        if want is not None:
            patcher.unpatch(model)
            patcher.patch(model, names=want)
        decode(model, 16, steps=2)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            decode(model, 16, steps=2, warm=0)
        print(f"--- {name}: decode b16 (prompt + 2 steps), top ops by device time")
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=14, max_name_column_width=60))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
