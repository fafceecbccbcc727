"""Bench jobs in their own processes, driven by :mod:`.bench` over a pipe (``multiprocessing`` spawn:
a fresh interpreter per path, so no patch leaks from one path into another).

A job is the machine limits, the float32 reference logits, or one path (see :mod:`.paths`). A path
worker stays alive for the whole bench so that the parent can time the paths in alternating rounds
on one warm GPU:

* ``setup``: load; logits on the shared prompt batch (top-5 indices saved as a tensor file for the
  paired gate); kernel coverage when asked; an untimed rehearsal of the prefill and of every decode
  batch size (cuDNN attention builds a plan per KV length; compiled paths compile and capture);
* ``round``: ``repeats`` timed prefills and, per batch size, a timed time-to-first-token and
  ``decode_steps`` timed decode steps after ``warmup`` untimed ones, reusing the rehearsed caches;
* ``finish``: our launch counters over the timed rounds and peak memory.
"""

from __future__ import annotations

import gc
import os
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from . import coverage, limits, paths


class _GcClock:
    """Milliseconds spent in Python's cyclic garbage collector since import (``gc.callbacks``)."""

    def __init__(self):
        self.ms = 0.0
        self._t0 = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.ms += (time.perf_counter() - self._t0) * 1e3
            self._t0 = None


GC_CLOCK = _GcClock()


class Timer:
    """Times one call of a function: CUDA events on a GPU, ``perf_counter`` on a CPU.

    After each call, for telling a slow host from a busy GPU:

    * ``host_ms``: host wall time until ``fn`` returned, before waiting for the device. On a GPU,
      close to the event time means the host, not the GPU, set the pace.
    * ``host_cpu_ms``: CPU time of the calling thread over the same span. Well below ``host_ms``,
      the thread was waiting (a synchronizing call, or the OS ran something else); close to it,
      the thread was computing.
    * ``gc_ms``: of that, the time in Python's garbage collector.
    """

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.host_ms = self.host_cpu_ms = self.gc_ms = 0.0

    def _host(self, fn) -> None:
        gc0, cpu0, t0 = GC_CLOCK.ms, time.thread_time(), time.perf_counter()
        fn()
        self.host_ms = (time.perf_counter() - t0) * 1e3
        self.host_cpu_ms = (time.thread_time() - cpu0) * 1e3
        self.gc_ms = GC_CLOCK.ms - gc0

    def __call__(self, fn) -> float:
        """Milliseconds one call of ``fn`` takes (CUDA events on GPU)."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._host(fn)
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        self._host(fn)
        return self.host_ms


def spread(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


class Decoder:
    """Greedy decode of ``batch`` sequences after a prompt of ``prompt_len`` tokens.

    Eager paths use a DynamicCache. Compiled paths use transformers' recipe: a StaticCache and the
    decode step under ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (CUDA graphs); the
    prefill stays eager, as ``generate`` runs it. Decode-graph paths (``graphs``) use a StaticCache
    and the step ``generate`` would use, ``model.get_compiled_call``: our decode graphs.
    """

    def __init__(self, model, batch: int, prompt_len: int, max_new: int, device: str, compiled: bool, seed: int,
                 graphs: bool = False):
        from transformers import DynamicCache, StaticCache

        self.model, self.graphs, self.timer = model, graphs, Timer(device)
        self.static = compiled or graphs  # both decode over a StaticCache
        gen = torch.Generator().manual_seed(seed + 11)
        self.ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=gen).to(device)
        if self.static:
            self.cache = StaticCache(config=model.config, max_cache_len=prompt_len + max_new + 1)
            self.step_fn = model.get_compiled_call(None) if graphs else _compiled_forward(model)
        else:
            self.cache = DynamicCache(config=model.config)
            self.step_fn = model
        self.prompt_len = self.pos = prompt_len
        self.max_new, self.device = max_new, device

    @torch.inference_mode()
    def reset(self) -> None:
        """Empty the cache for another run over the same lengths. A StaticCache is zeroed in place:
        a new one would have new addresses, and the compiled step would recompile and recapture.
        In inference mode, as the prefill and the steps: a hybrid cache (Qwen3.5's) allocates its
        linear-attention states in the first prefill, so they are inference tensors."""
        from transformers import DynamicCache

        if self.static:
            self.cache.reset()
            if self.graphs:  # a decode-graph session counts the cache's length from its first step
                self.step_fn = self.model.get_compiled_call(None)
        else:
            self.cache = DynamicCache(config=self.model.config)
        self.pos = self.prompt_len

    @torch.inference_mode()
    def prefill(self) -> float:
        """Run the prompt; returns its milliseconds (the time to the first token)."""
        def run():
            out = self.model(self.ids, past_key_values=self.cache, use_cache=True,
                             cache_position=torch.arange(self.ids.shape[1], device=self.device))
            self.next = out.logits[:, -1:].argmax(-1)
        return self.timer(run)

    @torch.inference_mode()
    def forced_logits(self, ids: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
        """The logits of a teacher-forced decode: the prompt ``ids`` (batch, decode prompt len)
        prefilled into the emptied cache, then one step per column of ``forced`` (batch, K) through
        the path's own decode step (the compiled call, the decode graphs, or the eager model), each
        step fed that column's token. Returns (batch, K, vocab) float32 on the CPU: row ``j`` is the
        logits after ``forced[:, j]``, what a forward over ``cat(ids, forced)`` gives at position
        ``len(ids) + j``. Leaves the decoder reset (its timed prompt back in place). Each step's
        input has the timed steps' shape, strides and inference mode, so a compiled path neither
        recompiles nor records again and the decode graphs replay the timed step's graph.

        Raises:
            ValueError: ``ids`` or ``forced`` is not the decoder's batch, ``ids`` not its prompt
                length, or ``forced`` longer than its cache has room for."""
        room = self.max_new if self.static else forced.shape[1]
        if ids.shape != self.ids.shape or forced.shape[0] != ids.shape[0] or forced.shape[1] > room:
            raise ValueError(f"forced decode of {tuple(ids.shape)} + {tuple(forced.shape)} tokens on a decoder "
                             f"of {tuple(self.ids.shape)} with room for {room} steps")
        timed, self.ids = self.ids, ids.to(self.device)
        try:
            self.reset()
            self.prefill()
            rows = []
            for j in range(forced.shape[1]):
                # A fresh contiguous (batch, 1) inference tensor, as the timed steps' argmax().clone(): a
                # column view's strides, (K, 1), would make dynamo recompile and the decode graphs
                # capture again at batch 1 (both key on strides), checking another graph than the timed one.
                token = forced[:, j:j + 1].to(self.device).clone(memory_format=torch.contiguous_format)
                rows.append(self._call(token).logits[:, -1].float().cpu())  # a copy: a replay overwrites it
                self.pos += 1
        finally:
            self.ids = timed
            self.reset()
        return torch.stack(rows, dim=1)

    def _call(self, token: torch.Tensor):
        # One decode step of the path on `token` (batch, 1) at the decoder's position.
        pos = torch.tensor([self.pos], device=self.device)
        return self.step_fn(token, past_key_values=self.cache, use_cache=True, cache_position=pos)

    @torch.inference_mode()
    def step(self) -> float:
        def run():
            self.next = self._call(self.next).logits[:, -1:].argmax(-1).clone()
        ms = self.timer(run)
        self.pos += 1
        return ms


_COMPILED = {}
#: Decode steps timed into ``load_to_token.decode_ready_s``: by the third, compiled paths have
#: compiled and recorded their CUDA graphs and decode-graph paths have warmed up and captured.
LOAD_STEPS = 3


def _compiled_forward(model):
    if id(model) not in _COMPILED:
        _COMPILED[id(model)] = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    return _COMPILED[id(model)]


def decode_run(dec: Decoder, warmup: int, steps: int) -> tuple[float, list[float]]:
    """One run on a reset decoder: (time to first token ms, the timed step ms after ``warmup``)."""
    dec.reset()
    ttft = dec.prefill()
    ms = [dec.step() for _ in range(warmup + steps)]
    return ttft, ms[warmup:]


def prefill_ids(model, s: dict) -> torch.Tensor:
    gen = torch.Generator().manual_seed(s["seed"] + 7)
    return torch.randint(0, model.config.vocab_size, (1, s["prefill_len"]), generator=gen).to(s["device"])


def runtime_copies() -> list:
    """The ``dispatch`` modules of every cutile_kernels copy loaded in this process (the source
    package and any build variant ``kernels`` loaded); each keeps its own counters."""
    return [m for name, m in list(sys.modules.items())
            if name.endswith(".dispatch") and hasattr(m, "STATS") and hasattr(m, "FallbackError")]


def our_symbols() -> dict[str, str]:
    """Every variant symbol of the builds this process loaded (for exact kernel-name matching),
    else of the default build, mapped to its kernel name (``rms_norm``...)."""
    copies = runtime_copies()
    if not copies:
        import cutile_kernels.dispatch  # noqa: F401 - the source package's build

        copies = runtime_copies()
    syms = {}
    for d in copies:
        reg = sys.modules[d.__name__.rsplit(".", 1)[0] + ".registry"].registry()
        syms.update((v.symbol, v.kernel) for v in reg.variants())
    return syms


def merged_stats() -> dict:
    total = {"launches": {}, "jit_launches": {}, "fallbacks": {}, "reference_calls": {}}
    for d in runtime_copies():
        for key, counts in d.stats().items():
            for k, n in counts.items():
                total[key][k] = total[key].get(k, 0) + n
    return total


def inert_patches(model, spec, device: str) -> list[str]:
    """The opt-in patches ``spec`` includes that changed no module of ``model``, and the opt-in hub
    layers it includes that the model has no module or function of (CUDA only: on a CPU no patch
    is applied at all, which the report already says)."""
    if not (spec.include and device.startswith("cuda")):
        return []
    from cutile_kernels.layers import patch as patcher
    from cutile_kernels.layers.hub import hub_layer_names

    applied = patcher.applied(model)
    present = hub_layer_names(model)
    return [n for n in spec.include
            if (n in patcher.PATCHES and not applied.get(n)) or (n not in patcher.PATCHES and n not in present)]


def kernelized_layers(model) -> dict:
    """Count of modules whose forward was replaced by one of our layers, by layer class."""
    counts = {}
    for mod in model.modules():
        func = getattr(mod.__dict__.get("forward"), "__func__", None)
        if func is not None and func.__qualname__.startswith("Cutile"):
            name = func.__qualname__.split(".")[0]
            counts[name] = counts.get(name, 0) + 1
    return counts


def _peak_memory(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PathSession:
    """One path's model, kept loaded across the bench's timing rounds (see the module doc)."""

    def __init__(self, job: dict):
        self.job, self.s, self.name = job, job["settings"], job["path"]
        self.spec = paths.spec(self.name)
        self.timer = Timer(self.s["device"])

    def _decoder(self, batch: int) -> Decoder:
        s = self.s
        return Decoder(self.model, batch, s["decode_prompt_len"], decode_room(s), s["device"],
                       self.spec.compile, s["seed"], graphs=self.spec.graphs)

    def setup(self) -> dict:
        s, job = self.s, self.job
        t0 = time.perf_counter()
        model = self.model = paths.load(self.name, Path(job["checkpoint"]), getattr(torch, s["dtype"]), s["device"])
        load_s = time.perf_counter() - t0
        # The timed decoders, made now: the first one's steps here are also what compiled paths
        # compile and capture for, as a user's first generate would.
        self.decoders = {b: self._decoder(b) for b in s["decode_batches"]}
        first = self.decoders[s["decode_batches"][0]]
        with torch.inference_mode():
            first.prefill()
            if s["device"].startswith("cuda"):
                torch.cuda.synchronize()
            first_token_s = time.perf_counter() - t0
            for _ in range(LOAD_STEPS):
                first.step()
            if s["device"].startswith("cuda"):
                torch.cuda.synchronize()
        load = {"load_s": load_s, "first_token_s": first_token_s, "decode_ready_s": time.perf_counter() - t0,
                "batch": s["decode_batches"][0]}
        ref = torch.load(job["reference"])
        with torch.inference_mode():
            logits = model(ref["prompt"].to(s["device"]), use_cache=False).logits.float().cpu()
        from ..metrics import logit_metrics

        out = {"path": self.name, "description": self.spec.description,
               "correctness": logit_metrics(logits, ref["logits"]), "kernelized_layers": kernelized_layers(model),
               "inert_patches": inert_patches(model, self.spec, s["device"]),
               "weight_bytes": limits.weight_bytes(model), "n_params": sum(p.numel() for p in model.parameters()),
               "load_to_token": load}
        torch.save(logits.topk(5, dim=-1).indices, job["top5"])
        del logits
        out["decode_correctness"], top5 = self._decode_check(ref)
        torch.save(top5, job["decode_top5"])
        del ref
        if job.get("coverage"):
            out["coverage"] = run_coverage(model, s, self.spec.compile, self.spec.graphs)
        self.ids = prefill_ids(model, s)
        with torch.inference_mode():  # the rehearsal: nothing timed is the first of its kind
            for _ in range(s["warmup"]):
                model(self.ids, use_cache=False)
            for dec in self.decoders.values():
                decode_run(dec, s["warmup"], s["decode_steps"])
        for d in runtime_copies():
            d.reset_stats()
        return out

    def _decode_check(self, ref: dict) -> tuple[dict, dict]:
        """Each decode batch size's teacher-forced decode (:meth:`Decoder.forced_logits`, on the
        timed decoder: the path's own decode step and cache) against the float32 reference's
        (:func:`run_reference`): ``({"<batch>": logit metrics}, {"<batch>": top-5 indices (batch,
        K, 5)})``. The prefill logits above never run a cached decode step; these do."""
        from ..metrics import logit_metrics

        metrics, top5 = {}, {}
        for b, dec in self.decoders.items():
            got = dec.forced_logits(ref["decode_prompt"][:b], ref["decode_forced"][:b])
            metrics[str(b)] = logit_metrics(got, ref["decode_logits"][:b])
            top5[str(b)] = got.topk(5, dim=-1).indices
        return metrics, top5

    @torch.inference_mode()
    def round(self) -> dict:
        """Timed samples of one round: prefill ms, and per batch size TTFT ms and decode step ms."""
        s = self.s
        out = {"prefill_ms": [], "prefill_host_ms": [], "prefill_host_cpu_ms": [], "prefill_gc_ms": [], "decode": {}}
        for _ in range(s["repeats"]):
            out["prefill_ms"].append(self.timer(lambda: self.model(self.ids, use_cache=False)))
            out["prefill_host_ms"].append(self.timer.host_ms)
            out["prefill_host_cpu_ms"].append(self.timer.host_cpu_ms)
            out["prefill_gc_ms"].append(self.timer.gc_ms)
        for b, dec in self.decoders.items():
            ttft, ms = decode_run(dec, s["warmup"], s["decode_steps"])
            out["decode"][b] = {"ttft_ms": ttft, "step_ms": ms}
        return out

    def finish(self) -> dict:
        return {"runtime": merged_stats(), "peak_memory_bytes": _peak_memory(self.s["device"])}


def combine_rounds(setup: dict, rounds: list[dict], s: dict) -> dict:
    """The path's result from its setup and its rounds: medians over every sample of every round,
    with the per-round medians beside them (the spread between rounds is the machine's drift)."""
    def merged(samples_per_round):
        out = spread([x for r in samples_per_round for x in r])
        out["round_medians"] = [statistics.median(r) for r in samples_per_round]
        return out

    out = dict(setup)
    out["prefill_ms"] = merged([r["prefill_ms"] for r in rounds])
    for key in ("prefill_host_ms", "prefill_host_cpu_ms", "prefill_gc_ms"):
        out[key] = merged([r[key] for r in rounds])
    out["prefill_tokens_per_s"] = s["prefill_len"] / (out["prefill_ms"]["median"] / 1e3)
    out["decode"] = []
    for b in s["decode_batches"]:
        step = merged([r["decode"][b]["step_ms"] for r in rounds])
        ttfts = [r["decode"][b]["ttft_ms"] for r in rounds]
        out["decode"].append({"batch": b, "ttft_ms": statistics.median(ttfts), "ttft_round_ms": ttfts,
                              "step_ms": step, "tokens_per_s": b / (step["median"] / 1e3)})
    return out


def run_coverage(model, s: dict, compiled: bool, graphs: bool = False) -> dict:
    """Kernel coverage over one prefill of ``coverage_prefill_len`` tokens (at most ``prefill_len``) and
    ``coverage_steps`` decode steps (batch 1)."""
    n = s["coverage_steps"]
    dec = Decoder(model, 1, min(s["prefill_len"], s["coverage_prefill_len"]), n + 1, s["device"], compiled, s["seed"],
                  graphs=graphs)
    if compiled or graphs:  # compile and capture outside the profiled window, over the same cache
        dec.prefill()
        for _ in range(n):
            dec.step()
        dec.reset()

    def steps():
        for _ in range(n):
            dec.step()

    # The prefill and the decode steps in two profiles (the steps continue from that prefill), so
    # that each phase's share of non-GEMM time is its own.
    ours = our_symbols()
    prefill = coverage.attribute(coverage.profile_steps(model, dec.prefill, s["device"]), s["device"])
    decode = coverage.attribute(coverage.profile_steps(model, steps, s["device"]), s["device"])
    out = coverage.summarize(prefill + decode, ours, s["amdahl_speedup"])
    out["phases"] = {"prefill": coverage.phase_share(prefill, ours), "decode": coverage.phase_share(decode, ours)}
    return out


def decode_room(s: dict) -> int:
    """Decode steps a timed decoder's cache has room for: its warm-up and timed steps, at least
    :data:`LOAD_STEPS` (the load-to-token steps run on the first one)."""
    return max(s["warmup"] + s["decode_steps"], LOAD_STEPS)


def decode_check_steps(s: dict) -> int:
    """Decode steps of the decode check: ``decode_check_steps``, at most :func:`decode_room`."""
    return max(1, min(s["decode_check_steps"], decode_room(s)))


def run_reference(job: dict) -> dict:
    s = job["settings"]
    model = paths.load("stock", Path(job["checkpoint"]), torch.float32, s["device"])
    gen = torch.Generator().manual_seed(s["seed"])
    prompt = torch.randint(0, model.config.vocab_size, (s["prompt_batch"], s["prompt_len"]), generator=gen)
    # The decode check's reference: prompts of the decode length for the largest batch (each batch
    # size takes the first rows) and the tokens its steps are fed; the logits of one forward over
    # both at the fed positions are what each cached decode step must produce.
    steps = decode_check_steps(s)
    decode_prompt = torch.randint(0, model.config.vocab_size, (max(s["decode_batches"]), s["decode_prompt_len"]),
                                  generator=gen)
    forced = torch.randint(0, model.config.vocab_size, (decode_prompt.shape[0], steps), generator=gen)
    with torch.inference_mode():
        logits = model(prompt.to(s["device"]), use_cache=False).logits.float().cpu()
        decode_logits = model(torch.cat([decode_prompt, forced], dim=1).to(s["device"]), use_cache=False,
                              logits_to_keep=steps).logits.float().cpu()
    torch.save({"prompt": prompt, "logits": logits, "decode_prompt": decode_prompt, "decode_forced": forced,
                "decode_logits": decode_logits}, job["reference"])
    return {"model_type": model.config.model_type, "vocab_size": model.config.vocab_size, "decode_check_steps": steps}


class _OneShot:
    """A limits or reference job: all its work happens in ``setup``."""

    def __init__(self, job: dict):
        self.job = job

    def setup(self) -> dict:
        if self.job["kind"] == "limits":
            return limits.measure(self.job["settings"]["device"])
        return run_reference(self.job)

    def finish(self) -> dict:
        return {}


def serve(conn, job: dict) -> None:
    """Worker process entry point: answer ``setup``, ``round`` and ``finish`` commands on ``conn``
    (each reply a dict with ``ok``); stdout and stderr go to ``job["log"]``."""
    with open(job["log"], "a", buffering=1) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout = sys.stderr = log
        try:
            paths.isolate_packages(job.get("path"))
            session = PathSession(job) if job["kind"] == "path" else _OneShot(job)
        except Exception as exc:  # noqa: BLE001 - said in the reply to the first command
            traceback.print_exc()
            session, failed = None, exc
        while True:
            try:
                cmd = conn.recv()
            except EOFError:
                return
            try:
                if session is None:
                    raise failed
                reply = getattr(session, cmd)()
                reply["ok"] = True
            except Exception as exc:  # noqa: BLE001 - a failing path is reported, the bench goes on
                traceback.print_exc()
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                         "traceback": traceback.format_exc()[-4000:]}
            conn.send(reply)
            if cmd == "finish" or not reply["ok"]:
                return
