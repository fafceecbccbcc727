"""cuTile device code and build matrices, one module per op family. Imports cuda.tile, never torch.

Each family module defines its ``@ct.kernel`` functions and a ``VARIANTS`` list of
:class:`~._spec.VariantSpec`. :func:`all_variants` gathers them for the builder; the runtime
imports a family module only to JIT-compile a kernel that no prebuilt variant fits.
"""

from __future__ import annotations

import importlib
from functools import lru_cache

#: The op families, i.e. the modules of this package that hold kernels.
FAMILIES = ("norm", "activation", "rope", "attention", "rope_cos_sin", "qk_norm_rope")


def family_module(name: str):
    """Import and return one family module (``norm`` -> ``cutile_kernels.kernel_src.norm``)."""
    if name not in FAMILIES:
        raise KeyError(f"unknown kernel family {name!r}; known: {FAMILIES}")
    return importlib.import_module(f"{__name__}.{name}")


def all_variants():
    """Every VariantSpec of every family, in build order."""
    return [spec for fam in FAMILIES for spec in family_module(fam).VARIANTS]


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
