"""Host (Python) time of one eager op call, measured on a CPU-only machine.

Every op runs its real CUDA branch: argument checks, output allocation, variant lookup (the
per-signature plan cache), parameter packing into the ctypes buffer and the launcher's device and
context checks. Only what needs a GPU is faked, and only in this process:

* ``torch.Tensor.is_cuda`` reads True, so the ops take their CUDA branch on CPU tensors (CPU
  tensors carry the dtype, shape, stride and data_ptr that variant selection uses; the CPU
  allocator stands in for the CUDA caching allocator);
* the device is "index -1" (what ``get_device()`` says for a CPU tensor): ``_arch_of`` answers
  sm_90, ``Launcher.load`` builds the argument packer (after the same cubin layout check) without
  loading a module, ``torch.cuda.current_device`` answers -1;
* the driver call itself (``cuLaunchKernel``) and the current-stream getter are no-ops.

So the numbers are the Python path between the op call and ``cuLaunchKernel``, plus a CPU
allocation per output, minus the driver call. Run from the checkout with the build present:

    python benchmarks/host_overhead.py [--calls 20000] [--json out.json] [--real]

It prints median microseconds per call for each op (median over batches of 100 calls, timed
with ``time.perf_counter_ns``), with a plain ``torch.add`` and ``torch.empty`` for scale.

``--real`` (on a GPU machine) fakes nothing: the same calls on CUDA tensors, with the driver call,
each batch ending in a synchronize (decode-step shapes keep the GPU ahead of the host). It adds
what the model's other launches cost the host for scale (``F.linear`` on cuBLAS, SDPA) and
``launch only``: our launcher's packing and ``cuLaunchKernel`` for a cached RMSNorm plan.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

BF16 = torch.bfloat16


def install_fakes(dispatch=None, launcher=None):
    """Patch this process so that the ops' CUDA path runs on CPU tensors down to the driver call.

    ``dispatch`` and ``launcher`` are the modules of one package copy (default: the installed
    ``cutile_kernels``; ``kernels`` loads the build's copy under another name)."""
    os.environ["CUTILE_KERNELS_STRICT"] = "1"  # a fallback must raise: we time the kernel path only
    if dispatch is None:
        from cutile_kernels import dispatch, launcher
    from cutile_kernels.cubin import ArgPacker, param_info

    torch.Tensor.is_cuda = property(lambda self: True)
    torch.cuda.current_device = lambda: -1
    if hasattr(launcher, "_current_device"):
        launcher._current_device = lambda: -1

    class _Driver:
        class CUresult:
            CUDA_SUCCESS = 0

        @staticmethod
        def cuLaunchKernel(*args):
            return (0,)

    launcher._driver = _Driver
    launcher._current_raw_stream = lambda device_index: 0
    dispatch._arch_of = lambda device_index: ((9, 0), "sm_90")
    dispatch._LAUNCHER._ctx_ready.__dict__[-1] = True
    cache = dispatch._LAUNCHER._loaded

    def load(variant, device_index):
        key = (device_index, variant.symbol)
        loaded = cache.get(key)
        if loaded is None:
            packer = ArgPacker(variant.params)
            assert param_info(variant.cubin.read_bytes(), variant.symbol) == packer.layout
            loaded = cache[key] = launcher._Loaded(None, packer, variant)
        return loaded

    dispatch._LAUNCHER.load = load
    if dispatch._registry.registry().pkg_dir is None:
        sys.exit("no cuTile build found: run `cutile-kernels build` first")


def cases(hidden: int = 2048, inter: int = 8192, heads: int = 32, kv_heads: int = 8, head_dim: int = 64,
          device: str = "cpu"):
    """(name, fn) for decode-step shapes of a Llama-3.2-1B-like model, batch 1."""
    import cutile_kernels as ck

    def randn(*shape):
        return torch.randn(*shape, dtype=BF16, device=device)

    x = randn(1, 1, hidden)
    res = randn(1, 1, hidden)
    w = randn(hidden)
    gate = randn(1, 1, inter)
    up = randn(1, 1, inter)
    fused = randn(1, 1, 2 * inter)
    # transformers' q/k: (B, S, H, D) projections seen as (B, H, S, D)
    q = randn(1, 1, heads, head_dim).transpose(1, 2)
    k = randn(1, 1, kv_heads, head_dim).transpose(1, 2)
    cos = randn(1, 1, head_dim)
    sin = randn(1, 1, head_dim)
    extra = []
    if device != "cpu":
        from cutile_kernels import dispatch

        wq = randn(hidden, hidden)
        kc = randn(1, kv_heads, 64, head_dim)
        y = torch.empty_like(x)
        args = (x.view(1, hidden), w, y.view(1, hidden), 1e-6)
        ck.rms_norm(x, w, 1e-6)
        plan = next(p for p in dispatch._PLANS.values() if getattr(p, "symbol", "").startswith("rms_norm"))

        def launch_only():
            values = plan.values.copy()
            for slot, i in plan.ptr_slots:
                values[slot] = args[i].data_ptr()
            dispatch._LAUNCHER.launch_values(plan.loaded, plan.grid, values, 0)

        extra = [
            ("gemv 2048x2048", lambda: ck.gemv(x, wq)),  # eager steps keep F.linear: this says what it would cost
            ("(F.linear 2048x2048, cuBLAS)", lambda: torch.nn.functional.linear(x, wq)),
            ("(sdpa, 64 cached keys)", lambda: torch.nn.functional.scaled_dot_product_attention(
                q, kc, kc, enable_gqa=True)),
            ("(launch only: rms_norm plan)", launch_only),
        ]
    return [
        ("rms_norm", lambda: ck.rms_norm(x, w, 1e-6)),
        ("add_rms_norm", lambda: ck.add_rms_norm(x, res, w, 1e-6)),
        ("apply_rope", lambda: ck.apply_rope(q, k, cos, sin)),
        ("silu_and_mul", lambda: ck.silu_and_mul(gate, up)),
        ("silu_and_mul_fused", lambda: ck.silu_and_mul_fused(fused)),
        ("silu", lambda: ck.silu(gate)),
        ("(torch.add, for scale)", lambda: torch.add(x, res)),
        ("(torch.empty, for scale)", lambda: torch.empty((1, hidden), dtype=BF16, device=device)),
        *extra,
    ]


def time_us(fn, calls: int, batch: int = 100, sync=None) -> float:
    """Median microseconds per call over batches of ``batch`` calls (each ending in ``sync()``)."""
    for _ in range(max(calls // 20, 50)):
        fn()
    if sync:
        sync()
    gc.collect()
    per = []
    clock = time.perf_counter_ns
    for _ in range(max(calls // batch, 1)):
        t0 = clock()
        for _ in range(batch):
            fn()
        if sync:
            sync()
        per.append((clock() - t0) / batch / 1e3)
    return statistics.median(per)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--only", nargs="*", help="op names to time (default: all)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--real", action="store_true", help="on a GPU: fake nothing (see the module docstring)")
    args = ap.parse_args(argv)
    if args.real:
        if not torch.cuda.is_available():
            sys.exit("--real needs a CUDA device")
        os.environ["CUTILE_KERNELS_STRICT"] = "1"
        device, sync = "cuda", torch.cuda.synchronize
    else:
        install_fakes()
        device, sync = "cpu", None
    from cutile_kernels import dispatch

    torch.set_grad_enabled(False)  # inference, as in a decode step (no custom-op dispatch)
    results = {}
    for name, fn in cases(device=device):
        if args.only and name not in args.only:
            continue
        dispatch.reset_stats()
        fn()
        launched = sum(dispatch.STATS.launches.values())
        assert name.startswith("(") or launched >= 1, f"{name} launched nothing: {dispatch.stats()}"
        results[name] = time_us(fn, args.calls, sync=sync)
        print(f"{name:28s} {results[name]:7.2f} us/call")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
