"""``graph_step.py`` with one runtime switch flipped in every loaded copy of the package after the model
loads, for an A/B across processes where one process cannot hold both sides (a compiled step keeps what
inductor captured first). Run from the checkout, the variant in ``AB``:

    AB=twins   python dev/diagnostics/graph_step_ab.py llama-3.2-1b --path cutile-compile --batch 1 16 --host --top 0
    AB=residual python dev/diagnostics/graph_step_ab.py ...   # and the same with AB=none, alternating

* ``twins``: ``dispatch.CAPTURE_TWINS = True`` (our programmatic twins in inductor's CUDA graphs);
* ``residual``: ``ops.gemv.RESIDUAL_TILES`` = every built GEMV tile (the decoder layers' last add in the
  down projection's GEMV, ``gemv_residual``);
* ``ropeattend``: ``layers._direct.COMPILED_ROPE_ATTEND = True`` (a compiled decode step's RoPE, cache write
  and masked attention as one ``rope_append_attention`` launch);
* ``none`` (or unset): as shipped.

``residual`` and ``ropeattend`` are read while dynamo traces, so ``graph_step.py --ab-compiled NAME`` times them
against the shipped step in one process (alternating rounds, a cheaper and fairer A/B); ``twins`` acts when
inductor captures its CUDA graphs, which one process records once: it needs this script.
"""

from __future__ import annotations

import os
import runpy
import sys

from cutile_kernels_tools.bench import paths
from cutile_kernels_tools.bench.worker import runtime_copies

_load = paths.load


def _flip(variant: str) -> None:
    flipped = False
    for dispatch in runtime_copies():  # this package's and the build copy's
        package = dispatch.__name__.rsplit(".", 1)[0]
        if variant == "twins":
            dispatch.CAPTURE_TWINS = flipped = True
        if variant == "residual":
            sys.modules[package + ".ops.gemv"].RESIDUAL_TILES = sys.modules[package + ".kernel_src.gemv"].TILES
            flipped = True
        if variant == "ropeattend" and package + ".layers._direct" in sys.modules:
            sys.modules[package + ".layers._direct"].COMPILED_ROPE_ATTEND = True
            flipped = True
    if variant != "none" and not flipped:  # else the A/B would time the shipped step twice
        raise RuntimeError(f"AB={variant}: no loaded copy of cutile_kernels has the switch")


def _load_and_flip(*args, **kwargs):
    model = _load(*args, **kwargs)
    _flip(os.environ.get("AB", "none"))
    return model


if __name__ == "__main__":
    if os.environ.get("AB", "none") not in ("none", "twins", "residual", "ropeattend"):
        raise SystemExit(f"AB={os.environ['AB']!r}: one of none, twins, residual, ropeattend")
    paths.load = _load_and_flip
    sys.argv = ["graph_step.py", *sys.argv[1:]]
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "graph_step.py"), run_name="__main__")
