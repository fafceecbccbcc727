"""RoPE layer for transformers' ``"rotary_pos_emb"`` hub function, and its mapping row.

transformers 5.22.2 decorates ``apply_rotary_pos_emb`` in 118 modeling modules with
``@use_kernel_forward_from_hub("rotary_pos_emb")``. ``kernels`` turns each decorated function into
an instance of a one-off ``nn.Module`` class (``Func``) whose ``forward`` calls the function, and
``@use_kernelized_func`` on the attention class lists that instance in the attention module's
``_kernel_funcs``, where ``kernels.kernelize`` finds it and rebinds its ``forward`` to ours (as for
any hub layer). The instance is the module-level ``apply_rotary_pos_emb`` the attention calls, so
the swap reaches every model of that modeling module in the process; on CPU tensors our forward
is the reference formula, bit-identical to the stock one.

The hub name covers functions with other math. Of the 118, 104 compile to the same code as
Llama's with Llama's ``rotate_half`` (Mistral, Qwen2, Qwen3, Phi, Gemma, ...). Olmo, Olmo2, Olmo3,
OlmoHybrid, FlexOlmo and Beam compile to OLMo 2's code (cast back to the input dtype, after
float32 math with their float32 cos/sin): :func:`~..ops.rope.apply_rope_cast` on the same kernel.
The others keep their own forward: HunyuanVL (float32 cos/sin), ESM, Evolla, ModernBERT,
ModernBERT-decoder (float32 math), GPT-OSS (half-width cos/sin), OpenAI privacy filter
(interleaved pairs), and NanoChat (Llama's code, but its ``rotate_half`` flips the other sign).

Partial rotary (``partial_rotary_factor < 1``): models that use Llama's function slice q and k to
the rotary part first (Phi), so the layer sees ``cos`` as wide as its (strided) ``q``; the op also
takes a narrower ``cos`` (the first R elements rotated, the rest passed through).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .. import dispatch
from ..ops.rope import apply_rope, apply_rope_cast
from ._match import class_verdict, same_code
from ._pins import TRANSFORMERS, holds

#: The pins (``layers/_pins.py``) of Llama's ``apply_rotary_pos_emb`` and ``rotate_half``
#: (``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``): the formula
#: ``kernel_src/rope.py`` reproduces.
PINS = ("llama.apply_rotary_pos_emb", "llama.rotate_half")


def wrapped_function(cls: type):
    """The Python function a ``kernels`` ``Func`` class wraps (its ``forward``'s closure), or None."""
    try:
        return inspect.getclosurevars(cls.forward).nonlocals.get("func")
    except (AttributeError, TypeError):
        return None


def _llama_functions():
    from transformers.models.llama import modeling_llama

    return wrapped_function(type(modeling_llama.apply_rotary_pos_emb)), modeling_llama.rotate_half


@class_verdict
def computes_llama_rope(cls: type) -> bool:
    """True if the ``Func`` class ``cls`` wraps a function computing Llama's RoPE formula: same code
    as Llama's ``apply_rotary_pos_emb``, resolving ``rotate_half`` to the same code as Llama's, and
    Llama's pair still being the pinned formula (:data:`PINS`). Once per
    class; a constant under ``torch.compile`` (:func:`~._match.class_verdict`)."""
    fn = wrapped_function(cls)
    llama_fn, llama_rotate = _llama_functions()
    rotate = getattr(fn, "__globals__", {}).get("rotate_half")
    return (fn is not None and llama_fn is not None
            and all(holds(p) for p in PINS) and same_code(fn, llama_fn) and same_code(rotate, llama_rotate))


#: The pin of OLMo 2's ``apply_rotary_pos_emb`` (Llama's formula in the promoted dtype, each
#: result cast back to its input's): the formula :func:`~..ops.rope.apply_rope_cast` computes.
OLMO2_PIN = "olmo2.apply_rotary_pos_emb"


@class_verdict
def computes_olmo2_rope(cls: type) -> bool:
    """True if the ``Func`` class ``cls`` wraps a function with the code of OLMo 2's
    ``apply_rotary_pos_emb`` (still the pinned one, :data:`OLMO2_PIN`) resolving ``rotate_half`` to
    Llama's code (and Llama's pins holding). Once per class."""
    from transformers.models.olmo2 import modeling_olmo2

    fn = wrapped_function(cls)
    olmo2_fn = wrapped_function(type(modeling_olmo2.apply_rotary_pos_emb))
    _, llama_rotate = _llama_functions()
    rotate = getattr(fn, "__globals__", {}).get("rotate_half")
    return (fn is not None and olmo2_fn is not None and holds(OLMO2_PIN) and all(holds(p) for p in PINS)
            and same_code(fn, olmo2_fn) and same_code(rotate, llama_rotate))


def llama_rope_function(fn) -> bool:
    """Whether ``fn``, the ``apply_rotary_pos_emb`` an attention forward calls (its modeling
    module's), computes Llama's RoPE formula: a ``kernels`` ``Func`` module (what transformers makes
    of a hub-decorated function) judged by :func:`computes_llama_rope`, or a plain function with
    Llama's code calling a ``rotate_half`` with Llama's code."""
    if isinstance(fn, nn.Module):
        return computes_llama_rope(type(fn))
    llama_fn, llama_rotate = _llama_functions()
    return same_code(fn, llama_fn or _llama_apply()) and same_code(getattr(fn, "__globals__", {}).get("rotate_half"),
                                                                   llama_rotate)


def olmo2_rope_function(fn) -> bool:
    """Whether ``fn``, the ``apply_rotary_pos_emb`` an attention forward calls (its modeling
    module's), computes OLMo 2's RoPE formula (:func:`computes_olmo2_rope` for a ``kernels`` ``Func``
    module; for a plain function the code of OLMo 2's, calling a ``rotate_half`` with Llama's code)."""
    if isinstance(fn, nn.Module):
        return computes_olmo2_rope(type(fn))
    from transformers.models.olmo2 import modeling_olmo2

    olmo2_fn = wrapped_function(type(modeling_olmo2.apply_rotary_pos_emb)) or modeling_olmo2.apply_rotary_pos_emb
    _, llama_rotate = _llama_functions()
    return (holds(OLMO2_PIN) and same_code(fn, olmo2_fn)
            and same_code(getattr(fn, "__globals__", {}).get("rotate_half"), llama_rotate))


def _llama_apply():
    from transformers.models.llama import modeling_llama

    return modeling_llama.apply_rotary_pos_emb


def partial_rope_attention_verdict(cls: type, pins: tuple[str, ...], attention_forward, rope,
                                   formula: str) -> str | None:
    """Why attention class ``cls`` may not take a reproduced forward that runs ``apply_rope`` for a
    family's partial-rotary ``apply_rotary_pos_emb`` (``rope``, with Llama's ``rotate_half``), or
    None: ``pins`` (the attention forward's and ``rope``'s) must hold, ``cls.forward`` be
    ``attention_forward``'s code, and the ``apply_rotary_pos_emb`` it calls ``rope``'s code
    (``formula`` names it in the reason). Phi-3's and Qwen3.5's attention patches ask it."""
    from transformers.models.llama.modeling_llama import rotate_half

    name = attention_forward.__qualname__
    if not all(holds(p) for p in pins):
        return (f"this transformers' {name.rpartition('.')[0]} / apply_rotary_pos_emb is not the one reproduced "
                f"({TRANSFORMERS})")
    fwd = getattr(cls, "forward", None)
    if not same_code(fwd, attention_forward):
        return f"its forward is not {name}'s code"
    called = fwd.__globals__.get("apply_rotary_pos_emb")
    if not (same_code(called, rope) and same_code(getattr(called, "__globals__", {}).get("rotate_half"), rotate_half)):
        return f"the apply_rotary_pos_emb it calls is not {formula}"
    return None


def function_name(cls: type) -> str:
    """``module.qualname`` of the function a ``kernels`` ``Func`` class wraps (for log lines)."""
    fn = wrapped_function(cls)
    return f"{fn.__module__}.{fn.__qualname__}" if fn is not None else cls.__qualname__


class CutileRotaryPosEmb(nn.Module):
    """``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` on the cuTile RoPE kernel.

    Replaces the forward of the ``Func`` module ``kernels`` makes of a decorated function (see the
    module docstring); stateless. Shapes, dtypes and layouts as :func:`cutile_kernels.apply_rope`
    (Llama's code) or :func:`cutile_kernels.apply_rope_cast` (OLMo 2's); returns ``(q_embed,
    k_embed)``. A function with another formula keeps its own forward and says so once.
    """

    can_torch_compile = True
    has_backward = False

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        cls = type(self)
        if computes_llama_rope(cls):  # cached verdicts; constants under torch.compile
            return apply_rope(q, k, cos, sin, unsqueeze_dim)
        if computes_olmo2_rope(cls):
            return apply_rope_cast(q, k, cos, sin, unsqueeze_dim)
        if not torch.compiler.is_compiling():  # counted and announced in eager; traced, the stock code
            dispatch.fallback("rope", f"{function_name(cls)} is neither Llama's nor OLMo 2's apply_rotary_pos_emb "
                              "formula; it keeps its own")
        return cls.forward(self, q, k, cos, sin, unsqueeze_dim)


#: Attribute marking :meth:`CutileRotaryPosEmb.forward` (in this package and in a build's copy of it),
#: which ``_direct`` looks for on a hub module's bound forward: dynamo reads a function's attributes as
#: eager Python does, but not its ``__qualname__`` (torch 2.13 gave the type's descriptor).
ROPE_FORWARD_MARK = "_cutile_rope_forward"
setattr(CutileRotaryPosEmb.forward, ROPE_FORWARD_MARK, True)

#: transformers hub layer name -> layer class in this module (gathered by ``layers.MAPPING``).
MAPPING = {"rotary_pos_emb": "CutileRotaryPosEmb"}
