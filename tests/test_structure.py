"""The tree's shape (CPU): no module of the packages imports a module that imports it back, directly
or not, at module level or inside a function (the data flows one way: kernel_src -> build ->
runtime and ops -> layers -> tools)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    mods = {}
    for pkg, rel in dirs.items():
        for f in (ROOT / rel).rglob("*.py"):  # subpackages too (ops, layers.models, ...)
            parts = f.relative_to(ROOT / rel).with_suffix("").parts
            if parts[0] in ("kernel_src", "layers") and pkg == "cutile_kernels":
                continue  # shipped inside the runtime package, mapped by their own package-dir row
            name = ".".join((pkg, *parts))
            mods[name.removesuffix(".__init__")] = f
    return mods


def _imports(name: str, path: Path, mods: dict) -> set[str]:
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
            # `from pkg import mod` imports the submodule; `from mod import name` the module
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in mods and t != name:
                out.add(t)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    mods = _modules()
    assert {"cutile_kernels.layers.patch", "cutile_kernels_tools.bench", "cutile_kernels.ops.norm",
            "cutile_kernels.layers.models.qwen3", "cutile_kernels.layers.models"} <= set(mods)
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_with_rows_is_gathered():
    # A layers/ module that declares MAPPING or PATCH_ROWS but is missing from layers/_registry.py's
    # tuples would be silently ignored; family modules (layers/models/) are found by name.
    import importlib

    from cutile_kernels.layers import _registry, models

    gathered_patches = {m.__name__ for m in _registry.PATCH_MODULES}
    gathered_maps = {m.__name__ for m in (*_registry.MAPPING_MODULES, *_registry.MAPPING_LEFT_OUT)}
    for f in sorted((ROOT / "layers").glob("*.py")) + sorted((ROOT / "layers" / "models").glob("*.py")):
        if f.stem in ("__init__", "_registry"):  # the gatherer itself
            continue
        pkg = "cutile_kernels.layers" + (".models" if f.parent.name == "models" else "")
        mod = importlib.import_module(f"{pkg}.{f.stem}")
        if hasattr(mod, "PATCH_ROWS"):
            assert mod.__name__ in gathered_patches, f"{f.name} declares PATCH_ROWS that nothing registers"
        rows = getattr(mod, "MAPPING", None)
        if isinstance(rows, dict) and rows and rows is not _registry.MAPPING:  # its own, non-empty rows
            assert mod.__name__ in gathered_maps, f"{f.name} declares MAPPING rows that nothing gathers"
    assert {m.__name__ for m in models.modules() if hasattr(m, "PATCH_ROWS")} <= gathered_patches


def test_every_mapped_layer_is_exported_by_layers():
    # kernels finds a mapped layer by class name on the build's `layers` module: one mapped but not
    # exported fails only when a model with that hub name is kernelized on a GPU.
    from cutile_kernels import layers
    from cutile_kernels.layers import _registry

    assert set(_registry.LAYERS) == set(_registry.MAPPING.values())
    for name, cls in _registry.LAYERS.items():
        assert getattr(layers, name, None) is cls and name in layers.__all__, name
