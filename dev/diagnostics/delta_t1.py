"""Diagnostic (sixth session): the gated delta rule at T=1 on Qwen3.5's heads, each variant forced.

Prints, for bf16 and fp16 and for contiguous and strided (column-slice) inputs, the relative error
against the float64 reference and the variant launched. Run on a GPU from the checkout's root."""

import sys

import torch

sys.path.insert(0, "tests")
import cutile_kernels  # noqa: E402
from cutile_kernels import dispatch  # noqa: E402
from test_gated_delta import _delta_inputs, _float64_rule  # noqa: E402

for dtype in (torch.bfloat16, torch.float16):
    for strided in (True, False):
        for T in (1, 2):
            q, k, v, g, beta, s0 = _delta_inputs(1, T, 16, 128, 128, dtype, "cuda", seed=T, strided=strided)
            want, want_state = _float64_rule(q, k, v, g, beta, s0)
            before = dict(dispatch.stats()["launches"])
            state = s0.clone()
            out = cutile_kernels.gated_delta_rule(q, k, v, g, beta, state)
            torch.cuda.synchronize()
            after = dispatch.stats()["launches"]
            ran = [kk[:60] for kk, n in after.items() if n > before.get(kk, 0)]
            err = float((out.double() - want).norm() / want.norm())
            serr = float((state.double() - want_state).norm() / want_state.norm())
            print(f"{dtype} strided={strided} T={T}: out err {err:.3e} state err {serr:.3e} ran {ran} "
                  f"fallbacks {dispatch.stats()['fallbacks']}", flush=True)
