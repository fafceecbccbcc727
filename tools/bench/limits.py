"""The machine's two ceilings, measured at the start of a bench on the same device.

* copy bandwidth: a device-to-device copy, counting bytes read plus bytes written;
* matrix rate: a large matmul in the bench dtype (bf16 on GPU; float32 on CPU, where bf16 matmul
  is emulated and would understate the machine).

Decode is reported against weight bytes / bandwidth (every weight read once per step) and prefill
against FLOPs / matmul rate (2 x parameters x tokens, attention ignored), so every figure has a
roofline fraction.
"""

from __future__ import annotations

import statistics
import time

import torch


def _median_ms(fn, device: str, reps: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def measure(device: str, copy_bytes: int | None = None, matmul_n: int | None = None) -> dict:
    """Copy bandwidth (bytes/s) and matmul rate (FLOP/s) on ``device``, medians of 10 runs.

    Sizes default to 2 GiB and n = 8192 (bf16) on CUDA, 256 MiB and n = 1024 (float32) on CPU.
    Inputs are random (zeros run faster than real data on some GPUs).
    """
    cuda = device.startswith("cuda")
    copy_bytes = copy_bytes or (2 << 30 if cuda else 256 << 20)
    n = matmul_n or (8192 if cuda else 1024)
    dtype = torch.bfloat16 if cuda else torch.float32
    src = torch.randint(0, 255, (copy_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = _median_ms(lambda: dst.copy_(src), device)
    del src, dst
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm_ms = _median_ms(lambda: a @ b, device)
    del a, b
    if cuda:
        torch.cuda.empty_cache()
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "copy_bytes": copy_bytes,
        "copy_bandwidth_Bps": 2 * copy_bytes / (copy_ms / 1e3),
        "matmul_n": n,
        "matmul_dtype": str(dtype).removeprefix("torch."),
        "matmul_flops": 2 * n**3 / (mm_ms / 1e3),
    }


def weight_bytes(model) -> int:
    """Bytes of the model's parameters (tied weights counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def roofline(limits: dict, weights: int, n_params: int, prefill_tokens: int, prefill_ms: float,
             decode: list[dict]) -> dict:
    """Roofline fractions: prefill FLOP floor over measured time; decode tok/s over the bound of
    reading every weight once per step (batch tokens per step)."""
    floor_ms = 2 * n_params * prefill_tokens / limits["matmul_flops"] * 1e3
    out = {"prefill_floor_ms": floor_ms, "prefill_fraction": floor_ms / prefill_ms, "decode": []}
    for d in decode:
        bound = d["batch"] * limits["copy_bandwidth_Bps"] / weights
        out["decode"].append({"batch": d["batch"], "bound_tokens_per_s": bound,
                              "fraction": d["tokens_per_s"] / bound})
    return out
