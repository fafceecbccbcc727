"""``cutile-kernels bench``: one checkpoint run every way a user might run it, side by side.

For a checkpoint directory or a preset (:mod:`..presets`) the bench runs, each in its own process so
that no patch leaks from one path into another:

1. the machine's limits (:mod:`.limits`): copy bandwidth and matmul rate, for roofline fractions;
2. the stock model in float32, whose logits on a seeded prompt batch are the reference (random
   weights give near-uniform logits, so greedy tokens prove nothing);
3. every path of :mod:`.paths` that can run here (stock eager, stock with StaticCache + compile,
   Liger-Kernel, TileGym, ours eager, ours compiled): distance of its logits to the reference (max
   abs error, relative L2 error, KL divergence, top-5 agreement), prefill time and tokens/s
   (batch 1), time to first token and decode tokens/s per batch size (CUDA events, medians after a
   rehearsal and warm-up), peak memory, our launch counters, and for ours and stock the kernel
   coverage of a profiled prefill + decode (:mod:`.coverage`);
4. gates, for every path against stock eager: relative L2 error and KL within 1.1x, top-5
   agreement not significantly below (see :func:`gate`), on the prompt batch's logits (a forward
   without a cache) and on each decode batch size's teacher-forced decode steps (the path's own
   cache and decode step: the compiled call, the decode graphs; ``decode_correctness``).

The report (schema ``cutile-kernels/bench/2``, documented by :mod:`.schema`) is returned, printed
as a table and, with an output directory, written as ``bench.json``, ``report.md`` and PNG plots
(:mod:`.report`).
"""

from __future__ import annotations

import json
import multiprocessing
import platform
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import paths as bench_paths
from .. import presets
from ..metrics import logit_metrics, top5_hits  # noqa: F401 - logit_metrics stays part of this module's API

SCHEMA = "cutile-kernels/bench/2"


@dataclass
class BenchSettings:
    """What the bench runs. Lengths in tokens. Each of ``rounds`` timing rounds runs ``repeats`` timed
    prefills and ``decode_steps`` timed decode steps per batch size, after ``warmup`` untimed ones;
    ``warm_rounds`` untimed rounds over all paths come first (on the H200 the first round after the
    setups ran 10-50 % slower on every path)."""

    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    dtype: str = "bfloat16"
    seed: int = 0
    prompt_batch: int = 4
    prompt_len: int = 128
    prefill_len: int = 2048
    decode_batches: tuple = (1, 4, 16)
    decode_prompt_len: int = 128
    decode_steps: int = 32
    warmup: int = 3
    repeats: int = 10
    rounds: int = 3
    warm_rounds: int = 1
    #: Decode steps of the correctness check of each decode batch size (teacher-forced through the
    #: path's own cache and step, against a float32 forward over the same tokens; at most
    #: ``warmup + decode_steps`` or 3, whichever is more: what the timed decoders' caches hold).
    #: 32 steps give batch 1's paired top-5 test 160 slots.
    decode_check_steps: int = 32
    coverage: bool = True
    coverage_steps: int = 4
    #: Tokens of the coverage pass's prefill (at most ``prefill_len``).
    coverage_prefill_len: int = 512
    amdahl_speedup: float = 2.0
    paths: tuple = tuple(bench_paths.PATHS)
    timeout_s: int = 1800

    @classmethod
    def for_cpu(cls, **kw) -> "BenchSettings":
        """Small sizes for the embedded model on a CPU (runs in seconds per path)."""
        base = dict(device="cpu", prompt_len=16, prefill_len=32, decode_batches=(1, 4), decode_prompt_len=8,
                    decode_steps=6, warmup=1, repeats=3, rounds=2, coverage_steps=2)
        base.update(kw)
        return cls(**base)


# ---------------------------------------------------------------------------------------------
# Correctness
# ---------------------------------------------------------------------------------------------

def _checks(ours: dict, base: dict, hits, base_hits, prefix: str = "") -> list[dict]:
    # The three checks of one set of logit metrics against the baseline's (see gate).
    checks = [
        {"metric": prefix + "rel_l2_err", "path": ours["rel_l2_err"], "stock": base["rel_l2_err"],
         "passed": ours["rel_l2_err"] <= 1.1 * base["rel_l2_err"] + 1e-7},
        {"metric": prefix + "kl", "path": ours["kl"], "stock": base["kl"], "passed": ours["kl"] <= 1.1 * base["kl"] + 1e-9},
    ]
    top5 = {"metric": prefix + "top5_agreement", "path": ours["top5_agreement"], "stock": base["top5_agreement"]}
    if hits is not None and base_hits is not None:
        lost = int((base_hits & ~hits).sum())
        won = int((hits & ~base_hits).sum())
        top5.update(lost=lost, won=won, passed=lost - won <= 2 * (lost + won) ** 0.5)
    else:
        top5["passed"] = ours["top5_agreement"] >= base["top5_agreement"]
    return checks + [top5]


def gate(paths: dict, hits: dict | None = None, baseline: str = "stock", decode_hits: dict | None = None) -> dict:
    """Correctness gate of every path against ``baseline``.

    ``rel_l2_err`` and ``kl`` must be within 1.1x the baseline's. For top-5 agreement both paths
    are compared slot by slot with the reference's top 5: near-ties flip in bf16 for either path,
    so a path fails only if the slots it loses outnumber the ones it wins by more than two standard
    deviations (a one-sided sign test); the raw agreements are reported beside it. The same three
    checks run on each decode batch size's teacher-forced decode (``decode_correctness``, metrics
    named ``decode-b<N> <metric>``; ``decode_hits``: path -> batch -> slot hits) where both paths
    have it: a path missing one the baseline has fails.
    """
    base = paths[baseline]["correctness"]
    base_decode = {str(b): c for b, c in (paths[baseline].get("decode_correctness") or {}).items()}
    hits = hits or {}
    decode_hits = {n: {str(b): h for b, h in by_batch.items()} for n, by_batch in (decode_hits or {}).items()}
    out = {}
    for name, p in paths.items():
        if name == baseline or "correctness" not in p:
            continue
        checks = _checks(p["correctness"], base, hits.get(name), hits.get(baseline))
        decode = {str(b): c for b, c in (p.get("decode_correctness") or {}).items()}
        for b, ref in base_decode.items():
            if b not in decode:
                checks.append({"metric": f"decode-b{b} checked", "path": 0.0, "stock": 1.0, "passed": False})
                continue
            checks += _checks(decode[b], ref, decode_hits.get(name, {}).get(b), decode_hits.get(baseline, {}).get(b),
                              prefix=f"decode-b{b} ")
        out[name] = {"passed": all(c["passed"] for c in checks), "checks": checks}
    return out


# ---------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------

def _build_identity() -> dict | None:
    """Which build the ``cutile`` paths load: its directory, kernel-variant id (``metadata.json``),
    archs and kernels, so that a report says what was measured. None without a build."""
    from cutile_kernels import registry

    reg = registry.registry()
    if reg.pkg_dir is None:
        return None
    meta = reg.pkg_dir.parent / "metadata.json"
    return {"dir": str(reg.pkg_dir.parent), "id": json.loads(meta.read_text()).get("id") if meta.is_file() else None,
            "archs": list(reg.archs), "kernels": sorted({v.kernel for v in reg.variants()})}


def _environment(s: BenchSettings) -> dict:
    import importlib.metadata as md

    versions = {}
    for dist in ("torch", "transformers", "kernels", "cuda-tile", "cuda-bindings", "cutile-kernels",
                 "liger-kernel", "tilegym"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    env = {"python": platform.python_version(), "platform": platform.platform(), "versions": versions,
           "device": s.device, "cutile_build": _build_identity()}
    if s.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        env["torch_cuda"] = torch.version.cuda
    return env


class _Worker:
    """One job in a fresh interpreter (``multiprocessing`` spawn), driven over a pipe; see
    :func:`.worker.serve`. A reply is a dict with ``ok``; a crash, a timeout or an exception in the
    worker comes back as ``ok: False`` with the error and the tail of the worker's log."""

    def __init__(self, tmp: Path, name: str, kind: str, checkpoint: Path, s: BenchSettings, **extra):
        from . import worker

        job = {"kind": kind, "checkpoint": str(checkpoint), "settings": asdict(s), "log": str(tmp / f"{name}.log"),
               "reference": str(tmp / "reference.pt"), **extra}
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker.serve, args=(child, job), name=f"bench-{name}")
        self.proc.start()
        child.close()
        self.timeout_s, self.log = s.timeout_s, Path(job["log"])

    def call(self, cmd: str) -> dict:
        try:
            self.conn.send(cmd)
            if self.conn.poll(self.timeout_s):
                reply = self.conn.recv()
            else:
                reply = {"ok": False, "error": f"worker timed out after {self.timeout_s} s in {cmd}"}
        except (EOFError, OSError):
            self.proc.join(10)
            reply = {"ok": False, "error": f"worker exited ({self.proc.exitcode}) during {cmd}"}
        if not reply.get("ok"):
            reply.setdefault("log_tail", self.log.read_text()[-4000:] if self.log.is_file() else "")
            self.close()
        return reply

    def close(self) -> None:
        self.conn.close()
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def _one_shot(tmp: Path, kind: str, checkpoint: Path, s: BenchSettings) -> dict:
    w = _Worker(tmp, kind, kind, checkpoint, s)
    result = w.call("setup")
    if not result.get("ok"):
        raise RuntimeError(f"bench {kind} failed: {result.get('error')}\n{result.get('traceback', result.get('log_tail', ''))}")
    w.call("finish")
    w.close()
    return result


#: Written to ``out_dir`` after each timing round and removed once the report is: what a bench
#: killed before its end (a time limit) had measured, its paths' rounds so far.
PARTIAL = "bench.partial.json"


def _write_partial(report: dict, setups: dict, rounds: dict, s: BenchSettings, out_dir: str, done: int) -> None:
    from . import worker

    paths = dict(report["paths"])
    for name, rs in rounds.items():
        if rs:
            paths[name] = worker.combine_rounds(setups[name], rs, asdict(s))
    partial = {**report, "paths": paths, "partial": {"timing_rounds_done": done, "timing_rounds": s.rounds}}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / PARTIAL).write_text(json.dumps(partial, indent=1, default=str))


def run(model: str = "tiny", s: BenchSettings | None = None, out_dir: str | None = None, progress: bool = True) -> dict:
    """Run the bench on a preset name or checkpoint directory; returns the report (see module doc).

    Every path gets its own worker process, set up one after another (load, logits, coverage,
    rehearsal); then, after ``s.warm_rounds`` untimed rounds, the paths are timed in ``s.rounds``
    alternating rounds, the order rotated each round, so that a drift of the machine's clocks or of
    a neighbour's load falls on all of them. With ``out_dir``, :data:`PARTIAL` there holds the
    rounds done so far until the report replaces it (no gates, no ratios: the raw rounds).
    """
    from tqdm import tqdm

    from . import worker

    s = s or (BenchSettings() if torch.cuda.is_available() else BenchSettings.for_cpu())
    checkpoint, label = presets.resolve(model, seed=s.seed, device=s.device)
    report = {"schema": SCHEMA, "model": label, "checkpoint": str(checkpoint),
              "environment": _environment(s), "settings": asdict(s), "paths": {}, "skipped": {}}
    runnable = []
    for name in dict.fromkeys(s.paths):  # a path named twice runs once
        why = bench_paths.spec(name).unavailable(s.device)
        if why:
            report["skipped"][name] = why
        else:
            runnable.append(name)
    with tempfile.TemporaryDirectory(prefix="cutile-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        bar = tqdm(total=2 + len(runnable) * (2 + s.warm_rounds + s.rounds), desc="bench", disable=not progress)
        for kind in ("limits", "reference"):
            bar.set_postfix_str(kind)
            report[kind] = _one_shot(tmp, kind, checkpoint, s)
            bar.update()
        ref = torch.load(tmp / "reference.pt")
        workers, setups, rounds, hits, decode_hits = {}, {}, {}, {}, {}
        try:
            for name in runnable:
                bar.set_postfix_str(f"{name}: setup")
                spec = bench_paths.spec(name)
                workers[name] = _Worker(tmp, name, "path", checkpoint, s, path=name, top5=str(tmp / f"{name}.top5.pt"),
                                        decode_top5=str(tmp / f"{name}.decode-top5.pt"),
                                        coverage=s.coverage and (spec.ours or name == "stock"))
                setups[name] = workers[name].call("setup")
                if setups[name]["ok"]:
                    hits[name] = top5_hits(torch.load(tmp / f"{name}.top5.pt"), ref["logits"])
                    decode_hits[name] = {b: top5_hits(t, ref["decode_logits"][:int(b)])
                                         for b, t in torch.load(tmp / f"{name}.decode-top5.pt").items()}
                    rounds[name] = []
                else:
                    report["paths"][name] = setups[name]
                bar.update()
            for r in range(-s.warm_rounds, s.rounds):
                live = [n for n in runnable if n in rounds]
                for name in live[r % max(len(live), 1):] + live[:r % max(len(live), 1)]:
                    bar.set_postfix_str(f"{name}: " + (f"round {r + 1}/{s.rounds}" if r >= 0 else "warm round"))
                    result = workers[name].call("round")
                    if result["ok"]:
                        if r >= 0:
                            rounds[name].append(result)
                    else:
                        report["paths"][name] = result
                        del rounds[name]
                    bar.update()
                if out_dir is not None and r >= 0:
                    _write_partial(report, setups, rounds, s, out_dir, r + 1)
            for name in runnable:
                if name in rounds:
                    result = workers[name].call("finish")
                    if result["ok"]:
                        report["paths"][name] = {**worker.combine_rounds(setups[name], rounds[name], asdict(s)),
                                                 **result}
                    else:
                        report["paths"][name] = result
                bar.update()
        finally:
            for w in workers.values():
                w.close()
            bar.close()
    report["paths"] = {n: report["paths"][n] for n in runnable if n in report["paths"]}
    _derive(report, {n: h for n, h in hits.items() if report["paths"].get(n, {}).get("ok")}, s, decode_hits)
    if out_dir is not None:
        from . import report as report_out

        report_out.write(report, Path(out_dir))
        (Path(out_dir) / PARTIAL).unlink(missing_ok=True)
    return report


def round_ratios(path: dict, baseline: dict) -> dict[str, list[float]]:
    """Per timing round, how many times faster ``path`` ran than ``baseline``: the baseline's round
    median over the path's, for ``prefill`` and each ``decode-b<N>`` (keys as throughput figures).

    The paths alternate inside every round, so round by round they shared the machine's state;
    a drift between rounds (seen up to 1.8x on the H200 host) cancels in the ratio, where a median
    over all samples would mix it in. Figures either side lacks, or with a non-positive time, are
    left out.

    Raises:
        ValueError: the two report different numbers of rounds (they come from different runs).
    """
    def ratios(a, b):
        if not a or not b or min(a) <= 0 or min(b) <= 0:
            return None
        return [y / x for x, y in zip(a, b, strict=True)]

    out = {}
    r = ratios(path.get("prefill_ms", {}).get("round_medians"), baseline.get("prefill_ms", {}).get("round_medians"))
    if r:
        out["prefill"] = r
    base = {d["batch"]: d for d in baseline.get("decode", [])}
    for d in path.get("decode", []):
        r = ratios(d.get("step_ms", {}).get("round_medians"),
                   base.get(d["batch"], {}).get("step_ms", {}).get("round_medians"))
        if r:
            out[f"decode-b{d['batch']}"] = r
    return out


def _derive(report: dict, hits: dict, s: BenchSettings, decode_hits: dict | None = None) -> None:
    """Gates, roofline fractions and the did-our-kernels-run summary, from the raw results."""
    from .limits import roofline

    ok = {n: p for n, p in report["paths"].items() if p.get("ok")}
    if "stock" in ok:
        report["gate"] = gate(ok, hits, decode_hits=decode_hits)
        report["speedup_by_round"] = {n: round_ratios(p, ok["stock"]) for n, p in ok.items() if n != "stock"}
    else:
        report["ungated"] = "nothing was gated: the gates compare each path with stock eager (add stock to --paths)"
    for p in ok.values():
        p["roofline"] = roofline(report["limits"], p["weight_bytes"], p["n_params"], s.prefill_len,
                                 p["prefill_ms"]["median"], p["decode"])
    ran = {n: sum(p["runtime"]["launches"].values()) + sum(p["runtime"]["jit_launches"].values())
           for n, p in ok.items() if bench_paths.spec(n).ours}
    report["cutile_kernels_ran"] = any(ran.values())
    if ran and not report["cutile_kernels_ran"]:
        report["note"] = ("no cuTile kernel ran: " + ("the model is not on a CUDA device, so every layer "
                          "took its PyTorch reference path (read the correctness gates; the timings "
                          "compare reference code, not kernels)" if not s.device.startswith("cuda")
                          else "see paths.cutile.runtime.fallbacks"))


def print_report(report: dict, wide: bool = False, console=None) -> None:
    """The report as tables (rich): by default two that fit 100 columns (speed; correctness and
    memory), with ``wide`` one table of every column (as before, about 200 columns)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if console is None:
        from ..cli_args import table_width

        console = Console(width=table_width(200 if wide else 100))
    gates = report.get("gate", {})
    batches = sorted({d["batch"] for p in report["paths"].values() if p.get("ok") for d in p["decode"]})

    def gate_cell(name):
        return "-" if name not in gates else ("pass" if gates[name]["passed"] else "[red]FAIL[/red]")

    def decode_cell(name, p):  # the decode check's worst batch size's rel L2
        return max((f"{c['rel_l2_err']:.2e}" for c in (p.get("decode_correctness") or {}).values()),
                   key=float, default="-")

    decode_checked = any(p.get("decode_correctness") for p in report["paths"].values())

    def cov_cell(name, p, sep=" / "):
        cov = p.get("coverage")  # on the others' paths our share is 0 by design: "-"
        return (f"{cov['ours_time_share']:.1%}{sep}{cov['ours_launch_share']:.1%}"
                if cov and bench_paths.spec(name).ours else "-")

    if wide:
        tables = [Table(title=f"cutile-kernels bench: {report['model']}")]
        cols = [("path", lambda n, p: n), ("rel L2 err", lambda n, p: f"{p['correctness']['rel_l2_err']:.3e}"),
                ("KL", lambda n, p: f"{p['correctness']['kl']:.2e}"),
                ("top-5", lambda n, p: f"{p['correctness']['top5_agreement']:.4f}"), ("gate", lambda n, p: gate_cell(n)),
                *([("decode rel L2 (worst b)", decode_cell)] if decode_checked else []),
                ("prefill ms", lambda n, p: f"{p['prefill_ms']['median']:.2f}"),
                ("prefill % roof", lambda n, p: f"{p['roofline']['prefill_fraction']:.1%}"),
                ("TTFT ms (b1)", lambda n, p: f"{p['decode'][0]['ttft_ms']:.2f}"),
                ("decode tok/s", lambda n, p: ", ".join(f"b{d['batch']}: {d['tokens_per_s']:.1f}" for d in p["decode"])),
                ("decode % roof", lambda n, p: ", ".join(f"{d['fraction']:.1%}" for d in p["roofline"]["decode"])),
                ("peak GB", lambda n, p: f"{p['peak_memory_bytes'] / 1e9:.2f}"),
                ("ours: time / launches", lambda n, p: cov_cell(n, p))]
        layout = [cols]
    else:
        console.print(escape(f"cutile-kernels bench: {report['model']}"))
        console.print("(medians; --wide: one table with every column and the rooflines)")
    if "note" in report:  # before the tables: a CPU row's "speedup" is noise between two reference runs
        console.print(escape(report["note"]))
    if not wide:
        tables = [Table(title="speed: prefill and TTFT in ms, decode in tokens/s by batch size"),
                  Table(title="correctness against float32 (decode: the decode check's worst rel L2); ours: our "
                              "kernels' share of the profiled kernel time / of the launches")]
        speed = [("path", lambda n, p: n), ("prefill", lambda n, p: f"{p['prefill_ms']['median']:.2f}"),
                 ("TTFT", lambda n, p: f"{p['decode'][0]['ttft_ms']:.2f}")]
        speed += [(f"b{b}", lambda n, p, b=b: next((f"{d['tokens_per_s']:.1f}" for d in p["decode"]
                                                   if d["batch"] == b), "-")) for b in batches]
        speed += [("peak GB", lambda n, p: f"{p['peak_memory_bytes'] / 1e9:.2f}")]
        checks = [("path", lambda n, p: n), ("gate", lambda n, p: gate_cell(n)),
                  ("rel L2", lambda n, p: f"{p['correctness']['rel_l2_err']:.3e}"),
                  ("KL", lambda n, p: f"{p['correctness']['kl']:.2e}"),
                  ("top-5", lambda n, p: f"{p['correctness']['top5_agreement']:.4f}"),
                  ("ours", lambda n, p: cov_cell(n, p, "/"))]
        if decode_checked:
            checks.insert(5, ("decode", decode_cell))
        layout = [speed, checks]
    for table, cols in zip(tables, layout):
        for col, _ in cols:
            table.add_column(col, justify="left" if col == "path" else "right", no_wrap=True)
        for name, p in report["paths"].items():
            if not p.get("ok"):
                table.add_row(name, "[red]failed[/red]", *[""] * (len(cols) - 2))
                continue
            table.add_row(*[cell(name, p) for _, cell in cols])
        console.print(table)
    for name, p in report["paths"].items():
        if not p.get("ok"):
            console.print(escape(f"{name} failed: {p.get('error', '')}"))
        elif p.get("inert_patches"):
            console.print(escape(f"{name}: {', '.join(p['inert_patches'])} changed nothing in this model: the row "
                                 "measures the same model as without it"))
    lim = report["limits"]
    steps, asked = report["reference"].get("decode_check_steps"), report["settings"].get("decode_check_steps")
    if decode_checked and steps is not None:
        console.print(escape(f"decode check: {steps} teacher-forced steps per decode batch size" + (
            f" (--decode-check-steps asked {asked}; the check reuses the timed decoders' caches, which hold "
            "only the warm-up steps + --decode-steps)" if asked is not None and steps < asked else "")))
    console.print(f"limits on {lim['device']}: copy {lim['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, "
                  f"{lim['matmul_dtype']} matmul {lim['matmul_flops'] / 1e12:.1f} TFLOP/s")
    env = report["environment"]
    console.print(escape(f"device: {env.get('gpu', env['device'])}; versions: "
                         + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)))
    by_reason: dict = {}
    for name, why in report["skipped"].items():  # one line a reason: a CPU skips seven paths for one
        by_reason.setdefault(why, []).append(name)
    for why, names in by_reason.items():
        console.print(escape(f"skipped {', '.join(names)}: {why}"))
    for name, g in gates.items():
        if not g["passed"]:
            console.print(escape(f"gate FAILED for {name}: " + "; ".join(
                f"{c['metric']} {c['path']:.4g} vs stock {c['stock']:.4g}" for c in g["checks"] if not c["passed"])))
    if "ungated" in report:
        console.print(report["ungated"])
