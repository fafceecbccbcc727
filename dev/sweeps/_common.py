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
