"""The ``inventory``, ``evaluate``, ``kernel-table`` and ``autokernelize`` subcommands of ``cutile-kernels``
(registered by :func:`add_parsers` from :mod:`.cli`; errors follow its convention: a ValueError,
KeyError or FileNotFoundError is printed and exits 2)."""

from __future__ import annotations

import json
from pathlib import Path

from ..cli_args import device, table_width


def _print_json(data) -> None:
    print(json.dumps(data, indent=1, default=str))


def _validate(args) -> int:
    from .. import inventory

    rep = inventory.validate(Path(args.root) if args.root else None, compile=not args.no_compile,
                             build_dir=Path(args.build) if args.build else None)
    if args.json:
        _print_json(rep.to_dict())
    else:
        for line in rep.compiled:
            print(f"compiles: {line}")
        for w in rep.warnings:
            print(f"warning: {w}")
        for e in rep.errors:
            print(f"error: {e}")
        c = rep.checked
        print(f"{'OK' if rep.ok else 'FAILED'}: {c['kernels']} kernels, {c['definitions']} definitions, "
              f"{c['solutions']} solutions, {c['workloads']} workloads, {c['traces']} traces; "
              f"{len(rep.errors)} errors, {len(rep.warnings)} warnings")
    return 0 if rep.ok else 1


def _show(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .. import inventory

    inv = inventory.Inventory.load(Path(args.root) if args.root else None)
    if args.name:
        obj = inv.definitions.get(args.name) or inv.solutions.get(args.name)
        if obj is None:
            raise KeyError(f"no Definition or Solution named {args.name!r}")
        print(obj.to_json())
        return 0
    rows = inventory.summary_rows(inv)
    if args.json:
        _print_json(rows)
        return 0
    table = Table(title=f"kernel inventory: {inv.root}")
    for col in ("definition", "op_type", "axes", "solutions", "archs", "workloads", "traces", "latest"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["definition"], r["op_type"], ", ".join(f"{k}:{v}" for k, v in r["axes"].items()),
                      ", ".join(r["solutions"]) or "-", " ".join(r["archs"]), str(r["workloads"]), str(r["traces"]),
                      ", ".join(f"{k}: {v}" for k, v in r["latest"].items()) or "-")
    Console(width=table_width(200)).print(table)
    for e in inv.errors:
        print(f"error: {e}")
    return 0


def _sync(args) -> int:
    from . import families as inventory_families

    changed = inventory_families.sync(Path(args.root) if args.root else None)
    for p in changed:
        print(f"updated {p}")
    print(f"{len(changed)} files changed")
    return 0


def _new_solution(args) -> int:
    from .. import inventory

    checkout = inventory.repo_root()
    if checkout is None:
        raise FileNotFoundError("writing a Solution needs a source checkout")
    inv = inventory.Inventory.load(Path(args.root) if args.root else None)
    d = inv.definitions.get(args.definition)
    if d is None:
        raise KeyError(f"no Definition {args.definition!r}: write inventory/definitions/<family>/{args.definition}.json first")
    kernel = args.kernel or d.name
    if kernel not in inventory.kernel_functions():
        raise KeyError(f"kernel {kernel!r} has no variants in kernel_src")
    family = args.family or inventory.family_dir(d)
    s = inventory.make_solution(d, kernel=kernel, family=family, op=args.op or kernel, checkout=checkout)
    if s.name in inv.solutions:
        raise FileExistsError(f"Solution {s.name!r} exists (refresh it with `cutile-kernels inventory sync`)")
    print(inventory.write_solution(inv.root, s, inventory.family_dir(d)))
    return 0


def _export(args) -> int:
    from .. import inventory

    out = inventory.export(inventory.Inventory.load(Path(args.root) if args.root else None), Path(args.out))
    print(f"wrote a FlashInfer-Bench dataset to {out}")
    return 0


def _evaluate(args) -> int:
    from . import evaluate
    from .. import inventory

    root = Path(args.root) if args.root else None
    inv = inventory.Inventory.load(root)
    names = sorted(inv.solutions) if args.all else args.solution
    if not names:
        raise ValueError("name a Solution or pass --all")
    out_root = Path(args.out) if args.out else inv.root
    results, worst, said = [], 0, set()
    for name in names:
        r = evaluate.evaluate(name, inv.root, args.device, workloads=args.workload, seed=args.seed,
                              warmup=args.warmup, repeats=args.repeats,
                              build_dir=Path(args.build) if args.build else None)
        written = None
        if r.traces and not args.no_write:
            written = inventory.append_traces(out_root, inventory.family_dir(inv.definitions[r.definition]), r.traces)
        results.append(r.to_dict())
        print(f"{name}: {r.status}" + (f" ({r.message})" if r.message else "")
              + (f"; {len(r.traces)} traces -> {written}" if written else ""))
        for st in r.stages:
            detail = st.get("detail", "")
            if st["status"] == "not run" and detail in said:
                detail = "(as above)"  # e.g. no toolchain: said once, not once per Solution
            said.add(detail)
            print(f"  {st['stage']:<11} {st['status']:<8} {detail}")
        for t in r.traces:
            p = t.evaluation.performance
            if p is not None:
                print(f"  {t.workload.uuid:<40} {p.latency_ms * 1e3:9.2f} us  reference {p.reference_latency_ms * 1e3:9.2f} us"
                      f"  x{p.speedup_factor:.2f}  max abs err {t.evaluation.correctness.max_absolute_error:.3g}")
        worst = max(worst, 0 if r.status == "PASSED" else 3 if r.status == evaluate.NOT_RUN else 1)
    if args.summary:
        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary).write_text(json.dumps(results, indent=1, default=str) + "\n")
    return worst


def _kernel_table(args) -> int:
    from . import kernel_table

    report = kernel_table.run(Path(args.root) if args.root else None, solutions=args.solution or None,
                              models=args.model, device=args.device, seed=args.seed)
    text = kernel_table.markdown(report)
    print(text, end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 1 if any(r["note"] for r in report["rows"]) else 0


def _autokernelize(args) -> int:
    from .. import autokernelize as ak

    if args.score:
        bench_kw = {k: v for k, v in (("decode_batches", tuple(args.decode_batch or ())), ("rounds", args.rounds)) if v}
        row = ak.score(args.model, args.score, root=Path(args.root) if args.root else None,
                       log=Path(args.log) if args.log else None, description=args.description or "",
                       tolerance=args.tolerance, device=args.device, progress=not args.quiet, bench_overrides=bench_kw,
                       bench_out=Path(args.bench_out) if args.bench_out else None)
        for k in ak.LOG_COLUMNS:
            print(f"{k:>13}: {row.get(k, '')}")
        if row["status"] == "not_run":
            print("not logged: the candidate was not evaluated (no CUDA device)")
            return 3
        return 0 if row["status"] == "keep" else 1
    model, label, device = ak.load_model(args.model, args.device, args.seed)
    found = ak.regions(model, device, steps=args.steps, prompt_len=args.prompt_len, seed=args.seed)
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1, default=float) + "\n")
    rows = found["regions"]
    if args.scaffold is None:
        _print_regions(found, label, args.top)
        return 0
    region = next((r for r in rows if r["region"] == args.scaffold), None)
    if region is None and args.scaffold.isdigit():
        uncovered = [r for r in rows if not r["covered"]]
        k = int(args.scaffold)
        region = uncovered[k - 1] if 1 <= k <= len(uncovered) else None
    if region is None:
        raise KeyError(f"no region {args.scaffold!r}: give a rank (1 = most time) or a region path from the list")
    if region["covered"]:
        raise ValueError(f"region {region['region']} is already ours: {region['covered']}")
    from .. import inventory

    target = Path(args.target) if args.target else (inventory.repo_root() or Path.cwd())
    out = ak.scaffold(model, region, label, target, name=args.name)
    print(f"scaffolded {out['definition']} for {region['region']} ({region['cls']}, {region['share']:.1%} of device "
          f"time, ceiling x{region['ceiling']:.3f} at 2x):")
    for f in out["files"]:
        print(f"  {f}")
    if not out["registered"]:
        print(f"  warning: kernel_src does not find {out['definition']}.py (a family module's name must not start with _)")
    print(f"next: write the kernel and its VARIANTS, the op, then `cutile-kernels autokernelize {args.model} "
          f"--score {out['definition']}`")
    return 0


def _print_regions(found: dict, label: str, top: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"uncovered regions of {label} (device time {found['device_us'] / 1e3:.2f} ms, "
                        f"covered by our layers {found['covered_share']:.1%})")
    for col in ("rank", "region", "module class", "share", "launches", "top ops", "ceiling 2x", "ceiling max"):
        table.add_column(col, justify="left" if col in ("region", "module class", "top ops") else "right")
    rank = 0
    for r in found["regions"]:
        if r["covered"]:
            continue
        rank += 1
        if rank > top:
            break
        table.add_row(str(rank), r["region"], r["cls"] or "-", f"{r['share']:.1%}", str(r["launches"]),
                      ", ".join(r["ops"]), f"x{r['ceiling']:.3f}", f"x{r['ceiling_max']:.3f}")
    console = Console(width=table_width(200))
    console.print(table)
    for r in found["regions"]:
        if r["covered"]:
            console.print(f"covered: {r['region']} ({r['share']:.1%}): {r['covered']}")


def add_parsers(sub) -> None:
    """Add ``inventory``, ``evaluate``, ``kernel-table`` and ``autokernelize`` to the CLI's subparsers."""
    inv = sub.add_parser("inventory", help="the kernel inventory (FlashInfer-Bench Definitions, Solutions, ...)")
    isub = inv.add_subparsers(dest="inventory_cmd", required=True, metavar="COMMAND")
    v = isub.add_parser("validate", help="every kernel described, every reference callable, every Solution compiles")
    v.add_argument("--root", help="inventory directory (default: <checkout>/inventory)")
    v.add_argument("--build", help="build whose manifest proves compiles (default: the runtime's)")
    v.add_argument("--no-compile", action="store_true", help="skip the compile check")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=_validate)
    s = isub.add_parser("show", help="a table of Definitions, Solutions, Workloads and latest traces, or one as JSON")
    s.add_argument("name", nargs="?")
    s.add_argument("--root")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_show)
    y = isub.add_parser("sync", help="regenerate what is derived from code (norm Definitions, Workloads, sources)")
    y.add_argument("--root")
    y.set_defaults(func=_sync)
    n = isub.add_parser("new-solution", help="write the cuda-tile Solution of a kernel for an existing Definition")
    n.add_argument("definition")
    n.add_argument("--kernel", help="VariantSpec.kernel (default: the Definition's name)")
    n.add_argument("--family", help="kernel_src / ops module (default: the Definition's family:<name> tag or op_type)")
    n.add_argument("--op", help="function in cutile_kernels.ops.<family> (default: the kernel name)")
    n.add_argument("--root")
    n.set_defaults(func=_new_solution)
    x = isub.add_parser("export", help="write a copy FlashInfer-Bench loads (cuda-tile Solutions as python)")
    x.add_argument("out")
    x.add_argument("--root")
    x.set_defaults(func=_export)

    e = sub.add_parser("evaluate", help="a Solution against its Definition's reference: gates, then Traces")
    e.add_argument("solution", nargs="*", help="Solution names")
    e.add_argument("--all", action="store_true", help="every Solution of the inventory")
    e.add_argument("--root", help="inventory directory (default: <checkout>/inventory)")
    e.add_argument("--out", help="dataset directory to append Traces to (default: the inventory)")
    e.add_argument("--no-write", action="store_true", help="write no Traces")
    e.add_argument("--summary", help="write every result (stages, traces) as JSON here")
    e.add_argument("--workload", nargs="+", help="only these workload uuids")
    e.add_argument("--device", type=device, help="cuda, cuda:N or cpu (default: cuda when available)")
    e.add_argument("--build", help="build whose manifest proves compiles on a CPU")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--warmup", type=int, default=10)
    e.add_argument("--repeats", type=int, default=30)
    e.set_defaults(func=_evaluate)

    k = sub.add_parser("kernel-table", help="each kernel against the stock code path on the models' shapes (CUDA); "
                                            "exit 1 if a kernel fell back")
    k.add_argument("solution", nargs="*", help="Solution names (default: all)")
    k.add_argument("--model", action="append", help="only the Workloads of this preset (uuid prefix, e.g. "
                                                    "qwen3-0.6b); repeat for several")
    k.add_argument("--root", help="inventory directory (default: <checkout>/inventory)")
    k.add_argument("--device", type=device, default="cuda")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--out", help="write the markdown table here")
    k.add_argument("--json", help="write the rows and the measured limits as JSON here")
    k.set_defaults(func=_kernel_table)

    a = sub.add_parser("autokernelize", help="rank uncovered regions, scaffold one, score a written kernel")
    a.add_argument("model", help="preset name or checkpoint directory")
    a.add_argument("--scaffold", metavar="RANK|REGION", help="scaffold the region of this rank or path")
    a.add_argument("--name", help="Definition / family name for --scaffold (default: <model_type>_<module>)")
    a.add_argument("--target", help="checkout to write the scaffold into (default: this checkout)")
    a.add_argument("--score", metavar="NAME", help="evaluate + bench this Definition's or Solution's kernel, log it")
    a.add_argument("--description", help="what the candidate changes (for the results log)")
    a.add_argument("--log", help="results log (default: <checkout>/benchmarks/results/autokernelize.tsv)")
    a.add_argument("--tolerance", type=float, default=0.01, help="allowed throughput drop (fraction, default 0.01)")
    a.add_argument("--decode-batch", type=int, nargs="+", help="--score's bench decode batch sizes (default 1 4 16)")
    a.add_argument("--rounds", type=int, help="--score's bench timing rounds (default 3)")
    a.add_argument("--bench-out", help="--score: write the bench report (bench.json, report.md, plots) here")
    a.add_argument("--root", help="inventory directory (default: <checkout>/inventory)")
    a.add_argument("--device", type=device, help="cuda, cuda:N or cpu (default: cuda when available)")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--steps", type=int, default=2, help="profiled decode steps")
    a.add_argument("--prompt-len", type=int, default=64, help="profiled prefill tokens")
    a.add_argument("--top", type=int, default=15)
    a.add_argument("--json", help="write the ranked regions as JSON here")
    a.add_argument("--quiet", action="store_true")
    a.set_defaults(func=_autokernelize)
