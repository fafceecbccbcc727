"""RMSNorm layer in the Hugging Face ``kernels`` layer convention, and its mapping row.

transformers decorates ``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``Qwen3RMSNorm``, ``MistralRMSNorm``
(and ~130 more) with ``@use_kernel_forward_from_hub("RMSNorm")``; ``kernelize`` rebinds their
``forward`` to :class:`CutileRMSNorm.forward`, which reads the module's own ``weight`` and
``variance_epsilon``. Gemma-style ``(1 + weight)`` norms are not decorated and are not mapped.

The hub name covers classes that round differently (in transformers 5.22, 12 of 137: Olmo2/3,
GptOss, NemotronH, DeepseekV4... multiply by the weight before casting back). Our kernel computes
``LlamaRMSNorm``'s formula, so the layer runs it only for classes whose ``forward`` is
``LlamaRMSNorm.forward``'s code; any other keeps its own forward and says so once.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import dispatch
from ..ops.norm import rms_norm
from ._match import class_verdict, same_code
from ._pins import holds

#: The pin (``layers/_pins.py``) of the formula the kernel reproduces; a later transformers that
#: changes it turns the kernel path off for every copy.
PIN = "llama.LlamaRMSNorm.forward"


@class_verdict
def computes_llama_rms_norm(cls: type) -> bool:
    """True if ``cls.forward`` is ``LlamaRMSNorm.forward``'s code (same bytecode, names, constants,
    defaults) and ``LlamaRMSNorm.forward`` is still the pinned formula (:data:`PIN`).

    Classes "copied from" Llama compile to identical code; a different rounding order does not.
    Once per class; a constant under ``torch.compile`` (:func:`~._match.class_verdict`).
    """
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return holds(PIN) and same_code(getattr(cls, "forward", None), LlamaRMSNorm.forward)


def is_llama_norm(m) -> bool:
    """Whether module ``m`` is a Llama-formula RMSNorm (:func:`computes_llama_rms_norm`) with a
    ``weight`` tensor and ``variance_epsilon``, whose forward is its class's (also when bound on
    the instance, as ``kernels``' fallback does for a layer it leaves stock) or
    :class:`CutileRMSNorm`'s (same formula): what the fusions may compute in its place."""
    if not (computes_llama_rms_norm(type(m)) and isinstance(getattr(m, "weight", None), torch.Tensor)
            and hasattr(m, "variance_epsilon")):
        return False
    fwd = getattr(m.__dict__.get("forward"), "__func__", None) if "forward" in m.__dict__ else type(m).forward
    # By name: kernelize binds the layer of the build's copy of this package, another function object.
    return fwd is type(m).forward or getattr(fwd, "__qualname__", "") == "CutileRMSNorm.forward"


class CutileRMSNorm(nn.Module):
    """``LlamaRMSNorm.forward`` on the cuTile RMSNorm kernel (inference only).

    Borrows ``weight`` (``(N,)``) and ``variance_epsilon`` from the module it replaces; input
    ``(..., N)``, output of the same shape and of dtype ``promote_types(weight, input)``. A module
    whose class computes another formula keeps its own forward (see the module docstring).
    """

    weight: torch.Tensor
    variance_epsilon: float

    can_torch_compile = True
    has_backward = False

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        cls = type(self)
        if not computes_llama_rms_norm(cls):  # a cached verdict; a constant under torch.compile
            if not torch.compiler.is_compiling():  # counted and announced in eager; traced, the stock code
                dispatch.fallback("rms_norm", f"{cls.__name__} is not LlamaRMSNorm's formula; it keeps its own forward")
            return cls.forward(self, hidden_states)
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)


#: transformers hub layer name -> layer class in this module (gathered by ``layers.MAPPING``).
MAPPING = {"RMSNorm": "CutileRMSNorm"}
