"""Kernel coverage: which kernels a prefill and N decode steps run, and which of them are ours.

torch.profiler records the steps; forward hooks wrap every module in a ``module::<name>`` range,
so each kernel is traced back to the aten op that launched it and the innermost module it ran in.
A kernel is ours when its name is exactly one of the loaded builds' variant symbols (no substring
matching: ``matmul`` or ``norm`` in a name proves nothing). On a CPU the aten ops (self time) stand in for
kernels (each with its self time), so the pipeline runs, and is tested, without a GPU.

For each uncovered kernel the report gives its share ``f`` of the device time and the Amdahl
ceiling ``1 / (1 - f + f / s)`` of speeding it up ``s`` times.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections import defaultdict

import torch

MODULE_PREFIX = "module::"

#: Kernel classes for the time breakdown, decided by the aten op that launched the kernel.
_CLASS_BY_OP = (
    ("gemm", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm")),
    ("attention", ("attention", "sdpa", "flash", "aten::_efficient")),
    ("reduction", ("aten::mean", "aten::sum", "aten::max", "aten::argmax", "aten::softmax", "aten::_softmax")),
    ("copy / cat / cast", ("aten::copy_", "aten::cat", "aten::to", "aten::_to_copy", "aten::contiguous",
                           "aten::clone", "aten::index", "aten::embedding", "aten::index_select")),
)


def amdahl(f: float, s: float) -> float:
    """Whole-step speedup from making a share ``f`` of the time ``s`` times faster."""
    return 1.0 / (1.0 - f + f / s)


#: Kernel-name marks, for kernels whose launching op is unknown: a kernel replayed from a CUDA graph
#: was launched by the graph, not by an aten op (cuBLAS's nvjet / cutlass GEMMs, attention kernels).
_CLASS_BY_NAME = (
    ("gemm", ("nvjet", "gemm", "cutlass", "cublas", "xmma")),
    ("attention", ("flash", "fmha", "sdpa", "attention")),
)


def kernel_class(name: str, op: str | None, ours: set[str]) -> str:
    """The breakdown class of kernel ``name`` launched by aten op ``op`` (None when unknown: then
    the kernel's name decides, as for kernels replayed from a CUDA graph)."""
    if name in ours:
        return "ours"
    if not op:
        low = name.lower()
        return next((cls for cls, keys in _CLASS_BY_NAME if any(k in low for k in keys)), "elementwise / other")
    text = op.lower()
    for cls, keys in _CLASS_BY_OP:
        if any(k.lower() in text for k in keys):
            return cls
    return "elementwise / other"


class _ModuleRanges:
    """Forward hooks that open a profiler range per module call (innermost module of a kernel).

    The hooks are marked transparent (``layers.patch.TRANSPARENT_HOOK``): the fallback patcher's
    fusions otherwise step aside for hooked modules, and the profile would not be of the model
    that is timed. A module a fusion skips gets no range; its kernels count to the caller's.
    """

    def __init__(self, model):
        from cutile_kernels.layers.patch import TRANSPARENT_HOOK

        self.handles = []
        self.stack = []
        exit_hook = self._exit_hook()
        setattr(exit_hook, TRANSPARENT_HOOK, True)
        for name, mod in model.named_modules():
            enter_hook = self._enter(MODULE_PREFIX + (name or type(mod).__name__))
            setattr(enter_hook, TRANSPARENT_HOOK, True)
            self.handles.append(mod.register_forward_pre_hook(enter_hook))
            self.handles.append(mod.register_forward_hook(exit_hook))

    def _enter(self, label):
        def hook(module, args):
            rf = torch.autograd.profiler.record_function(label)
            rf.__enter__()
            self.stack.append(rf)
        return hook

    def _exit_hook(self):
        def hook(module, args, output):
            if self.stack:
                self.stack.pop().__exit__(None, None, None)
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def _ancestors(evt):
    p = evt.cpu_parent
    while p is not None:
        yield p
        p = p.cpu_parent


def _is_op(name: str) -> bool:
    return "::" in name and not name.startswith(MODULE_PREFIX)


class _Intervals:
    """Nested (start, end, name) intervals; :meth:`innermost` finds the deepest one holding a time."""

    def __init__(self, items):
        self.items = sorted(items, key=lambda r: (r[0], -r[1]))
        self.starts = [r[0] for r in self.items]

    def innermost(self, t: float, max_walk: int = 512) -> str | None:
        import bisect

        # Walking back from the last interval that starts at or before t, the first one still open
        # at t is the innermost (intervals on one thread nest); siblings that ended are skipped.
        i = bisect.bisect_right(self.starts, t) - 1
        for j in range(i, max(i - max_walk, -1), -1):
            if self.items[j][1] >= t:
                return self.items[j][2]
        return None


def profile_steps(model, run_steps, device: str):
    """Profile ``run_steps()`` with module ranges; returns the profiler's function events."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    ranges = _ModuleRanges(model)
    try:
        with without_usdt_lines(), profile(activities=activities) as prof:
            run_steps()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
    finally:
        ranges.remove()
    return prof.events()


@contextlib.contextmanager
def without_usdt_lines():
    """Drop the ``USDT:... profiler_start`` / ``profiler_stop`` lines that kineto (torch 2.11-2.13)
    writes to file descriptor 2 around every profile: they are noise in a command's output. Whatever
    else goes to fd 2 meanwhile is written after the block, in order."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            rest = [line for line in held.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith("USDT:")]
            if rest:
                sys.stderr.write("".join(rest))
                sys.stderr.flush()


def attribute(events, device: str) -> list[dict]:
    """One record per kernel launch: name, device microseconds, launching op, innermost module."""
    records = []
    if device.startswith("cuda"):
        # On the GPU timeline the module ranges appear as user annotations: a kernel's module is the
        # innermost one whose interval contains it (our kernels are launched from Python, outside
        # any aten op, so CPU-side parentage would not find theirs). The launching op comes from
        # the CPU event the kernel is correlated with, when there is one.
        # The launching op: torch attaches each kernel to the CPU event it is correlated with
        # (``FunctionEvent.kernels``; torch 2.11 keeps no link on the kernel's own event, seen on the
        # H200). That event may be the CUDA runtime call, recorded by CUPTI under another thread id
        # and so without a CPU parent: then the op is the innermost aten op whose interval holds
        # the call. A kernel name launched by several ops gets the one with the most time.
        cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
        ops = _Intervals((e.time_range.start, e.time_range.end, e.name) for e in cpu if _is_op(e.name))
        op_time = defaultdict(lambda: defaultdict(float))
        for e in cpu:
            for k in getattr(e, "kernels", None) or ():
                op = e.name if _is_op(e.name) else ops.innermost(e.time_range.start)
                op_time[k.name][op] += k.duration
        op_of = {name: max(t, key=t.get) for name, t in op_time.items()}
        device_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        ranges = sorted(((e.time_range.start, e.time_range.end, e.name[len(MODULE_PREFIX):])
                         for e in device_events if e.name.startswith(MODULE_PREFIX)), key=lambda r: r[1] - r[0])
        for evt in device_events:
            if evt.name.startswith(MODULE_PREFIX) or getattr(evt, "is_user_annotation", False):
                continue
            start, end = evt.time_range.start, evt.time_range.end
            module = next((name for a, b, name in ranges if a <= start and end <= b), None)
            op = op_of.get(evt.name)
            records.append({"kernel": evt.name, "us": end - start, "op": op, "module": module})
    else:
        # CPU: aten ops are the "kernels", each with its self time (its children excluded, so
        # nothing counts twice). Not only the leaves: aten::mm does its GEMM in its own frame,
        # under small aten children, and leaves only would drop the biggest cost.
        for evt in events:
            if evt.device_type != torch.autograd.DeviceType.CPU or not evt.name.startswith("aten::"):
                continue
            if evt.self_cpu_time_total <= 0:
                continue
            module = next((a.name[len(MODULE_PREFIX):] for a in _ancestors(evt) if a.name.startswith(MODULE_PREFIX)), None)
            records.append({"kernel": evt.name, "us": evt.self_cpu_time_total, "op": evt.name, "module": module})
    return records


def _by_kernel(records: list[dict], ours) -> dict:
    """Kernel name -> launches, microseconds, and microseconds per launching op and per module
    (layers folded); our kernels' op is ``cutile_kernels::<kernel>`` where the profiler could not
    correlate the launch and ``ours`` names them (see :func:`summarize`)."""
    per_kernel = defaultdict(lambda: {"count": 0, "us": 0.0, "ops": defaultdict(float), "modules": defaultdict(float)})
    for r in records:
        k = per_kernel[r["kernel"]]
        k["count"] += 1
        k["us"] += r["us"]
        op = r["op"] or (f"cutile_kernels::{ours[r['kernel']]}" if isinstance(ours, dict) and r["kernel"] in ours
                         else None)
        k["ops"][op or "?"] += r["us"]
        k["modules"][_module_kind(r["module"])] += r["us"]
    return per_kernel


def summarize(records: list[dict], ours, speedup: float = 2.0, top: int = 15) -> dict:
    """Coverage from kernel records: totals, our share of time and launches, the time breakdown by
    class, and the top uncovered kernels with their ops, modules and Amdahl ceiling at ``speedup``.

    ``ours``: our variant symbols, a set or a ``{symbol: kernel name}`` dict; with the dict, our
    kernels' op is ``cutile_kernels::<kernel>`` where the profiler could not correlate the launch
    (driver-API launches are not linked to an op). Each kernel name gets the ops that launched it
    most, so one elementwise kernel launched from several places lists several ops."""
    total_us = sum(r["us"] for r in records) or 1e-9
    by_class = defaultdict(float)
    for r in records:
        by_class[kernel_class(r["kernel"], r["op"], ours)] += r["us"]
    rows = []
    for name, k in _by_kernel(records, ours).items():
        f = k["us"] / total_us
        rows.append({
            "kernel": name, "ours": name in ours, "count": k["count"], "us": k["us"], "share": f,
            "ops": [o for o, _ in sorted(k["ops"].items(), key=lambda x: -x[1])[:3]],
            "modules": [m for m, _ in sorted(k["modules"].items(), key=lambda x: -x[1])[:3]],
            "ceiling": amdahl(f, speedup),
        })
    rows.sort(key=lambda r: -r["us"])
    ours_rows = [r for r in rows if r["ours"]]
    launches = sum(r["count"] for r in rows) or 1
    return {
        "device_us": total_us,
        "launches": launches,
        "ours_time_share": sum(r["us"] for r in ours_rows) / total_us,
        "ours_launch_share": sum(r["count"] for r in ours_rows) / launches,
        "ours": ours_rows,
        "uncovered": [r for r in rows if not r["ours"]][:top],
        "by_class": dict(by_class),
        "amdahl_speedup": speedup,
    }


def phase_share(records: list[dict], ours, top: int = 8) -> dict:
    """One phase's (a prefill, or the decode steps) device time and the share of its non-GEMM time
    spent in our kernels: the figure the families' coverage targets name (GEMMs stay on cuBLAS);
    and that phase's ``top`` non-GEMM kernels not ours, most time first (kernel, its launching op
    with the most time, launches, microseconds, share of the phase's non-GEMM time): what a kernel
    would have to take over to raise the share."""
    total = sum(r["us"] for r in records)
    by_class = defaultdict(float)
    rest = []  # the records of kernels neither GEMMs nor ours
    for r in records:
        cls = kernel_class(r["kernel"], r["op"], ours)
        by_class[cls] += r["us"]
        if cls not in ("gemm", "ours"):
            rest.append(r)
    left = _by_kernel(rest, ours)
    non_gemm = total - by_class.get("gemm", 0.0)
    uncovered = [{"kernel": name, "op": max(k["ops"], key=k["ops"].get), "count": k["count"], "us": k["us"],
                  "non_gemm_share": k["us"] / non_gemm if non_gemm > 0 else 0.0}
                 for name, k in sorted(left.items(), key=lambda kv: -kv[1]["us"])[:top]]
    return {"device_us": total, "launches": len(records), "non_gemm_us": non_gemm,
            "ours_us": by_class.get("ours", 0.0),
            "ours_non_gemm_share": by_class.get("ours", 0.0) / non_gemm if non_gemm > 0 else 0.0,
            "uncovered": uncovered}


def _module_kind(name: str | None) -> str:
    """``model.layers.3.self_attn.q_proj`` -> ``layers.*.self_attn.q_proj`` (layers folded)."""
    if not name:
        return "?"
    parts = ["*" if p.isdigit() else p for p in name.split(".")]
    if parts and parts[0] == "model":
        parts = parts[1:]
    return ".".join(parts) or name
