"""The variant registry: which prebuilt cubin fits a call.

The build writes a manifest with, for every variant, the assumptions its array arguments were
compiled with (dtype, rank, unit strides, stride / shape divisibility, base alignment, index
width). :func:`select` checks them on the actual tensors (cuTile gives undefined behaviour, i.e.
wrong numbers, when a compiled assumption does not hold) and returns the first variant that fits,
in the build matrix's order of preference, or the reason none does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from .kernel_src._spec import DECODE_DTYPES

ENV_BUILD_DIR = "CUTILE_KERNELS_BUILD_DIR"
VARIANT_DIR = "torch-cuda"
PACKAGE = "cutile_kernels"

_INT32_MAX = 2**31 - 1

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                "int8": torch.int8, "int32": torch.int32, "int64": torch.int64}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
#: The torch dtypes that have decode tiles (``kernel_src._spec.DECODE_DTYPES``).
DECODE_TORCH_DTYPES = frozenset(TORCH_DTYPES[name] for name in DECODE_DTYPES)


def default_build_dir() -> Path:
    """The ``build/`` directory the runtime and ``kernel_config()`` use when none is given.

    ``$CUTILE_KERNELS_BUILD_DIR`` if set; else ``<checkout>/build`` when this package runs from a
    source checkout (editable install); else ``~/.cache/cutile-kernels/build``.
    """
    env = os.environ.get(ENV_BUILD_DIR)
    if env:
        return Path(env).expanduser().resolve()
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / "kernel_src").is_dir():
        return checkout / "build"
    return Path.home() / ".cache" / "cutile-kernels" / "build"


def package_dir_of(build_dir: Path) -> Path:
    """``<build>/torch-cuda/cutile_kernels``: where the manifest and cubins of a build live."""
    return Path(build_dir) / VARIANT_DIR / PACKAGE


def find_package_dir() -> Path | None:
    """The directory holding the manifest this process uses, or None if there is no build.

    A package loaded from a build variant (``kernels.get_local_kernel`` or the Hub) uses its own
    manifest; the source package uses :func:`default_build_dir`.
    """
    here = Path(__file__).resolve().parent
    if (here / "manifest.json").is_file():
        return here
    pkg = package_dir_of(default_build_dir())
    return pkg if (pkg / "manifest.json").is_file() else None


@dataclass(frozen=True)
class ArrayCheck:
    """The compiled assumptions of one array parameter, in a form cheap to test."""

    index: int
    name: str
    dtype: torch.dtype
    ndim: int
    stride_one: tuple[int, ...]
    stride_divisible_by: tuple[int, ...]
    shape_divisible_by: tuple[int, ...]
    base_addr_divisible_by: int
    index_bits: int
    tile_extent: int = 1
    #: Dimensions every tile indexes with extent 1 (the manifest's ``flat_dims``): no reach past them.
    flat_dims: tuple[int, ...] = ()

    def violation(self, t: torch.Tensor) -> str | None:
        """Why ``t`` breaks this parameter's assumptions, or None if it satisfies all of them."""
        if t.dtype != self.dtype:
            return f"{self.name}: dtype {t.dtype} != {self.dtype}"
        if t.dim() != self.ndim:
            return f"{self.name}: rank {t.dim()} != {self.ndim}"
        shape, strides = t.shape, t.stride()
        for d in range(self.ndim):
            if shape[d] == 1:
                continue  # the index along a size-1 dim is always 0; its stride is repacked
            if strides[d] < 0:
                return f"{self.name}: negative stride"
            if d in self.stride_one and strides[d] != 1:
                return f"{self.name}: stride[{d}]={strides[d]} is not 1"
            if strides[d] % self.stride_divisible_by[d]:
                return f"{self.name}: stride[{d}]={strides[d]} not divisible by {self.stride_divisible_by[d]}"
        for d in range(self.ndim):
            if shape[d] % self.shape_divisible_by[d]:
                return f"{self.name}: shape[{d}]={shape[d]} not divisible by {self.shape_divisible_by[d]}"
        if t.data_ptr() % self.base_addr_divisible_by:
            return f"{self.name}: base address not {self.base_addr_divisible_by}-byte aligned"
        if self.index_bits == 32 and _max_offset(t, self.tile_extent, self.flat_dims) > _INT32_MAX:
            return f"{self.name}: offsets exceed int32 indexing"
        return None


def _max_offset(t: torch.Tensor, tile_extent: int = 1, flat_dims: tuple[int, ...] = ()) -> int:
    # Largest element offset, plus a tile's reach past the edge along any dimension but those every
    # tile indexes with extent 1 (those lanes are masked, but their offsets are still computed in the
    # index type).
    strides = [st for d, (s, st) in enumerate(zip(t.shape, t.stride())) if s > 1 and d not in flat_dims] or [1]
    return sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0) + tile_extent * max(strides)


def internal_overlap(t: torch.Tensor) -> bool:
    """True if two in-bounds indices of ``t`` address the same element (e.g. expand(), stride 0)."""
    dims = sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1)
    extent = 1
    for st, s in dims:
        if st < extent:
            return True
        extent = st * (s - 1) + extent
    return False


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) bytes that ``t`` can touch."""
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    span = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return (t.data_ptr(), t.data_ptr() + (span + 1) * t.element_size())


def row_arcs(t: torch.Tensor) -> dict[int, int]:
    """``{R: e}`` in bytes: for each stride ``R`` of ``t`` (in bytes) such that every dimension
    with a smaller stride spans ``e < R`` bytes together and every other stride is a multiple of
    ``R``, the bytes ``t`` touches lie, modulo ``R``, in one arc of ``e`` bytes starting at
    ``data_ptr()``. E.g. q and k split from one fused projection ``(B, S, Nq + 2 Nkv)``: modulo the
    row stride, q is the arc of its ``Nq`` columns and k the arc of its ``Nkv`` columns."""
    size = t.element_size()
    dims = [(n, st * size) for n, st in zip(t.shape, t.stride()) if n > 1]
    arcs = {}
    for r in {st for _, st in dims if st > 0}:
        ext = size + sum((n - 1) * st for n, st in dims if st < r)
        # ext == r covers the whole circle and can prove nothing: left out (fewer per-call checks)
        if ext < r and all(st % r == 0 for _, st in dims if st >= r):
            arcs[r] = ext
    return arcs


def disjoint_arcs(arcs_a: dict[int, int], arcs_b: dict[int, int], ptr_a: int, ptr_b: int) -> bool:
    """True if two arrays of one buffer are proven to touch no common byte: for some shared row
    stride ``R`` (see :func:`row_arcs`) their arcs modulo ``R``, starting at the two pointers, do
    not meet. False means not proven (they may still be disjoint)."""
    for r, ea in arcs_a.items():
        eb = arcs_b.get(r)
        if eb is not None:
            d = (ptr_b - ptr_a) % r
            if ea <= d and d + eb <= r:
                return True
    return False


def overlapping_pair(tensors) -> tuple[int, int] | None:
    """Indices of two arrays that may touch the same bytes (kernels assume no aliasing), or None.
    Byte ranges that overlap are still disjoint when the arrays interleave row by row
    (:func:`disjoint_arcs`), e.g. the q and k views of one fused QKV projection."""
    ranges = [byte_range(t) for t in tensors]
    for i in range(len(ranges)):
        for j in range(i + 1, len(ranges)):
            (a0, a1), (b0, b1) = ranges[i], ranges[j]
            if a0 < b1 and b0 < a1 and not disjoint_arcs(row_arcs(tensors[i]), row_arcs(tensors[j]), a0, b0):
                return i, j
    return None


@dataclass
class Variant:
    """One prebuilt cubin of one kernel, as described by the manifest."""

    kernel: str
    tag: str
    arch: str
    symbol: str
    function: str
    module: str
    cubin: Path
    constants: dict
    params: list[dict]
    arrays: tuple[ArrayCheck, ...] = field(default=())

    @classmethod
    def from_manifest(cls, entry: dict, pkg_dir: Path) -> "Variant":
        arrays = []
        for i, p in enumerate(entry["params"]):
            if p["kind"] == "array":
                arrays.append(ArrayCheck(
                    index=i, name=p["name"], dtype=TORCH_DTYPES[p["dtype"]], ndim=p["ndim"],
                    stride_one=tuple(p["stride_one"]),
                    stride_divisible_by=tuple(p["stride_divisible_by"]),
                    shape_divisible_by=tuple(p["shape_divisible_by"]),
                    base_addr_divisible_by=p["base_addr_divisible_by"],
                    index_bits=64 if p["index_dtype"] == "int64" else 32,
                    tile_extent=max([1] + [v for v in entry["constants"].values() if isinstance(v, int)]),
                    flat_dims=tuple(p.get("flat_dims", ())),
                ))
        return cls(kernel=entry["kernel"], tag=entry["variant"], arch=entry["arch"], symbol=entry["symbol"],
                   function=entry["function"], module=entry["module"], cubin=pkg_dir / entry["cubin"],
                   constants=dict(entry["constants"]), params=list(entry["params"]), arrays=tuple(arrays))

    def violation(self, args) -> str | None:
        """Why the call's arguments break this variant's assumptions, or None if they fit."""
        for check in self.arrays:
            reason = check.violation(args[check.index])
            if reason is not None:
                return reason
        return None


class Registry:
    """All variants of one build, indexed by (kernel, arch)."""

    def __init__(self, pkg_dir: Path | None):
        self.pkg_dir = pkg_dir
        self.manifest: dict = {}
        self._by_kernel_arch: dict[tuple[str, str], list[Variant]] = {}
        if pkg_dir is not None:
            self.manifest = json.loads((pkg_dir / "manifest.json").read_text())
            for entry in self.manifest.get("variants", []):
                v = Variant.from_manifest(entry, pkg_dir)
                self._by_kernel_arch.setdefault((v.kernel, v.arch), []).append(v)
        self.archs = sorted({a for _, a in self._by_kernel_arch}, key=_arch_key)
        self._candidates: dict = {}

    def variants(self, kernel: str | None = None, arch: str | None = None) -> list[Variant]:
        return [v for (k, a), vs in self._by_kernel_arch.items() for v in vs
                if (kernel is None or k == kernel) and (arch is None or a == arch)]

    def arch_for(self, capability: tuple[int, int]) -> str | None:
        """The built arch whose cubins run on a device of this compute capability.

        A cubin runs on the same major version with an equal or newer minor; sm_90 and sm_100
        cubins from tileiras are arch-specific (sm_90a, ...), so they need the exact capability.
        """
        major, minor = capability
        best = None
        for arch in self.archs:
            a_major, a_minor = _arch_key(arch)
            exact_only = a_major in (9, 10)
            ok = (a_major, a_minor) == (major, minor) if exact_only else (a_major == major and a_minor <= minor)
            if ok and (best is None or _arch_key(arch) > _arch_key(best)):
                best = arch
        return best

    def select(self, kernel: str, arch: str, want: dict, args) -> tuple[Variant | None, str]:
        """The first variant of ``kernel`` for ``arch`` whose constants include ``want`` and whose
        assumptions hold for ``args``; else (None, the reason the last candidate was refused)."""
        key = (kernel, arch, tuple(sorted(want.items())))
        cands = self._candidates.get(key)
        if cands is None:
            cands = [v for v in self._by_kernel_arch.get((kernel, arch), ())
                     if all(v.constants.get(k) == val for k, val in want.items())]
            self._candidates[key] = cands
        if not cands:
            return None, f"no prebuilt {kernel} variant for {arch} with {want}"
        dtypes = tuple(args[c.index].dtype for c in cands[0].arrays)
        same_dtype = [v for v in cands if all(c.dtype == d for c, d in zip(v.arrays, dtypes))]
        if not same_dtype:
            return None, f"no prebuilt {kernel} variant takes dtypes {[str(d) for d in dtypes]}"
        reason = ""
        for v in same_dtype:  # the last one is the most permissive layout: report its reason
            reason = v.violation(args)
            if reason is None:
                return v, ""
        return None, f"no prebuilt {kernel} variant fits ({reason})"


def _arch_key(arch: str) -> tuple[int, int]:
    digits = arch.removeprefix("sm_").rstrip("af")
    return int(digits[:-1]), int(digits[-1])


def programmatic_arch(arch: str) -> bool:
    """Whether a kernel built for ``arch`` (``"sm_90"``) with a ``PDL`` 1 twin is launched with
    programmatic dependent launch (sm_90 and newer; for sm_8x tileiras drops the wait, and the launcher
    launches the twin plainly)."""
    return _arch_key(arch) >= (9, 0)


@lru_cache(maxsize=None)
def registry() -> Registry:
    """The process-wide registry of this package copy (loaded once, on first use)."""
    return Registry(find_package_dir())
