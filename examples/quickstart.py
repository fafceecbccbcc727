"""Load a model with our kernels and check it against the stock model.

    python examples/quickstart.py [checkpoint dir | preset]     (default: the embedded tiny preset)

On a GPU with a build (`cutile-kernels build`), the RMSNorm layers run our cuTile kernel; on a CPU
nothing is replaced and the logits are identical.
"""

import sys

import torch
from transformers import AutoModelForCausalLM

import cutile_kernels
from cutile_kernels_tools import presets
from cutile_kernels_tools.worker import kernelized_layers

device = "cuda" if torch.cuda.is_available() else "cpu"
checkpoint, label = presets.resolve(sys.argv[1] if len(sys.argv) > 1 else "tiny", device=device)

stock = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, device_map=device).eval()
ours = AutoModelForCausalLM.from_pretrained(
    checkpoint, dtype=torch.bfloat16, device_map=device,
    use_kernels=True, kernel_config=cutile_kernels.kernel_config(),
).eval()

ids = torch.randint(0, stock.config.vocab_size, (2, 32), device=device)
with torch.inference_mode():
    a, b = stock(ids).logits.float(), ours(ids).logits.float()
replaced = kernelized_layers(ours).get("CutileRMSNorm", 0)  # modules whose forward is now ours
print(f"{label} on {device}: {replaced} RMSNorm layers kernelized; "
      f"max |stock - ours| = {(a - b).abs().max().item():.3e}; "
      f"top-1 agreement = {(a.argmax(-1) == b.argmax(-1)).float().mean().item():.4f}")
