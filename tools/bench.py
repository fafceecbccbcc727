"""``cutile-kernels bench``: the stock and the kernelized model from one checkpoint, side by side.

For a checkpoint directory or a preset (:mod:`.presets`), the bench

1. loads the stock model in float32 and keeps its logits on a seeded prompt batch as the
   reference (random weights give near-uniform logits, so greedy tokens prove nothing);
2. for each path (``stock``: the bf16 model as transformers runs it; ``cutile``: the same checkpoint
   through ``from_pretrained(..., use_kernels=True, kernel_config=cutile_kernels.kernel_config())``)
   measures the distance of its logits to the reference (max abs error, relative L2 error, KL
   divergence, top-5 agreement), prefill time (batch 1) and decode throughput per batch size
   (CUDA events, median over repeats, warm-up excluded), and which of our kernels ran (launch
   counters, and kernel names in a torch.profiler trace, matched exactly against the build's
   variant symbols);
3. gates: the kernelized path's relative L2 error and KL divergence are within 1.1x the stock
   path's, and its top-5 agreement is not significantly below the stock path's (see :func:`gate`).

Returns the report (schema ``cutile-kernels/bench/1``), writes it as ``bench.json`` when given an
output directory, and prints a table.
"""

from __future__ import annotations

import gc
import json
import logging
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import presets

SCHEMA = "cutile-kernels/bench/1"
PATHS = ("stock", "cutile")


@dataclass
class BenchSettings:
    """What the bench runs. Lengths in tokens; ``repeats`` timed runs after ``warmup`` ones."""

    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    dtype: str = "bfloat16"
    seed: int = 0
    prompt_batch: int = 4
    prompt_len: int = 128
    prefill_len: int = 2048
    decode_batches: tuple = (1, 16)
    decode_prompt_len: int = 128
    decode_steps: int = 32
    warmup: int = 3
    repeats: int = 10
    profile: bool = True
    paths: tuple = PATHS

    @classmethod
    def for_cpu(cls, **kw) -> "BenchSettings":
        """Small sizes for the embedded model on a CPU (runs in seconds)."""
        base = dict(device="cpu", prompt_len=16, prefill_len=32, decode_batches=(1, 4), decode_prompt_len=8,
                    decode_steps=6, warmup=1, repeats=3, profile=False)
        base.update(kw)
        return cls(**base)


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------

def logit_metrics(logits: torch.Tensor, ref: torch.Tensor) -> dict:
    """Distance of ``logits`` (B, S, V) to the float32 reference ``ref``.

    ``kl``: mean over positions of KL(softmax(ref) || softmax(logits)) in nats;
    ``top5_agreement``: mean over positions of |top5(logits) ∩ top5(ref)| / 5.
    """
    a, r = logits.float(), ref.float()
    diff = a - r
    logp_ref = torch.log_softmax(r, dim=-1)
    kl = (logp_ref.exp() * (logp_ref - torch.log_softmax(a, dim=-1))).sum(-1).mean()
    return {
        "max_abs_err": diff.abs().max().item(),
        "rel_l2_err": (diff.norm() / r.norm()).item(),
        "kl": max(kl.item(), 0.0),
        "top5_agreement": top5_hits(a, r).float().mean().item(),
    }


def top5_hits(logits: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """(B, S, 5) bool: is the reference's k-th most likely token among ``logits``' top 5."""
    top_a, top_r = logits.topk(5, dim=-1).indices, ref.topk(5, dim=-1).indices
    return (top_r.unsqueeze(-1) == top_a.unsqueeze(-2)).any(-1)


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


def _spread(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def runtime_copies() -> list:
    """The ``dispatch`` modules of every cutile_kernels copy loaded in this process (the source
    package and any build variant ``kernels`` loaded); each keeps its own counters."""
    return [m for name, m in list(sys.modules.items())
            if name.endswith(".dispatch") and hasattr(m, "STATS") and hasattr(m, "FallbackError")]


def our_symbols() -> set[str]:
    """Every variant symbol of every loaded copy's build (for exact kernel-name matching)."""
    syms = set()
    for d in runtime_copies():
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


def reset_all_stats() -> None:
    for d in runtime_copies():
        d.reset_stats()


@torch.inference_mode()
def profile_kernels(model, s: BenchSettings, vocab: int, decode_steps: int = 4) -> dict:
    """GPU kernels of one prefill (batch 1, up to 512 tokens) and a few decode steps, by name, with
    ours (exact symbol match) marked."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import DynamicCache

    ids = torch.randint(0, vocab, (1, min(s.prefill_len, 512)), generator=torch.Generator().manual_seed(3))
    ids = ids.to(s.device)
    ours = our_symbols()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        cache = DynamicCache(config=model.config)
        out = model(ids, past_key_values=cache, use_cache=True)
        for _ in range(decode_steps):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
    kernels = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(evt.name, {"count": 0, "us": 0.0})
            k["count"] += 1
            k["us"] += evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
    total_us = sum(k["us"] for k in kernels.values()) or 1.0
    ours_found = {n: k for n, k in kernels.items() if n in ours}
    return {
        "gpu_us": total_us,
        "launches": sum(k["count"] for k in kernels.values()),
        "ours": ours_found,
        "ours_gpu_share": sum(k["us"] for k in ours_found.values()) / total_us,
        "ours_launch_share": sum(k["count"] for k in ours_found.values()) / max(1, sum(k["count"] for k in kernels.values())),
        "top": sorted(({"name": n, **k} for n, k in kernels.items()), key=lambda k: -k["us"])[:15],
    }


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------

def load(checkpoint: Path, path: str, dtype: torch.dtype, device: str):
    """Load the checkpoint for one bench path (``reference``/``stock``: plain; ``cutile``: ours)."""
    from transformers import AutoModelForCausalLM

    import cutile_kernels

    kw = {}
    if path == "cutile":
        kw = {"use_kernels": True, "kernel_config": cutile_kernels.kernel_config()}
    # kernels warns once per hub layer we do not map (SiLU, rotary_pos_emb...): expected, and noise here.
    kernels_logger = logging.getLogger("kernels")
    level = kernels_logger.level
    kernels_logger.setLevel(logging.ERROR)
    try:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, device_map=device, **kw)
    finally:
        kernels_logger.setLevel(level)
    return model.eval()


def _free(model) -> None:
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _environment(s: BenchSettings) -> dict:
    import importlib.metadata as md

    versions = {}
    for dist in ("torch", "transformers", "kernels", "cuda-tile", "cuda-bindings", "cutile-kernels"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    env = {"python": platform.python_version(), "platform": platform.platform(), "versions": versions,
           "device": s.device}
    if s.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        env["torch_cuda"] = torch.version.cuda
    return env


def gate(paths: dict, hits: dict | None = None) -> dict:
    """Correctness gate of the kernelized path against the stock path.

    ``rel_l2_err`` and ``kl`` of the kernelized path must be within 1.1x the stock path's. For
    top-5 agreement both paths are compared slot by slot with the reference's top 5: near-ties
    flip in bf16 for either path, so the gate fails only if the slots the kernelized path loses
    outnumber the ones it wins by more than two standard deviations (a one-sided sign test);
    the raw agreements are reported beside it.
    """
    stock, ours = paths["stock"]["correctness"], paths["cutile"]["correctness"]
    checks = [
        {"metric": "rel_l2_err", "cutile": ours["rel_l2_err"], "stock": stock["rel_l2_err"],
         "passed": ours["rel_l2_err"] <= 1.1 * stock["rel_l2_err"] + 1e-7},
        {"metric": "kl", "cutile": ours["kl"], "stock": stock["kl"], "passed": ours["kl"] <= 1.1 * stock["kl"] + 1e-9},
    ]
    top5 = {"metric": "top5_agreement", "cutile": ours["top5_agreement"], "stock": stock["top5_agreement"]}
    if hits is not None:
        lost = int((hits["stock"] & ~hits["cutile"]).sum())
        won = int((hits["cutile"] & ~hits["stock"]).sum())
        top5.update(lost=lost, won=won, passed=lost - won <= 2 * (lost + won) ** 0.5)
    else:
        top5["passed"] = ours["top5_agreement"] >= stock["top5_agreement"]
    checks.append(top5)
    return {"passed": all(c["passed"] for c in checks), "checks": checks}


def run(model: str = "tiny", s: BenchSettings | None = None, out_dir: str | None = None, progress: bool = True) -> dict:
    """Run the bench on a preset name or checkpoint directory; returns the report (see module doc).

    The paths are loaded side by side and timed in alternation (prefill A, B, A, B...; decode step
    by step), so that drift of clocks or of the host's load falls on every path alike.
    """
    from tqdm import tqdm

    s = s or (BenchSettings() if torch.cuda.is_available() else BenchSettings.for_cpu())
    checkpoint, label = presets.resolve(model, seed=s.seed, device=s.device)
    dtype = getattr(torch, s.dtype)
    report = {"schema": SCHEMA, "model": label, "checkpoint": str(checkpoint),
              "environment": _environment(s), "settings": {k: (list(v) if isinstance(v, tuple) else v)
                                                           for k, v in s.__dict__.items()},
              "paths": {}}
    gen = torch.Generator().manual_seed(s.seed)
    bar = tqdm(total=3 + len(s.decode_batches), desc="bench", disable=not progress)

    bar.set_postfix_str("float32 reference")
    ref_model = load(checkpoint, "reference", torch.float32, s.device)
    vocab = ref_model.config.vocab_size
    prompt = torch.randint(0, vocab, (s.prompt_batch, s.prompt_len), generator=gen).to(s.device)
    with torch.inference_mode():
        ref = ref_model(prompt, use_cache=False).logits.float()
    _free(ref_model)
    del ref_model
    bar.update()

    bar.set_postfix_str("load " + ", ".join(s.paths))
    models = {path: load(checkpoint, path, dtype, s.device) for path in s.paths}
    hits = {}
    for path, m in models.items():
        with torch.inference_mode():
            logits = m(prompt, use_cache=False).logits.float()
        report["paths"][path] = {"correctness": logit_metrics(logits, ref),
                                 "kernelized_layers": kernelized_layers(m)}
        hits[path] = top5_hits(logits, ref)
        del logits
    bar.update()

    reset_all_stats()
    bar.set_postfix_str("prefill")
    for path, ms in interleave(models, lambda m: PrefillTimer(m, s, vocab)).items():
        report["paths"][path]["prefill_ms"] = _spread(ms)
        report["paths"][path]["prefill_tokens_per_s"] = s.prefill_len / (statistics.median(ms) / 1e3)
        report["paths"][path]["decode"] = []
    bar.update()
    for b in s.decode_batches:
        bar.set_postfix_str(f"decode b={b}")
        for path, ms in interleave(models, lambda m: DecodeTimer(m, s, vocab, b)).items():
            spread = _spread(ms)
            report["paths"][path]["decode"].append(
                {"batch": b, "step_ms": spread, "tokens_per_s": b / (spread["median"] / 1e3)})
        bar.update()
    stats = merged_stats()  # the stock path launches none of ours, so the counts are the kernelized path's
    for path in models:
        report["paths"][path]["runtime"] = stats if path == "cutile" else {k: {} for k in stats}
    if s.profile and s.device.startswith("cuda") and "cutile" in models:
        for path, m in models.items():
            report["paths"][path]["profile"] = profile_kernels(m, s, vocab)
    bar.close()
    for path in list(models):
        _free(models.pop(path))

    if {"stock", "cutile"} <= set(report["paths"]):
        report["gate"] = gate(report["paths"], hits)
        ours = report["paths"]["cutile"]
        launched = sum(ours["runtime"]["launches"].values()) + sum(ours["runtime"]["jit_launches"].values())
        report["cutile_kernels_ran"] = launched > 0
        if not launched:
            report["note"] = ("no cuTile kernel ran: " + ("the model is not on a CUDA device, so every layer "
                              "took its PyTorch reference path" if not s.device.startswith("cuda")
                              else "see paths.cutile.runtime.fallbacks"))
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def interleave(models: dict, make_timer) -> dict:
    """Per path, the milliseconds of each timed call, the paths taking turns call by call.

    Every path first runs the whole sequence once untimed (a rehearsal). Kernels that build a plan
    per new shape (cuDNN attention does, for each KV length of a decode) would otherwise charge
    the plans to whichever path meets a length first: on the H200 that made the first path's
    decode steps 4.5x slower, and the path after it look fast. Timed runs see warm caches alike.
    """
    for m in models.values():
        rehearsal = make_timer(m)
        for _ in range(rehearsal.warmup + rehearsal.count):
            rehearsal.step()
        del rehearsal
    timers = {path: make_timer(m) for path, m in models.items()}
    for _ in range(next(iter(timers.values())).warmup):
        for t in timers.values():
            t.step()
    samples = {path: [] for path in timers}
    for _ in range(next(iter(timers.values())).count):
        for path, t in timers.items():
            samples[path].append(t.timed_step())
    return samples


class PrefillTimer:
    """One forward over a batch-1 prompt of ``prefill_len`` tokens, no cache."""

    def __init__(self, model, s: BenchSettings, vocab: int):
        gen = torch.Generator().manual_seed(s.seed + 7)
        self.ids = torch.randint(0, vocab, (1, s.prefill_len), generator=gen).to(s.device)
        self.model, self.timer = model, _Timer(s.device)
        self.warmup, self.count = s.warmup, s.repeats

    @torch.inference_mode()
    def step(self):
        self.model(self.ids, use_cache=False)

    def timed_step(self) -> float:
        return self.timer(self.step)


class DecodeTimer:
    """Decode steps of batch ``batch`` over a DynamicCache primed with ``decode_prompt_len`` tokens;
    each step feeds the greedy token back."""

    def __init__(self, model, s: BenchSettings, vocab: int, batch: int):
        from transformers import DynamicCache

        gen = torch.Generator().manual_seed(s.seed + 11)
        ids = torch.randint(0, vocab, (batch, s.decode_prompt_len), generator=gen).to(s.device)
        self.model, self.timer = model, _Timer(s.device)
        self.cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            out = model(ids, past_key_values=self.cache, use_cache=True)
        self.next = out.logits[:, -1:].argmax(-1)
        self.warmup, self.count = s.warmup, s.decode_steps

    @torch.inference_mode()
    def step(self):
        out = self.model(self.next, past_key_values=self.cache, use_cache=True)
        self.next = out.logits[:, -1:].argmax(-1)

    def timed_step(self) -> float:
        return self.timer(self.step)


def kernelized_layers(model) -> dict:
    """Count of modules whose forward was replaced, by replacement layer class."""
    counts = {}
    for mod in model.modules():
        fwd = mod.__dict__.get("forward")
        func = getattr(fwd, "__func__", None)
        if func is not None and func.__qualname__.startswith("Cutile"):
            name = func.__qualname__.split(".")[0]
            counts[name] = counts.get(name, 0) + 1
    return counts


def print_report(report: dict) -> None:
    """A table of the report (rich)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    table = Table(title=f"cutile-kernels bench: {report['model']}")
    for col in ("path", "rel L2 err", "max abs err", "KL", "top-5", "prefill ms", "decode tok/s", "our launches"):
        table.add_column(col, justify="right" if col != "path" else "left")
    for name, p in report["paths"].items():
        c = p["correctness"]
        dec = ", ".join(f"b{d['batch']}: {d['tokens_per_s']:.1f}" for d in p["decode"])
        table.add_row(name, f"{c['rel_l2_err']:.3e}", f"{c['max_abs_err']:.3e}", f"{c['kl']:.3e}",
                      f"{c['top5_agreement']:.4f}", f"{p['prefill_ms']['median']:.2f}", dec,
                      str(sum(p["runtime"]["launches"].values())))
    console.print(table)
    env = report["environment"]
    console.print(f"device: {env.get('gpu', env['device'])}; versions: "
                  + ", ".join(f"{k} {v}" for k, v in env["versions"].items()))
    if "gate" in report:
        g = report["gate"]
        console.print("gate: " + ("PASSED" if g["passed"] else "FAILED") + " ("
                      + "; ".join(f"{c['metric']}: cutile {c['cutile']:.4g} vs stock {c['stock']:.4g}"
                                  + (f" (slots lost {c['lost']}, won {c['won']})" if "lost" in c else "")
                                  for c in g["checks"]) + ")")
    ours = report["paths"].get("cutile", {})
    if "profile" in ours:
        prof = ours["profile"]
        console.print(f"profiler: our kernels {len(prof['ours'])} distinct, "
                      f"{prof['ours_gpu_share']:.1%} of GPU time, {prof['ours_launch_share']:.1%} of launches")
        for name, k in prof["ours"].items():
            console.print(f"  {name}: {k['count']} launches, {k['us']:.1f} us")
    if "note" in report:
        console.print(report["note"])
