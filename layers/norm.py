"""RMSNorm layer in the Hugging Face ``kernels`` layer convention, and its mapping row.

transformers decorates ``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``Qwen3RMSNorm``, ``MistralRMSNorm``
(and ~130 more) with ``@use_kernel_forward_from_hub("RMSNorm")``; ``kernelize`` rebinds their
``forward`` to :class:`CutileRMSNorm.forward`, which reads the module's own ``weight`` and
``variance_epsilon``. Gemma-style ``(1 + weight)`` norms are not decorated and are not mapped.

The hub name covers classes that round differently (in transformers 5.22, 12 of 137: Olmo2/3,
GptOss, NemotronH, DeepseekV4... multiply by the weight before casting back). Our kernel computes
``LlamaRMSNorm``'s formula, so the layer runs it only for classes whose ``forward`` is
``LlamaRMSNorm.forward``'s code; any other keeps its own forward and says so once. Qwen3.5's
``(1 + weight)`` norm carries another hub name, ``RMSNormZeroCentered``: :class:`CutileZeroCenteredRMSNorm`
runs it on the ``rms_norm_gemma`` kernel.

The other order transformers uses, float32 throughout and one rounding at the end, is two patches
here on the ``rms_norm_gemma`` kernel, both default: ``rms_norm_gemma`` takes every module whose
class computes ``GemmaRMSNorm``'s formula (offset 1: Gemma 1/2/3, Qwen3.5, ...), ``rms_norm_olmo2``
every one computing ``Olmo2RMSNorm``'s (offset 0: OLMo 2/3, GptOss, ...), replacing the hub layer's stock fallback where
``kernelize`` bound it. ``from_pretrained`` applies the patches before ``kernelize``, which rebinds
every hub-decorated module's forward (OLMo 2's norms are decorated, Gemma's are not), so a patch
also marks each module it takes (:data:`FLOAT_NORM_MARK`) and the hub layer runs the marked formula.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import dispatch
from ..ops.norm import rms_norm, rms_norm_gated, rms_norm_gemma
from ._match import class_verdict, same_code
from ._patching import Patch, restore_forwards, swap_forwards
from ._pins import TRANSFORMERS, holds

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
            offset = getattr(self, FLOAT_NORM_MARK, None)  # taken by a float-order patch before kernelize
            if offset is not None:
                return rms_norm_gemma(hidden_states, self.weight, _float_norm_eps(self), offset)
            return _own_forward(self, hidden_states, "rms_norm", "LlamaRMSNorm")
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _own_forward(module: nn.Module, x: torch.Tensor, kernel: str, formula: str) -> torch.Tensor:
    """A hub layer's way out for a class it declines: its own forward, counted and announced in eager
    (traced, just the stock code)."""
    cls = type(module)
    if not torch.compiler.is_compiling():
        dispatch.fallback(kernel, f"{cls.__name__} is not {formula}'s formula; it keeps its own forward")
    return cls.forward(module, x)


class CutileZeroCenteredRMSNorm(nn.Module):
    """``GemmaRMSNorm.forward``'s formula (float32, ``1 + weight``, one rounding) on the
    ``rms_norm_gemma`` kernel with offset 1, for the classes transformers decorates
    ``@use_kernel_forward_from_hub("RMSNormZeroCentered")`` (``Qwen3_5RMSNorm`` and its copies):
    ``kernelize`` binds this forward to them after the patches ran, so the ``rms_norm_gemma``
    patch cannot reach them (inference only).

    Borrows ``weight`` (``(N,)``) and ``eps`` from the module it replaces; input ``(..., N)``, output
    of the same shape and dtype. A class whose code is not ``GemmaRMSNorm``'s keeps its own forward.
    """

    weight: torch.Tensor
    eps: float

    can_torch_compile = True
    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not computes_gemma_rms_norm(type(self)):  # cached per class; a constant under torch.compile
            return _own_forward(self, x, "rms_norm_gemma", "GemmaRMSNorm")
        return rms_norm_gemma(x, self.weight, _float_norm_eps(self), 1.0)


#: The pin (``layers/models/qwen3_5.py``) of the gated norm's forward the kernel reproduces.
GATED_PIN = "qwen3_5.Qwen3_5RMSNormGated.forward"


@class_verdict
def computes_gated_rms_norm(cls: type) -> bool:
    """True if ``cls.forward`` is ``Qwen3_5RMSNormGated.forward``'s code (Llama's norm order, times
    ``ACT2FN[self.activation](gate.float())``) and still the pinned statements. Once per class."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    return holds(GATED_PIN) and same_code(getattr(cls, "forward", None), Qwen3_5RMSNormGated.forward)


class CutileRMSNormGated(nn.Module):
    """Gated DeltaNet's output norm, ``forward(hidden_states, gate)``, on the ``rms_norm_gated``
    kernel, for the classes transformers decorates ``@use_kernel_forward_from_hub("RMSNormGated")``
    (``Qwen3_5RMSNormGated`` and its copies). Borrows ``weight`` ``(N,)``, ``variance_epsilon`` and
    ``activation`` (``"silu"``); inputs ``(..., N)``, output of the input's shape and dtype. Another
    class, or another activation, keeps its own forward (inference only)."""

    weight: torch.Tensor
    variance_epsilon: float
    activation: str

    can_torch_compile = True
    has_backward = False

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        cls = type(self)
        if not computes_gated_rms_norm(cls) or self.activation != "silu":
            if not torch.compiler.is_compiling():
                dispatch.fallback("rms_norm_gated", f"{cls.__name__} is not Qwen3_5RMSNormGated's formula with SiLU; "
                                  "it keeps its own forward")
            return cls.forward(self, hidden_states, gate)
        return rms_norm_gated(hidden_states, gate, self.weight, self.variance_epsilon)


#: transformers hub layer name -> layer class in this module (gathered by ``layers.MAPPING``).
MAPPING = {"RMSNorm": "CutileRMSNorm", "RMSNormZeroCentered": "CutileZeroCenteredRMSNorm",
           "RMSNormGated": "CutileRMSNormGated"}


# ---------------------------------------------------------------------------------------------
# Patches rms_norm_gemma and rms_norm_olmo2: the float32-order norms (Gemma's 1 + weight, OLMo 2's weight)
# ---------------------------------------------------------------------------------------------

#: Instance attribute the two float-order patches set on each module they take (the offset, 1.0 or
#: 0.0): kernelize rebinds the forward of a hub-decorated module after the patches ran (OLMo 2's
#: norms), and :class:`CutileRMSNorm` then runs the marked formula.
FLOAT_NORM_MARK = "_cutile_float_norm"

#: The pins (``layers/models/gemma.py``, ``olmo2.py``) of the two forwards the patches reproduce.
GEMMA_PINS = ("gemma.GemmaRMSNorm.forward", "gemma.GemmaRMSNorm._norm")
OLMO2_PIN = "olmo2.Olmo2RMSNorm.forward"


@class_verdict
def computes_gemma_rms_norm(cls: type) -> bool:
    """True if ``cls.forward`` and ``cls._norm`` are ``GemmaRMSNorm``'s code (float32, ``1 + weight``,
    one rounding) and still the pinned statements (:data:`GEMMA_PINS`). Once per class; a constant
    under ``torch.compile``."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    return (all(holds(p) for p in GEMMA_PINS) and same_code(getattr(cls, "forward", None), GemmaRMSNorm.forward)
            and same_code(getattr(cls, "_norm", None), GemmaRMSNorm._norm))


@class_verdict
def computes_olmo2_rms_norm(cls: type) -> bool:
    """True if ``cls.forward`` is ``Olmo2RMSNorm.forward``'s code (float32, ``weight``, one rounding)
    and still the pinned statements (:data:`OLMO2_PIN`). Once per class; a constant under compile."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    return holds(OLMO2_PIN) and same_code(getattr(cls, "forward", None), Olmo2RMSNorm.forward)


def _float_norm_eps(m: nn.Module):
    return m.eps if hasattr(m, "eps") else getattr(m, "variance_epsilon", None)


#: Forwards that compute a ``GemmaRMSNorm``-code class's own formula when bound on its instance: our
#: hub layer (``kernelize`` binds the build copy's: matched by name) and the ``rms_norm_gemma`` patch.
_GEMMA_FORMULA_FORWARDS = ("CutileZeroCenteredRMSNorm.forward", "gemma_norm_forward")
#: The same for an ``Olmo2RMSNorm``-code class: patch ``rms_norm_olmo2``'s forward, and our hub
#: layer (which runs that formula for such a class).
_OLMO2_FORMULA_FORWARDS = ("olmo2_norm_forward", "CutileRMSNorm.forward")


def _formula_norm(n, computes, forwards) -> bool:
    # The class computes the formula (``computes``), its weight is a tensor, and nobody replaced its
    # forward on the instance with something else (accelerate's offload hooks, a user's wrapper):
    # the class's own forward or one of ``forwards`` (by qualified name) is bound, or none.
    if not (isinstance(n, nn.Module) and computes(type(n)) and isinstance(getattr(n, "weight", None), torch.Tensor)):
        return False
    bound = n.__dict__.get("forward")
    if bound is None:
        return True
    fwd = getattr(bound, "__func__", None)
    return fwd is type(n).forward or getattr(fwd, "__qualname__", "") in forwards


def _gemma_formula_norm(n) -> bool:
    return _formula_norm(n, computes_gemma_rms_norm, _GEMMA_FORMULA_FORWARDS)


def olmo2_formula_norm(n) -> bool:
    """Whether module ``n`` computes ``Olmo2RMSNorm``'s formula (its class's code, an ``(N,)``
    weight tensor, a float eps, a forward that is the class's or computes the same): what a fused
    forward may run in its place."""
    return (_formula_norm(n, computes_olmo2_rms_norm, _OLMO2_FORMULA_FORWARDS) and n.weight.dim() == 1
            and isinstance(_float_norm_eps(n), float))


def gemma_qk_norms_verdict(m: nn.Module) -> str | None:
    """Why attention module ``m``'s ``q_norm`` / ``k_norm`` may not run as one
    ``qk_norm_rope_gemma`` (Qwen3.5's and Gemma 3's attention patches), or None: both must compute
    ``GemmaRMSNorm``'s formula (their class's code, a ``weight`` tensor, a forward that is the
    class's or computes the same) with one float eps."""
    qn, kn = getattr(m, "q_norm", None), getattr(m, "k_norm", None)
    if not all(_gemma_formula_norm(n) for n in (qn, kn)):
        return "its q_norm / k_norm are not GemmaRMSNorm-formula norms"
    eps = {_float_norm_eps(qn), _float_norm_eps(kn)}
    if len(eps) != 1 or not isinstance(next(iter(eps)), float):
        return f"its q_norm / k_norm eps {sorted(map(repr, eps))} are not one float"
    return None


def gemma_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``GemmaRMSNorm.forward`` (5.22.2) on the ``rms_norm_gemma`` kernel: ``x`` ``(..., N)`` ->
    ``(x / rms(x)) * (1 + weight)`` in float32, rounded once to ``x.dtype``."""
    return rms_norm_gemma(x, self.weight, _float_norm_eps(self), 1.0)


def olmo2_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``Olmo2RMSNorm.forward`` (5.22.2) on the ``rms_norm_gemma`` kernel with offset 0:
    ``(x / rms(x)) * weight`` in float32, rounded once to ``x.dtype``."""
    return rms_norm_gemma(x, self.weight, _float_norm_eps(self), 0.0)


def _float_norm_candidate(m: nn.Module) -> bool:
    return (isinstance(getattr(m, "weight", None), torch.Tensor) and _float_norm_eps(m) is not None
            and type(m).__name__.endswith("RMSNorm"))


def _float_norm_verdict(computes, pins, formula):
    def verdict(m: nn.Module) -> str | None:
        if not computes(type(m)):
            if not all(holds(p) for p in pins):
                return f"this transformers' {formula} is not the one reproduced ({TRANSFORMERS})"
            return f"its formula is not {formula}'s code"
        if m.weight.dim() != 1 or not isinstance(_float_norm_eps(m), float):
            return (f"weight of shape {tuple(m.weight.shape)} or eps {_float_norm_eps(m)!r} is not an (N,) tensor "
                    "and a float")
        return None
    return verdict


def _our_hub_forward(fwd) -> bool:
    # kernelize binds our hub layers (the build's copy: by name): the stock code or this same kernel.
    name = getattr(getattr(fwd, "__func__", None), "__qualname__", "")
    return name in ("CutileRMSNorm.forward", "CutileZeroCenteredRMSNorm.forward")


def _swap_float_norms(model: nn.Module, name: str, forward, verdict, offset: float) -> int:
    new = swap_forwards(model, name, forward, _float_norm_candidate, verdict, "{n} {cls} on the rms_norm_gemma kernel",
                        replaceable=_our_hub_forward, prepare=lambda m: setattr(m, FLOAT_NORM_MARK, offset))
    return sum(new.values())


def _restore_float_norms(model: nn.Module, name: str, forward, offset: float) -> int:
    marked = [m for m in model.modules() if m.__dict__.get(FLOAT_NORM_MARK) == offset]
    for m in marked:
        del m.__dict__[FLOAT_NORM_MARK]
    restore_forwards(model, name, forward, noun="norms")
    return len(marked)  # every module the patch took is marked, whoever rebound its forward since


def patch_rms_norm_gemma(model: nn.Module) -> int:
    """Patch ``rms_norm_gemma``: bind :func:`gemma_norm_forward` to every RMSNorm of ``model`` whose
    class computes ``GemmaRMSNorm``'s formula (see the module docstring). Same numbers as the stock
    forward on the CPU (the reference formula). Returns the number of modules newly patched."""
    return _swap_float_norms(model, "rms_norm_gemma", gemma_norm_forward,
                             _float_norm_verdict(computes_gemma_rms_norm, GEMMA_PINS, "GemmaRMSNorm"), 1.0)


def unpatch_rms_norm_gemma(model: nn.Module) -> int:
    """Undo :func:`patch_rms_norm_gemma`: the class forward again (where kernelize bound a hub layer
    of ours since, that layer's forward). Returns the modules restored."""
    return _restore_float_norms(model, "rms_norm_gemma", gemma_norm_forward, 1.0)


def patch_rms_norm_olmo2(model: nn.Module) -> int:
    """Patch ``rms_norm_olmo2``: bind :func:`olmo2_norm_forward` to every RMSNorm of ``model`` whose
    class computes ``Olmo2RMSNorm``'s formula. Returns the number of modules newly patched."""
    return _swap_float_norms(model, "rms_norm_olmo2", olmo2_norm_forward,
                             _float_norm_verdict(computes_olmo2_rms_norm, (OLMO2_PIN,), "Olmo2RMSNorm"), 0.0)


def unpatch_rms_norm_olmo2(model: nn.Module) -> int:
    """Undo :func:`patch_rms_norm_olmo2` (also where kernelize rebound the hub layer since: the
    hub layer's stock fallback again). Returns the modules restored."""
    return _restore_float_norms(model, "rms_norm_olmo2", olmo2_norm_forward, 0.0)


#: This module's patch rows (gathered by ``layers/_registry.py``). ``rms_norm_gemma`` is on by
#: default since the H200 bench of 2026-12-01 (gemma-3-1b: decode 1.8x, prefill 1.7x over our build
#: without it), ``rms_norm_olmo2`` since that of 2026-12-02 (olmo-2-1b over stock: prefill 1.15x,
#: decode 1.22x at batch 1 and 1.46x at 16, against 0.98x / 1.03x / 0.83x without it; docs/results.md).
PATCH_ROWS = [
    Patch("rms_norm_gemma", apply=patch_rms_norm_gemma, undo=unpatch_rms_norm_gemma, default=True,
          description="GemmaRMSNorm (float32, 1 + weight, one rounding) on one cuTile launch"),
    Patch("rms_norm_olmo2", apply=patch_rms_norm_olmo2, undo=unpatch_rms_norm_olmo2, default=True,
          description="Olmo2RMSNorm (float32, weight, one rounding) on the same kernel, offset 0"),
]
