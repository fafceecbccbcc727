"""Patch ``rope_cos_sin``: the rotary embedding's cos/sin tables on one cuTile launch.

transformers does not decorate the rotary embedding classes for the hub, so the fallback
patcher swaps the forward of each module whose class computes ``LlamaRotaryEmbedding.forward``
(transformers v5.22.2; 123 classes compile to the same code, among them Llama, Mistral, Qwen2,
Qwen3, DiffLlama and Mistral4): the instance's ``forward`` becomes
:class:`CutileRotaryEmbedding`'s, which calls ``cutile_kernels.rope_cos_sin`` with the module's
``inv_freq`` and ``attention_scaling``. Stock eager runs ~9 small kernels there per forward.

RoPE scaling types: ours is wrapped in transformers' own ``dynamic_rope_update`` (and
``torch.no_grad``), exactly as the stock forward is, so ``dynamic`` and ``longrope`` still update
``inv_freq`` / ``attention_scaling`` before the tables are computed, and every other type (default,
linear, yarn, llama3) is already in those two attributes. No rope type is left out.

Left alone, with a log line per class: classes with another forward (Gemma3, GPT-OSS, Qwen2-VL's
multimodal RoPE, ...), a forward wrapped differently from Llama's, and modules whose forward is
already replaced on the instance (e.g. accelerate hooks).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn
from transformers.modeling_rope_utils import dynamic_rope_update

from ..ops.rope_cos_sin import rope_cos_sin
from ._match import same_code
from ._pins import TRANSFORMERS, holds
from ._patching import Patch, restore_forwards, swap_forwards

logger = logging.getLogger("cutile_kernels")

#: The pin (``layers/_pins.py``) of the undecorated ``LlamaRotaryEmbedding.forward``: the formula
#: ``kernel_src/rope_cos_sin.py`` reproduces. Another formula patches nothing.
PIN = "llama.LlamaRotaryEmbedding.forward"


def _wrappers(fn) -> list:
    # fn, then what each functools.wraps layer wraps: [no_grad wrapper, dynamic_rope_update wrapper, forward].
    chain = []
    while fn is not None and len(chain) < 8:
        chain.append(fn)
        fn = getattr(fn, "__wrapped__", None)
    return chain


@functools.lru_cache(maxsize=None)
def rotary_verdict(cls: type) -> str | None:
    """Why ``cls`` (a rotary embedding class) does not take our forward, or None if it does: its
    ``forward`` must be ``LlamaRotaryEmbedding.forward``'s code under the same decorators
    (``torch.no_grad``, ``dynamic_rope_update``), and that forward must still be the pinned
    formula (:data:`PIN`)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    ref = _wrappers(LlamaRotaryEmbedding.forward)
    if not holds(PIN):
        return f"this transformers' LlamaRotaryEmbedding.forward is not the one the kernel reproduces ({TRANSFORMERS})"
    got = _wrappers(getattr(cls, "forward", None))
    if len(got) != len(ref) or not all(same_code(a, b) for a, b in zip(got, ref)):
        return "its forward is not LlamaRotaryEmbedding.forward's code (with the same decorators)"
    return None


class CutileRotaryEmbedding(nn.Module):
    """``LlamaRotaryEmbedding.forward(x, position_ids)`` on the cuTile cos/sin kernel.

    Borrows ``inv_freq`` (``(R/2,)`` float32 buffer) and ``attention_scaling`` (float) from the
    module it is bound to (plus ``rope_type``, ``config`` and friends, which
    ``dynamic_rope_update`` reads). ``x``: any tensor, only its dtype and device are used;
    ``position_ids``: ``(B, S)`` int64. Returns ``(cos, sin)``, ``(B, S, R)`` in ``x.dtype``.
    """

    inv_freq: torch.Tensor
    attention_scaling: float

    can_torch_compile = True
    has_backward = False

    def _forward(self, x, position_ids):
        inv_freq = self.inv_freq.to(device=x.device, dtype=torch.float)
        return rope_cos_sin(inv_freq, position_ids, self.attention_scaling, x.dtype)

    # Same decorators as the stock forward: no autograd graph, dynamic / longrope updates first.
    _forward.__qualname__ = "CutileRotaryEmbedding.forward"
    forward = torch.no_grad()(dynamic_rope_update(_forward))
    del _forward


def _looks_rotary(m: nn.Module) -> bool:
    # Candidates (patched or logged): what holds Llama's state, and any class named like one.
    return (isinstance(m._buffers.get("inv_freq"), torch.Tensor) and hasattr(m, "attention_scaling")
            or type(m).__name__.endswith("RotaryEmbedding"))


def patch_rotary_embeddings(model: nn.Module) -> int:
    """Patch ``rope_cos_sin``: bind :class:`CutileRotaryEmbedding`'s forward to every rotary
    embedding of ``model`` whose class passes :func:`rotary_verdict` (and whose instance forward
    nobody replaced). Same results as the stock forward on the CPU (the reference formula); on
    CUDA one kernel launch per call. Returns the number of modules newly patched."""
    new = swap_forwards(model, "rope_cos_sin", CutileRotaryEmbedding.forward, _looks_rotary,
                        lambda m: rotary_verdict(type(m)), "cos/sin of {n} {cls} on one cuTile launch")
    return sum(new.values())


def unpatch_rotary_embeddings(model: nn.Module) -> int:
    """Undo :func:`patch_rotary_embeddings`: the class forward again. Returns the modules restored."""
    return restore_forwards(model, "rope_cos_sin", CutileRotaryEmbedding.forward)


__all__ = ["PIN", "CutileRotaryEmbedding", "patch_rotary_embeddings", "rotary_verdict",
           "unpatch_rotary_embeddings"]


#: This module's patch row (gathered by ``layers/_registry.py``). Opt-in: autokernelize discarded it
#: on the H200 (2026-11-30; benchmarks/results/autokernelize.tsv): correct everywhere, but no
#: throughput gain that the bench could tell from the host's drift.
PATCH_ROWS = [Patch("rope_cos_sin", apply=patch_rotary_embeddings, undo=unpatch_rotary_embeddings,
                    description="the rotary embedding's cos/sin tables (LlamaRotaryEmbedding code) on one cuTile launch",
                    default=False)]
