"""A Workload's inputs as tensors, and the shape / dtype check of a reference's or Solution's
outputs against their Definition (used by evaluate, the inventory's validate and kernel-table)."""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from .fib_schema import Definition, EvaluationStatus as Status, Workload


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name if isinstance(name, str) else name.value)


def make_inputs(d: Definition, w: Workload, device: str, seed: int = 0, scale: float = 1.0,
                root: Path | None = None) -> dict:
    """The Workload's inputs as tensors (and Python scalars), in Definition order.

    Random floating tensors are standard normal times ``scale``, drawn in float32 from a generator
    seeded with ``seed`` and the Workload's uuid (so every run sees the same numbers), then cast;
    integer tensors are uniform in [0, 64); bool tensors fair coins. Safetensors inputs load
    ``root / path``.

    Raises:
        ValueError: an input has no spec in the Workload, or a scalar input is not a scalar.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed + zlib.crc32(w.uuid.encode()))
    out = {}
    for name, spec in d.inputs.items():
        inp = w.inputs.get(name)
        if inp is None:
            raise ValueError(f"workload {w.uuid!r} gives no input {name!r}")
        if spec.shape is None:
            if inp.type != "scalar":
                raise ValueError(f"workload {w.uuid!r}: scalar input {name!r} needs a value")
            out[name] = inp.value
            continue
        shape = d.shape_of(spec, w.axes)
        dtype = torch_dtype(spec.dtype)
        if inp.type == "safetensors":
            from safetensors.torch import load_file

            t = load_file(str(Path(root or ".") / inp.path))[inp.tensor_key]
        elif dtype.is_floating_point:
            t = torch.randn(shape, generator=gen, dtype=torch.float32) * scale
        elif dtype == torch.bool:
            t = torch.rand(shape, generator=gen) < 0.5
        else:
            t = torch.randint(0, 64, shape, generator=gen)
        out[name] = t.to(device=device, dtype=dtype)
    return out


def reference_inputs(d: Definition, inputs: dict, dtype: torch.dtype | None = None) -> list:
    """Inputs in Definition order; with ``dtype``, floating tensors are cast to it."""
    return [v.to(dtype) if dtype is not None and isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for v in (inputs[n] for n in d.inputs)]


def as_tuple(outs) -> tuple:
    return tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)


def check_outputs(d: Definition, outs, axes: dict) -> tuple[Status | None, str]:
    """Does ``outs`` have the Definition's outputs' count, shapes and dtypes? (None, "") if so."""
    outs = as_tuple(outs)
    if len(outs) != len(d.outputs):
        return Status.INCORRECT_SHAPE, f"{len(outs)} outputs, the Definition has {len(d.outputs)} ({', '.join(d.outputs)})"
    for (name, spec), t in zip(d.outputs.items(), outs):
        if not isinstance(t, torch.Tensor):
            return Status.INCORRECT_SHAPE, f"output {name!r} is a {type(t).__name__}, not a tensor"
        want = d.shape_of(spec, axes)
        if tuple(t.shape) != tuple(want or ()):
            return Status.INCORRECT_SHAPE, f"output {name!r} has shape {tuple(t.shape)}, expected {tuple(want or ())}"
        if t.dtype != torch_dtype(spec.dtype):
            return Status.INCORRECT_DTYPE, f"output {name!r} has dtype {t.dtype}, expected {spec.dtype.value}"
    return None, ""
