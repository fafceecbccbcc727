"""Layers in the Hugging Face ``kernels`` convention, the kernelize mapping, and the entry points
that apply it (:func:`kernel_config` for ``from_pretrained``, :func:`kernelize` for a loaded model).

Each op-family module here defines its layer classes and a ``MAPPING`` of transformers hub layer
names to them, each feature module its patches (``PATCH_ROWS``); ``_registry.py`` gathers both, so
adding a layer or a patch edits only its own module.
"""

from __future__ import annotations

from ._registry import MAPPING, OPT_IN_LAYERS
from .attention import cutile_attention_forward, register_attention
from .decode_graphs import CacheFullError, disable_decode_graphs, enable_decode_graphs
# kernels looks a mapped layer up by class name on this module (tests/test_structure.py checks all are).
from .gated_delta import (CutileCausalConv1dFn, CutileCausalConv1dUpdate, CutileChunkGatedDeltaRule,
                          CutileFusedRecurrentGatedDeltaRule, CutileGatedDeltaNet)
from .norm import CutileRMSNorm, CutileRMSNormGated, CutileZeroCenteredRMSNorm
from .rope import CutileRotaryPosEmb

# attn_implementation="cutile" (and "cutile_kernel") work as soon as the package is imported; a
# copy imported after another (the build variant kernels loads) keeps the first one's forwards.
register_attention(replace=False)


def kernel_config(build_dir=None, exclude=(), include=(), decode_graphs: bool = False):
    """A transformers ``KernelConfig`` that maps our layers from the local build and applies our
    default patches, without the hub layers and patches named in ``exclude`` and with the opt-in
    patches named in ``include``; ``decode_graphs`` switches on the CUDA-graph decode fast path
    (see ``hub.kernel_config``)."""
    from .hub import kernel_config as _kernel_config

    return _kernel_config(build_dir, exclude=exclude, include=include, decode_graphs=decode_graphs)


def kernelize(model, mode=None, build_dir=None, include=()):
    """Swap our layers into an already-loaded model (see ``hub.kernelize``); ``include``: opt-in
    hub layers (``OPT_IN_LAYERS``) to map too."""
    from .hub import kernelize as _kernelize

    return _kernelize(model, mode=mode, build_dir=build_dir, include=include)


__all__ = ["CacheFullError", "CutileCausalConv1dFn", "CutileCausalConv1dUpdate", "CutileChunkGatedDeltaRule",
           "CutileFusedRecurrentGatedDeltaRule", "CutileGatedDeltaNet", "CutileRMSNorm", "CutileRMSNormGated", "CutileRotaryPosEmb",
           "CutileZeroCenteredRMSNorm", "MAPPING", "OPT_IN_LAYERS", "disable_decode_graphs",
           "enable_decode_graphs", "kernel_config", "kernelize"]
