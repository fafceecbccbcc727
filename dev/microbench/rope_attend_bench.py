"""A decode step's RoPE + KV cache write + attention: one ``rope_append_attention`` launch against
``rope_append`` then ``attention`` (the two launches it replaces), as CUDA-graph replays.

    python dev/microbench/rope_attend_bench.py [--kernels rope_append_attention other_name ...]

For Llama-3.2-1B's head layout (32 query heads over 8 KV heads, head_dim 64) at batch 1 and 16 over
a static cache of 272 slots with 150 filled, and the layouts of the other full-rotary presets at
batch 1, each launch form is first checked against the two launches (outputs within 2e-2, the
written slot equal), then timed (GPU microseconds per call, 10 calls a graph, median of 20
replays; the forms alternate round by round). ``--kernels`` names build variants of the one launch
to time (a kernel name of the manifest whose variants take the same arguments).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics

import torch

#: name -> (query heads, KV heads, head_dim)
LAYOUTS = {"llama-3.2-1b": (32, 8, 64), "mistral-7b": (32, 8, 128), "olmo-2-1b": (16, 16, 128)}


def _inputs(B, Hq, Hkv, D, slots=272, filled=150):
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(B, 1, (Hq + 2 * Hkv) * D, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = (t.view(B, 1, -1, D).transpose(1, 2) for t in qkv.split((Hq * D, Hkv * D, Hkv * D), -1))
    pos = torch.full((B, 1, 1), float(filled), device="cuda")
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, device="cuda").float() / D)
    ang = torch.cat([pos * inv, pos * inv], -1)
    keys = torch.randn(B, Hkv, slots, D, device="cuda", dtype=torch.bfloat16, generator=g)
    values = torch.randn(B, Hkv, slots, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, ang.cos().bfloat16(), ang.sin().bfloat16(), keys, values, torch.tensor(filled, device="cuda")


def main(argv=None) -> None:
    from cutile_kernels_tools.timing import graph_us

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", nargs="*", default=["rope_append_attention"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    ops = importlib.import_module("cutile_kernels.ops.attention")
    rope = importlib.import_module("cutile_kernels.ops.rope")
    rows = []
    cases = [("llama-3.2-1b", 1), ("llama-3.2-1b", 16)] + [(n, 1) for n in LAYOUTS if n != "llama-3.2-1b"]
    for name, B in cases:
        Hq, Hkv, D = LAYOUTS[name]
        q, k, v, cos, sin, keys, values, n = _inputs(B, Hq, Hkv, D)
        n1 = n.view(1) + 1

        def two():
            q_rot = rope.rope_append(q, k, v, cos, sin, keys, values, n)
            return ops.attention(q_rot, keys, values, None, kv_len=n1)

        def one(kernel):
            def run():
                ops.ROPE_APPEND_KERNEL = kernel
                return ops.rope_append_attention(q, k, v, cos, sin, keys, values, n)
            return run

        forms = {"two launches": two, **{kname: one(kname) for kname in args.kernels}}
        want = two()
        want_slot = keys[:, :, int(n)].clone()
        for fname, fn in forms.items():
            if fname == "two launches":
                continue
            keys[:, :, int(n)] = 0
            got = fn()
            err = (got.float() - want.float()).abs().max().item()
            assert err < 2e-2 and torch.equal(keys[:, :, int(n)], want_slot), (name, B, fname, err)
        times = {f: [] for f in forms}
        for _ in range(args.rounds):
            for fname, fn in forms.items():
                times[fname].append(graph_us(fn))
        row = {"layout": name, "batch": B, **{f: round(statistics.median(t), 2) for f, t in times.items()}}
        ops.ROPE_APPEND_KERNEL = "rope_append_attention"
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
