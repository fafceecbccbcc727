"""Gathers what the feature and family modules declare: the kernelize mapping rows (``MAPPING``), the
patches (``PATCH_ROWS``) and the families' pins, in one place and one order, so that adding a layer
or a patch edits only its own module (and, for a new feature module, the tuples here; a new family
module is found by name)."""

from __future__ import annotations

from . import _pins, gated_delta, kv_cache, linear, mlp, models, norm, qkv, rope, rope_cos_sin
from . import patch as decoder
from ._patching import PATCHES, register

#: Modules whose ``MAPPING`` rows (transformers hub layer name -> layer class) are gathered. mlp's
#: ``SiLU`` row is left out: on the H200 our SiLU lost to ``F.silu`` at prefill, and alone it saves
#: no launch (the fused MLP, patch ``fused_gate_up``, is what runs).
MAPPING_MODULES = (norm, rope, gated_delta)
#: Modules whose ``MAPPING`` rows are left out on purpose (tests/test_structure.py checks that every
#: module with rows is in one tuple or the other).
MAPPING_LEFT_OUT = (mlp,)
for _family in models.FAMILIES.values():
    _pins.register(*_family.pins)

#: Modules whose ``PATCH_ROWS`` are registered, in apply order (undone in reverse): the shared
#: features (the DynamicCache's first write among them), then the attention switch over every
#: family (``models``), then the families' own (after the features they build on), then fused
#: q/k/v (which must see the attention forwards the others chose), then the opt-in float32-order
#: norms, then the one-row GEMV (it covers the stacked projections, so it comes after every patch
#: that makes them).
PATCH_MODULES = (decoder, mlp, rope_cos_sin, kv_cache, models,
                 *(m for m in models.modules() if hasattr(m, "PATCH_ROWS")), qkv, norm, linear)

#: transformers hub layer name -> class name in this package, gathered from the family modules.
MAPPING: dict[str, str] = {}
#: Hub layers of ``MAPPING`` that ``kernel_config()`` maps only when named in ``include`` (a module's
#: ``OPT_IN``): the end-to-end bench has not accepted them yet.
OPT_IN_LAYERS: set[str] = set()
#: class name -> the layer class (``layers`` exports them: kernels finds a layer by name there).
LAYERS: dict[str, type] = {}
for _mod in MAPPING_MODULES:
    for _hub_name, _cls_name in _mod.MAPPING.items():
        if _hub_name in MAPPING:
            raise RuntimeError(f"hub layer {_hub_name!r} is mapped twice")
        MAPPING[_hub_name] = _cls_name
        LAYERS[_cls_name] = getattr(_mod, _cls_name)
    OPT_IN_LAYERS.update(getattr(_mod, "OPT_IN", ()))

for _mod in PATCH_MODULES:
    for _row in _mod.PATCH_ROWS:
        if _row.name not in PATCHES:  # the registry outlives a reload of this module
            register(_row)

__all__ = ["LAYERS", "MAPPING", "MAPPING_LEFT_OUT", "MAPPING_MODULES", "OPT_IN_LAYERS", "PATCH_MODULES"]
