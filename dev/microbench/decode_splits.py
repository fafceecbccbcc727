"""Decode attention over a static cache by the number of KV splits: what ``num_splits`` should pick.

    python dev/microbench/decode_splits.py --json decode-splits.json

For the head layouts of the presets (query heads, KV heads, head_dim), batch 1 and 16, static caches
of a few sizes with three quarters of the slots filled (the filled length read on the device, as the
decode fast path passes it), the attention kernel is launched through ``attention_into`` with each
count of ``FORCED`` and the one ``num_splits`` chooses, and timed as CUDA-graph replays (GPU
microseconds per call, the split-KV combine included). Each count's output is checked first against
float32 PyTorch attention over the filled keys, on an output poisoned with NaN.
"""

from __future__ import annotations

import argparse
import json

#: preset -> (query heads, KV heads, head_dim)
SHAPES = {"llama-3.2-1b": (32, 8, 64), "qwen3-0.6b": (16, 8, 128), "olmo-2-1b": (16, 16, 128),
          "phi-3-mini-4k": (32, 32, 96), "phi-4-mini": (24, 8, 128), "gemma-3-1b": (4, 1, 256),
          "gemma-2-2b": (8, 4, 256), "smollm3-3b": (16, 4, 128)}
SLOTS = (169, 392, 1024, 4096)
FORCED = (1, 2, 3, 4, 8, 16)


def decode_inputs(B: int, Hq: int, Hkv: int, D: int, slots: int, filled: int):
    """A bf16 decode step over a static cache on the GPU: (q (B, Hq, 1, D) as a transposed view of
    the projection, k and v (B, Hkv, slots, D), kv_len (1,) = ``filled``, scale, float32 attention
    over the filled keys (B, Hq, 1, D), an output buffer (B, 1, Hq, D))."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    k = torch.randn(B, Hkv, slots, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, Hkv, slots, D, device="cuda", dtype=torch.bfloat16, generator=g)
    n = torch.tensor([filled], device="cuda")
    scale = D ** -0.5
    kf = k[:, :, :filled].float().repeat_interleave(Hq // Hkv, 1)
    vf = v[:, :, :filled].float().repeat_interleave(Hq // Hkv, 1)
    ref = torch.softmax(q.float() @ kf.transpose(-1, -2) * scale, -1) @ vf
    out = torch.empty(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
    return q, k, v, n, scale, ref, out


def _case(shape, B, slots):
    import importlib

    import torch

    from cutile_kernels_tools.timing import graph_us

    ops = importlib.import_module("cutile_kernels.ops.attention")  # the module; ops.attention is the op
    Hq, Hkv, D = SHAPES[shape]
    filled = slots * 3 // 4
    q, k, v, n, scale, ref, out = decode_inputs(B, Hq, Hkv, D, slots, filled)
    auto = ops.launches(q, k, v, None, out, scale, True, kv_len=n)
    auto_splits = auto[0][2][-1]  # the launch's last scalar
    row = {"shape": shape, "B": B, "slots": slots, "filled": filled, "auto_splits": auto_splits, "us": {}}
    for splits in sorted(set(FORCED) | {auto_splits}):
        out.fill_(float("nan"))
        if not ops.attention_into(q, k, v, None, out, scale, True, splits=splits, kv_len=n):
            raise RuntimeError(f"{shape} B={B} slots={slots} splits={splits}: no kernel took the call")
        got = out.transpose(1, 2).float()
        rel = ((got - ref).norm() / ref.norm()).item()
        if not (torch.isfinite(got).all() and rel < 1e-2):
            raise RuntimeError(f"{shape} B={B} slots={slots} splits={splits}: rel {rel:.3g} to float32")
        row["us"][splits] = round(graph_us(
            lambda s=splits: ops.attention_into(q, k, v, None, out, scale, True, splits=s, kv_len=n), reps=11), 2)
    row["best"] = min(row["us"], key=row["us"].get)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    rows = [_case(s, B, slots) for s in args.shapes for B in (1, 16) for slots in SLOTS]
    print("| shape | B | slots (filled) | auto splits (us) | " + " | ".join(f"{s} split(s) us" for s in FORCED)
          + " | best |")
    print("|---|---|---|---|" + "---|" * len(FORCED) + "---|")
    for r in rows:
        cells = " | ".join(f"{r['us'][s]:.2f}" for s in FORCED)
        auto = r["auto_splits"]
        print(f"| {r['shape']} | {r['B']} | {r['slots']} ({r['filled']}) | {auto} ({r['us'][auto]:.2f}) | {cells} | "
              f"{r['best']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
