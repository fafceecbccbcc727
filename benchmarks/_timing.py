"""CUDA-event timing shared by the benchmark scripts: medians, microseconds per call.

Import it from a script run by path (``python benchmarks/x.py`` puts this folder on ``sys.path``):
``from _timing import events_us, graph_us``.
"""

import statistics


def events_us(fn, reps: int = 5, inner: int = 200, warmup: int = 10) -> float:
    """Median microseconds per call of ``fn`` (eager, host launch cost included): ``reps``
    measurements of ``inner`` back-to-back calls between two CUDA events, after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(inner):
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / inner)
    return statistics.median(times)


def graph_us(fn, reps: int = 20, per_graph: int = 10) -> float:
    """Median GPU microseconds per call of ``fn``: ``per_graph`` calls captured in one CUDA graph
    (host launch cost out of the number; three warm-up calls on a side stream first, as capture
    requires), ``reps`` timed replays after three untimed ones."""
    import torch

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
