"""cutile-kernels: cuTile kernels for Hugging Face transformers models.

    cutile-kernels bench [MODEL]      every path side by side: gates, timings, roofline, coverage
    cutile-kernels build              compile every kernel variant ahead of time
    cutile-kernels preset NAME        write a preset checkpoint (real config, seeded weights)
    cutile-kernels info               what this install has: build, archs, variants, JIT
    cutile-kernels inventory validate the kernel inventory (FlashInfer-Bench format): also show, sync, export
    cutile-kernels evaluate SOLUTION  a Solution against its Definition's reference, written as Traces
    cutile-kernels kernel-table       each kernel against the stock code path, device time and roofline (CUDA)
    cutile-kernels autokernelize M    rank uncovered regions, --scaffold one, --score a written kernel
    cutile-kernels publish            the build as a Hugging Face kernel repo (--dry-run: stage only)
    cutile-kernels pins check         which pinned transformers functions still hold (diffs of the rest)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from .cli_args import Parser, device, positive, seed


def _bench(args) -> int:
    import torch

    from . import bench

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    base = bench.BenchSettings() if device.startswith("cuda") else bench.BenchSettings.for_cpu()
    overrides = {k: v for k, v in {
        "device": device, "seed": args.seed, "prompt_batch": args.prompt_batch, "prompt_len": args.prompt_len,
        "prefill_len": args.prefill_len, "decode_steps": args.decode_steps, "repeats": args.repeats, "rounds": args.rounds,
        "decode_check_steps": args.decode_check_steps, "decode_prompt_len": args.decode_prompt_len,
        "decode_batches": tuple(args.decode_batch) if args.decode_batch else None,
        "coverage": False if args.no_coverage else None, "coverage_prefill_len": args.coverage_prefill_len,
        "paths": tuple(args.paths) if args.paths else None,
    }.items() if v is not None}
    settings = bench.BenchSettings(**{**base.__dict__, **overrides})
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}, but torch sees no CUDA device here: run with --device cpu")
    if args.out:  # before the run, not after it: a run's results must not be lost to a bad --out
        _writable_dir(args.out)
    report = bench.run(args.model, settings, out_dir=args.out, progress=not args.quiet)
    bench.print_report(report, wide=args.wide)
    if args.out:
        written = [f for f in ("bench.json", "report.md", "throughput.png", "breakdown.png")
                   if (Path(args.out) / f).is_file()]
        print(f"wrote {', '.join(written)} in {args.out}")
    if any(not g["passed"] for g in report.get("gate", {}).values()):
        return 1
    if not any(p.get("ok") for p in report["paths"].values()):
        print("no path ran (see skipped and failed above): nothing was measured", file=sys.stderr)
        return 3
    if device.startswith("cuda") and not report.get("cutile_kernels_ran", False):
        return 4  # on a GPU the point of the run is our kernels: none ran (see the report's fallbacks)
    return 0


def _writable_dir(path: str) -> None:
    """Create ``path`` (and parents) or raise a one-line ``FileNotFoundError`` saying why not."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FileNotFoundError(f"--out {path}: cannot create it ({exc.strerror}): choose a writable directory") from None
    if not os.access(path, os.W_OK):
        raise FileNotFoundError(f"--out {path}: not writable: choose a writable directory")


#: ``kernel_src._spec.DEFAULT_ARCHS`` for the help text, which must not import the package (and so
#: torch and transformers): ``--help`` answers in well under a second (a test keeps the two equal).
DEFAULT_ARCHS_HELP = "sm_80 sm_90 sm_100 sm_120"
#: ``presets.PRESETS``' names for the help text, for the same reason (a test keeps the two equal).
PRESETS_HELP = ("tiny, llama-3.2-1b, qwen3-0.6b, qwen2.5-1.5b, mistral-7b-v0.3, gemma-3-1b, olmo-2-1b, olmo-3-7b, "
                "phi-3-mini-4k, gemma-2-2b, phi-4-mini, granite-3.3-2b, smollm3-3b, qwen3.5-0.8b, qwen3.5-27b")


def _build(args) -> int:
    from cutile_kernels import registry
    from cutile_kernels.kernel_src._spec import DEFAULT_ARCHS
    from cutile_kernels_build import build

    out = args.out or registry.default_build_dir()
    manifest = build(out, archs=args.arch or list(DEFAULT_ARCHS), kernels=args.kernel, jobs=args.jobs,
                     progress="quiet" if args.quiet else True, force=args.force)
    stats = manifest["build_stats"]
    print(f"{len(manifest['variants'])} variants for {', '.join(manifest['archs'])}: compiled {stats['compiled']}, "
          f"reused {stats['reused']} in {stats['seconds']} s -> {stats['variant_dir']}")
    return 0


def _preset(args) -> int:
    import torch

    from . import presets

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}, but torch sees no CUDA device here: run with --device cpu")
    path = presets.materialize(args.name, out_dir=args.out, seed=args.seed, device=args.device)
    print(path)
    return 0


def _info(args) -> int:
    from cutile_kernels import dispatch, registry

    import torch

    reg = registry.registry()
    cuda = torch.cuda.is_available()
    info = {
        "build": str(reg.pkg_dir) if reg.pkg_dir else None,
        "default_build_dir": str(registry.default_build_dir()),
        "archs": reg.archs,
        "variants": len(reg.variants()),
        "kernels": sorted({v.kernel for v in reg.variants()}),
        "cuda_available": cuda,
        "gpu_arch": "sm_{}{}".format(*torch.cuda.get_device_capability()) if cuda else None,
        # JIT needs both the toolchain and a GPU to compile for.
        "jit_toolchain": dispatch.jit_available(),
        "jit_available": cuda and dispatch.jit_available(),
        # the versions that compiled the build found (None: no build), not what is installed now
        "build_toolchain": {k: reg.manifest.get(k) for k in ("cuda_tile", "tileiras")} if reg.pkg_dir else None,
        "installed_cuda_tile": _version("cuda-tile"),
    }
    print(json.dumps(info, indent=1))
    return 0


def _pins_check(args) -> int:
    from . import pins

    return pins.main_check(args.json)


def _pins_record(args) -> int:
    from . import pins

    print(pins.record())
    return 0


def _version(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _publish(args) -> int:
    from . import publish

    repo_id = args.repo_id or publish.default_repo_id()
    plan, commits = publish.publish(repo_id, dry_run=args.dry_run, out_dir=args.out, build_dir=args.build,
                                    inventory_dir=args.inventory, bench_files=args.bench, private=args.private)
    for revision in plan.revisions:
        files = plan.revision_files(revision)
        print(f"{revision}: {len(files)} files, {publish.human_bytes(sum(f.size for f in files))}")
        # By folder, not by file (a build is thousands of cubins: a few hundred per arch); the plan file lists every one.
        groups: dict[str, list] = {}
        for f in files:
            groups.setdefault(str(Path(f.path_in_repo).parent), []).append(f)
        for folder, group in sorted(groups.items()):
            print(f"  {folder}/  {len(group)} files, {publish.human_bytes(sum(f.size for f in group))}")
    if args.dry_run:
        print(f"dry run: nothing uploaded; {len(plan.files)} files ({publish.human_bytes(plan.total_bytes)}) for "
              f"{publish.REPO_TYPE} repo {plan.repo_id} staged in {plan.out_dir} "
              f"(list: {plan.out_dir / publish.PLAN_FILE})")
    else:
        for revision, urls in commits.items():
            print(f"{revision}: " + ", ".join(urls))
    return 0


def main(argv=None) -> int:
    # Only light imports before the arguments are parsed: torch, transformers and the package are
    # imported by the commands that use them.
    from .bench import paths as bench_paths

    p = Parser(prog="cutile-kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(verbose=False)  # -v before or after the command (cli_args.Parser)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    b = sub.add_parser("bench", help="every path side by side: correctness gates, timings, coverage")
    b.add_argument("model", nargs="?", default="tiny", help="preset name or checkpoint directory (default: tiny)")
    b.add_argument("--out", help="directory for bench.json, report.md and the plots (default: print only)")
    b.add_argument("--device", type=device, help="cuda, cuda:N or cpu (default: cuda when available)")
    b.add_argument("--seed", type=seed, help="weight and prompt seed (default 0)")
    b.add_argument("--prompt-batch", type=positive, help="prompts in the correctness batch")
    b.add_argument("--prompt-len", type=positive, help="tokens per correctness prompt")
    b.add_argument("--prefill-len", type=positive, help="tokens of the timed batch-1 prefill")
    b.add_argument("--decode-batch", type=positive, nargs="+", help="decode batch sizes (default 1 4 16; CPU: 1 4)")
    b.add_argument("--decode-steps", type=positive, help="timed decode steps per batch size")
    b.add_argument("--decode-prompt-len", type=positive,
                   help="prompt tokens before the timed decode steps and the decode check's (default 128; CPU: 8); "
                        "past a model's sliding window, its decode steps roll the window")
    b.add_argument("--decode-check-steps", type=positive,
                   help="teacher-forced decode steps of the correctness check, per decode batch size (default 32; at "
                        "most what the timed caches hold: 3 warm-up steps (CPU: 1) + --decode-steps, or 3 if more)")
    b.add_argument("--repeats", type=positive, help="timed prefills per round")
    b.add_argument("--rounds", type=positive, help="alternating timing rounds over the paths (default 3; CPU: 2)")
    b.add_argument("--paths", nargs="+", type=_bench_path, metavar="PATH",
                   help=f"paths to run, of {{{','.join(bench_paths.PATHS)}}}, cutile~NAME (ours without the default "
                        "patch or hub layer NAME) or cutile+NAME (ours with the opt-in patch NAME), the same after "
                        "cutile-compile, cutile-compile-attn, cutile-graphs and cutile-graphs-sdpa, several names with one separator (cutile-compile~A~B) (default: all "
                        "that can run here)")
    b.add_argument("--no-coverage", action="store_true", help="skip the profiled coverage pass")
    b.add_argument("--coverage-prefill-len", type=positive,
                   help="tokens of the coverage pass's prefill (default 512; a longer one is cut to --prefill-len)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.add_argument("--wide", action="store_true", help="one table of every column (about 200 columns wide)")
    b.set_defaults(func=_bench)

    c = sub.add_parser("build", help="compile every kernel variant ahead of time (no GPU needed)")
    c.add_argument("--out", help="build directory (default: $CUTILE_KERNELS_BUILD_DIR or <checkout>/build)")
    c.add_argument("--arch", nargs="+", action="extend", help=f"target archs (default: {DEFAULT_ARCHS_HELP})")
    c.add_argument("--kernel", nargs="+", action="extend", help="only these kernels (the manifest then holds only them)")
    c.add_argument("--jobs", type=positive, help="compiler processes (default: the CPU count)")
    c.add_argument("--force", action="store_true", help="recompile unchanged variants too")
    c.add_argument("--quiet", action="store_true", help="a progress line that updates every 30 s (logs stay short)")
    c.set_defaults(func=_build)

    r = sub.add_parser("preset", help="write a preset checkpoint (real config, seeded weights)")
    r.add_argument("name", help=f"one of {PRESETS_HELP}")
    r.add_argument("--out", help="directory to write it to (default: <name>-seed<seed> in $CUTILE_KERNELS_PRESET_DIR, "
                                 "else in ~/.cache/cutile-kernels/presets)")
    r.add_argument("--seed", type=seed, default=0, help="weight seed (default 0)")
    r.add_argument("--device", type=device, default="cpu", help="where to create the weights (cpu, cuda, cuda:N)")
    r.set_defaults(func=_preset)

    i = sub.add_parser("info", help="what this install has", description="The build, its archs and variants, "
                       "whether a CUDA GPU is there and whether JIT is available, as JSON.")
    i.set_defaults(func=_info)

    n = sub.add_parser("pins", help="which pinned transformers functions still hold; diffs of the others")
    nsub = n.add_subparsers(dest="pins_cmd", required=True, metavar="COMMAND")
    nc = nsub.add_parser("check", help="each pin: holds, changed (with a unified diff) or missing; exit 1 unless all hold")
    nc.add_argument("--json", action="store_true")
    nc.set_defaults(func=_pins_check)
    nr = nsub.add_parser("record", help="write the pinned functions' sources (after updating the digests)")
    nr.set_defaults(func=_pins_record)

    from .inventory.cli import add_parsers as add_inventory_parsers

    add_inventory_parsers(sub)

    u = sub.add_parser("publish", help="the build as a Hugging Face kernel repo: card on main, build on v<version>")
    u.add_argument("--repo-id", help="ORG/NAME (default: [general.hub] repo-id of build.toml)")
    u.add_argument("--dry-run", action="store_true", help="stage and list the upload; touch no network")
    u.add_argument("--out", help="staging directory (default: a new temporary one)")
    u.add_argument("--build", help="build directory (default: $CUTILE_KERNELS_BUILD_DIR or <checkout>/build)")
    u.add_argument("--inventory", help="kernel inventory for the card (default: <checkout>/inventory)")
    u.add_argument("--bench", nargs="+", help="bench.json reports for the card (default: newest GPU report "
                                              "per model under benchmarks/results)")
    u.add_argument("--private", action="store_true", help="create the repository as private")
    u.set_defaults(func=_publish)

    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    from cutile_kernels_build import BuildError

    try:
        rc = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe can still be caught, not at interpreter exit
        return rc
    except BrokenPipeError:
        # The reader stopped early (`| head`): end quietly, as Unix tools do on SIGPIPE (128 + 13).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (ValueError, KeyError, FileNotFoundError, FileExistsError, BuildError) as exc:
        if args.verbose:
            raise
        # A KeyError's str() is its repr (quoted): print the message itself.
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"cutile-kernels {args.cmd}: {msg}", file=sys.stderr)
        return 2


def _bench_path(name: str) -> str:
    from .bench import paths as bench_paths

    try:
        bench_paths.spec(name)
    except KeyError as e:
        raise argparse.ArgumentTypeError(e.args[0]) from None
    return name


if __name__ == "__main__":
    sys.exit(main())
