"""Execute the example notebooks (``examples/*.ipynb``) with nbclient.

Cells tagged ``gpu`` need a CUDA GPU. The CPU run (the tests) drops them and executes the rest;
the GPU run (``benchmarks/device_notebooks.sh``) executes every cell and saves the executed
notebooks, whose outputs are the ones committed.

    python -m cutile_kernels_tools.notebooks [--all-cells] [--out DIR] NOTEBOOK...

Each notebook runs in its own kernel (``python3``: this interpreter) with a fresh temporary
working directory, so nothing it writes lands in the checkout. Exit status 1 if a cell failed
(the partly executed notebook is still written to ``--out``), 2 if nbclient/ipykernel are missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

GPU_TAG = "gpu"


def tags(cell) -> set[str]:
    return set(cell.get("metadata", {}).get("tags", []))


def execute(path, skip_tags=(GPU_TAG,), timeout: int = 600, out_path=None):
    """Execute one notebook and return it with its outputs.

    Args:
        path: the ``.ipynb`` file.
        skip_tags: cells carrying any of these tags are left out of the run (and of the result).
        timeout: seconds one cell may take.
        out_path: where to write the executed notebook (also when a cell fails).

    Raises:
        nbclient.exceptions.CellExecutionError: a cell raised; the message shows the cell and the
            traceback.
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(str(path), as_version=4)
    nb.cells = [c for c in nb.cells if not tags(c) & set(skip_tags)]
    with tempfile.TemporaryDirectory(prefix="cutile-nb-") as cwd:
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": cwd}})
        try:
            client.execute()
        finally:
            if out_path is not None:
                Path(out_path).parent.mkdir(parents=True, exist_ok=True)
                nbformat.write(nb, str(out_path))
    return nb


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cutile_kernels_tools.notebooks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("notebooks", nargs="+", type=Path)
    p.add_argument("--all-cells", action="store_true", help="also the cells tagged gpu (on a GPU machine)")
    p.add_argument("--out", type=Path, help="directory for the executed notebooks")
    p.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = p.parse_args(argv)
    missing = [m for m in ("nbclient", "nbformat", "ipykernel") if importlib.util.find_spec(m) is None]
    if missing:  # ipykernel is the kernel nbclient starts
        print(f"notebooks: {', '.join(missing)} missing: install the `test` extra", file=sys.stderr)
        return 2
    from nbclient.exceptions import CellExecutionError
    failed = 0
    for nb_path in args.notebooks:
        out = args.out / nb_path.name if args.out else None
        t0 = time.perf_counter()
        try:
            execute(nb_path, skip_tags=() if args.all_cells else (GPU_TAG,), timeout=args.timeout, out_path=out)
            status = "ok"
        except CellExecutionError as exc:
            failed += 1
            status = f"FAILED\n{exc}"
        print(f"{nb_path.name}: {status} ({time.perf_counter() - t0:.1f} s)" + (f" -> {out}" if out else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
