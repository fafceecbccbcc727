"""Patch ``gemv``: the model's projections run one-row inputs (batch-1 decode) on our GEMV kernel.

Every exact ``nn.Linear`` of the model's decoder layers that :func:`~._fusion.linear_problem` accepts (no subclass
such as a LoRA or quantized layer, no hooks, no forward replaced on the instance, a plain dense weight,
not meta) has its class switched to :class:`CutileGemvLinear`, whose forward is
``cutile_kernels.ops.gemv.linear``, i.e. the cuTile GEMV (``kernel_src/gemv.py``) when the input holds
one row of a 16-bit dtype, the projection is at most 2048 wide (where the GEMV beat cuBLAS on the H200)
and the step is compiled or captured in a CUDA graph; ``F.linear`` otherwise (prefill, batched decode,
eager steps: the stock GEMMs). A class switch, as ``torch.nn.utils.parametrize`` does, rather than a
forward bound on each instance: a compiled step re-checks dynamo's guards on the host before every
replay, and each instance-bound forward adds guards on its function, closure and ``__self__`` (on a
16-layer Llama, the 112 projections' took a check from ~122 to ~153 us on the dev CPU; the class is
guarded once per module as ``nn.Linear`` is).
Applied after the stacking patches (``fused_qkv``, ``fused_gate_up``), so their stacked
projections are covered too, and again after any later patch or undo (``Patch.follows``): a
stacking applied afterwards, or an unstacking, leaves no projection of the layers uncovered.
Weights are not touched: saving after the patch gives the stock bytes.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx._symbolic_trace import is_fx_tracing
from torch.nn.utils import parametrize

from ..ops.gemv import linear
from ._fusion import linear_problem
from ._patching import Patch, forward_replaced, own_forward_on_instance

logger = logging.getLogger("cutile_kernels")


class CutileGemvLinear(nn.Linear):
    """``nn.Linear`` with one-row 16-bit inputs on the cuTile GEMV (:func:`~..ops.gemv.linear`): the
    class patch ``gemv`` switches exact ``nn.Linear`` modules to, and its undo back. Same parameters,
    ``state_dict`` and initialisation as ``nn.Linear``; ``input (..., in_features)`` -> ``(...,
    out_features)`` of its dtype, the math of ``F.linear`` (float32 sums rounded once on the GEMV)."""

    #: Computes ``nn.Linear``'s function on the same parameters: the stacking patches take it as one
    #: (``_fusion.linear_problem``).
    _cutile_as_linear = True

    def forward(self, input):
        # torch.fx traces into this class (not torch.nn's, so not a leaf): nn.Linear's call there.
        # Dynamo first: it then reads nothing more (each read a guard a compiled call checks).
        if not torch.compiler.is_compiling() and is_fx_tracing():
            return F.linear(input, self.weight, self.bias)
        return linear(input, self.weight, self.bias)


#: The forward of :class:`CutileGemvLinear`, as the reproduced forwards recognise it.
gemv_linear_forward = CutileGemvLinear.forward


def _decoder_linears(model: nn.Module) -> set[int]:
    """ids of the ``nn.Linear`` modules inside the model's decoder stacks: every ``nn.ModuleList``
    named ``layers`` (``model.layers`` in transformers' decoder models)."""
    found = set()
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and name.rpartition(".")[2] == "layers":
            found.update(id(x) for x in m.modules() if isinstance(x, nn.Linear))
    return found


def _verdict(m: nn.Module) -> str | None:
    why = linear_problem(m, bias_ok=True)
    if why is None and forward_replaced(m):
        why = "its forward is replaced on the instance (e.g. an accelerate hook)"
    return why


def patch_linears(model: nn.Module) -> int:
    """Patch ``gemv``: switch every exact ``nn.Linear`` of the decoder layers (:func:`_decoder_linears`;
    the LM head and anything outside the layer stack keep theirs) to :class:`CutileGemvLinear` where
    :func:`_verdict` accepts it (the others are logged with the reason, once per reason). Returns the
    modules newly patched."""
    inside = _decoder_linears(model)
    new, refused = 0, Counter()
    for m in model.modules():
        if id(m) not in inside or type(m) is not nn.Linear:
            continue
        why = _verdict(m)
        if why is not None:
            refused[why] += 1
            continue
        # nn.Linear.forward bound on the instance (what accelerate's remove_hook_from_module leaves)
        # would shadow the class's: dropped, as the stacking patches drop it (_fusion.fuse_one).
        if own_forward_on_instance(m):
            del m.__dict__["forward"]
        m.__class__ = CutileGemvLinear
        new += 1
    if new:
        logger.info("cutile_kernels: patch gemv: one-row inputs of %d nn.Linear on the cuTile GEMV", new)
    for why, n in refused.items():
        logger.info("cutile_kernels: patch gemv leaves %d nn.Linear alone: %s", n, why)
    return new


def unpatch_linears(model: nn.Module) -> int:
    """Undo :func:`patch_linears`: every :class:`CutileGemvLinear` of the model is ``nn.Linear`` again.
    Returns the modules restored."""
    n = 0
    for m in model.modules():
        cls = type(m)
        if cls is CutileGemvLinear:
            m.__class__ = nn.Linear
            n += 1
        elif parametrize.is_parametrized(m) and cls.__bases__ == (CutileGemvLinear,):
            # torch.nn.utils.parametrize made this module a class of its own over ours: rebased.
            cls.__bases__ = (nn.Linear,)
            n += 1
    if n:
        logger.info("cutile_kernels: patch gemv undone on %d projections", n)
    return n


#: This module's patch row (``layers/_registry.py`` applies it after the stacking patches).
PATCH_ROWS = [Patch("gemv", apply=patch_linears, undo=unpatch_linears,
                    description="one-row (batch-1 decode) projections up to 2048 wide on the cuTile GEMV in compiled "
                                "and CUDA-graph steps; cuBLAS otherwise",
                    follows=True)]

__all__ = ["CutileGemvLinear", "gemv_linear_forward", "patch_linears", "unpatch_linears"]
