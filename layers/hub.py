"""Pointing transformers and ``kernels`` at our layers in a local build.

Two entry points, one mapping (``layers.MAPPING``), both loading the build variant
``<build>/torch-cuda`` through ``kernels.LocalLayerRepository``, offline:

* :func:`kernel_config` for ``from_pretrained(..., use_kernels=True, kernel_config=...)``;
* :func:`kernelize` for a model that is already loaded.

Both also apply the fallback patcher (``layers.patch``) to CUDA models, for what the mapping
cannot reach. On a model that is not on CUDA, with ``CUTILE_KERNELS_DISABLE=1``, or without a
build, nothing changes (the last logs a warning naming ``cutile-kernels build``).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from transformers import KernelConfig

from .. import dispatch, registry
from ._registry import MAPPING, OPT_IN_LAYERS

logger = logging.getLogger("cutile_kernels")


def variant_dir(build_dir=None) -> Path | None:
    """``<build>/torch-cuda`` if a build with a manifest is there, else None."""
    build = Path(build_dir) if build_dir is not None else registry.default_build_dir()
    variant = build / registry.VARIANT_DIR
    return variant if (variant / "metadata.json").is_file() and (
        registry.package_dir_of(build) / "manifest.json").is_file() else None


def _built_variant(build_dir) -> Path | None:
    """:func:`variant_dir`, with a warning naming the directory when there is no build."""
    variant = variant_dir(build_dir)
    if variant is None:
        logger.warning("cutile_kernels: no build under %s; the model keeps its own layers "
                       "(run `cutile-kernels build`)", build_dir or registry.default_build_dir())
    return variant


def _mapping_in_build(variant: Path, include=()) -> dict[str, str]:
    """The rows of ``MAPPING`` whose layer class the build at ``variant`` ships, but the opt-in
    layers (``OPT_IN_LAYERS``) not named in ``include``; with a warning naming the classes the
    build lacks: a build made by an older cutile-kernels lacks newer layers, and mapping one of
    those makes ``kernels`` raise (``Layer ... not found``) even on a CPU model."""
    from kernels import get_local_kernel

    built = get_local_kernel(variant).layers
    missing = sorted(cls for cls in MAPPING.values() if not hasattr(built, cls))
    if missing:
        logger.warning("cutile_kernels: the build under %s has no %s (it predates them); those layers stay "
                       "stock (run `cutile-kernels build`)", variant, ", ".join(missing))
    return {hub: cls for hub, cls in MAPPING.items()
            if hasattr(built, cls) and (hub not in OPT_IN_LAYERS or hub in include)}


def _unwrap(value):
    """``"path:Layer"`` from the forms transformers rewrites mapping values into."""
    if isinstance(value, tuple):
        return value[0]
    if isinstance(value, dict):
        return {k: _unwrap(v) for k, v in value.items()}
    return value


class CutileKernelConfig(KernelConfig):
    """``KernelConfig`` for local builds that works on transformers 5.20-5.22.

    Fixes two things the stock class does with a local mapping:

    * ``register_kernel_replacements_and_fusions`` (run by ``from_pretrained``) rewrites every
      value into a ``(repo, metadata)`` tuple, and ``create_compatible_mapping`` then calls
      ``.split(":")`` on that tuple (``AttributeError: 'tuple' object has no attribute 'split'``,
      seen with 5.22.2): the tuple is unwrapped first.
    * ``sanitize_kernel_mapping`` rejects a layer name the model does not contain, so one config
      could not serve every architecture: names the model lacks are dropped instead.

    On a model that is not on CUDA the mapping becomes empty, so nothing is replaced (stock
    transformers raises for a local mapping on ``cpu``).

    With ``patch_model=True`` (what :func:`kernel_config` sets when a build is found), a CUDA model
    also gets the fallback patcher's patches (``layers.patch.patch``) when transformers prepares
    the mapping, i.e. after its weights are loaded and before the hub layers are swapped. With
    ``decode_graphs=True`` a CUDA model gets ``layers.decode_graphs.enable_decode_graphs`` then too
    (with or without a build: the decode graphs replay whatever the model runs).
    """

    def __init__(self, kernel_mapping=None, use_local_kernel=False, inherit_mapping=True, patch_model=False,
                 exclude_patches=(), include_patches=(), inactive: str | None = None, decode_graphs: bool = False):
        super().__init__(kernel_mapping, use_local_kernel=use_local_kernel, inherit_mapping=inherit_mapping)
        self.patch_model = patch_model
        self.decode_graphs = decode_graphs
        #: Why this config maps nothing anywhere (disabled, no build), said when a model loads with it.
        self.inactive = inactive
        self.exclude_patches = tuple(exclude_patches)
        self.include_patches = tuple(include_patches)
        # Loading rewrites kernel_mapping for the model at hand (rows dropped, emptied off CUDA);
        # each load starts again from the full mapping, so one config serves many models.
        self._full_mapping = dict(self.kernel_mapping or {})

    def sanitize_kernel_mapping(self, model):
        self.store_registered_layer_names(model)
        present = set(self.registered_layer_names.values())
        self.kernel_mapping = {k: _unwrap(v) for k, v in self._full_mapping.items() if k in present}
        super().sanitize_kernel_mapping(model)

    def create_compatible_mapping(self, model, compile=False):
        self.kernel_mapping = {k: _unwrap(v) for k, v in self.kernel_mapping.items()}
        from transformers.utils.kernel_config import infer_device

        _quiet_kernels_warnings()
        device = infer_device(model)
        if device != "cuda":
            self.kernel_mapping = {}
            logger.info("cutile_kernels: nothing kernelized: the model is on %s and our kernels run on CUDA GPUs; "
                        "its layers keep their own forwards", device)
            return
        if self.decode_graphs and not dispatch.disabled():
            from .decode_graphs import enable_decode_graphs

            enable_decode_graphs(model)
        if self.inactive is not None:  # said here, once the model is known to be on CUDA
            self.kernel_mapping = {}
            log = logger.warning if self.inactive.startswith("no build") else logger.info
            log("cutile_kernels: nothing kernelized: %s; the model keeps its own layers", self.inactive)
            return
        mapped = sorted(self.kernel_mapping)
        super().create_compatible_mapping(model, compile=compile)
        _log_kernelized(model, mapped, "from_pretrained")
        if self.patch_model:
            from ._patching import patch

            patch(model, names=_patch_names(self.exclude_patches, self.include_patches))


def hub_layer_names(model) -> set[str]:
    """The ``kernels`` hub layer names of ``model``'s decorated modules and kernelized functions
    (what ``kernels.kernelize`` looks up in a mapping)."""
    names = set()
    for m in model.modules():
        name = getattr(type(m), "kernel_layer_name", None)
        if name is not None:
            names.add(str(name))
        for fn in (getattr(m, "_kernel_funcs", None) or {}).values():
            name = getattr(type(fn), "kernel_layer_name", None) or getattr(fn, "kernel_layer_name", None)
            if name is not None:
                names.add(str(name))
    return names


class _OurKernelization(logging.Filter):
    """Drops ``kernels``' "No kernel mapping found for layer ..." warning (one per module) while
    cutile_kernels drives the kernelization: ``from_pretrained`` with our config (transformers'
    ``set_use_kernels`` on the call stack with a :class:`CutileKernelConfig`) or our
    :func:`kernelize`. Layers we have no kernel for keep their forwards by design; what was and was
    not kernelized is said once, at INFO. Elsewhere (another kernel config, plain ``kernels``) the
    warning stays. Runs only when ``kernels`` emits that warning: no cost otherwise."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "No kernel mapping found for layer" not in record.getMessage():
            return True
        f = sys._getframe(1)
        while f is not None:
            if f.f_code is kernelize.__code__ or (f.f_code.co_name == "set_use_kernels"
                                                  and isinstance(f.f_locals.get("kernel_config"), CutileKernelConfig)):
                return False
            f = f.f_back
        return True


_FILTER = _OurKernelization()


def _quiet_kernels_warnings() -> None:
    logging.getLogger("kernels.layer.layer").addFilter(_FILTER)  # a set: adding it again changes nothing


def _log_kernelized(model, mapped, how: str) -> None:
    names = hub_layer_names(model)
    ours = sorted(names & set(mapped))
    others = sorted(names - set(mapped))
    logger.info("cutile_kernels: %s kernelizes %s with our layers; left stock (no layer of ours for them): %s",
                how, ", ".join(ours) or "no hub layer", ", ".join(others) or "none")


def _patch_names(exclude=(), include=()) -> list[str]:
    """The patches a config applies: the default ones but ``exclude``, plus the opt-in ``include``."""
    from ._patching import PATCHES

    return [n for n, p in PATCHES.items() if (p.default or n in include) and n not in exclude]


def _names(arg, what: str, known: set) -> tuple:
    names = (arg,) if isinstance(arg, str) else tuple(arg or ())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"kernel_config({what}=...): unknown name(s) {unknown}; known: {sorted(known)}")
    return names


#: Opt-in patches that ``decode_graphs=True`` applies too (unless excluded): measured on the decode
#: fast path by the end-to-end bench (H200; docs/results.md). Stacked q/k/v: Llama-3.2-1B and
#: Qwen3-0.6B decode +10 % and +19 % at batch 1 (2026-12-02; its cost: Qwen3's eager prefill 15 %
#: slower). (Gemma's three, accepted here on 2026-12-03, and OLMo 2's two fused patches, measured on
#: both paths, are defaults.)
DECODE_GRAPH_PATCHES = ("fused_qkv",)


def kernel_config(build_dir=None, exclude=(), include=(), decode_graphs: bool = False) -> KernelConfig:
    """The ``kernel_config`` to pass to ``from_pretrained(..., use_kernels=True)``.

    Args:
        build_dir: the ``build/`` directory written by ``cutile-kernels build`` (default:
            ``registry.default_build_dir()``).
        exclude: hub layer names (``"RMSNorm"``) and patch names (``"fused_gate_up"``) to leave
            out, e.g. to time a model without one kernel (the bench's ``cutile~NAME`` path). A
            hub layer left out does not turn off a patch that uses the same kernel
            (``decoder_add_rms_norm`` still fuses the decoder layers' norms).
        include: patches to apply and hub layers to map too: the opt-in ones (``Patch.default``
            False, e.g. ``"rope_cos_sin"``; the hub layers of ``layers.OPT_IN_LAYERS``, none
            today; the bench's ``cutile+NAME`` path); a default patch or hub
            layer named here is applied anyway, so naming it changes nothing (``qk_norm_rope`` was
            opt-in before).
        decode_graphs: also switch on the decode fast path (``layers.decode_graphs``): ``generate``
            uses a static KV cache and replays each decode step as a captured CUDA graph, no
            ``torch.compile``; the opt-in patches of :data:`DECODE_GRAPH_PATCHES` are applied too
            unless ``exclude`` names them. Not under ``CUTILE_KERNELS_DISABLE``.

    Raises:
        ValueError: a name in ``exclude`` or ``include`` that is neither a hub layer of ours nor a
            patch.
        TypeError: ``decode_graphs`` that is not a bool (``"no"`` would read as on).

    Returns:
        A :class:`CutileKernelConfig` mapping each transformers hub layer name in
        ``layers.MAPPING`` to ``"<build>/torch-cuda:<Layer>"`` with ``use_local_kernel=True`` that
        also applies the fallback patcher to CUDA models (``patch_model=True``), or an empty one
        (nothing changes) when disabled or when no build exists.

    Example::

        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, device_map="cuda",
            use_kernels=True, kernel_config=cutile_kernels.kernel_config())
    """
    from ._patching import PATCHES

    if not isinstance(decode_graphs, bool):
        raise TypeError(f"kernel_config(decode_graphs=...) takes True or False, not {decode_graphs!r}")
    exclude = _names(exclude, "exclude", set(MAPPING) | set(PATCHES))
    include = _names(include, "include", set(PATCHES) | set(MAPPING))  # a default one named: no change
    layers_in = tuple(n for n in include if n in MAPPING)
    include = tuple(n for n in include if n in PATCHES)
    if decode_graphs:
        include += tuple(p for p in DECODE_GRAPH_PATCHES if p not in exclude and p not in include)
    if dispatch.disabled():
        return CutileKernelConfig({}, use_local_kernel=True, inactive=f"disabled by {dispatch.ENV_DISABLE}")
    variant = variant_dir(build_dir)
    if variant is None:  # said when a CUDA model loads with it: on a CPU a build would change nothing
        return CutileKernelConfig({}, use_local_kernel=True, decode_graphs=decode_graphs, inactive=(
            f"no build under {build_dir or registry.default_build_dir()} (run `cutile-kernels build`)"))
    mapping = {hub: f"{variant}:{cls}" for hub, cls in _mapping_in_build(variant, layers_in).items()
               if hub not in exclude}
    return CutileKernelConfig(mapping, use_local_kernel=True, patch_model=True, exclude_patches=exclude,
                              include_patches=include, decode_graphs=decode_graphs)


def kernelize(model, mode=None, build_dir=None, include=()):
    """Replace the forwards of a loaded model's hub layers with ours (in place; returns the model).

    Args:
        model: an ``nn.Module`` whose layers carry transformers' hub decorators.
        mode: a ``kernels.Mode`` (default: INFERENCE, or TRAINING when ``model.training``; our
            layers are inference-only, so TRAINING keeps the original forwards).
        build_dir: as for :func:`kernel_config`.
        include: opt-in hub layers to map too (``layers.OPT_IN_LAYERS``; a default one named
            changes nothing).

    Raises:
        ValueError: a name in ``include`` that is no hub layer of ours.

    After the hub layers (and transformers' ``rotary_pos_emb`` function) are swapped, the fallback
    patcher's registered patches are applied too (``layers.patch.patch``: e.g. the residual add
    fused into the decoder layers' RMSNorms); ``cutile_kernels.unpatch(model)`` undoes those.
    """
    from kernels import LocalLayerRepository, Mode, use_kernel_mapping
    from kernels import kernelize as kernels_kernelize

    include = set(_names(include, "include", set(MAPPING)))  # a default layer named: no change
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda" or dispatch.disabled():
        why = ("it is disabled by CUTILE_KERNELS_DISABLE" if dispatch.disabled() else
               "the model has no parameters" if param is None else
               f"the model is on {param.device.type} and our kernels run on CUDA GPUs")
        logger.info("cutile_kernels: kernelize changed nothing: %s", why)
        return model
    variant = _built_variant(build_dir)
    if variant is None:
        return model
    if mode is None:
        mode = Mode.TRAINING if model.training else Mode.INFERENCE
    mapping = {
        hub: {"cuda": {m: LocalLayerRepository(variant, layer_name=cls)
                       for m in (Mode.INFERENCE, Mode.INFERENCE | Mode.TORCH_COMPILE)}}
        for hub, cls in _mapping_in_build(variant, include).items()
    }
    _log_kernelized(model, mapping, "kernelize")
    _quiet_kernels_warnings()
    with use_kernel_mapping(mapping, inherit_mapping=False):
        kernels_kernelize(model, mode=mode, device="cuda", use_fallback=True)
    from ._patching import patch

    patch(model)
    return model
