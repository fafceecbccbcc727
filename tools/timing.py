"""CUDA-event timing for the bench tools and the benchmark scripts: medians of event-timed samples.

* :func:`time_pair`: two callables interleaved sample by sample, milliseconds per call (``evaluate``);
* :func:`events_us`: eager microseconds per call, host launch cost included;
* :func:`graph_us`: device microseconds per call, calls captured in one CUDA graph and replayed,
  so the host's launch cost is out of the number.

Every figure is a median over samples taken after warm-up calls (module load, plan caches and
first-call compilation out of the numbers).
"""

from __future__ import annotations

import math
import statistics
import time

import torch


def synchronize(device: str) -> None:
    """Wait for ``device``'s queued work (a no-op off CUDA)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _events_ms(fn, n: int) -> float:
    """Milliseconds per call of ``n`` back-to-back calls of ``fn`` between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def time_pair(fn_a, fn_b, device: str, warmup: int = 10, repeats: int = 30, sample_ms: float = 1.0) -> tuple[float, float]:
    """Median milliseconds per call of ``fn_a`` and ``fn_b``, interleaved sample by sample.

    After ``warmup`` calls of each, every sample times ``inner`` back-to-back calls (enough for
    about ``sample_ms``, from a first estimate) between CUDA events (``perf_counter`` on a CPU) and
    divides; the result is the median of ``repeats`` samples.
    """
    def estimate(fn) -> float:
        for _ in range(warmup):
            fn()
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        return max((time.perf_counter() - t0) * 1e3, 1e-4)

    inner = {id(f): max(1, min(1000, math.ceil(sample_ms / estimate(f)))) for f in (fn_a, fn_b)}

    def sample(fn) -> float:
        n = inner[id(fn)]
        if device.startswith("cuda"):
            return _events_ms(fn, n)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) * 1e3 / n

    a, b = [], []
    for _ in range(repeats):
        a.append(sample(fn_a))
        b.append(sample(fn_b))
    return statistics.median(a), statistics.median(b)


def events_us(fn, reps: int = 5, inner: int = 200, warmup: int = 10) -> float:
    """Median microseconds per call of ``fn`` (eager, host launch cost included): ``reps``
    measurements of ``inner`` back-to-back calls between two CUDA events, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(_events_ms(fn, inner) * 1e3 for _ in range(reps))


def graph_us(fn, reps: int = 20, per_graph: int = 10) -> float:
    """Median GPU microseconds per call of ``fn``: ``per_graph`` calls captured in one CUDA graph
    (host launch cost out of the number; three warm-up calls on a side stream first, as capture
    requires), ``reps`` timed replays after three untimed ones."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per_graph):
            fn()
    for _ in range(3):
        g.replay()
    return events_us(g.replay, reps=reps, inner=1, warmup=0) / per_graph
