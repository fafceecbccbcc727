"""Where a decode-graph step's time goes (the decode fast path, ``layers/decode_graphs.py``).

For a preset and a bench path with decode graphs (``cutile-graphs``, ``stock-graphs``), after a
prompt of ``--prompt`` tokens: the step as the bench times it (session call + greedy pick, CUDA
events), its host time, the captured graph's replay alone (CUDA events over back-to-back
replays: the GPU's time), and the kernels of a few replays by device time (torch.profiler).
For a compiled path (``stock-compile``, ``cutile-compile``) the same step and kernel list come from
the bench's compiled decoder (StaticCache, ``torch.compile(mode="reduce-overhead")``), so the two
lists can be read side by side (the compiled step's list also has the greedy pick's kernels).
A step much slower than its replay is host-bound. ``--ab-cache-kernel`` also captures the same step
with transformers' own cache writes (``DecodeGraphs.cache_kernel`` off) and times the two graphs'
replays in alternating rounds, in one process: the whole model's step with and without
``kv_append``; ``--ab-splits`` likewise with the split-KV choice before 2026-12-03;
``--ab-rope-append`` with RoPE, the cache write and the attention as three launches (no ``rope_append``, no
one launch: ``rope_append_attention`` is armed by default, so the shipped arm runs it);
``--ab-rope-attend`` with ``rope_append_attention`` (RoPE, the cache write and the attention in one launch) armed
or not, the other way from the default;
``--ab-pdl`` with the step captured with programmatic dependent launch the other way from the default
(``DecodeGraphs.pdl``: our kernels may start while the one before them finishes);
``--ab-lengths`` with each full layer advancing its own cache length (16 launches for Llama-3.2-1B)
instead of the one advance of the grouped lengths (``decode_graphs._group_lengths``); ``--ab-gemv-upto N``
with the batch-1 GEMV (patch ``gemv``) also taking projections up to ``N`` wide (``ops.gemv.TILE_BY_N``
extended by ``--ab-gemv-tile``; e.g. 3072 takes Llama-3.2-1B's stacked q/k/v). For a compiled path
``--ab-guards`` times the step with dynamo's guard check and without it
(``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``: only the guards that tell its cache
entries apart), in alternating rounds: what the guards cost the step on this host; ``--ab-compiled NAME``
times the step as shipped and with a switch of :data:`COMPILED_SWITCHES` (``ropeattend-off``, ``residual``)
flipped, in alternating rounds, in one process (each is read while dynamo traces: flipped, dynamo compiles a
second cache entry beside the first, each with its CUDA graphs); ``--host`` the
host time to submit a compiled step against its kernels' span on the GPU (host-bound or not).
``--host-profile N`` lists the N host functions that take a decode-graph step's host time (cProfile,
the timed steps again); for a compiled path, those of its compiled steps, by own and by cumulative time. ``--bind-instances`` binds each decoder module's own class forward to the instance first (as
``kernels.kernelize`` and our patches bind theirs; nothing else changes): on a stock path, what
that binding alone costs a compiled step. On the GPU machine::

    python3 dev/diagnostics/graph_step.py llama-3.2-1b --path cutile-graphs --batch 1 16 --ab-cache-kernel
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch


def _captured(model, graphs, batch: int, args, cache_kernel: bool, profile: bool = False):
    """A fresh static cache filled by a prompt, its step captured; returns (entry, cache, step ms
    as the bench times it, host ms of those steps). Replays advance the cache's length: rewind with
    :func:`_rewind` to the length it has on return (``cache._lengths``) before each timing."""
    from transformers import StaticCache

    graphs.cache_kernel = cache_kernel  # read when the session meets a cache first
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
        if profile and args.host_profile:  # the host's functions over the same steps
            last = [nxt]

            def one():
                last[0] = step(last[0], past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            _host_profile(one, args.steps, f"steps at batch {batch}", args.host_profile, ("tottime",))
    entry = next(e for k, e in graphs.entries.items() if k[0] == id(cache) and e.graph is not None)
    cache._lengths = [int(layer.cumulative_length) for layer in cache.layers]
    return entry, cache, statistics.median(ev_ms), statistics.median(host_ms)


def _host_profile(run, steps: int, what: str, top: int, keys: tuple) -> None:
    """Print the ``top`` host functions of ``steps`` calls of ``run`` (cProfile, sorted by each of
    ``keys``), each call waited for on the GPU outside the profile: the next starts on an idle stream."""
    prof = cProfile.Profile()
    for _ in range(steps):
        prof.enable()
        run()
        prof.disable()
        torch.cuda.synchronize()
    for key in keys:
        print(f"host functions of {steps} {what} (cProfile, by {key}):")
        pstats.Stats(prof).sort_stats(key).print_stats(top)


@contextlib.contextmanager
def _set_in(modules, name: str, value):
    """``name`` set to ``value`` in each of ``modules`` (every loaded copy of a package module: the
    source package and the build variant ``kernels`` loads), put back on exit."""
    before = [getattr(m, name) for m in modules]
    for m in modules:
        setattr(m, name, value)
    try:
        yield
    finally:
        for m, v in zip(modules, before):
            setattr(m, name, v)


def _rewind(cache) -> None:
    # Back to the length after the timed steps, so that replays never write past the cache (a
    # replay of transformers' writes would index past it: a device-side assert).
    with torch.inference_mode():  # the lengths are inference tensors (the steps ran in inference mode)
        for layer, n in zip(cache.layers, cache._lengths):
            layer.cumulative_length.fill_(n)


def _replay_ms(entry, cache, n: int) -> float:
    _rewind(cache)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        entry.graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


def _alternating(ours, theirs, steps: int) -> tuple[float, float]:
    """Median replay ms of two captured steps, each ``(entry, cache)``, timed in 10 alternating
    rounds (a drifting clock slows both alike)."""
    times = ([], [])
    for _ in range(10):
        for side, (entry, cache) in zip(times, (ours, theirs)):
            side.append(_replay_ms(entry, cache, steps))
    return statistics.median(times[0]), statistics.median(times[1])


def _kernels(run, n: int, top: int) -> float:
    """Profile ``n`` calls of ``run``; print the ``top`` kernels by device time a call; returns the
    device microseconds a call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            run()
        torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total / n, e.count / n) for e in prof.key_averages()), key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    print(f"  {total:8.1f} us a step, {sum(r[2] for r in rows):6.1f} kernels a step")
    for name, us, k in rows[:top]:
        print(f"  {us:8.1f} us {us / total:6.1%} x{k:5.1f}  {name[:110]}")
    return total


#: The decode tiles' keys per tile by padded head dim before 2026-12-04 (what ``--ab-splits`` compares
#: against counted its KV tiles in these).
PREVIOUS_DECODE_BN = {64: 128, 128: 128, 256: 64}


def _previous_num_splits(bn: int):
    """The split-KV choice before 2026-12-03, with ``num_splits``'s arguments, for ``--ab-splits``:
    no split from one block per SM up; below that, enough splits for ``2 * sms`` blocks with at least
    2 KV tiles of ``bn`` keys each."""
    def choose(blocks: int, keys: int, sms: int) -> int:
        tiles = -(-keys // bn)
        if blocks >= sms or tiles < 4:
            return 1
        return max(1, min(-(-2 * sms // blocks), tiles // 2, 64))
    return choose


def _bind_instances(model) -> int:
    """Bind its class's own forward to every module under the decoder stack that has none on the
    instance (the same code: only where dynamo finds the forward changes); returns how many."""
    import types

    n = 0
    for m in model.model.modules():
        if "forward" not in m.__dict__ and m is not model.model:
            m.forward = types.MethodType(type(m).forward, m)
            n += 1
    return n


def _host_and_span(dec, steps: int) -> dict:
    """Medians over ``steps`` compiled steps of the host time to submit one (the bench's
    ``Timer.host_ms`` of ``Decoder.step``: the position tensor, the step's call and the greedy pick,
    before waiting for the GPU), of its GPU span (first kernel start to last kernel end,
    torch.profiler) and of its kernels' summed time: a step whose host time reaches its span is
    host-bound; a span well over the kernels' sum is gaps between kernels."""
    from torch.profiler import ProfilerActivity, profile

    host, spans, busy = [], [], []
    for _ in range(steps):  # each step waits for the GPU at its end: the next starts on an idle stream
        dec.step()
        host.append(dec.timer.host_ms)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            dec.step()
    events = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    groups = []  # each step starts with its position's host-to-device copy
    for start, end, name in events:
        if name.startswith("Memcpy HtoD"):
            groups.append([])
        elif groups and not name.startswith(("Memcpy", "Memset")):
            groups[-1].append((start, end))
    groups = [g for g in groups if g]
    if len(groups) != steps:
        raise RuntimeError(f"--host: {len(groups)} steps found in the profile of {steps}")
    for group in groups:
        spans.append(max(e for _, e in group) - group[0][0])
        busy.append(sum(e - s for s, e in group))
    return {"host_ms": statistics.median(host), "gpu_span_ms": statistics.median(spans) / 1e3,
            "gpu_kernels_ms": statistics.median(busy) / 1e3}


#: Switches of the compiled step for ``--ab-compiled``: name -> (package module, attribute, the value the
#: A/B sets against the shipped one, from this package's copy). Each is read while dynamo traces the step.
#: ``ropeattend-off``: the two launches (``rope_append``, then the masked attention) the one launch replaced
#: by default on 2026-12-07; ``residual``: ``gemv_residual`` on every built tile (staged, off as shipped).
COMPILED_SWITCHES = {
    "ropeattend-off": ("layers._direct", "COMPILED_ROPE_ATTEND", lambda: False),
    "residual": ("ops.gemv", "RESIDUAL_TILES", lambda: __import__("cutile_kernels.kernel_src.gemv",
                                                                  fromlist=["TILES"]).TILES),
}


def switch_modules(name: str) -> tuple[list, str, object]:
    """``(modules, attribute, on value)`` of :data:`COMPILED_SWITCHES` ``name``: the module in every
    loaded copy of the package (the source package and the build variant ``kernels`` loads).

    Raises:
        KeyError: ``name`` is not a switch."""
    module, attr, on = COMPILED_SWITCHES[name]
    from cutile_kernels_tools.bench.worker import runtime_copies

    packages = [d.__name__.rsplit(".", 1)[0] for d in runtime_copies()]
    mods = [sys.modules[f"{p}.{module}"] for p in packages if f"{p}.{module}" in sys.modules]
    return mods, attr, on()


def _ab_compiled(dec, name: str, steps: int, rounds: int = 10) -> dict:
    """Median step ms of the compiled step as shipped and with switch ``name`` flipped, in ``rounds``
    alternating rounds of ``steps // 2`` steps a side (one decoder: both write the same cache)."""
    mods, attr, on = switch_modules(name)
    if not mods:
        raise RuntimeError(f"--ab-compiled {name}: no loaded copy of the package has {COMPILED_SWITCHES[name][0]}")
    with _set_in(mods, attr, on):
        for _ in range(5):  # dynamo traces the other entry; its CUDA graphs record
            dec.step()
    times = ([], [])
    for _ in range(rounds):
        times[0].extend(dec.step() for _ in range(steps // 2))
        with _set_in(mods, attr, on):
            times[1].extend(dec.step() for _ in range(steps // 2))
    return {"ab_step_ms_shipped": statistics.median(times[0]), f"ab_step_ms_{name}": statistics.median(times[1])}


def _compiled(model, args) -> None:
    """The compiled decode step of the bench (``tools/bench/worker.Decoder``), timed and profiled."""
    from cutile_kernels_tools.bench.worker import Decoder

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from guards import check_us

    for batch in args.batch:
        rounds = 10 if args.ab_guards else 0
        room = (3 + 2 * args.host + rounds + (10 if args.ab_compiled else 0)) * args.steps + 30
        dec = Decoder(model, batch, args.prompt, room, "cuda", True, seed=0)
        dec.prefill()
        for _ in range(5):  # compile and record the graphs
            dec.step()
        step_ms = statistics.median(dec.step() for _ in range(args.steps))
        row = {"model": args.model, "path": args.path, "batch": batch, "step_ms": step_ms}
        if args.host:
            row.update(_host_and_span(dec, args.steps))
        if rounds:
            times = ([], [])
            for _ in range(rounds):  # alternating, each round args.steps // 2 steps a side
                times[0].extend(dec.step() for _ in range(args.steps // 2))
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    times[1].extend(dec.step() for _ in range(args.steps // 2))
            row.update(ab_step_ms_guards=statistics.median(times[0]), ab_step_ms_no_guards=statistics.median(times[1]))
            with torch.inference_mode():  # the steps' mode; one eager step writes the next position
                pos = torch.tensor([dec.pos], device="cuda")
                row["guard_check_us_per_entry"] = check_us(
                    model, (dec.next,), dict(past_key_values=dec.cache, use_cache=True, cache_position=pos), 200)
        if args.ab_compiled:
            row.update(_ab_compiled(dec, args.ab_compiled, args.steps))
        print(json.dumps(row))
        if args.host_profile:
            _host_profile(dec.step, args.steps, f"compiled steps at batch {batch}", args.host_profile,
                          ("tottime", "cumulative"))
        if args.top:
            _kernels(dec.step, 5, args.top)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="preset name or checkpoint directory")
    ap.add_argument("--path", default="cutile-graphs")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--top", type=int, default=25, help="kernels listed from the profile")
    ap.add_argument("--ab-cache-kernel", action="store_true",
                    help="also time the step with transformers' cache writes, alternating with ours")
    ap.add_argument("--ab-splits", action="store_true",
                    help="also time the step captured with the previous split-KV choice, alternating with ours")
    ap.add_argument("--ab-rope-append", action="store_true",
                    help="also time the step with RoPE, kv_append and the attention as three launches, alternating with ours")
    ap.add_argument("--ab-rope-attend", action="store_true",
                    help="also time the step with rope_append_attention (RoPE, the cache write and the attention "
                         "in one launch) armed or not, the other way from the default, alternating with ours")
    ap.add_argument("--ab-lengths", action="store_true",
                    help="also time the step with a length advance per layer, alternating with ours")
    ap.add_argument("--ab-gemv-upto", type=int, default=0, metavar="N",
                    help="also time the step with the one-row GEMV taking projections up to N wide (on the "
                         "--ab-gemv-tile), alternating with ours")
    ap.add_argument("--ab-gemv-tile", type=int, nargs=2, default=(16, 256), metavar=("BN", "BK"),
                    help="the built GEMV tile --ab-gemv-upto adds (default 16 256)")
    ap.add_argument("--ab-pdl", action="store_true",
                    help="also time the step captured with programmatic dependent launch the other way from the "
                         "default (DecodeGraphs.pdl), alternating with the shipped one")
    ap.add_argument("--ab-guards", action="store_true",
                    help="compiled paths: also time the step without dynamo's guard check, alternating")
    ap.add_argument("--ab-compiled", choices=sorted(COMPILED_SWITCHES), default=None,
                    help="compiled paths: also time the step with this switch flipped, alternating with the "
                         "shipped step in one process")
    ap.add_argument("--host", action="store_true",
                    help="compiled paths: also the host time to submit a step and the step's GPU span")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="the top N host functions of the timed steps (cProfile; compiled paths: by own and cumulative time)")
    ap.add_argument("--bind-instances", action="store_true",
                    help="bind every decoder module's own class forward to its instance first")
    args = ap.parse_args(argv)

    from cutile_kernels.layers import decode_graphs as dg
    from cutile_kernels_tools import presets
    from cutile_kernels_tools.bench import paths

    ckpt, _ = presets.resolve(args.model, device="cuda")
    model = paths.load(args.path, ckpt, torch.bfloat16, "cuda")
    if args.bind_instances:
        print(json.dumps({"bound_instances": _bind_instances(model)}))
    if paths.spec(args.path).compile:
        return _compiled(model, args)
    graphs = getattr(model, dg.ATTR)
    for batch in args.batch:
        entry, cache, step_ms, host_ms = _captured(model, graphs, batch, args, cache_kernel=True, profile=True)
        replay_ms = _replay_ms(entry, cache, args.steps)
        row = {"model": args.model, "path": args.path, "batch": batch, "step_ms": step_ms, "step_host_ms": host_ms,
               "replay_ms": replay_ms}
        if args.ab_cache_kernel:
            stock_entry, stock_cache, stock_step, _ = _captured(model, graphs, batch, args, cache_kernel=False)
            ours, theirs = _alternating((entry, cache), (stock_entry, stock_cache), args.steps)
            row.update(ab_replay_ms_kv_append=ours, ab_replay_ms_stock_writes=theirs, ab_step_ms_stock_writes=stock_step)
        if args.ab_splits:
            # this package's ops and the hub build's copy of them, whichever the model calls
            mods = [m for n, m in list(sys.modules.items()) if n.endswith(".ops.attention") and hasattr(m, "num_splits")]
            cfg = model.config.get_text_config()
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            dp = mods[0].tiles_for(head_dim, 1, 1)[0]
            previous = _previous_num_splits(PREVIOUS_DECODE_BN[dp])
            with _set_in(mods, "num_splits", previous):  # a graph captured now keeps the previous choice's launches
                old_entry, old_cache, old_step, _ = _captured(model, graphs, batch, args, cache_kernel=True)
            ours, theirs = _alternating((entry, cache), (old_entry, old_cache), args.steps)
            row.update(ab_replay_ms_splits_now=ours, ab_replay_ms_splits_before=theirs, ab_step_ms_splits_before=old_step)
        if args.ab_rope_append:
            # Every loaded copy arms its layers under another attribute name, which the attention
            # forwards do not look up, and none gets the one launch: a graph captured now runs RoPE, kv_append
            # and the attention apart.
            mods = [m for n, m in list(sys.modules.items()) if n.endswith(".layers.decode_graphs")]
            with _set_in(mods, "ROPE_UPDATE", "_cutile_rope_update_unused"), _set_in(mods, "ROPE_ATTEND_ON", False):
                two_entry, two_cache, two_step, _ = _captured(model, graphs, batch, args, cache_kernel=True)
            ours, theirs = _alternating((entry, cache), (two_entry, two_cache), args.steps)
            row.update(ab_replay_ms_shipped=ours, ab_replay_ms_three_launches=theirs, ab_step_ms_three_launches=two_step)
        if args.ab_rope_attend:
            # Every loaded copy arms the layers of a cache met now the other way round from the
            # default (decode_graphs.ROPE_ATTEND_ON): the one launch against rope_append, then attention.
            mods = [m for n, m in list(sys.modules.items()) if n.endswith(".layers.decode_graphs")]
            on = dg.ROPE_ATTEND_ON
            with _set_in(mods, "ROPE_ATTEND_ON", not on):
                other_entry, other_cache, other_step, _ = _captured(model, graphs, batch, args, cache_kernel=True)
            ours, theirs = _alternating((entry, cache), (other_entry, other_cache), args.steps)
            one, two = (ours, theirs) if on else (theirs, ours)
            row.update(ab_replay_ms_rope_append_attention=one, ab_replay_ms_rope_append_then_attention=two,
                       **{f"ab_step_ms_{'rope_append_then_attention' if on else 'rope_append_attention'}": other_step})
        if args.ab_lengths:
            # Every loaded copy leaves the caches it arms now ungrouped: each layer advances its own length.
            mods = [m for n, m in list(sys.modules.items()) if n.endswith(".layers.decode_graphs")]
            with _set_in(mods, "_group_lengths", lambda cache, layers: None):
                per_entry, per_cache, per_step, _ = _captured(model, graphs, batch, args, cache_kernel=True)
            ours, theirs = _alternating((entry, cache), (per_entry, per_cache), args.steps)
            row.update(ab_replay_ms_one_advance=ours, ab_replay_ms_per_layer_advances=theirs,
                       ab_step_ms_per_layer_advances=per_step)
        if args.ab_gemv_upto:
            # Every loaded copy of the router takes the wider projections while the graph is captured.
            mods = [m for n, m in list(sys.modules.items()) if n.endswith(".ops.gemv") and hasattr(m, "TILE_BY_N")]
            wider = mods[0].TILE_BY_N + ((args.ab_gemv_upto, tuple(args.ab_gemv_tile)),)
            with _set_in(mods, "TILE_BY_N", wider):
                wide_entry, wide_cache, wide_step, _ = _captured(model, graphs, batch, args, cache_kernel=True)
            ours, theirs = _alternating((entry, cache), (wide_entry, wide_cache), args.steps)
            row.update(ab_replay_ms_shipped=ours, ab_replay_ms_gemv_wider=theirs, ab_step_ms_gemv_wider=wide_step)
        if args.ab_pdl:
            on = graphs.pdl
            graphs.pdl = not on  # read at each capture
            try:
                other_entry, other_cache, other_step, _ = _captured(model, graphs, batch, args, cache_kernel=True)
            finally:
                graphs.pdl = on
            ours, theirs = _alternating((entry, cache), (other_entry, other_cache), args.steps)
            with_pdl, without = (ours, theirs) if on else (theirs, ours)
            row.update(ab_replay_ms_pdl=with_pdl, ab_replay_ms_no_pdl=without,
                       **{f"ab_step_ms_{'no_pdl' if on else 'pdl'}": other_step})
        _rewind(cache)
        print(json.dumps(row))
        _kernels(entry.graph.replay, 5, args.top)


if __name__ == "__main__":
    main()
