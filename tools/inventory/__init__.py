"""The kernel inventory: every kernel described, in the FlashInfer-Bench trace format.

``inventory/`` at the top of the checkout is a FlashInfer-Bench dataset (:mod:`.fib_schema`):

=====================================  =====================================================
``definitions/<family>/<op>.json``     one Definition per operation: axes, typed inputs and
                                       outputs, a PyTorch reference ``run`` and its source
``solutions/<family>/<op>_cutile.json``  one Solution per kernel: language ``cuda-tile``, the
                                       archs, the entry point, the sources, the build-matrix link
``workloads/<family>/<op>.jsonl``      Workloads from real model shapes (workload-only Traces)
``traces/<family>/<op>.jsonl``         Traces that ``cutile-kernels evaluate`` wrote
=====================================  =====================================================

:func:`validate` (``cutile-kernels inventory validate``, run by the test suite) checks that every
kernel of ``kernel_src`` has a Solution and a Definition, that every reference's ``run`` takes the
Definition's inputs in order and returns its outputs, that Workloads fit their Definition, that
a Solution's sources are the tree's files, and that every Solution compiles for its targets.
:func:`.inventory_families.sync` regenerates what is derived from code: the Definitions of the norm
family (here) and of the families :mod:`.inventory_families` describes (activation, rope, attention) -- their
reference is the source of the ops' reference functions -- their Workloads (the presets' shapes)
and Solutions, and every Solution's copies of tree files. A new family adds a table entry there, or
its JSON files (by hand or with ``cutile-kernels autokernelize --scaffold``).
"""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import json
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from .fib_schema import (AxisVar,
                         BuildMatrixLink, BuildSpec, Definition, RandomInput, ScalarInput, Solution, SourceFile,
                         TensorSpec, Trace, Workload, load_jsonl, to_flashinfer_bench)

SUBDIRS = ("definitions", "solutions", "workloads", "traces")
AUTHOR = "cutile-kernels"
#: The transformers release whose code the norm references reproduce (the pinned window's newest).
TRANSFORMERS_PIN = "5.22.2"
#: The source a norm reference restates, at that release.
NORM_SOURCE = "src/transformers/models/llama/modeling_llama.py::LlamaRMSNorm.forward"
#: Token counts of the workloads, as the bench runs them: decode at batch 1 and 16, prefill 1x2048.
TOKEN_COUNTS = {"decode-b1": 1, "decode-b16": 16, "prefill-2048": 2048}
#: Presets whose shapes become Workloads (the real architectures; ``tiny`` is not one).
WORKLOAD_PRESETS = ("llama-3.2-1b", "qwen3-0.6b", "qwen2.5-1.5b", "mistral-7b-v0.3")


def repo_root() -> Path | None:
    """The source checkout these tools run from, else the current directory if it is one (an
    installed copy run from a checkout, as on the GPU machine), else None. A checkout has
    ``kernel_src/`` and ``pyproject.toml``."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):  # <checkout>/tools/inventory/__init__.py
        if (root / "kernel_src").is_dir() and (root / "pyproject.toml").is_file():
            return root
    return None


def default_root() -> Path:
    """``<checkout>/inventory``, else ``./inventory`` (an installed copy run from a checkout)."""
    root = repo_root()
    return (root if root is not None else Path.cwd()) / "inventory"


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

@dataclass
class Inventory:
    """A loaded dataset. Files that fail to parse are listed in ``errors``, not raised."""

    root: Path
    definitions: dict[str, Definition] = field(default_factory=dict)
    solutions: dict[str, Solution] = field(default_factory=dict)
    workloads: dict[str, list[Workload]] = field(default_factory=dict)
    traces: dict[str, list[Trace]] = field(default_factory=dict)
    paths: dict[tuple[str, str], Path] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, root: str | Path | None = None) -> "Inventory":
        """Read every JSON / JSONL file under ``root`` (default :func:`default_root`).

        Raises:
            FileNotFoundError: ``root`` is not a directory.
        """
        root = Path(root) if root is not None else default_root()
        if not root.is_dir():
            raise FileNotFoundError(f"no inventory at {root}")
        inv = cls(root=root)
        for kind, model, table in (("definitions", Definition, inv.definitions),
                                   ("solutions", Solution, inv.solutions)):
            for path in sorted((root / kind).rglob("*.json")):
                try:
                    obj = model.model_validate_json(path.read_text())
                except ValueError as exc:
                    inv.errors.append(f"{path.relative_to(root)}: {_first_line(exc)}")
                    continue
                if obj.name in table:
                    inv.errors.append(f"{path.relative_to(root)}: duplicate {kind[:-1]} name {obj.name!r} "
                                      f"(also {inv.paths[(kind, obj.name)].relative_to(root)})")
                    continue
                table[obj.name] = obj
                inv.paths[(kind, obj.name)] = path
        for kind, table in (("workloads", inv.workloads), ("traces", inv.traces)):
            for path in sorted((root / kind).rglob("*.jsonl")):
                try:
                    rows = load_jsonl(Trace, path.read_text())
                except ValueError as exc:
                    inv.errors.append(f"{path.relative_to(root)}: {_first_line(exc)}")
                    continue
                for t in rows:
                    if (kind == "workloads") != t.is_workload:
                        inv.errors.append(f"{path.relative_to(root)}: a {'workload-only' if t.is_workload else 'evaluated'} "
                                          f"trace of {t.definition!r} does not belong in {kind}/")
                        continue
                    table.setdefault(t.definition, []).append(t.workload if kind == "workloads" else t)
                    inv.paths.setdefault((kind, t.definition), path)
        return inv

    def solutions_of(self, definition: str) -> list[Solution]:
        return [s for s in self.solutions.values() if s.definition == definition]

    def solution_for_kernel(self, kernel: str) -> Solution | None:
        """The Solution whose build-matrix link names ``kernel`` (a ``VariantSpec.kernel``)."""
        return next((s for s in self.solutions.values()
                     if s.spec.build_matrix is not None and s.spec.build_matrix.kernel == kernel), None)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return " ".join(t.strip() for t in text[:3]) if text else type(exc).__name__


def family_dir(definition: Definition) -> str:
    """Subdirectory a Definition's files go to: its ``family:<name>`` tag, else its op_type."""
    return next((t.split(":", 1)[1] for t in definition.tags if t.startswith("family:")), definition.op_type)


def write_definition(root: Path, d: Definition) -> Path:
    return _write(root / "definitions" / family_dir(d) / f"{d.name}.json", d.to_json() + "\n")


def write_solution(root: Path, s: Solution, family: str) -> Path:
    return _write(root / "solutions" / family / f"{s.name}.json", s.to_json() + "\n")


def write_workloads(root: Path, d: Definition, workloads: list[Workload]) -> Path:
    rows = [Trace(definition=d.name, workload=w).to_json(indent=None) for w in workloads]
    return _write(root / "workloads" / family_dir(d) / f"{d.name}.jsonl", "".join(r + "\n" for r in rows))


def append_traces(root: Path, family: str, traces: list[Trace]) -> Path | None:
    """Append evaluated Traces to ``traces/<family>/<definition>.jsonl`` (one file per definition)."""
    last = None
    for t in traces:
        path = root / "traces" / family / f"{t.definition}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(t.to_json(indent=None) + "\n")
        last = path
    return last


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


# ---------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------

def load_reference(d: Definition):
    """The Definition's ``run``: its reference source executed in a fresh namespace.

    Raises:
        Exception: whatever executing the source raises (a missing import, ...).
    """
    namespace = {"__name__": f"cutile_reference_{d.name}"}
    exec(compile(d.reference, f"<reference of {d.name}>", "exec"), namespace)
    return namespace["run"]


def function_params(source: str, name: str) -> list[str] | None:
    """Parameter names of the top-level function ``name`` in ``source`` (None if absent).

    ``*args`` / ``**kwargs`` are returned with their stars, so they never match an input name.
    """
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            a = node.args
            names = [p.arg for p in (*a.posonlyargs, *a.args)]
            names += [f"*{a.vararg.arg}"] if a.vararg else []
            names += [p.arg for p in a.kwonlyargs]
            names += [f"**{a.kwarg.arg}"] if a.kwarg else []
            return names
    return None


def reference_source(functions, run_params: list[str], run_body: str, header: str,
                     imports: tuple[str, ...] = ("import torch",)) -> str:
    """A reference module: ``header`` (a docstring naming the source reproduced), ``imports`` (one
    statement each), the source of ``functions`` (via :mod:`inspect`), and ``run(<run_params>)``
    with ``run_body``."""
    parts = [f'"""{header}"""\n\n' + "".join(f"{line}\n" for line in imports)]
    for fn in functions:
        parts.append(textwrap.dedent(inspect.getsource(fn)))
    parts.append(f"def run({', '.join(run_params)}):\n{textwrap.indent(run_body.strip(), '    ')}\n")
    return "\n\n".join(p.rstrip() + "\n" for p in parts)


# ---------------------------------------------------------------------------------------------
# What is generated from code: the norm family
# ---------------------------------------------------------------------------------------------

def _norm_definitions() -> list[Definition]:
    from cutile_kernels.ops import norm as ops_norm

    header = (f"Reproduces transformers v{TRANSFORMERS_PIN} {NORM_SOURCE} (Qwen2, Qwen3 and Mistral copy it):\n"
              "normalise in float32, round to the input dtype, multiply by the weight.\n"
              "Generated by `cutile-kernels inventory sync` from cutile_kernels.ops.norm.")
    axes = {
        "num_tokens": AxisVar(description="rows: batch x sequence tokens (x heads for per-head norms), flattened"),
        "hidden_size": AxisVar(description="normalised width: the model's hidden_size, or head_dim for q/k norms"),
    }
    tags = ["family:norm", f"source:transformers@v{TRANSFORMERS_PIN}:{NORM_SOURCE}",
            *[f"model:{p}" for p in WORKLOAD_PRESETS]]
    x = TensorSpec(shape=["num_tokens", "hidden_size"], dtype="bfloat16", description="activations")
    w = TensorSpec(shape=["hidden_size"], dtype="bfloat16", description="RMSNorm weight")
    eps = TensorSpec(shape=None, dtype="float32", description="added to the mean square (config.rms_norm_eps)")
    rms = Definition(
        name="rms_norm", op_type="rmsnorm", axes=axes,
        inputs={"x": x, "weight": w, "eps": eps},
        outputs={"y": TensorSpec(shape=["num_tokens", "hidden_size"], dtype="bfloat16",
                                 description="weight * (x / rms(x)), rounded to x.dtype before the product")},
        reference=reference_source([ops_norm.rms_norm_reference], ["x", "weight", "eps"],
                                   "return rms_norm_reference(x, weight, eps)", header),
        tags=tags,
        description=("RMSNorm over the last dimension with transformers' LlamaRMSNorm rounding order "
                     f"(transformers v{TRANSFORMERS_PIN}, {NORM_SOURCE})."),
    )
    add = Definition(
        name="add_rms_norm", op_type="fused_add_rmsnorm", axes=axes,
        inputs={"x": x, "residual": TensorSpec(shape=["num_tokens", "hidden_size"], dtype="bfloat16",
                                               description="the residual stream"),
                "weight": w, "eps": eps},
        outputs={"y": TensorSpec(shape=["num_tokens", "hidden_size"], dtype="bfloat16",
                                 description="rms_norm(x + residual)"),
                 "residual_out": TensorSpec(shape=["num_tokens", "hidden_size"], dtype="bfloat16",
                                            description="x + residual, rounded to the input dtype")},
        reference=reference_source([ops_norm.rms_norm_reference, ops_norm.add_rms_norm_reference],
                                   ["x", "residual", "weight", "eps"],
                                   "return add_rms_norm_reference(x, residual, weight, eps)", header),
        tags=tags,
        description=("The decoder layer's residual add followed by RMSNorm, fused: s = x + residual rounded to "
                     f"the input dtype, then RMSNorm(s) as rms_norm (transformers v{TRANSFORMERS_PIN}, "
                     "LlamaDecoderLayer.forward's `residual + hidden_states` and LlamaRMSNorm.forward)."),
    )
    gemma_source = "src/transformers/models/gemma/modeling_gemma.py::GemmaRMSNorm.forward"
    olmo_source = "src/transformers/models/olmo2/modeling_olmo2.py::Olmo2RMSNorm.forward"
    gemma = Definition(
        name="rms_norm_gemma", op_type="rmsnorm", axes=axes,
        inputs={"x": x, "weight": w, "eps": eps,
                "offset": TensorSpec(shape=None, dtype="float32",
                                     description="added to the weight: 1.0 for Gemma's (1 + weight), 0.0 for OLMo 2")},
        outputs={"y": TensorSpec(shape=["num_tokens", "hidden_size"], dtype="bfloat16",
                                 description="(x / rms(x)) * (offset + weight) in float32, rounded once to x.dtype")},
        reference=reference_source([ops_norm.rms_norm_gemma_reference], ["x", "weight", "eps", "offset"],
                                   "return rms_norm_gemma_reference(x, weight, eps, offset)",
                                   f"Reproduces transformers v{TRANSFORMERS_PIN} {gemma_source} (offset 1.0) and\n"
                                   f"{olmo_source} (offset 0.0): float32 throughout, one rounding at the end.\n"
                                   "Generated by `cutile-kernels inventory sync` from cutile_kernels.ops.norm."),
        tags=["family:norm", f"source:transformers@v{TRANSFORMERS_PIN}:{gemma_source}",
              f"source:transformers@v{TRANSFORMERS_PIN}:{olmo_source}", *[f"model:{p}" for p in FLOAT_NORM_PRESETS]],
        description=("RMSNorm in Gemma's rounding order: normalise and multiply by (offset + weight) in float32, "
                     f"round once (transformers v{TRANSFORMERS_PIN}: GemmaRMSNorm with offset 1, Olmo2RMSNorm with 0; "
                     "Gemma 2/3, Qwen3.5, OLMo 3, GptOss copy them)."),
    )
    qwen_source = "src/transformers/models/qwen3_5/modeling_qwen3_5.py::Qwen3_5DecoderLayer.forward"
    gemma3_source = "src/transformers/models/gemma3/modeling_gemma3.py::Gemma3DecoderLayer.forward"
    add_gemma = Definition(
        name="add_rms_norm_gemma", op_type="fused_add_rmsnorm", axes=axes,
        inputs={"x": x, "residual": add.inputs["residual"], "weight": w, "eps": eps,
                "offset": gemma.inputs["offset"]},
        outputs={"y": TensorSpec(shape=["num_tokens", "hidden_size"], dtype="bfloat16",
                                 description="rms_norm_gemma(x + residual)"),
                 "residual_out": add.outputs["residual_out"]},
        reference=reference_source([ops_norm.rms_norm_gemma_reference, ops_norm.add_rms_norm_gemma_reference],
                                   ["x", "residual", "weight", "eps", "offset"],
                                   "return add_rms_norm_gemma_reference(x, residual, weight, eps, offset)",
                                   f"Reproduces transformers v{TRANSFORMERS_PIN} {qwen_source}'s\n"
                                   "`residual + hidden_states` then its (1 + weight) post_attention_layernorm.\n"
                                   "Generated by `cutile-kernels inventory sync` from cutile_kernels.ops.norm."),
        tags=["family:norm", f"source:transformers@v{TRANSFORMERS_PIN}:{qwen_source}",
              f"source:transformers@v{TRANSFORMERS_PIN}:{gemma3_source}",
              *[f"model:{p}" for p in FUSED_FLOAT_NORM_PRESETS]],
        description=("The decoder layer's residual add followed by RMSNorm in Gemma's rounding order, fused: "
                     "s = x + residual rounded to the input dtype, then rms_norm_gemma(s) (Qwen3.5's decoder; "
                     "Gemma 2 and 3's attention residual add and pre_feedforward_layernorm, patch gemma_add_norm)."),
    )
    olmo_layer_source = "src/transformers/models/olmo2/modeling_olmo2.py::Olmo2DecoderLayer.forward"
    post_add = Definition(
        name="rms_norm_add_gemma", op_type="rmsnorm_fused_add", axes=axes,
        inputs={"x": x, "residual": add.inputs["residual"], "weight": w, "eps": eps,
                "offset": gemma.inputs["offset"]},
        outputs={"y": TensorSpec(shape=["num_tokens", "hidden_size"], dtype="bfloat16",
                                 description="residual + rms_norm_gemma(x), the norm rounded before the add: the new "
                                             "residual stream")},
        reference=reference_source([ops_norm.rms_norm_gemma_reference, ops_norm.rms_norm_add_gemma_reference],
                                   ["x", "residual", "weight", "eps", "offset"],
                                   "return rms_norm_add_gemma_reference(x, residual, weight, eps, offset)",
                                   f"Reproduces transformers v{TRANSFORMERS_PIN} {olmo_layer_source}'s\n"
                                   "post_*_layernorm (offset 0.0) then `residual + hidden_states`.\n"
                                   "Generated by `cutile-kernels inventory sync` from cutile_kernels.ops.norm."),
        tags=["family:norm", f"source:transformers@v{TRANSFORMERS_PIN}:{olmo_layer_source}",
              *[f"model:{p}" for p in POST_NORM_PRESETS]],
        description=("A post-norm block's RMSNorm in Gemma's rounding order followed by the residual add, fused: "
                     "residual + rms_norm_gemma(x), the norm rounded to the input dtype first (OLMo 2's decoder)."),
    )
    return [rms, add, gemma, add_gemma, post_add]


#: Presets whose norms compute Gemma's order (rms_norm_gemma's Workloads), and their offsets.
FLOAT_NORM_PRESETS = {"gemma-3-1b": 1.0, "gemma-2-2b": 1.0, "olmo-2-1b": 0.0, "olmo-3-7b": 0.0}
#: Presets whose decoder fuses the residual add into a Gemma-order norm (add_rms_norm_gemma's):
#: Qwen3.5's decoder, and Gemma 2 and 3's attention block under patch gemma_add_norm.
FUSED_FLOAT_NORM_PRESETS = {"qwen3.5-0.8b": 1.0, "qwen3.5-27b": 1.0, "gemma-3-1b": 1.0, "gemma-2-2b": 1.0}
#: Presets whose post-norm blocks fuse the norm and the residual add (rms_norm_add_gemma's).
POST_NORM_PRESETS = {"olmo-2-1b": 0.0, "olmo-3-7b": 0.0}


def preset_norm_shapes(preset: str) -> list[tuple[str, int, int, float]]:
    """(role, num_tokens, hidden_size, eps) of every RMSNorm a preset runs at the bench's token
    counts: the hidden-state norms, and Qwen3's per-head q/k norms (rows = tokens x heads)."""
    from .. import presets

    cfg = presets.PRESETS[preset].config
    eps = float(cfg["rms_norm_eps"])
    out = []
    for phase, tokens in TOKEN_COUNTS.items():
        out.append((f"hidden/{phase}", tokens, cfg["hidden_size"], eps))
        if cfg["model_type"] in ("qwen3", "gemma3_text"):  # per-head q/k norms
            out.append((f"q_norm/{phase}", tokens * cfg["num_attention_heads"], cfg["head_dim"], eps))
            out.append((f"k_norm/{phase}", tokens * cfg["num_key_value_heads"], cfg["head_dim"], eps))
        elif cfg["model_type"] in ("olmo2", "olmo3"):  # q/k norms over the whole projections, before the head split
            head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
            out.append((f"q_norm/{phase}", tokens, cfg["num_attention_heads"] * head_dim, eps))
            out.append((f"k_norm/{phase}", tokens, cfg["num_key_value_heads"] * head_dim, eps))
    return out


def _norm_workloads(d: Definition) -> list[Workload]:
    rows = []
    presets = {"rms_norm_gemma": FLOAT_NORM_PRESETS, "add_rms_norm_gemma": FUSED_FLOAT_NORM_PRESETS,
               "rms_norm_add_gemma": POST_NORM_PRESETS}
    for preset in presets.get(d.name, WORKLOAD_PRESETS):
        for role, tokens, hidden, eps in preset_norm_shapes(preset):
            if "add" in d.name and not role.startswith("hidden/"):
                continue  # the fused adds are on the residual stream only
            scalars = {"eps": eps, "offset": presets.get(d.name, {}).get(preset)}
            inputs = {name: (ScalarInput(value=scalars[name]) if spec.shape is None else RandomInput())
                      for name, spec in d.inputs.items()}
            rows.append(Workload(axes={"num_tokens": tokens, "hidden_size": hidden}, inputs=inputs,
                                 uuid=f"{preset}/{role}"))
    return rows


def _norm_solutions(root: Path) -> list[tuple[Solution, str]]:
    return [(make_solution(d, kernel=d.name, family="norm", op=d.name, checkout=root), "norm")
            for d in _norm_definitions()]


def make_solution(d: Definition, kernel: str, family: str, op: str, checkout: Path,
                  archs=None, description: str | None = None, body: str | None = None,
                  name: str | None = None) -> Solution:
    """The cuda-tile Solution of ``kernel`` for Definition ``d``, named ``name`` (default
    ``<kernel>_cutile``; another name where two Definitions share a kernel).

    Its entry ``main.py::run`` calls ``cutile_kernels.ops.<family>.<op>`` with the Definition's
    inputs in order (the installed package is what runs), or runs ``body`` when one is given (the
    op imported as ``_op``, the inputs by name: e.g. ``"return _op(q, k, v, scale=scale)"`` for an
    op that takes some of them as keywords); the sources are that entry and the kernel's files from
    ``checkout`` (:func:`kernel_sources`). The build-matrix link lists the device functions of
    ``kernel`` in kernel_src (none yet for a scaffold).
    """
    from cutile_kernels.kernel_src._spec import DEFAULT_ARCHS

    params = list(d.inputs)
    name = name or f"{kernel}_cutile"
    entry = (f'"""Entry point of {name}: the cutile-kernels op `{op}`, whose cuTile kernel is\n'
             f'kernel_src/{family}.py (host side: torch-ext/cutile_kernels/ops/{family}.py)."""\n\n'
             f"from cutile_kernels.ops.{family} import {op} as _op\n\n\n"
             f"def run({', '.join(params)}):\n"
             + textwrap.indent((body or f"return _op({', '.join(params)})").strip(), "    ") + "\n")
    sources = [SourceFile(path="main.py", content=entry)]
    sources += [SourceFile(path=rel, content=(checkout / rel).read_text()) for rel in kernel_sources(checkout, family)]
    functions = kernel_functions().get(kernel, [])
    return Solution(
        name=name, definition=d.name, author=AUTHOR,
        spec=BuildSpec(language="cuda-tile", target_hardware=list(archs or DEFAULT_ARCHS), entry_point="main.py::run",
                       dependencies=["cutile-kernels", f"cuda-tile=={importlib.metadata.version('cuda-tile')}"],
                       destination_passing_style=False,
                       build_matrix=BuildMatrixLink(module=f"cutile_kernels.kernel_src.{family}", kernel=kernel,
                                                    functions=functions or [f"{kernel}_kernel"])),
        sources=sources,
        description=description or (f"cuTile kernels {', '.join(functions) or f'{kernel}_kernel'} (kernel_src/{family}.py), "
                                    f"prebuilt per variant of its build matrix for {', '.join(archs or DEFAULT_ARCHS)}; "
                                    "launched by the cutile-kernels runtime (JIT when no prebuilt variant fits)."),
    )


#: Where the modules of the device code and of the ops live in a source checkout.
_SOURCE_DIRS = {"cutile_kernels.kernel_src": "kernel_src", "cutile_kernels.ops": "torch-ext/cutile_kernels/ops"}


def kernel_sources(checkout: Path, family: str) -> list[str]:
    """The files of ``checkout`` that a family's kernel runs: ``kernel_src/<family>.py``,
    ``torch-ext/cutile_kernels/ops/<family>.py`` and every module of those two folders that they
    import, directly or not (the op definition helper, dtype checks, another family's reference,
    kernel_src/_spec.py); those two first, the rest sorted. The runtime (dispatch, registry,
    launcher) is the installed package's, named in the Solution's dependencies, not copied."""
    start = [rel for rel in (f"kernel_src/{family}.py", f"torch-ext/cutile_kernels/ops/{family}.py")
             if (checkout / rel).is_file()]
    seen, todo = list(start), list(start)
    while todo:
        for dep in _relative_imports(checkout, todo.pop()):
            if dep not in seen:
                seen.append(dep)
                todo.append(dep)
    return start + sorted(seen[len(start):])


def _relative_imports(checkout: Path, rel: str) -> list[str]:
    # The files of _SOURCE_DIRS that ``rel`` imports with relative imports.
    package = next(pkg for pkg, folder in _SOURCE_DIRS.items() if rel.startswith(folder + "/")).split(".")
    found = []
    for node in ast.walk(ast.parse((checkout / rel).read_text())):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        module = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
        for name in [module] + [f"{module}.{a.name}" for a in node.names]:
            pkg, _, leaf = name.rpartition(".")
            if pkg in _SOURCE_DIRS and (checkout / _SOURCE_DIRS[pkg] / f"{leaf}.py").is_file():
                found.append(f"{_SOURCE_DIRS[pkg]}/{leaf}.py")
    return found


def kernel_functions() -> dict[str, list[str]]:
    """kernel name -> its device functions, in build-matrix order, from kernel_src."""
    from cutile_kernels import kernel_src

    out: dict[str, list[str]] = {}
    for spec in kernel_src.all_variants():
        fns = out.setdefault(spec.kernel, [])
        if spec.function not in fns:
            fns.append(spec.function)
    return out


def refresh_solution(s: Solution, checkout: Path, funcs: dict[str, list[str]]) -> Solution:
    """``s`` with every source that is a file of ``checkout`` re-read, and its build-matrix
    functions updated from kernel_src (when the kernel has variants)."""
    sources = [SourceFile(path=src.path, content=(checkout / src.path).read_text())
               if (checkout / src.path).is_file() else src for src in s.sources]
    module = s.spec.build_matrix.module if s.spec.build_matrix is not None else ""
    family = module.removeprefix("cutile_kernels.kernel_src.")
    if module != family and (checkout / f"kernel_src/{family}.py").is_file():  # the kernel's files as they are now
        sources = [src for src in sources if src.path == s.entry_file] + [
            SourceFile(path=rel, content=(checkout / rel).read_text()) for rel in kernel_sources(checkout, family)]
    spec = s.spec
    if spec.build_matrix is not None and funcs.get(spec.build_matrix.kernel):
        spec = spec.model_copy(update={"build_matrix": spec.build_matrix.model_copy(
            update={"functions": funcs[spec.build_matrix.kernel]})})
    return s.model_copy(update={"sources": sources, "spec": spec})


def _snapshot(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for sub in SUBDIRS[:3] for p in (root / sub).rglob("*") if p.is_file()}


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

@dataclass
class Report:
    """Validation outcome: errors fail it, warnings do not; ``checked`` counts what was seen."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    checked: dict = field(default_factory=dict)
    compiled: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict:
        return {"ok": self.ok, "errors": self.errors, "warnings": self.warnings, "checked": self.checked,
                "compiled": self.compiled}


def validate(root: Path | None = None, *, compile: bool = True, build_dir: Path | None = None,
             checkout: Path | None = None, kernels: dict[str, list[str]] | None = None) -> Report:
    """Check the inventory at ``root`` against the kernels in the tree (see the module docstring).

    Args:
        root: the dataset (default :func:`default_root`).
        compile: check that every cuda-tile Solution compiles for each of its target archs: a
            build manifest that holds all of the kernel's variants for that arch with their
            current content hashes counts; otherwise one representative variant is compiled
            ahead of time (:func:`check_compiles`).
        build_dir: the build whose manifest to consult (default: the runtime's).
        checkout: the source tree the Solutions' sources must match (default :func:`repo_root`;
            the check is skipped when there is none).
        kernels: kernel name -> device functions that must be covered (default: kernel_src's).

    Raises:
        FileNotFoundError: ``root`` is not a directory.
    """
    inv = Inventory.load(root)
    rep = Report(errors=list(inv.errors))
    checkout = checkout if checkout is not None else repo_root()
    kernels = kernel_functions() if kernels is None else kernels

    for k, fns in kernels.items():
        s = inv.solution_for_kernel(k)
        if s is None:
            has_def = k in inv.definitions
            rep.errors.append(f"kernel {k!r} ({', '.join(fns)}) has " + (
                "a Definition but no Solution" if has_def else "no Definition (and no Solution naming it in "
                "spec.build_matrix.kernel)"))
            continue
        if s.definition not in inv.definitions:
            rep.errors.append(f"kernel {k!r} has no Definition: its Solution {s.name!r} names {s.definition!r}, "
                              "which is not in the inventory")
        missing = [f for f in fns if f not in s.spec.build_matrix.functions]
        if missing:
            rep.errors.append(f"Solution {s.name!r}: build_matrix lacks device functions {missing} of kernel {k!r} "
                              "(run `cutile-kernels inventory sync`)")

    for d in inv.definitions.values():
        _check_definition(d, inv.workloads.get(d.name, []), rep)
        if not inv.solutions_of(d.name):
            rep.warnings.append(f"Definition {d.name!r} has no Solution")
    for name in sorted(set(inv.workloads) - set(inv.definitions)):
        rep.errors.append(f"workloads of unknown Definition {name!r}")

    from cutile_kernels_build.aot import ToolchainMissing

    manifest = _manifest(build_dir) if compile else None
    unchecked = []  # (Solution, arch) pairs that needed a compile and found no toolchain
    for s in inv.solutions.values():
        d = inv.definitions.get(s.definition)
        if d is None:
            rep.errors.append(f"Solution {s.name!r} names unknown Definition {s.definition!r}")
        _check_solution(s, d, checkout, kernels, rep)
        if compile and s.spec.language == "cuda-tile" and s.spec.build_matrix is not None:
            for arch in s.spec.target_hardware:
                try:
                    how = check_compiles(s.spec.build_matrix.kernel, arch, manifest)
                    rep.compiled.append(f"{s.name} {arch}: {how}")
                except ToolchainMissing as exc:
                    unchecked.append((s.name, arch))
                    missing = str(exc)
                except Exception as exc:
                    rep.errors.append(f"Solution {s.name!r} does not compile for {arch}: {_first_line(exc)}")
    if unchecked:  # one line, not one per Solution and arch
        rep.warnings.append(f"compile not checked for {len(unchecked)} Solution x arch pairs "
                            f"({len({n for n, _ in unchecked})} Solutions, no current build manifest for them): {missing}")

    for dname, traces in inv.traces.items():
        for t in traces:
            if dname not in inv.definitions:
                rep.errors.append(f"trace of unknown Definition {dname!r}")
                break
            if t.solution not in inv.solutions:
                rep.errors.append(f"trace of {dname!r} names unknown Solution {t.solution!r}")
    rep.checked = {"definitions": len(inv.definitions), "solutions": len(inv.solutions),
                   "workloads": sum(len(v) for v in inv.workloads.values()),
                   "traces": sum(len(v) for v in inv.traces.values()), "kernels": len(kernels)}
    return rep


def _check_definition(d: Definition, workloads: list[Workload], rep: Report) -> None:
    params = function_params(d.reference, "run")
    if params != list(d.inputs):
        rep.errors.append(f"Definition {d.name!r}: reference run{tuple(params or ())} does not take its inputs "
                          f"{tuple(d.inputs)} in order")
        return
    for w in workloads:
        where = f"Definition {d.name!r} workload {w.uuid!r}"
        if set(w.axes) != set(d.var_axes):
            rep.errors.append(f"{where}: axes {sorted(w.axes)} != the var axes {sorted(d.var_axes)}")
        if set(w.inputs) != set(d.inputs):
            rep.errors.append(f"{where}: inputs {sorted(w.inputs)} != the Definition's {sorted(d.inputs)}")
        for name, spec in d.inputs.items():
            inp = w.inputs.get(name)
            if spec.shape is None and inp is not None and inp.type == "random":
                rep.errors.append(f"{where}: scalar input {name!r} must be given a value")
        bad = d.satisfies(w.axes)
        if bad:
            rep.errors.append(f"{where}: violates constraints {bad}")
    if not workloads:
        rep.warnings.append(f"Definition {d.name!r} has no Workloads (evaluate has nothing to run)")
    # Execute the reference on the smallest workload (or 2 along every var axis), on the CPU.
    axes = min((w.axes for w in workloads if set(w.axes) == set(d.var_axes)),
               key=lambda a: _numel(d, a), default={a: 2 for a in d.var_axes})
    try:
        from .workload_tensors import check_outputs, make_inputs, reference_inputs

        w = next((w for w in workloads if w.axes == axes), None)
        inputs = make_inputs(d, w or Workload(axes=axes, inputs={n: _default_input(s) for n, s in d.inputs.items()},
                                              uuid="validate"), "cpu", seed=0)
        outs = load_reference(d)(*reference_inputs(d, inputs))
    except Exception as exc:
        rep.errors.append(f"Definition {d.name!r}: reference failed on axes {axes}: {type(exc).__name__}: "
                          f"{_first_line(exc)}")
        return
    status, msg = check_outputs(d, outs, axes)
    if status is not None:
        rep.errors.append(f"Definition {d.name!r}: reference output on axes {axes} does not match the "
                          f"Definition: {msg}")


def _default_input(spec: TensorSpec):
    return ScalarInput(value=1e-6) if spec.shape is None else RandomInput()


def _numel(d: Definition, axes: dict) -> int:
    total = 0
    for spec in d.inputs.values():
        n = 1
        for v in d.shape_of(spec, axes) or ():
            n *= v
        total += n
    return total


def _check_solution(s: Solution, d: Definition | None, checkout: Path | None, kernels: dict, rep: Report) -> None:
    entry = s.source(s.entry_file).content
    if s.entry_file.endswith(".py"):
        try:
            params = function_params(entry, s.entry_symbol)
        except SyntaxError as exc:
            rep.errors.append(f"Solution {s.name!r}: entry {s.entry_file} is not valid Python: {exc}")
            params = None
        if params is None:
            rep.errors.append(f"Solution {s.name!r}: {s.entry_file} defines no {s.entry_symbol}()")
        elif d is not None:
            want = list(d.inputs) + ([] if not s.spec.destination_passing_style else list(d.outputs))
            if params != want:
                rep.errors.append(f"Solution {s.name!r}: {s.spec.entry_point}{tuple(params)} does not take "
                                  f"{tuple(want)}")
    if checkout is not None:
        stale = [src.path for src in s.sources
                 if (checkout / src.path).is_file() and (checkout / src.path).read_text() != src.content]
        if stale:
            rep.errors.append(f"Solution {s.name!r}: sources {stale} differ from the tree "
                              "(run `cutile-kernels inventory sync`)")
    if s.spec.language == "cuda-tile":
        from cutile_kernels_build import SUPPORTED_ARCHS

        bad = [a for a in s.spec.target_hardware if a not in SUPPORTED_ARCHS]
        if bad:
            rep.errors.append(f"Solution {s.name!r}: target_hardware {bad} are not archs tileiras targets")
        link = s.spec.build_matrix
        if link is None:
            rep.errors.append(f"Solution {s.name!r}: a cuda-tile Solution needs spec.build_matrix")
        elif link.kernel not in kernels:
            rep.errors.append(f"Solution {s.name!r}: build matrix has no variants of kernel {link.kernel!r}")


def _manifest(build_dir: Path | None) -> dict | None:
    from cutile_kernels import registry

    pkg = registry.package_dir_of(build_dir) if build_dir is not None else registry.find_package_dir()
    try:
        return json.loads((Path(pkg) / "manifest.json").read_text()) if pkg is not None else None
    except (OSError, ValueError):
        return None


_COMPILED: dict[str, str] = {}


def check_compiles(kernel: str, arch: str, manifest: dict | None = None, specs=None) -> str:
    """Prove that ``kernel`` compiles for ``arch``; returns how (for the report).

    If ``manifest`` holds every variant of the kernel for ``arch`` with the hash its source,
    assumptions and toolchain have now, the build already compiled them. Otherwise the first
    variant of the kernel (the build matrix's most preferred) is compiled ahead of time with
    ``cutile_kernels_build.aot.compile_variant`` (results cached per content hash in this process).

    Raises:
        KeyError: ``kernel`` has no variant in the build matrix.
        ToolchainMissing: a compile is needed and there is no tileiras.
        BuildError: the variant does not compile.
    """
    from cutile_kernels import kernel_src
    from cutile_kernels_build.aot import compile_variant, variant_hash

    specs = [s for s in (specs if specs is not None else kernel_src.all_variants()) if s.kernel == kernel]
    if not specs:
        raise KeyError(f"kernel {kernel!r} has no variant in the build matrix")
    if manifest is not None and arch in manifest.get("archs", []):
        built = {(v["variant"], v["hash"]) for v in manifest.get("variants", [])
                 if v["kernel"] == kernel and v["arch"] == arch}
        if all((s.tag, variant_hash(s, arch)) in built for s in specs):
            return f"{len(specs)} variants in the build manifest, hashes current"
    spec = specs[0]
    key = variant_hash(spec, arch)
    if key not in _COMPILED:
        data, seconds = compile_variant(spec, arch)
        _COMPILED[key] = f"compiled {spec.tag} ({len(data)} bytes, {seconds:.1f} s)"
    return _COMPILED[key]


# ---------------------------------------------------------------------------------------------
# Show and export
# ---------------------------------------------------------------------------------------------

def summary_rows(inv: Inventory) -> list[dict]:
    """One row per Definition: its Solutions, Workload count and latest trace statuses."""
    rows = []
    for d in inv.definitions.values():
        sols = inv.solutions_of(d.name)
        latest: dict[str, str] = {}
        for t in inv.traces.get(d.name, []):
            latest[t.solution] = t.evaluation.status.value if t.evaluation else "-"
        rows.append({"definition": d.name, "op_type": d.op_type, "axes": {k: a.type for k, a in d.axes.items()},
                     "solutions": [s.name for s in sols],
                     "archs": sorted({a for s in sols for a in s.spec.target_hardware}),
                     "workloads": len(inv.workloads.get(d.name, [])),
                     "traces": len(inv.traces.get(d.name, [])), "latest": latest})
    return rows


def export(inv: Inventory, out: Path) -> Path:
    """Write ``inv`` as a dataset FlashInfer-Bench 0.1.2 loads (``TraceSet.from_path(out)``):
    cuda-tile Solutions become ``python`` ones (:func:`~.fib_schema.to_flashinfer_bench`).

    Raises:
        FileExistsError: ``out`` exists and is not empty.
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    for d in inv.definitions.values():
        _write(out / "definitions" / family_dir(d) / f"{d.name}.json", json.dumps(to_flashinfer_bench(d), indent=2) + "\n")
    for s in inv.solutions.values():
        d = inv.definitions.get(s.definition)
        fam = family_dir(d) if d else "unknown"
        _write(out / "solutions" / fam / f"{s.name}.json", json.dumps(to_flashinfer_bench(s), indent=2) + "\n")
    for kind, table in (("workloads", inv.workloads), ("traces", inv.traces)):
        for dname, rows in table.items():
            d = inv.definitions.get(dname)
            fam = family_dir(d) if d else "unknown"
            lines = [Trace(definition=dname, workload=r).to_json(indent=None) if kind == "workloads"
                     else r.to_json(indent=None) for r in rows]
            _write(out / kind / fam / f"{dname}.jsonl", "".join(line + "\n" for line in lines))
    return out
