"""Ahead-of-time build: every variant of every kernel family, compiled for every arch on a
machine without a GPU, assembled into the Hugging Face ``kernels`` noarch variant layout::

    <out>/torch-cuda/metadata.json              what ``kernels`` 0.17 reads
    <out>/torch-cuda/cutile_kernels/            the package (runtime, ops, layers, kernel_src)
    <out>/torch-cuda/cutile_kernels/_ops.py     a unique torch.library namespace for this build
    <out>/torch-cuda/cutile_kernels/manifest.json
    <out>/torch-cuda/cutile_kernels/cubins/<sm_XX>/<symbol>.cubin   (:func:`cubin_file`)

A variant whose content hash (source, assumptions, arch, toolchain) is unchanged and whose cubin
is present is not recompiled. The build is assembled beside the old one and swapped in when it is
complete, so a failed build leaves the previous one intact. Run it with ``cutile-kernels build``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib
import json
import os
import shutil
import time
from pathlib import Path

from cutile_kernels import kernel_src
from cutile_kernels.kernel_src._spec import DEFAULT_ARCHS, VariantSpec

from .aot import (CALLING_CONVENTION, BuildError, ToolchainMissing, compile_variant, require_toolchain, signature,
                  toolchain_versions, variant_hash)

__all__ = ["BuildError", "ToolchainMissing", "build", "MANIFEST_FORMAT", "PACKAGE", "VARIANT_DIR"]

MANIFEST_FORMAT = 1
PACKAGE = "cutile_kernels"
DIST_NAME = "cutile-kernels"
VARIANT_DIR = "torch-cuda"
#: Major version of the Hub kernel (the ``v1`` branch).
KERNEL_VERSION = 1

#: What ``tileiras`` 13.4 takes as ``--gpu-name`` (cuTile runs on Ampere and newer).
SUPPORTED_ARCHS = ("sm_80", "sm_86", "sm_87", "sm_88", "sm_89", "sm_90", "sm_100", "sm_103", "sm_107",
                   "sm_110", "sm_120", "sm_121")

_ARCH_CAPABILITY = {"sm_80": "8.0", "sm_86": "8.6", "sm_89": "8.9", "sm_90": "9.0a",
                    "sm_100": "10.0a", "sm_120": "12.0"}


def _compile_job(spec: VariantSpec, arch: str, path: str) -> tuple[int, float]:
    data, seconds = compile_variant(spec, arch)
    tmp = Path(path + ".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(data)
    tmp.replace(path)
    return len(data), seconds


def _source_dirs() -> dict[str, Path]:
    """Where the package's three source trees live (torch-ext/cutile_kernels, layers, kernel_src)."""
    import cutile_kernels
    import cutile_kernels.layers

    return {
        "": Path(cutile_kernels.__file__).parent,
        "layers": Path(cutile_kernels.layers.__file__).parent,
        "kernel_src": Path(kernel_src.__file__).parent,
    }


def _copy_package(dest: Path) -> None:
    """Copy the three source trees into ``dest`` (a fresh directory), without the source
    ``_ops.py``: the build writes its own, with this build's namespace."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "cubins", "manifest.json")
    for sub, src in _source_dirs().items():
        if sub:
            shutil.copytree(src, dest / sub, ignore=ignore)
            continue
        for item in src.iterdir():
            if item.name in ("__pycache__", "cubins", "manifest.json", "layers", "kernel_src", "_ops.py"):
                continue
            if item.is_dir():
                shutil.copytree(item, dest / item.name, ignore=ignore)
            else:
                shutil.copy2(item, dest / item.name)


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def validate(archs, kernels, specs) -> None:
    """Refuse arguments that would build nothing useful, before anything is written.

    Raises:
        ValueError: an arch tileiras does not target, or a kernel name no spec has.
    """
    bad = [a for a in archs if a not in SUPPORTED_ARCHS]
    if bad or not archs:
        raise ValueError(f"unsupported arch {bad or archs}; tileiras 13.4 targets {', '.join(SUPPORTED_ARCHS)}")
    if kernels is not None:
        known = sorted({s.kernel for s in specs})
        unknown = [k for k in kernels if k not in known]
        if unknown or not kernels:
            raise ValueError(f"unknown kernel {unknown or kernels}; known: {', '.join(known)}")


#: Manifest fields that describe how a build went, not what it holds: left out of the build id,
#: so that two builds of one tree get the same id.
_VOLATILE = ("compile_s",)


def _package_digest(pkg: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(pkg.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.name != "_ops.py":
            if path.suffix in (".py", ".json"):
                h.update(str(path.relative_to(pkg)).encode())
                data = path.read_bytes()
                if path.name == "manifest.json":
                    m = json.loads(data)
                    for v in m.get("variants", []):
                        for k in _VOLATILE:
                            v.pop(k, None)
                    data = json.dumps(m, sort_keys=True).encode()
                h.update(data)
    return h.hexdigest()


def _write_ops(pkg: Path, namespace: str) -> None:
    (pkg / "_ops.py").write_text(
        '"""Generated by `cutile-kernels build`: the torch.library namespace of this build."""\n'
        "import torch\n\n"
        f"NAMESPACE = {namespace!r}\n"
        f"ops = getattr(torch.ops, NAMESPACE)\n\n\n"
        "def add_op_namespace_prefix(op_name: str) -> str:\n"
        '    """Prefix an op name with this build\'s namespace (`kernels` convention)."""\n'
        '    return f"{NAMESPACE}::{op_name}"\n'
    )


def _load_manifest(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


#: Longest symbol used as a file name as it is: file systems cap a name at 255 bytes, and the
#: builder writes ``<name>.tmp`` first. cuTile's mangled symbols grow with the parameter count
#: (qk_norm_rope_gemma's 8 arrays of 5 dims mangle to ~250 characters).
MAX_SYMBOL_FILE = 160


def _params_json(spec: VariantSpec) -> list[dict]:
    """The manifest's record of ``spec``'s parameters: each one's fields, and for an array the
    dimensions its module's ``ARRAY_FLAT_DIMS`` says every tile indexes with extent 1 (``flat_dims``,
    read by the registry's int32 offset bound; empty when the module says nothing). A key is a
    parameter name, whose dims must hold in every kernel of the module with a parameter of that
    name, or a ``(function, name)`` pair for one kernel, which wins over the name. The builder can
    check only that the dims exist: raises :class:`BuildError` for a dim past the array's rank."""
    module = importlib.import_module(spec.module if "." in spec.module else f"{kernel_src.__name__}.{spec.module}")
    flat = getattr(module, "ARRAY_FLAT_DIMS", {})
    params = spec.params_json()
    for p in params:
        if p["kind"] == "array":
            dims = list(flat.get((spec.function, p["name"]), flat.get(p["name"], ())))
            if any(not 0 <= d < p["ndim"] for d in dims):
                raise BuildError(f"{spec.module}.ARRAY_FLAT_DIMS[{p['name']!r}] = {dims}: {spec.tag}'s {p['name']} has "
                                 f"{p['ndim']} dims")
            p["flat_dims"] = dims
    return params


def cubin_file(symbol: str) -> str:
    """The cubin's file name of a variant: ``<symbol>.cubin``, or for a symbol longer than
    :data:`MAX_SYMBOL_FILE` its first characters and a digest of the whole (unique, stable)."""
    if len(symbol) <= MAX_SYMBOL_FILE:
        return f"{symbol}.cubin"
    return f"{symbol[:MAX_SYMBOL_FILE - 17]}-{hashlib.sha256(symbol.encode()).hexdigest()[:16]}.cubin"


def build(out_dir: str | os.PathLike = "build", archs=DEFAULT_ARCHS, kernels=None, jobs: int | None = None,
          progress: bool = True, force: bool = False, specs: list[VariantSpec] | None = None) -> dict:
    """Compile every variant for every arch and assemble the Hub variant directory.

    Args:
        out_dir: the ``build/`` directory; the variant goes to ``<out_dir>/torch-cuda``.
        archs: target architectures (``sm_80``, ``sm_90``, ``sm_100``, ``sm_120``, ...).
        kernels: optional list of kernel names to build (default: all); the manifest then holds
            only these.
        jobs: parallel compiler processes (default: the CPU count).
        progress: show a tqdm progress bar; ``"quiet"``: one that updates every 30 s (for logs).
        force: recompile even variants whose hash and cubin are unchanged.
        specs: build these variants instead of kernel_src's matrices (tile-config sweeps).

    Returns:
        The manifest (also written to ``<variant>/cutile_kernels/manifest.json``), with a
        ``build_stats`` entry: variants compiled, reused, and seconds.

    Raises:
        ValueError: an unsupported arch or an unknown kernel name (nothing is written).
        ToolchainMissing: a variant needs compiling and there is no tileiras (one message that
            names the install command; nothing is written).
        BuildError: a variant failed to compile (the message names kernel, variant and arch); the
            previous build is left as it was.
    """
    out_dir = Path(out_dir).resolve()
    created = not out_dir.exists()
    all_specs = kernel_src.all_variants() if specs is None else specs
    archs = list(dict.fromkeys(archs))
    validate(archs, kernels, all_specs)
    specs = [s for s in all_specs if kernels is None or s.kernel in kernels]
    variant_dir = out_dir / VARIANT_DIR
    old_pkg = variant_dir / PACKAGE
    old = {(v["arch"], v["symbol"]): v for v in _load_manifest(old_pkg / "manifest.json").get("variants", [])}

    # Everything is assembled in a staging directory and swapped in at the end, so that a failed
    # or interrupted build leaves the previous build as it was.
    staging = out_dir / f".{VARIANT_DIR}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    pkg = staging / PACKAGE
    pkg.mkdir(parents=True)
    _copy_package(pkg)
    tool = toolchain_versions()

    entries, todo, seen = [], [], set()
    for arch in archs:
        for spec in specs:
            sig = signature(spec)
            key = (arch, sig.symbol)
            if key in seen:
                raise BuildError(f"duplicate symbol {sig.symbol} for {arch} (variant {spec.tag})")
            seen.add(key)
            rel = f"cubins/{arch}/{cubin_file(sig.symbol)}"
            entry = {
                "kernel": spec.kernel, "variant": spec.tag, "arch": arch, "symbol": sig.symbol,
                "function": spec.function, "module": spec.module, "cubin": rel,
                "calling_convention": CALLING_CONVENTION, "constants": spec.constants,
                "params": _params_json(spec), "hash": variant_hash(spec, arch), **tool,
            }
            prev = old.get(key)
            if not force and prev and prev.get("hash") == entry["hash"] and (old_pkg / rel).is_file():
                _link_or_copy(old_pkg / rel, pkg / rel)
                entry["cubin_bytes"], entry["compile_s"] = prev["cubin_bytes"], prev["compile_s"]
            else:
                todo.append((spec, arch, entry))
            entries.append(entry)

    t0 = time.perf_counter()
    if todo:
        try:
            require_toolchain()
        except ToolchainMissing:
            shutil.rmtree(staging, ignore_errors=True)
            if created:
                shutil.rmtree(out_dir, ignore_errors=True)  # nothing written, not even the directory
            raise
        jobs = jobs or os.cpu_count() or 1
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(todo), desc=f"cuTile AOT -> {variant_dir} ({len(todo)} variants, {jobs} jobs)",
                       unit="variant", mininterval=30 if progress == "quiet" else 0.1)
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(_compile_job, spec, arch, str(pkg / e["cubin"])): e for spec, arch, e in todo}
            try:
                for fut in concurrent.futures.as_completed(futures):
                    entry = futures[fut]
                    entry["cubin_bytes"], seconds = fut.result()
                    entry["compile_s"] = round(seconds, 3)
                    if bar is not None:
                        bar.update(1)
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
            finally:
                if bar is not None:
                    bar.close()

    manifest = {
        "format": MANIFEST_FORMAT,
        "package": PACKAGE,
        "archs": archs,
        **tool,
        "variants": entries,
    }
    (pkg / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    namespace = f"_{PACKAGE}_cuda_{_package_digest(pkg)[:10]}"
    _write_ops(pkg, namespace)
    metadata = {
        "name": DIST_NAME,
        "id": namespace,
        "version": KERNEL_VERSION,
        "license": "Apache-2.0",
        "python-depends": [],
        "backend": {"type": "cuda", "archs": [_ARCH_CAPABILITY.get(a, a) for a in archs]},
    }
    (staging / "metadata.json").write_text(json.dumps(metadata, indent=1) + "\n")
    retired = out_dir / f".{VARIANT_DIR}.old"
    shutil.rmtree(retired, ignore_errors=True)
    if variant_dir.exists():
        variant_dir.rename(retired)
    staging.rename(variant_dir)
    shutil.rmtree(retired, ignore_errors=True)
    manifest["build_stats"] = {"compiled": len(todo), "reused": len(entries) - len(todo),
                               "seconds": round(time.perf_counter() - t0, 1), "variant_dir": str(variant_dir)}
    return manifest
