"""Profile a few decode steps of a checkpoint loaded plainly and with use_kernels=True (empty
mapping): top CPU ops, memcpys, synchronisations, device placement. See decode_diag.py."""

import sys

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, DynamicCache

from cutile_kernels.layers.hub import CutileKernelConfig

ck = sys.argv[1]
for name, kw in [("stock", {}), ("stock+use_kernels", dict(use_kernels=True, kernel_config=CutileKernelConfig({}, use_local_kernel=True)))]:
    m = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.bfloat16, device_map="cuda", **kw).eval()
    devs = {str(p.device) for p in m.parameters()}
    hooks = sum(hasattr(x, "_hf_hook") for x in m.modules())
    fwd_hooks = sum(len(x._forward_hooks) + len(x._forward_pre_hooks) for x in m.modules())
    cache = DynamicCache(config=m.config)
    with torch.inference_mode():
        out = m(torch.randint(0, 1000, (1, 128), device="cuda"), past_key_values=cache, use_cache=True)
        for _ in range(3):
            out = m(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                out = m(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
            torch.cuda.synchronize()
    print(f"== {name}: param devices {devs}, accelerate hooks {hooks}, torch hooks {fwd_hooks}, "
          f"dtypes {sorted({str(p.dtype) for p in m.parameters()})}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
    del m
    torch.cuda.empty_cache()
