"""Decode attention over long static caches: does the shipped launch write finite, correct rows?

    python -m dev.diagnostics.decode_long_check [--time]   # from the checkout's root

Why: the MHA decode sweep (H100, 2026-12-05) saw the shipped launch's output NaN for OLMo-3-7B's
layout at batch 16 over 3000 of 4096 slots (the long tile, 256 keys). Prints, per layout, the plan's
tile, whether each launch ran, the NaN count and where the first NaN sits, and the error against
float32 attention; then the public op on the same inputs. With ``--time``, OLMo-3-7B's layout at
batch 16 over 3000 of 4096 slots is timed, six copies of the cache cycled (as the sweeps do; one is
already past the L2 here): our launch and SDPA over every slot with a mask (as stock calls it on a
static cache) as median GPU us of CUDA-graph replays, the PyTorch reference it fell back to before
eagerly (host included).
"""

from __future__ import annotations

import importlib
import logging

import torch

import cutile_kernels
from cutile_kernels import dispatch

from dev.microbench.decode_splits import decode_inputs
from dev.sweeps._common import cycling

ops = importlib.import_module("cutile_kernels.ops.attention")
#: (batch, query heads, KV heads, head_dim, filled, slots)
CASES = [(16, 32, 32, 128, 3000, 4096), (1, 32, 32, 128, 3000, 4096), (4, 32, 32, 128, 3000, 4096),
         (8, 32, 32, 128, 3000, 4096), (16, 32, 32, 128, 2100, 2048 + 128), (16, 32, 32, 128, 1500, 1024),
         (16, 32, 8, 128, 3000, 4096), (16, 32, 8, 64, 3000, 4096), (16, 16, 16, 128, 3000, 4096)]


def timings() -> None:
    import torch.nn.functional as F
    from cutile_kernels_tools.timing import events_us, graph_us

    B, H, D, filled, slots = 16, 32, 128, 3000, 4096
    q, k0, v0, n, scale, ref, out = decode_inputs(B, H, H, D, slots, filled)
    kv = [(k0, v0)] + [(k0.clone(), v0.clone()) for _ in range(5)]
    mask = (torch.arange(slots, device="cuda") < filled).view(1, 1, 1, slots)

    plans = [ops.launches(q, k, v, None, out, scale, True, kv_len=n) for k, v in kv]
    ours = graph_us(cycling([lambda p=p: [dispatch.run(*s) for s in p] for p in plans]))
    sdpa = graph_us(cycling([lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
                             for k, v in kv]))
    reference = events_us(cycling([lambda k=k, v=v: ops.attention_reference(q, k, v, None, scale, True, kv_len=n)
                                   for k, v in kv]), reps=5, inner=6, warmup=2)
    print(f"timing B={B} heads={H} D={D} filled={filled}/{slots}: ours {ours:.1f} us, sdpa over masked slots "
          f"{sdpa:.1f} us, the reference fallback {reference:.1f} us (eager, host included)", flush=True)


if __name__ == "__main__":
    import sys

    logging.basicConfig(level=logging.INFO)
    if "--time" in sys.argv:
        timings()
        sys.exit(0)
    for B, hq, hkv, D, filled, slots in CASES:
        filled = min(filled, slots)
        q, k, v, n, scale, ref, out = decode_inputs(B, hq, hkv, D, slots, filled)
        out.fill_(float("nan"))
        plan = ops.launches(q, k, v, None, out, scale, True, kv_len=n)
        ran = [dispatch.run(*s) for s in plan]
        torch.cuda.synchronize()
        got = out.transpose(1, 2).float()
        bad = torch.isnan(got)
        first = bad.nonzero()[0].tolist() if bad.any() else None
        rel = ((got.nan_to_num() - ref).norm() / ref.norm()).item()
        op = cutile_kernels.attention(q, k, v, kv_len=n).float()
        rel_op = ((op - ref).norm() / ref.norm()).item()
        print(f"B={B} heads={hq}/{hkv} D={D} filled={filled}/{slots} want={dict(plan[0][1])} "
              f"splits={plan[0][2][-1]} ran={ran} nan={int(bad.sum())} first_nan={first} rel={rel:.3g} "
              f"op_nan={int(torch.isnan(op).sum())} op_rel={rel_op:.3g}", flush=True)
