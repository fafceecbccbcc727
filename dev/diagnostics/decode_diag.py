"""Where does a stock decode step's time go? One checkpoint loaded four ways, timed in alternation.

    python dev/diagnostics/decode_diag.py <checkpoint dir> [--steps 24]

Paths: ``stock`` (plain from_pretrained); ``stock+use_kernels`` (use_kernels=True with an empty
mapping: transformers' kernel plumbing, no layer replaced); ``cutile`` (our RMSNorm);
``cutile-disabled`` (our layer, CUTILE_KERNELS_DISABLE=1 at call time: the PyTorch reference
through our layer). Prints median wall and CUDA-event milliseconds per decode step (batch 1).
"""

import argparse
import os
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

import cutile_kernels
from cutile_kernels.layers.hub import CutileKernelConfig


def main():
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("--steps", type=int, default=24)
    a = p.parse_args()
    load = lambda **kw: AutoModelForCausalLM.from_pretrained(a.checkpoint, dtype=torch.bfloat16, device_map="cuda", **kw).eval()
    models = {
        "stock": load(),
        "stock+use_kernels": load(use_kernels=True, kernel_config=CutileKernelConfig({}, use_local_kernel=True)),
        "cutile": load(use_kernels=True, kernel_config=cutile_kernels.kernel_config()),
    }
    models["cutile-disabled"] = models["cutile"]
    state = {}
    ids = torch.randint(0, models["stock"].config.vocab_size, (1, 128), device="cuda")
    for name, m in models.items():
        cache = DynamicCache(config=m.config)
        with torch.inference_mode():
            out = m(ids, past_key_values=cache, use_cache=True)
        state[name] = (cache, out.logits[:, -1:].argmax(-1))
    wall, gpu = {n: [] for n in models}, {n: [] for n in models}
    for i in range(a.steps + 3):
        for name, m in models.items():
            os.environ["CUTILE_KERNELS_DISABLE"] = "1" if name == "cutile-disabled" else "0"
            cache, nxt = state[name]
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            s.record()
            with torch.inference_mode():
                out = m(nxt, past_key_values=cache, use_cache=True)
            e.record()
            e.synchronize()
            t1 = time.perf_counter()
            state[name] = (cache, out.logits[:, -1:].argmax(-1))
            if i >= 3:
                wall[name].append((t1 - t0) * 1e3)
                gpu[name].append(s.elapsed_time(e))
    os.environ.pop("CUTILE_KERNELS_DISABLE", None)
    for name in models:
        print(f"{name:20s} wall {statistics.median(wall[name]):8.2f} ms   events {statistics.median(gpu[name]):8.2f} ms")


if __name__ == "__main__":
    main()
