"""The build-matrix vocabulary shared by every kernel family. Imports neither torch nor cuda.tile.

A family module (``norm.py``, ...) declares, beside its ``@ct.kernel`` functions, a list of
:class:`VariantSpec`: one per compiled variant, with the dtype, the ``ct.Constant`` values and
the assumptions each array argument was compiled with. The builder turns a spec into
``cuda.tile.compilation`` constraints; the runtime reads the same assumptions back from the
manifest and checks them on the real tensors before every launch (a violated assumption is
undefined behaviour in cuTile, i.e. wrong numbers, so nothing is assumed at run time).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Union

#: Bytes per element of the dtypes our kernels take (cuTile dtype names).
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4, "int64": 8}

#: The alignment (bytes) that makes a base address or stride eligible for vector loads / TMA.
ALIGN_BYTES = 16

#: Architectures every kernel is compiled for (Ampere, Hopper, Blackwell datacenter, Blackwell).
DEFAULT_ARCHS = ("sm_80", "sm_90", "sm_100", "sm_120")


@dataclass(frozen=True)
class ArrayParam:
    """An array argument and the assumptions a variant is compiled with.

    All divisibility values are in elements, as ``cuda.tile.compilation.ArrayConstraint`` takes
    them; ``base_addr_divisible_by`` is in bytes. ``stride_one`` lists the dimensions whose
    stride is exactly 1. Strides are never negative and a dimension of size > 1 never has
    stride 0 (no internal aliasing), in every variant.
    """

    name: str
    dtype: str
    ndim: int
    stride_one: tuple[int, ...] = ()
    stride_divisible_by: tuple[int, ...] = ()
    shape_divisible_by: tuple[int, ...] = ()
    base_addr_divisible_by: int = 1
    index_dtype: str = "int32"
    kind: str = "array"

    def __post_init__(self):
        for field in ("stride_divisible_by", "shape_divisible_by"):
            if not getattr(self, field):
                object.__setattr__(self, field, (1,) * self.ndim)
            if len(getattr(self, field)) != self.ndim:
                raise ValueError(f"{self.name}: {field} needs {self.ndim} entries")


@dataclass(frozen=True)
class ScalarParam:
    """A runtime scalar argument, passed by value as its C type."""

    name: str
    dtype: str
    kind: str = "scalar"


@dataclass(frozen=True)
class ConstParam:
    """A ``ct.Constant`` argument: compiled in, omitted from the calling convention."""

    name: str
    value: Union[int, float, bool]
    kind: str = "constant"


Param = Union[ArrayParam, ScalarParam, ConstParam]


@dataclass(frozen=True)
class VariantSpec:
    """One compiled variant of one kernel.

    Attributes:
        kernel: public kernel name (``rms_norm``); several device functions may serve one name.
        module: the kernel_src module that defines the device function (``norm``).
        function: attribute name of the ``@ct.kernel`` object in that module.
        tag: short human-readable variant name, unique per kernel (``bf16.n4096.r1.aligned``).
        params: every parameter of the device function, in Python order.
    """

    kernel: str
    module: str
    function: str
    tag: str
    params: tuple[Param, ...]

    def __post_init__(self):
        kinds = [isinstance(p, ConstParam) for p in self.params]
        if kinds != sorted(kinds):
            # The runtime passes the non-constant arguments positionally and appends constants.
            raise ValueError(f"{self.kernel} {self.tag}: ct.Constant parameters must come last")

    @property
    def constants(self) -> dict:
        return {p.name: p.value for p in self.params if isinstance(p, ConstParam)}

    def params_json(self) -> list[dict]:
        return [dataclasses.asdict(p) for p in self.params]


def array(name: str, dtype: str, ndim: int, layout: str) -> ArrayParam:
    """An :class:`ArrayParam` in one of the two layouts every family builds.

    ``aligned``: row-major with the last dimension contiguous, every outer stride a multiple
    of 16 bytes, the last dimension's length a multiple of 16 and the base address 16-byte
    aligned: what a contiguous tensor of a real model's hidden size satisfies, and what buys
    vectorised loads (and TMA on sm_90+).
    ``generic``: no assumption beyond non-negative strides, for views, odd sizes and offsets.
    """
    if layout == "generic":
        return ArrayParam(name, dtype, ndim)
    if layout != "aligned":
        raise ValueError(f"unknown layout {layout!r}")
    vec = ALIGN_BYTES // DTYPE_BYTES[dtype]
    return ArrayParam(
        name,
        dtype,
        ndim,
        stride_one=(ndim - 1,),
        stride_divisible_by=(vec,) * (ndim - 1) + (1,),
        shape_divisible_by=(1,) * (ndim - 1) + (16,),
        base_addr_divisible_by=ALIGN_BYTES,
    )


LAYOUTS = ("aligned", "generic")

DTYPE_TAGS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

#: Dtypes that get decode tiles (one row or position per block) besides the prefill tiles: what
#: models decode in. A decode step's few rows in a prefill tile leave most of it padding and most
#: SMs idle (on the H200, add_rms_norm of one 2048-wide row took 8 us in its 16-row tile).
DECODE_DTYPES = ("bfloat16", "float16")


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (cuTile tile dimensions must be powers of two)."""
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
