"""One call of a kernel: a prebuilt variant, else cuTile JIT, else the op's declared fallback.

For a CUDA call, :func:`run` tries in order:

1. a prebuilt cubin for the device's arch whose compiled assumptions the arguments satisfy
   (:mod:`.registry`), launched through cuda-python (:mod:`.launcher`);
2. a JIT compile through ``cuda.tile`` when ``tileiras`` is installed (and not disabled with
   ``CUTILE_KERNELS_JIT=0``);
3. otherwise it returns False and the op computes its PyTorch reference. The first fallback of
   each (kernel, reason) is logged as a warning naming the reason; ``CUTILE_KERNELS_STRICT=1``
   turns every fallback into a :class:`FallbackError` instead (tests and benchmarks use it).

``CUTILE_KERNELS_DISABLE=1`` sends every call to the fallback. Counters of launches per variant
symbol, JIT launches and fallbacks per reason are kept for the bench (:func:`stats`).

Inside :func:`programmatic_launches` (the decode graphs' captures), and with :data:`CAPTURE_TWINS` in
any other CUDA-graph capture (inductor's ``mode="reduce-overhead"`` steps, a user's ``torch.cuda.graph``), a
kernel built with programmatic dependent launch twins (``kernel_src/_pdl.py``) takes such a variant
where one fits the call, launched so that it may start while the kernel before it finishes;
elsewhere, and where no twin fits, the variant without the wait, launched as always.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import Counter
from functools import lru_cache
from typing import Callable

import torch

from . import registry as _registry
from .launcher import CudaError, Launcher

logger = logging.getLogger("cutile_kernels")

ENV_DISABLE = "CUTILE_KERNELS_DISABLE"
ENV_STRICT = "CUTILE_KERNELS_STRICT"
ENV_JIT = "CUTILE_KERNELS_JIT"
#: Read when the ops are defined (import): see ``ops/_define.py``.
ENV_FIXED_LAYOUT = "CUTILE_KERNELS_FIXED_LAYOUT"
#: Read when the ops are defined (import): ops that write an argument, declared flexible (an A/B switch).
ENV_FLEXIBLE = "CUTILE_KERNELS_FLEXIBLE"
#: Read when the layers are imported: see ``layers/_direct.py`` (``compiled_static_layer``).
ENV_STOCK_CACHE_WRITES = "CUTILE_KERNELS_STOCK_CACHE_WRITES"
#: Read when decode graphs are switched on: see ``layers/decode_graphs.py`` (``PDL``).
ENV_PDL = "CUTILE_KERNELS_PDL"


class FallbackError(RuntimeError):
    """Raised instead of a fallback when ``CUTILE_KERNELS_STRICT=1``."""


_TRUE = ("1", "true", "yes", "on")


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def fixed_layout() -> bool:
    """Whether ``CUTILE_KERNELS_FIXED_LAYOUT`` asks inductor's default input layouts for our ops."""
    return _flag(ENV_FIXED_LAYOUT)


def flexible_ops() -> frozenset:
    """The op names ``CUTILE_KERNELS_FLEXIBLE`` lists (comma-separated): ops that write an argument
    but take inductor's input layouts anyway (``torch.Tag.flexible_layout``; ``ops/_define.py``), for
    an A/B of a writer's layout before its declaration changes. ``CUTILE_KERNELS_FIXED_LAYOUT``
    overrides it."""
    return frozenset(n.strip() for n in os.environ.get(ENV_FLEXIBLE, "").split(",") if n.strip())


def pdl_switched_off() -> bool:
    """Whether ``CUTILE_KERNELS_PDL`` is set to 0/false/no/off: decode graphs then capture their steps
    without programmatic dependent launch (a profiler's or compute-sanitizer's run, a driver issue)."""
    return os.environ.get(ENV_PDL, "").strip().lower() in ("0", "false", "no", "off")


def stock_cache_writes() -> bool:
    """Whether ``CUTILE_KERNELS_STOCK_CACHE_WRITES`` asks compiled steps to keep transformers' static
    cache writes (``StaticLayer.update``) instead of our kernels'."""
    return _flag(ENV_STOCK_CACHE_WRITES)


#: ``os.environ`` keeps its variables in ``_data`` under encoded keys (CPython's ``os._Environ``):
#: a lookup there costs 0.06 us against 1.2 us through the Mapping API, and these run per launch
#: (the disable switch) and per fallback (the strict one: a declined class falls back on every call).
_KEYS = {name: os.environ.encodekey(name) for name in (ENV_DISABLE, ENV_STRICT)} if hasattr(os.environ, "encodekey") \
    else {}
_DISABLE_KEY = _KEYS.get(ENV_DISABLE)


def _set_flag(name: str) -> bool:
    """``_flag(name)`` with the unset case (the common one) answered without decoding anything."""
    data, key = getattr(os.environ, "_data", None), _KEYS.get(name)
    if data is not None and key is not None and data.get(key) is None:
        return False
    return _flag(name)


def disabled() -> bool:
    """True when ``CUTILE_KERNELS_DISABLE`` is set: every op takes its PyTorch path. Read on every
    call, so setting it at run time takes effect at once."""
    data = getattr(os.environ, "_data", None)  # _set_flag inlined: this runs per launch
    if data is not None and _DISABLE_KEY is not None and data.get(_DISABLE_KEY) is None:
        return False
    return _flag(ENV_DISABLE)


class Stats:
    """What ran: launches per variant symbol, JIT launches and fallbacks per (kernel, reason)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.launches: Counter = Counter()
        self.jit_launches: Counter = Counter()
        self.fallbacks: Counter = Counter()
        self.reference_calls: Counter = Counter()

    def snapshot(self) -> dict:
        return {
            "launches": dict(self.launches),
            "jit_launches": dict(self.jit_launches),
            "fallbacks": {f"{k}: {r}": n for (k, r), n in self.fallbacks.items()},
            "reference_calls": dict(self.reference_calls),
        }


STATS = Stats()
_LAUNCHER = Launcher()
_warned: set = set()


def stats() -> dict:
    """A snapshot of this package copy's counters (see :class:`Stats`)."""
    return STATS.snapshot()


def reset_stats() -> None:
    STATS.reset()


def _warn_once(key, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg)


def fallback(kernel: str, reason: str) -> bool:
    """Record that ``kernel`` takes its PyTorch fallback for ``reason``; always returns False.

    Raises:
        FallbackError: when ``CUTILE_KERNELS_STRICT=1``.
    """
    if _set_flag(ENV_STRICT):
        raise FallbackError(f"cutile_kernels: {kernel} has no cuTile path here: {reason}")
    STATS.fallbacks[(kernel, reason)] += 1
    _warn_once((kernel, reason), f"cutile_kernels: {kernel} falls back to PyTorch: {reason}")
    return False


def reference_call(kernel: str) -> None:
    """Record a call on a non-CUDA device, which the reference path serves by design."""
    STATS.reference_calls[kernel] += 1


@lru_cache(maxsize=None)
def _arch_of(device_index: int) -> tuple[tuple[int, int], str | None]:
    cap = torch.cuda.get_device_capability(device_index)
    return cap, _registry.registry().arch_for(cap)


@lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Multiprocessors of a CUDA device (132 on the H100 and H200): blocks in one wave of a grid,
    which the ops' tile and split choices size launches by."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launches_programmatic(device_index: int) -> bool:
    """Whether a twin launched on this device goes with programmatic dependent launch: the build arch it
    runs there is sm_90 or newer (:func:`~.registry.programmatic_arch`, the launcher's rule)."""
    arch = _arch_of(device_index)[1]
    return arch is not None and _registry.programmatic_arch(arch)


def runs_on(device: torch.device) -> bool:
    """Whether kernels can launch on CUDA ``device``: a built arch's cubins run on its compute
    capability, or cuda.tile can JIT (:func:`jit_available`)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _arch_of(index)[1] is not None or jit_available()


def jit_available() -> bool:
    """True when cuda.tile can JIT-compile here: its ``tileiras`` toolchain is found and
    ``CUTILE_KERNELS_JIT`` is not set to 0/false/no/off."""
    if os.environ.get(ENV_JIT, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    from . import kernel_src

    return kernel_src.tileiras_found()


class _Plan:
    """Everything about a call that depends only on its signature (dtypes, shapes, strides, base
    alignment, constants): the loaded variant, the grid, the packed parameters but for pointers and
    scalars, and the byte spans of the inputs for the per-call aliasing check."""

    __slots__ = ("loaded", "grid", "values", "ptr_slots", "scalar_slots", "spans", "arcs", "symbol", "input_slots")

    def __init__(self, loaded, grid, args, n_inputs):
        self.loaded = loaded
        self.grid = grid
        self.values, self.ptr_slots, self.scalar_slots = loaded.packer.template(args)
        self.spans = [_registry.byte_range(a)[1] - a.data_ptr() for a in args[:n_inputs]]
        # Per input, how it may interleave with another one in the same buffer (row_arcs): only
        # read when two byte ranges overlap.
        self.arcs = [_registry.row_arcs(a) for a in args[:n_inputs]] if n_inputs > 1 else []
        self.symbol = loaded.variant.symbol
        #: slots of the input pointers (the first n_inputs parameters), for the aliasing check
        self.input_slots = tuple(slot for slot, _ in self.ptr_slots[:n_inputs]) if n_inputs > 1 else ()


class _NoPlan(str):
    """Why no prebuilt variant takes a call signature; ``jit_ok`` says whether a JIT compile may
    (it may not when the operands themselves are unfit: several devices, overlapping memory)."""

    jit_ok = True


class _Unfit(_NoPlan):
    jit_ok = False


#: Call signature -> _Plan, or the reason no prebuilt variant fits (a _NoPlan).
_PLANS: dict = {}
_MAX_PLANS = 4096


#: The tensor classes a kernel takes: plain tensors and parameters. A subclass (tensor parallelism's
#: ``DTensor``, whose shape is the global one and whose data is a shard) must never reach a launch.
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


class _SubclassOperand(Exception):
    """An operand of :func:`run` is a tensor subclass (its class is the argument)."""


def _signature(kernel: str, want: tuple, layout, args) -> tuple:
    """The plan cache key of a call: kernel, wanted constants, layout function, then per tensor
    argument its dtype, shape, strides, base address mod 16 and device index, per scalar its type
    (flat: one tuple is cheaper to build than one per tensor; a dtype never equals a type, so the
    fields cannot shift). The device index of ``args[0]`` (always a tensor) is ``key[7]``.

    Raises:
        _SubclassOperand: a tensor argument is a subclass (e.g. a ``DTensor``), before its data
            pointer is read.
    """
    key = [kernel, want, layout]
    for a in args:
        cls = a.__class__
        if cls is _PLAIN_TENSORS[0] or cls is _PLAIN_TENSORS[1]:
            key += (a.dtype, a.shape, a.stride(), a.data_ptr() & 15, a.get_device())
        elif isinstance(a, torch.Tensor):
            raise _SubclassOperand(cls)
        else:
            key.append(cls)
    return tuple(key)


def _make_plan(kernel: str, want: tuple, args, n_inputs: int, grid, device_index: int):
    """The _Plan for a new call signature, or the reason no prebuilt variant takes it."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if any(t.get_device() != device_index for t in tensors):
        return _Unfit(f"operands on several devices {sorted({str(t.device) for t in tensors})}")
    for t in args[:n_inputs]:
        if not t.is_contiguous() and _registry.internal_overlap(t):
            return _Unfit("an input has internally overlapping elements (stride 0 or expand())")
    cap, arch = _arch_of(device_index)
    reg = _registry.registry()
    if reg.pkg_dir is None:
        return _NoPlan("no cuTile build found (run `cutile-kernels build`)")
    if arch is None:
        return _NoPlan(f"the build has no cubins for sm_{cap[0]}{cap[1]} (built: {', '.join(reg.archs)})")
    variant, why = reg.select(kernel, arch, dict(want), args)
    if variant is None:
        return _NoPlan(why)
    try:
        loaded = _LAUNCHER.load(variant, device_index)
    except CudaError as exc:  # e.g. no binary for this GPU: a declared fallback, not a crash
        return _NoPlan(str(exc))
    return _Plan(loaded, grid(variant.constants), args, n_inputs)


def _inputs_overlap(plan: _Plan, values: list) -> bool:
    """Whether the call's input arrays may touch the same bytes (their pointers are in values):
    their byte ranges overlap and they do not interleave row by row without meeting (e.g. q and
    k split from one fused QKV projection do not alias). Byte ranges first, inline: this runs per
    launch, and interleaved rows of one buffer are only looked at when two ranges meet."""
    slots, spans = plan.input_slots, plan.spans
    n = len(slots)
    for i in range(n - 1):
        a, end_a = values[slots[i]], spans[i]
        end_a += a
        for j in range(i + 1, n):
            b = values[slots[j]]
            if a < b + spans[j] and b < end_a and not _registry.disjoint_arcs(plan.arcs[i], plan.arcs[j], a, b):
                return True
    return False


#: A signature whose layout function copies an input (no view of it): each call lays out anew.
_RELAYOUT = _NoPlan("the layout copies an input")


def run(kernel: str, want: tuple, args: tuple, n_inputs: int, grid: Callable[[dict], tuple],
        layout: Callable[[tuple], tuple] | None = None, optional: bool = False) -> bool:
    """Launch ``kernel`` on the device of ``args[0]``; False means the caller must fall back.

    Args:
        kernel: kernel name in the manifest (``rms_norm``).
        want: ``((name, value), ...)`` constants the variant must have (``(("BLOCK_N", 4096),)``).
        args: the non-constant arguments in parameter order: CUDA tensors and Python scalars.
            The first ``n_inputs`` tensors are inputs; the rest are outputs the caller has just
            allocated (so they cannot alias anything).
        n_inputs: how many leading arguments are input tensors.
        grid: maps the chosen variant's constants to the launch grid (x, y, z).
        layout: maps ``args`` to the arguments the kernel takes (same count and order), as views:
            e.g. ``(B, S, N)`` activations seen as ``(B*S, N)`` rows. It must depend only on
            what the plan key holds (dtypes, shapes, strides, devices, ``want``). It runs once per
            call signature, not per call: the kernel arguments' shapes and strides are in the
            plan, and each view starts at its tensor's address, so the call's own pointers are
            launched. A layout that copies an input (the view would not start there) is run on
            every call of that signature instead; one that would copy an output (which the
            kernel would write and the caller never see) makes the call fall back.
        optional: a kernel the caller can do without (another of our kernels then serves the
            call, e.g. a fused variant's unfused pair): where it cannot launch (disabled, no
            fitting prebuilt variant, an unfit operand, overlapping inputs) return False quietly,
            without a JIT compile, a fallback record or a strict-mode error.

    Returns:
        True if a cuTile kernel (prebuilt or JIT) was launched; False (with the reason logged once)
        for no fitting variant, operands on several devices, or an operand that is a tensor
        subclass (tensor parallelism's ``DTensor``: its data pointer is a shard's).

    Raises:
        FallbackError: no cuTile path and ``CUTILE_KERNELS_STRICT=1``.
        CudaError: the launch itself failed.
    """
    if disabled():
        return False if optional else fallback(kernel, f"disabled by {ENV_DISABLE}")
    try:
        key = _signature(kernel, want, layout, args)
    except _SubclassOperand as exc:
        return False if optional else fallback(
            kernel, f"a {exc.args[0].__name__} operand (e.g. tensor parallelism's DTensor, whose data is a shard of "
                    "a global shape): the kernels take plain tensors")
    # twins_now(), inlined (this runs per launch): the capture is asked only for a twinned kernel
    on = getattr(_PDL, "on", None)
    if on is None and CAPTURE_TWINS and _has_twins(kernel):
        on = _capturing()
    plan = _programmatic(kernel, want, args, n_inputs, grid, layout) if on else None
    if plan is None:
        plan = _PLANS.get(key)
        if plan is None:
            plan = _new_plan(key, kernel, want, args, n_inputs, grid, layout)
    if plan.__class__ is not _Plan:  # a _NoPlan: why no prebuilt variant fits
        if optional:
            return False
        if layout is not None:
            args = layout(args)
            if plan is _RELAYOUT:
                return run(kernel, want, args, n_inputs, grid)
        if plan.jit_ok and jit_available():
            return _jit(kernel, want, args, grid, str(plan))
        return fallback(kernel, str(plan))
    values = plan.values.copy()
    for slot, i in plan.ptr_slots:
        values[slot] = args[i].data_ptr()
    if plan.input_slots and _inputs_overlap(plan, values):
        return False if optional else fallback(kernel, f"inputs of {kernel} overlap in memory (the kernels assume "
                                                       "no aliasing)")
    for slot, i in plan.scalar_slots:
        values[slot] = args[i]
    _LAUNCHER.launch_values(plan.loaded, plan.grid, values, key[7])
    STATS.launches[plan.symbol] += 1
    return True


#: Per thread, whether :func:`programmatic_launches` is active (``on``: True or False; unset: neither,
#: then :data:`CAPTURE_TWINS` decides). A capture runs on its own thread's stream, and two threads
#: capturing at once must not switch each other.
_PDL = threading.local()
#: Outside :func:`programmatic_launches`, whether a launch captured into a CUDA graph takes its
#: programmatic twin (inductor's CUDA graphs of a ``mode="reduce-overhead"`` compiled step, a user's
#: ``torch.cuda.graph``): the same bits, each such kernel's launch overlapping the end of the one
#: before it in a replay. Off until the model bench accepts it for compiled steps (set it to True to
#: try it; one H100 run of Llama-3.2-1B's compiled step, 2026-12-07, one process each way: batch 1
#: 1.857 against 1.873 ms, batch 16 2.293 against 2.205).
CAPTURE_TWINS = False


def _capturing() -> bool:
    # Whether this thread's current CUDA stream is capturing a graph. Nothing is capturing where torch
    # has not initialised CUDA (asked first: it touches no driver, so importing us never does either).
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def programmatic_launches(on: bool = True):
    """While active (in this thread), a kernel built with programmatic dependent launch twins
    (``kernel_src/_pdl.py``: the variant waits for the kernel before it at its start) takes its twin
    where one fits the call, launched so that it may start while the kernel before it finishes;
    elsewhere the plain variant, launched as always. The decode graphs capture their steps inside
    it (``layers/decode_graphs.py``): there the launches form one chain on one stream and a replay
    gains each one's launch latency; an eager launch gains nothing (its host sets the pace, and a
    launch with the attribute costs ~3 us more host time). Outside any switch, a capture takes the
    twins as :data:`CAPTURE_TWINS` says (:func:`twins_now`).

    Args:
        on: True to take the twins, False to take the plain variants (inside an enclosing switch, or
            in a capture that would take them).
    """
    before = getattr(_PDL, "on", None)  # None: neither (CAPTURE_TWINS decides), kept so after it
    _PDL.on = bool(on)
    try:
        yield
    finally:
        _PDL.on = before


def programmatic_launches_active() -> bool:
    """Whether :func:`programmatic_launches` is active in this thread."""
    return getattr(_PDL, "on", False) is True


def twins_now() -> bool:
    """Whether a launch now takes its programmatic twin where one fits (what :func:`run` decides per
    launch): inside :func:`programmatic_launches` as it says, else while this thread's current stream
    is capturing a CUDA graph, unless :data:`CAPTURE_TWINS` is off."""
    on = getattr(_PDL, "on", None)
    return (CAPTURE_TWINS and _capturing()) if on is None else on


@lru_cache(maxsize=None)
def _has_twins(kernel: str) -> bool:
    # Whether the build holds programmatic dependent launch twins of `kernel` (any arch).
    return any(v.constants.get("PDL", 0) for v in _registry.registry().variants(kernel))


def _programmatic(kernel: str, want: tuple, args: tuple, n_inputs: int, grid, layout):
    """The plan of the call's programmatic twin, or None where none is built or none fits (the
    caller then takes its plain plan)."""
    if not _has_twins(kernel):
        return None
    key = _signature(kernel, (*want, ("PDL", 1)), layout, args)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _new_plan(key, kernel, key[1], args, n_inputs, grid, layout)
    return plan if plan.__class__ is _Plan else None


def _new_plan(key: tuple, kernel: str, want: tuple, args: tuple, n_inputs: int, grid, layout):
    # The plan of a signature not in the cache (_plan_for), stored under its key.
    plan = _plan_for(kernel, want, args, n_inputs, grid, layout, key[7])
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def _plan_for(kernel: str, want: tuple, args: tuple, n_inputs: int, grid, layout, device_index: int):
    """The plan of a new call signature: :func:`_make_plan` of the laid-out arguments;
    ``_RELAYOUT`` when the layout does not view every input at its own address; an ``_Unfit``
    reason when it would not view an output there, or changes the arguments' count or kinds."""
    if layout is None:
        return _make_plan(kernel, want, args, n_inputs, grid, device_index)
    laid = layout(args)
    if len(laid) != len(args) or any(isinstance(a, torch.Tensor) != isinstance(v, torch.Tensor)
                                     for a, v in zip(args, laid)):
        return _Unfit(f"the layout of {kernel} changes its arguments")
    moved = [i for i, (a, v) in enumerate(zip(args, laid))
             if isinstance(a, torch.Tensor) and a.data_ptr() != v.data_ptr()]
    if any(i >= n_inputs for i in moved):  # the kernel would write a copy the caller never sees
        return _Unfit(f"the layout of {kernel} copies an output")
    if moved:
        return _RELAYOUT
    return _make_plan(kernel, want, laid, n_inputs, grid, device_index)


@lru_cache(maxsize=None)
def _jit_spec(kernel: str, want: tuple, dtypes: tuple):
    """The kernel_src spec whose function and constants a JIT compile uses, or None."""
    from . import kernel_src

    for s in kernel_src.all_variants():
        arrays = tuple(p.dtype for p in s.params if p.kind == "array")
        if s.kernel == kernel and arrays == dtypes and all(s.constants.get(k) == v for k, v in want):
            return s
    return None


def _jit(kernel: str, want: tuple, args: tuple, grid, why: str) -> bool:
    from . import kernel_src

    dtypes = tuple(_registry.DTYPE_NAMES.get(a.dtype) for a in args if isinstance(a, torch.Tensor))
    spec = _jit_spec(kernel, want, dtypes)
    if spec is None:
        return fallback(kernel, f"{why}; and no kernel_src variant to JIT for dtypes {dtypes}")
    import cuda.tile as ct

    fn = getattr(kernel_src.family_module(spec.module), spec.function)
    _warn_once(("jit", kernel, why), f"cutile_kernels: JIT-compiling {kernel} ({spec.tag}) because {why}")
    try:
        ct.launch(torch.cuda.current_stream(args[0].device), grid(spec.constants), fn,
                  tuple(args) + tuple(spec.constants.values()))
    except Exception as exc:  # noqa: BLE001 - a failed JIT is a declared fallback
        return fallback(kernel, f"{why}; JIT failed: {type(exc).__name__}: {exc}")
    STATS.jit_launches[kernel] += 1
    return True


def needs_op(*tensors) -> bool:
    """Whether an op call must go through its ``torch.library`` custom op: under torch.compile (the
    op is what the graph records) or when a gradient is wanted (its autograd formula). Otherwise
    the ops call their implementation directly, skipping the dispatcher's overhead."""
    if torch.compiler.is_compiling():
        return True
    if torch.is_grad_enabled():
        for t in tensors:  # a loop, not any(<generator>): this runs on every op call
            if t.requires_grad:
                return True
    return False
