"""``cutile-kernels bench`` (orchestrated by :mod:`.runner`): every path side by side, with
correctness gates and kernel coverage.

The package's modules: :mod:`.runner` (the bench: settings, workers, gates, the report's derived
figures), :mod:`.worker` (one path in its own process), :mod:`.paths` (what each path loads),
:mod:`.coverage` (profiled kernel coverage), :mod:`.limits` (copy bandwidth, matmul rate),
:mod:`.report` (markdown and plots), :mod:`.schema` (the report's pydantic schema).

``bench.run``, ``bench.BenchSettings``, ``bench.gate``, ... are :mod:`.runner`'s, imported on first use
so that the CLI can name the paths (``bench.paths``) without importing torch.
"""

from __future__ import annotations

import importlib


#: This package's modules: ``from .bench import paths`` must load paths alone, not run.
_SUBMODULES = ("coverage", "limits", "paths", "report", "schema", "worker")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    runner = importlib.import_module(f"{__name__}.runner")
    try:
        return getattr(runner, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
