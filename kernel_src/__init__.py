"""cuTile device code and build matrices, one module per op family. Imports cuda.tile, never torch.

Each family module defines its ``@ct.kernel`` functions and a ``VARIANTS`` list of
:class:`~._spec.VariantSpec`. A family is found by being here: every module of this package whose
name does not start with ``_`` (no list to keep). :func:`all_variants` gathers them for the builder;
the runtime imports a family module only to JIT-compile a kernel that no prebuilt variant fits.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache
from pathlib import Path


def discover(folder: str | Path) -> tuple[str, ...]:
    """The family modules in ``folder`` (a ``kernel_src`` directory): ``*.py`` names not starting
    with ``_``, sorted."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules([str(folder)]) if not m.name.startswith("_")))


#: The op families, i.e. the modules of this package that hold kernels.
FAMILIES = discover(Path(__file__).parent)


def family_module(name: str):
    """Import and return one family module (``norm`` -> ``cutile_kernels.kernel_src.norm``).

    Raises:
        KeyError: no such family module.
    """
    if name not in FAMILIES:
        raise KeyError(f"unknown kernel family {name!r}; known: {FAMILIES}")
    return importlib.import_module(f"{__name__}.{name}")


def all_variants():
    """Every VariantSpec of every family, in build order (families by name)."""
    return [spec for fam in FAMILIES for spec in getattr(family_module(fam), "VARIANTS", ())]


@lru_cache(maxsize=1)
def tileiras_found() -> bool:
    """Whether cuda.tile finds its ``tileiras`` compiler here (what both an ahead-of-time build and
    a JIT compile need); once per process."""
    try:
        from cuda.tile._compile import _find_compiler_bin  # private in cuda-tile 1.7 (pinned)

        _find_compiler_bin()
        return True
    except Exception:  # noqa: BLE001 - any failure to find it is the same answer
        return False
