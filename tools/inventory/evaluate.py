"""``cutile-kernels evaluate``: a Solution against its Definition's reference, written as Traces.

Checks run in order of cost and the first failure ends the evaluation with its status
(FlashInfer-Bench's statuses, :class:`~.fib_schema.EvaluationStatus`):

1. ``compile``: the entry imports, the Solution's sources are the tree's, and its kernel has
   prebuilt variants for the device's arch (or the cuTile JIT toolchain is there) -- on a
   machine without CUDA, that it compiles ahead of time for its target archs instead
   (COMPILE_ERROR);
2. ``reference``: the Definition's reference runs on every Workload and returns the declared
   shapes and dtypes (RUNTIME_ERROR / INCORRECT_SHAPE / INCORRECT_DTYPE: a broken Definition);
3. ``dispatch``: one call on the first Workload under ``CUTILE_KERNELS_STRICT=1`` launches a cuTile
   kernel (prebuilt or JIT) and takes no fallback, so a fallback cannot pass as the kernel
   (RUNTIME_ERROR);
4. ``parity``: every Workload (the models' shapes) against the reference (:func:`compare`);
5. ``boundaries``: derived Workloads -- each var axis set to 1 and to its value + 1 (odd sizes
   take other variants), or to the nearest values the Definition's constraints allow, with the
   axes a constraint defines recomputed (:func:`derived_workloads`), and the floating inputs
   scaled by 64 and 1/64;
6. ``benchmark``: median milliseconds per call of the Solution and of the reference, CUDA events
   after warm-up, the two interleaved.

Without CUDA only 1 (the ahead-of-time compile) and 2 run: the result's status is
``NOT_RUN_NO_CUDA`` and no Trace is written, since the kernel never ran. A PASSED evaluation
writes one Trace per Workload; a failure writes the Trace of the Workload that failed (or of
every Workload, when the failure is not tied to one: compile, dispatch).
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import importlib.metadata
import os
import platform
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .fib_schema import (Correctness,
                         Definition, Environment, Evaluation, EvaluationStatus, Performance, Solution, Trace,
                         Workload)
from ..timing import synchronize, time_pair
# The Workload -> tensors helpers (inventory's validate and kernel-table use them too); part of this
# module's API as before.
from .workload_tensors import as_tuple, check_outputs, make_inputs, reference_inputs, torch_dtype  # noqa: F401

NOT_RUN = "NOT_RUN_NO_CUDA"
STAGES = ("compile", "reference", "dispatch", "parity", "boundaries", "benchmark")
#: Floating inputs are also scaled by these (powers of two: exact in every float dtype).
SCALES = (64.0, 1 / 64)

#: allclose tolerances per output dtype (torch.testing's defaults for these dtypes).
TOLERANCES = {torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (1e-3, 1e-5), torch.float32: (1.3e-6, 1e-5)}
#: Or: error against the float32 reference at most this many times the reference's own.
FP32_FACTOR = 2.0

Status = EvaluationStatus


class StageFailure(Exception):
    """A check failed: ``status`` for the Trace, ``workload`` the one that failed (or None)."""

    def __init__(self, status: Status, message: str, workload: Workload | None = None,
                 correctness: Correctness | None = None):
        super().__init__(message)
        self.status, self.workload, self.correctness = status, workload, correctness


@dataclass
class Result:
    """What an evaluation found. ``status`` is a FlashInfer-Bench status or ``NOT_RUN_NO_CUDA``."""

    solution: str
    definition: str
    device: str
    status: str = "PASSED"
    message: str = ""
    stages: list[dict] = field(default_factory=list)
    traces: list[Trace] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"solution": self.solution, "definition": self.definition, "device": self.device,
                "status": self.status, "message": self.message, "stages": self.stages,
                "traces": [t.to_dict() for t in self.traces]}


# ---------------------------------------------------------------------------------------------
# Inputs and comparison
# ---------------------------------------------------------------------------------------------

def compare(d: Definition, outs, ref, ref32, axes: dict) -> tuple[Status | None, str, Correctness]:
    """Errors of ``outs`` against the reference ``ref`` (same dtypes) and ``ref32`` (the reference
    on float32 inputs), and the verdict.

    An output passes when it is allclose to ``ref`` with :data:`TOLERANCES` of its dtype, or when its
    largest error against ``ref32`` is at most :data:`FP32_FACTOR` times the reference's own (the
    kernel is no further from exact than PyTorch is); NaN / inf must sit where the reference has
    them; integer and bool outputs must be equal. ``max_relative_error`` is
    ``max |out - ref| / max(|ref|, 1e-6)``. Returns (None, "", correctness) on a pass.
    """
    status, msg = check_outputs(d, outs, axes)
    if status is not None:
        raise StageFailure(status, msg)
    max_abs = max_rel = 0.0
    extra = {}
    verdict: tuple[Status | None, str] = (None, "")
    for (name, _), o, r, r32 in zip(d.outputs.items(), as_tuple(outs), as_tuple(ref), as_tuple(ref32)):
        if not o.dtype.is_floating_point:
            diff = (o != r).sum().item()
            if diff and verdict[0] is None:
                verdict = (Status.INCORRECT_NUMERICAL, f"output {name!r}: {diff} elements differ")
            continue
        of, rf, r32f = o.float(), r.float(), r32.float()
        finite = torch.isfinite(rf)
        if not torch.equal(torch.isfinite(of), finite) or not torch.equal(torch.isnan(of), torch.isnan(rf)):
            if verdict[0] is None:
                verdict = (Status.INCORRECT_NUMERICAL, f"output {name!r}: non-finite values where the reference "
                                                       "has none (or the reverse)")
            continue
        err = (of - rf).abs()[finite]
        a = err.max().item() if err.numel() else 0.0
        rel = (err / rf.abs()[finite].clamp_min(1e-6)).max().item() if err.numel() else 0.0
        e_out = (of - r32f).abs()[finite].max().item() if err.numel() else 0.0
        e_ref = (rf - r32f).abs()[finite].max().item() if err.numel() else 0.0
        rtol, atol = TOLERANCES.get(o.dtype, (1e-3, 1e-5))
        close = torch.allclose(of[finite], rf[finite], rtol=rtol, atol=atol)
        no_worse = e_out <= FP32_FACTOR * e_ref + atol
        extra[name] = {"max_abs_err_vs_fp32": e_out, "reference_max_abs_err_vs_fp32": e_ref, "allclose": close}
        max_abs, max_rel = max(max_abs, a), max(max_rel, rel)
        if not (close or no_worse) and verdict[0] is None:
            verdict = (Status.INCORRECT_NUMERICAL,
                       f"output {name!r}: max |out - ref| {a:.3g} (rtol {rtol}, atol {atol}), error vs float32 "
                       f"{e_out:.3g} > {FP32_FACTOR} x the reference's {e_ref:.3g}")
    correctness = Correctness(max_absolute_error=max_abs, max_relative_error=max_rel, extra=extra)
    return verdict[0], verdict[1], correctness


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# The pipeline
# ---------------------------------------------------------------------------------------------

def environment(device: str) -> Environment:
    libs = {}
    for dist in ("torch", "cuda-tile", "cutile-kernels", "transformers", "nvidia-cuda-tileiras", "cuda-bindings"):
        try:
            libs[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    if device.startswith("cuda"):
        libs["cuda"] = str(torch.version.cuda)
        cap = torch.cuda.get_device_capability(torch.device(device))
        hardware = f"{torch.cuda.get_device_name(torch.device(device))} (sm_{cap[0]}{cap[1]})"
    else:
        hardware = f"cpu ({platform.machine()})"
    return Environment(hardware=hardware, libs=libs)


def dependent_axes(d: Definition) -> dict:
    """Var axes that a constraint ``axis == <expression>`` defines (``gate_up_size == 2 *
    intermediate_size``): axis name -> the compiled expression of the other axes."""
    out = {}
    for c in d.constraints:
        node = ast.parse(c, mode="eval").body
        if (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq)
                and isinstance(node.left, ast.Name) and node.left.id in d.var_axes):
            out[node.left.id] = compile(ast.Expression(node.comparators[0]), f"<constraint {c}>", "eval")
    return out


def _valid_axes(d: Definition, axes: dict, dependent: dict) -> dict | None:
    """``axes`` with the dependent axes recomputed, if that satisfies every constraint; else None."""
    axes = dict(axes)
    for name, expr in dependent.items():
        try:
            axes[name] = int(eval(expr, {"__builtins__": {}}, {**axes, **d.const_axes}))
        except Exception:  # noqa: BLE001 - an expression that does not evaluate makes no workload
            return None
    return None if d.satisfies(axes) else axes


def derived_workloads(d: Definition, workloads: list[Workload]) -> list[tuple[Workload, float]]:
    """Boundary Workloads from the first one: each var axis at its smallest valid value and at the
    next valid value above the Workload's (for an unconstrained axis: 1 and value + 1), and the
    first Workload with its floating inputs scaled by each of :data:`SCALES`.

    Valid means that the Definition's constraints hold. The smallest value is searched upwards
    from 1 (below the Workload's value), the next one from value + 1 up to twice the value; an
    axis with no valid value there gets no Workload. Axes that an equality constraint defines
    (:func:`dependent_axes`) are not varied themselves: they are recomputed from the others.
    Returns (workload, input scale) pairs.
    """
    if not workloads:
        return []
    base = workloads[0]
    dependent = dependent_axes(d)
    out, seen = [], {tuple(sorted(base.axes.items()))}
    for axis in d.var_axes:
        if axis in dependent:
            continue
        v0 = base.axes[axis]
        for candidates in (range(1, v0), range(v0 + 1, 2 * v0 + 2)):
            value, axes = next(((v, a) for v in candidates
                                if (a := _valid_axes(d, {**base.axes, axis: v}, dependent)) is not None), (None, None))
            if axes is None or tuple(sorted(axes.items())) in seen:
                continue
            seen.add(tuple(sorted(axes.items())))
            out.append((base.model_copy(update={"axes": axes, "uuid": f"{base.uuid}#{axis}={value}"}), 1.0))
    for s in SCALES:
        out.append((base.model_copy(update={"uuid": f"{base.uuid}#scale={s:g}"}), s))
    return out


def run_checks(d: Definition, fn, workloads: list[Workload], device: str, *, launches=None,
               strict=contextlib.nullcontext, seed: int = 0, warmup: int = 10, repeats: int = 30,
               root: Path | None = None, kernel_needs_cuda: bool = False, result: Result) -> Result:
    """Stages 2-6 of the module docstring on ``device`` with the Solution callable ``fn``.

    Args:
        launches: a callable returning how many cuTile kernels have launched so far in this
            process; the dispatch stage requires it to grow (None skips that requirement).
        strict: a context manager under which a fallback raises (``CUTILE_KERNELS_STRICT=1``).
        kernel_needs_cuda: on a non-CUDA ``device``, stop after the reference stage with status
            ``NOT_RUN_NO_CUDA`` (the runtime serves CPU tensors with the reference by design).
    """
    from . import load_reference

    env = environment(device)
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

    def trace(w: Workload, status: Status, log: str = "", correctness=None, performance=None) -> Trace:
        return Trace(definition=d.name, workload=w, solution=result.solution,
                     evaluation=Evaluation(status=status, environment=env, timestamp=stamp, log=log,
                                           correctness=correctness, performance=performance))

    def call(f, w, scale=1.0, dtype=None):
        inputs = make_inputs(d, w, device, seed=seed, scale=scale, root=root)
        return f(*reference_inputs(d, inputs, dtype))

    def parity(w: Workload, scale: float) -> Correctness:
        r = call(ref, w, scale)
        r32 = call(ref, w, scale, torch.float32)
        try:
            with strict():
                o = call(fn, w, scale)
        except Exception as exc:
            raise StageFailure(Status.RUNTIME_ERROR, f"{type(exc).__name__}: {exc}", w) from exc
        synchronize(device)
        try:
            status, msg, corr = compare(d, o, r, r32, w.axes)
        except StageFailure as exc:
            exc.workload = w
            raise
        if status is not None:
            raise StageFailure(status, msg, w, corr)
        return corr

    stage = "reference"
    ref = None
    try:
        with _stage(result, "reference"):
            try:
                ref = load_reference(d)
            except Exception as exc:
                raise StageFailure(Status.RUNTIME_ERROR, f"the reference does not load: {type(exc).__name__}: {exc}") from exc
            for w in workloads:
                try:
                    out = call(ref, w)
                except Exception as exc:
                    raise StageFailure(Status.RUNTIME_ERROR, f"the reference failed: {type(exc).__name__}: {exc}", w) from exc
                status, msg = check_outputs(d, out, w.axes)
                if status is not None:
                    raise StageFailure(status, f"the reference does not match its Definition: {msg}", w)
        if not device.startswith("cuda") and kernel_needs_cuda:
            for name in STAGES[2:]:
                result.stages.append({"stage": name, "status": "not run",
                                      "detail": "no CUDA device: the cuTile kernel path cannot run here"})
            ran = " and ".join(st["stage"] for st in result.stages if st["status"] == "passed")
            result.status, result.message = NOT_RUN, (f"no CUDA device: only the {ran} checks ran; "
                                                      "the kernel was not run and no Trace was written")
            return result
        stage = "dispatch"
        with _stage(result, "dispatch"):
            if workloads:
                before = launches() if launches else 0
                try:
                    with strict():
                        call(fn, workloads[0])
                    synchronize(device)
                except Exception as exc:
                    raise StageFailure(Status.RUNTIME_ERROR, f"{type(exc).__name__}: {exc}") from exc
                if launches is not None and launches() <= before:
                    raise StageFailure(Status.RUNTIME_ERROR, "the call launched no cuTile kernel")
        stage = "parity"
        correct = {}
        with _stage(result, "parity"):
            for w in workloads:
                correct[w.uuid] = parity(w, 1.0)
        stage = "boundaries"
        with _stage(result, "boundaries"):
            for w, scale in derived_workloads(d, workloads):
                parity(w, scale)
        stage = "benchmark"
        with _stage(result, "benchmark"):
            for w in workloads:
                args = reference_inputs(d, make_inputs(d, w, device, seed=seed, root=root))
                try:
                    with strict():
                        t_sol, t_ref = time_pair(lambda: fn(*args), lambda: ref(*args), device, warmup, repeats)
                except Exception as exc:
                    raise StageFailure(Status.RUNTIME_ERROR, f"while timing: {type(exc).__name__}: {exc}", w) from exc
                perf = Performance(latency_ms=t_sol, reference_latency_ms=t_ref, speedup_factor=t_ref / t_sol if t_sol else 0.0)
                result.traces.append(trace(w, Status.PASSED, correctness=correct[w.uuid], performance=perf))
    except StageFailure as exc:
        result.status, result.message = exc.status.value, f"{stage}: {exc}"
        targets = [exc.workload] if exc.workload is not None else workloads
        corr = exc.correctness if exc.status == Status.INCORRECT_NUMERICAL else None
        result.traces = [trace(w, exc.status, log=result.message, correctness=corr) for w in targets]
    return result


@contextlib.contextmanager
def _stage(result: Result, name: str):
    t0 = time.perf_counter()
    row = {"stage": name, "status": "passed"}
    result.stages.append(row)
    try:
        yield
    except StageFailure as exc:
        row.update(status="failed", detail=f"{exc.status.value}: {exc}")
        raise
    finally:
        row["seconds"] = round(time.perf_counter() - t0, 3)


@contextlib.contextmanager
def strict_dispatch():
    """``CUTILE_KERNELS_STRICT=1`` for the duration: every fallback raises FallbackError."""
    from cutile_kernels import dispatch

    old = os.environ.get(dispatch.ENV_STRICT)
    os.environ[dispatch.ENV_STRICT] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(dispatch.ENV_STRICT, None)
        else:
            os.environ[dispatch.ENV_STRICT] = old


def launch_count() -> int:
    """cuTile kernels launched so far in this process, over every loaded copy of the runtime."""
    import cutile_kernels.dispatch  # noqa: F401 - the source package's counters exist even before a call

    from ..bench.worker import runtime_copies

    return sum(sum(d.STATS.launches.values()) + sum(d.STATS.jit_launches.values()) for d in runtime_copies())


def load_entry(s: Solution):
    """The Solution's entry function: its entry source executed as a module.

    Raises:
        ValueError: the entry is not a Python file or does not define the entry symbol.
        Exception: whatever importing the entry raises.
    """
    if not s.entry_file.endswith(".py"):
        raise ValueError(f"entry {s.entry_file} is not a Python file")
    ns = {"__name__": f"cutile_solution_{s.name}"}
    exec(compile(s.source(s.entry_file).content, f"<{s.name}/{s.entry_file}>", "exec"), ns)
    fn = ns.get(s.entry_symbol)
    if not callable(fn):
        raise ValueError(f"{s.entry_file} defines no function {s.entry_symbol}")
    return fn


def compile_stage(s: Solution, device: str, result: Result, checkout: Path | None, build_dir: Path | None):
    """Stage 1; returns the entry function. Raises StageFailure(COMPILE_ERROR)."""
    from .. import inventory

    with _stage(result, "compile"):
        try:
            fn = load_entry(s)
        except Exception as exc:
            raise StageFailure(Status.COMPILE_ERROR, f"entry {s.spec.entry_point}: {type(exc).__name__}: {exc}") from exc
        if checkout is not None:
            stale = [src.path for src in s.sources
                     if (checkout / src.path).is_file() and (checkout / src.path).read_text() != src.content]
            if stale:
                raise StageFailure(Status.COMPILE_ERROR, f"sources {stale} differ from the tree: the Solution is not "
                                   "what would run (run `cutile-kernels inventory sync`)")
        link = s.spec.build_matrix
        if s.spec.language != "cuda-tile" or link is None:
            return fn
        if device.startswith("cuda"):
            from cutile_kernels import dispatch, registry

            cap = torch.cuda.get_device_capability(torch.device(device))
            reg = registry.registry()
            arch = reg.arch_for(cap) if reg.pkg_dir is not None else None
            have = arch is not None and any(v.kernel == link.kernel and v.arch == arch for v in reg.variants())
            result.stages[-1]["detail"] = (f"prebuilt variants for {arch} in {reg.pkg_dir}" if have else
                                           "JIT (no prebuilt variant for this GPU)")
            if not have and not dispatch.jit_available():
                raise StageFailure(Status.COMPILE_ERROR, f"no prebuilt {link.kernel} variant for sm_{cap[0]}{cap[1]} "
                                   f"(build: {reg.pkg_dir}, archs {reg.archs}) and no cuTile JIT toolchain")
            return fn
        from cutile_kernels_build.aot import ToolchainMissing

        manifest = inventory._manifest(build_dir)
        done = []
        for arch in s.spec.target_hardware:
            try:
                done.append(f"{arch}: {inventory.check_compiles(link.kernel, arch, manifest)}")
            except ToolchainMissing as exc:  # nothing to prove or disprove here: not run, said once
                result.stages[-1].update(status="not run", detail=str(exc))
                return fn
            except Exception as exc:
                raise StageFailure(Status.COMPILE_ERROR, f"{arch}: {type(exc).__name__}: {exc}") from exc
        result.stages[-1]["detail"] = "; ".join(done)
        return fn


def evaluate(solution: str, root: Path | None = None, device: str | None = None, *, workloads: list[str] | None = None,
             seed: int = 0, warmup: int = 10, repeats: int = 30, build_dir: Path | None = None,
             checkout: Path | None = None) -> Result:
    """Evaluate one Solution of the inventory at ``root`` (see the module docstring).

    Args:
        solution: the Solution's name.
        device: ``cuda`` / ``cuda:N`` / ``cpu`` (default: cuda when available).
        workloads: only the Workloads with these uuids (default: all of the Definition's).
        checkout: the tree the sources must match (default: this checkout, when there is one).

    Raises:
        KeyError: unknown Solution, Definition or Workload uuid.
        FileNotFoundError: no inventory at ``root``.
    """
    from .. import inventory

    inv = inventory.Inventory.load(root)
    if solution not in inv.solutions:
        raise KeyError(f"unknown Solution {solution!r}; known: {', '.join(sorted(inv.solutions)) or 'none'}")
    s = inv.solutions[solution]
    if s.definition not in inv.definitions:
        raise KeyError(f"Solution {solution!r} names unknown Definition {s.definition!r}")
    d = inv.definitions[s.definition]
    ws = inv.workloads.get(d.name, [])
    if workloads:
        unknown = sorted(set(workloads) - {w.uuid for w in ws})
        if unknown:
            raise KeyError(f"unknown workloads {unknown} of {d.name!r}")
        ws = [w for w in ws if w.uuid in workloads]
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA device")
    checkout = checkout if checkout is not None else inventory.repo_root()
    result = Result(solution=s.name, definition=d.name, device=device)
    try:
        fn = compile_stage(s, device, result, checkout, build_dir)
    except StageFailure as exc:
        result.status, result.message = exc.status.value, f"compile: {exc}"
        if device.startswith("cuda"):
            env = environment(device)
            stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            result.traces = [Trace(definition=d.name, workload=w, solution=s.name, evaluation=Evaluation(
                status=exc.status, environment=env, timestamp=stamp, log=result.message)) for w in ws]
        return result
    try:
        return run_checks(d, fn, ws, device, launches=launch_count, strict=strict_dispatch, seed=seed,
                          warmup=warmup, repeats=repeats, root=inv.root, kernel_needs_cuda=True, result=result)
    except Exception as exc:
        result.status = Status.RUNTIME_ERROR.value
        result.message = f"evaluate itself failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
        return result
