"""``cutile-kernels kernel-table``: each kernel against the stock code path doing the same work.

For every Solution of the inventory and every Workload of its Definition (the presets' real
shapes; ``models`` keeps those whose uuid starts with a preset's name), on one CUDA device:

* ``ours``: the Solution's entry (our op, one cuTile launch or a few);
* ``stock``: the Definition's reference, which is the transformers code the stock model runs for
  that work (e.g. ``LlamaRMSNorm.forward``: pow, mean, rsqrt, two muls and two casts), in the
  Workload's dtypes; where the reference differs from what the stock model runs, :data:`STOCK`
  gives the stock code instead (``silu_and_mul_fused``: the stock MLP has no fused tensor, it runs
  ``silu(gate) * up`` on the two projections' outputs);

each timed twice: device microseconds per call from CUDA-graph replays (:func:`.timing.graph_us`:
the launch gaps of the host are out, so this is the kernels' own time) and eager microseconds per
call (:func:`.timing.events_us`: host launch cost included, what an eager model step pays). Calls
rotate over enough input sets to move twice the L2 cache per round (:func:`input_sets`, at most
32), so a prefill-sized Workload is timed from device memory, not from the L2 its last call
filled; decode-sized ones stay in the L2, as they do inside a model step. The
roofline fraction is the fewest bytes the work must move (each tensor input read once, each output
written once) over the device time, against the copy bandwidth measured at the start
(:func:`.limits.measure`: a device-to-device copy, bytes read plus written): every kernel here is
memory-bound, so that is its ceiling.

Definitions whose reference is not the stock path (``attention``: a plain float32 softmax, where
stock runs sdpa) are left out with the reason; ``dev/microbench/attention_bench.py`` times our attention
against sdpa. A row whose call launched none of our kernels (a fallback) is marked so, not timed (the CLI then
exits 1).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

#: Definitions whose reference is not the code the stock model runs, and where to look instead.
NOT_STOCK = {
    "attention": "its reference is a float32 softmax, stock runs sdpa: see dev/microbench/attention_bench.py",
}


def _stock_silu_and_mul_fused(x):
    """LlamaMLP's ``act_fn(gate_proj(x)) * up_proj(x)``: two separate, contiguous GEMM outputs
    (the split and copies happen here, untimed; the reference's own copy of the gate half is for
    CPU bit-matching and is not what the stock model runs)."""
    gate, up = (h.contiguous() for h in x.chunk(2, dim=-1))
    return (lambda g, u: F.silu(g) * u), (gate, up)


#: Definition -> f(*inputs) -> (stock callable, its arguments), where the stock model's code for
#: the work is not the Definition's reference.
STOCK = {"silu_and_mul_fused": _stock_silu_and_mul_fused}


@dataclass
class Row:
    """One kernel on one Workload. Times in microseconds per call; ``None`` where not measured."""

    solution: str
    definition: str
    workload: str
    bytes_moved: int
    ours_graph_us: float | None = None
    stock_graph_us: float | None = None
    ours_eager_us: float | None = None
    stock_eager_us: float | None = None
    ours_roofline: float | None = None
    stock_roofline: float | None = None
    note: str = ""

    @property
    def speedup(self) -> float | None:
        """Stock device time over ours (>1: ours is faster)."""
        if self.ours_graph_us and self.stock_graph_us:
            return self.stock_graph_us / self.ours_graph_us
        return None


def moved_bytes(args, outs) -> int:
    """Bytes the work must move at least: every tensor in ``args`` read once, every tensor in
    ``outs`` (a tensor or a tuple of them) written once. Python scalars count nothing."""
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return sum(t.numel() * t.element_size() for t in (*args, *outs) if isinstance(t, torch.Tensor))


def roofline_fraction(bytes_moved: int, us: float | None, bandwidth_Bps: float) -> float | None:
    """Achieved bytes per second over ``bandwidth_Bps`` (bytes read plus written per second)."""
    if not us or not bandwidth_Bps:
        return None
    return bytes_moved / (us * 1e-6) / bandwidth_Bps


def input_sets(bytes_moved: int, l2_bytes: int, most: int = 32) -> int:
    """How many input sets the calls rotate over: enough that one pass moves at least twice
    ``l2_bytes`` (so no call finds its inputs in the L2 cache), at most ``most``."""
    return max(1, min(most, math.ceil(2 * l2_bytes / max(bytes_moved, 1))))


def select(inv, solutions=None, models=None) -> tuple[list[tuple], dict[str, str]]:
    """(Solution, Definition, Workload) triples to measure (Solutions in the order given, each once;
    default: all, by name) and the skipped Solutions as ``{name: reason}``.

    Raises:
        KeyError: an unknown Solution name.
        ValueError: a model that names no Workload of the selected Solutions (presets are the
            uuid prefixes, e.g. ``qwen3-0.6b``).
    """
    names = sorted(inv.solutions) if not solutions else list(dict.fromkeys(solutions))
    unknown = [n for n in names if n not in inv.solutions]
    if unknown:
        raise KeyError(f"unknown Solutions {unknown}; known: {', '.join(sorted(inv.solutions))}")
    if models:
        prefixes = {w.uuid.split("/")[0] for n in names for w in inv.workloads.get(inv.solutions[n].definition, [])}
        missing = [m for m in models if m not in prefixes]
        if missing:
            raise ValueError(f"no Workload of these Solutions for {missing}; known: {', '.join(sorted(prefixes))}")
    out, skipped = [], {}
    for name in names:
        s = inv.solutions[name]
        d = inv.definitions[s.definition]
        if d.name in NOT_STOCK:
            skipped[name] = NOT_STOCK[d.name]
            continue
        for w in inv.workloads.get(d.name, []):
            if models and not any(w.uuid.startswith(f"{m}/") for m in models):
                continue
            out.append((s, d, w))
    return out, skipped


def measure(inv, triples, device: str = "cuda", *, bandwidth_Bps: float, l2_bytes: int = 0, launches=None,
            seed: int = 0, graph_timer=None, eager_timer=None) -> list[Row]:
    """Time each (Solution, Definition, Workload) triple, ours and stock (see the module docstring).

    ``launches`` counts our kernel launches so far (``evaluate.launch_count``); a call that does not
    raise it is a fallback and its row is not timed. ``l2_bytes`` sets the input rotation
    (:func:`input_sets`; 0: one set). The timers take a callable that makes ``n`` calls and the
    ``n``, and return microseconds per call; they default to :func:`.timing.graph_us` and
    :func:`.timing.events_us`.
    """
    from . import evaluate
    from .. import inventory, timing

    graph_timer = graph_timer or (lambda fn, n: timing.graph_us(fn, per_graph=max(1, 10 // n)) / n)
    eager_timer = eager_timer or (lambda fn, n: timing.events_us(fn, reps=5, inner=max(1, 50 // n)) / n)
    rows, entries, refs = [], {}, {}
    for s, d, w in triples:
        if s.name not in entries:
            entries[s.name] = evaluate.load_entry(s)
        if d.name not in refs:
            refs[d.name] = inventory.load_reference(d)
        fn = entries[s.name]
        args = evaluate.reference_inputs(d, evaluate.make_inputs(d, w, device, seed=seed, root=inv.root))
        before = launches() if launches else 0
        outs = fn(*args)
        timing.synchronize(device)
        row = Row(s.name, d.name, w.uuid, moved_bytes(args, outs))
        if launches is not None and launches() <= before:
            row.note = "fallback: none of our kernels launched"
            rows.append(row)
            continue
        n = input_sets(row.bytes_moved, l2_bytes) if l2_bytes else 1
        sets = [args] + [evaluate.reference_inputs(d, evaluate.make_inputs(d, w, device, seed=seed + i, root=inv.root))
                         for i in range(1, n)]
        stock, stock_sets = refs[d.name], sets
        if d.name in STOCK:
            stock, stock_sets = STOCK[d.name](*sets[0])[0], [STOCK[d.name](*a)[1] for a in sets]

        def rotate(f, sets):
            def calls():
                for a in sets:
                    f(*a)
            return calls

        row.ours_graph_us = graph_timer(rotate(fn, sets), n)
        row.stock_graph_us = graph_timer(rotate(stock, stock_sets), n)
        row.ours_eager_us = eager_timer(rotate(fn, sets), n)
        row.stock_eager_us = eager_timer(rotate(stock, stock_sets), n)
        row.ours_roofline = roofline_fraction(row.bytes_moved, row.ours_graph_us, bandwidth_Bps)
        row.stock_roofline = roofline_fraction(row.bytes_moved, row.stock_graph_us, bandwidth_Bps)
        rows.append(row)
    return rows


def run(root: Path | None = None, solutions=None, models=None, device: str = "cuda", seed: int = 0) -> dict:
    """Measure the table on ``device``; returns ``{"limits", "rows", "skipped"}`` (rows as dicts).

    Raises:
        ValueError: ``device`` is not a CUDA device torch can see (graph timing needs CUDA), or a
            model names no Workload.
        KeyError: an unknown Solution name.
    """
    from . import evaluate
    from .. import inventory
    from ..bench import limits

    inv = inventory.Inventory.load(root)
    triples, skipped = select(inv, solutions, models)
    if not device.startswith("cuda"):
        raise ValueError(f"kernel-table times CUDA graphs: needs a CUDA device, not {device!r}")
    if not torch.cuda.is_available():
        raise ValueError("kernel-table times CUDA graphs: torch sees no CUDA device")
    lim = limits.measure(device)
    lim["l2_bytes"] = torch.cuda.get_device_properties(torch.device(device)).L2_cache_size
    rows = measure(inv, triples, device, bandwidth_Bps=lim["copy_bandwidth_Bps"], l2_bytes=lim["l2_bytes"],
                   launches=evaluate.launch_count, seed=seed)
    return {"limits": lim, "rows": [{**asdict(r), "speedup": r.speedup} for r in rows], "skipped": skipped}


def markdown(report: dict) -> str:
    """The report as a markdown table, one row per kernel and Workload, then per-kernel medians."""
    def us(v):
        return "-" if v is None else f"{v:.1f}"

    def pct(v):
        return "-" if v is None else f"{100 * v:.0f}%"

    bw = report["limits"]["copy_bandwidth_Bps"] / 1e12
    l2 = report["limits"].get("l2_bytes")
    rotation = f"; calls rotate over input sets moving twice the {l2 / 2**20:.0f} MiB L2 per round" if l2 else ""
    lines = [f"Device time from CUDA-graph replays, eager time with host launch cost, microseconds per call; "
             f"roofline: fewest bytes moved over device time, against the {bw:.2f} TB/s copy bandwidth{rotation}.", "",
             "| kernel | workload | MB moved | ours us | stock us | speedup | ours % roof | stock % roof "
             "| ours eager us | stock eager us | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        lines.append(f"| {r['solution']} | {r['workload']} | {r['bytes_moved'] / 1e6:.3f} | {us(r['ours_graph_us'])} "
                     f"| {us(r['stock_graph_us'])} | {sp} | {pct(r['ours_roofline'])} | {pct(r['stock_roofline'])} "
                     f"| {us(r['ours_eager_us'])} | {us(r['stock_eager_us'])} | {r['note']} |")
    by = {}
    for r in report["rows"]:
        if r["speedup"] is not None:
            by.setdefault(r["solution"], []).append(r)
    if by:
        lines += ["", "| kernel | workloads | median speedup (device) | median eager speedup |", "|---|---|---|---|"]
        for name, rs in sorted(by.items()):
            dev = statistics.median(r["speedup"] for r in rs)
            eager = statistics.median(r["stock_eager_us"] / r["ours_eager_us"] for r in rs)
            lines.append(f"| {name} | {len(rs)} | {dev:.2f}x | {eager:.2f}x |")
    for name, why in sorted(report["skipped"].items()):
        lines.append(f"\n{name}: not in the table, {why}.")
    for name in sorted({r["definition"] for r in report["rows"]} & set(STOCK)):
        lines.append(f"\n{name}: stock is {STOCK[name].__doc__.split(':')[0]}, not the Definition's reference.")
    return "\n".join(lines) + "\n"


__all__ = ["NOT_STOCK", "STOCK", "Row", "input_sets", "markdown", "measure", "moved_bytes", "roofline_fraction", "run", "select"]
