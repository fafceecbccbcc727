"""Load a model with our kernels and check it against the stock model.

    python examples/quickstart.py [checkpoint dir | preset]     (default: the embedded tiny preset)

On a GPU with a build (`cutile-kernels build`), the RMSNorm layers and the rotary embedding run our
cuTile kernels, and the fallback patcher fuses the decoder layers' residual adds into their norms
and each MLP's gate and up projections into one GEMM; on a CPU nothing is replaced and the logits
are identical.
"""

import sys

import cutile_kernels
import torch
from cutile_kernels_tools import presets
from cutile_kernels_tools.bench.worker import kernelized_layers
from transformers import AutoModelForCausalLM

device = "cuda" if torch.cuda.is_available() else "cpu"
try:
    checkpoint, label = presets.resolve(sys.argv[1] if len(sys.argv) > 1 else "tiny", device=device)
except (KeyError, FileNotFoundError, ValueError) as exc:  # unknown preset, no or broken weights
    print(f"quickstart: {exc.args[0] if exc.args else exc}", file=sys.stderr)
    sys.exit(2)  # bad input, as the CLI says it

stock = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, device_map=device).eval()
ours = AutoModelForCausalLM.from_pretrained(
    checkpoint, dtype=torch.bfloat16, device_map=device,
    use_kernels=True, kernel_config=cutile_kernels.kernel_config(),
).eval()

ids = torch.randint(0, stock.config.vocab_size, (2, 32), device=device)
with torch.inference_mode():
    a, b = stock(ids).logits.float(), ours(ids).logits.float()
replaced = kernelized_layers(ours)  # {our layer class: modules whose forward is now ours}
patched = cutile_kernels.layers.patch.applied(ours)  # {patch name: modules changed}
print(f"{label} on {device}: hub layers {replaced or 'none'}; patches {patched or 'none'}; "
      f"max |stock - ours| = {(a - b).abs().max().item():.3e}; "
      f"top-1 agreement = {(a.argmax(-1) == b.argmax(-1)).float().mean().item():.4f}")
if device == "cpu":
    print("(no CUDA GPU here: our kernels run on NVIDIA GPUs only, so nothing was swapped and the logits match)")
