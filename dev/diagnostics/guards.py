"""Dynamo's guards on a compiled decode step, stock against ours, measured on a CPU-only machine.

Every call of a ``torch.compile``d forward first checks the guards of its cached graph (Python
objects the trace depended on: module types, attributes, tensor metadata); under
``mode="reduce-overhead"`` that check runs on the host before each CUDA-graph replay, so it adds to
a host-paced decode step. This builds a tiny model of a family's real architecture with a real
layer count (hidden 64, seeded weights), three ways: stock, with our hub layers only
(``kernels.kernelize`` for "cuda", capability faked, no patch), and kernelized and patched as
``cutile_kernels.kernelize`` does; compiles one decode step over a ``StaticCache`` (``fullgraph=True``,
eager backend: the guards do not depend on the backend) and reports, per model, the guards by kind
(``torch._dynamo.explain``) and the microseconds one check of the cached entry's guard manager takes
on the step's arguments (the least of ``--repeats`` medians of ``--checks``, right after the model's compile: one model's
patches change globals another's guards read, so the three cannot be interleaved). The check time
drifts with the process's history: for timing, run each model in a process of its own, in turns::

    python dev/diagnostics/guards.py [--model-type qwen3] [--layers 28] [--batch 16] [--only ours] [--patches gemv]

``--patches`` names the patches of ``ours`` (one at a time finds the costly ones); :func:`check_us`
also times a real model's compiled step (``graph_step.py --ab-guards``).

Needs a build (``cutile-kernels build``; ``CUTILE_KERNELS_BUILD_DIR``) for the hub layers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter

import torch


def tiny_model(model_type: str, layers: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, vocab_size=256, num_hidden_layers=layers)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def kernelized(model, patches: bool, names=None):
    """Our hub layers from the build (capability faked), then when ``patches`` the default patches,
    or those in ``names``."""
    import kernels
    import kernels.layer.repos as repos
    from kernels import LocalLayerRepository, Mode

    import cutile_kernels
    from cutile_kernels.layers import hub

    variant = hub.variant_dir()
    if variant is None:
        sys.exit("no cuTile build found: run `cutile-kernels build` first")
    repos._find_capability = lambda: 90
    mapping = {name: {"cuda": {Mode.INFERENCE: LocalLayerRepository(variant, layer_name=cls)}}
               for name, cls in hub._mapping_in_build(variant).items()}
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(model, mode=Mode.INFERENCE, device="cuda", use_fallback=True)
    cutile_kernels.patch(model, names=(names or None) if patches else [])
    return model


def measure(model, batch: int, checks: int, repeats: int = 7) -> dict:
    """Guards by kind and the microseconds of one guard check of the compiled decode step: the least,
    over ``repeats`` runs, of the median of ``checks`` checks."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=64)
    ids = torch.randint(0, 256, (batch, 8), generator=torch.Generator().manual_seed(1))
    kwargs = dict(past_key_values=cache, use_cache=True, cache_position=torch.tensor([8]))
    torch._dynamo.reset()
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        explained = torch._dynamo.explain(model.forward)(ids[:, :1], **kwargs)
        torch._dynamo.reset()
        torch.compile(model.forward, backend="eager", fullgraph=True)(ids[:, :1], **kwargs)
        # The least of several medians: the host's drift only ever adds to a check's time.
        entries = min((check_us(model, (ids[:, :1],), kwargs, checks) for _ in range(repeats)), key=lambda e: e[0])
    kinds = Counter(g.create_fn_name() for g in explained.out_guards)
    return {"guards": len(explained.out_guards), "graph_breaks": explained.graph_break_count, "kinds": kinds,
            "check_us": entries[0]}


def check_us(model, args: tuple, kwargs: dict, checks: int) -> list[float]:
    """The median microseconds of one guard check of each cache entry that dynamo holds for
    ``model.forward``'s compiled frame (most recent first, the order dynamo tries them in), on the
    frame of an eager ``model.forward(*args, **kwargs)`` call (which runs once: it writes a cache
    position). Call in the grad mode of the compiled calls: grad mode is guarded too.

    Raises:
        RuntimeError: no compiled frame, or the newest entry's guards fail on these arguments.
    """
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    # The frame dynamo compiled: the outermost of forward's decorator chain with a cache entry.
    fn, code = type(model).forward, None
    while fn is not None and code is None:
        code = fn.__code__ if _debug_get_cache_entry_list(fn.__code__) else None
        fn = getattr(fn, "__wrapped__", None)
    if code is None:
        raise RuntimeError("no compiled frame of this model's forward")
    frame = {}

    def trace(f, event, arg):
        if event == "call" and f.f_code is code and not frame:
            frame.update(f.f_locals)

    sys.settrace(trace)
    try:
        model.forward(*args, **kwargs)
    finally:
        sys.settrace(None)
    # Timed right after the compile: another model's kernelize and patches change globals these
    # guards read (a check that fails returns early and would time nothing).
    out = []
    for i, entry in enumerate(_debug_get_cache_entry_list(code)):
        times = []
        for _ in range(checks):
            t0 = time.perf_counter()
            passed = entry.guard_manager.check(frame)
            times.append(time.perf_counter() - t0)
        if i == 0 and not passed:
            raise RuntimeError("the guards fail on the step they were built for")
        out.append(statistics.median(times) * 1e6)
    return out


#: The models compared: stock, stock with our hub layers, ours (hub layers and patches).
MODELS = ("stock", "hub layers", "ours")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-type", default="qwen3")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--checks", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7, help="runs of --checks checks; the least median is reported")
    ap.add_argument("--patches", nargs="+", help="the patches of `ours` (default: the default patches)")
    ap.add_argument("--only", choices=MODELS, help="measure this model alone (a fresh process for each is the fairer timing)")
    args = ap.parse_args(argv)
    rows = {}
    for name in [args.only] if args.only else MODELS:
        model = tiny_model(args.model_type, args.layers)
        if name != "stock":
            model = kernelized(model, patches=name == "ours", names=args.patches)
        rows[name] = r = measure(model, args.batch, args.checks, args.repeats)
        print(f"{name:10s} {r['guards']:6d} guards, {r['graph_breaks']} graph breaks, one check {r['check_us']:.0f} us",
              flush=True)
    last = rows[list(rows)[-1]]  # ours when measured, else the one model of --only
    kinds = sorted(set().union(*(r["kinds"] for r in rows.values())), key=lambda k: -last["kinds"][k])
    print("\n| guard kind | " + " | ".join(rows) + " |\n|---|" + "---|" * len(rows))
    for k in kinds[:12]:
        print(f"| {k} | " + " | ".join(str(r["kinds"][k]) for r in rows.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
