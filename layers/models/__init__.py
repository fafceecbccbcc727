"""One module per model family: what we claim for it, the transformers code it reproduces, its patches.

A family module (``llama.py``, ``qwen3.py``, ...) declares a :class:`Family` as ``FAMILY`` (the
``model_type`` values it covers, its :class:`~.._pins.Pin` rows, the benchmark presets of its real
checkpoints) and, when it has forwards of its own to reproduce, their patch rows as ``PATCH_ROWS``.
Modules here are found by name, as the kernel families are: adding a family is adding its module
(and its tiny-config row in ``tests/families.py``). ``layers/_registry.py`` registers the pins and
patch rows of every family at import.

Features shared by several families (the RMSNorm and RoPE hub layers, the fused MLP and q/k/v, the
decoder's residual-add + norm handoff) stay in their feature modules under ``layers/``; each checks
per class, at patch time, that the class computes the formula it reproduces (a pin of some family).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path

from .._pins import Pin


@dataclass(frozen=True)
class Family:
    """A model family we claim.

    Attributes:
        name: the family (its module's name).
        model_types: transformers ``model_type`` values of the family (each has a tiny config in the
            tests and a row in the README's coverage table).
        pins: the transformers functions the family's code paths reproduce, with their digests
            (none for a family whose modules are another family's code: those pins gate it).
        presets: benchmark presets (``tools/presets.py``) from the configs of real checkpoints.
        covered: one line: what runs in our kernels for this family.
        not_covered: one line: what still runs stock code.
        default: whether the package claims it by default (its own kernels run under
            ``kernel_config()`` as is); False while they are opt-in patches
            (``kernel_config(include=[...])``) the GPU bench has not accepted yet. What a family
            shares with another's code (OLMo 2's MLP is Llama's) runs by default either way.
    """

    name: str
    model_types: tuple[str, ...]
    pins: tuple[Pin, ...] = ()
    presets: tuple[str, ...] = ()
    covered: str = ""
    not_covered: str = ""
    default: bool = True


def discover() -> tuple[str, ...]:
    """The family modules of this package, by name (no list to keep)."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])
                        if not m.name.startswith("_")))


def modules() -> list:
    """The family modules, imported, in name order."""
    return [importlib.import_module(f"{__name__}.{name}") for name in discover()]


#: family name -> Family, of every family module.
FAMILIES: dict[str, Family] = {m.FAMILY.name: m.FAMILY for m in modules()}


def claimed_model_types(opt_in: bool = False) -> tuple[str, ...]:
    """Every ``model_type`` of the families the default ``kernel_config()`` accelerates (with
    ``opt_in``: also those whose kernels are opt-in patches), in family order."""
    return tuple(t for f in FAMILIES.values() if f.default or opt_in for t in f.model_types)


def family_of(model_type: str) -> Family | None:
    """The family that claims ``model_type``, or None."""
    return next((f for f in FAMILIES.values() if model_type in f.model_types), None)


__all__ = ["FAMILIES", "Family", "claimed_model_types", "discover", "family_of", "modules"]
