"""RMSNorm layer in the Hugging Face ``kernels`` layer convention, and its mapping row.

transformers decorates ``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``Qwen3RMSNorm``, ``MistralRMSNorm``
(and ~130 more) with ``@use_kernel_forward_from_hub("RMSNorm")``; ``kernelize`` rebinds their
``forward`` to :class:`CutileRMSNorm.forward`, which reads the module's own ``weight`` and
``variance_epsilon``. Gemma-style ``(1 + weight)`` norms are not decorated and are not mapped.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.norm import rms_norm


class CutileRMSNorm(nn.Module):
    """``LlamaRMSNorm.forward`` on the cuTile RMSNorm kernel (inference only).

    Borrows ``weight`` (``(N,)``) and ``variance_epsilon`` from the module it replaces; input
    ``(..., N)``, output of the same shape and of dtype ``promote_types(weight, input)``.
    """

    weight: torch.Tensor
    variance_epsilon: float

    can_torch_compile = True
    has_backward = False

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)


#: transformers hub layer name -> layer class in this module (gathered by ``layers.MAPPING``).
MAPPING = {"RMSNorm": "CutileRMSNorm"}
