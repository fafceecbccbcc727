"""The bench paths: every way a user might run the same checkpoint, each loaded in its own process.

=================  ==============================================================================
``stock``          transformers as is: eager, sdpa attention, DynamicCache
``stock-compile``  transformers' recipe for speed: StaticCache and the decode step under
                   ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (CUDA only)
``stock+fla``      transformers with flash-linear-attention importable (what a Qwen3.5 user installs
                   today): transformers calls fla's gated delta rule by itself. Every other path
                   but ``cutile+fla`` runs with fla and causal-conv1d hidden, so that each times
                   its own code; fla is found where it is installed, or in the folder
                   ``$CUTILE_BENCH_FLA_PATH`` names
``cutile+fla``     ours where flash-linear-attention is importable, as its users get it: transformers
                   resolves the gated delta rules to fla, our chunked (prefill) layer leaves fla
                   the call, every other layer of ours runs
``liger``          Liger-Kernel's patches applied to the loaded model, when it is installed
``tilegym``        NVIDIA TileGym's monkey patch (cuTile backend), applied before loading, when it
                   is installed (it pins an older transformers: what fails is reported)
``cutile``         ours: ``use_kernels=True, kernel_config=cutile_kernels.kernel_config()``; its
                   default patch ``cutile_attention`` attends with ``"cutile"`` (our kernel for
                   static-cache and padded decode, transformers' sdpa for prefill and unmasked
                   DynamicCache decode); ``cutile~cutile_attention`` keeps sdpa throughout
``cutile-attn``    ours with our attention kernel on every call it takes, prefill too
                   (``attn_implementation="cutile_kernel"``): what the kernel alone gives
``cutile-compile`` ours with StaticCache and the compiled decode step (CUDA only); its decode
                   attention reads only the static cache's filled slots where our attention
                   forwards run (sdpa masks every slot)
``cutile-compile-attn``  the same with ``"cutile_kernel"`` (prefill in our kernel too)
``cutile-graphs``  ours with the decode fast path (``kernel_config(decode_graphs=True)``: StaticCache,
                   each decode step a replayed CUDA graph, no torch.compile) and our attention
``cutile-graphs-sdpa``  the same with transformers' sdpa attention (without ``cutile_attention``)
``stock-graphs``   transformers with the same decode graphs (``enable_decode_graphs``), no kernels
                   of ours: what capturing alone gives
``cutile~NAME``    ours without one default patch or hub layer ``NAME``, and ``cutile+NAME`` ours
                   with the opt-in patch or hub layer ``NAME`` (not among the defaults): what
                   ``autokernelize --score`` times a candidate against / with;
                   ``cutile-compile~NAME``, ``cutile-graphs+NAME``... the same, compiled or
                   in decode graphs
=================  ==============================================================================
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PathSpec:
    name: str
    description: str
    compile: bool = False
    #: Decode steps replayed as CUDA graphs by ``layers.decode_graphs`` (StaticCache, no compile).
    graphs: bool = False
    ours: bool = False
    #: ``attn_implementation`` to load with (None: transformers' default, sdpa).
    attn: str | None = None
    #: Patch or hub layer names left out of our kernel_config, opt-in patches added (:func:`spec`).
    exclude: tuple = ()
    include: tuple = ()
    #: flash-linear-attention importable (every other path hides it: :func:`isolate_packages`).
    fla: bool = False

    def unavailable(self, device: str) -> str | None:
        """Why this path cannot run here, or None."""
        if (self.compile or self.graphs) and not device.startswith("cuda"):
            return "compiled and decode-graph paths use CUDA graphs: CUDA only"
        if self.attn == "cutile_kernel" and not device.startswith("cuda"):
            return "our attention kernel needs CUDA (on a CPU it would time the eager fallback)"
        if self.fla and not _fla_available():
            return f"flash-linear-attention is not installed (nor in ${FLA_DIR_ENV})"
        if self.name == "liger" and importlib.util.find_spec("liger_kernel") is None:
            return "liger-kernel is not installed"
        if self.name == "tilegym" and importlib.util.find_spec("tilegym") is None:
            return "tilegym is not installed"
        if self.name == "tilegym" and not device.startswith("cuda"):
            return "TileGym's kernels need CUDA"
        return None


PATHS = {p.name: p for p in [
    PathSpec("stock", "transformers eager (sdpa), DynamicCache"),
    PathSpec("stock-compile", "transformers, StaticCache + torch.compile(reduce-overhead) decode", compile=True),
    PathSpec("stock+fla", "transformers eager with flash-linear-attention's kernels (its gated delta rule)",
             fla=True),
    PathSpec("liger", "Liger-Kernel patches on transformers"),
    PathSpec("tilegym", "NVIDIA TileGym monkey patch (cuTile)"),
    PathSpec("cutile", "cutile-kernels: use_kernels=True with our kernel_config", ours=True),
    PathSpec("cutile+fla", "cutile-kernels where flash-linear-attention is importable (its chunked delta rule, "
             "which our prefill layer leaves it; the rest ours)", ours=True, fla=True),
    PathSpec("cutile-attn", "cutile-kernels with attn_implementation='cutile_kernel' (our attention kernel on every "
             "call, prefill too)", ours=True, attn="cutile_kernel"),
    PathSpec("cutile-compile", "cutile-kernels + StaticCache + torch.compile(reduce-overhead) decode",
             compile=True, ours=True),
    PathSpec("cutile-compile-attn", "cutile-kernels + our attention kernel on every call + StaticCache + "
             "torch.compile(reduce-overhead) decode", compile=True, ours=True, attn="cutile_kernel"),
    PathSpec("cutile-graphs", "cutile-kernels decode fast path: StaticCache, CUDA-graph decode steps (no compile), "
             "our attention", graphs=True, ours=True, attn="cutile"),
    PathSpec("cutile-graphs-sdpa", "cutile-kernels decode fast path with transformers' sdpa attention", graphs=True,
             ours=True, exclude=("cutile_attention",)),
    PathSpec("stock-graphs", "transformers with cutile-kernels' decode graphs only (StaticCache, CUDA-graph decode "
             "steps)", graphs=True),
]}

#: The paths the ``~NAME`` / ``+NAME`` forms extend.
VARIED = ("cutile", "cutile-compile", "cutile-compile-attn", "cutile-graphs", "cutile-graphs-sdpa")


#: Separators of the ``cutile~NAME`` (without) and ``cutile+NAME`` (with) path forms.
WITHOUT, WITH = "~", "+"


def spec(name: str) -> PathSpec:
    """The PathSpec of a path name: one of :data:`PATHS`, ``cutile~NAME`` (``cutile`` without the
    default patch or hub layer ``NAME``) or ``cutile+NAME`` (``cutile`` with the opt-in patch
    ``NAME`` too); ``cutile-compile~NAME`` and ``cutile-compile+NAME`` likewise, compiled. Several
    names with the same separator change several (``cutile-compile~rotary_pos_emb~fused_gate_up``).

    Raises:
        KeyError: an unknown path, or a NAME that the form cannot change (``~``: neither a default
            patch nor a hub layer of ours; ``+``: no opt-in patch).
    """
    if name in PATHS:
        return PATHS[name]
    for sep in (WITHOUT, WITH):
        base, found, part = name.partition(sep)
        if found and base in VARIED and part:
            break
    else:
        raise KeyError(f"unknown bench path {name!r}; known: {list(PATHS)}, {'|'.join(VARIED)} followed by "
                       f"{WITHOUT}<default patch or hub layer> or {WITH}<opt-in patch>")
    other = WITH if sep == WITHOUT else WITHOUT
    if other in part:
        raise KeyError(f"path {name!r}: one path takes names with {WITHOUT!r} (without) or {WITH!r} (with), not both")
    parts = tuple(part.split(sep))
    if len(set(parts)) != len(parts):
        raise KeyError(f"path {name!r}: a name is given twice")
    from cutile_kernels import layers
    from cutile_kernels.layers import hub, patch

    # decode_graphs=True applies DECODE_GRAPH_PATCHES too: defaults of the graph paths
    graph_defaults = set(hub.DECODE_GRAPH_PATCHES) if PATHS[base].graphs else set()
    opt_in = ({n for n, p in patch.PATCHES.items() if not p.default} | layers.OPT_IN_LAYERS) - graph_defaults
    known = (set(patch.PATCHES) - opt_in) | (set(layers.MAPPING) - layers.OPT_IN_LAYERS)
    for one in parts:
        if sep == WITH and one not in opt_in:
            raise KeyError(f"path {name!r}: {one!r} is no opt-in patch or hub layer ({base} applies the default "
                           f"ones); opt-in: {sorted(opt_in)}")
        if sep == WITHOUT and one in opt_in:
            raise KeyError(f"path {name!r}: {one!r} is opt-in, {base} does not apply it (time {base}{WITH}{one} "
                           f"against {base})")
        if sep == WITHOUT and one not in known:
            raise KeyError(f"path {name!r}: {one!r} is no patch or hub layer of ours; known: {sorted(known)}")
    what = "with the opt-in patch or hub layer" if sep == WITH else "without"
    return PathSpec(name, f"{PATHS[base].description}, {what} {', '.join(map(repr, parts))}",
                    compile=PATHS[base].compile, graphs=PATHS[base].graphs, attn=PATHS[base].attn, ours=True,
                    include=PATHS[base].include + (parts if sep == WITH else ()),
                    exclude=PATHS[base].exclude + tuple(p for p in parts
                                                        if sep == WITHOUT and p not in PATHS[base].exclude))


#: A folder holding the ``fla`` package, for a machine where it is not installed in the environment.
FLA_DIR_ENV = "CUTILE_BENCH_FLA_PATH"
#: Packages transformers 5.22 uses by itself when importable (``use_kernel_func_from_hub_with_fallback``
#: in the Qwen3.5 / Qwen3-Next / OLMo-hybrid modeling code): hidden from every path but those with
#: ``PathSpec.fla``.
FALLBACK_PACKAGES = ("fla", "causal_conv1d")
#: The module of fla that transformers takes the gated delta rules from (its
#: ``_KERNELS_INTERNAL_PATH_MAPPINGS``): importing ``fla`` alone succeeds without triton, this does not.
FLA_OPS_MODULE = "fla.ops.gated_delta_rule"


def _fla_available() -> bool:
    extra = os.environ.get(FLA_DIR_ENV)
    if extra and (Path(extra) / "fla").is_dir():
        return True
    return importlib.util.find_spec("fla") is not None


class _Hidden(importlib.abc.MetaPathFinder):
    """Makes :data:`FALLBACK_PACKAGES` unimportable in this process (``find_spec`` raises
    ``ModuleNotFoundError``, what transformers' import probe catches)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in FALLBACK_PACKAGES:
            raise ModuleNotFoundError(f"{fullname} is hidden from this bench path", name=fullname)
        return None


def isolate_packages(path: str | None) -> None:
    """Call in a bench worker before transformers imports a modeling module: a path with
    ``PathSpec.fla`` gets fla (``$CUTILE_BENCH_FLA_PATH`` added to ``sys.path`` when set; the path
    fails if fla's gated delta rule module (:data:`FLA_OPS_MODULE`) does not import, e.g. without
    triton, rather than timing transformers' torch code under its name),
    every other path and the reference job get neither fla nor causal-conv1d, installed or not
    (their imports raise ``ModuleNotFoundError``, ``importlib.util.find_spec`` too).

    Raises:
        RuntimeError: a fallback package was imported before the call (the choice would not hold),
            or fla does not import on a path that needs it.
    """
    loaded = [m for m in sys.modules if m.partition(".")[0] in FALLBACK_PACKAGES]
    if loaded:
        raise RuntimeError(f"isolate_packages must run before {loaded[0]} is imported")
    if path in PATHS and PATHS[path].fla:
        extra = os.environ.get(FLA_DIR_ENV)
        if extra and extra not in sys.path:
            sys.path.append(extra)
        try:
            importlib.import_module(FLA_OPS_MODULE)
        except Exception as exc:  # noqa: BLE001 - any import failure means the path would not be fla's
            raise RuntimeError(f"{path}: flash-linear-attention's {FLA_OPS_MODULE} does not import "
                               f"({type(exc).__name__}: {exc}); transformers would run its own torch code") from exc
    elif not any(isinstance(f, _Hidden) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hidden())


def load(path: str, checkpoint: Path, dtype, device: str):
    """Load ``checkpoint`` the way ``path`` runs it (in the calling process: patches stay there)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path_spec = spec(path) if path in PATHS or WITHOUT in path or WITH in path else None
    kw = {}
    if path_spec is not None and path_spec.ours:
        import cutile_kernels

        kw = {"use_kernels": True,
              "kernel_config": cutile_kernels.kernel_config(exclude=path_spec.exclude, include=path_spec.include,
                                                            decode_graphs=path_spec.graphs)}
    if path_spec is not None and path_spec.attn:
        kw["attn_implementation"] = path_spec.attn
    if path == "tilegym":
        _apply_tilegym(AutoConfig.from_pretrained(checkpoint).model_type)
    # kernels warns once per hub layer nobody maps (SiLU, rotary_pos_emb...): expected, noise here.
    kernels_logger = logging.getLogger("kernels")
    level = kernels_logger.level
    kernels_logger.setLevel(logging.ERROR)
    try:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, device_map=device, **kw)
    finally:
        kernels_logger.setLevel(level)
    if path_spec is not None and path_spec.graphs and not path_spec.ours:
        import cutile_kernels

        cutile_kernels.enable_decode_graphs(model)
    if path == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    return model.eval()


def _apply_tilegym(model_type: str) -> None:
    from tilegym.transformers import monkey_patch

    apply = monkey_patch.MODEL_TYPE_TO_APPLY_TILEGYM_FN.get(model_type)
    if apply is None:
        raise RuntimeError(f"TileGym has no patch for model_type {model_type!r}")
    apply(use_cutile=True)
