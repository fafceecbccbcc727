"""Where the host time of an eager prefill goes, stock against ours: ``cProfile`` of the forward.

    python benchmarks/host_profile.py llama-3.2-1b [--tokens 2048] [--calls 5] [--top 30] [--sync-debug]

The bench's prefill rounds show the host time (until ``forward`` returned) close to the whole
prefill time: the host sets the pace. This prints, per model, the host and device milliseconds
per prefill (unprofiled, medians) and the functions that take the host's time under
``cProfile`` (own time and cumulative, per call of the forward). cProfile slows Python-level
calls more than C calls, so read the shares, not the absolute times. ``--sync-debug`` also lists
the operations of one forward that make the host wait for the device
(``torch.cuda.set_sync_debug_mode("warn")``): a host time that tracks the device time can be such
a wait rather than a slow host.
"""

import argparse
import cProfile
import io
import pstats
import statistics

import cutile_kernels
import torch
from cutile_kernels_tools import presets
from cutile_kernels_tools.worker import Timer
from transformers import AutoModelForCausalLM


def synchronizing_ops(model, ids) -> list[str]:
    """The distinct warnings ``set_sync_debug_mode("warn")`` raises during one forward."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model(ids, use_cache=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sorted({str(w.message).splitlines()[0][:200] for w in caught})


def host_and_device_ms(model, ids, n: int) -> tuple[float, float]:
    """Median host and device milliseconds of ``n`` prefills, as the bench's Timer takes them."""
    timer, host, device = Timer("cuda"), [], []
    for _ in range(n):
        device.append(timer(lambda: model(ids, use_cache=False)))
        host.append(timer.host_ms)
    return statistics.median(host), statistics.median(device)


@torch.inference_mode()
def profile(name, model, ids, calls: int, top: int, sync_debug: bool = False) -> None:
    for _ in range(3):
        model(ids, use_cache=False)
    torch.cuda.synchronize()
    host, device = host_and_device_ms(model, ids, 10)
    print(f"\n=== {name}: host {host:.2f} ms, prefill {device:.2f} ms per forward (median of 10, unprofiled)")
    if sync_debug:
        ops = synchronizing_ops(model, ids)
        print(f"--- {name}: {len(ops)} kinds of synchronizing call in one forward" + "".join(f"\n  {o}" for o in ops))
    prof = cProfile.Profile()
    for _ in range(calls):
        prof.enable()
        model(ids, use_cache=False)
        prof.disable()
        torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        stats.sort_stats(key).print_stats(top)
        print(f"--- {name}, sorted by {key} ({calls} forwards profiled; times are totals over them)")
        print("\n".join(line[:200] for line in buf.getvalue().splitlines() if line.strip()))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--sync-debug", action="store_true", help="list the calls that wait for the device")
    a = p.parse_args()
    ckpt, _ = presets.resolve(a.model, device="cuda")

    def load(**kw):
        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device_map="cuda", **kw).eval()

    ids = torch.randint(0, 1000, (1, a.tokens), device="cuda")
    profile("stock", load(), ids, a.calls, a.top, a.sync_debug)
    profile("ours", load(use_kernels=True, kernel_config=cutile_kernels.kernel_config()), ids, a.calls, a.top,
            a.sync_debug)


if __name__ == "__main__":
    main()
