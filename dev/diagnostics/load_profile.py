"""Where a path's time from ``from_pretrained`` to its first token goes: ``cProfile`` of one process's
load and first prefill.

    python -m dev.diagnostics.load_profile qwen3-0.6b --path cutile-graphs [--top 40] [--device cuda]

Run each path in a fresh process (a second load in one process reuses imports, compiled modules and
the checkpoint's pages). A preset's checkpoint is written first in a child process when it is not
cached yet, so that writing it (which imports the modeling code) happens outside this process.
Prints the seconds of the imports of torch and transformers, of the load
(``tools.bench.paths.load``, the call the bench times) and of a first eager prefill (1 x ``--prompt``
tokens, no cache object: not the bench's decoder, which prefills into the path's own cache), each
synchronized and profiled, then the ``--top`` functions by own time (``tottime``). Cumulative times
are not listed: on Python 3.12 cProfile also records other threads (transformers loads weights on a
thread pool), and their calls land in the main thread's stacks. The bench reports the totals
(``load_to_token``); this says which functions moved.
"""

import argparse
import cProfile
import io
import pstats
import subprocess
import sys
import time

T0 = time.perf_counter()

import torch  # noqa: E402 - timed: the imports are part of a fresh process's load
import transformers  # noqa: E402

IMPORTS_S = time.perf_counter() - T0


def _checkpoint(model: str):
    # The checkpoint directory, written in a child process if the preset is not cached yet.
    from cutile_kernels_tools import presets

    if model in presets.PRESETS:
        code = f"from cutile_kernels_tools import presets; presets.materialize({model!r})"
        subprocess.run([sys.executable, "-c", code], check=True)
    return presets.resolve(model)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="preset name or checkpoint directory")
    ap.add_argument("--path", default="cutile-graphs", help="bench path to load the model as (default cutile-graphs)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompt", type=int, default=128, help="first prefill's tokens (the bench's decode prompt)")
    ap.add_argument("--top", type=int, default=40, help="functions listed by own time")
    args = ap.parse_args(argv)

    from cutile_kernels_tools.bench import paths

    checkpoint, label = _checkpoint(args.model)
    paths.isolate_packages(args.path)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    model = paths.load(args.path, checkpoint, torch.bfloat16, args.device)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(ids.to(args.device), use_cache=True)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    prof.disable()
    first_s = time.perf_counter() - t0
    print(f"{label}, path {args.path} on {args.device} (transformers {transformers.__version__}): "
          f"torch + transformers imports {IMPORTS_S:.3f} s, "
          f"load {load_s:.3f} s, first prefill {first_s - load_s:.3f} s (load to first token {first_s:.3f} s, "
          "profiled)")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
