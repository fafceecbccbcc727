"""Ahead-of-time compilation of one variant: VariantSpec -> cuda.tile KernelSignature -> cubin."""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.metadata
import io
import subprocess
import time
from functools import lru_cache
from pathlib import Path

import cuda.tile as ct
from cuda.tile.compilation import (
    ArrayConstraint,
    CallingConvention,
    ConstantConstraint,
    KernelSignature,
    ScalarConstraint,
    export_kernel,
)

from cutile_kernels import kernel_src
from cutile_kernels.kernel_src._spec import ArrayParam, ConstParam, ScalarParam, VariantSpec

#: The calling convention every prebuilt variant uses; the runtime packs arguments for it.
CALLING_CONVENTION = "cutile_python_v1"


class BuildError(RuntimeError):
    """A variant failed to compile; the message names the kernel, the variant and the arch."""


#: How to get the AOT toolchain: the project's own extra, which pins tileiras, nvcc (its ptxas) and
#: nvvm to one release (cuda-tile's own ``[tileiras]`` extra may resolve a mixed set that fails).
INSTALL_HINT = 'pip install -e ".[build]" in the cutile-kernels checkout'


class ToolchainMissing(BuildError):
    """No ``tileiras`` here: nothing can be compiled ahead of time (one message, with
    :data:`INSTALL_HINT`, instead of one failure per variant)."""


def toolchain_problem() -> str | None:
    """Why nothing can be compiled here (no ``tileiras`` found by cuda.tile), or None."""
    return None if kernel_src.tileiras_found() else f"no cuTile AOT toolchain (tileiras) installed: {INSTALL_HINT}"


def require_toolchain() -> None:
    """Raises:
        ToolchainMissing: :func:`toolchain_problem` is not None."""
    problem = toolchain_problem()
    if problem is not None:
        raise ToolchainMissing(problem)


def _ct_dtype(name: str):
    return getattr(ct, name)


def constraint(param):
    """The cuda.tile.compilation constraint that encodes a parameter's assumptions."""
    if isinstance(param, ConstParam):
        return ConstantConstraint(param.value)
    if isinstance(param, ScalarParam):
        return ScalarConstraint(_ct_dtype(param.dtype))
    if isinstance(param, ArrayParam):
        stride_constant = [1 if d in param.stride_one else None for d in range(param.ndim)]
        return ArrayConstraint(
            _ct_dtype(param.dtype),
            param.ndim,
            index_dtype=_ct_dtype(param.index_dtype),
            stride_lower_bound_incl=0,
            alias_groups=(),
            may_alias_internally=False,
            stride_constant=stride_constant if any(s is not None for s in stride_constant) else None,
            stride_divisible_by=param.stride_divisible_by,
            shape_divisible_by=param.shape_divisible_by,
            base_addr_divisible_by=param.base_addr_divisible_by,
        )
    raise TypeError(f"unknown parameter type {type(param).__name__}")


def signature(spec: VariantSpec) -> KernelSignature:
    """The KernelSignature of a variant, with cuTile's mangled symbol name."""
    cconv = getattr(CallingConvention, CALLING_CONVENTION)()
    sig = KernelSignature([constraint(p) for p in spec.params], cconv)
    return sig.with_mangled_symbol(spec.function)


def kernel_object(spec: VariantSpec):
    """The ``@ct.kernel`` object a spec compiles: ``spec.module`` names a kernel_src family, or
    (for experiments outside the shipped matrix) a dotted module path."""
    module = importlib.import_module(spec.module) if "." in spec.module else kernel_src.family_module(spec.module)
    return getattr(module, spec.function)


@lru_cache(maxsize=None)
def toolchain_versions() -> dict:
    """cuda-tile and tileiras versions, recorded in the manifest and in each variant's hash."""
    versions = {"cuda_tile": importlib.metadata.version("cuda-tile")}
    try:
        versions["tileiras"] = importlib.metadata.version("nvidia-cuda-tileiras")
    except importlib.metadata.PackageNotFoundError:
        try:
            out = subprocess.run(["tileiras", "--version"], capture_output=True, text=True, timeout=30)
            versions["tileiras"] = out.stdout.strip().splitlines()[-1]
        except (OSError, subprocess.SubprocessError, IndexError):
            versions["tileiras"] = "unknown"
    return versions


def kernel_sources(module: str) -> list[Path]:
    """The files a family's cubins are compiled from: its module, ``kernel_src/_spec.py``, and every
    ``kernel_src`` module it imports relatively (``from .norm import ...``, ``from ._pdl import ...``),
    transitively, in a fixed order. ``module``: a family name (``norm``) or a dotted module (a sweep's
    candidates). Raises ``FileNotFoundError`` for an unknown family."""
    root = Path(kernel_src.__file__).parent
    first = Path(importlib.import_module(module).__file__) if "." in module else root / f"{module}.py"
    if not first.is_file():
        raise FileNotFoundError(first)
    seen, todo = [first, root / "_spec.py"], [first]
    while todo:
        tree = ast.parse(todo.pop().read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                dep = root / f"{node.module.replace('.', '/')}.py"
                if dep.is_file() and dep not in seen:
                    seen.append(dep)
                    todo.append(dep)
    return seen


@lru_cache(maxsize=None)
def _source_digest(module: str) -> str:
    """Digest of what a family's cubins depend on (:func:`kernel_sources`): an edit to a device
    helper another family imports (norm's for qk_norm_rope, _pdl.py's wait) rebuilds its variants."""
    h = hashlib.sha256()
    for path in kernel_sources(module):
        h.update(path.read_bytes())
    return h.hexdigest()


def variant_hash(spec: VariantSpec, arch: str) -> str:
    """Content hash of a variant: its source, its assumptions, its arch and the toolchain."""
    h = hashlib.sha256()
    h.update(_source_digest(spec.module).encode())
    h.update(repr((spec.function, spec.params, arch, CALLING_CONVENTION)).encode())
    h.update(repr(sorted(toolchain_versions().items())).encode())
    return h.hexdigest()[:20]


def compile_variant(spec: VariantSpec, arch: str) -> tuple[bytes, float]:
    """Compile one variant for one arch; returns (cubin bytes, seconds).

    Raises:
        ToolchainMissing: no tileiras here (before anything is tried).
        BuildError: the variant failed to compile.
    """
    require_toolchain()
    t0 = time.perf_counter()
    buf = io.BytesIO()
    try:
        export_kernel(kernel_object(spec), [signature(spec)], buf, gpu_code=arch, output_format="cubin")
    except Exception as exc:  # noqa: BLE001 - re-raised with the variant named
        raise BuildError(f"kernel {spec.kernel!r} variant {spec.tag!r} for {arch} failed to compile: "
                         f"{type(exc).__name__}: {exc}") from exc
    return buf.getvalue(), time.perf_counter() - t0
