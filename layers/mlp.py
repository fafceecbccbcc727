"""SwiGLU MLP: the ``SiLU`` hub layer, and a gate/up-fused MLP for Llama-formula MLP classes.

``LlamaMLP.forward`` (transformers v5.22.2; Mistral, Qwen2, Qwen3 and ~120 other classes compile
to the same code) is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: two GEMMs on the same
input, then ``F.silu`` and a multiply, three elementwise passes over (tokens, intermediate).
:func:`fuse_mlp` rewrites such a module in place to one GEMM on the stacked weight
``gate_up_proj.weight = [gate; up]`` (``(2I, H)``, cuBLAS through ``F.linear``) followed by our
``silu_and_mul`` on the two halves of its output (one pass) and ``down_proj``.

Weights: the stacked weight is the only copy (the two originals are freed), and the module's
``state_dict()`` still has the stock keys ``gate_proj.weight`` and ``up_proj.weight`` (views of the
two halves, so ``save_pretrained`` writes the stock checkpoint, same keys and bytes);
``load_state_dict`` with the stock keys writes into the stacked weight. :func:`unfuse_mlp` restores
the stock modules.

Why after loading and not through transformers' load-time hooks (v5.22.2): a ``<Layer>Layout``
class that ``register_kernel_replacements_and_fusions`` loads for a ``kernel_config`` entry (a) in
the string-key case is patched in by class name (``LlamaMLP`` or a regex) but registers its
``conversion_mapping`` for the ``model_type`` of *any* model loaded with that config, so one
config that serves every architecture would concatenate ``mlp.gate_proj``/``mlp.up_proj`` of a
Gemma or Phi checkpoint into a key their MLPs lack (the weights would load as missing, i.e.
random); (b) in the tuple-key (fusion) case replaces ``gate_proj`` with the layout and ``up_proj``
with ``nn.Identity``, while the parent's own ``LlamaMLP.forward`` still runs ``act_fn(gate(x)) *
up(x)``, which cannot express SwiGLU; (c) registers the patch and the conversion process-wide
and permanently, and re-registering appends the converter again on every load. The
``fusion_config`` route (``transformers.fusion_mapping``) has a per-module ``is_fusable`` check,
but its registry is private and the flag is serialised into ``config.json``. So the fusion runs
on the loaded model (the fallback patcher calls :func:`fuse_mlp`), which also covers models
loaded before kernelize.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter

import torch
from torch import nn

from ..ops.activation import gelu_tanh_and_mul_fused, silu, silu_and_mul_fused
from ..ops.gemv import residual_tile
from ._direct import _plain_call, glu_linear, linear, residual_linear
from ._fusion import Stacking, fuse_one, linear_problem, reduce_fused, unfuse_one
from ._match import same_code
from ._patching import Patch
from ._pins import TRANSFORMERS, holds

logger = logging.getLogger("cutile_kernels")

#: The pin (``layers/_pins.py``) of the formula the fused forward reproduces; if transformers
#: changes it, nothing is fused.
PIN = "llama.LlamaMLP.forward"

#: The stacked gate/up projection that :func:`fuse_mlp` adds (``(2I, H)`` weight, gate rows first).
FUSED_NAME = "gate_up_proj"
_STOCK = ("gate_proj", "up_proj")


class CutileSiLU(nn.Module):
    """transformers' ``SiLUActivation`` (hub name ``"SiLU"``) on the cuTile SiLU kernel.

    Input any shape; output of the same shape and dtype, ``silu`` computed in float32 and rounded
    once, as ``nn.functional.silu``. It is what ``LlamaMLP.act_fn`` is (``ACT2FN["silu"]``), so a
    mapping row ``"SiLU"`` would reach every unfused Llama-formula MLP; the shipped mapping leaves
    it out (see :data:`MAPPING`), and a fused MLP does not call ``act_fn``.
    """

    can_torch_compile = True
    has_backward = False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return silu(input)


class CutileSwiGLUMLP(nn.Module):
    """``LlamaMLP.forward`` on a stacked gate/up weight: ``down(silu_and_mul(gate_up(x)))``.

    Borrows ``gate_up_proj`` (``nn.Linear(H, 2I)``, rows ``[gate; up]``) and ``down_proj``
    (``nn.Linear(I, H)``) from the module :func:`fuse_mlp` rewrote. Input ``(..., H)``, output
    ``(..., H)`` of the weights' dtype. The GEMMs are cuBLAS (``F.linear``); the activation is
    one cuTile pass over the two halves of the GEMM output (transformers' rounding order). With
    patch ``gemv`` on ``down_proj``, a one-row compiled or captured step can run the activation and
    the down projection as one launch (``gemv_swiglu``, :func:`._direct.glu_linear`) on the GEMV tiles
    of ``ops.gemv.GLU_TILES`` (none yet).
    """

    gate_up_proj: nn.Linear
    down_proj: nn.Linear

    can_torch_compile = True
    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The projections through F.linear when their module calls would run nothing else (_direct).
        return glu_linear(self.down_proj, linear(self.gate_up_proj, x))


class CutileGeGLUMLP(nn.Module):
    """``LlamaMLP.forward`` with a ``gelu_pytorch_tanh`` ``act_fn`` (Gemma's MLP) on a stacked gate/up
    weight: ``down(gelu_tanh_and_mul(gate_up(x)))``. Shapes as :class:`CutileSwiGLUMLP`; with patch
    ``gemv`` on ``down_proj`` likewise ``gemv_geglu`` (on ``GLU_TILES``' tiles)."""

    gate_up_proj: nn.Linear
    down_proj: nn.Linear

    can_torch_compile = True
    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return glu_linear(self.down_proj, linear(self.gate_up_proj, x), gelu=True)


def residual_forward(m: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
    """``residual + m(x)`` (a decoder layer's last line) for an MLP that :func:`fuse_mlp` switched to
    :class:`CutileSwiGLUMLP`'s or :class:`CutileGeGLUMLP`'s forward, where nothing else would run on its
    call (no hooks, no forward of its own on the instance): the stacked gate/up projection, the
    activation, and the down projection with the add (:func:`._direct.residual_linear`: in a compiled or
    captured one-row step the GEMV adds in its epilogue, one launch less than the add after it, the
    same bits). Input ``(..., H)``, residual and output ``(..., H)``. None for any other module, where
    the down projection's tile is not one of ``ops.gemv.RESIDUAL_TILES`` (none yet), and where it fuses
    the activation instead (``ops.gemv.GLU_TILES``): the caller calls the module and adds."""
    forward = type(m).forward
    if forward is not CutileSwiGLUMLP.forward and forward is not CutileGeGLUMLP.forward:
        return None
    # The tile first: while nothing is routed, a compiled step reads (guards) nothing more.
    if not residual_tile(m.down_proj.weight) or "forward" in m.__dict__ or not _plain_call(m):
        return None
    act = gelu_tanh_and_mul_fused if forward is CutileGeGLUMLP.forward else silu_and_mul_fused
    return residual_linear(m.down_proj, act(linear(m.gate_up_proj, x)), residual)


@functools.lru_cache(maxsize=None)
def computes_llama_mlp(cls: type) -> bool:
    """True if ``cls.forward`` is ``LlamaMLP.forward``'s code (same bytecode, names, constants),
    and ``LlamaMLP.forward`` is still the pinned formula (:data:`PIN`)."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    return holds(PIN) and same_code(getattr(cls, "forward", None), LlamaMLP.forward)


def _silu_classes() -> tuple:
    from transformers.activations import SiLUActivation

    return (SiLUActivation, nn.SiLU)


def _is_gelu_tanh(act) -> bool:
    # transformers' GELUTanh on torch's C gelu (not its use_gelu_tanh_python formula).
    from transformers.activations import GELUTanh

    f = getattr(act, "act", None)
    return (type(act) is GELUTanh and isinstance(f, functools.partial) and f.func is nn.functional.gelu
            and f.keywords == {"approximate": "tanh"} and not f.args)


def why_not_fusable(module: nn.Module, kind: str = "silu") -> str | None:
    """Why :func:`fuse_mlp` leaves ``module`` alone, or None if it fuses it (see
    :func:`is_fusable_mlp`); ``kind`` is the activation the fusion is for (``"silu"``, SwiGLU, or
    ``"gelu_tanh"``, GeGLU)."""
    if getattr(module, "_cutile_unfused_class", None) is not None:
        return "already fused"
    if not computes_llama_mlp(type(module)):
        return f"its forward is not LlamaMLP.forward (transformers {TRANSFORMERS})"
    act = getattr(module, "act_fn", None)
    if kind == "silu" and type(act) not in _silu_classes():
        return f"act_fn is {type(act).__name__}, not SiLU"
    if kind == "gelu_tanh" and not _is_gelu_tanh(act):
        return f"act_fn is {type(act).__name__}, not GELUTanh on torch's gelu(approximate='tanh')"
    for name in ("gate_proj", "up_proj", "down_proj"):
        problem = linear_problem(getattr(module, name, None))
        if problem:
            return f"{name} {problem}"
    g, u, d = module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight
    if g.shape != u.shape or d.shape != (g.shape[1], g.shape[0]):
        return f"weight shapes {tuple(g.shape)}, {tuple(u.shape)}, {tuple(d.shape)} do not chain"
    if not (g.dtype == u.dtype == d.dtype and g.device == u.device == d.device):
        return "weights differ in dtype or device"
    if g.requires_grad != u.requires_grad:
        return "gate_proj and up_proj differ in requires_grad (one stacked weight would train both or neither)"
    return None


def is_fusable_mlp(module: nn.Module) -> bool:
    """True if :func:`fuse_mlp` applies to ``module``.

    That is: its class computes ``LlamaMLP.forward`` (:func:`computes_llama_mlp`), ``act_fn`` is
    transformers' ``SiLUActivation`` or ``nn.SiLU``, and ``gate_proj``, ``up_proj``,
    ``down_proj`` are plain bias-free ``nn.Linear`` layers with ``(I, H)``, ``(I, H)``, ``(H, I)``
    weights of one dtype on one device, without forward hooks. Already fused modules are not.
    """
    return why_not_fusable(module) is None


@functools.lru_cache(maxsize=None)
def fused_class(cls: type) -> type:
    """The subclass of ``cls`` that a fused module is switched to: ``cls`` with
    :class:`CutileSwiGLUMLP`'s forward (``isinstance`` checks against ``cls`` still hold)."""
    return _make_fused_class(cls, CutileSwiGLUMLP.forward, "silu", "")


@functools.lru_cache(maxsize=None)
def geglu_fused_class(cls: type) -> type:
    """:func:`fused_class` for a GeGLU MLP (:class:`CutileGeGLUMLP`'s forward)."""
    return _make_fused_class(cls, CutileGeGLUMLP.forward, "gelu_tanh", "GeGLU")


def _make_fused_class(cls: type, forward, kind: str, tag: str) -> type:
    return type(f"CutileFused{tag}{cls.__name__}", (cls,), {
        "forward": forward,
        "_cutile_unfused_class": cls,
        "_cutile_act_kind": kind,
        "__module__": __name__,
        "__reduce_ex__": functools.partialmethod(reduce_fused, _STACKINGS[kind]),  # pickles via the stock class
        "__doc__": f"{cls.__name__} with gate_proj and up_proj stacked into {FUSED_NAME} (see layers.mlp).",
    })


def _row_slices(module: nn.Module) -> tuple[slice, slice]:
    # gate rows, then up rows: the two halves of the stacked weight.
    half = module.gate_up_proj.weight.shape[0] // 2
    return slice(0, half), slice(half, None)


def _gate_up_mismatch(keys: list, given: list, current: list) -> list:
    # Gate and up must agree with each other, not with the current halves: stacked rows of another
    # size are then reported by the module, under gate_up_proj.weight.
    gate, up = (want if t is None else t for t, want in zip(given, current))
    if gate.shape != up.shape:
        return [f"size mismatch for {keys[0]} {tuple(gate.shape)} and {keys[1]} {tuple(up.shape)}"]
    return []


_STACKING = Stacking(stock=_STOCK, fused=FUSED_NAME, row_slices=_row_slices, fused_class=fused_class,
                     unfused_attr="_cutile_unfused_class", hooks_attr="_cutile_fusion_hooks",
                     mismatch=_gate_up_mismatch)
#: activation kind -> its stacking spec (the same weights layout, another fused class).
_STACKINGS = {"silu": _STACKING,
              "gelu_tanh": Stacking(stock=_STOCK, fused=FUSED_NAME, row_slices=_row_slices,
                                    fused_class=geglu_fused_class, unfused_attr="_cutile_unfused_class",
                                    hooks_attr="_cutile_fusion_hooks", mismatch=_gate_up_mismatch)}


def fuse_mlp(model: nn.Module, kind: str = "silu") -> int:
    """Stack ``gate_proj`` and ``up_proj`` of every fusable MLP in ``model`` (in place).

    Each module for which :func:`is_fusable_mlp` holds gets a ``gate_up_proj`` ``nn.Linear(H,
    2I)`` whose weight is ``cat([gate_proj.weight, up_proj.weight])``; ``gate_proj`` and
    ``up_proj`` are removed (their weights are freed once nothing else refers to them; at most
    one module's pair is held twice at a time), and the module's class becomes
    :func:`fused_class` of its class, whose forward is :class:`CutileSwiGLUMLP`'s. ``state_dict``
    and ``load_state_dict`` keep using the stock keys (see the module docstring). Works on any
    device; on CUDA the activation is our kernel, elsewhere the reference formula. Modules that
    are already fused, or not fusable, are left alone.

    ``kind="gelu_tanh"`` does the same for GeGLU MLPs (Gemma's: ``act_fn`` ``gelu_pytorch_tanh``),
    whose fused forward is :class:`CutileGeGLUMLP`'s.

    Returns:
        The number of modules fused by this call.
    """
    targets, skipped = [], Counter()
    for m in model.modules():
        why = why_not_fusable(m, kind)
        if why is None:
            targets.append(m)
        elif all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj")) and why != "already fused":
            skipped[(type(m).__name__, why)] += 1
    for m in targets:
        fuse_one(m, _STACKINGS[kind])
    if targets:
        logger.info("cutile_kernels: stacked gate_proj and up_proj of %d MLPs (%s)", len(targets),
                    ", ".join(sorted({type(m).__name__ for m in targets})))
    for (cls, why), n in sorted(skipped.items()):
        logger.info("cutile_kernels: left %d %s unfused: %s", n, cls, why)
    return len(targets)


def unfuse_mlp(model: nn.Module, kind: str = "silu") -> int:
    """Undo :func:`fuse_mlp` (of that ``kind``): give every such fused MLP in ``model`` back its own
    ``gate_proj`` and ``up_proj`` (copies of the two halves, after which the stacked weight is
    freed) and its original class. Returns the number of modules restored."""
    targets = [m for m in model.modules() if getattr(type(m), "_cutile_unfused_class", None) is not None
               and getattr(type(m), "_cutile_act_kind", "silu") == kind]
    for m in targets:
        unfuse_one(m, _STACKINGS[kind])
    return len(targets)


def fuse_geglu_mlp(model: nn.Module) -> int:
    """Patch ``fused_gate_up_geglu``: :func:`fuse_mlp` for GeGLU MLPs. Returns the modules fused."""
    return fuse_mlp(model, "gelu_tanh")


def unfuse_geglu_mlp(model: nn.Module) -> int:
    """Undo :func:`fuse_geglu_mlp`. Returns the modules restored."""
    return unfuse_mlp(model, "gelu_tanh")


#: transformers hub layer name -> layer class in this module. Not gathered into ``layers.MAPPING``
#: (``layers/_registry.py`` leaves this module out of ``MAPPING_MODULES``): on the H200 our SiLU lost to ``F.silu`` at
#: prefill (27.9 vs 19.6 us at 2048 x 8192 bf16, benchmarks/results/h200-2026-11-30b), and alone it
#: saves no launch. The fused MLP (patch ``fused_gate_up``) is what runs in models.
MAPPING = {"SiLU": "CutileSiLU"}


#: This module's patch row (gathered by ``layers/_registry.py``, after the decoder patch).
PATCH_ROWS = [Patch("fused_gate_up", apply=fuse_mlp, undo=unfuse_mlp,
                    description="gate_proj and up_proj of each SwiGLU MLP as one GEMM, then our silu_and_mul"),
              # Default since the same-run A/B of 2026-12-05 (Gemma-3-1B, with Gemma's gemma_add_norm and
              # gemma3_qk_norm_rope: layers/models/gemma.py; estimate before: ceiling ~1.02-1.04 for eager decode).
              Patch("fused_gate_up_geglu", apply=fuse_geglu_mlp, undo=unfuse_geglu_mlp,
                    description="gate_proj and up_proj of each GeGLU MLP (Gemma) as one GEMM, then our "
                                "gelu_tanh_and_mul")]
