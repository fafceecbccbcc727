"""Each kernel of the chunked gated delta rule against a float64 reference of its own stage.

    python dev/diagnostics/gated_delta_stages.py

Runs ``gated_delta_prepare`` and ``gated_delta_scan`` the way the op does and prints, per work
buffer (w, u, attn) and result (o, the final state), the relative error against the same quantity
computed in float64 from the inputs; the scan also from the reference's own work buffers, which
isolates it from the prepare's error: where a wrong result starts. Shapes: Qwen3.5-0.8B's linear
heads (contiguous and as column slices) and longer sequences over fewer heads. (Its first version,
for a three-kernel attempt since reverted, found that attempt's bugs on the H200 on 2026-12-02; this
version's reference is checked against the op's float64 reference on the CPU.)
"""

from __future__ import annotations

import torch

from cutile_kernels import dispatch
from cutile_kernels.ops import gated_delta as gd


def reference(q, k, v, g, beta, s0, bt):
    """float64 work buffers of every stage, chunk by chunk (the kernels' formulas)."""
    q, k, v, g, beta, s = (t.double() for t in (q, k, v, g, beta, s0))
    B, T, H, dk = q.shape
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    out = {n: [] for n in ("w", "u", "attn", "o")}
    for c in range(-(-T // bt)):
        r = slice(c * bt, min(T, c * bt + bt))
        qc, kc, vc = (x[:, r].transpose(1, 2) for x in (q, k, v))  # (B, H, n, d)
        gc, bc = g[:, r].transpose(1, 2), beta[:, r].transpose(1, 2)  # (B, H, n)
        cum = gc.cumsum(-1)
        last = cum[..., -1:]
        n = cum.shape[-1]
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(lower, (cum[..., :, None] - cum[..., None, :]).clamp(max=0).exp(), 0.0)
        kb = kc * bc[..., None]
        a = (kb @ kc.transpose(-1, -2) * decay).tril(-1)
        tinv = torch.linalg.inv(torch.eye(n, dtype=a.dtype, device=a.device) + a)
        w = tinv @ (kb * cum.exp()[..., None])
        u = tinv @ (vc * bc[..., None])
        attn = (qc @ kc.transpose(-1, -2)) * decay
        v_new = u - w @ s
        o = (qc * cum.exp()[..., None]) @ s + attn @ v_new
        s = s * last.exp()[..., None] + (kc * (last - cum).exp()[..., None]).transpose(-1, -2) @ v_new
        for name, val in (("w", w), ("u", u), ("o", o)):
            out[name].append(val.transpose(1, 2))
        out["attn"].append(torch.nn.functional.pad(attn, (0, bt - n, 0, bt - n)))
    res = {n: torch.cat(out[n], 1) for n in ("w", "u", "o")}
    res["attn"] = torch.cat(out["attn"], 2)  # (B, H, chunks * bt, bt), the kernel's layout
    res["state"] = s
    return res


def rel(x, y):
    return float((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30))


def _launch(kernel, want, args, n_inputs, grid) -> None:
    if not dispatch.run(kernel, want, args, n_inputs, grid):
        raise SystemExit(f"{kernel}: no prebuilt variant launched (see the fallback log line)")


def run(B, T, H, strided):
    torch.manual_seed(T)
    dk = dv = 128
    dt = torch.bfloat16
    if strided:
        mix = torch.randn(B, T, H * (2 * dk + dv), device="cuda", dtype=dt)
        q, k, v = (x.reshape(B, T, H, -1) for x in mix.split([H * dk, H * dk, H * dv], -1))
    else:
        q, k, v = (torch.randn(B, T, H, d, device="cuda", dtype=dt) for d in (dk, dk, dv))
    g = -torch.nn.functional.softplus(torch.randn(B, T, H, device="cuda")) * 0.3
    beta = torch.rand(B, T, H, device="cuda").to(dt)
    s0 = 0.1 * torch.randn(B, H, dk, dv, device="cuda")
    bt, scale = gd.chunk_size, dk ** -0.5
    n = -(-T // bt)
    want = reference(q, k, v, g, beta, s0, bt)
    # Work buffers poisoned: an element a kernel does not write shows as NaN.
    w, u = (torch.full((B, T, H, d), float("nan"), device="cuda") for d in (dk, dv))
    attn = torch.full((B, H, n * bt, bt), float("nan"), device="cuda")
    want_consts = (("DK", dk), ("BT", bt))
    _launch("gated_delta_prepare", want_consts, (q, k, v, g, beta, w, u, attn, scale), 5, lambda c: (n, B * H, 1))
    got = {"w": rel(w, want["w"]), "u": rel(u, want["u"]), "attn": rel(attn, want["attn"])}
    o, state = torch.full(v.shape, float("nan"), device="cuda", dtype=dt), s0.clone()
    ref_bufs = [want[x].float().contiguous() for x in ("w", "u", "attn")]
    _launch("gated_delta_scan", want_consts, (q, k, g, *ref_bufs, state, o, scale), 7,
            lambda c: (-(-dv // c["BV"]), B * H, 1))
    got.update({"scan o": rel(o, want["o"]), "scan state": rel(state, want["state"])})
    state = s0.clone()
    got["op o"] = rel(gd.gated_delta_rule(q, k, v, g, beta, state), want["o"])
    got["op state"] = rel(state, want["state"])
    return got


def main() -> None:
    for B, T, H, strided in ((1, 64, 16, True), (1, 64, 16, False), (3, 100, 4, False), (1, 2048, 2, False)):
        errs = run(B, T, H, strided)
        print(f"B={B} T={T} H={H} strided={strided}:", " ".join(f"{k}={v:.1e}" for k, v in errs.items()), flush=True)


if __name__ == "__main__":
    main()
