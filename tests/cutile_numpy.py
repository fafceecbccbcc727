"""A NumPy interpreter for the cuTile calls our kernels use, so that a kernel's tile logic (block
indexing, tile ranges, masks, online softmax, split-KV) runs on a CPU in the tests.

:func:`emulate` re-binds a ``@ct.kernel``'s Python function (and the ``@ct.function`` helpers of
its module) to this module's ``ct`` stand-in and runs it once per block of a grid. Arrays are
NumPy views that share the torch tensors' memory and strides. What cuTile leaves undefined is an
error here: a tile entirely outside its array, a store of the wrong dtype, mma operands of two
dtypes. Loads with ``PaddingMode.UNDETERMINED`` pad floats with NaN, so relying on them shows.

It checks logic, not numerics: bfloat16 is not emulated (run it on float32 / float64 tensors),
and the compiler's choices (TMA, tensor-core precision) are the GPU tests' business.
"""

from __future__ import annotations

import itertools
import sys
import types

import cuda.tile as _ct
import numpy as np
import torch

PaddingMode = _ct.PaddingMode
RoundingMode = _ct.RoundingMode
Constant = _ct.Constant

float16, float32, float64 = np.float16, np.float32, np.float64
bfloat16 = np.float32  # not emulated: computed in float32
tfloat32 = np.float32  # likewise
int8, int16, int32, int64, bool_ = np.int8, np.int16, np.int32, np.int64, np.bool_

_block = (0, 0, 0)
_grid = (1, 1, 1)
#: Programmatic dependent launch (kernel_src/_pdl.py), checked where ``run(..., early=...)`` asks:
#: the arrays a block may read before its ``grid_dependency_control_wait`` (None: not checked), and
#: whether the running block has waited.
_early = None
_waited = False


class UndefinedBehaviour(AssertionError):
    """The kernel did something cuTile leaves undefined."""


def bid(axis):
    return _block[axis]


def num_blocks(axis):
    return _grid[axis]


def cdiv(a, b):
    return -(-a // b)


def _pad_value(mode, dtype):
    if mode == PaddingMode.ZERO:
        return 0
    if mode == PaddingMode.NEG_INF:
        return -np.inf
    if mode == PaddingMode.POS_INF:
        return np.inf
    return np.nan if np.issubdtype(dtype, np.floating) else np.iinfo(dtype).min


def _view(arr, order):
    if order == "C":
        return arr
    if order == "F":
        return arr.transpose()
    return arr.transpose(order)


def _spans(arr, index, shape):
    if len(index) != arr.ndim or len(shape) != arr.ndim:
        raise UndefinedBehaviour(f"index {index} / tile {shape} do not match a {arr.ndim}-D array")
    for s in shape:
        if s & (s - 1):
            raise UndefinedBehaviour(f"tile dimension {s} is not a power of two")
    src, dst = [], []
    for i, s, n in zip(index, shape, arr.shape):
        lo = int(i) * s
        if lo < 0 or lo >= n:
            raise UndefinedBehaviour(f"tile {index} x {shape} lies entirely outside an array of shape {arr.shape}")
        hi = np.minimum(lo + s, n)
        src.append(slice(lo, hi))
        dst.append(slice(0, hi - lo))
    return tuple(src), tuple(dst)


def grid_dependency_control_wait():
    global _waited
    _waited = True


def grid_dependency_control_launch_dependents():
    if _early is not None and not _waited:
        raise UndefinedBehaviour("launch_dependents before grid_dependency_control_wait (kernel_src/_pdl.py "
                                 "lets the next kernel launch only after the wait)")


def _before_wait(arr, what: str):
    # Under a PDL check, a block touches memory before its wait only to read an `early` array.
    if _early is None or _waited:
        return
    if what != "read" or not any(np.shares_memory(arr, e) for e in _early):
        raise UndefinedBehaviour(f"a {what} before grid_dependency_control_wait of an array the kernel before "
                                 "may still be writing")


def load(arr, index, shape, order="C", padding_mode=PaddingMode.UNDETERMINED, **_hints):
    _before_wait(arr, "read")
    a = _view(arr, order)
    shape = tuple(shape)
    out = np.full(shape, _pad_value(padding_mode, a.dtype), dtype=a.dtype)
    src, dst = _spans(a, tuple(index), shape)
    out[dst] = a[src]
    return out


def _element_indices(arr, indices, check_bounds, mask):
    # (broadcast index arrays, which elements are in bounds and unmasked) for gather / scatter.
    idx = np.broadcast_arrays(*(np.asarray(i) for i in (indices if isinstance(indices, tuple) else (indices,))))
    if len(idx) != arr.ndim:
        raise UndefinedBehaviour(f"{len(idx)} index arrays for an array of rank {arr.ndim}")
    valid = np.ones(idx[0].shape, dtype=bool)
    for i, n in zip(idx, arr.shape):
        valid &= (i >= 0) & (i < n)
    if not check_bounds and not valid.all():
        raise UndefinedBehaviour("an unchecked gather or scatter outside its array")
    if mask is not None:
        valid &= np.broadcast_to(np.asarray(mask), valid.shape)
    return idx, valid


def gather(arr, indices, mask=None, padding_value=0, check_bounds=True, **_hints):
    """Element indices (a scalar or a tuple of one index array per dimension, broadcast together);
    out-of-bounds or masked elements get the padding value, as cuTile's gather."""
    _before_wait(arr, "read")
    idx, valid = _element_indices(arr, indices, check_bounds, mask)
    if arr.size == 0:
        return np.full(valid.shape, padding_value, dtype=arr.dtype)
    got = arr[tuple(np.where(valid, i, 0) for i in idx)]
    return np.where(valid, got, np.asarray(padding_value).astype(arr.dtype))


def scatter(arr, indices, value, mask=None, check_bounds=True, **_hints):
    """Store ``value`` (broadcast to the indices' shape) at element indices; out-of-bounds or
    masked elements are not stored, as cuTile's scatter. A value of another dtype is an error."""
    _before_wait(arr, "write")
    idx, valid = _element_indices(arr, indices, check_bounds, mask)
    value = np.broadcast_to(np.asarray(value), valid.shape)
    if value.dtype != arr.dtype:
        raise UndefinedBehaviour(f"scatter of {value.dtype} into {arr.dtype}")
    arr[tuple(i[valid] for i in idx)] = value[valid]


def _atomic(arr, indices, update, check_bounds, combine):
    # Blocks run one after another here, so each element's read-modify-write is atomic by construction.
    _before_wait(arr, "write")
    idx, valid = _element_indices(arr, indices, check_bounds, None)
    update = np.broadcast_to(np.asarray(update), valid.shape)
    if update.dtype.kind != arr.dtype.kind:
        raise UndefinedBehaviour(f"atomic update of {update.dtype} on {arr.dtype}")
    old = np.zeros(valid.shape, dtype=arr.dtype)
    for pos in zip(*np.nonzero(valid)) if valid.ndim else [()] * bool(valid):
        at = tuple(int(i[pos]) for i in idx)  # one element at a time: a repeated index counts each time
        old[pos] = arr[at]
        arr[at] = combine(arr[at], update[pos])
    return old if old.ndim else old[()]


def atomic_add(arr, indices, update, check_bounds=True, memory_order=None, memory_scope=None):
    """The old values; adds ``update`` at element indices (cuTile's atomic_add; the memory order and
    scope have no effect here: the blocks of an emulated grid run one at a time). An index outside
    the array (bounds checked) changes nothing and reads 0 (cuTile: implementation-defined)."""
    return _atomic(arr, indices, update, check_bounds, lambda a, u: a + u)


def atomic_xchg(arr, indices, update, check_bounds=True, memory_order=None, memory_scope=None):
    """The old values; stores ``update`` at element indices (cuTile's atomic_xchg)."""
    return _atomic(arr, indices, update, check_bounds, lambda a, u: u)


def store(arr, index, tile, order="C", **_hints):
    _before_wait(arr, "write")
    a = _view(arr, order)
    tile = np.asarray(tile)
    if tile.dtype != a.dtype:
        raise UndefinedBehaviour(f"store of a {tile.dtype} tile into a {a.dtype} array")
    src, dst = _spans(a, tuple(index), tile.shape)
    a[src] = tile[dst]


def full(shape, fill_value, dtype):
    return np.full(shape, fill_value, dtype=dtype)


def zeros(shape, dtype):
    return np.zeros(shape, dtype=dtype)


def arange(size, *, dtype, start=0, step=1):
    return np.arange(start, start + size * step, step, dtype=dtype)


def reshape(x, shape):
    x = np.asarray(x)
    if x.size != int(np.prod(shape)):
        raise UndefinedBehaviour(f"reshape of {x.shape} to {shape}")
    return x.reshape(shape)


def broadcast_to(x, shape):
    return np.broadcast_to(x, shape).copy()


def permute(x, axes):
    return np.transpose(x, axes)


def transpose(x, axis0=None, axis1=None):
    return np.swapaxes(x, -1, -2) if axis0 is None else np.swapaxes(x, axis0, axis1)


def mma(x, y, acc, **_):
    if x.dtype != y.dtype:
        raise UndefinedBehaviour(f"mma of {x.dtype} and {y.dtype} (cuTile does not promote)")
    return (np.matmul(x.astype(acc.dtype), y.astype(acc.dtype)) + acc).astype(acc.dtype)


def cat(tiles, axis):
    a, b = (np.asarray(t) for t in tiles)
    if a.shape != b.shape:
        raise UndefinedBehaviour(f"cat of tiles of shapes {a.shape} and {b.shape} (cuTile: the same shape)")
    return np.concatenate((a, b), axis=axis)


def where(cond, x, y):
    out = np.where(cond, x, y)
    return out


def maximum(x, y, propagate_nan=False, **_):
    # cuTile's default ignores a NaN operand (propagate_nan=False), as np.fmax does.
    return np.maximum(x, y) if propagate_nan else np.fmax(x, y)


def minimum(x, y, propagate_nan=False, **_):
    return np.minimum(x, y) if propagate_nan else np.fmin(x, y)


def max(x, axis=None, keepdims=False, **_):  # noqa: A001 - the cuTile name
    return np.max(x, axis=axis, keepdims=keepdims)


def min(x, axis=None, keepdims=False, **_):  # noqa: A001 - the cuTile name
    return np.min(x, axis=axis, keepdims=keepdims)


def sum(x, axis=None, keepdims=False, **_):  # noqa: A001 - the cuTile name
    return np.sum(x, axis=axis, keepdims=keepdims, dtype=np.asarray(x).dtype)


def exp2(x, **_):
    return np.exp2(x)


def log2(x, **_):
    return np.log2(x)


def log(x, **_):
    return np.log(x)


def tanh(x, **_):
    return np.tanh(x)


def exp(x, **_):
    return np.exp(x)


def cos(x, **_):
    return np.cos(x)


def sin(x, **_):
    return np.sin(x)


def sqrt(x, **_):
    return np.sqrt(x)


def rsqrt(x, **_):
    return 1 / np.sqrt(x)


def cumsum(x, axis=0, reverse=False, **_):
    x = np.asarray(x)
    if reverse:
        return np.flip(np.cumsum(np.flip(x, axis), axis=axis, dtype=x.dtype), axis)
    return np.cumsum(x, axis=axis, dtype=x.dtype)


def _grid_slices(index, shape, full):
    for s, n in zip(shape, full):
        if n % s:
            raise UndefinedBehaviour(f"subtile {shape} does not divide the tile {full}")
    return tuple(slice(int(i) * s, int(i) * s + s) for i, s in zip(index, shape))


def extract(x, index, shape):
    x = np.asarray(x)
    return x[_grid_slices(index, shape, x.shape)].copy()


def insert(x, index, value):
    out = np.array(x, copy=True)
    value = np.asarray(value)
    out[_grid_slices(index, value.shape, out.shape)] = value
    return out


def static_iter(iterable):
    return list(iterable)


def truediv(x, y, **_):
    return np.true_divide(x, y)


def astype(x, dtype, **_):
    return np.asarray(x).astype(dtype)


_SHIM = types.ModuleType("cutile_numpy_ct")
_SHIM.__dict__.update({k: v for k, v in globals().items() if not k.startswith("__")})


def _rebind(fn, env):
    return types.FunctionType(fn.__code__, env, fn.__name__, fn.__defaults__, fn.__closure__)


def _module_env(module, envs: dict) -> dict:
    # The module's globals with ``ct`` the shim and each ``@ct.function`` rebound to run on NumPy,
    # a function imported from another kernel module in that module's own globals.
    env = envs.get(module.__name__)
    if env is None:
        env = envs[module.__name__] = dict(vars(module))
        env["ct"] = _SHIM
        for name, val in vars(module).items():
            if getattr(val, "_cutile_function_wrapper", False):
                home = sys.modules[val.__wrapped__.__module__]
                env[name] = _rebind(val.__wrapped__, _module_env(home, envs))
    return env


def emulate(kernel, module):
    """A callable ``run(grid, args)`` executing ``kernel`` (a ``@ct.kernel`` of ``module``) on
    NumPy; ``args`` as ``ct.launch`` takes them (constants included; a kernel's last constant
    ``PDL``, kernel_src/_pdl.py, may be left out: 0, the kernel as it runs outside a captured
    decode step), tensors as torch CPU tensors of a NumPy-convertible dtype; ``run(grid, args,
    order=f)`` runs the blocks in the order ``f`` gives their list (one at a time: an atomic is a
    plain read-modify-write here). A programmatic dependent launch is checked (a ``PDL`` constant of 1,
    or ``run(grid, args, early=(i, ...))``): each block may touch nothing before its
    ``grid_dependency_control_wait`` but read the ``args[i]`` named in ``early`` (what no kernel before
    it writes; none by default), and let dependents launch only after it."""
    fn = _rebind(kernel._pyfunc, _module_env(module, {}))
    names = kernel._pyfunc.__code__.co_varnames[:kernel._pyfunc.__code__.co_argcount]

    def run(grid, args, order=None, early=None):
        # ``order``: maps the list of blocks to the order they run in (a GPU promises none).
        global _block, _grid, _early, _waited
        args = tuple(args)
        if len(args) == len(names) - 1 and names[-1] == "PDL":
            args += (0,)
        if early is None and names[-1] == "PDL" and args[-1]:
            early = ()
        arrays = [a.numpy() if isinstance(a, torch.Tensor) else a for a in args]
        grid = tuple(grid) + (1,) * (3 - len(grid))
        _grid = grid
        blocks = list(itertools.product(*(range(g) for g in grid)))
        _early = None if early is None else [arrays[i] for i in early]
        try:
            for blk in order(blocks) if order is not None else blocks:
                _block, _waited = blk, False
                fn(*arrays)
        finally:
            _early = None

    return run
