"""``cutile-kernels pins``: which pinned transformers functions still hold, and what changed in the rest.

The pins themselves are ``cutile_kernels.layers._pins.PINS`` (a digest per function, checked at run
time before our code runs for a class). Their source in the pinned transformers release is kept
here, in ``pinned_sources.json``, so that for a newer transformers the check can print a unified
diff of each function that changed: moving to a new release is reading those diffs, updating the
reproductions that depend on them and the digests in ``_pins.py``, then ``pins record``.
"""

from __future__ import annotations

import difflib
import inspect
import json
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path

#: The pinned functions' source in the pinned release: {name: source}, plus the release.
SOURCES = Path(__file__).with_name("pinned_sources.json")


@dataclass
class PinStatus:
    """One pin against the installed transformers: ``holds``, ``changed`` (with ``diff``, a unified
    diff from the pinned source to the installed one) or ``missing`` (the function is gone)."""

    name: str
    used_by: str
    status: str
    diff: str = ""


def _source(fn) -> str:
    return textwrap.dedent(inspect.getsource(fn))


def check() -> tuple[str, list[PinStatus]]:
    """(installed transformers version, the status of every pin)."""
    import transformers

    from cutile_kernels.layers import _pins

    stored = json.loads(SOURCES.read_text())["sources"]
    out = []
    for name, pin in _pins.PINS.items():
        fn = pin.function()
        if fn is None:
            out.append(PinStatus(name, pin.used_by, "missing"))
            continue
        if _pins.holds(name):
            out.append(PinStatus(name, pin.used_by, "holds"))
            continue
        diff = "".join(difflib.unified_diff(
            stored.get(name, "").splitlines(keepends=True), _source(fn).splitlines(keepends=True),
            fromfile=f"{name} (transformers {_pins.TRANSFORMERS})", tofile=f"{name} (installed {transformers.__version__})"))
        out.append(PinStatus(name, pin.used_by, "changed", diff))
    return transformers.__version__, out


def record() -> Path:
    """Write the installed sources of every pin to :data:`SOURCES` (after moving the digests to a
    new release: every pin must hold, so the file is the source of the digests).

    Raises:
        ValueError: a pin does not hold for the installed transformers.
    """
    import transformers

    from cutile_kernels.layers import _pins

    broken = [n for n in _pins.PINS if not _pins.holds(n)]
    if broken:
        raise ValueError(f"pins that do not hold for transformers {transformers.__version__}: {', '.join(broken)} "
                         "(update their digests in layers/_pins.py first)")
    data = {"transformers": _pins.TRANSFORMERS, "sources": {n: _source(p.function()) for n, p in _pins.PINS.items()}}
    SOURCES.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return SOURCES


def main_check(as_json: bool = False) -> int:
    """Print the check (a table and the diffs, or JSON); 0 when every pin holds, else 1."""
    from cutile_kernels.layers import _pins

    version, statuses = check()
    if as_json:
        print(json.dumps({"installed": version, "pinned": _pins.TRANSFORMERS,
                          "pins": [asdict(s) for s in statuses]}, indent=1))
    else:
        print(f"transformers {version} installed; pins read in {_pins.TRANSFORMERS}")
        for s in statuses:
            print(f"  {s.status:<8} {s.name}: {s.used_by}")
        for s in statuses:
            if s.diff:
                print()
                print(s.diff, end="" if s.diff.endswith("\n") else "\n")
        bad = [s for s in statuses if s.status != "holds"]
        gating = [s for s in bad if _pins.PINS[s.name].gates]
        print(f"{len(statuses) - len(bad)} of {len(statuses)} pins hold"
              + (f"; left stock until re-read (a log line says so): {', '.join(s.name for s in gating)}"
                 if gating else "")
              + (f"; followed, not gated (read the diff: our code may need to follow it): "
                 f"{', '.join(s.name for s in bad if s not in gating)}" if len(bad) > len(gating) else ""))
    return 0 if all(s.status == "holds" for s in statuses) else 1
