"""SiLU-and-mul and the fused SwiGLU MLP against the stock path, on the H200.

    python dev/microbench/swiglu_bench.py [--json out.json]

For Llama-3.2-1B (H 2048, I 8192) and Qwen3-0.6B (H 1024, I 3072), bf16, at M = 1, 2, 4, 8, 16
(decode) and 2048 (prefill) rows:

* activation: stock ``F.silu(g) * u`` on two GEMM outputs (what ``LlamaMLP`` runs), ours on the
  two halves of one fused GEMM output (``silu_and_mul_fused``) and on two separate tensors, and
  each tile config of the build forced at every M (it chose the one config kept); and SiLU alone (the
  ``SiLU`` hub layer) against ``F.silu``;
* MLP: stock ``LlamaMLP`` against the same module after ``fuse_mlp`` (one cuBLAS GEMM on
  [gate; up], our activation, down), and the fused GEMM with torch's silu * mul (isolates the
  GEMM fusion).

Times are medians of CUDA-event measurements: ``graph_us`` is device time per call (10 calls
captured in one CUDA graph, 30 replays), ``eager_us`` is per call of 200 back-to-back eager calls
(includes host launch cost where the host is the bottleneck). Two input sets alternate so that a
repeat does not find its inputs in L2. Bandwidth counts what each path must move: ours reads g
and u and writes the output (3 M I elements); stock's silu reads g, writes s, its mul reads s and
u and writes the output (5 M I elements).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cutile_kernels_tools.timing import events_us, graph_us

SIZES = {"llama-3.2-1b": (2048, 8192), "qwen3-0.6b": (1024, 3072)}
ROWS = (1, 2, 4, 8, 16, 2048)






def _alternate(fns):
    state = {"i": 0}

    def call():
        state["i"] ^= 1
        return fns[state["i"]]()

    return call


def _row(kind, model, m, path, fn, nbytes=None, **extra):
    graph = graph_us(fn, reps=30)
    eager = events_us(fn)
    row = {"kind": kind, "model": model, "M": m, "path": path, "graph_us": round(graph, 2),
           "eager_us": round(eager, 2), **extra}
    if nbytes:
        row["bytes"] = nbytes
        row["GBps"] = round(nbytes / graph / 1e3, 1)
    print(json.dumps(row), flush=True)
    return row


def activation_rows(model, inter, m):
    import cutile_kernels
    import torch
    import torch.nn.functional as F
    from cutile_kernels import dispatch
    from cutile_kernels.kernel_src.activation import TILES
    from cutile_kernels.ops import activation as ops

    esize = 2
    sets = []
    for _ in range(2):
        gu = torch.randn(m, 2 * inter, device="cuda", dtype=torch.bfloat16)
        sets.append({"gu": gu, "g": gu[:, :inter].contiguous(), "u": gu[:, inter:].contiguous(),
                     "out": torch.empty(m, inter, device="cuda", dtype=torch.bfloat16)})
    ours_bytes, stock_bytes = 3 * m * inter * esize, 5 * m * inter * esize
    rows = [
        _row("activation", model, m, "stock F.silu(g)*u",
             _alternate([lambda s=s: F.silu(s["g"]) * s["u"] for s in sets]), stock_bytes),
        _row("activation", model, m, "stock on fused halves",
             _alternate([lambda s=s: F.silu(s["gu"][:, :inter]) * s["gu"][:, inter:] for s in sets]), stock_bytes),
        _row("activation", model, m, "ours silu_and_mul_fused",
             _alternate([lambda s=s: cutile_kernels.silu_and_mul_fused(s["gu"]) for s in sets]), ours_bytes),
        _row("activation", model, m, "ours silu_and_mul (separate)",
             _alternate([lambda s=s: cutile_kernels.silu_and_mul(s["g"], s["u"]) for s in sets]), ours_bytes),
    ]
    silu_bytes = 2 * m * inter * esize  # the "SiLU" hub layer alone: read g, write silu(g)
    rows += [_row("silu", model, m, "stock F.silu(g)", _alternate([lambda s=s: F.silu(s["g"]) for s in sets]),
                  silu_bytes),
             _row("silu", model, m, "ours silu", _alternate([lambda s=s: cutile_kernels.silu(s["g"]) for s in sets]),
                  silu_bytes)]
    for name, (r, b) in TILES.items():
        want = (("ROWS", r), ("BLOCK", b))

        def launch(s, want=want):
            x = s["gu"].unflatten(-1, (2, inter))
            assert dispatch.run("silu_and_mul_fused", want, (x, s["out"]), 1, ops._grid(m, inter))

        rows.append(_row("activation", model, m, f"ours fused, {name} config r{r}.b{b}",
                         _alternate([lambda s=s: launch(s) for s in sets]), ours_bytes))
    return rows


def _cuda_mlp(hidden, inter):
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    with torch.device("cuda"):
        return LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=inter)).to(torch.bfloat16).eval()


def mlp_rows(model, hidden, inter, m):
    import copy

    import torch
    import torch.nn.functional as F
    from cutile_kernels.layers.mlp import fuse_mlp

    torch.manual_seed(0)
    stock = _cuda_mlp(hidden, inter)
    fused = copy.deepcopy(stock)
    assert fuse_mlp(fused) == 1
    xs = [torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    w = fused.gate_up_proj.weight

    def fused_gemm_torch_act(x):
        gu = F.linear(x, w)
        return fused.down_proj(F.silu(gu[:, :inter]) * gu[:, inter:])

    weight_bytes = 3 * hidden * inter * 2
    rows = []
    with torch.no_grad():
        for path, f in [("stock LlamaMLP", stock), ("fused GEMM + torch silu*mul", fused_gemm_torch_act),
                        ("fuse_mlp (fused GEMM + ours)", fused)]:
            rows.append(_row("mlp", model, m, path, _alternate([lambda x=x, f=f: f(x) for x in xs]), weight_bytes,
                             note="bytes = the three weights once (the decode roofline)"))
    return rows


def main(argv=None) -> int:
    import cutile_kernels
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    print(json.dumps({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                      "build": str(cutile_kernels.registry.find_package_dir())}), flush=True)
    rows = []
    for model, (hidden, inter) in SIZES.items():
        for m in ROWS:
            rows += activation_rows(model, inter, m)
            rows += mlp_rows(model, hidden, inter, m)
    stats = cutile_kernels.stats()
    print(json.dumps({"fallbacks": stats["fallbacks"], "jit_launches": stats["jit_launches"]}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
