"""RoPE and fused residual-add + RMSNorm microbenchmark on a GPU (a microbenchmark can reject, never accept).

    python dev/microbench/rope_bench.py --json rope-bench.json

For the Llama-3.2-1B (32/8 heads, head_dim 64, hidden 2048) and Qwen3-0.6B (16/8, 128, hidden
1024) shapes at prefill 1x2048 and decode b=1 / b=16, times

* RoPE: ``cutile_kernels.apply_rope`` (one cuTile launch for q and k) against transformers'
  ``apply_rotary_pos_emb`` (Llama's, v5.22.2: 10 torch kernels), on q/k laid out as transformers
  passes them (transposed (B, S, H, D) projections) and cos/sin from ``LlamaRotaryEmbedding``;
* add + norm: ``cutile_kernels.add_rms_norm`` against the decoder layer's ``residual + h``
  followed by ``LlamaRMSNorm`` (what the ``decoder_add_rms_norm`` patch replaces).

Before timing, each cuTile call is checked (strict mode: no fallback) against the stock result:
RoPE must be bit-identical, add + norm within 2 bf16 ulps of the stock norm.

Two numbers per case, both medians of CUDA-event measurements:

* ``eager_us``: one call as a model makes it (host dispatch + launch + GPU), timed over a loop of
  back-to-back calls;
* ``graph_us``: GPU time alone, from replays of a CUDA graph holding the calls.

Inputs rotate through enough sets to exceed the 50 MB L2 for prefill; ``GBps`` counts the bytes that
must move (inputs read once, outputs written once).
"""

from __future__ import annotations

import argparse
import json
import os

from cutile_kernels_tools.timing import events_us, graph_us

SHAPES = {"llama-3.2-1b": dict(hq=32, hkv=8, d=64, hidden=2048), "qwen3-0.6b": dict(hq=16, hkv=8, d=128, hidden=1024)}
REGIMES = {"prefill-1x2048": (1, 2048), "decode-b1": (1, 1), "decode-b16": (16, 1)}






class _Rotating:
    """Calls ``fn(*inputs[i])`` cycling through input sets (so repeated calls do not hit L2)."""

    def __init__(self, fn, sets):
        self.fn, self.sets, self.i = fn, sets, 0

    def __call__(self):
        self.i = (self.i + 1) % len(self.sets)
        return self.fn(*self.sets[self.i])


def _n_sets(nbytes: int) -> int:
    return max(2, min(16, -(-120_000_000 // max(nbytes, 1))))


def rope_cases(reps: int, inner: int) -> list[dict]:
    import cutile_kernels
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama

    stock = modeling_llama.apply_rotary_pos_emb
    stock.__dict__.pop("forward", None)  # the stock function, even if something kernelized it
    rows = []
    for model, sh in SHAPES.items():
        cfg = LlamaConfig(hidden_size=sh["hq"] * sh["d"], num_attention_heads=sh["hq"], num_key_value_heads=sh["hkv"],
                          head_dim=sh["d"], rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
        emb = modeling_llama.LlamaRotaryEmbedding(cfg).to("cuda")
        for regime, (b, s) in REGIMES.items():
            nbytes = 2 * 2 * b * s * (sh["hq"] + sh["hkv"]) * sh["d"] + 2 * 2 * b * s * sh["d"]
            sets = []
            for i in range(_n_sets(nbytes)):
                q = torch.randn(b, s, sh["hq"], sh["d"], device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                k = torch.randn(b, s, sh["hkv"], sh["d"], device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                pos = torch.arange(s, device="cuda")[None].expand(b, s) + 100 * i
                cos, sin = emb(q, pos)
                sets.append((q, k, cos, sin))
            got, want = cutile_kernels.apply_rope(*sets[0]), stock(*sets[0])
            exact = all(torch.equal(g, w) and g.stride() == w.stride() for g, w in zip(got, want))
            for impl, fn in (("cutile", cutile_kernels.apply_rope), ("transformers", stock)):
                call = _Rotating(fn, sets)
                eager = events_us(call, reps, inner, warmup=0)
                graph = graph_us(call, reps, inner)
                row = {"op": "rope", "model": model, "regime": regime, "impl": impl, "bit_identical": exact,
                       "eager_us": round(eager, 2), "graph_us": round(graph, 2), "bytes": nbytes,
                       "GBps": round(nbytes / graph / 1e3, 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def add_norm_cases(reps: int, inner: int) -> list[dict]:
    import cutile_kernels
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    rows = []
    for model, sh in SHAPES.items():
        n = sh["hidden"]
        norm = LlamaRMSNorm(n, eps=1e-5).to("cuda", torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(n))

        def stock(h, r):
            s = r + h
            return norm(s), s

        def ours(h, r):
            return cutile_kernels.add_rms_norm(h, r, norm.weight, norm.variance_epsilon)

        for regime, (b, s) in REGIMES.items():
            nbytes = 2 * (4 * b * s * n + n)
            sets = [(torch.randn(b, s, n, device="cuda", dtype=torch.bfloat16),
                     torch.randn(b, s, n, device="cuda", dtype=torch.bfloat16)) for _ in range(_n_sets(nbytes))]
            with torch.no_grad():
                (y, s_out), (y_ref, s_ref) = ours(*sets[0]), stock(*sets[0])
            ulps = ((y.float() - y_ref.float()).abs() / (y_ref.float().abs() * 2.0**-8).clamp(min=1e-30)).max().item()
            for impl, fn in (("cutile", ours), ("transformers", stock)):
                call = _Rotating(fn, sets)
                with torch.no_grad():
                    eager = events_us(call, reps, inner, warmup=0)
                    graph = graph_us(call, reps, inner)
                row = {"op": "add_rms_norm", "model": model, "regime": regime, "impl": impl,
                       "sum_identical": bool(torch.equal(s_out, s_ref)), "max_ulps_vs_stock": round(ulps, 2),
                       "eager_us": round(eager, 2), "graph_us": round(graph, 2), "bytes": nbytes,
                       "GBps": round(nbytes / graph / 1e3, 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--inner", type=int, default=20)
    args = ap.parse_args(argv)
    os.environ["CUTILE_KERNELS_STRICT"] = "1"  # a fallback is an error here, not a slow number
    import torch

    torch.manual_seed(0)
    with torch.no_grad():
        rows = rope_cases(args.reps, args.inner) + add_norm_cases(args.reps, args.inner)
    summary = {}
    for r in rows:
        summary.setdefault((r["op"], r["model"], r["regime"]), {})[r["impl"]] = r
    print("\nspeedup of cutile over transformers (eager / graph):")
    for (op, model, regime), by in summary.items():
        c, t = by["cutile"], by["transformers"]
        print(f"  {op:12s} {model:13s} {regime:15s} {t['eager_us'] / c['eager_us']:5.2f}x / "
              f"{t['graph_us'] / c['graph_us']:5.2f}x   ({c['eager_us']} / {c['graph_us']} us vs "
              f"{t['eager_us']} / {t['graph_us']} us)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
