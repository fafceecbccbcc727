"""The example notebooks (examples/*.ipynb) run on the CPU path: every cell not tagged ``gpu`` is
executed in a fresh kernel with CUDA hidden, and must not raise (the notebooks assert their own
results). The notebooks must also be what ``examples/make_notebooks.py`` generates, and every cell
that needs CUDA must carry the ``gpu`` tag."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from cutile_kernels_tools import notebooks  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("0*.ipynb"))
#: Source that only runs with a CUDA device (``%%writefile`` cells only write a file: not checked).
CUDA_ONLY = re.compile(r"\.cuda\(|device_map=\"cuda\"|device=\"cuda\"")


def _generator():
    spec = importlib.util.spec_from_file_location("make_notebooks", EXAMPLES / "make_notebooks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_three_notebooks_generated_from_their_source():
    gen = _generator()
    assert [p.name for p in NOTEBOOKS] == sorted(gen.NOTEBOOKS) == [
        "01_kernelize.ipynb", "02_benchmark.ipynb", "03_new_kernel.ipynb"]
    assert gen.check(EXAMPLES) == []


def test_check_notices_an_edited_notebook(tmp_path):
    gen = _generator()
    for name, cells in gen.NOTEBOOKS.items():
        nbformat.write(gen.notebook(cells), str(tmp_path / name))
    assert gen.check(tmp_path) == []
    nb = nbformat.read(str(tmp_path / "02_benchmark.ipynb"), as_version=4)
    nb.cells[1].source += "\nprint('edited')"
    nbformat.write(nb, str(tmp_path / "02_benchmark.ipynb"))
    assert gen.check(tmp_path) == ["02_benchmark.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_cuda_cells_are_tagged_gpu(path):
    nb = nbformat.read(str(path), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    untagged = [c.source[:80] for c in code if CUDA_ONLY.search(c.source) and not c.source.startswith("%%writefile")
                and notebooks.GPU_TAG not in notebooks.tags(c)]
    assert untagged == []
    assert any(notebooks.GPU_TAG in notebooks.tags(c) for c in code)  # each has a GPU part
    assert any(notebooks.GPU_TAG not in notebooks.tags(c) for c in code)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_on_the_cpu(path, built_package_dir, tmp_path, monkeypatch):
    from cutile_kernels import dispatch

    if path.stem.startswith("03") and not dispatch.jit_available():
        pytest.skip("the new-kernel notebook compiles a kernel: needs the tileiras toolchain (the `build` extra)")
    # The kernel process inherits this environment: no GPU, presets and tutorial files in tmp.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("CUTILE_KERNELS_PRESET_DIR", str(tmp_path / "presets"))
    monkeypatch.setenv("CUTILE_KERNELS_BUILD_DIR", str(built_package_dir.parent.parent))
    monkeypatch.delenv("CUTILE_TUTORIAL_DIR", raising=False)
    nb = notebooks.execute(path, timeout=300, out_path=tmp_path / path.name)
    source = nbformat.read(str(path), as_version=4)
    cpu_cells = [c for c in source.cells if c.cell_type == "code" and notebooks.GPU_TAG not in notebooks.tags(c)]
    ran = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.source for c in ran] == [c.source for c in cpu_cells]
    assert [c.execution_count for c in ran] == list(range(1, len(ran) + 1))
    assert not [o for c in ran for o in c.outputs if o.output_type == "error"]
