"""Write the example notebooks from the cell sources below (the notebooks are generated, not edited).

    python examples/make_notebooks.py           write examples/0*.ipynb (without outputs)
    python examples/make_notebooks.py --check   exit 1 if a notebook's cells differ from these

Cells tagged ``gpu`` need a CUDA GPU: the tests execute the notebooks on the CPU without them
(``tests/test_notebooks.py``), and ``benchmarks/device_notebooks.sh`` executes every cell on the
GPU machine; the executed notebooks it saves, outputs included, are the ones committed. Regenerate
after editing a cell, then rerun the device script for the outputs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent


def md(text: str):
    return new_markdown_cell(text.strip("\n"))


def code(text: str, gpu: bool = False):
    cell = new_code_cell(text.strip("\n"))
    if gpu:
        cell.metadata["tags"] = ["gpu"]
    return cell


# ---------------------------------------------------------------------------------------------
# 01: kernelize a model
# ---------------------------------------------------------------------------------------------

KERNELIZE = [
    md("""
# Kernelize a transformers model with cutile-kernels

`from_pretrained(..., use_kernels=True, kernel_config=cutile_kernels.kernel_config())` replaces the
forwards of a model's hub layers (transformers' `RMSNorm`, ...) with our layers from the local build,
which run cuTile kernels on an NVIDIA GPU. This notebook loads the embedded `tiny` preset (a two-layer
Llama with seeded weights; nothing is downloaded), kernelizes it and checks its logits against the stock
model, then shows how the same build is loaded from the Hugging Face Hub.

Cells tagged `gpu` need a CUDA GPU. Without one (CI) they are skipped and the rest runs on the CPU,
where our layers take their PyTorch reference path. The outputs saved here come from a run of every
cell on an H200 (`benchmarks/device_notebooks.sh`).
"""),
    code("""
import json
import logging
import tempfile
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm in a notebook without ipywidgets
import kernels
import torch
import transformers
from transformers import AutoModelForCausalLM

import cutile_kernels
from cutile_kernels import registry
from cutile_kernels_tools import presets
from cutile_kernels_tools.bench.worker import kernelized_layers

# kernels warns once per hub layer that a mapping does not name (rotary_pos_emb, ...): expected here.
logging.getLogger("kernels").setLevel(logging.ERROR)
transformers.utils.logging.disable_progress_bar()
print(f"torch {torch.__version__}, transformers {transformers.__version__}, kernels {kernels.__version__}")
print("GPU:", torch.cuda.get_device_name() if torch.cuda.is_available() else None)

variant = registry.default_build_dir() / registry.VARIANT_DIR  # <build>/torch-cuda, what `cutile-kernels build` writes
assert (variant / "metadata.json").is_file(), f"no build in {variant}: run `cutile-kernels build`"
manifest = json.loads((variant / "cutile_kernels" / "manifest.json").read_text())
print("build:", variant)
print("archs:", manifest["archs"], "| cubins:", len(manifest["variants"]),
      "| kernels:", sorted({v["kernel"] for v in manifest["variants"]}))
"""),
    code("""
WORK = Path(tempfile.mkdtemp(prefix="cutile-nb01-"))
ckpt = presets.materialize("tiny", out_dir=WORK / "tiny")  # config + seeded weights, saved with safetensors
print(sorted(p.name for p in ckpt.iterdir()))

ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
stock = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
with torch.no_grad():
    stock_logits = stock(ids).logits
print(type(stock).__name__, tuple(stock_logits.shape), stock_logits.dtype)
"""),
    md("""
## `use_kernels=True` with our `kernel_config()`

`cutile_kernels.kernel_config()` maps each transformers hub layer name we cover to our layer in the
build (`"<build>/torch-cuda:CutileRMSNorm"`, loaded with `kernels.LocalLayerRepository`, offline). On a
model that is not on CUDA it maps nothing, because the kernels run on NVIDIA GPUs: here, on the CPU,
the model keeps its own layers and its logits are the stock ones.
"""),
    code("""
cfg = cutile_kernels.kernel_config()
print(cfg.kernel_mapping)
model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, use_kernels=True, kernel_config=cfg).eval()
with torch.no_grad():
    logits = model(ids).logits
print("device:", model.device, "| layers replaced:", kernelized_layers(model),
      "| logits equal to stock:", torch.equal(logits, stock_logits))
assert torch.equal(logits, stock_logits)
"""),
    md("""
### What kernelizing does

To watch the replacement itself on the CPU, ask `kernels` to kernelize for the `cpu` device with our
layer from the build. `kernels` validates the layer class (no `__init__`, no extra members, the same
`forward` signature) and rebinds each decorated module's `forward`. On the CPU our layer runs its
PyTorch reference, which is transformers' `LlamaRMSNorm` formula in the same rounding order, so the
logits are bit-identical; the build's own copy of the package counts the calls.
"""),
    code("""
from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

repo = LocalLayerRepository(variant, layer_name="CutileRMSNorm")
model_cpu = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
with use_kernel_mapping({"RMSNorm": {"cpu": {Mode.INFERENCE: repo}}}, inherit_mapping=False):
    kernelize(model_cpu, mode=Mode.INFERENCE, device="cpu")
print("layers replaced:", kernelized_layers(model_cpu))
print("forward of model.norm:", model_cpu.model.norm.forward.__func__.__module__, model_cpu.model.norm.forward.__qualname__)

build_pkg = kernels.get_local_kernel(variant)  # the module kernels imported from the build
build_pkg.reset_stats()
with torch.no_grad():
    logits = model_cpu(ids).logits
print("calls:", build_pkg.stats()["reference_calls"], "| logits equal to stock:", torch.equal(logits, stock_logits))
assert kernelized_layers(model_cpu) == {"CutileRMSNorm": 2 * 2 + 1} and torch.equal(logits, stock_logits)
"""),
    md("""
Kernelizing only rebinds `forward`: `save_pretrained` writes the stock checkpoint, tensor for tensor.
"""),
    code("""
from safetensors.torch import load_file

model_cpu.save_pretrained(WORK / "saved")
a, b = load_file(ckpt / "model.safetensors"), load_file(WORK / "saved" / "model.safetensors")
same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
print(len(b), "tensors; identical to the checkpoint:", same)
assert same
"""),
    md("""
## On a GPU

On CUDA the same `from_pretrained` call swaps the layers and our cuTile kernels run. Random weights give
near-uniform logits, so tokens are no correctness signal: compare logits with a float32 reference of the
stock model, and require ours to be no further from it than stock bf16 is.
"""),
    code("""
dev_ids = ids.cuda()
ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, device_map="cuda").eval()
stock_gpu = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device_map="cuda").eval()
ours_gpu = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device_map="cuda",
                                                use_kernels=True, kernel_config=cutile_kernels.kernel_config()).eval()
print("layers replaced:", kernelized_layers(ours_gpu))

gpu_pkg = kernels.get_local_kernel(variant)
gpu_pkg.reset_stats()
with torch.no_grad():
    r, s, o = (m(dev_ids).logits.float() for m in (ref, stock_gpu, ours_gpu))
rel = lambda x: ((x - r).norm() / r.norm()).item()
print(f"relative L2 error against float32: stock bf16 {rel(s):.3e}, ours {rel(o):.3e}")
print("cuTile launches:", gpu_pkg.stats()["launches"])
assert kernelized_layers(ours_gpu).get("CutileRMSNorm") == 5 and rel(o) <= 1.1 * rel(s)
assert sum(gpu_pkg.stats()["launches"].values()) > 0
""", gpu=True),
    md("""
A model that is already loaded is kernelized with `cutile_kernels.kernelize(model)` (the same mapping,
through `kernels.kernelize`):
"""),
    code("""
loaded = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device_map="cuda").eval()
cutile_kernels.kernelize(loaded)
with torch.no_grad():
    o2 = loaded(dev_ids).logits.float()
print("layers replaced:", kernelized_layers(loaded), "| logits equal to the use_kernels=True model:", torch.equal(o2, o))
assert torch.equal(o2, o)
""", gpu=True),
    md("""
## From the Hugging Face Hub

`cutile-kernels publish --repo-id ORG/NAME` uploads the build as a kernel repository: the card on `main`,
the build under `build/torch-cuda/` on the branch `v1` (`--dry-run` stages and lists the files without
uploading). Users then load it the standard way; `trust_remote_code=True` is needed unless the
organisation is a trusted kernel publisher, and `cuda-tile` must be installed (kernels 0.17 does not let a
kernel declare it):

```python
from kernels import get_kernel, LayerRepository
from transformers import AutoModelForCausalLM, KernelConfig

ck = get_kernel("ORG/NAME", version=1, trust_remote_code=True)       # functions: ck.rms_norm(x, w, eps)
layer = LayerRepository(repo_id="ORG/NAME", layer_name="CutileRMSNorm", version=1, trust_remote_code=True)
cfg = KernelConfig({"RMSNorm": ("ORG/NAME:CutileRMSNorm", {"version": 1, "trust_remote_code": True})})
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda",
                                             use_kernels=True, kernel_config=cfg)
```

The local equivalents, used above and tested offline: `kernels.get_local_kernel(<build>/torch-cuda)`,
`kernels.LocalLayerRepository(<build>/torch-cuda, layer_name=...)` and `cutile_kernels.kernel_config()`.
"""),
]

# ---------------------------------------------------------------------------------------------
# 02: benchmark and coverage
# ---------------------------------------------------------------------------------------------

BENCHMARK = [
    md("""
# Benchmark a model and read the coverage report

`cutile-kernels bench` runs one checkpoint through several paths (stock transformers, ours, and where
they can run Liger-Kernel, TileGym and the compiled variants), each in its own process, and reports:
a correctness gate against a float32 reference, prefill time and decode tokens/s, roofline fractions,
and, from a profiled prefill and decode, the kernel **coverage**: which kernels the device time goes
to, which of them are ours, and how much faster the model could get if the others were.

From the shell: `cutile-kernels bench llama-3.2-1b --out DIR`. Here: the same through the Python API.
On a GPU the notebook benches the `llama-3.2-1b` preset (the config of meta-llama/Llama-3.2-1B with seeded
weights); on the CPU the embedded `tiny` model at small sizes, where timings say nothing about our
kernels (every layer takes its PyTorch path) but the report has the same shape. Cells tagged `gpu` need
a CUDA GPU; the saved outputs come from an H200 run.
"""),
    code("""
import tempfile
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm in a notebook without ipywidgets
import torch

from cutile_kernels_tools import bench

ON_GPU = torch.cuda.is_available()
if ON_GPU:
    MODEL = "llama-3.2-1b"
    settings = bench.BenchSettings(paths=("stock", "cutile"), prefill_len=1024, decode_batches=(1, 16),
                                   decode_steps=16, repeats=5)
else:
    MODEL = "tiny"
    settings = bench.BenchSettings.for_cpu(paths=("stock", "cutile"), decode_batches=(1,), rounds=1, repeats=2,
                                           decode_steps=4)
OUT = Path(tempfile.mkdtemp(prefix="cutile-nb02-"))
report = bench.run(MODEL, settings, out_dir=OUT, progress=False)
bench.print_report(report)
"""),
    md("""
## The report

`report` is the dict that `bench.json` holds (schema in `docs/bench-schema.json`). The gate compares
each path with stock eager on relative L2 error, KL divergence and top-5 agreement against the float32
reference: a path passes when it is no further from the reference than stock is (within 10 %).
"""),
    code("""
print(report["schema"], "|", report["model"])
env = report["environment"]
print("device:", env.get("gpu", env["device"]), "| versions:", {k: v for k, v in env["versions"].items() if v})
for name, g in report["gate"].items():
    print(f"gate {name}: {'passed' if g['passed'] else 'FAILED'}",
          [(c["metric"], f"{c['path']:.4g}", f"stock {c['stock']:.4g}") for c in g["checks"]])
for name, p in report["paths"].items():
    if not p.get("ok"):
        print(f"{name:7s} FAILED: {p.get('error')}")
        continue
    decode = ", ".join(f"b={d['batch']}: {d['tokens_per_s']:.1f} tok/s" for d in p["decode"])
    print(f"{name:7s} prefill {p['prefill_ms']['median']:.2f} ms "
          f"({p['roofline']['prefill_fraction']:.1%} of the matmul roofline) | {decode}")
assert report["gate"]["cutile"]["passed"]
"""),
    md("""
## Reading the coverage

Each path's `coverage` covers a profiled prefill and a few decode steps:

* `device_us`, `launches`: device time (microseconds) and kernel launches in that window;
* `ours_time_share`, `ours_launch_share`: the fractions that were our cuTile kernels;
* `ours`: our kernels, by exact variant symbol; `uncovered`: every other kernel, most time first, with
  the aten ops that launched it and the modules it ran in (layer index folded to `*`);
* `ceiling`: the Amdahl bound `1 / (1 - share + share / s)` on the whole window's speedup if that one
  kernel ran `s = amdahl_speedup` times faster. The uncovered kernel with the highest ceiling is the
  next one worth writing;
* `by_class`: device time per kernel class (GEMM, attention, elementwise, copies, ...).
"""),
    code("""
def show_coverage(name, top=6):
    cov = report["paths"][name]["coverage"]
    print(f"{name}: {cov['device_us'] / 1e3:.2f} ms device time, {cov['launches']} launches; "
          f"ours: {cov['ours_time_share']:.1%} of the time, {cov['ours_launch_share']:.1%} of the launches")
    for row in cov["ours"]:
        print(f"   ours  {row['share']:6.1%}  x{row['count']:<5d} {row['kernel'][:56]}  in {', '.join(row['modules'][:2])}")
    for row in cov["uncovered"][:top]:
        print(f"   other {row['share']:6.1%}  x{row['count']:<5d} {row['kernel'][:56]}  op {', '.join(row['ops'][:1])}"
              f"  in {', '.join(row['modules'][:2])}  ceiling {row['ceiling']:.3f}x")
    print("   by class (ms):", {k: round(v / 1e3, 3) for k, v in cov["by_class"].items()})


for name, p in report["paths"].items():
    if p.get("coverage"):
        show_coverage(name)
"""),
    code("""
cov = report["paths"]["cutile"]["coverage"]
nxt = max(cov["uncovered"], key=lambda r: r["ceiling"])
print(f"next kernel to write: {nxt['kernel'][:60]} ({nxt['share']:.1%} of the device time; "
      f"launched by {nxt['ops'][:2]} in {nxt['modules'][:3]}): at most {nxt['ceiling']:.3f}x on this window "
      f"if it ran {cov['amdahl_speedup']}x faster")
"""),
    code("""
# On a GPU our kernels must have run; the coverage names each variant that did.
assert report["cutile_kernels_ran"], report.get("note")
ours_rows = report["paths"]["cutile"]["coverage"]["ours"]
print(f"{len(ours_rows)} of our kernel variants ran: {sum(r['us'] for r in ours_rows) / 1e3:.3f} ms, "
      f"{sum(r['count'] for r in ours_rows)} launches")
assert ours_rows
""", gpu=True),
    md("""
## The files

`out_dir` (`--out` on the command line) gets `bench.json`, a Markdown `report.md` and two plots: decode
tokens/s against batch size per path, and device time by kernel class.
"""),
    code("""
from IPython.display import Image, display

print(sorted(p.name for p in OUT.iterdir()))
print((OUT / "report.md").read_text()[:1500])
for png in ("throughput.png", "breakdown.png"):
    if (OUT / png).is_file():
        display(Image(filename=str(OUT / png), width=560))
"""),
]

# ---------------------------------------------------------------------------------------------
# 03: a new kernel, end to end
# ---------------------------------------------------------------------------------------------

KERNEL_SRC = '''
%%writefile {SCRATCH}/tutorial_kernels/quick_gelu.py
"""QuickGELU, y = x * sigmoid(1.702 x) (tutorial): the cuTile kernel and its build matrix.

Rounding order of transformers' QuickGELUActivation.forward (activations.py, v5.22.2),
``input * torch.sigmoid(1.702 * input)``: each of the three torch ops computes in float32 and
rounds to the input dtype, so the kernel rounds after each step as well.
"""
import cuda.tile as ct

from cutile_kernels.kernel_src._spec import DTYPE_TAGS, LAYOUTS, ConstParam, VariantSpec, array

ZERO = ct.PaddingMode.ZERO


@ct.kernel
def quick_gelu_kernel(x, y, BLOCK: ct.Constant[int]):
    """y = quick_gelu(x), BLOCK elements per block. x, y: (N,), same dtype."""
    bid = ct.bid(0)
    h = ct.load(x, index=(bid,), shape=(BLOCK,), padding_mode=ZERO).astype(ct.float32)
    t = (h * 1.702).astype(x.dtype).astype(ct.float32)                  # 1.702 * input
    s = (1.0 / (1.0 + ct.exp(-t))).astype(x.dtype).astype(ct.float32)  # torch.sigmoid(...)
    ct.store(y, index=(bid,), tile=(h * s).astype(y.dtype))             # input * ...


#: Elements per block (every tile dimension is a power of two; the last block is masked).
BLOCK = 1024

#: One variant per dtype and layout, in the runtime's order of preference: "aligned" (16-byte aligned
#: base, unit stride, length a multiple of 16: vectorised loads) before "generic" (no assumption).
VARIANTS = [
    VariantSpec("quick_gelu", "tutorial_kernels.quick_gelu", "quick_gelu_kernel",
                f"{DTYPE_TAGS[dtype]}.b{BLOCK}.{layout}",
                (array("x", dtype, 1, layout), array("y", dtype, 1, layout), ConstParam("BLOCK", BLOCK)))
    for dtype in ("bfloat16", "float16", "float32") for layout in LAYOUTS
]
'''

OPS_SRC = '''
%%writefile {SCRATCH}/tutorial_kernels/ops.py
"""The QuickGELU op (tutorial): the first prebuilt variant whose compiled assumptions the tensors
satisfy, launched with cuda-python; else transformers' formula in PyTorch.

In the package an op calls ``cutile_kernels.dispatch.run(kernel, constants, args, n_inputs, grid)``,
which does this against the build's process-wide registry (and adds the JIT fallback and its
logging), inside a ``torch.library.custom_op`` with a fake implementation. The tutorial's build has
a registry of its own.
"""
from collections import Counter
from pathlib import Path

import torch

from cutile_kernels import registry
from cutile_kernels.launcher import Launcher

from .quick_gelu import BLOCK

BUILD = Path(__file__).resolve().parents[1] / "build"
REGISTRY = registry.Registry(registry.package_dir_of(BUILD))
LAUNCHER = Launcher()
LAUNCHES = Counter()  # variant tag -> launches


def quick_gelu_reference(x: torch.Tensor) -> torch.Tensor:
    """transformers' QuickGELUActivation.forward: x * sigmoid(1.702 x), each op rounded to x.dtype."""
    return x * torch.sigmoid(1.702 * x)


def pick_variant(x: torch.Tensor, y: torch.Tensor, arch: str = "sm_90"):
    """(variant, "") for the first variant of ``arch`` that takes (x, y), else (None, the reason)."""
    return REGISTRY.select("quick_gelu", arch, {"BLOCK": BLOCK}, (x, y))


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """QuickGELU of ``x`` (any shape; bfloat16, float16 or float32): a new contiguous tensor of its
    shape and dtype. On CUDA the cuTile kernel when a prebuilt variant fits, else the reference."""
    if not x.is_cuda:
        return quick_gelu_reference(x)
    flat = x.reshape(-1)  # a view of a contiguous x; a copy otherwise
    y = torch.empty_like(flat)
    arch = REGISTRY.arch_for(torch.cuda.get_device_capability(x.device))
    variant, why = pick_variant(flat, y, arch) if arch else (None, "no cubins for this GPU")
    if variant is None:
        return quick_gelu_reference(x)
    if flat.numel():
        LAUNCHER.launch(variant, (-(-flat.numel() // BLOCK), 1, 1), (flat, y), x.device.index)
        LAUNCHES[variant.tag] += 1
    return y.view(x.shape)
'''

LAYER_SRC = '''
%%writefile {SCRATCH}/tutorial_kernels/layers.py
"""The QuickGELU layer in the ``kernels`` layer convention, and its mapping row (tutorial)."""
import torch
from torch import nn

from .ops import quick_gelu


class CutileQuickGELU(nn.Module):
    """transformers' QuickGELUActivation on the cuTile kernel (inference only): input of any shape,
    output of the same shape and dtype. No ``__init__`` and no state: kernelize only rebinds the
    ``forward`` of the module it replaces."""

    can_torch_compile = False  # the package's layers call torch custom ops and compile; this op is not one
    has_backward = False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return quick_gelu(input)


#: transformers hub layer name -> layer class (QuickGELUActivation is decorated "QuickGELU").
MAPPING = {"QuickGELU": "CutileQuickGELU"}
'''

TEST_SRC = '''
%%writefile {SCRATCH}/test_quick_gelu.py
"""The tutorial QuickGELU. CPU: the Definition's reference and the op's reference are transformers'
module, variant choice, the kernels layer contract. GPU: the cubins against transformers for every
dtype at odd sizes, misaligned and strided inputs, and proof that the kernel ran."""
import json
from pathlib import Path

import pytest
import torch
from kernels.layer.layer import _validate_layer
from transformers.activations import QuickGELUActivation

from tutorial_kernels.layers import CutileQuickGELU
from tutorial_kernels.ops import LAUNCHES, pick_variant, quick_gelu, quick_gelu_reference

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("dtype", DTYPES)
def test_references_are_transformers(dtype):
    x = torch.randn(3, 77, dtype=dtype) * 4
    want = QuickGELUActivation()(x)
    assert torch.equal(quick_gelu_reference(x), want)
    definition = json.loads(Path(__file__).with_name("inventory").joinpath(
        "definitions", "activation", "quick_gelu.json").read_text())
    scope = {}
    exec(definition["reference"], scope)
    assert torch.equal(scope["run"](x), want)


def test_layer_contract():
    _validate_layer(check_cls=QuickGELUActivation, cls=CutileQuickGELU, repo="tutorial")


@pytest.mark.parametrize("dtype", DTYPES)
def test_variant_choice(dtype):
    x = torch.randn(4097, dtype=dtype)
    aligned, misaligned = x[:4096], x[1:]
    assert pick_variant(aligned, torch.empty_like(aligned))[0].tag.endswith(".aligned")
    assert pick_variant(misaligned, torch.empty_like(misaligned))[0].tag.endswith(".generic")
    variant, why = pick_variant(x.double(), torch.empty_like(x.double()))
    assert variant is None and "dtypes" in why


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 1000, 4096, 3 * 1024 + 5])
def test_kernel_matches_transformers(dtype, n):
    base = torch.randn(2 * n + 1, device="cuda", dtype=dtype) * 4
    before = sum(LAUNCHES.values())
    for x in (base[:n], base[1:n + 1], base[::2][:n]):  # aligned, misaligned, strided
        torch.testing.assert_close(quick_gelu(x), QuickGELUActivation()(x))
    assert sum(LAUNCHES.values()) == before + 3
'''

NEW_KERNEL = [
    md("""
# Add a cuTile kernel, end to end

A new kernel touches one place per stage of the project's data flow
(`kernel_src -> builder -> torch-ext -> layers`), plus its inventory entry and its tests. This notebook
walks through all of them for a small example, transformers' `QuickGELUActivation`
(`x * sigmoid(1.702 x)`, decorated as the hub layer `QuickGELU`), and writes every piece into a scratch
directory so that nothing in the checkout changes:

1. the cuTile kernel and its build matrix;
2. the ahead-of-time compile of every variant to cubins, on a machine without a GPU;
3. the inventory Definition and Solution (FlashInfer-Bench format);
4. the op and the layer, and kernelizing a model with it;
5. the tests.

It runs on a CPU in well under a minute (CI runs it); cells tagged `gpu` launch the cubins and need a
CUDA GPU. The saved outputs come from an H200 run; that machine has no cuTile compiler, so its run reuses
the cubins compiled from the same source on a machine that has one (`CUTILE_TUTORIAL_DIR`).
"""),
    code("""
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm in a notebook without ipywidgets
import torch
import transformers

logging.getLogger("kernels").setLevel(logging.ERROR)
transformers.utils.logging.disable_progress_bar()
SCRATCH = Path(os.environ.get("CUTILE_TUTORIAL_DIR") or tempfile.mkdtemp(prefix="cutile-tutorial-")).resolve()
(SCRATCH / "tutorial_kernels").mkdir(parents=True, exist_ok=True)
(SCRATCH / "tutorial_kernels" / "__init__.py").write_text("")
sys.path.insert(0, str(SCRATCH))
print("scratch directory:", SCRATCH)
"""),
    md("""
## 1. The kernel and its build matrix

A cuTile kernel (`import cuda.tile as ct`) works on tiles: `ct.load` reads a `(BLOCK,)` tile of `x` at
block index `bid` (zero-padded past the end), the arithmetic runs on whole tiles, `ct.store` writes the
tile back (masked past the end). Every tile dimension is a power of two; `ct.Constant` parameters are
compiled in. The math follows the rounding order of the transformers module it replaces, so that our
layer is as close to the float32 truth as stock transformers is.

The build matrix lists one `VariantSpec` per compiled variant: the dtype, the constants, and the
assumptions each array is compiled with. Declared assumptions (unit stride, 16-byte alignment, length a
multiple of 16) let the compiler vectorise; the runtime checks them on the real tensors before every
launch and falls back to a more general variant when they do not hold. In the package this file is
`kernel_src/<family>.py`, found by its name (no list to edit).
"""),
    code(KERNEL_SRC),
    md("""
## 2. Compile ahead of time

`cutile_kernels_build.build` compiles each variant for each arch with
`cuda.tile.compilation.export_kernel` (no GPU needed, only the `tileiras` compiler) and writes the build
in the `kernels` variant layout: `metadata.json`, the package, `manifest.json` and
`cubins/<sm_XX>/<symbol>.cubin`. `cutile-kernels build` does the same for every family of the package.
"""),
    code("""
from cutile_kernels import dispatch
from cutile_kernels_build import build

from tutorial_kernels.quick_gelu import VARIANTS

source_sha = hashlib.sha256((SCRATCH / "tutorial_kernels" / "quick_gelu.py").read_bytes()).hexdigest()
stamp = SCRATCH / "build" / "quick_gelu.py.sha256"
if dispatch.jit_available():  # the tileiras compiler is installed: compile here
    manifest = build(SCRATCH / "build", archs=["sm_90"], specs=VARIANTS, jobs=2, progress=False)
    stamp.write_text(source_sha)
else:  # a GPU machine without the compiler: reuse the cubins compiled from this very source elsewhere
    assert stamp.is_file() and stamp.read_text() == source_sha, "no tileiras here, and no cubins built from this source"
    manifest = json.loads((SCRATCH / "build/torch-cuda/cutile_kernels/manifest.json").read_text())
    print("no tileiras on this machine: reusing the cubins compiled from this source in", SCRATCH / "build")
print(f"{len(manifest['variants'])} variants, cuda-tile {manifest['cuda_tile']}, tileiras {manifest['tileiras']}")
for v in manifest["variants"]:
    print(f"  {v['variant']:22s} {v['arch']}  {v['cubin_bytes']:6d} bytes  {v['symbol']}")
"""),
    code("""
# What the runtime reads back for one variant: the assumptions of each array, checked before a launch.
aligned = manifest["variants"][0]
print(json.dumps([p for p in aligned["params"] if p["kind"] == "array"][0], indent=1))
"""),
    md("""
## 3. The inventory entry

Every kernel is described in the inventory (`inventory/` in the checkout), a FlashInfer-Bench dataset: a
**Definition** says what is computed (named axes, typed inputs and outputs, and a PyTorch reference
`run`), a **Solution** says which implementation computes it and for which hardware. Traces of
`cutile-kernels evaluate` add the measured error and speedup per workload. Here both go to the scratch
directory, and the Definition's reference is checked against the transformers module it describes.
"""),
    code("""
definition = {
    "name": "quick_gelu",
    "op_type": "activation",
    "description": "QuickGELU, x * sigmoid(1.702 x), with transformers' rounding order "
                   "(v5.22.2, src/transformers/activations.py::QuickGELUActivation.forward).",
    "axes": {"n": {"type": "var", "description": "elements"}},
    "inputs": {"x": {"shape": ["n"], "dtype": "bfloat16"}},
    "outputs": {"y": {"shape": ["n"], "dtype": "bfloat16"}},
    "reference": "import torch\\n\\n\\ndef run(x):\\n    return x * torch.sigmoid(1.702 * x)\\n",
    "tags": ["hub_layer:QuickGELU", "tutorial"],
}
solution = {
    "name": "quick_gelu_cutile",
    "definition": "quick_gelu",
    "author": "cutile-kernels tutorial",
    "spec": {"language": "cuda-tile", "target_hardware": ["sm_90"],
             "entry_point": "tutorial_kernels/quick_gelu.py::quick_gelu_kernel", "dependencies": ["cuda-tile==1.7.0"]},
    "sources": [{"path": "tutorial_kernels/quick_gelu.py",
                 "content": (SCRATCH / "tutorial_kernels" / "quick_gelu.py").read_text()}],
}
for kind, obj in (("definitions", definition), ("solutions", solution)):
    path = SCRATCH / "inventory" / kind / "activation" / f"{obj['name']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\\n")
    print("wrote", path.relative_to(SCRATCH))

from transformers.activations import QuickGELUActivation

scope = {}
exec(definition["reference"], scope)
x = torch.randn(1000, dtype=torch.bfloat16) * 4
assert torch.equal(scope["run"](x), QuickGELUActivation()(x))
print("the Definition's reference equals QuickGELUActivation")
"""),
    md("""
## 4. The op and the layer

The op picks the first prebuilt variant whose compiled assumptions the tensors satisfy and launches it;
otherwise (CPU tensors, float64, no cubins for the GPU) it computes the reference. In the package it is a
`torch.library` custom op in `torch-ext/cutile_kernels/ops/<family>.py` that calls `dispatch.run`.
"""),
    code(OPS_SRC),
    code("""
from tutorial_kernels.ops import pick_variant

x = torch.randn(4097, dtype=torch.bfloat16)
for name, t in {"contiguous, 4096": x[:4096], "offset by one element": x[1:], "every other element": x[::2],
                "float16, 4096": x[:4096].half(), "float64": x.double()}.items():
    variant, why = pick_variant(t, torch.empty_like(t))
    print(f"{name:24s} -> {variant.tag if variant else '-':22s} {why}")
"""),
    md("""
The layer follows the `kernels` layer contract: an `nn.Module` without `__init__` or extra members
(only `has_backward` and `can_torch_compile`), whose `forward` has the signature of the forward it
replaces. Its `MAPPING` row names the transformers hub layer it serves; in the package it lives in
`layers/<family>.py`, whose module is listed in `layers._registry.MAPPING_MODULES`.
"""),
    code(LAYER_SRC),
    code("""
from kernels import Mode, kernelize, use_kernel_mapping
from kernels.layer.layer import _validate_layer
from transformers import LlamaConfig, LlamaForCausalLM

from tutorial_kernels.layers import CutileQuickGELU

_validate_layer(check_cls=QuickGELUActivation, cls=CutileQuickGELU, repo="tutorial")  # raises if not
print("CutileQuickGELU passes the kernels layer validator")


class TutorialRepo:
    \"\"\"For kernels, a repository is anything whose load() returns the layer class; the shipped layers
    come from the build through LocalLayerRepository or, from the Hub, LayerRepository.\"\"\"

    def load(self):
        return CutileQuickGELU


config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512, hidden_act="quick_gelu")
torch.manual_seed(0)
model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
ids = torch.randint(0, 512, (2, 16))
with torch.no_grad():
    want = model(ids).logits
with use_kernel_mapping({"QuickGELU": {"cpu": {Mode.INFERENCE: TutorialRepo()}}}, inherit_mapping=False):
    kernelize(model, mode=Mode.INFERENCE, device="cpu")
acts = [m for m in model.modules() if isinstance(m, QuickGELUActivation)]
with torch.no_grad():
    got = model(ids).logits
print(len(acts), "activations now run", {m.forward.__qualname__ for m in acts}, "| logits unchanged:", torch.equal(got, want))
assert torch.equal(got, want)
"""),
    md("""
## 5. The tests

CPU tests run everywhere (references, variant choice, the layer contract); GPU tests compare the cubins
with transformers for every dtype at odd sizes and on misaligned and strided inputs, and check that the
kernel really ran. In the package: `tests/test_<family>.py`, GPU tests marked `@pytest.mark.gpu`.
"""),
    code(TEST_SRC),
    code("""
proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--color=no", "test_quick_gelu.py"],
                      cwd=SCRATCH, capture_output=True, text=True,
                      env={**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRATCH), os.environ.get("PYTHONPATH", "")])})
print(proc.stdout[-2500:], proc.stderr[-2500:])
assert proc.returncode == 0
"""),
    md("""
## On a GPU

The cubins against transformers' module, and the kernelized model against a float32 reference of the
stock model (ours must be no further from it than stock bf16 is).
"""),
    code("""
from tutorial_kernels.ops import LAUNCHES, quick_gelu

for dtype in (torch.bfloat16, torch.float16, torch.float32):
    x = torch.randn(1 << 20, device="cuda", dtype=dtype) * 4
    want, got = QuickGELUActivation()(x), quick_gelu(x)
    ulp = torch.finfo(dtype).eps * want.abs().clamp_min(torch.finfo(dtype).tiny)
    print(f"{str(dtype):15s} max |ours - transformers| = {(got - want).abs().max().item():.3g} "
          f"({((got - want).abs() / ulp).max().item():.1f} ulp), equal elements {(got == want).float().mean().item():.4%}")
    torch.testing.assert_close(got, want)
print("launches:", dict(LAUNCHES))
""", gpu=True),
    code("""
import copy

torch.manual_seed(0)
ref = LlamaForCausalLM(config).eval().cuda()  # float32 weights
stock, ours = (copy.deepcopy(ref).to(torch.bfloat16) for _ in range(2))
with use_kernel_mapping({"QuickGELU": {"cuda": {Mode.INFERENCE: TutorialRepo()}}}, inherit_mapping=False):
    kernelize(ours, mode=Mode.INFERENCE, device="cuda")
before = sum(LAUNCHES.values())
with torch.no_grad():
    r, s, o = (m(ids.cuda()).logits.float() for m in (ref, stock, ours))
rel = lambda t: ((t - r).norm() / r.norm()).item()
print(f"relative L2 error against float32: stock bf16 {rel(s):.3e}, ours {rel(o):.3e}; "
      f"{sum(LAUNCHES.values()) - before} kernel launches")
assert rel(o) <= 1.1 * rel(s) and sum(LAUNCHES.values()) - before == config.num_hidden_layers
""", gpu=True),
    md("""
## Shipping it

| piece | here | in the checkout |
|---|---|---|
| kernel + build matrix | `tutorial_kernels/quick_gelu.py` | `kernel_src/<family>.py` (found by its name) |
| compile | `build(..., specs=VARIANTS)` | `cutile-kernels build` (every family's `VARIANTS`) |
| Definition, Solution | `inventory/` in the scratch directory | `inventory/definitions/<family>/`, `inventory/solutions/<family>/` |
| op | `tutorial_kernels/ops.py` | `torch-ext/cutile_kernels/ops/<family>.py`: `define_op` (custom op, fake, autograd, CPU path) over a launch through `dispatch.run` |
| layer + mapping row | `tutorial_kernels/layers.py` | `layers/<family>.py`, listed in `layers._registry.MAPPING_MODULES` |
| tests | `test_quick_gelu.py` | `tests/test_<family>.py` |

Then `cutile-kernels bench <preset>` shows the new kernel in the coverage report, and
`cutile-kernels publish --repo-id ORG/NAME --dry-run` lists what the Hub repository would receive.
"""),
]


NOTEBOOKS = {
    "01_kernelize.ipynb": KERNELIZE,
    "02_benchmark.ipynb": BENCHMARK,
    "03_new_kernel.ipynb": NEW_KERNEL,
}


def notebook(cells) -> nbformat.NotebookNode:
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def _key(nb) -> list:
    return [(c.cell_type, c.source, sorted(c.get("metadata", {}).get("tags", []))) for c in nb.cells]


def check(directory: Path = HERE) -> list[str]:
    """Names of the notebooks in ``directory`` whose cells (type, source, tags) differ from these."""
    stale = []
    for name, cells in NOTEBOOKS.items():
        path = directory / name
        if not path.is_file() or _key(nbformat.read(str(path), as_version=4)) != _key(notebook(cells)):
            stale.append(name)
    return stale


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--check" in argv:
        stale = check()
        for name in stale:
            print(f"{name} differs from examples/make_notebooks.py: regenerate it", file=sys.stderr)
        return 1 if stale else 0
    for name, cells in NOTEBOOKS.items():
        nbformat.write(notebook(cells), str(HERE / name))
        print("wrote", HERE / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
