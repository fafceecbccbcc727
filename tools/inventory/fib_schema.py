"""The FlashInfer-Bench trace format (Definition, Solution, Workload, Trace) as pydantic models.

`flashinfer-bench <https://github.com/flashinfer-ai/flashinfer-bench>`_ 0.1.2 defines these models,
but the package depends on ``flashinfer-python`` (a large CUDA build) and ``apache-tvm-ffi``; these
models are written to its field names, types and checks so that our inventory's JSON loads with its
models unchanged, without that runtime. ``tests/test_inventory.py`` checks both directions against
``flashinfer_bench.data`` whenever it is importable (``pip install --no-deps flashinfer-bench``
suffices), and against a stored summary of its schema otherwise.

Two additions, both ignored by FlashInfer-Bench's models (they do not forbid extra keys):

* ``BuildSpec.language`` also takes ``"cuda-tile"``, which FlashInfer-Bench 0.1.2's enum lacks
  (python, triton, cpp, cuda, tilelang). :func:`to_flashinfer_bench` maps it to ``"python"``
  (a cuTile kernel is a Python function that ``cuda.tile`` compiles; the entry point is Python)
  and adds the ``cuda-tile`` pin to ``dependencies``, which is what its ``python`` builder needs.
* ``BuildSpec.build_matrix`` links a Solution to the kernel_src build matrix it ships
  (:class:`BuildMatrixLink`).

Layout on disk (a FlashInfer-Bench dataset): ``definitions/**/<name>.json``,
``solutions/**/<name>.json``, ``workloads/**/<definition>.jsonl`` (workload-only Traces) and
``traces/**/<definition>.jsonl``.
"""

from __future__ import annotations

import ast
import math
from enum import Enum
from pathlib import PurePosixPath
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

NonEmpty = Annotated[str, Field(min_length=1)]
NonNegative = Annotated[int, Field(ge=0)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def to_json(self, indent: int | None = 2) -> str:
        """JSON as FlashInfer-Bench writes it: only the fields that were set (so a scalar input's
        ``"shape": null`` stays and an absent description stays absent)."""
        return self.model_dump_json(indent=indent, exclude_unset=True)

    def to_dict(self) -> dict:
        return self.model_dump(mode="json", exclude_unset=True)


class _Tagged(_Model):
    """A model with a ``type`` discriminator, which is always written (even at its default)."""

    def model_post_init(self, context) -> None:
        self.model_fields_set.add("type")


# ---------------------------------------------------------------------------------------------
# Definition
# ---------------------------------------------------------------------------------------------

class DType(str, Enum):
    """Element types FlashInfer-Bench knows (torch's names)."""

    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"
    float8_e4m3fn = "float8_e4m3fn"
    float8_e5m2 = "float8_e5m2"
    float4_e2m1 = "float4_e2m1"
    int64 = "int64"
    int32 = "int32"
    int16 = "int16"
    int8 = "int8"
    bool = "bool"


class AxisConst(_Tagged):
    """An axis whose length is fixed by the Definition (e.g. a model's hidden size)."""

    type: Literal["const"] = "const"
    value: NonNegative
    description: Optional[str] = None


class AxisVar(_Tagged):
    """An axis whose length each Workload gives (e.g. the number of tokens)."""

    type: Literal["var"] = "var"
    description: Optional[str] = None


class TensorSpec(_Model):
    """A tensor argument: its shape as axis names (``None`` for a scalar) and its dtype."""

    shape: Optional[list[NonEmpty]]
    dtype: DType
    description: Optional[str] = None


class Definition(_Model):
    """One operation: named axes, typed inputs and outputs, and a PyTorch reference.

    ``reference`` is Python source that defines a top-level ``run(<inputs in order>)`` returning
    the outputs (a tuple when there are several). ``constraints`` are Python expressions over the
    axis names that every valid set of axis values satisfies.
    """

    name: NonEmpty
    op_type: NonEmpty
    axes: dict[NonEmpty, Union[AxisConst, AxisVar]]
    inputs: dict[NonEmpty, TensorSpec]
    outputs: dict[NonEmpty, TensorSpec]
    reference: NonEmpty
    tags: list[NonEmpty] = Field(default_factory=list)
    description: Optional[str] = None
    constraints: list[NonEmpty] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> "Definition":
        try:
            tree = ast.parse(self.reference)
        except SyntaxError as exc:
            raise ValueError(f"reference is not valid Python: {exc}") from exc
        if not any(isinstance(n, ast.FunctionDef) and n.name == "run" for n in tree.body):
            raise ValueError("reference defines no top-level function `run`")
        clash = set(self.inputs) & set(self.outputs)
        if clash:
            raise ValueError(f"names used as both input and output: {sorted(clash)}")
        for c in self.constraints:
            try:
                ast.parse(c, mode="eval")
            except SyntaxError as exc:
                raise ValueError(f"constraint {c!r} is not a Python expression: {exc}") from exc
        for kind, tensors in (("input", self.inputs), ("output", self.outputs)):
            for tname, spec in tensors.items():
                for axis in spec.shape or ():
                    if axis not in self.axes:
                        raise ValueError(f"{kind} {tname!r} uses undefined axis {axis!r}")
        return self

    @property
    def const_axes(self) -> dict[str, int]:
        return {k: a.value for k, a in self.axes.items() if isinstance(a, AxisConst)}

    @property
    def var_axes(self) -> list[str]:
        return [k for k, a in self.axes.items() if isinstance(a, AxisVar)]

    def shape_of(self, spec: TensorSpec, axes: dict[str, int]) -> Optional[tuple[int, ...]]:
        """Concrete shape of ``spec`` given the var axes' values (``None`` for a scalar).

        Raises:
            ValueError: a var axis of the shape has no value in ``axes``.
        """
        if spec.shape is None:
            return None
        values = {**axes, **self.const_axes}
        missing = [a for a in spec.shape if a not in values]
        if missing:
            raise ValueError(f"{self.name}: no value for axes {missing}")
        return tuple(int(values[a]) for a in spec.shape)

    def satisfies(self, axes: dict[str, int]) -> list[str]:
        """The constraints that ``axes`` (var axes' values) violate (an empty list if none).

        A constraint that names an unknown identifier counts as violated and says so.
        """
        env = {**axes, **self.const_axes}
        bad = []
        for c in self.constraints:
            try:
                ok = eval(compile(c, "<constraint>", "eval"), {"__builtins__": {}}, dict(env))
            except Exception as exc:
                bad.append(f"{c} ({type(exc).__name__}: {exc})")
                continue
            if not ok:
                bad.append(c)
        return bad


# ---------------------------------------------------------------------------------------------
# Solution
# ---------------------------------------------------------------------------------------------

#: FlashInfer-Bench 0.1.2's languages, plus ours.
LANGUAGES = ("python", "triton", "cpp", "cuda", "tilelang", "cuda-tile")
FIB_LANGUAGES = LANGUAGES[:-1]


class SourceFile(_Model):
    """One source file of a Solution; ``path`` is relative (no ``..``), ``content`` verbatim."""

    path: NonEmpty
    content: NonEmpty

    @field_validator("path")
    @classmethod
    def _relative(cls, v: str) -> str:
        p = PurePosixPath(v)
        if p.is_absolute() or ".." in p.parts:
            raise ValueError(f"source path must be relative without '..': {v!r}")
        return v


class BuildMatrixLink(_Model):
    """Where a cuda-tile Solution's compiled variants come from: the ``VariantSpec`` entries of
    ``kernel_src`` whose ``kernel`` is ``kernel`` (``functions`` lists their device functions)."""

    module: NonEmpty
    kernel: NonEmpty
    functions: list[NonEmpty] = Field(min_length=1)


class BuildSpec(_Model):
    """How to build and call a Solution. ``target_hardware`` lists the GPU archs (``sm_90``...);
    ``entry_point`` is ``<source path>::<function>``; with ``destination_passing_style`` the
    function takes the outputs as trailing arguments, otherwise it returns them."""

    language: Literal[LANGUAGES]  # type: ignore[valid-type]
    target_hardware: list[str] = Field(min_length=1)
    entry_point: NonEmpty
    dependencies: list[NonEmpty] = Field(default_factory=list)
    destination_passing_style: bool = True
    binding: Optional[Literal["tvm-ffi", "torch"]] = None
    build_matrix: Optional[BuildMatrixLink] = None

    @field_validator("entry_point")
    @classmethod
    def _entry(cls, v: str) -> str:
        if v.count("::") != 1:
            raise ValueError(f"entry_point must be '<file>::<function>', got {v!r}")
        return v


class Solution(_Model):
    """One implementation of a Definition."""

    name: NonEmpty
    definition: NonEmpty
    author: NonEmpty
    spec: BuildSpec
    sources: list[SourceFile] = Field(min_length=1)
    description: Optional[str] = None

    @model_validator(mode="after")
    def _check(self) -> "Solution":
        paths = [s.path for s in self.sources]
        dup = sorted({p for p in paths if paths.count(p) > 1})
        if dup:
            raise ValueError(f"duplicate source paths {dup}")
        if self.entry_file not in paths:
            raise ValueError(f"entry file {self.entry_file!r} is not among the sources")
        return self

    @property
    def entry_file(self) -> str:
        return self.spec.entry_point.split("::")[0]

    @property
    def entry_symbol(self) -> str:
        return self.spec.entry_point.split("::")[1]

    def source(self, path: str) -> SourceFile:
        return next(s for s in self.sources if s.path == path)


# ---------------------------------------------------------------------------------------------
# Workload and Trace
# ---------------------------------------------------------------------------------------------

class RandomInput(_Tagged):
    type: Literal["random"] = "random"


class ScalarInput(_Tagged):
    type: Literal["scalar"] = "scalar"
    value: Union[bool, int, float]


class SafetensorsInput(_Tagged):
    type: Literal["safetensors"] = "safetensors"
    path: NonEmpty
    tensor_key: NonEmpty


class Workload(_Model):
    """Values for a Definition's var axes and how to make each input."""

    axes: dict[str, NonNegative]
    inputs: dict[str, Union[RandomInput, ScalarInput, SafetensorsInput]]
    uuid: NonEmpty


class Correctness(_Model):
    """Largest errors of the Solution's outputs against the Definition's reference."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")

    max_relative_error: float = 0.0
    max_absolute_error: float = 0.0
    extra: Optional[dict] = None

    @field_validator("max_relative_error", "max_absolute_error")
    @classmethod
    def _non_negative(cls, v: float) -> float:
        if not math.isnan(v) and v < 0:
            raise ValueError("must be non-negative or NaN")
        return v


class Performance(_Model):
    """Milliseconds per call (medians) and ``speedup_factor = reference / solution``."""

    latency_ms: float = Field(default=0.0, ge=0)
    reference_latency_ms: float = Field(default=0.0, ge=0)
    speedup_factor: float = Field(default=0.0, ge=0)


class Environment(_Model):
    hardware: NonEmpty
    libs: dict[str, str] = Field(default_factory=dict)


class EvaluationStatus(str, Enum):
    PASSED = "PASSED"
    INCORRECT_SHAPE = "INCORRECT_SHAPE"
    INCORRECT_NUMERICAL = "INCORRECT_NUMERICAL"
    INCORRECT_DTYPE = "INCORRECT_DTYPE"
    RUNTIME_ERROR = "RUNTIME_ERROR"
    COMPILE_ERROR = "COMPILE_ERROR"
    TIMEOUT = "TIMEOUT"


class Evaluation(_Model):
    """The outcome of one Solution on one Workload. PASSED carries correctness and performance,
    INCORRECT_NUMERICAL correctness only, every other status neither (FlashInfer-Bench's rule)."""

    status: EvaluationStatus
    environment: Environment
    timestamp: NonEmpty
    log: str = ""
    correctness: Optional[Correctness] = None
    performance: Optional[Performance] = None

    @model_validator(mode="after")
    def _fields_match_status(self) -> "Evaluation":
        want_c = self.status in (EvaluationStatus.PASSED, EvaluationStatus.INCORRECT_NUMERICAL)
        want_p = self.status == EvaluationStatus.PASSED
        if (self.correctness is not None) != want_c:
            raise ValueError(f"status {self.status.value} {'needs' if want_c else 'takes no'} correctness")
        if (self.performance is not None) != want_p:
            raise ValueError(f"status {self.status.value} {'needs' if want_p else 'takes no'} performance")
        return self


class Trace(_Model):
    """A Workload of a Definition and, unless it is a workload-only trace, a Solution's evaluation."""

    definition: NonEmpty
    workload: Workload
    solution: Optional[str] = None
    evaluation: Optional[Evaluation] = None

    @property
    def is_workload(self) -> bool:
        return self.solution is None and self.evaluation is None


# ---------------------------------------------------------------------------------------------
# Interchange with flashinfer_bench
# ---------------------------------------------------------------------------------------------

def to_flashinfer_bench(obj: _Model) -> dict:
    """The JSON dict of ``obj`` as FlashInfer-Bench 0.1.2 accepts it.

    A ``cuda-tile`` Solution becomes a ``python`` one with the ``cuda-tile`` pin among its
    dependencies (see the module docstring); ``build_matrix`` is kept (FlashInfer-Bench ignores it).
    Everything else is unchanged.
    """
    data = obj.to_dict()
    if isinstance(obj, Solution) and obj.spec.language == "cuda-tile":
        import importlib.metadata

        spec = data["spec"]
        spec["language"] = "python"
        try:
            pin = f"cuda-tile=={importlib.metadata.version('cuda-tile')}"
        except importlib.metadata.PackageNotFoundError:
            pin = "cuda-tile"
        if not any(d.split("=")[0].split(">")[0].split("<")[0] == "cuda-tile" for d in spec.get("dependencies", [])):
            spec["dependencies"] = [*spec.get("dependencies", []), pin]
    return data


def load_jsonl(model: type[_Model], text: str) -> list:
    """Parse JSON Lines (blank lines skipped) into ``model`` instances.

    Raises:
        ValueError: a line does not validate (the message gives its 1-based number).
    """
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append(model.model_validate_json(line))
            except ValueError as exc:
                raise ValueError(f"line {i}: {exc}") from exc
    return out
