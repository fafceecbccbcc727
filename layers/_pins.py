"""The transformers code we reproduce or match, in one table, pinned to the release it was read in.

Every kernel path and patch of ours computes some transformers function's math (``LlamaRMSNorm``'s
rounding order, ``LlamaDecoderLayer.forward``'s residual stream, ...). Each such function is a
:class:`Pin`: where it lives, the :func:`~._match.statements_digest` of its body in
:data:`TRANSFORMERS`, and what of ours relies on it. A verdict asks :func:`holds` before it lets
our code run for a class: a transformers release that changes a pinned function turns the kernel
path or patch that relies on it off (the stock forward runs, with a log line), never on changed
code. ``cutile-kernels pins check`` tells which pins hold for the installed transformers and shows
the diff of each that does not (the pinned sources are kept beside the tools), so moving to a new
release is reading those diffs, updating the reproductions and the digests here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from ._match import same_code, statements_digest

#: The transformers release every pin was read in.
TRANSFORMERS = "5.22.2"


@dataclass(frozen=True)
class Pin:
    """One pinned transformers function.

    Attributes:
        module: the modeling module's short name (``"llama"`` for
            ``transformers.models.llama.modeling_llama``), or a module path under
            ``transformers`` that is dotted (``"integrations.sdpa_attention"``) or ends in
            ``_utils`` (``"cache_utils"``).
        qualname: the function in it (``"LlamaRMSNorm.forward"``, ``"rotate_half"``); a function
            the hub decorator turned into a ``kernels`` module (``apply_rotary_pos_emb``) is the
            function it wraps, a decorated method the undecorated one (as ``inspect`` unwraps it).
        digest: its :func:`~._match.statements_digest` in :data:`TRANSFORMERS`.
        used_by: what of ours computes or relies on it (for reports).
        gates: our code for it runs only while it holds (a reproduced formula or forward); False
            for code we follow but do not reproduce (an interface's contract): reported only.
    """

    module: str
    qualname: str
    digest: str
    used_by: str
    gates: bool = True

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"

    def function(self):
        """The installed transformers' function (None when it is gone)."""
        path = (f"transformers.{self.module}" if "." in self.module or self.module.endswith("_utils")
                else f"transformers.models.{self.module}.modeling_{self.module}")
        try:
            obj = importlib.import_module(path)
            for part in self.qualname.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            return None
        wrapped = _kernels_func(obj)
        return wrapped if wrapped is not None else obj


def _kernels_func(obj):
    # The Python function a ``kernels`` ``Func`` module wraps (its forward's closure), or None.
    import inspect

    forward = getattr(type(obj), "forward", None)
    if forward is None or not hasattr(type(obj), "kernel_layer_name"):
        return None
    try:
        return inspect.getclosurevars(forward).nonlocals.get("func")
    except (TypeError, ValueError):
        return None


#: name -> Pin: every pin, those of the interfaces below and those the family modules declare
#: (``layers/models/*.py``, registered by ``layers/_registry.py``). Digests of transformers 5.22.2.
PINS: dict[str, Pin] = {}


def register(*pins: Pin) -> None:
    """Add pins to :data:`PINS` (a family module's, at import; the same pin again is a no-op).

    Raises:
        ValueError: another pin of that name is registered.
    """
    for p in pins:
        if PINS.get(p.name, p) != p:
            raise ValueError(f"pin {p.name!r} is declared twice with different values")
        PINS[p.name] = p


# Matched, not reproduced: our code follows these interfaces' contracts (gates=False). Reported by
# `pins check`; nothing asks them at run time. The families' own pins are in layers/models/.
register(
    Pin("integrations.sdpa_attention", "sdpa_attention_forward", "c356aebf5d0f5113",
        "attn_implementation='cutile' (cutile_attention_forward takes sdpa's arguments and masks, and hands it "
        "the calls route() gives sdpa)", gates=False),
    Pin("integrations.hub_kernels", "kernelize", "e45cac02bd1557ef", "kernel_config() through from_pretrained (the swap "
        "after CutileKernelConfig.create_compatible_mapping)", gates=False),
    Pin("integrations.hub_kernels", "register_kernel_replacements_and_fusions", "98c8832e89270c64",
        "CutileKernelConfig (unwraps the (repo, metadata) tuples this function writes)", gates=False),
    Pin("utils.kernel_config", "KernelConfig.create_compatible_mapping", "2486ed7b90f8a63f",
        "CutileKernelConfig.create_compatible_mapping (calls it for CUDA models)", gates=False),
    Pin("utils.kernel_config", "KernelConfig.sanitize_kernel_mapping", "af34dae3c640b84b",
        "CutileKernelConfig.sanitize_kernel_mapping (drops names the model lacks, then calls it)", gates=False),
)


def digest_now(name: str) -> str | None:
    """The pinned function's digest in the installed transformers (None: gone, or no source)."""
    fn = PINS[name].function()
    return None if fn is None else statements_digest(fn)


def holds(name: str) -> bool:
    """Whether the installed transformers' function still has the pinned statements.

    Raises:
        KeyError: no such pin.
    """
    return digest_now(name) == PINS[name].digest


def forward_verdict(cls: type, pin: str, reference) -> str | None:
    """Why class ``cls`` may not take a fused forward that reproduces ``reference`` (a transformers
    method, pinned as ``pin``), or None if it may: the installed ``reference`` must still be the
    pinned statements and ``cls.forward`` its code (:func:`~._match.same_code`)."""
    name = reference.__qualname__
    if not holds(pin):
        return f"this transformers' {name} is not the one the fused forward reproduces ({TRANSFORMERS})"
    if not same_code(getattr(cls, "forward", None), reference):
        return f"its forward is not {name}'s code"
    return None


__all__ = ["PINS", "TRANSFORMERS", "Pin", "digest_now", "forward_verdict", "holds", "register"]
