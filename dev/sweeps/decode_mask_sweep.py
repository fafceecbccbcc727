"""Decode attention with a mask: the shipped tile's skip of hidden tiles against loads that do not wait for it.

    python -m dev.sweeps.decode_mask_sweep export --out /tmp/sweep-mask   # CPU: compile the candidates (sm_90)
    python -m dev.sweeps.decode_mask_sweep run --dir /tmp/sweep-mask --json out.json   # GPU: check, then time

Why: OLMo-3-7B's fast-path step at batch 16 (H100, 2026-12-05) spent 55 us a layer in our decode
attention, but the same launch over the profiled cache took 34-37 us in the MHA sweep
(``decode_rows_sweep.py``), which passes only ``kv_len``. In the model, 24 of the 32 layers slide:
their ``StaticSlidingWindowLayer`` has no ``kv_len``, so the step passes the window's boolean mask
over every slot (``layers/decode_graphs.py`` ``_window_mask``), and the shipped loop
(``kernel_src/attention.py`` ``_attend``) then loads each tile's mask, reduces it to decide whether
the tile is live, and only then loads K and V: three dependent global loads a tile instead of two,
and no load of the next tile can start before the current tile's mask is read.

Estimate before (Amdahl): if the masked launches are the ~55 - 36 = 19 us a layer over the unmasked
ones on 24 of 32 layers, f ~ 24 * 19 / 7617 = 0.06 of the batch-16 step; removing the mask's
dependency (s ~1.5 on those launches) gives a ceiling of ~1.02x: only worth it with the hidden-tile
skip kept where it pays (padded batches over long caches). This sweep measures the gap first.

The candidate ``attention_maskfree_kernel`` is ``attention_kernel`` (same arguments, grid and math)
whose loop loads K, V and the mask tile up front and masks element-wise: no tile is skipped, so a
hidden tile's K and V are read (the bytes the skip saved), but nothing waits on the mask.

``run`` times, for OLMo-3-7B's, OLMo-2-1B's and Llama-3.2-1B's head layouts at batch 1 and 16, a
static cache of ``slots`` slots with ``filled`` of them written (six copies cycled: L2-cold), as
CUDA-graph replays (median GPU us, the output NaN-poisoned and checked first against float32
attention over the filled keys): the shipped launch with ``kv_len`` only (a full layer), the shipped
launch with the window mask over every slot (a sliding layer), the candidate with that mask, and
SDPA with that mask (what stock runs).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import cuda.tile as ct

from cutile_kernels.kernel_src.attention import (LOG2E, NEG_INF, ZERO, _kv_length, _kv_tile_range,
                                                 _tail_rows_zeroed)

from dev.sweeps._common import checked_timing, cycling, main, write_rows


@ct.kernel
def attention_maskfree_kernel(q, k, v, mask, kv_len, o, part, lse, scale: float, softcap: float, window: int,
                              has_mask: int, has_len: int, causal: int, num_splits: int,
                              D: ct.Constant[int], HB: ct.Constant[int], BS: ct.Constant[int],
                              BN: ct.Constant[int]):
    """``kernel_src.attention.attention_kernel`` with every KV tile of the block's range loaded and
    masked element-wise (no tile skipped on its mask). Arguments, grid and math as there."""
    M = HB * BS
    qb = ct.bid(0) // num_splits
    split = ct.bid(0) % num_splits
    nhb = ct.cdiv(q.shape[1], HB)
    b = ct.bid(1) // nhb
    hb = ct.bid(1) % nhb
    sq = q.shape[2]
    skv = _kv_length(k, kv_len, has_len)
    j_lo, j_hi = _kv_tile_range(qb, sq, skv, causal, window, BS, BN)
    if num_splits > 1:
        per = ct.cdiv(j_hi - j_lo, num_splits)
        j_lo = ct.minimum(j_lo + split * per, j_hi)
        j_hi = ct.minimum(j_lo + per, j_hi)
    kvh = (hb * HB) // (q.shape[1] // k.shape[1])
    qt = ct.reshape(ct.load(q, index=(b, hb, qb, 0), shape=(1, HB, BS, D), padding_mode=ZERO), (M, D))
    rows = ct.arange(M, dtype=ct.int32)
    pos = ct.reshape(qb * BS + rows % BS + (skv - sq), (M, 1))
    cols = ct.reshape(ct.arange(BN, dtype=ct.int32), (1, BN))
    mb = b % mask.shape[0]
    qk_scale = scale * LOG2E
    m_i = ct.full((M, 1), NEG_INF, dtype=ct.float32)
    l_i = ct.full((M, 1), 0.0, dtype=ct.float32)
    acc = ct.full((M, D), 0.0, dtype=ct.float32)
    for j in range(j_lo, j_hi):
        kt = ct.load(k, index=(b, kvh, 0, j), shape=(1, 1, D, BN), order=(0, 1, 3, 2), padding_mode=ZERO)
        vt = ct.reshape(ct.load(v, index=(b, kvh, j, 0), shape=(1, 1, BN, D), padding_mode=ZERO), (BN, D))
        kidx = j * BN + cols
        valid = ct.broadcast_to(kidx < skv, (M, BN))
        if has_mask != 0:
            mt = ct.load(mask, index=(mb, qb, j), shape=(1, BS, BN), padding_mode=ZERO)
            valid = valid & (ct.reshape(ct.broadcast_to(mt, (HB, BS, BN)), (M, BN)) != 0)
        if causal != 0:
            valid = valid & (kidx <= pos)
        if window > 0:
            valid = valid & (kidx > pos - window)
        s = ct.mma(qt, ct.reshape(kt, (D, BN)), ct.full((M, BN), 0.0, dtype=ct.float32))
        if softcap > 0.0:
            s = ct.tanh(s * (scale / softcap)) * (softcap * LOG2E)
        else:
            s = s * qk_scale
        s = ct.where(valid, s, NEG_INF)
        m_new = ct.maximum(m_i, ct.max(s, axis=1, keepdims=True))
        m_use = ct.where(m_new == NEG_INF, 0.0, m_new)
        p = ct.exp2(s - m_use)
        alpha = ct.exp2(m_i - m_use)
        l_i = l_i * alpha + ct.sum(p, axis=1, keepdims=True)
        if has_len != 0:
            vt = _tail_rows_zeroed(vt, j, skv, BN)
        acc = ct.mma(p.astype(v.dtype), vt, acc * alpha)
        m_i = m_new
    out = acc / ct.where(l_i == 0.0, 1.0, l_i)
    if num_splits > 1:
        lse_rows = ct.where(l_i == 0.0, NEG_INF, m_i + ct.log2(ct.where(l_i == 0.0, 1.0, l_i)))
        bh = b * nhb + hb
        ct.store(part, index=(split, bh, qb, 0), tile=ct.reshape(out, (1, HB, BS, D)))
        ct.store(lse, index=(split, bh, qb), tile=ct.reshape(lse_rows, (1, HB, BS)))
    else:
        ct.store(o, index=(b, hb, qb, 0), tile=ct.reshape(out.astype(o.dtype), (1, HB, BS, D)))


#: preset -> (query heads, KV heads, head_dim)
SHAPES = {"olmo-3-7b": (32, 32, 128), "olmo-2-1b": (16, 16, 128), "llama-3.2-1b": (32, 8, 64)}
#: (filled, slots): the profiled step's cache (128 + 80 + 64 slots), and a longer one
LENGTHS = ((150, 272), (250, 272), (700, 1024))
COPIES = 6


def candidates():
    from cutile_kernels.kernel_src import attention
    from cutile_kernels.kernel_src._spec import VariantSpec

    out = []
    for dp in (64, 128):
        for hb in attention.DECODE_HEADS:
            for bn in sorted({attention.DECODE_BN[dp], attention.DECODE_BN_LONG[dp]}):
                consts = {"D": dp, "HB": hb, "BS": attention.DECODE_ROWS // hb, "BN": bn}
                out.append(VariantSpec("attention", "dev.sweeps.decode_mask_sweep", "attention_maskfree_kernel",
                                       f"bf16.d{dp}.h{hb}.m{consts['BS']}.n{bn}.maskfree",
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

    for preset, (hq, hkv, D) in SHAPES.items():
        for B in (1, 16):
            for filled, slots in LENGTHS:
                q, k0, v0, n, scale, ref, out = decode_inputs(B, hq, hkv, D, slots, filled)
                kv = [(k0, v0)] + [(k0.clone(), v0.clone()) for _ in range(COPIES - 1)]
                # The sliding layer's window mask before the window fills: slots 0 .. filled - 1.
                mask = (torch.arange(slots, device="cuda") < filled).view(1, 1, 1, slots)
                base = {"preset": preset, "B": B, "filled": filled, "slots": slots}

                def plans(m, length, splits=None):
                    return [ops.launches(q, k, v, m, out, scale, m is None, splits=splits, kv_len=length)
                            for k, v in kv]

                full, sliding = plans(None, n), plans(mask, None)
                timed({**base, "tag": "shipped kv_len", "splits": full[0][0][2][-1]},
                      cycling([lambda p=p: [dispatch.run(*s) for s in p] for p in full]), out, ref)
                timed({**base, "tag": "shipped mask", "splits": sliding[0][0][2][-1]},
                      cycling([lambda p=p: [dispatch.run(*s) for s in p] for p in sliding]), out, ref)
                both = plans(mask, n)  # a full layer in generate(), a sliding one since: the mask and kv_len
                timed({**base, "tag": "shipped mask+kv_len", "splits": both[0][0][2][-1]},
                      cycling([lambda p=p: [dispatch.run(*s) for s in p] for p in both]), out, ref)
                timed({**base, "tag": "sdpa mask"},
                      cycling([lambda k=k, v=v: out.copy_(F.scaled_dot_product_attention(
                          q, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != hkv).transpose(1, 2))
                          for k, v in kv]), out, ref)
                splits = sliding[0][0][2][-1]
                want = dict(sliding[0][0][1])
                for variant in variants:
                    if variant.constants != want:
                        continue
                    grid = sliding[0][0][4](want)
                    calls = []
                    for p in sliding:
                        def call(p=p):
                            launcher.launch(variant, grid, p[0][2], 0)
                            for step in p[1:]:
                                dispatch.run(*step)
                        calls.append(call)
                    timed({**base, "tag": variant.tag, "splits": splits}, cycling(calls), out, ref)
    print("\n| preset | B | filled/slots | shipped, kv_len | shipped, mask | shipped, mask + kv_len | candidate, mask "
          "| SDPA, mask |")
    print("|---|---|---|---|---|---|---|---|")
    for preset in SHAPES:
        for B in (1, 16):
            for filled, slots in LENGTHS:
                mine = {r["tag"].split(".")[-1] if "maskfree" in r["tag"] else r["tag"]: r.get("us", "-")
                        for r in rows if (r["preset"], r["B"], r["filled"]) == (preset, B, filled)}
                print(f"| {preset} | {B} | {filled}/{slots} | {mine.get('shipped kv_len', '-')} | "
                      f"{mine.get('shipped mask', '-')} | {mine.get('shipped mask+kv_len', '-')} | {mine.get('maskfree', '-')} | {mine.get('sdpa mask', '-')} |")
    write_rows(rows, json_out)


if __name__ == "__main__":
    main(__doc__, "/tmp/sweep-mask", candidates, run)
