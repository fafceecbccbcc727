"""What the candidate sweeps share: compiling the candidates on a CPU machine (``export``), and the
two-command line (``export`` there, ``run`` on the GPU) with the rows written as JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def export_specs(specs, out: str) -> None:
    """Compile the VariantSpecs ``specs`` for sm_90 into the build ``out``, one at a time so that a
    candidate tileiras rejects is reported and left out (a failed build leaves the previous one
    intact; compiled variants are reused); prints the compiled tags and the failures."""
    from cutile_kernels_build import BuildError, build

    kept, failed = [], {}
    for spec in specs:
        try:
            build(out, archs=["sm_90"], specs=kept + [spec])
            kept.append(spec)
        except BuildError as exc:
            failed[spec.tag] = str(exc).splitlines()[0][-160:]
    print(json.dumps({"compiled": [s.tag for s in kept], "failed": failed}, indent=1))


def launched(launch, row: dict, rows: list) -> bool:
    """Run ``launch()`` (one candidate's first launch) and wait for it; a candidate that cannot
    launch is reported instead: its error goes into ``row``, which is appended to ``rows`` and
    printed, and False is returned (the caller skips its check and timing)."""
    import torch

    try:
        launch()
        torch.cuda.synchronize()
        return True
    except Exception as exc:  # noqa: BLE001 - a candidate that cannot launch is reported
        row["error"] = f"{type(exc).__name__}: {exc}"[:200]
        rows.append(row)
        print(json.dumps(row), flush=True)
        return False


def cycling(calls: list):
    """One call that runs the next of ``calls`` each time (the same work over copies of its inputs:
    a working set past the L2 cache, as in a model step, where other layers' data evicts it)."""
    it = [0]

    def call():
        calls[it[0] % len(calls)]()
        it[0] += 1
    return call


def checked_timing(call, row: dict, rows: list, out, ref, reps: int = 11) -> None:
    """Run ``call`` (an attention launch writing ``out``, a ``(B, Sq, Hq, D)`` buffer, poisoned with NaN
    first) and check it against ``ref`` ``(B, Hq, Sq, D)``: ``row`` gets the relative L2 error
    (``rel``), ``ok`` (finite and ``rel`` < 1e-2) and, when ok, the median GPU microseconds of CUDA-graph
    replays (``us``); it is appended to ``rows`` and printed. A call that cannot launch is reported
    by :func:`launched`."""
    import torch
    from cutile_kernels_tools.timing import graph_us

    out.fill_(float("nan"))
    if not launched(call, row, rows):
        return
    got = out.transpose(1, 2).float()
    row["rel"] = ((got - ref).norm() / ref.norm()).item()
    row["ok"] = bool(torch.isfinite(got).all()) and row["rel"] < 1e-2
    if row["ok"]:
        row["us"] = round(graph_us(call, reps=reps), 2)
    rows.append(row)
    print(json.dumps(row), flush=True)


def write_rows(rows: list, json_out: str | None) -> None:
    """The sweep's rows as a JSON file, when one was asked for."""
    if json_out:
        Path(json_out).write_text(json.dumps(rows, indent=1))


def main(doc: str, default_dir: str, candidates, run) -> None:
    """``export --out DIR`` (CPU: compile ``candidates()``) or ``run --dir DIR [--json F]`` (GPU:
    ``run(dir, json)``), ``default_dir`` the directory of both."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("export").add_argument("--out", default=default_dir)
    r = sub.add_parser("run")
    r.add_argument("--dir", default=default_dir)
    r.add_argument("--json")
    a = p.parse_args()
    export_specs(candidates(), a.out) if a.cmd == "export" else run(a.dir, a.json)
