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
* ``fixed-layout``: ``CUTILE_KERNELS_FIXED_LAYOUT=1`` set before the package is imported (every op of ours with
  inductor's default input layout, which copies an input it has not stored yet for each call that reads it:
  the mask, cos and sin once per layer);
* ``none`` (or unset): as shipped.

Every variant runs with inductor's caches off (:data:`NO_CACHES`), which also makes each process compile afresh.

``residual`` and ``ropeattend-off`` are read while dynamo traces, so ``graph_step.py --ab-compiled NAME`` times them
against the shipped step in one process (alternating rounds, a cheaper and fairer A/B); ``twins`` acts when
inductor captures its CUDA graphs, which one process records once: it needs this script.
"""

from __future__ import annotations

import os
import runpy
import sys

#: Variants that are environment variables the package reads at import: set before anything imports it.
ENV_VARIANTS = {"fixed-layout": {"CUTILE_KERNELS_FIXED_LAYOUT": "1"}}
#: Set for every variant: inductor's FX graph and AOTAutograd caches do not key on the ops' layout tags,
#: so either side could replay code compiled under the other's (or an earlier run's) variables.
NO_CACHES = {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
if __name__ == "__main__":
    os.environ.update({**NO_CACHES, **ENV_VARIANTS.get(os.environ.get("AB", "none"), {})})

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
