"""Where the host time of an eager prefill goes, stock against ours: ``cProfile`` of the forward.

    python dev/diagnostics/host_profile.py llama-3.2-1b [--tokens 2048] [--calls 5] [--top 30] [--sync-debug]
        [--drift N] [--include PATCH...] [--interleave N]

The bench's prefill rounds show the host time (until ``forward`` returned) close to the whole
prefill time: the host sets the pace. This prints, per model, the host and device milliseconds
per prefill (unprofiled, medians) and the functions that take the host's time under
``cProfile`` (own time and cumulative, per call of the forward). cProfile slows Python-level
calls more than C calls, so read the shares, not the absolute times. ``--sync-debug`` also lists
the operations of one forward that make the host wait for the device
(``torch.cuda.set_sync_debug_mode("warn")``): a host time that tracks the device time can be such
a wait rather than a slow host. ``--drift N`` times N more prefills per model, with Python's
garbage collector on and then off, and prints the spread of host wall time, the timing thread's CPU
time and the collector's time: a slow host computes (CPU time near wall time), a waiting one
does not. ``--interleave N`` only times: all paths loaded at once, N rounds of one prefill of each
in turn (the order rotating), so a host whose speed drifts slows every path alike; it prints each
path's median and p10 host and prefill milliseconds and its median per-round ratio to stock.
"""

import argparse
import cProfile
import gc
import io
import pstats
import statistics

import cutile_kernels
import torch
from cutile_kernels_tools import presets
from cutile_kernels_tools.bench.worker import Timer
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


def drift(name, model, ids, n: int) -> None:
    """Spread of ``n`` prefills' host, host CPU, GC and device milliseconds, GC on, then off."""
    timer = Timer("cuda")
    for label in ("gc on", "gc off"):
        rows = []
        if label == "gc off":
            gc.collect()
            gc.disable()
        try:
            for _ in range(n):
                device = timer(lambda: model(ids, use_cache=False))
                rows.append((timer.host_ms, timer.host_cpu_ms, timer.gc_ms, device))
        finally:
            gc.enable()
        cols = list(zip(*rows))
        cells = []
        for what, col in zip(("host", "host cpu", "gc", "prefill"), cols):
            q = statistics.quantiles(col, n=10)
            cells.append(f"{what} {statistics.median(col):.2f} (p10 {q[0]:.2f}, p90 {q[-1]:.2f}, max {max(col):.2f})")
        print(f"--- {name}, {label}, {n} prefills, ms: " + "; ".join(cells))


@torch.inference_mode()
def profile(name, model, ids, calls: int, top: int, sync_debug: bool = False, drift_n: int = 0) -> None:
    for _ in range(3):
        model(ids, use_cache=False)
    torch.cuda.synchronize()
    host, device = host_and_device_ms(model, ids, 10)
    print(f"\n=== {name}: host {host:.2f} ms, prefill {device:.2f} ms per forward (median of 10, unprofiled)")
    if sync_debug:
        ops = synchronizing_ops(model, ids)
        print(f"--- {name}: {len(ops)} kinds of synchronizing call in one forward" + "".join(f"\n  {o}" for o in ops))
    if drift_n:
        drift(name, model, ids, drift_n)
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


def interleave(models: dict, ids, n: int) -> None:
    """Time ``n`` rounds of one prefill per model, in rotating order; print medians and ratios."""
    timer = Timer(str(ids.device))
    names = list(models)
    rows = {k: [] for k in names}
    with torch.inference_mode():
        for _ in range(3):
            for m in models.values():
                m(ids, use_cache=False)
        if ids.is_cuda:
            torch.cuda.synchronize()
        for r in range(n):
            for k in names[r % len(names):] + names[:r % len(names)]:
                device = timer(lambda: models[k](ids, use_cache=False))
                rows[k].append((timer.host_ms, device))
    print(f"\n=== interleaved, {n} rounds of one prefill per path ({ids.shape[0]} x {ids.shape[1]} tokens), ms")
    for k in names:
        host, device = (sorted(c) for c in zip(*rows[k]))
        ratio = statistics.median(a[1] / b[1] for a, b in zip(rows[k], rows[names[0]]))
        print(f"{k:28s} host {statistics.median(host):6.2f} (p10 {host[len(host) // 10]:6.2f})  prefill "
              f"{statistics.median(device):6.2f} (p10 {device[len(device) // 10]:6.2f})  prefill / {names[0]}'s, "
              f"median by round {ratio:.3f}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--sync-debug", action="store_true", help="list the calls that wait for the device")
    p.add_argument("--drift", type=int, default=0, metavar="N", help="time N more prefills, GC on and off")
    p.add_argument("--include", nargs="*", default=[], metavar="PATCH",
                   help="also profile ours with these opt-in patches (e.g. fused_qkv)")
    p.add_argument("--exclude", nargs="*", default=[], metavar="PATCH",
                   help="with --interleave, also time ours without these default patches")
    p.add_argument("--interleave", type=int, default=0, metavar="N",
                   help="only time the paths against each other, N rounds of one prefill each")
    a = p.parse_args()
    if a.drift == 1:
        p.error("--drift needs at least 2 prefills (for its deciles)")
    ckpt, _ = presets.resolve(a.model, device="cuda")

    def load(**kw):
        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device_map="cuda", **kw).eval()

    ids = torch.randint(0, 1000, (1, a.tokens), device="cuda")
    if a.interleave:
        models = {"stock": load(), "ours": load(use_kernels=True, kernel_config=cutile_kernels.kernel_config())}
        if a.include:
            models[f"ours+{'+'.join(a.include)}"] = load(use_kernels=True, kernel_config=cutile_kernels.kernel_config(
                include=a.include))
        if a.exclude:
            models[f"ours~{'~'.join(a.exclude)}"] = load(use_kernels=True, kernel_config=cutile_kernels.kernel_config(
                exclude=a.exclude))
        interleave(models, ids, a.interleave)
        return
    profile("stock", load(), ids, a.calls, a.top, a.sync_debug, a.drift)
    profile("ours", load(use_kernels=True, kernel_config=cutile_kernels.kernel_config()), ids, a.calls, a.top,
            a.sync_debug, a.drift)
    if a.include:
        profile(f"ours+{'+'.join(a.include)}", load(use_kernels=True, kernel_config=cutile_kernels.kernel_config(
            include=a.include)), ids, a.calls, a.top, a.sync_debug, a.drift)


if __name__ == "__main__":
    main()
