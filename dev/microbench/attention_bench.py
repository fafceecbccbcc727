"""Attention microbenchmark on a GPU: the ``"cutile"`` attention function against transformers' sdpa one.

    python dev/microbench/attention_bench.py --json attention-bench.json

Shapes of Llama-3.2-1B (32 query / 8 KV heads, head_dim 64) and Qwen3-0.6B (16 / 8, 128), bf16.
Both sides are timed as a model calls them, through transformers' attention-function signature
(``cutile_kernel_attention_forward``, the kernel on every call, vs ``sdpa_attention_forward``; the
``"cutile"`` column of the JSON is the kernel, ``route`` says which of the two ``"cutile"`` runs
under the default patches (``masked_prefill_attention`` included):
q a transposed projection, K/V cache
tensors, output the contiguous (B, S, H, D) tensor), plus torch SDPA's best case for prefill
(``is_causal=True, enable_gqa=True``: cuDNN / flash):

* ``prefill``: 1 x 2048 causal, no mask; and 4 x 1024 left-padded (boolean mask: sdpa then
  repeats K/V to the query heads and runs its masked kernel);
* ``decode-dynamic``: b = 1 and 16, one query over KV 128 .. 4096, no mask (DynamicCache);
* ``decode-padded``: the same with left padding (a boolean mask: a padded batch's eager decode);
* ``decode-static``: the same over a 4096-slot static cache, the unfilled slots masked (what
  ``generate(cache_implementation="static")`` passes); ours with the filled length on the device
  (``cutile_kv_len``, as our reproduced attention forwards pass it) and with the mask alone.

Each case is checked first (strict mode, so no fallback) against the sdpa output. Numbers are
medians of CUDA-event measurements over back-to-back calls (``us``: host + GPU per call, as a
model makes it) and over CUDA-graph replays (``graph_us``: GPU time). ``TFLOPs`` counts the
visible (query, key) pairs x 4 x head_dim; ``GBps`` the K and V bytes a decode step must read.
"""

from __future__ import annotations

import argparse
import json
import os
import types

from cutile_kernels_tools.timing import events_us, graph_us

SHAPES = {"llama-3.2-1b": (32, 8, 64), "qwen3-0.6b": (16, 8, 128)}
#: Masked prefills only (``--prefill``): Gemma-3-1B's layout, whose sliding layers pass a mask.
PREFILL_SHAPES = {**SHAPES, "gemma-3-1b": (4, 1, 256)}
KV_LENGTHS = (128, 256, 512, 1024, 2048, 4096)
STATIC_SLOTS = 4096






def _inputs(B, Hq, Hkv, D, Sq, Skv, device="cuda"):
    import torch

    q = torch.randn(B, Sq, Hq, D, device=device, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, Hkv, Skv, D, device=device, dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, Skv, D, device=device, dtype=torch.bfloat16)
    return q, k, v


def _mask(B, Sq, Skv, q_offset, seen, pads, window=None):
    """sdpa_mask's boolean mask: ``seen`` tokens of which the first ``pads[b]`` are padding; with
    ``window`` a sliding window's (transformers' ``sliding_window_causal_mask_function``)."""
    import torch
    from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function

    pad = torch.ones(B, seen, dtype=torch.bool, device="cuda")
    for b, p in enumerate(pads):
        pad[b, :p] = False
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    return sdpa_mask(batch_size=B, q_length=Sq, kv_length=Skv, q_offset=q_offset, mask_function=fn,
                     attention_mask=pad, allow_is_causal_skip=False, device="cuda")


def _case(name, shape, B, Sq, Skv, mask, pairs, kv_bytes, filled=None):
    import torch
    import torch.nn.functional as F
    from cutile_kernels.layers.attention import cutile_kernel_attention_forward, route
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    Hq, Hkv, D = PREFILL_SHAPES[shape]
    q, k, v = _inputs(B, Hq, Hkv, D, Sq, Skv)
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=Hq // Hkv, training=False)
    scale = D ** -0.5
    # A static cache: our reproduced forwards pass its filled length (cutile_kv_len); the mask alone
    # is what transformers' own forwards give us (cutile-mask-only).
    length = {} if filled is None else {"cutile_kv_len": torch.tensor(filled, device="cuda")}
    paths = {
        "cutile": lambda: cutile_kernel_attention_forward(module, q, k, v, mask, scaling=scale, **length),
        "sdpa": lambda: sdpa_attention_forward(module, q, k, v, mask, scaling=scale),
    }
    if filled is not None:
        paths["cutile-mask-only"] = lambda: cutile_kernel_attention_forward(module, q, k, v, mask, scaling=scale)
    if mask is None and Sq == Skv:
        paths["torch-sdpa-causal-gqa"] = lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    ours, stock = paths["cutile"]()[0].float(), paths["sdpa"]()[0].float()
    rows = torch.ones(B, Sq, dtype=torch.bool, device="cuda") if mask is None else mask.any(-1)[:, 0].expand(B, Sq)
    rel = ((ours[rows] - stock[rows]).norm() / stock[rows].norm()).item()
    assert rel < 2e-2, f"{name} {shape}: cutile differs from sdpa by {rel:.3g}"
    row = {"case": name, "shape": shape, "B": B, "Sq": Sq, "Skv": Skv, "filled": filled, "masked": mask is not None,
           "rel_diff_vs_sdpa": rel,
           "route": "kernel" if route(q, mask, None, length.get("cutile_kv_len"), masked_prefill=True) else "sdpa"}
    for path, fn in paths.items():
        us = events_us(fn, reps=11, inner=10, warmup=0)
        gus = graph_us(fn, reps=11)
        row[path] = {"us": round(us, 2), "graph_us": round(gus, 2),
                     "TFLOPs": round(4 * pairs * Hq * D / (gus * 1e-6) / 1e12, 2),
                     "GBps": round(kv_bytes(Hkv, D) / (gus * 1e-6) / 1e9, 1)}
    row["speedup_graph"] = round(row["sdpa"]["graph_us"] / row["cutile"]["graph_us"], 3)
    return row


def run():
    cases = []
    for shape in SHAPES:
        cases.append(_case("prefill-1x2048", shape, 1, 2048, 2048, None, 2048 * 2049 // 2,
                           lambda hkv, d: 0))
        pads = [0, 100, 400, 900]
        mask = _mask(4, 1024, 1024, 0, 1024, pads)
        cases.append(_case("prefill-4x1024-padded", shape, 4, 1024, 1024, mask,
                           sum((1024 - p) * (1024 - p + 1) // 2 for p in pads), lambda hkv, d: 0))
        for B in (1, 16):
            for kv in KV_LENGTHS:
                cases.append(_case(f"decode-dynamic-b{B}", shape, B, 1, kv, None, B * kv,
                                   lambda hkv, d, B=B, kv=kv: 2 * B * hkv * kv * d * 2))
                pads = [(b % 4) * kv // 16 for b in range(B)] if B > 1 else [kv // 16]
                cases.append(_case(f"decode-padded-b{B}", shape, B, 1, kv, _mask(B, 1, kv, kv - 1, kv, pads),
                                   B * kv - sum(pads), lambda hkv, d, B=B, kv=kv: 2 * B * hkv * kv * d * 2))
                mask = _mask(B, 1, STATIC_SLOTS, kv - 1, kv, [0] * B)
                cases.append(_case(f"decode-static-b{B}", shape, B, 1, STATIC_SLOTS, mask, B * kv,
                                   lambda hkv, d, B=B, kv=kv: 2 * B * hkv * kv * d * 2, filled=kv))
    return cases


def run_prefill():
    """Prefills with a boolean mask, where the kernel classifies the mask's tiles first: a causal
    mask passed as such (a full-attention layer given one), a sliding window of 512 (Gemma 3's
    local layers) and left padding, against sdpa with the same mask."""
    cases = []
    for shape in PREFILL_SHAPES:
        for S in (512, 2048):
            full = lambda B, S, p: sum((S - x) * (S - x + 1) // 2 for x in p)  # noqa: E731
            cases.append(_case(f"prefill-1x{S}-causal-mask", shape, 1, S, S, _mask(1, S, S, 0, S, [0]),
                               full(1, S, [0]), lambda hkv, d: 0))
            win = sum(min(i + 1, 512) for i in range(S))
            cases.append(_case(f"prefill-1x{S}-window512", shape, 1, S, S, _mask(1, S, S, 0, S, [0], window=512),
                               win, lambda hkv, d: 0))
        pads = [0, 100, 400, 900]
        cases.append(_case("prefill-4x1024-padded", shape, 4, 1024, 1024, _mask(4, 1024, 1024, 0, 1024, pads),
                           sum((1024 - p) * (1024 - p + 1) // 2 for p in pads), lambda hkv, d: 0))
    return cases


def _table(cases):
    lines = ["| case | shape | KV (filled) | cutile us (graph) | sdpa us (graph) | speedup | cutile TFLOP/s | cutile GB/s | "
             "torch causal GQA us | cutile mask only, graph us | \"cutile\" runs |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        best = c.get("torch-sdpa-causal-gqa", {}).get("graph_us", "")
        mask_only = c.get("cutile-mask-only", {}).get("graph_us", "")
        lines.append(f"| {c['case']} | {c['shape']} | {c['Skv']} ({c.get('filled') or c['Skv']}) | "
                     f"{c['cutile']['us']} ({c['cutile']['graph_us']}) | "
                     f"{c['sdpa']['us']} ({c['sdpa']['graph_us']}) | {c['speedup_graph']} | "
                     f"{c['cutile']['TFLOPs']} | {c['cutile']['GBps']} | {best} | {mask_only} | {c['route']} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--prefill", action="store_true", help="masked prefills only (run_prefill)")
    args = parser.parse_args()
    os.environ["CUTILE_KERNELS_STRICT"] = "1"
    import cutile_kernels
    import torch

    torch.manual_seed(0)
    cases = run_prefill() if args.prefill else run()
    stats = cutile_kernels.stats()
    print(_table(cases))
    print("launches:", json.dumps(stats["launches"], indent=None)[:2000])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cases": cases,
                       "stats": stats}, f, indent=1)


if __name__ == "__main__":
    main()
