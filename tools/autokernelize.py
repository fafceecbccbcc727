"""``cutile-kernels autokernelize``: grow kernel coverage of a model in a loop whose gates keep only
what helps end to end.

1. :func:`regions` profiles the kernelized model (the bench's coverage pass, :mod:`.coverage`) and
   ranks the PyTorch regions -- innermost modules, layer index folded -- that no kernel of ours
   covers, by device time, with their Amdahl ceilings (whole-step speedup if the region ran 2x
   faster, and if it took no time at all). On a CPU the aten ops (self time) stand in for kernels.
2. :func:`scaffold` writes, for the chosen region, a Definition whose reference is the module's
   own code (transformers' class at the installed, pinned release, run through
   ``torch.func.functional_call``), Workloads from the model's shapes, a kernel stub with an empty
   build matrix (found by ``kernel_src`` by its file name; nothing to register) and a test.
3. Once the kernel is written, :func:`score` runs ``evaluate`` (every correctness gate, on the
   GPU) and, only if that passes, the end-to-end bench (logit gates and throughput), then appends
   keep or discard with the reason to the results log (:data:`LOG_COLUMNS`). A candidate is kept
   only if every gate passes and no throughput figure drops by more than ``tolerance`` below the
   baseline: our build without the candidate, timed in the same bench run (``cutile~<name>``
   against ``cutile``, or ``cutile`` against ``cutile+<name>`` for an opt-in patch, when the
   candidate is a patch or hub layer named after its Definition), else the last kept row, else
   stock.
"""

from __future__ import annotations

import ast
import copy
import csv
import datetime
import inspect
import json
import pprint
import re
import statistics
import subprocess
import textwrap
from pathlib import Path

import torch

from .bench import coverage
from . import inventory
from .inventory.fib_schema import AxisConst, AxisVar, Definition, RandomInput, ScalarInput, TensorSpec, Workload

#: Captured call shape: batch and sequence lengths unlikely to equal any config size, so that a
#: dimension of this length is recognisably the batch or the sequence.
CAPTURE_BATCH, CAPTURE_SEQ = 3, 11
#: Config attributes that name a constant axis, in order of preference when sizes coincide.
CONFIG_AXES = ("hidden_size", "intermediate_size", "head_dim", "num_attention_heads", "num_key_value_heads",
               "vocab_size")
#: Workload shapes (batch, seq): decode at batch 1 and 16, prefill 1 x 2048 (the bench's), and the capture.
WORKLOAD_SHAPES = {"decode-b1": (1, 1), "decode-b16": (16, 1), "prefill-2048": (1, 2048),
                   "captured": (CAPTURE_BATCH, CAPTURE_SEQ)}
LOG_COLUMNS = ("timestamp", "commit", "model", "candidate", "status", "eval_status", "gate", "coverage",
               "prefill_tok_s", "decode_tok_s", "baseline", "reason", "description")
DEFAULT_LOG = Path("benchmarks") / "results" / "autokernelize.tsv"


# ---------------------------------------------------------------------------------------------
# 1. Regions
# ---------------------------------------------------------------------------------------------

def load_model(model: str, device: str | None = None, seed: int = 0):
    """The kernelized model (the bench's ``cutile`` path) and its label."""
    from .bench import paths
    from . import presets

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    checkpoint, label = presets.resolve(model, seed=seed, device=device)
    return paths.load("cutile", checkpoint, torch.bfloat16, device), label, device


def _covered_by_layer(module) -> str | None:
    """Why ``module`` counts as ours: its forward was replaced by one of our layers, or (where the
    kernelize mapping does not apply, e.g. on a CPU) its hub layer name is in our mapping."""
    from cutile_kernels.layers import MAPPING

    if type(module).__dict__.get("_cutile_as_linear"):
        # Patch gemv's projections run our GEMV only in compiled or captured one-row steps: ours where
        # the profile finds our kernel, not by their class.
        return None
    func = getattr(module.__dict__.get("forward"), "__func__", None) or getattr(type(module), "forward", None)
    if func is not None and getattr(func, "__qualname__", "").startswith("Cutile"):
        return f"kernelized ({func.__qualname__.split('.')[0]})"  # a layer, or a patch's class (fused MLP)
    hub = getattr(type(module), "kernel_layer_name", None)
    if hub in MAPPING:
        return f"hub layer {hub!r} is mapped to {MAPPING[hub]} (runs our kernel on CUDA)"
    return None


def regions(model, device: str, steps: int = 2, prompt_len: int = 64, speedup: float = 2.0, seed: int = 0) -> dict:
    """Profile one prefill of ``prompt_len`` tokens and ``steps`` decode steps (batch 1) and rank the
    uncovered regions by device time.

    Returns ``{"device_us", "covered_share", "regions": [...]}``; a region row has ``region`` (the
    folded module path), ``module`` (a concrete path), ``cls``, ``us``, ``share``, ``launches``,
    ``ops`` (top aten ops), ``ceiling`` (Amdahl at ``speedup``), ``ceiling_max`` (1 / (1 - share)),
    ``covered`` (None, or why it is ours). Uncovered regions come first, by time.
    """
    from .bench.worker import Decoder, our_symbols

    dec = Decoder(model, 1, prompt_len, steps + 1, device, False, seed)

    def run():
        dec.prefill()
        for _ in range(steps):
            dec.step()

    records = coverage.attribute(coverage.profile_steps(model, run, device), device)
    ours = our_symbols() if device.startswith("cuda") else set()
    total = sum(r["us"] for r in records) or 1e-9
    rows: dict[str, dict] = {}
    for r in records:
        name = r["module"] or ""
        kind = coverage._module_kind(name) if name else "(outside any module)"
        row = rows.setdefault(kind, {"region": kind, "module": name, "us": 0.0, "launches": 0, "ops": {},
                                     "ours_us": 0.0})
        row["us"] += r["us"]
        row["launches"] += 1
        row["ops"][r["op"] or "?"] = row["ops"].get(r["op"] or "?", 0.0) + r["us"]
        if r["kernel"] in ours:
            row["ours_us"] += r["us"]
    modules = dict(model.named_modules())
    out = []
    for row in rows.values():
        mod = modules.get(row["module"])
        row["cls"] = type(mod).__name__ if mod is not None else None
        row["covered"] = (_covered_by_layer(mod) if mod is not None else None) or (
            "our kernels" if row["ours_us"] >= 0.5 * row["us"] else None)
        f = row["us"] / total
        row.update(share=f, ceiling=coverage.amdahl(f, speedup), ceiling_max=1 / (1 - f) if f < 1 else float("inf"),
                   ops=[o for o, _ in sorted(row["ops"].items(), key=lambda x: -x[1])[:3]])
        out.append(row)
    out.sort(key=lambda r: (r["covered"] is not None, -r["us"]))
    return {"device_us": total, "amdahl_speedup": speedup,
            "covered_share": sum(r["us"] for r in out if r["covered"]) / total, "regions": out}


# ---------------------------------------------------------------------------------------------
# 2. Scaffold
# ---------------------------------------------------------------------------------------------

def capture(model, module_name: str, batch: int = CAPTURE_BATCH, seq: int = CAPTURE_SEQ, seed: int = 0):
    """The first call of ``module_name`` in a forward of ``batch`` x ``seq`` random tokens
    (no cache): (bound arguments by parameter name, output)."""
    mod = model.get_submodule(module_name)
    seen = {}

    def hook(m, args, kwargs, output):
        if not seen:
            bound = inspect.signature(type(m).forward).bind(m, *args, **kwargs)
            arguments = dict(bound.arguments)
            arguments.pop(next(iter(arguments)))  # self
            seen["args"], seen["out"] = arguments, output

    handle = mod.register_forward_hook(hook, with_kwargs=True)
    try:
        gen = torch.Generator().manual_seed(seed + 5)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen).to(model.device)
        with torch.inference_mode():
            model(ids, use_cache=False)
    finally:
        handle.remove()
    if not seen:
        raise ValueError(f"module {module_name!r} was not called in a forward pass")
    return seen["args"], seen["out"]


def _flat_tensors(value, name: str) -> list[tuple[str, torch.Tensor]] | None:
    if isinstance(value, torch.Tensor):
        return [(name, value)]
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return [(f"{name}_{i}", v) for i, v in enumerate(value)]
    return None


def _literal(value) -> bool:
    try:
        return ast.literal_eval(repr(value)) == value
    except (ValueError, SyntaxError):
        return False


def _axis_namer(config, batch: int, seq: int):
    sizes = {}
    for attr in CONFIG_AXES:
        v = getattr(config, attr, None)
        if isinstance(v, int) and v not in sizes:
            sizes[v] = attr

    def name(tensor: str, dim: int, size: int) -> tuple[str, object]:
        if size == batch:
            return "batch_size", AxisVar(description="sequences in the batch")
        if size == seq:
            return "seq_len", AxisVar(description="tokens per sequence")
        if size == batch * seq:
            return "num_tokens", AxisVar(description="batch_size x seq_len, flattened")
        if size in sizes:
            return sizes[size], AxisConst(value=size, description=f"config.{sizes[size]}")
        return f"{tensor}_dim{dim}", AxisConst(value=size)
    return name


def returned_names(fn, count: int) -> list[str] | None:
    """Names for the ``count`` tensors ``fn`` returns, read from its ``return a, b`` statement: each
    returned expression's root variable (``cos`` in ``cos.to(dtype=x.dtype)``); None when the
    source cannot be read or the names are not ``count`` distinct identifiers."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    except (OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) and len(node.value.elts) == count:
            names = []
            for e in node.value.elts:
                while isinstance(e, (ast.Call, ast.Attribute, ast.Subscript)):
                    e = e.func if isinstance(e, ast.Call) else e.value
                names.append(e.id if isinstance(e, ast.Name) else None)
            if None not in names and len(set(names)) == count:
                return names
    return None


def state_axes(model, module_name: str) -> dict[tuple[str, int], str]:
    """Which config size each dimension of the module's parameters and buffers follows:
    ``{(state name, dim): config attribute}``, found by rebuilding the module's skeleton (meta
    device) with each :data:`CONFIG_AXES` value doubled and seeing which dimensions change. A size
    can equal a config value by coincidence (RoPE's ``inv_freq`` has head_dim / 2 entries, which is
    num_attention_heads in Llama-3.2-1B); only a dimension that follows the value gets its name."""
    import transformers

    def shapes(config):
        with torch.device("meta"):
            mod = transformers.AutoModelForCausalLM.from_config(config).get_submodule(module_name)
        return {n: tuple(t.shape) for n, t in [*mod.named_parameters(), *mod.named_buffers()]}

    try:
        base = shapes(model.config)
    except Exception:  # noqa: BLE001 - no skeleton to compare with: claim nothing
        return {}
    out: dict[tuple[str, int], str] = {}
    for attr in CONFIG_AXES:
        value = getattr(model.config, attr, None)
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        config = copy.deepcopy(model.config)
        setattr(config, attr, 2 * value)
        try:
            changed = shapes(config)
        except Exception:  # noqa: BLE001 - this value cannot be doubled alone (a derived size)
            continue
        for n, shape in base.items():
            for i, size in enumerate(shape):
                other = changed.get(n)
                if other is not None and len(other) == len(shape) and other[i] != size:
                    out.setdefault((n, i), attr)
    return out


def build_definition(model, region: dict, name: str, label: str) -> tuple[Definition, list[Workload]]:
    """A Definition (and Workloads) for one region, from a captured call of its module.

    Inputs are the module's tensor arguments (tuples of tensors flattened to ``<arg>_<i>``), then
    its parameters and buffers (``.`` -> ``_``); other arguments must be literals (None, numbers,
    strings) and are fixed in the reference. The reference builds the model skeleton from the
    model's config on the meta device, takes the module at the same path and calls it with
    ``torch.func.functional_call``: the module's own code at the installed transformers release.

    Raises:
        ValueError: an argument is neither a tensor, a tuple of tensors nor a literal.
    """
    import transformers

    module_name = region["module"]
    mod = model.get_submodule(module_name)
    cls = type(mod)
    arguments, output = capture(model, module_name)
    sig = inspect.signature(cls.forward)
    tensors: list[tuple[str, torch.Tensor]] = []
    call_args: list[str] = []
    for pname, value in arguments.items():
        kind = sig.parameters[pname].kind
        items = value.items() if kind == inspect.Parameter.VAR_KEYWORD else [(pname, value)]
        for key, v in items:
            flat = _flat_tensors(v, key)
            if flat is not None:
                tensors += flat
                expr = flat[0][0] if isinstance(v, torch.Tensor) else f"({', '.join(n for n, _ in flat)},)"
                call_args.append(f"{key!r}: {expr}")
            elif v is None or _literal(v):
                call_args.append(f"{key!r}: {v!r}")
            else:
                raise ValueError(f"{cls.__name__}.forward argument {key!r} is a {type(v).__name__}: write this "
                                 "region's Definition by hand")
    used = {n for n, _ in tensors}
    state = []
    for pname, t in [*mod.named_parameters(), *mod.named_buffers()]:
        arg = pname.replace(".", "_")
        if arg in used:
            arg = f"param_{arg}"
        used.add(arg)
        state.append((arg, pname, t))
    outs = _flat_tensors(output, "output") or [
        (f"output_{i}", t) for i, t in enumerate(x for x in (output if isinstance(output, (tuple, list)) else ())
                                                 if isinstance(x, torch.Tensor))]
    if not outs:
        raise ValueError(f"{cls.__name__}.forward returned no tensor")
    if len(outs) == 1:
        outs = [("output", outs[0][1])]
    else:
        names = returned_names(cls.forward, len(outs))
        if names and not set(names) & used:
            outs = [(n, t) for n, (_, t) in zip(names, outs)]

    namer = _axis_namer(model.config, CAPTURE_BATCH, CAPTURE_SEQ)
    axes: dict = {}

    def spec(tname: str, t: torch.Tensor, role: str) -> TensorSpec:
        shape = []
        for i, size in enumerate(t.shape):
            aname, axis = namer(tname, i, size)
            axes.setdefault(aname, axis)
            shape.append(aname)
        return TensorSpec(shape=shape, dtype=str(t.dtype).removeprefix("torch."), description=role)

    inputs = {n: spec(n, t, "argument of forward") for n, t in tensors}
    tracks = state_axes(model, module_name) if state else {}
    for arg, pname, t in state:
        shape = []
        for i, size in enumerate(t.shape):
            aname, axis = namer(arg, i, size)
            if isinstance(axis, AxisConst) and tracks.get((pname, i)) != aname:
                # The size matched a config value by coincidence: the axis does not follow it.
                attr = tracks.get((pname, i))
                aname = f"{arg}_dim{i}"
                axis = AxisConst(value=size, description=None if attr is None else
                                 f"follows config.{attr} ({size} for {getattr(model.config, attr)})")
            axes.setdefault(aname, axis)
            shape.append(aname)
        inputs[arg] = TensorSpec(shape=shape, dtype=str(t.dtype).removeprefix("torch."),
                                 description=f"module state {pname}")
    outputs = {n: spec(n, t, "returned by forward") for n, t in outs}
    constraints = ["num_tokens == batch_size * seq_len"] if {"num_tokens", "batch_size", "seq_len"} <= set(axes) else []

    version = transformers.__version__
    src_file = Path(inspect.getsourcefile(cls)).resolve()
    rel = src_file.relative_to(Path(transformers.__file__).resolve().parent.parent)
    lines = inspect.getsourcelines(cls.forward)
    where = f"transformers v{version} src/{rel.as_posix()}::{cls.__name__}.forward (lines {lines[1]}-{lines[1] + len(lines[0]) - 1})"
    config = dict(model.config.to_diff_dict())
    config["model_type"] = model.config.model_type
    for key in ("transformers_version", "dtype", "torch_dtype", "architectures"):
        config.pop(key, None)
    params = list(inputs)
    state_map = ", ".join(f"{p!r}: {a}" for a, p, _ in state)
    reference = (
        f'"""Reference for {name}: {where}, i.e. the module {module_name!r} of {label}, run through\n'
        "torch.func.functional_call on the model skeleton built from the same config (meta device).\n"
        'Scaffolded by `cutile-kernels autokernelize`."""\n\n'
        "import functools\n\nimport torch\nimport transformers\n\n"
        f"CONFIG = {pprint.pformat(config, width=100, sort_dicts=True)}\n\n\n"
        "@functools.lru_cache(maxsize=1)\n"
        "def _module():\n"
        "    cfg = dict(CONFIG)\n"
        '    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)\n'
        '    with torch.device("meta"):\n'
        "        model = transformers.AutoModelForCausalLM.from_config(config)\n"
        f"    return model.get_submodule({module_name!r}).eval()\n\n\n"
        "def _tensors(out):\n"
        "    if isinstance(out, torch.Tensor):\n        return out\n"
        "    flat = tuple(t for t in out if isinstance(t, torch.Tensor))\n"
        "    return flat[0] if len(flat) == 1 else flat\n\n\n"
        f"def run({', '.join(params)}):\n"
        f"    state = {{{state_map}}}\n"
        f"    kwargs = {{{', '.join(call_args)}}}\n"
        "    with torch.no_grad():\n"
        "        return _tensors(torch.func.functional_call(_module(), state, args=(), kwargs=kwargs))\n"
    )
    definition = Definition(
        name=name, op_type=re.sub(r"[^a-z0-9]+", "_", cls.__name__.lower()), axes=axes, inputs=inputs,
        outputs=outputs, reference=reference, constraints=constraints,
        tags=[f"family:{name}", "status:scaffold", f"source:transformers@v{version}:src/{rel.as_posix()}::{cls.__name__}.forward",
              f"model:{label.split(' ')[0]}"],
        description=f"{cls.__name__}.forward of {label} ({where}); scaffolded by autokernelize from region "
                    f"{region['region']} ({region['share']:.1%} of the profiled device time).",
    )
    var = definition.var_axes
    workloads = []
    for tag, (b, s) in WORKLOAD_SHAPES.items():
        values = {"batch_size": b, "seq_len": s, "num_tokens": b * s}
        ax = {a: values[a] for a in var}
        if any(w.axes == ax for w in workloads):
            continue
        workloads.append(Workload(axes=ax, inputs={n: RandomInput() if sp.shape is not None else ScalarInput(value=0)
                                                   for n, sp in inputs.items()}, uuid=f"{label.split(' ')[0]}/{tag}"))
    return definition, workloads


def _stub(d: Definition) -> str:
    arrays = [n for n, s in [*d.inputs.items(), *d.outputs.items()] if s.shape is not None]
    return (
        f'"""{d.name}: the cuTile kernel for Definition {d.name!r} (inventory/definitions/{d.name}/{d.name}.json).\n\n'
        f"Scaffolded by `cutile-kernels autokernelize`; not written yet. {d.description}\n\n"
        "Write the ``@ct.kernel`` below (see kernel_src/norm.py: padded power-of-two tiles, float32\n"
        "accumulation, the reference's rounding order), then fill ``VARIANTS``, add the torch op in\n"
        f"torch-ext/cutile_kernels/ops/{d.name}.py and score it with\n"
        f"`cutile-kernels autokernelize <model> --score {d.name}`.\n"
        '"""\n\n'
        "from __future__ import annotations\n\n"
        "import cuda.tile as ct\n\n"
        "from ._spec import VariantSpec\n\n\n"
        "@ct.kernel\n"
        f"def {d.name}_kernel({', '.join(arrays)}, BLOCK: ct.Constant[int]):\n"
        f'    """Inputs {", ".join(d.inputs)}; outputs {", ".join(d.outputs)} (shapes in the Definition)."""\n'
        "    pass  # not written yet\n\n\n"
        "#: The build matrix: one VariantSpec per compiled variant (dtype, constants, layout); empty\n"
        "#: until the kernel is written, so the build and the runtime skip this family.\n"
        "VARIANTS: list[VariantSpec] = []\n"
    )


def _test(d: Definition) -> str:
    return (
        f'"""{d.name} (scaffolded by `cutile-kernels autokernelize`): the Definition\'s reference on the CPU,\n'
        'and its cuTile Solution through `evaluate` on a GPU."""\n\n'
        "from pathlib import Path\n\nimport pytest\n\n"
        "from cutile_kernels_tools import evaluate, inventory\n\n"
        'INVENTORY = Path(__file__).resolve().parents[1] / "inventory"\n'
        f"NAME = {json.dumps(d.name)}\n\n\n"
        "def test_reference_runs_on_the_model_shapes():\n"
        "    inv = inventory.Inventory.load(INVENTORY)\n"
        "    d = inv.definitions[NAME]\n"
        "    run = inventory.load_reference(d)\n"
        "    w = min(inv.workloads[NAME], key=lambda w: sum(w.axes.values()))\n"
        '    out = run(*evaluate.reference_inputs(d, evaluate.make_inputs(d, w, "cpu")))\n'
        "    assert evaluate.check_outputs(d, out, w.axes) == (None, \"\")\n\n\n"
        "@pytest.mark.gpu\n"
        "def test_solution_passes_evaluate():\n"
        "    inv = inventory.Inventory.load(INVENTORY)\n"
        "    solutions = inv.solutions_of(NAME)\n"
        '    assert solutions, f"no Solution for {NAME} yet: write the kernel, then `autokernelize --score`"\n'
        "    result = evaluate.evaluate(solutions[0].name, INVENTORY)\n"
        '    assert result.status == "PASSED", result.message\n'
    )


def scaffold(model, region: dict, label: str, target: Path, name: str | None = None,
             inventory_root: Path | None = None) -> dict:
    """Write the Definition, Workloads, kernel stub, test and build-matrix entry of ``region``
    under ``target`` (a checkout); returns {"definition": name, "files": [...], "registered": bool}
    (registered: ``kernel_src`` of the target finds the new family module, which it does by its name).

    Raises:
        FileExistsError: one of the files exists (nothing is written then).
        ValueError: the region's module cannot be described automatically.
    """
    name = name or re.sub(r"\W+", "_", f"{model.config.model_type}_{region['region'].split('.')[-1]}").lower()
    if not name.isidentifier():
        raise ValueError(f"{name!r} is not a Python identifier: pass --name")
    d, workloads = build_definition(model, region, name, label)
    root = inventory_root or target / "inventory"
    files = {
        root / "definitions" / name / f"{name}.json": d.to_json() + "\n",
        root / "workloads" / name / f"{name}.jsonl": "".join(
            inventory.Trace(definition=name, workload=w).to_json(indent=None) + "\n" for w in workloads),
        target / "kernel_src" / f"{name}.py": _stub(d),
        target / "tests" / f"test_{name}.py": _test(d),
    }
    existing = [str(p) for p in files if p.exists()]
    if existing:
        raise FileExistsError(f"refusing to overwrite {', '.join(existing)}")
    if not (target / "kernel_src" / "__init__.py").is_file():  # checked before anything is written
        raise FileNotFoundError(f"{target} is not a cutile-kernels checkout (no kernel_src/__init__.py): "
                                "--target must be one, the scaffold adds its family module there")
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    from cutile_kernels.kernel_src import discover

    registered = name in discover(target / "kernel_src")
    return {"definition": name, "files": [str(p) for p in files], "registered": registered}


# ---------------------------------------------------------------------------------------------
# 3. Score and record
# ---------------------------------------------------------------------------------------------

def throughput(path: dict) -> dict:
    """{"prefill": tokens/s, "decode-b<N>": tokens/s, ...} of one bench path."""
    out = {"prefill": path["prefill_tokens_per_s"]}
    out.update({f"decode-b{d['batch']}": d["tokens_per_s"] for d in path["decode"]})
    return out


#: Timing rounds a figure needs before :func:`decide` judges it by the median of its per-round
#: ratios (with two, the median is the mean, and one drifted round still decides).
MIN_ROUNDS = 3


def decide(eval_status: str, gate_passed: bool | None, now: dict | None, baseline: dict | None,
           tolerance: float = 0.01, ratios: dict | None = None) -> tuple[bool, str]:
    """Keep or discard a candidate, and why.

    Kept only if ``evaluate`` PASSED, the bench's logit gate passed, and no throughput figure
    dropped by more than ``tolerance``. A figure with at least :data:`MIN_ROUNDS` ``ratios`` (the
    candidate's speedup over a baseline timed in the same bench, per round:
    :func:`.bench.round_ratios`) dropped when the median of its ratios is below ``1 - tolerance``,
    so one drifted round cannot decide; any other figure dropped when ``now``'s value is below
    ``(1 - tolerance)`` times ``baseline``'s (figures the baseline lacks are not compared).
    """
    if eval_status != "PASSED":
        return False, f"evaluate: {eval_status}"
    if not gate_passed:
        return False, "end-to-end logit gate failed"
    if not now:
        return False, "no end-to-end throughput"
    paired = {k: r for k, r in (ratios or {}).items() if len(r) >= MIN_ROUNDS}
    drops = [f"{k} x{statistics.median(r):.3f} (rounds " + ", ".join(f"{x:.2f}" for x in r) + ")"
             for k, r in paired.items() if statistics.median(r) < 1 - tolerance]
    drops += [f"{k} {now[k]:.1f} < {baseline[k]:.1f}" for k in now
              if k not in paired and k in (baseline or {}) and now[k] < (1 - tolerance) * baseline[k]]
    how = " (median per-round ratio)" if paired else ""
    if drops:
        return False, f"throughput dropped more than {tolerance:.0%}{how}: " + "; ".join(drops)
    return True, f"every gate passed; throughput did not drop{how}"


def commit_id(cwd: Path) -> str:
    """``git rev-parse --short HEAD`` of ``cwd``, with ``+dirty`` for uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd, capture_output=True,
                               text=True, timeout=30).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def read_log(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def append_log(path: Path, row: dict) -> None:
    """Append one row (missing columns empty) to the TSV results log, writing the header first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.is_file() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=LOG_COLUMNS, delimiter="\t", extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerow({k: " ".join(str(row.get(k, "")).split()) for k in LOG_COLUMNS})


def last_kept(rows: list[dict], model: str) -> dict | None:
    """Throughput of the last kept candidate for ``model`` in the log, or None."""
    for row in reversed(rows):
        if row["model"] == model and row["status"] == "keep" and row.get("decode_tok_s"):
            return {"prefill": float(row["prefill_tok_s"]), **json.loads(row["decode_tok_s"])}
    return None


def ensure_solution(inv: inventory.Inventory, candidate: str, checkout: Path) -> str:
    """The Solution to score for ``candidate`` (a Solution or Definition name); a cuda-tile
    Solution is written for a Definition that has none once kernel_src has variants of the kernel
    of the same name (``kernel_src/<candidate>.py``, op ``cutile_kernels.ops.<candidate>.<candidate>``).

    Raises:
        KeyError: nothing to score yet.
    """
    if candidate in inv.solutions:
        return candidate
    if candidate not in inv.definitions:
        raise KeyError(f"no Solution or Definition named {candidate!r}")
    found = inv.solutions_of(candidate)
    if found:
        return found[0].name
    if candidate not in inventory.kernel_functions():
        raise KeyError(f"kernel {candidate!r} has no variants in kernel_src yet: write it and its VARIANTS first")
    d = inv.definitions[candidate]
    s = inventory.make_solution(d, kernel=candidate, family=candidate, op=candidate, checkout=checkout,
                                body=entry_body(d, candidate))
    inventory.write_solution(inv.root, s, inventory.family_dir(d))
    return s.name


def entry_body(d, family: str) -> str | None:
    """The Solution entry's call of ``cutile_kernels.ops.<family>.<family>``, matched to the op's
    signature: each parameter that is a Definition input by name, ``dtype`` (when it is not an
    input) as the outputs' dtype, parameters with defaults left out. None (the plain call with
    the inputs in order) when the op cannot be imported or a parameter has no match.

    Raises:
        ValueError: ``dtype`` is wanted but the outputs disagree on it.
    """
    import importlib

    try:
        op = getattr(importlib.import_module(f"cutile_kernels.ops.{family}"), family)
        params = inspect.signature(op).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    args, lines = [], []
    for name, p in params.items():
        if name in d.inputs:
            args.append(f"{name}={name}")
        elif name == "dtype":
            dtypes = {spec.dtype.value if hasattr(spec.dtype, "value") else spec.dtype for spec in d.outputs.values()}
            if len(dtypes) != 1:
                raise ValueError(f"{family}: the op takes dtype, but the outputs have dtypes {sorted(dtypes)}")
            lines = ["import torch", ""]
            args.append(f"dtype=torch.{dtypes.pop()}")
        elif p.default is inspect.Parameter.empty:
            return None
    return "\n".join([*lines, f"return _op({', '.join(args)})"])


def bench_paths_for(definition: str) -> tuple[str | None, str]:
    """(baseline path, candidate path) of the bench for a candidate named ``definition``: a
    default patch or hub layer of that name is timed as ``cutile`` against ``cutile~<name>`` (our
    build without it), an opt-in patch as ``cutile+<name>`` against ``cutile``; anything else as
    ``cutile`` with no baseline path (then the last kept row, or stock, is the baseline)."""
    from cutile_kernels import layers
    from cutile_kernels.layers import patch

    p = patch.PATCHES.get(definition)
    if p is not None and not p.default:
        return "cutile", f"cutile+{definition}"
    if p is not None or definition in layers.MAPPING:
        return f"cutile~{definition}", "cutile"
    return None, "cutile"


def score(model: str, candidate: str, *, root: Path | None = None, log: Path | None = None, description: str = "",
          tolerance: float = 0.01, device: str | None = None, bench_settings=None, checkout: Path | None = None,
          progress: bool = False, bench_overrides: dict | None = None, bench_out: Path | None = None) -> dict:
    """Evaluate ``candidate``, bench ``model`` if that passed, decide, append to the log; returns the row.
    Without CUDA the evaluation cannot run: the row's status is ``not_run`` and nothing is logged.

    The bench runs ``bench_settings`` if given, else the default settings with stock and the paths
    of :func:`bench_paths_for`, updated by ``bench_overrides``
    (BenchSettings fields, e.g. ``{"rounds": 2}``); its report is written to ``bench_out`` if given.

    Raises:
        KeyError: unknown candidate (see :func:`ensure_solution`).
        FileNotFoundError: no inventory at ``root``.
    """
    from . import bench
    from .inventory import evaluate

    checkout = checkout or inventory.repo_root() or Path.cwd()
    inv = inventory.Inventory.load(root)
    solution = ensure_solution(inv, candidate, checkout)
    result = evaluate.evaluate(solution, inv.root, device)
    if result.traces:
        inventory.append_traces(inv.root, inventory.family_dir(inv.definitions[result.definition]), result.traces)
    row = {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit_id(checkout), "model": model, "candidate": solution, "eval_status": result.status,
           "description": description}
    if result.status == evaluate.NOT_RUN:  # nothing was measured: nothing to keep or discard, no log row
        row.update(status="not_run", reason=result.message)
        return row
    gate = now = base = ratios = None
    if result.status == "PASSED":
        without, with_ = bench_paths_for(inv.definitions[result.definition].name)
        paths_wanted = ("stock", with_) if without is None else ("stock", without, with_)
        s = bench_settings or bench.BenchSettings(paths=paths_wanted, **(bench_overrides or {}))
        report = bench.run(model, s, out_dir=bench_out, progress=progress)
        paths = report["paths"]
        ours = paths.get(with_, {})
        gate = bool(report.get("gate", {}).get(with_, {}).get("passed")) and bool(report.get("cutile_kernels_ran"))
        if ours.get("ok"):
            now = throughput(ours)
            cov = ours.get("coverage")
            row["coverage"] = f"{cov['ours_time_share']:.4f}" if cov else ""
            row.update(prefill_tok_s=f"{now['prefill']:.2f}",
                       decode_tok_s=json.dumps({k: round(v, 2) for k, v in now.items() if k != "prefill"}))
        if without is not None and paths.get(without, {}).get("ok"):
            base = throughput(paths[without])  # our build without the candidate, same run
            ratios = bench.round_ratios(ours, paths[without]) if ours.get("ok") else None
            row["baseline"] = without
        else:
            base = last_kept(read_log(log or checkout / DEFAULT_LOG), model)
            row["baseline"] = "last kept" if base is not None else ""
            if base is None and paths.get("stock", {}).get("ok"):
                base = throughput(paths["stock"])
                ratios = bench.round_ratios(ours, paths["stock"]) if ours.get("ok") else None
                row["baseline"] = "stock"
        row["gate"] = "passed" if gate else "failed"
    keep, reason = decide(result.status, gate, now, base, tolerance, ratios)
    row.update(status="keep" if keep else "discard", reason=reason if result.status == "PASSED" or not result.message
               else f"{reason}: {result.message}")
    append_log(log or checkout / DEFAULT_LOG, row)
    return row
