"""Decode attention for one query row per head without a tensor-core tile (MHA): a candidate sweep.

    python -m dev.sweeps.decode_rows_sweep export --out /tmp/sweep-rows   # CPU: compile the candidates (sm_90)
    python -m dev.sweeps.decode_rows_sweep run --dir /tmp/sweep-rows --json out.json   # GPU: check, then time

Why: in OLMo-3-7B's decode fast path at batch 16 (H100, 2026-12-05) the shipped decode attention took
55 us a layer against cuDNN's 28 in stock-compile's step, though cuDNN reads every slot of the static
cache and ours only the filled ones. OLMo 3 is MHA (32 KV heads of 128): the shipped tile packs the
query heads of one KV group into 16 MMA rows, and with a group of one a decode step fills one row of
16; the block walks its KV tiles with a transposed K load and two MMAs per tile for that one row.

Estimate before (Amdahl): attention is f = 0.23 of the batch-16 step (1759 of 7617 us); at s ~2 (near
cuDNN's time for fewer bytes) the step's ceiling is ~1.13x, which would put the fast path ahead of
stock-compile at b=16 (now 0.98-1.02x).

The candidate (``attention_rows_kernel``, same arguments as ``kernel_src.attention.attention_kernel``
and the same math for one query per head with Hq == Hkv): a block takes ``HB`` heads of one batch
row, loads each KV tile in its natural (BN, D) layout for all of them, and computes the scores and the
weighted values with float32 multiplies and reductions (no MMA, no transposed load). Split-KV writes
the shipped combine kernel's inputs. ``W`` worker warps (4 or 8).

Outcome (2026-12-05, benchmarks/results/h100-2026-12-05f, docs/results.md): **rejected**; the
criterion was near the 2x the estimate needed. Batch 1 a tie (OLMo-3-7B's layout over 150 of 169
slots: 7.86 us for the best, 7.61 shipped, H100); batch 16, one copy of the cache (H100, L2-warm),
ahead by 1.04-1.11x (OLMo-3-7B 27.4 / 33.8 / 71.3 against 30.4 / 37.4 / 74.4 over 150/169, 200/272,
700/1024); six copies (H200, L2-cold) 31.6 against 33.9 over 200 of 272 but 68.7 against 65.5 over 700
of 1024; splits lost throughout. The 55 us a layer of the model's profile is not the tile: the same
shipped launch takes 37.4 us (H100, one copy) and 33.9 us (H200, six) over 200 of 272 slots, even with
SDPA over the masked slots. A first run also tried the shipped kernel with ``occupancy=2``: the run
timed out where its first launch came (inferred from the log), so it is not a candidate here.

``run`` ($ROWS_SWEEP_SHAPES, $ROWS_SWEEP_B, $ROWS_SWEEP_TAGS, $ROWS_SWEEP_LENGTHS as filled/slots pairs,
$ROWS_SWEEP_SPLITS and $ROWS_SWEEP_COPIES, the copies of the cache each call cycles through, pick
presets, batches, candidates, lengths, splits and the working set) builds, for the MHA presets' head
layouts, a bf16 static cache with ``filled`` of its ``slots`` written (the length read on the device),
poisons the output with NaN, checks each candidate against float32 attention over the filled keys
(relative L2 < 1e-2), and times it as CUDA-graph replays, beside
the shipped tile (the router's choice) and torch's SDPA as stock calls it on a static cache (every
slot, a boolean mask) and on the filled keys only.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import cuda.tile as ct

from cutile_kernels.kernel_src.attention import LOG2E, NEG_INF, ZERO, _kv_length, _kv_tile_range

from dev.sweeps._common import checked_timing, cycling, main, write_rows


@ct.kernel
def attention_rows_kernel(q, k, v, mask, kv_len, o, part, lse, scale: float, softcap: float, window: int,
                          has_mask: int, has_len: int, causal: int, num_splits: int,
                          D: ct.Constant[int], HB: ct.Constant[int], BN: ct.Constant[int]):
    """One query row of ``HB`` heads (each its own KV head, Hq == Hkv) of one batch row[, one KV
    split]: q (B, Hq, 1, head_dim), the rest as attention_kernel's. Grid: (num_splits, B * Hq // HB)."""
    split = ct.bid(0)
    nhb = q.shape[1] // HB
    b = ct.bid(1) // nhb
    hb = ct.bid(1) % nhb
    skv = _kv_length(k, kv_len, has_len)
    j_lo, j_hi = _kv_tile_range(0, 1, skv, causal, window, 1, BN)
    if num_splits > 1:
        per = ct.cdiv(j_hi - j_lo, num_splits)
        j_lo = ct.minimum(j_lo + split * per, j_hi)
        j_hi = ct.minimum(j_lo + per, j_hi)
    qt = ct.reshape(ct.load(q, index=(b, hb, 0, 0), shape=(1, HB, 1, D), padding_mode=ZERO), (HB, 1, D))
    qt = qt.astype(ct.float32)
    pos = skv - 1  # the query's absolute position: causal leaves every key below skv visible
    cols = ct.reshape(ct.arange(BN, dtype=ct.int32), (1, BN))
    mb = b % mask.shape[0]
    qk_scale = scale * LOG2E
    m_i = ct.full((HB, 1), NEG_INF, dtype=ct.float32)
    l_i = ct.full((HB, 1), 0.0, dtype=ct.float32)
    acc = ct.full((HB, D), 0.0, dtype=ct.float32)
    for j in range(j_lo, j_hi):
        kt = ct.reshape(ct.load(k, index=(b, hb, j, 0), shape=(1, HB, BN, D), padding_mode=ZERO), (HB, BN, D))
        vt = ct.reshape(ct.load(v, index=(b, hb, j, 0), shape=(1, HB, BN, D), padding_mode=ZERO), (HB, BN, D))
        s = ct.sum(kt.astype(ct.float32) * qt, axis=2)  # (HB, BN)
        if softcap > 0.0:
            s = ct.tanh(s * (scale / softcap)) * (softcap * LOG2E)
        else:
            s = s * qk_scale
        kidx = j * BN + cols
        valid = kidx < skv
        if window > 0:
            valid = valid & (kidx > pos - window)
        if has_mask != 0:
            mt = ct.reshape(ct.load(mask, index=(mb, 0, j), shape=(1, 1, BN), padding_mode=ZERO), (1, BN))
            valid = valid & (mt != 0)
        s = ct.where(ct.broadcast_to(valid, (HB, BN)), s, NEG_INF)
        m_new = ct.maximum(m_i, ct.max(s, axis=1, keepdims=True))
        m_use = ct.where(m_new == NEG_INF, 0.0, m_new)
        p = ct.exp2(s - m_use)
        alpha = ct.exp2(m_i - m_use)
        l_i = l_i * alpha + ct.sum(p, axis=1, keepdims=True)
        vf = vt.astype(ct.float32)
        if has_len != 0:  # unfilled slots may hold anything: 0 * NaN is not 0
            vf = ct.where(ct.reshape(kidx, (1, BN, 1)) < skv, vf, 0.0)
        acc = acc * alpha + ct.sum(ct.reshape(p, (HB, BN, 1)) * vf, axis=1)
        m_i = m_new
    out = acc / ct.where(l_i == 0.0, 1.0, l_i)
    if num_splits > 1:
        lse_rows = ct.where(l_i == 0.0, NEG_INF, m_i + ct.log2(ct.where(l_i == 0.0, 1.0, l_i)))
        bh = b * nhb + hb
        ct.store(part, index=(split, bh, 0, 0), tile=ct.reshape(out, (1, HB, 1, D)))
        ct.store(lse, index=(split, bh, 0), tile=ct.reshape(lse_rows, (1, HB, 1)))
    else:
        ct.store(o, index=(b, hb, 0, 0), tile=ct.reshape(out.astype(o.dtype), (1, HB, 1, D)))


attention_rows_w8_kernel = attention_rows_kernel.replace_hints(num_worker_warps=8)

#: preset -> (query heads, KV heads, head_dim): the MHA presets
SHAPES = {"olmo-3-7b": (32, 32, 128), "olmo-2-1b": (16, 16, 128), "phi-3-mini-4k": (32, 32, 96)}
#: (filled, slots) of the static cache
LENGTHS = ((150, 169), (200, 272), (700, 1024), (3000, 4096))
HBS = (1, 2, 4)
BNS = (32, 64, 128)
SPLITS = tuple(int(x) for x in os.environ.get("ROWS_SWEEP_SPLITS", "1,2,4").split(","))


def candidates():
    from cutile_kernels.kernel_src import attention
    from cutile_kernels.kernel_src._spec import VariantSpec

    mod = "dev.sweeps.decode_rows_sweep"
    out = []
    for hb in HBS:
        for bn in BNS:
            for fn, label in (("attention_rows_kernel", "w4"), ("attention_rows_w8_kernel", "w8")):
                consts = {"D": 128, "HB": hb, "BN": bn}
                out.append(VariantSpec("attention", mod, fn, f"bf16.d128.rows.h{hb}.n{bn}.{label}",
                                       attention._attention_params("bfloat16", consts)))
    return out


def run(sweep_dir: str, json_out: str | None) -> None:
    import torch
    import torch.nn.functional as F
    from cutile_kernels import dispatch, registry
    from cutile_kernels.launcher import Launcher

    from dev.microbench.decode_splits import decode_inputs
    ops = importlib.import_module("cutile_kernels.ops.attention")  # the module; ops.attention is the op

    reg = registry.Registry(registry.package_dir_of(Path(sweep_dir)))
    launcher = Launcher()
    variants = list(reg.variants("attention", "sm_90"))
    rows = []

    def timed(row, call, out, ref):
        checked_timing(call, row, rows, out, ref)

    shapes = os.environ.get("ROWS_SWEEP_SHAPES", ",".join(SHAPES)).split(",")
    batches = [int(b) for b in os.environ.get("ROWS_SWEEP_B", "1,16").split(",")]
    copies = int(os.environ.get("ROWS_SWEEP_COPIES", "1"))
    lengths = [tuple(int(x) for x in fs.split("/")) for fs in os.environ["ROWS_SWEEP_LENGTHS"].split(",")] \
        if os.environ.get("ROWS_SWEEP_LENGTHS") else LENGTHS
    tags = os.environ.get("ROWS_SWEEP_TAGS")  # comma-separated substrings of the candidates' tags to keep
    if tags:
        variants = [x for x in variants if any(t in x.tag for t in tags.split(","))]
    for preset in shapes:
        hq, hkv, D = SHAPES[preset]
        for B in batches:
            for filled, slots in lengths:
                q, k0, v0, n, scale, ref, out = decode_inputs(B, hq, hkv, D, slots, filled)
                # $ROWS_SWEEP_COPIES copies of the cache, each call the next: a working set past the
                # L2 cache (50 MB on the H100), as in a model step, where other layers' weights evict it.
                kv = [(k0, v0)] + [(k0.clone(), v0.clone()) for _ in range(copies - 1)]
                base = {"preset": preset, "B": B, "filled": filled, "slots": slots, "copies": copies}
                slot_mask = (torch.arange(slots, device="cuda") < filled).view(1, 1, 1, slots)

                def per_copy(make):  # make(k, v) -> a call; one call taking the next copy each time
                    return cycling([make(k, v) for k, v in kv])

                def shipped_call(k, v):
                    plan = ops.launches(q, k, v, None, out, scale, True, kv_len=n)
                    return lambda: [dispatch.run(*s) for s in plan]

                def sdpa_mask(k, v):
                    return lambda: out.copy_(F.scaled_dot_product_attention(q, k, v, attn_mask=slot_mask,
                                                                            scale=scale).transpose(1, 2))

                def sdpa_filled(k, v):
                    return lambda: out.copy_(F.scaled_dot_product_attention(q, k[:, :, :filled], v[:, :, :filled],
                                                                            scale=scale).transpose(1, 2))
                timed({**base, "tag": "shipped",
                       "splits": ops.launches(q, k0, v0, None, out, scale, True, kv_len=n)[0][2][-1]},
                      per_copy(shipped_call), out, ref)
                timed({**base, "tag": "sdpa-masked-slots"}, per_copy(sdpa_mask), out, ref)
                timed({**base, "tag": "sdpa-filled"}, per_copy(sdpa_filled), out, ref)
                for splits in SPLITS:
                    for variant in variants:
                        c = variant.constants
                        if c["D"] < D or hq % c["HB"]:
                            continue
                        grid = (splits, B * hq // c["HB"], 1)

                        def make(k, v, variant=variant, grid=grid, splits=splits):
                            plan = ops.launches(q, k, v, None, out, scale, True, splits=splits, kv_len=n)

                            def call():
                                launcher.launch(variant, grid, plan[0][2], 0)
                                for step in plan[1:]:
                                    dispatch.run(*step)
                            return call

                        timed({**base, "tag": variant.tag, "splits": splits}, per_copy(make), out, ref)
    print("\n| preset | B | filled/slots | shipped us | sdpa masked slots | sdpa filled | best candidate |")
    print("|---|---|---|---|---|---|---|")
    for preset in shapes:
        for B in batches:
            for filled, slots in lengths:
                mine = [r for r in rows if (r["preset"], r["B"], r["filled"]) == (preset, B, filled) and r.get("ok")]
                if not mine:
                    continue
                by = {r["tag"]: r["us"] for r in mine if r["tag"] in ("shipped", "sdpa-masked-slots", "sdpa-filled")}
                cands = [r for r in mine if r["tag"] not in by]
                best = min(cands, key=lambda r: r["us"]) if cands else None
                print(f"| {preset} | {B} | {filled}/{slots} | {by.get('shipped', '-')} | "
                      f"{by.get('sdpa-masked-slots', '-')} "
                      f"| {by.get('sdpa-filled', '-')} | "
                      f"{(best['tag'] + ' s' + str(best['splits']) + ' ' + str(best['us'])) if best else '-'} |")
    write_rows(rows, json_out)


if __name__ == "__main__":
    main(__doc__, "/tmp/sweep-rows", candidates, run)
