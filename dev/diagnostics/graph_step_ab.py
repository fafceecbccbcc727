"""``graph_step.py`` with one runtime switch flipped in every loaded copy of the package after the model
loads, for an A/B across processes where one process cannot hold both sides (a compiled step keeps what
inductor captured first). Run from the checkout, the variant in ``AB``:

    AB=twins   python dev/diagnostics/graph_step_ab.py llama-3.2-1b --path cutile-compile --batch 1 16 --host --top 0
    AB=residual python dev/diagnostics/graph_step_ab.py ...   # and the same with AB=none, alternating

* ``twins``: ``dispatch.CAPTURE_TWINS = True`` (our programmatic twins in inductor's CUDA graphs);
* ``residual``: ``ops.gemv.RESIDUAL_TILES`` = every built GEMV tile (the decoder layers' last add in the
  down projection's GEMV, ``gemv_residual``);
* ``ropeattend-off``: ``layers._direct.COMPILED_ROPE_ATTEND = False`` (a compiled decode step's RoPE and cache
  write as ``rope_append``, then the masked attention: the two launches the one ``rope_append_attention`` replaced
  by default);
* ``flexible-ropeattend``: ``CUTILE_KERNELS_FLEXIBLE=rope_append_attention`` set before the package is imported
  (the one launch, which writes the cache, declared ``flexible_layout``: inductor hands it the mask, cos and sin
  as it stored them, where its default builds a copy of each for every layer);
* ``none`` (or unset): as shipped.

``residual`` and ``ropeattend-off`` are read while dynamo traces, so ``graph_step.py --ab-compiled NAME`` times them
against the shipped step in one process (alternating rounds, a cheaper and fairer A/B); ``twins`` acts when
inductor captures its CUDA graphs, which one process records once: it needs this script.
"""

from __future__ import annotations

import os
import runpy
import sys

#: Variants that are environment variables the package reads at import: set before anything imports it.
ENV_VARIANTS = {"flexible-ropeattend": {"CUTILE_KERNELS_FLEXIBLE": "rope_append_attention"}}
if __name__ == "__main__":
    os.environ.update(ENV_VARIANTS.get(os.environ.get("AB", "none"), {}))

from cutile_kernels_tools.bench import paths  # noqa: E402
from cutile_kernels_tools.bench.worker import runtime_copies  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_step import COMPILED_SWITCHES, switch_modules  # noqa: E402

_load = paths.load
VARIANTS = ("none", "twins", *COMPILED_SWITCHES, *ENV_VARIANTS)


def _flip(variant: str) -> None:
    if variant == "none" or variant in ENV_VARIANTS:  # those were set before the import
        return
    # twins: every copy's dispatch (this package's and the build's); the others: graph_step's switch table
    mods, attr, on = (runtime_copies(), "CAPTURE_TWINS", True) if variant == "twins" else switch_modules(variant)
    if not mods:  # else the A/B would time the shipped step twice
        raise RuntimeError(f"AB={variant}: no loaded copy of cutile_kernels has the switch")
    for mod in mods:
        setattr(mod, attr, on)


def _load_and_flip(*args, **kwargs):
    model = _load(*args, **kwargs)
    _flip(os.environ.get("AB", "none"))
    return model


if __name__ == "__main__":
    if os.environ.get("AB", "none") not in VARIANTS:
        raise SystemExit(f"AB={os.environ['AB']!r}: one of {', '.join(VARIANTS)}")
    paths.load = _load_and_flip
    sys.argv = ["graph_step.py", *sys.argv[1:]]
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "graph_step.py"), run_name="__main__")
