"""Plugging the layers into transformers models through ``kernels`` and ``from_pretrained``, on
tiny CPU models built from real transformers configs. On the CPU our layer's forward takes the
reference path, which is bit-identical to transformers' own RMSNorm, so a kernelized model's
logits must equal the stock model's exactly."""

from __future__ import annotations

import logging
import sys
from collections import Counter

import pytest
import torch

import cutile_kernels
import families
from cutile_kernels import layers
from cutile_kernels.layers import CutileRMSNorm
from cutile_kernels.layers import patch as patcher
from cutile_kernels.layers.hub import CutileKernelConfig

transformers = pytest.importorskip("transformers")
kernels = pytest.importorskip("kernels")

from kernels import Mode  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import (AutoModelForCausalLM, KernelConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config,  # noqa: E402
                          Qwen3ForCausalLM)
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402

LAYER_QUALNAME = "CutileRMSNorm.forward"


def _llama():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256)
    return LlamaForCausalLM, cfg, LlamaRMSNorm, 2 * 2 + 1


def _qwen3():
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=256)
    return Qwen3ForCausalLM, cfg, Qwen3RMSNorm, 2 * 4 + 1  # + q_norm and k_norm per layer


MODELS = {"llama": _llama, "qwen3": _qwen3}


class _Ckpt:
    def __init__(self, name, path, cls, norm_cls, n_norms, ids, logits):
        self.name, self.path, self.cls, self.norm_cls = name, path, cls, norm_cls
        self.n_norms, self.ids, self.logits = n_norms, ids, logits

    def load(self, **kw):
        return self.cls.from_pretrained(self.path, **kw).eval()


@pytest.fixture(scope="module", params=sorted(MODELS))
def ckpt(request, tmp_path_factory):
    """A tiny seeded checkpoint (safetensors) and the stock model's logits on fixed inputs."""
    cls, cfg, norm_cls, n_norms = MODELS[request.param]()
    gen = torch.Generator().manual_seed(1234)
    torch.manual_seed(1234)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # RMSNorm weights start at 1: make them matter
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    assert (path / "model.safetensors").is_file()
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=gen)
    stock = cls.from_pretrained(path).eval()
    with torch.no_grad():
        logits = stock(ids).logits
    assert torch.isfinite(logits).all()
    return _Ckpt(request.param, path, cls, norm_cls, n_norms, ids, logits)


@pytest.fixture(scope="module")
def variant(built_package_dir):
    """``<build>/torch-cuda``."""
    return built_package_dir.parent


@pytest.fixture(scope="module")
def build_pkg(variant):
    """The build's package as ``kernels`` imports it (module name = metadata id)."""
    import json

    from kernels import get_local_kernel

    mod = get_local_kernel(variant)
    meta = json.loads((variant / "metadata.json").read_text())
    assert mod.__name__ == meta["id"]
    assert sys.modules[meta["id"]] is mod
    return mod


def _norms(model, norm_cls):
    return [m for m in model.modules() if isinstance(m, norm_cls)]


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _force_kernelize(model, variant, monkeypatch):
    """kernels.kernelize for "cuda" on a CPU model, with the device capability faked."""
    import kernels.layer.repos as repos

    monkeypatch.setattr(repos, "_find_capability", lambda: 90)
    mapping = {"RMSNorm": {"cuda": {Mode.INFERENCE: kernels.LocalLayerRepository(variant, layer_name="CutileRMSNorm")}}}
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        out = kernels.kernelize(model, mode=Mode.INFERENCE, device="cuda", use_fallback=True)
    assert out is model
    return model


def _assert_original_forwards(model, norm_cls):
    norms = _norms(model, norm_cls)
    assert norms
    for m in norms:
        fwd = m.forward
        assert fwd.__func__ is norm_cls.forward, fwd
        assert fwd.__func__.__qualname__ != LAYER_QUALNAME


# ---------------------------------------------------------------------------------------------
# The layer and the mapping
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("check_cls", [LlamaRMSNorm, Qwen3RMSNorm], ids=lambda c: c.__name__)
def test_layer_passes_kernels_validator(check_cls):
    from kernels.layer.layer import _validate_layer

    _validate_layer(check_cls=check_cls, cls=CutileRMSNorm, repo="cutile-kernels (test)")
    assert CutileRMSNorm.can_torch_compile is True and CutileRMSNorm.has_backward is False


def test_validator_is_real():
    from kernels.layer.layer import _validate_layer

    class WithInit(CutileRMSNorm):
        def __init__(self):
            super().__init__()

    class WithMember(CutileRMSNorm):
        extra = 3

    class WithOtherForward(CutileRMSNorm):
        def forward(self, hidden_states, residual):
            return hidden_states

    for bad in (WithInit, WithMember, WithOtherForward):
        with pytest.raises(TypeError):
            _validate_layer(check_cls=LlamaRMSNorm, cls=bad, repo="cutile-kernels (test)")


def test_mapping_names_are_transformers_hub_names():
    assert layers.MAPPING == {"RMSNorm": "CutileRMSNorm", "RMSNormZeroCentered": "CutileZeroCenteredRMSNorm",
                              "RMSNormGated": "CutileRMSNormGated", "rotary_pos_emb": "CutileRotaryPosEmb",
                              "chunk_gated_delta_rule": "CutileChunkGatedDeltaRule",
                              "fused_recurrent_gated_delta_rule": "CutileFusedRecurrentGatedDeltaRule",
                              "causal_conv1d_fn": "CutileCausalConv1dFn",
                              "causal_conv1d_update": "CutileCausalConv1dUpdate",
                              "Qwen3_5GatedDeltaNet": "CutileGatedDeltaNet"}
    assert getattr(layers, layers.MAPPING["RMSNorm"]) is CutileRMSNorm
    for norm_cls in (LlamaRMSNorm, Qwen3RMSNorm):
        assert norm_cls.kernel_layer_name == "RMSNorm"
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q35

    assert q35.Qwen3_5RMSNorm.kernel_layer_name == "RMSNormZeroCentered"
    assert q35.Qwen3_5RMSNormGated.kernel_layer_name == "RMSNormGated"
    for hub, fn in (("chunk_gated_delta_rule", q35.torch_chunk_gated_delta_rule),
                    ("fused_recurrent_gated_delta_rule", q35.torch_recurrent_gated_delta_rule),
                    ("causal_conv1d_fn", q35.causal_conv1d_fn), ("causal_conv1d_update", q35.causal_conv1d_update)):
        assert type(fn).kernel_layer_name == hub
    assert q35.Qwen3_5GatedDeltaNet.kernel_layer_name == "Qwen3_5GatedDeltaNet"


def test_gated_deltanet_layers_pass_kernels_validation():
    """kernels checks a layer against the module it replaces (no state, the same forward
    parameters): Qwen3.5's gated norm, the Func modules of its four hub functions and the block."""
    from kernels.layer.layer import _validate_layer
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q35

    for replaced, ours in ((q35.Qwen3_5RMSNormGated, "RMSNormGated"),
                           (type(q35.torch_chunk_gated_delta_rule), "chunk_gated_delta_rule"),
                           (type(q35.torch_recurrent_gated_delta_rule), "fused_recurrent_gated_delta_rule"),
                           (type(q35.causal_conv1d_fn), "causal_conv1d_fn"),
                           (type(q35.causal_conv1d_update), "causal_conv1d_update"),
                           (q35.Qwen3_5GatedDeltaNet, "Qwen3_5GatedDeltaNet")):
        _validate_layer(check_cls=replaced, cls=getattr(layers, layers.MAPPING[ours]), repo="cutile-kernels (test)")


def test_layer_forward_is_the_reference_on_cpu():
    mod = LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        mod.weight.copy_(1 + 0.1 * torch.randn(64))
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    want = mod(x)
    got = CutileRMSNorm.forward(mod, x)  # borrows weight and variance_epsilon
    assert got.dtype == want.dtype and torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# kernels.kernelize with our mapping
# ---------------------------------------------------------------------------------------------

def test_kernels_kernelize_maps_every_rmsnorm(ckpt, variant, build_pkg, monkeypatch):
    model = ckpt.load()
    norms = _norms(model, ckpt.norm_cls)
    assert len(norms) == ckpt.n_norms
    _force_kernelize(model, variant, monkeypatch)
    for m in norms:
        assert m.forward.__func__.__qualname__ == LAYER_QUALNAME
        assert m.forward.__self__ is m
        assert m.forward.__func__.__module__ == f"{build_pkg.__name__}.layers.norm"  # from the build
    build_pkg.reset_stats()
    got = _logits(model, ckpt.ids)
    assert torch.equal(got, ckpt.logits)
    # Every norm went through our layer (the CPU reference path of the build's own dispatch).
    assert build_pkg.stats()["reference_calls"] == {"rms_norm": ckpt.n_norms}
    assert build_pkg.stats()["fallbacks"] == {}


def test_switching_to_our_attention_registers_the_patching_copy(build_pkg, monkeypatch):
    """A process holding the source package and the build variant ``kernels`` loads has two copies
    of our attention, each keeping its own stand-in arrays: the copy imported second keeps the first
    one's forwards registered, and the patch that switches a model registers its own copy's forwards
    again, the copy whose arrays it prepares (on the H200 the build's forwards, registered by its
    import, ran with the source's arrays prepared: three fills a call)."""
    from families import model as family_model
    from transformers import AttentionInterface

    from cutile_kernels.layers import attention as ours
    from cutile_kernels.layers import models

    mapping = AttentionInterface._global_mapping
    for name in ours.NAMES:  # restored after the test
        monkeypatch.setitem(mapping, name, mapping[name])
    theirs = build_pkg.layers.attention
    assert theirs is not ours
    ours.register_attention()
    theirs.register_attention(replace=False)  # what the build's import does
    assert mapping[ours.NAME] is ours.cutile_attention_forward
    theirs.register_attention()  # what its patches would do
    assert mapping[ours.NAME] is theirs.cutile_attention_forward
    assert models.patch_cutile_attention(family_model("llama", layers=2)) == 2
    assert mapping[ours.NAME] is ours.cutile_attention_forward
    assert mapping[ours.KERNEL_NAME] is ours.cutile_kernel_attention_forward


def test_kernels_kernelize_training_keeps_original(ckpt, variant, monkeypatch):
    # Our layer has no backward: a TRAINING kernelize must keep transformers' forwards.
    import kernels.layer.repos as repos

    model = ckpt.load()
    monkeypatch.setattr(repos, "_find_capability", lambda: 90)
    mapping = {"RMSNorm": {"cuda": {Mode.INFERENCE: kernels.LocalLayerRepository(variant, layer_name="CutileRMSNorm")}}}
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(model, mode=Mode.TRAINING, device="cuda", use_fallback=True)
    _assert_original_forwards(model, ckpt.norm_cls)


def test_cutile_kernelize_on_cpu_changes_nothing(ckpt, variant):
    model = ckpt.load()
    out = cutile_kernels.kernelize(model, build_dir=variant.parent)
    assert out is model
    for m in _norms(model, ckpt.norm_cls):
        assert "forward" not in vars(m)  # not even rebound to the original
    _assert_original_forwards(model, ckpt.norm_cls)
    assert torch.equal(_logits(model, ckpt.ids), ckpt.logits)


# ---------------------------------------------------------------------------------------------
# from_pretrained(use_kernels=True, kernel_config=...)
# ---------------------------------------------------------------------------------------------

def test_from_pretrained_with_kernel_config_on_cpu(ckpt, variant):
    cfg = cutile_kernels.kernel_config(build_dir=variant.parent)
    assert isinstance(cfg, CutileKernelConfig) and cfg.use_local_kernel
    assert cfg.kernel_mapping == {hub: f"{variant}:{cls}" for hub, cls in layers.MAPPING.items()
                                  if hub not in layers.OPT_IN_LAYERS}
    model = ckpt.load(use_kernels=True, kernel_config=cfg)
    assert model.kernel_config is cfg
    assert cfg.kernel_mapping == {}  # a CPU model: nothing mapped
    _assert_original_forwards(model, ckpt.norm_cls)
    assert torch.equal(_logits(model, ckpt.ids), ckpt.logits)


@pytest.fixture
def pretend_cuda(monkeypatch):
    """transformers' KernelConfig believes the (CPU) model is on CUDA."""
    import transformers.utils.kernel_config as kc

    monkeypatch.setattr(kc, "infer_device", lambda model: "cuda")


@pytest.fixture
def kernelize_as_on_cuda(pretend_cuda, monkeypatch):
    """``from_pretrained(use_kernels=True, kernel_config=...)`` does to a CPU model all it does on a
    GPU: the default patches (``pretend_cuda``), and transformers' kernelize binds our hub layers
    from the build for "cuda" (capability 90). On the CPU those forwards compute the reference
    formulas, so the model's numbers stay stock's."""
    import kernels.layer.repos as repos
    import transformers.integrations.hub_kernels as hub_kernels

    monkeypatch.setattr(hub_kernels, "get_device_type", lambda device: "cuda")
    monkeypatch.setattr(repos, "_find_capability", lambda: 90)


def our_forwards(model) -> Counter:
    """{qualified name: count} of the forwards bound on ``model``'s modules and on the hub-function
    modules of their modeling files (``apply_rotary_pos_emb`` and the like): what kernelize and the
    patches put in place. Hub functions stay bound for the whole process once a model was kernelized."""
    homes = {sys.modules[type(m).__module__] for m in model.modules() if type(m).__module__ in sys.modules}
    funcs = [v for home in homes for v in vars(home).values() if isinstance(v, torch.nn.Module)]
    unique = {id(m): m for m in [*model.modules(), *funcs]}.values()
    return Counter(m.__dict__["forward"].__qualname__ for m in unique if "forward" in m.__dict__)


def test_stock_kernel_config_local_crash_upstream(ckpt, variant, pretend_cuda):
    """Documents the transformers 5.22.2 bug CutileKernelConfig works around: with a local mapping,
    register_kernel_replacements_and_fusions rewrites each value to a ``(path, metadata)`` tuple and
    create_compatible_mapping -> add_to_mapping_local then calls ``tuple.split(":")``."""
    stock = KernelConfig({"RMSNorm": f"{variant}:CutileRMSNorm"}, use_local_kernel=True)
    try:
        ckpt.load(use_kernels=True, kernel_config=stock)
    except AttributeError as exc:
        assert "split" in str(exc)
        return
    pytest.xfail(f"transformers {transformers.__version__} no longer crashes on a local KernelConfig "
                 "(the upstream bug is fixed; CutileKernelConfig's unwrap may be dropped)")


def test_cutile_kernel_config_survives_local_mapping(ckpt, variant, pretend_cuda):
    cfg = cutile_kernels.kernel_config(build_dir=variant.parent)
    model = ckpt.load(use_kernels=True, kernel_config=cfg)
    assert model.kernel_config is cfg
    assert set(cfg.kernel_mapping) == {"RMSNorm", "rotary_pos_emb"}
    by_mode = cfg.kernel_mapping["RMSNorm"]["cuda"]
    assert set(by_mode) == {Mode.INFERENCE}
    repo = by_mode[Mode.INFERENCE]
    assert isinstance(repo, kernels.LocalLayerRepository)
    assert repo.layer_name == "CutileRMSNorm"
    assert repo == kernels.LocalLayerRepository(variant, layer_name="CutileRMSNorm")
    # transformers kernelizes for the model's real device (cpu): forwards and logits unchanged.
    _assert_original_forwards(model, ckpt.norm_cls)
    assert torch.equal(_logits(model, ckpt.ids), ckpt.logits)


def test_sanitize_drops_names_the_model_lacks(ckpt, variant):
    model = ckpt.load()
    absent = "MultiScaleDeformableAttention"  # a transformers hub name no decoder-only LM has
    cfg_probe = KernelConfig()
    cfg_probe.store_registered_layer_names(model)
    names = set(cfg_probe.registered_layer_names.values())
    assert "RMSNorm" in names and absent not in names
    mapping = {"RMSNorm": f"{variant}:CutileRMSNorm", absent: f"{variant}:CutileRMSNorm"}

    stock = KernelConfig(dict(mapping), use_local_kernel=True)
    with pytest.raises(ValueError, match="not registered"):
        stock.sanitize_kernel_mapping(model)

    ours = CutileKernelConfig(dict(mapping), use_local_kernel=True)
    ours.sanitize_kernel_mapping(model)
    assert ours.kernel_mapping == {"RMSNorm": f"{variant}:CutileRMSNorm"}
    # Still validates what it keeps.
    bad = CutileKernelConfig({"RMSNorm": "no-colon-or-slash"}, use_local_kernel=True)
    with pytest.raises(ValueError):
        bad.sanitize_kernel_mapping(model)


def test_one_config_serves_several_loads(ckpt, variant, pretend_cuda):
    """Loading rewrites the config's mapping for that model (emptied on a CPU model); the next
    model loaded with the same config still gets the full mapping."""
    import transformers.utils.kernel_config as kc

    cfg = cutile_kernels.kernel_config(build_dir=variant.parent)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kc, "infer_device", lambda model: "cpu")
        ckpt.load(use_kernels=True, kernel_config=cfg)
    assert cfg.kernel_mapping == {}
    ckpt.load(use_kernels=True, kernel_config=cfg)  # "CUDA" (pretend_cuda) this time
    assert set(cfg.kernel_mapping) == {"RMSNorm", "rotary_pos_emb"}


def test_kernel_config_exclude_leaves_out_layers_and_patches(ckpt, variant, pretend_cuda, monkeypatch):
    from cutile_kernels.layers import _patching
    from cutile_kernels.layers import patch as patch_mod

    seen = []
    monkeypatch.setattr(_patching, "patch", lambda model, names=None: seen.append(names))  # what hub calls
    cfg = cutile_kernels.kernel_config(build_dir=variant.parent, exclude=("RMSNorm", "fused_gate_up"))
    assert "RMSNorm" not in cfg.kernel_mapping and "rotary_pos_emb" in cfg.kernel_mapping
    ckpt.load(use_kernels=True, kernel_config=cfg)
    assert set(cfg.kernel_mapping) == {"rotary_pos_emb"}
    assert seen == [[n for n, p in patch_mod.PATCHES.items() if p.default and n != "fused_gate_up"]]
    assert "decoder_add_rms_norm" in seen[0] and "rope_cos_sin" not in seen[0]  # opt-in patches stay out


def test_kernel_config_checks_its_names(variant):
    from cutile_kernels.layers import hub

    with pytest.raises(ValueError, match="unknown name"):
        cutile_kernels.kernel_config(build_dir=variant.parent, exclude=["Bogus"])
    with pytest.raises(ValueError, match="unknown name"):
        cutile_kernels.kernel_config(build_dir=variant.parent, include=["Bogus"])
    # A default patch named in include (qk_norm_rope was opt-in once) is applied as it would be anyway.
    same = cutile_kernels.kernel_config(build_dir=variant.parent, include=["qk_norm_rope"])
    assert hub._patch_names(same.exclude_patches, same.include_patches) == hub._patch_names()
    one = cutile_kernels.kernel_config(build_dir=variant.parent, exclude="fused_gate_up")  # one name as a str
    assert one.exclude_patches == ("fused_gate_up",)
    assert cutile_kernels.kernel_config(build_dir=variant.parent, exclude=None).exclude_patches == ()
    cfg = cutile_kernels.kernel_config(build_dir=variant.parent, include=["rope_cos_sin"])
    assert "rope_cos_sin" in hub._patch_names(cfg.exclude_patches, cfg.include_patches)
    assert "rope_cos_sin" not in hub._patch_names()


def test_kernel_config_disabled(monkeypatch, variant):
    monkeypatch.setenv("CUTILE_KERNELS_DISABLE", "1")
    cfg = cutile_kernels.kernel_config(build_dir=variant.parent)
    assert isinstance(cfg, CutileKernelConfig)
    assert cfg.kernel_mapping == {} and cfg.use_local_kernel is True


def test_kernel_config_without_build_warns(tmp_path, caplog, monkeypatch, ckpt):
    # Said when a CUDA model loads with it (on a CPU a build would change nothing: not said there).
    import transformers.utils.kernel_config as kc

    monkeypatch.delenv("CUTILE_KERNELS_DISABLE", raising=False)
    with caplog.at_level(logging.INFO, logger="cutile_kernels"):
        cfg = cutile_kernels.kernel_config(build_dir=tmp_path)
        ckpt.load(use_kernels=True, kernel_config=cfg)  # a CPU model
    assert isinstance(cfg, CutileKernelConfig) and cfg.kernel_mapping == {}
    assert not [r for r in caplog.records if r.name == "cutile_kernels" and r.levelno >= logging.WARNING]
    caplog.clear()
    monkeypatch.setattr(kc, "infer_device", lambda model: "cuda")
    with caplog.at_level(logging.WARNING, logger="cutile_kernels"):
        model = ckpt.load(use_kernels=True, kernel_config=cfg)
    msgs = [r.getMessage() for r in caplog.records if r.name == "cutile_kernels" and r.levelno == logging.WARNING]
    assert len(msgs) == 1
    assert str(tmp_path) in msgs[0] and "cutile-kernels build" in msgs[0]
    _assert_original_forwards(model, ckpt.norm_cls)


def test_kernel_config_default_build_dir_from_env(tmp_path, monkeypatch, variant):
    monkeypatch.delenv("CUTILE_KERNELS_DISABLE", raising=False)
    monkeypatch.setenv("CUTILE_KERNELS_BUILD_DIR", str(variant.parent))
    assert cutile_kernels.kernel_config().kernel_mapping == {
        hub: f"{variant}:{cls}" for hub, cls in layers.MAPPING.items() if hub not in layers.OPT_IN_LAYERS}
    assert cutile_kernels.kernel_config().kernel_mapping["RMSNorm"] == f"{variant}:CutileRMSNorm"
    monkeypatch.setenv("CUTILE_KERNELS_BUILD_DIR", str(tmp_path))
    assert cutile_kernels.kernel_config().kernel_mapping == {}


# ---------------------------------------------------------------------------------------------
# Saving a kernelized model writes the same checkpoint
# ---------------------------------------------------------------------------------------------

def assert_same_checkpoint(want_dir, got_dir):
    """``got_dir``'s model.safetensors holds ``want_dir``'s keys with the same dtypes, shapes and bytes."""
    want = load_file(str(want_dir / "model.safetensors"))
    got = load_file(str(got_dir / "model.safetensors"))
    assert set(got) == set(want)
    for k in want:
        a, b = want[k], got[k]
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert a.contiguous().view(torch.uint8).numpy().tobytes() == b.contiguous().view(torch.uint8).numpy().tobytes(), k


def test_save_after_kernelize_is_byte_identical(ckpt, variant, monkeypatch, tmp_path):
    model = ckpt.load()
    _force_kernelize(model, variant, monkeypatch)
    assert all(m.forward.__func__.__qualname__ == LAYER_QUALNAME for m in _norms(model, ckpt.norm_cls))
    model.save_pretrained(tmp_path)
    assert any(k.endswith("norm.weight") for k in load_file(str(tmp_path / "model.safetensors")))
    assert_same_checkpoint(ckpt.path, tmp_path)


@pytest.mark.parametrize("model_type", list(families.FAMILIES))
def test_every_family_kernelized_by_from_pretrained_saves_its_checkpoint(model_type, variant, kernelize_as_on_cuda,
                                                                        tmp_path):
    """Each family row (OLMo's at a head dim olmo2_qk_norm_rope takes), loaded as users load it, with
    every default hub layer and patch of ``kernel_config()`` (stacked projections, fused norms, our
    attention and cache writes) and run (a prefill and a cached step), saves the checkpoint it was
    loaded from: the same keys, dtypes, shapes and bytes."""
    families.save_kernel_row(model_type, tmp_path / "stock")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "stock", use_kernels=True,
                                                 kernel_config=cutile_kernels.kernel_config(build_dir=variant.parent))
    applied = patcher.applied(model.eval())
    assert {"gemv", "dynamic_cache_prefill", "masked_prefill_attention"} <= set(applied), applied
    assert sum(our_forwards(model).values()) > model.config.num_hidden_layers, our_forwards(model)
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(families.prefill_and_step(model, ids)).all()
    # The patches stacked projections (Phi-3's checkpoint has its gate_up_proj stacked already): the
    # save has something to undo.
    stock_keys = set(load_file(str(tmp_path / "stock" / "model.safetensors")))
    stacked = {n for n, _ in model.named_parameters()} - stock_keys
    assert bool(stacked) == (model_type != "phi3"), stacked
    model.save_pretrained(tmp_path / "ours")
    assert_same_checkpoint(tmp_path / "stock", tmp_path / "ours")
    assert (tmp_path / "ours" / "model.safetensors").read_bytes() == (tmp_path / "stock" / "model.safetensors").read_bytes()


def test_layer_runs_only_for_llama_formula_classes(caplog):
    """The "RMSNorm" hub name also covers classes that round differently: those keep their own
    forward (and say so), the Llama-formula ones take ours."""
    import types

    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from cutile_kernels.layers.norm import computes_llama_rms_norm

    assert computes_llama_rms_norm(LlamaRMSNorm) and computes_llama_rms_norm(MistralRMSNorm)
    assert not computes_llama_rms_norm(GptOssRMSNorm) and not computes_llama_rms_norm(Olmo2RMSNorm)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    mod = GptOssRMSNorm(64).to(torch.bfloat16)
    with torch.no_grad():
        mod.weight.copy_(torch.rand(64) + 0.5)
    want = mod(x)
    mod.forward = types.MethodType(CutileRMSNorm.forward, mod)
    with caplog.at_level("WARNING", logger="cutile_kernels"):
        got = mod(x)
    assert torch.equal(got, want)
    assert "GptOssRMSNorm is not LlamaRMSNorm's formula" in caplog.text


def test_rms_norm_gate_is_pinned_to_the_transformers_formula(change_pin):
    """A later transformers whose LlamaRMSNorm.forward differs turns the kernel path off for every
    copy (the bytecode check alone would follow it)."""
    from cutile_kernels.layers import _pins
    from cutile_kernels.layers import norm as norm_layers
    from cutile_kernels.layers._match import statements_digest

    assert statements_digest(LlamaRMSNorm.forward) == _pins.PINS[norm_layers.PIN].digest
    norm_layers.computes_llama_rms_norm.cache_clear()
    change_pin(norm_layers.PIN)
    try:
        assert not norm_layers.computes_llama_rms_norm(LlamaRMSNorm)
    finally:
        norm_layers.computes_llama_rms_norm.cache_clear()


def test_opt_in_hub_layers_map_only_when_included(variant, monkeypatch):
    """A hub layer waiting for its end-to-end bench (a module's OPT_IN; none today: the gated
    DeltaNet prefill pair was one until its bench): kernel_config() leaves it out, include=[...] maps
    it; the gated DeltaNet layers are all mapped by default."""
    from cutile_kernels.layers import hub

    every = set(hub.kernel_config(build_dir=variant.parent).kernel_mapping)
    assert {"fused_recurrent_gated_delta_rule", "causal_conv1d_update", "RMSNormGated", "chunk_gated_delta_rule",
            "causal_conv1d_fn"} <= every
    monkeypatch.setattr(hub, "OPT_IN_LAYERS", {"chunk_gated_delta_rule"})
    base = set(hub.kernel_config(build_dir=variant.parent).kernel_mapping)
    assert base == every - {"chunk_gated_delta_rule"}
    cfg = hub.kernel_config(build_dir=variant.parent, include=["chunk_gated_delta_rule", "rope_cos_sin"])
    assert set(cfg.kernel_mapping) == base | {"chunk_gated_delta_rule"}
    assert cfg.include_patches == ("rope_cos_sin",)
    # A default layer named in include changes nothing (as a default patch named there).
    assert set(hub.kernel_config(build_dir=variant.parent, include=["RMSNorm"]).kernel_mapping) == base
    with pytest.raises(ValueError, match="unknown name"):
        hub.kernel_config(include=["no_such_layer"])
    with pytest.raises(ValueError, match="unknown name"):
        hub.kernelize(torch.nn.Linear(2, 2), include=["fused_gate_up"])  # a patch: kernelize maps layers
