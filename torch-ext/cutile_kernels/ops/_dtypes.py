"""The dtypes every op takes, and the one-line error for any other.

The kernels are built for bfloat16, float16 and float32; float64 is served by each op's PyTorch
reference (gradient checks use it). Integer, bool and complex tensors are no input of any op: they
raise a ``TypeError`` naming the op, the argument and what is supported, instead of computing
something in a dtype nobody asked for (``rms_norm`` of int64 used to return int64 values).
"""

from __future__ import annotations

import torch

#: What the ops take: the kernels' three dtypes, then float64 (the reference path).
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
#: The dtypes of most ops' kernels (attention's are 16-bit only).
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def supported(kernel_dtypes=KERNEL_DTYPES) -> str:
    """What an op takes, in words: its kernels' dtypes, and the rest of :data:`FLOAT_DTYPES`."""
    ref = [d for d in FLOAT_DTYPES if d not in kernel_dtypes]
    return (f"{', '.join(dtype_name(d) for d in kernel_dtypes)} (cuTile kernels) or "
            f"{', '.join(dtype_name(d) for d in ref)} (the PyTorch reference)")


SUPPORTED = supported()


class UnsupportedDtypeError(TypeError, ValueError):
    """A tensor of a dtype no op takes. A ``TypeError``; also a ``ValueError``, which
    ``rope_cos_sin`` raised for such inputs before, so callers catching that still do."""


def check_float(op: str, names: str, *tensors: torch.Tensor | None, kernel_dtypes=KERNEL_DTYPES) -> None:
    """Raise ``TypeError`` unless every given tensor (None skipped) has a dtype of :data:`FLOAT_DTYPES`.

    Args:
        op: the public function's name, e.g. ``"rms_norm"``.
        names: the tensors' argument names, comma-separated in the order given (for the message).
        kernel_dtypes: the dtypes the op's kernels take (for the message; the others of
            :data:`FLOAT_DTYPES` take the reference).

    Raises:
        UnsupportedDtypeError: ``cutile_kernels.<op>: <arg> is <dtype>; supported: ...``.
    """
    for i, t in enumerate(tensors):
        if t is not None and not isinstance(t, torch.Tensor):
            name = names.split(",")[i].strip()
            raise UnsupportedDtypeError(f"cutile_kernels.{op}: {name} is a {type(t).__name__}, not a torch.Tensor")
        if t is not None and t.dtype not in FLOAT_DTYPES:
            name = names.split(",")[i].strip()
            raise UnsupportedDtypeError(f"cutile_kernels.{op}: {name} is {dtype_name(t.dtype)}; "
                                        f"supported: {supported(kernel_dtypes)}")
