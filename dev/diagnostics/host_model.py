"""Host time of a whole eager forward, stock against ours, measured on a CPU-only machine.

On the H200 machine the eager prefill of the small presets is paced by the host (see the README),
so the Python and dispatch work per forward is what a change there must cut. This times it without
a GPU: two Llama-architecture models with Llama-3.2-1B's layer count and head layout but small
widths, one stock and one kernelized (our RoPE hub layer from the build) and patched with the
default patches (``cutile_kernels.patch``). Our ops run their CUDA branch down to the driver call,
faked as in ``host_overhead.py``; in both models the GEMMs and SDPA, which cuBLAS and cuDNN run on
a GPU, are replaced by an output allocation. What remains is the forward's Python and dispatch
work, plus the stock model's small CPU elementwise ops. The models are timed alternately, one
forward each per round, so a drifting host slows both alike:

    python dev/diagnostics/host_model.py [--family llama|phi3|qwen3|...] [--layers 16] [--tokens 8] [--rounds 300]
        [--profile 30]

It prints each model's median and p10 microseconds per forward and their ratio (median over rounds
of ours / stock). ``--profile N`` adds the top N functions of ours under cProfile.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # for host_overhead
import host_overhead  # noqa: E402


def fake_gemms() -> None:
    """``F.linear`` and SDPA allocate their output and compute nothing (both models call them)."""
    def linear(x, w, b=None):
        return torch.empty(*x.shape[:-1], w.shape[0], dtype=x.dtype)

    def sdpa(q, k, v, *args, **kwargs):
        return torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)

    F.linear = linear
    F.scaled_dot_product_attention = sdpa
    torch.cuda.is_current_stream_capturing = lambda: False  # a one-row step asks (the gemv routing)


def config(family: str, layers: int):
    """The small-width config: Llama-3.2-1B's head layout (head_dim 64, GQA 4:1), Phi-4-mini's
    architecture (fused q/k/v and gate/up, 3/4 of each head rotated), or another family's (the test
    suite's row of it, ``tests/families.py``, at these widths with head_dim 64 and GQA 2:1)."""
    from transformers import LlamaConfig, Phi3Config

    widths = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
                  vocab_size=512)
    if family == "phi3":
        return Phi3Config(**widths, num_key_value_heads=2, partial_rotary_factor=0.75, pad_token_id=0)
    if family == "llama":
        return LlamaConfig(**widths, num_key_value_heads=1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    import families

    del widths["num_hidden_layers"]
    return families.config(family, layers, **widths, num_key_value_heads=2, head_dim=64)


def models(layers: int, family: str = "llama"):
    """(stock, ours): equal seeded weights, bf16, eval; ours kernelized for "cuda" and patched."""
    import kernels
    import kernels.layer.repos as repos
    from kernels import LocalLayerRepository, Mode
    from transformers import AutoModelForCausalLM

    import cutile_kernels
    from cutile_kernels.layers import hub

    torch.manual_seed(0)
    # One config each: the attention patch switches its model's config to our attention, and a
    # shared config object would switch the stock model's too.
    stock = AutoModelForCausalLM.from_config(config(family, layers), dtype=torch.bfloat16).eval()
    ours = AutoModelForCausalLM.from_config(config(family, layers), dtype=torch.bfloat16).eval()
    ours.load_state_dict(stock.state_dict())
    variant = hub.variant_dir()
    if variant is None:
        sys.exit("no cuTile build found: run `cutile-kernels build` first")
    repos._find_capability = lambda: 90  # kernelize for "cuda" on this CPU
    mapping = {name: {"cuda": {Mode.INFERENCE: LocalLayerRepository(variant, layer_name=cls)}}
               for name, cls in hub._mapping_in_build(variant).items()}
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(ours, mode=Mode.INFERENCE, device="cuda", use_fallback=True)
    # kernels loaded the build's copy of the package under another name: fake its driver too
    for name, mod in list(sys.modules.items()):
        if name.endswith(".dispatch") and hasattr(mod, "_LAUNCHER") and mod is not sys.modules["cutile_kernels.dispatch"]:
            host_overhead.install_fakes(mod, sys.modules[name[: -len("dispatch")] + "launcher"])
    report = cutile_kernels.patch(ours)
    print(f"ours: {report.changed}")
    return stock, ours


def _shared_bindings(stock, ours) -> list:
    """(module, forward) for the modules both models hold (transformers' hub functions, e.g.
    ``apply_rotary_pos_emb``, are one module object per modeling module, a child of every attention
    module of every model) on which kernelize bound our forward: in one process the stock model
    would run it too. :func:`compare` takes it off for stock's forwards."""
    in_stock = {id(m) for m in stock.modules()}
    return [(m, m.__dict__["forward"]) for m in ours.modules() if id(m) in in_stock and "forward" in m.__dict__]


def compare(pair: dict, ids, rounds: int) -> dict:
    """Microseconds per forward of each model, one forward of each per round (order rotating); the
    hub functions both share run our forward in ours only (:func:`_shared_bindings`)."""
    times = {k: [] for k in pair}
    names = list(pair)
    shared = _shared_bindings(pair["stock"], pair["ours"])

    def bind(k):
        for m, fwd in shared:
            if k == "ours":
                m.__dict__["forward"] = fwd
            else:
                m.__dict__.pop("forward", None)
    with torch.inference_mode():
        for _ in range(20):
            for k, m in pair.items():
                bind(k)
                m(ids, use_cache=False)
        gc.collect()
        gc.disable()
        try:
            for r in range(rounds):
                for k in names[r % 2:] + names[:r % 2]:
                    bind(k)
                    t0 = time.perf_counter_ns()
                    pair[k](ids, use_cache=False)
                    times[k].append((time.perf_counter_ns() - t0) / 1e3)
        finally:
            gc.enable()
            bind("ours")
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="llama",
                    help="llama, phi3 (their real head layouts) or another model type of tests/families.py")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="top N functions of ours under cProfile")
    args = ap.parse_args(argv)
    host_overhead.install_fakes()
    stock, ours = models(args.layers, args.family)
    fake_gemms()
    ids = torch.randint(0, 512, (1, args.tokens))
    times = compare({"stock": stock, "ours": ours}, ids, args.rounds)
    for k, v in times.items():
        s = sorted(v)
        print(f"{k:6s} {statistics.median(s):8.0f} us per forward (p10 {s[len(s) // 10]:.0f}), {args.layers} layers")
    ratio = statistics.median(o / s for o, s in zip(times["ours"], times["stock"]))
    print(f"ours / stock, median by round: {ratio:.3f}")
    if args.profile:
        prof = cProfile.Profile()
        with torch.inference_mode():
            prof.enable()
            for _ in range(20):
                ours(ids, use_cache=False)
            prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
