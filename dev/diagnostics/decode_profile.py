"""Profile a few eager decode steps of a checkpoint (DynamicCache, 128-token prompt, b=1) on each
path given: top ops by host time and by device time, and the step's wall time.

    python3 dev/diagnostics/decode_profile.py CHECKPOINT [stock] [empty] [cutile] [cutile~NAME ...]

``stock``: transformers as is; ``empty``: ``use_kernels=True`` with an empty mapping (what loading
through ``kernels`` alone costs); ``cutile`` and the bench's ``cutile~NAME`` forms: ours. See
decode_diag.py.
"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, DynamicCache

import cutile_kernels
from cutile_kernels.layers.hub import CutileKernelConfig
from cutile_kernels_tools.bench import paths as bench_paths

ck, names = sys.argv[1], sys.argv[2:] or ["stock", "empty"]
bench_paths.isolate_packages("stock")  # fla and causal-conv1d hidden, as in the bench
for name in names:
    if name == "stock":
        kw = {}
    elif name == "empty":
        kw = dict(use_kernels=True, kernel_config=CutileKernelConfig({}, use_local_kernel=True))
    else:
        spec = bench_paths.spec(name)
        kw = dict(use_kernels=True, kernel_config=cutile_kernels.kernel_config(exclude=spec.exclude,
                                                                               include=spec.include))
    m = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.bfloat16, device_map="cuda", **kw).eval()
    cache = DynamicCache(config=m.config)
    with torch.inference_mode():
        out = m(torch.randint(0, 1000, (1, 128), device="cuda"), past_key_values=cache, use_cache=True)
        for _ in range(3):
            out = m(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            out = m(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
        step_ms = (time.perf_counter() - t0) / 5 * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                out = m(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
            torch.cuda.synchronize()
    print(f"== {name}: eager decode step {step_ms:.2f} ms (b=1, DynamicCache); "
          f"dtypes {sorted({str(p.dtype) for p in m.parameters()})}")
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=70))
    print(events.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=70))
    del m, cache, out
    torch.cuda.empty_cache()
