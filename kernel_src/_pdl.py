"""Programmatic dependent launch (PDL): the device side, and the build twins that carry it.

CUDA's programmatic dependent launch (sm_90+, CUDA programming guide, "Programmatic Dependent
Launch and Synchronization") lets a kernel launched with the programmatic-stream-serialization
attribute start while the kernel before it in the stream still runs: its blocks become resident
once every block of the one before has let dependents launch (or exited), and
``griddepcontrol.wait`` (``ct.grid_dependency_control_wait``) holds them until that kernel has
finished and its writes are visible. The launch latency and the kernel's prologue then overlap the
kernel before; in a decode step of ~150 small launches that gap is ~0.4 us a launch on an H100
(Llama-3.2-1B at batch 1: replay 1.247 ms against 1.188 ms of kernels, 2026-12-07).

A kernel of ours takes a ``PDL`` constant: 0 builds it as before (no wait: it must never be
launched with the attribute); 1 waits at its very start and then lets the next kernel launch, so
the kernel reads and writes nothing before the one before it has finished (the results are the
same bits as without). The runtime launches a variant with the attribute exactly when its ``PDL``
is 1 and its arch sm_90 or newer (``torch-ext/cutile_kernels/launcher.py``; for sm_8x, which has no
programmatic dependent launch, tileiras drops the wait) and asks for such variants only while a decode
step is captured (``dispatch.programmatic_launches``).

Rejected (H100, 2026-12-07): the GEMV reading its first weight tile before the wait (weights are
not written in a decode step). tileiras keeps the load before ``griddepcontrol.wait`` (its producer
warps issue the tile's TMA copies, its consumer warps wait for them, then for the kernel before),
but the step's replay was slower than with the wait first: Llama-3.2-1B 1.196 against 1.187 ms,
Qwen3-0.6B 1.266 against 1.245.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import cuda.tile as ct

from ._spec import DECODE_DTYPES, ConstParam, VariantSpec


@ct.function
def pdl_wait(PDL: ct.Constant[int]):
    # Wait for the kernel before this one (its writes visible after), then let the next one launch:
    # after the wait, so that at most one kernel's blocks sit waiting behind a running one.
    if PDL != 0:
        ct.grid_dependency_control_wait()
        ct.grid_dependency_control_launch_dependents()


def decode_tile(spec: VariantSpec) -> bool:
    """Whether a variant is what a decode step launches: a 16-bit dtype (``DECODE_DTYPES``), not the
    generic layout (a family built in one layout carries no layout suffix)."""
    return spec.params[0].dtype in DECODE_DTYPES and not spec.tag.endswith(".generic")


def with_pdl(specs: list[VariantSpec], functions: tuple[str, ...],
             twin: Callable[[VariantSpec], bool] = decode_tile) -> list[VariantSpec]:
    """A family's build matrix with programmatic dependent launch twins.

    Args:
        specs: the family's variants, in the runtime's order of preference.
        functions: device functions whose signatures end in a ``PDL`` constant.
        twin: which of their variants also get a twin (default :func:`decode_tile`).

    Returns:
        A new list: ``specs`` in their order, those of ``functions`` with ``PDL`` 0 appended; then, after
        all of them, for each such spec ``twin`` selects, a copy with ``PDL`` 1 and the tag suffix
        ``.pdl``. A request that does not name ``PDL`` thus takes the first fitting variant: one without
        the wait."""
    def with_constant(spec: VariantSpec, value: int, suffix: str = "") -> VariantSpec:
        return dataclasses.replace(spec, tag=spec.tag + suffix, params=(*spec.params, ConstParam("PDL", value)))
    out = [with_constant(s, 0) if s.function in functions else s for s in specs]
    return out + [with_constant(s, 1, ".pdl") for s in specs if s.function in functions and twin(s)]
