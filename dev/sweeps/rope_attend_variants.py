"""Why the first ``rope_append_attention`` was slow, read from sm_90 SASS on a CPU (not shipped).

    python -m dev.sweeps.rope_attend_variants --cuobjdump <path to cuobjdump, e.g. triton's>

prints, for Llama-3.2-1B's decode tile (bf16, head_dim 64, 4 heads x 4 rows, 128 keys a tile), the
instruction counts (total, HMMA, MUFU, BAR, MEMBAR, UTMALDG) of each candidate's cubin: the decode
attention kernel, the shipped one launch and the candidates below. Needs the build toolchain.

On an H100 (2026-12-06) the first one launch took 13.6 us a layer where ``attention`` and
``rope_append`` took 7.9 + 3.4; its cubin had 7696 instructions and 160 HMMA against the attention
kernel's 3336 and 32. Neither merging the new key after the loop ("merge_last": 7640 / 160), nor
dropping the window (7384 / 160), nor loading q already rotated (7088 / 160) changed that; putting the loop's body under a runtime condition, as the attention kernel's per-tile test
does, did ("... under a condition": 4216 / 64). The shipped kernel now has that condition: 3408 / 32
(not yet timed on a GPU).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import subprocess
import tempfile

import cuda.tile as ct

from cutile_kernels.kernel_src.attention import (NEG_INF, ZERO, _cos_sin, _logits, _rotated, _softmax_step, _split_tiles,
                                                 _store_block, _tail_rows_zeroed, _tile_logits)


@ct.kernel
def rope_attend_candidate_kernel(q, k, v, cos, sin, keys, values, length, o, part, lse, scale: float,
                                 softcap: float, window: int, num_splits: int, D: ct.Constant[int],
                                 HB: ct.Constant[int], BS: ct.Constant[int], BN: ct.Constant[int],
                                 WINDOW: ct.Constant[int], QLOAD: ct.Constant[int], LIVE: ct.Constant[int]):
    # The shipped kernel's math with the cached keys' loop first, from the empty state, and the new
    # key merged into split 0's state after it; the new key and value written last. WINDOW: the
    # window's bounds in the loop; QLOAD: q (B, Hq, 1, D) already rotated, loaded as the attention
    # kernel loads it (else halves rotated in registers); LIVE: the loop body under an always-true
    # runtime condition, as the attention kernel's per-tile test.
    split = ct.bid(0)
    nhb = q.shape[1] // HB
    b = ct.bid(1) // nhb
    hb = ct.bid(1) % nhb
    group = q.shape[1] // keys.shape[1]
    kvh = (hb * HB) // group
    n = ct.gather(length, 0).astype(ct.int32)
    c1, c2, s1, s2 = _cos_sin(cos, sin, b, 0, D // 2, 1)
    c1, c2 = ct.reshape(c1, (1, D // 2)), ct.reshape(c2, (1, D // 2))
    s1, s2 = ct.reshape(s1, (1, D // 2)), ct.reshape(s2, (1, D // 2))
    M = HB * BS
    if QLOAD != 0:
        qt = ct.reshape(ct.load(q, index=(b, hb, 0, 0), shape=(1, HB, BS, D), padding_mode=ZERO), (M, D))
    else:
        qt = _rotated(q, b, hb, c1, c2, s1, s2, cos.dtype, HB, BS, D // 2)
    m_i = ct.full((M, 1), NEG_INF, dtype=ct.float32)
    l_i = ct.full((M, 1), 0.0, dtype=ct.float32)
    acc = ct.full((M, D), 0.0, dtype=ct.float32)
    lo = 0
    if WINDOW != 0:
        if window > 0:
            lo = ct.maximum(n - window + 1, 0)
    j_lo, j_hi = _split_tiles(lo // BN, ct.cdiv(n, BN), split, num_splits)
    for j in range(j_lo, j_hi):
        if LIVE != 0:
            if j * BN < n:  # always
                acc, m_i, l_i = _cached_tile(qt, keys, values, acc, m_i, l_i, b, kvh, j, n, scale, softcap, window,
                                             WINDOW, M, D, BN)
        else:
            acc, m_i, l_i = _cached_tile(qt, keys, values, acc, m_i, l_i, b, kvh, j, n, scale, softcap, window,
                                         WINDOW, M, D, BN)
    kn = _rotated(k, b, kvh, c1, c2, s1, s2, cos.dtype, 1, 1, D // 2)
    vn = ct.reshape(ct.load(v, index=(b, kvh, 0, 0), shape=(1, 1, 1, D), padding_mode=ZERO), (1, D))
    # The new key (split 0 only): a one-column tile of the online softmax, -inf elsewhere.
    s_new = _logits(ct.sum(qt.astype(ct.float32) * kn.astype(ct.float32), axis=1, keepdims=True), scale, softcap)
    s_new = ct.where(split == 0, s_new, NEG_INF)
    p, alpha, m_i, l_i = _softmax_step(s_new, m_i, l_i)
    acc = acc * alpha + p * vn.astype(ct.float32)
    _store_block(acc, m_i, l_i, o, part, lse, b, hb, nhb, 0, split, num_splits, D, HB, BS)
    if split == 0 and (hb * HB) % group == 0 and n < keys.shape[2]:
        ct.store(keys, index=(b, kvh, n, 0), tile=ct.reshape(kn, (1, 1, 1, D)))
        ct.store(values, index=(b, kvh, n, 0), tile=ct.reshape(vn, (1, 1, 1, D)))


@ct.function
def _cached_tile(qt, keys, values, acc, m_i, l_i, b, kvh, j, n, scale, softcap, window, WINDOW: ct.Constant[int],
                 M: ct.Constant[int], D: ct.Constant[int], BN: ct.Constant[int]):
    # KV tile j of the first n cached keys into the online softmax's state.
    s = _tile_logits(qt, keys, b, kvh, j, scale, softcap, M, D, BN)
    edge = (j + 1) * BN > n
    if WINDOW != 0:
        if window > 0:
            edge = edge | (j * BN <= n - window)
    if edge:
        kidx = j * BN + ct.reshape(ct.arange(BN, dtype=ct.int32), (1, BN))
        valid = kidx < n
        if WINDOW != 0:
            if window > 0:
                valid = valid & (kidx > n - window)
        s = ct.where(ct.broadcast_to(valid, (M, BN)), s, NEG_INF)
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
    vt = ct.reshape(ct.load(values, index=(b, kvh, j, 0), shape=(1, 1, BN, D), padding_mode=ZERO), (BN, D))
    vt = _tail_rows_zeroed(vt, j, n, BN)
    return ct.mma(p.astype(values.dtype), vt, acc * alpha), m_i, l_i


def _specs():
    from cutile_kernels.kernel_src import attention as kattn
    from cutile_kernels.kernel_src._spec import ConstParam, VariantSpec, array

    def find(kernel):
        return next(s for s in kattn.VARIANTS if s.kernel == kernel and s.tag == "bf16.d64.h4.m4.n128")

    shipped = find("rope_append_attention")
    # the candidates predate the compiled steps' mask: the shipped signature without it
    base = tuple(p for p in shipped.params if p.name not in ("STORE_LAST", "MASKED", "mask"))
    q4 = (array("q", "bfloat16", 4, "aligned"),) + base[1:]
    out = {"attention (decode tile)": find("attention"), "rope_append_attention (shipped)": shipped}
    for name, window, qload, live in (("merge_last", 1, 0, 0), ("merge_last, no window", 0, 0, 0),
                                      ("q loaded, rotated before", 0, 1, 0),
                                      ("q loaded, loop body under a condition", 0, 1, 1)):
        consts = tuple(ConstParam(c, val) for c, val in (("WINDOW", window), ("QLOAD", qload), ("LIVE", live)))
        out[name] = VariantSpec("x", "dev.sweeps.rope_attend_variants", "rope_attend_candidate_kernel", name,
                                (q4 if qload else base) + consts)
    return out


def sass_counts(cubin: bytes, cuobjdump: str) -> dict:
    """Instruction counts of a cubin's SASS: total, HMMA, MUFU (exp2), BAR, MEMBAR, UTMALDG."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    ops = collections.Counter(o.split(".")[0] for o in re.findall(
        r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", text))
    return {"total": sum(ops.values()), **{k: ops.get(k, 0) for k in ("HMMA", "MUFU", "BAR", "MEMBAR", "UTMALDG")}}


def main(argv=None) -> None:
    from cutile_kernels_build import aot

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    args = ap.parse_args(argv)
    for name, spec in _specs().items():
        cubin, _ = aot.compile_variant(spec, "sm_90")
        print(json.dumps({"candidate": name, **sass_counts(cubin, args.cuobjdump)}), flush=True)


if __name__ == "__main__":
    main()
