"""The bench report on disk: ``bench.json``, ``report.md`` and PNG plots (matplotlib)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .schema import BenchReport


def write(report: dict, out: Path) -> list[Path]:
    """Validate ``report`` against the schema and write it; returns the files written."""
    BenchReport.model_validate(report)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "bench.json", out / "report.md"]
    files[0].write_text(json.dumps(report, indent=1) + "\n")
    for stale in ("throughput.png", "breakdown.png"):  # a reused directory keeps no old plot
        (out / stale).unlink(missing_ok=True)
    plots = [p for p in (plot_throughput(report, out / "throughput.png"),
                         plot_breakdown(report, out / "breakdown.png")) if p is not None]
    files[1].write_text(markdown(report, [p.name for p in plots]))
    return files + plots


def _ok(report):
    return {n: p for n, p in report["paths"].items() if p.get("ok")}


def markdown(report: dict, plots: list[str]) -> str:
    env, lim, s = report["environment"], report["limits"], report["settings"]
    lines = [f"# Bench: {report['model']}", ""]
    lines.append(f"Device: {env.get('gpu', env['device'])}; "
                 + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v) + ".")
    b = env.get("cutile_build")
    lines.append("Build measured: " + (f"`{b['id']}` ({', '.join(b['archs'])}): " + ", ".join(b["kernels"]) + "."
                                      if b else "none (every cutile layer took its PyTorch reference)."))
    lines.append(f"Limits measured at the start: copy {lim['copy_bandwidth_Bps'] / 1e12:.2f} TB/s (read + write), "
                 f"{lim['matmul_dtype']} matmul {lim['matmul_flops'] / 1e12:.1f} TFLOP/s (n = {lim['matmul_n']}).")
    lines.append(f"Each path runs in its own process; after an untimed rehearsal and {s.get('warm_rounds', 0)} "
                 f"untimed round(s) the paths are timed in {s.get('rounds', 1)} alternating rounds. Prefill: batch 1 x {s['prefill_len']} tokens, "
                 f"{s['repeats']} per round. Decode: greedy after {s['decode_prompt_len']} prompt tokens, "
                 f"{s['decode_steps']} steps per round after {s['warmup']} untimed. Medians over all samples. "
                 f"Correctness: {s['prompt_batch']} x {s['prompt_len']} seeded tokens against float32 stock logits"
                 + ("; the decode steps: see Decode correctness." if _decode_checked(report) else "."))
    if "note" in report:  # above the tables, where a CPU row's noise would read as a speedup
        lines += ["", f"**{report['note']}**"]
    lines += ["", "## Paths", "",
              "| path | rel L2 err | KL | top-5 | gate | prefill ms | prefill tok/s | % roof | TTFT ms b1 | "
              "decode tok/s | % roof | peak GB |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    gates = report.get("gate", {})
    for name, p in report["paths"].items():
        if not p.get("ok"):
            lines.append(f"| {name} | failed: {p.get('error', '')[:120]} |" + " |" * 11)
            continue
        c, r = p["correctness"], p["roofline"]
        gate = "-" if name not in gates else ("pass" if gates[name]["passed"] else "**FAIL**")
        lines.append(
            f"| {name} | {c['rel_l2_err']:.3e} | {c['kl']:.2e} | {c['top5_agreement']:.4f} | {gate} | "
            f"{p['prefill_ms']['median']:.2f} | {p['prefill_tokens_per_s']:.0f} | {r['prefill_fraction']:.1%} | "
            f"{p['decode'][0]['ttft_ms']:.2f} | "
            + ", ".join(f"b{d['batch']} {d['tokens_per_s']:.1f}" for d in p["decode"]) + " | "
            + ", ".join(f"{d['fraction']:.1%}" for d in r["decode"]) + f" | {p['peak_memory_bytes'] / 1e9:.2f} |")
    for name, why in report["skipped"].items():
        lines.append(f"| {name} | skipped: {why} |" + " |" * 11)
    lines += _decode_table(report)
    lines += _load_table(report)
    lines += _round_table(report)
    lines += _speedup_table(report)
    for name, p in _ok(report).items():
        cov = p.get("coverage")
        if not cov:
            continue
        unit = "us"
        lines += ["", f"## Coverage: {name}", "",
                  f"{cov['launches']} launches, {cov['device_us']:.0f} {unit} of device time over one prefill "
                  f"({min(s['prefill_len'], s.get('coverage_prefill_len', 512))} tokens) and "
                  f"{s['coverage_steps']} decode steps; ours: {cov['ours_time_share']:.1%} of the time, "
                  f"{cov['ours_launch_share']:.1%} of the launches.{_phase_line(cov)}", "",
                  f"| kernel | ours | launches | {unit} | share | ops | modules | ceiling at {cov['amdahl_speedup']:g}x |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in cov["ours"] + cov["uncovered"]:
            lines.append(f"| `{row['kernel'][:80]}` | {'yes' if row['ours'] else ''} | {row['count']} | "
                         f"{row['us']:.1f} | {row['share']:.1%} | {', '.join(row['ops'])} | "
                         f"{', '.join(row['modules'])} | {row['ceiling']:.3f} |")
        lines += _phase_uncovered(cov)
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    if "ungated" in report:
        lines += ["", report["ungated"]]
    return "\n".join(lines) + "\n"


def _decode_checked(report: dict) -> dict:
    return {n: p["decode_correctness"] for n, p in _ok(report).items() if p.get("decode_correctness")}


def _decode_table(report: dict) -> list[str]:
    """Each path's teacher-forced decode steps against float32 (the gate's ``decode-b<N>`` checks)."""
    ok = _decode_checked(report)
    if not ok:
        return []
    s = report["settings"]
    lines = ["", "## Decode correctness", "",
             f"Per decode batch size: {s['decode_prompt_len']} seeded prompt tokens prefilled, then "
             f"{report['reference'].get('decode_check_steps')} decode steps through the path's own cache and step (compiled, "
             "CUDA graphs or eager), each fed a seeded token; their logits against one float32 stock forward over "
             "the same tokens. " + ("The gate holds each to stock eager's as it holds the prompt logits."
                                    if "gate" in report else "Nothing was gated: no stock path."), "",
             "| path | batch | rel L2 err | KL | top-5 |", "|---|---|---|---|---|"]
    for name, by_batch in ok.items():
        for b, c in by_batch.items():
            lines.append(f"| {name} | {b} | {c['rel_l2_err']:.3e} | {c['kl']:.2e} | {c['top5_agreement']:.4f} |")
    return lines


def _load_table(report: dict) -> list[str]:
    """From ``from_pretrained`` to tokens: what a user waits for before a path is fast."""
    ok = {n: p["load_to_token"] for n, p in _ok(report).items() if p.get("load_to_token")}
    if not ok:
        return []
    lines = ["", "## Load to token", "",
             "Seconds from the start of `from_pretrained` (each path in a fresh process; the checkpoint may be in the "
             "page cache for all but the first) to the prefill's token, and to the token of the third decode step "
             "(compiling, CUDA-graph recording or capture included), batch "
             f"{next(iter(ok.values()))['batch']}.", "",
             "| path | load s | first token s | third decode token s |", "|---|---|---|---|"]
    for name, t in ok.items():
        lines.append(f"| {name} | {t['load_s']:.2f} | {t['first_token_s']:.2f} | {t['decode_ready_s']:.2f} |")
    return lines


def _speedup_table(report: dict) -> list[str]:
    """Speedup over stock, round by round (the rounds' drift cancels in each ratio)."""
    rows = report.get("speedup_by_round") or {}
    keys = sorted({k for r in rows.values() for k in r}, key=lambda k: (k != "prefill", len(k), k))
    if not keys:
        return []
    lines = ["", "## Speedup over stock by round", "",
             "Stock's round median over the path's, per round in the order run, then their median (>1: faster)."
             + ("" if report.get("cutile_kernels_ran") else " No cuTile kernel ran: the paths ran the same code, so "
                "these ratios are the machine's noise."), "",
             "| path | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for name, r in rows.items():
        cells = [(", ".join(f"{x:.2f}" for x in r[k]) + f" (median {statistics.median(r[k]):.2f})") if r.get(k) else "-"
                 for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _round_table(report: dict) -> list[str]:
    """Per-round medians: how much the machine drifted while the paths alternated."""
    ok = {n: p for n, p in _ok(report).items() if p["prefill_ms"].get("round_medians")}
    if not ok:
        return []
    batches = [d["batch"] for d in next(iter(ok.values()))["decode"]]
    lines = ["", "## Rounds", "", "Median of each timing round, in the order run (prefill ms; decode ms per step). "
             "Prefill host: the time until the forward returned, before waiting for the GPU; close to the prefill "
             "time, the host set the pace. Host CPU: the timing thread's CPU time over that span (well below it, "
             "the thread waited); GC: of that, Python's garbage collector.", "",
             "| path | prefill | prefill host | host CPU | GC | " + " | ".join(f"decode b{b}" for b in batches) + " |",
             "|---|---|---|---|---|" + "---|" * len(batches)]

    def medians(spread) -> str:
        return ", ".join(f"{x:.2f}" for x in (spread or {}).get("round_medians", [])) or "-"

    for name, p in ok.items():
        cells = [medians(p["prefill_ms"])]
        cells += [medians(p.get(k)) for k in ("prefill_host_ms", "prefill_host_cpu_ms", "prefill_gc_ms")]
        cells += [medians(d["step_ms"]) for d in p["decode"]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def provenance(report: dict) -> str:
    """One line a plot carries, so that a pasted image says where it came from: the device, the
    versions, and whether any of our kernels ran (on a CPU none does)."""
    env = report.get("environment", {})
    device = env.get("gpu") or env.get("device", "?")
    versions = ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items() if v)
    if report.get("cutile_kernels_ran"):
        ran = "cuTile kernels ran"
    elif str(env.get("device", "")).startswith("cuda"):
        ran = "no cuTile kernel ran (see the report's fallbacks)"
    else:
        ran = "CPU, no cuTile kernel ran (PyTorch reference paths)"
    return f"{device}; {ran}\n{versions}"


def _figure(report: dict, width: float = 6.5):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, 4.6))
    fig.text(0.01, 0.01, provenance(report), fontsize=7, va="bottom", ha="left", color="0.3")
    return plt, fig, ax


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout(rect=(0, 0.09, 1, 1))  # room for the provenance lines at the bottom
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def throughput_figure(report: dict):
    """The figure of :func:`plot_throughput` (``(pyplot, figure, axes)``), or None."""
    ok = _ok(report)
    if not ok:
        return None
    plt, fig, ax = _figure(report)
    for name, p in ok.items():
        ax.plot([d["batch"] for d in p["decode"]], [d["tokens_per_s"] for d in p["decode"]], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)  # from zero: 6.7 against 7.4 tok/s must not look like a 10 % win
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens / s")
    ax.set_title(report["model"].split(" (")[0])
    ax.grid(True, alpha=0.3)
    ax.legend()
    return plt, fig, ax


def plot_throughput(report: dict, path: Path) -> Path | None:
    """Decode tokens/s against batch size, one line per path, the axis from zero."""
    made = throughput_figure(report)
    return None if made is None else _save(made[0], made[1], path)


def breakdown_figure(report: dict):
    """The figure of :func:`plot_breakdown` (``(pyplot, figure, axes)``), or None."""
    covered = {n: p["coverage"] for n, p in _ok(report).items() if p.get("coverage")}
    if not covered:
        return None
    plt, fig, ax = _figure(report, width=8.0)
    classes = sorted({c for cov in covered.values() for c in cov["by_class"]})
    bottom = [0.0] * len(covered)
    for cls in classes:
        values = [cov["by_class"].get(cls, 0.0) / 1e3 for cov in covered.values()]
        ax.bar(list(covered), values, bottom=bottom, label=cls)
        bottom = [b + v for b, v in zip(bottom, values)]
    on_gpu = str(report.get("environment", {}).get("device", "")).startswith("cuda")
    ax.set_ylabel(f"{'device' if on_gpu else 'CPU op self'} time, ms (one prefill + decode steps)")
    ax.set_title("time by kernel class")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over one
    return plt, fig, ax


def plot_breakdown(report: dict, path: Path) -> Path | None:
    """Device time by kernel class, one stacked bar per profiled path, the legend beside them."""
    made = breakdown_figure(report)
    return None if made is None else _save(made[0], made[1], path)


def _phase_uncovered(cov: dict) -> list[str]:
    """Per phase, the non-GEMM kernels not ours with the most time (what the coverage share misses)."""
    lines = []
    for name, label in (("prefill", "the prefill"), ("decode", "the decode steps")):
        rows = ((cov.get("phases") or {}).get(name) or {}).get("uncovered") or []
        if rows:
            lines += ["", f"Non-GEMM time of {label} not in our kernels, most first:", "",
                      "| kernel | op | launches | us | share of non-GEMM |", "|---|---|---|---|---|"]
            lines += [f"| `{r['kernel'][:80]}` | {r['op']} | {r['count']} | {r['us']:.1f} | {r['non_gemm_share']:.1%} |"
                      for r in rows]
    return lines


def _phase_line(cov: dict) -> str:
    """' Non-GEMM device time in our kernels: prefill X% (a of b us), decode steps Y% (...).' or ''."""
    phases = cov.get("phases") or {}
    parts = [f"{name} {p['ours_non_gemm_share']:.1%} ({p['ours_us']:.0f} of {p['non_gemm_us']:.0f} us)"
             for name, p in (("prefill", phases.get("prefill")), ("decode steps", phases.get("decode"))) if p]
    return f" Non-GEMM device time in our kernels: {', '.join(parts)}." if parts else ""
