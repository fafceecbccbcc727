"""Launching prebuilt cubins through cuda-python (``cuda.bindings.driver``).

Modules are loaded once per (device, cubin) into the device's primary context, the same one
PyTorch uses, and launched on PyTorch's current stream of the tensor's device, so launches are
ordered with PyTorch's own work and are captured by ``torch.cuda.graph``. cuTile kernels take
block (1, 1, 1) and no dynamic shared memory: the driver sizes the block from the cubin and fills
any TMA descriptors through host code embedded in it. A variant built with a ``PDL`` constant of 1
for sm_90 or newer (``kernel_src/_pdl.py``: it waits for the kernel before it) is launched with programmatic
stream serialization (``cuLaunchKernelEx``), so that it may start while that kernel finishes; every
other variant with ``cuLaunchKernel``, fully ordered as before.

Nothing here touches the driver until the first launch, so importing works without a GPU.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from .cubin import ArgPacker, param_info
from .registry import Variant, programmatic_arch


def _current_raw_stream(device_index: int) -> int:
    """Handle of PyTorch's current stream on a device (the private getter is ~1 us, the public
    ``torch.cuda.current_stream`` object several)."""
    return torch.cuda.current_stream(device_index).cuda_stream


if hasattr(torch._C, "_cuda_getCurrentRawStream"):
    _current_raw_stream = torch._C._cuda_getCurrentRawStream  # noqa: F811


def _current_device() -> int:
    """PyTorch's current CUDA device index. ``torch.cuda.current_device`` adds a Python-level lazy
    init check to the C getter (which initialises CUDA itself when needed); a launch comes after
    a module load, which initialised it, so the getter alone is the same answer."""
    return torch.cuda.current_device()


if hasattr(torch._C, "_cuda_getDevice"):
    _current_device = torch._C._cuda_getDevice  # noqa: F811


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call, the kernel and the error."""


_driver = None


def driver():
    """``cuda.bindings.driver``, imported on first use."""
    global _driver
    if _driver is None:
        from cuda.bindings import driver as cu

        _driver = cu
    return _driver


def _check(result, what: str):
    cu = driver()
    err = result[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)[1]
        raise CudaError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return result[1] if len(result) == 2 else result[1:]


class _Loaded:
    """A variant's function handle on one device, with its argument packer."""

    __slots__ = ("function", "packer", "variant", "local", "pdl")

    def __init__(self, function, packer: ArgPacker, variant: Variant):
        self.function = function
        self.packer = packer
        self.variant = variant
        self.local = threading.local()
        #: The variant waits for the kernel before it (``PDL`` 1, for sm_90 and newer: tileiras drops the
        #: wait for sm_8x, which has no programmatic dependent launch): launch it with programmatic
        #: stream serialization. Never a variant without the wait, which would then read what the kernel
        #: before it has not yet written.
        self.pdl = bool(variant.constants.get("PDL", 0)) and programmatic_arch(variant.arch)

    def params_address(self, values) -> int:
        """Pack ``values`` into this thread's parameter buffer; return the void*[] address.

        The driver copies parameters during cuLaunchKernel, so a per-thread buffer can be reused
        by the next launch of the same variant.
        """
        loc = self.local
        buf = getattr(loc, "buf", None)
        if buf is None:
            packer = self.packer
            buf = ctypes.create_string_buffer(max(packer.struct.size, 1))
            base = ctypes.addressof(buf)
            ptrs = (ctypes.c_void_p * max(len(packer.offsets), 1))(*[base + o for o in packer.offsets])
            loc.buf, loc.ptrs, loc.ptrs_addr = buf, ptrs, ctypes.addressof(ptrs)
        self.packer.struct.pack_into(buf, 0, *values)
        return loc.ptrs_addr


class Launcher:
    """Module cache and launch path for one package copy."""

    def __init__(self):
        self._loaded: dict[tuple[int, str], _Loaded] = {}
        self._cubins: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._ctx_ready = threading.local()

    def _make_current(self, device_index: int) -> None:
        # PyTorch makes the device's primary context current when it selects the device; a thread
        # that never selected one has no current context, so make it current once per thread.
        ready = self._ctx_ready.__dict__
        if ready.get(device_index):
            return
        cu = driver()
        ctx = _check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
        dev = _check(cu.cuDeviceGet(device_index), "cuDeviceGet")
        primary = _check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        if int(ctx) != int(primary):
            _check(cu.cuCtxSetCurrent(primary), "cuCtxSetCurrent")
        ready[device_index] = True

    def load(self, variant: Variant, device_index: int) -> _Loaded:
        """Load ``variant``'s cubin on a device (once) and check its parameter layout."""
        key = (device_index, variant.symbol)
        loaded = self._loaded.get(key)
        if loaded is not None:
            return loaded
        with self._lock:
            loaded = self._loaded.get(key)
            if loaded is not None:
                return loaded
            path = str(variant.cubin)
            data = self._cubins.get(path)
            if data is None:
                data = self._cubins[path] = variant.cubin.read_bytes()
            packer = ArgPacker(variant.params)
            declared = param_info(data, variant.symbol)
            if declared != packer.layout:
                raise CudaError(f"{variant.symbol}: cubin parameters {declared} do not match the "
                                f"cutile_python_v1 packing {packer.layout}")
            cu = driver()
            with torch.cuda.device(device_index):
                self._make_current(device_index)
                module = _check(cu.cuModuleLoadData(data), f"cuModuleLoadData({variant.symbol})")
                function = _check(cu.cuModuleGetFunction(module, variant.symbol.encode()),
                                  f"cuModuleGetFunction({variant.symbol})")
            loaded = self._loaded[key] = _Loaded(function, packer, variant)
            return loaded

    def launch(self, variant: Variant, grid: tuple[int, int, int], args, device_index: int) -> None:
        """Launch a variant on PyTorch's current stream of ``device_index``.

        Raises:
            CudaError: loading or launching failed (e.g. no binary for this GPU).
        """
        loaded = self.load(variant, device_index)
        self.launch_values(loaded, grid, loaded.packer.values(args), device_index)

    def launch_values(self, loaded: _Loaded, grid, values, device_index: int) -> None:
        """Launch an already loaded variant with flat parameter values (see ``ArgPacker``)."""
        address = loaded.params_address(values)
        if _current_device() != device_index:
            with torch.cuda.device(device_index):
                self._launch(loaded, grid, address, device_index)
        else:
            self._launch(loaded, grid, address, device_index)

    def _launch(self, loaded: _Loaded, grid, address: int, device_index: int) -> None:
        if not self._ctx_ready.__dict__.get(device_index):
            self._make_current(device_index)
        cu = _driver
        stream = _current_raw_stream(device_index)
        if loaded.pdl:
            err = cu.cuLaunchKernelEx(programmatic_config(grid, stream), loaded.function, address, 0)[0]
        else:
            err = cu.cuLaunchKernel(loaded.function, grid[0], grid[1], grid[2], 1, 1, 1, 0, stream, address, 0)[0]
        if err != cu.CUresult.CUDA_SUCCESS:
            _check((err,), f"cuLaunchKernel{'Ex' if loaded.pdl else ''}({loaded.variant.symbol}, grid={grid})")


def programmatic_config(grid: tuple[int, int, int], stream: int):
    """The ``cuda.bindings.driver.CUlaunchConfig`` of a launch with programmatic stream serialization (CUDA's
    programmatic dependent launch, ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``): the
    kernel may start before the one before it in ``stream`` has finished, and must wait for it
    (``griddepcontrol.wait``) before touching its outputs. Block (1, 1, 1), no dynamic shared memory,
    as every cuTile launch here."""
    cu = driver()
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX = config.blockDimY = config.blockDimZ = 1
    config.sharedMemBytes = 0
    config.hStream = cu.CUstream(stream)
    config.attrs = [attr]
    config.numAttrs = 1
    return config
