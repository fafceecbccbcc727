"""Patch ``gemv``: the model's projections run one-row inputs (batch-1 decode) on our GEMV kernel.

Every exact ``nn.Linear`` of the model's decoder layers that :func:`~._fusion.linear_problem` accepts (no subclass
such as a LoRA or quantized layer, no hooks, a plain dense weight, not meta) gets
:func:`gemv_linear_forward` as its instance forward: ``cutile_kernels.ops.gemv.linear``, i.e. the
cuTile GEMV (``kernel_src/gemv.py``) when the input holds one row of a 16-bit dtype, the projection
is at most 2048 wide (where the GEMV beat cuBLAS on the H200) and the step is compiled or captured
in a CUDA graph; ``F.linear`` otherwise (prefill, batched decode, eager steps: the stock GEMMs).
Applied after the stacking patches (``fused_qkv``, ``fused_gate_up``), so their stacked
projections are covered too, and again after any later patch or undo (``Patch.follows``): a
stacking applied afterwards, or an unstacking, leaves no projection of the layers uncovered.
Weights are not touched: saving after the patch gives the stock bytes.
"""

from __future__ import annotations

from torch import nn

from ..ops.gemv import linear
from ._fusion import linear_problem
from ._patching import Patch, restore_forwards, swap_forwards


def gemv_linear_forward(self: nn.Linear, input):
    """``nn.Linear.forward`` with one-row 16-bit inputs on the cuTile GEMV (:func:`~..ops.gemv.linear`).
    ``input (..., in_features)`` -> ``(..., out_features)`` of its dtype. A module whose class was
    changed after the patch (a subclass put in place, as LoRA-style wrappers may) runs its class's
    forward."""
    if type(self) is not nn.Linear:
        return type(self).forward(self, input)
    return linear(input, self.weight, self.bias)


def _decoder_linears(model: nn.Module) -> set[int]:
    """ids of the ``nn.Linear`` modules inside the model's decoder stacks: every ``nn.ModuleList``
    named ``layers`` (``model.layers`` in transformers' decoder models)."""
    found = set()
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and name.rpartition(".")[2] == "layers":
            found.update(id(x) for x in m.modules() if isinstance(x, nn.Linear))
    return found


def patch_linears(model: nn.Module) -> int:
    """Patch ``gemv``: bind :func:`gemv_linear_forward` to every ``nn.Linear`` of the decoder
    layers (:func:`_decoder_linears`; the LM head and anything outside the layer stack keep theirs)
    that ``linear_problem`` accepts (the others are logged with the reason). Returns the modules
    newly patched."""
    inside = _decoder_linears(model)
    new = swap_forwards(model, "gemv", gemv_linear_forward, lambda m: id(m) in inside,
                        lambda m: linear_problem(m, bias_ok=True), "one-row inputs of {n} {cls} on the cuTile GEMV")
    return sum(new.values())


def unpatch_linears(model: nn.Module) -> int:
    """Undo :func:`patch_linears`: torch's ``nn.Linear.forward`` again. Returns the modules restored."""
    return restore_forwards(model, "gemv", gemv_linear_forward, noun="projections")


#: This module's patch row (``layers/_registry.py`` applies it after the stacking patches).
PATCH_ROWS = [Patch("gemv", apply=patch_linears, undo=unpatch_linears,
                    description="one-row (batch-1 decode) projections up to 2048 wide on the cuTile GEMV in compiled "
                                "and CUDA-graph steps; cuBLAS otherwise",
                    follows=True)]

__all__ = ["gemv_linear_forward", "patch_linears", "unpatch_linears"]
