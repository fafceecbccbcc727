"""One bench job in its own process: ``python -m cutile_kernels_tools.worker JOB.json``.

A job is the machine limits, the float32 reference logits, or one path (see :mod:`.paths`): load,
logits on the shared prompt batch, prefill, time to first token and decode timing, peak memory,
our launch counters and, when asked, kernel coverage. The result is written as JSON beside the job
(top-5 indices as a tensor file, for the paired gate in the parent).
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from . import coverage, limits, paths


class _Timer:
    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def __call__(self, fn) -> float:
        """Milliseconds one call of ``fn`` takes (CUDA events on GPU)."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def spread(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


class Decoder:
    """Greedy decode of ``batch`` sequences after a prompt of ``prompt_len`` tokens.

    Eager paths use a DynamicCache. Compiled paths use transformers' recipe: a StaticCache and the
    decode step under ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (CUDA graphs); the
    prefill stays eager, as ``generate`` runs it.
    """

    def __init__(self, model, batch: int, prompt_len: int, max_new: int, device: str, compiled: bool, seed: int):
        from transformers import DynamicCache, StaticCache

        self.model, self.compiled, self.timer = model, compiled, _Timer(device)
        gen = torch.Generator().manual_seed(seed + 11)
        self.ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=gen).to(device)
        if compiled:
            self.cache = StaticCache(config=model.config, max_cache_len=prompt_len + max_new + 1)
            self.step_fn = _compiled_forward(model)
        else:
            self.cache = DynamicCache(config=model.config)
            self.step_fn = model
        self.pos = prompt_len
        self.device = device

    @torch.inference_mode()
    def prefill(self) -> float:
        """Run the prompt; returns its milliseconds (the time to the first token)."""
        def run():
            out = self.model(self.ids, past_key_values=self.cache, use_cache=True,
                             cache_position=torch.arange(self.ids.shape[1], device=self.device))
            self.next = out.logits[:, -1:].argmax(-1)
        return self.timer(run)

    @torch.inference_mode()
    def step(self) -> float:
        def run():
            pos = torch.tensor([self.pos], device=self.device)
            out = self.step_fn(self.next, past_key_values=self.cache, use_cache=True, cache_position=pos)
            self.next = out.logits[:, -1:].argmax(-1).clone()
        ms = self.timer(run)
        self.pos += 1
        return ms


_COMPILED = {}


def _compiled_forward(model):
    if id(model) not in _COMPILED:
        _COMPILED[id(model)] = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    return _COMPILED[id(model)]


def measure_decode(model, s: dict, batch: int, compiled: bool) -> dict:
    """Decode tokens/s at one batch size: an untimed rehearsal over the same lengths first (cuDNN
    attention builds a plan per KV length; compiled paths compile and capture), then timed steps."""
    steps = s["warmup"] + s["decode_steps"]
    rehearsal = Decoder(model, batch, s["decode_prompt_len"], steps, s["device"], compiled, s["seed"])
    rehearsal.prefill()
    for _ in range(steps):
        rehearsal.step()
    del rehearsal
    dec = Decoder(model, batch, s["decode_prompt_len"], steps, s["device"], compiled, s["seed"])
    ttft = dec.prefill()
    ms = [dec.step() for _ in range(steps)][s["warmup"]:]
    sp = spread(ms)
    return {"batch": batch, "ttft_ms": ttft, "step_ms": sp, "tokens_per_s": batch / (sp["median"] / 1e3)}


@torch.inference_mode()
def measure_prefill(model, s: dict) -> dict:
    gen = torch.Generator().manual_seed(s["seed"] + 7)
    ids = torch.randint(0, model.config.vocab_size, (1, s["prefill_len"]), generator=gen).to(s["device"])
    timer = _Timer(s["device"])
    for _ in range(s["warmup"]):
        model(ids, use_cache=False)
    return spread([timer(lambda: model(ids, use_cache=False)) for _ in range(s["repeats"])])


def runtime_copies() -> list:
    """The ``dispatch`` modules of every cutile_kernels copy loaded in this process (the source
    package and any build variant ``kernels`` loaded); each keeps its own counters."""
    return [m for name, m in list(sys.modules.items())
            if name.endswith(".dispatch") and hasattr(m, "STATS") and hasattr(m, "FallbackError")]


def our_symbols() -> set[str]:
    """Every variant symbol of the builds this process loaded (for exact kernel-name matching),
    else of the default build."""
    copies = runtime_copies()
    if not copies:
        import cutile_kernels.dispatch  # noqa: F401 - the source package's build

        copies = runtime_copies()
    syms = set()
    for d in copies:
        reg = sys.modules[d.__name__.rsplit(".", 1)[0] + ".registry"].registry()
        syms.update(v.symbol for v in reg.variants())
    return syms


def merged_stats() -> dict:
    total = {"launches": {}, "jit_launches": {}, "fallbacks": {}, "reference_calls": {}}
    for d in runtime_copies():
        for key, counts in d.stats().items():
            for k, n in counts.items():
                total[key][k] = total[key].get(k, 0) + n
    return total


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


def run_path(job: dict) -> dict:
    s, name = job["settings"], job["path"]
    spec = paths.PATHS[name]
    dtype = getattr(torch, s["dtype"])
    model = paths.load(name, Path(job["checkpoint"]), dtype, s["device"])
    ref = torch.load(job["reference"])
    with torch.inference_mode():
        logits = model(ref["prompt"].to(s["device"]), use_cache=False).logits.float().cpu()
    from .bench import logit_metrics

    out = {"path": name, "description": spec.description, "correctness": logit_metrics(logits, ref["logits"]),
           "kernelized_layers": kernelized_layers(model), "weight_bytes": limits.weight_bytes(model),
           "n_params": sum(p.numel() for p in model.parameters())}
    torch.save(logits.topk(5, dim=-1).indices, job["top5"])
    del logits
    for d in runtime_copies():
        d.reset_stats()
    out["prefill_ms"] = measure_prefill(model, s)
    out["prefill_tokens_per_s"] = s["prefill_len"] / (out["prefill_ms"]["median"] / 1e3)
    out["decode"] = [measure_decode(model, s, b, spec.compile) for b in s["decode_batches"]]
    out["runtime"] = merged_stats()
    out["peak_memory_bytes"] = _peak_memory(s["device"])
    if job.get("coverage"):
        out["coverage"] = run_coverage(model, s, spec.compile)
    return out


def run_coverage(model, s: dict, compiled: bool) -> dict:
    """Kernel coverage over one prefill and ``coverage_steps`` decode steps (batch 1)."""
    n = s["coverage_steps"]
    dec = Decoder(model, 1, min(s["prefill_len"], 512), n + 1, s["device"], compiled, s["seed"])
    if compiled:  # compile and capture outside the profiled window
        warm = Decoder(model, 1, min(s["prefill_len"], 512), n + 1, s["device"], compiled, s["seed"])
        warm.prefill()
        for _ in range(n):
            warm.step()

    def steps():
        dec.prefill()
        for _ in range(n):
            dec.step()

    events = coverage.profile_steps(model, steps, s["device"])
    return coverage.summarize(coverage.attribute(events, s["device"]), our_symbols(), s["amdahl_speedup"])


def run_reference(job: dict) -> dict:
    s = job["settings"]
    model = paths.load("stock", Path(job["checkpoint"]), torch.float32, s["device"])
    gen = torch.Generator().manual_seed(s["seed"])
    prompt = torch.randint(0, model.config.vocab_size, (s["prompt_batch"], s["prompt_len"]), generator=gen)
    with torch.inference_mode():
        logits = model(prompt.to(s["device"]), use_cache=False).logits.float().cpu()
    torch.save({"prompt": prompt, "logits": logits}, job["reference"])
    return {"model_type": model.config.model_type, "vocab_size": model.config.vocab_size}


def main(argv=None) -> int:
    job_path = Path((argv or sys.argv[1:])[0])
    job = json.loads(job_path.read_text())
    try:
        if job["kind"] == "limits":
            result = limits.measure(job["settings"]["device"])
        elif job["kind"] == "reference":
            result = run_reference(job)
        else:
            result = run_path(job)
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - a failing path is reported, the bench goes on
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
    Path(job["out"]).write_text(json.dumps(result, indent=1, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
