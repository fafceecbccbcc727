"""Benchmark presets: real architectures' configs with seeded weights, saved with safetensors.

No weights are downloaded. A preset is the ``config.json`` of a public checkpoint (copied here
with its source repository named) and a seed. :func:`materialize` builds the model from the
config, draws its weights from the seed (transformers' own initialisation, then the norm weights
moved off 1.0 so that a wrong weight multiply is visible), saves it with ``save_pretrained``
(safetensors), and every benchmark path loads it back through ``from_pretrained``: the real
loading path is exercised.

``tiny`` is the embedded default: a two-layer Llama that runs on a CPU in seconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("cutile_kernels")

ENV_CACHE = "CUTILE_KERNELS_PRESET_DIR"

#: Version of how :func:`materialize` draws the weights; a cached preset of another one is rebuilt
#: (2: the ``(1 + weight)`` norms drawn around 0, see :func:`seed_norm_weights`).
WEIGHTS_RECIPE = 2


@dataclass(frozen=True)
class Preset:
    name: str
    source: str  # the Hub repository whose config.json this is
    config: dict


PRESETS = {
    p.name: p
    for p in [
        Preset("tiny", "an embedded two-layer Llama", {
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512,
            "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
        }),
        Preset("llama-3.2-1b", "meta-llama/Llama-3.2-1B", {
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64,
            "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
            "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32,
            "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
            "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "rope_theta": 500000.0, "tie_word_embeddings": True, "use_cache": True, "vocab_size": 128256,
        }),
        Preset("qwen3-0.6b", "Qwen/Qwen3-0.6B", {
            "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
            "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
            "max_position_embeddings": 40960, "max_window_layers": 28, "num_attention_heads": 16,
            "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
            "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True, "use_cache": True,
            "use_sliding_window": False, "vocab_size": 151936,
        }),
        Preset("qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B", {
            "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
            "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 1536,
            "initializer_range": 0.02, "intermediate_size": 8960, "max_position_embeddings": 131072,
            "max_window_layers": 28, "num_attention_heads": 12, "num_hidden_layers": 28,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
            "tie_word_embeddings": True, "use_cache": True, "use_mrope": False, "use_sliding_window": False,
            "vocab_size": 151936,
        }),
        Preset("mistral-7b-v0.3", "mistralai/Mistral-7B-v0.3", {
            "model_type": "mistral", "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0,
            "bos_token_id": 1, "eos_token_id": 2, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
            "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
            "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "use_cache": True,
            "vocab_size": 32768,
        }),
        # Value for value from google/gemma-3-1b-it's config.json (transformers 4.52.4 wrote it), as a
        # public Gemma 3 checkpoint-loading note quotes it (found with the search tool, 2026-12-01).
        Preset("gemma-3-1b", "google/gemma-3-1b-it", {
            "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "attention_bias": False,
            "attention_dropout": 0.0, "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": [1, 106],
            "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912,
            "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 26,
            "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
            "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
            "sliding_window_pattern": 6, "use_cache": True, "vocab_size": 262144,
        }),
        # allenai/OLMo-2-0425-1B: its own config.json was not found with the search tool (2026-12-06).
        # Every value here but use_cache is that of the config.json of a fine-tune of it
        # (CodeAtCMU/OLMo-2-0425-1B_full_sft_code_data_120K_remove_comments, Hub commit c6680f4,
        # written by transformers 4.52.1; its use_cache false is a training setting), and the
        # checkpoint's model card and fairseq2's OLMO2Config (whose defaults are this checkpoint's) agree
        # on the sizes: hidden 2048, MLP 8192, 16 layers of 16 heads without GQA, vocab 100352, 4096
        # positions, RoPE theta 5e5, untied.
        Preset("olmo-2-1b", "allenai/OLMo-2-0425-1B", {
            "model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"], "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": 100257, "pad_token_id": 100277,
            "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
            "max_position_embeddings": 4096, "num_attention_heads": 16, "num_hidden_layers": 16,
            "num_key_value_heads": 16, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 500000.0,
            "tie_word_embeddings": False, "use_cache": True, "vocab_size": 100352,
        }),
        # allenai/Olmo-3-7B (Instruct, Think and Base share the architecture): the sizes of a public
        # from-scratch reimplementation that loads its weights (rasbt/LLMs-from-scratch ch05/13_olmo3,
        # found with the search tool, 2026-12-03): hidden 4096, MLP 11008, 32 layers of 32 heads
        # without GQA, vocab 100278, 65536 positions, three sliding-window layers (window 4096) to one
        # full (Olmo3Config's default layer_types), RoPE theta 5e5, eps 1e-6. Left out: the YaRN
        # scaling of the full layers' RoPE (factor 8 over 8192 positions), which changes cos/sin values,
        # not the work of a kernel.
        Preset("olmo-3-7b", "allenai/Olmo-3-7B-Instruct", {
            "model_type": "olmo3", "architectures": ["Olmo3ForCausalLM"], "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": 100257, "pad_token_id": 100277,
            "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008,
            "max_position_embeddings": 65536, "num_attention_heads": 32, "num_hidden_layers": 32,
            "num_key_value_heads": 32, "rms_norm_eps": 1e-06, "rope_theta": 500000.0, "sliding_window": 4096,
            "tie_word_embeddings": False, "use_cache": True, "vocab_size": 100278,
        }),
        # microsoft/Phi-3-mini-4k-instruct: the sizes two public catalogues give for it (hidden 3072,
        # MLP 8192, 32 layers of 32 heads without GQA, vocab 32064, 4096 positions; found with the
        # search tool); the rest are transformers' Phi3Config defaults (rms_norm_eps 1e-5, RoPE theta
        # 1e4, full rotary, no RoPE scaling).
        Preset("phi-3-mini-4k", "microsoft/Phi-3-mini-4k-instruct", {
            "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_act": "silu", "hidden_size": 3072,
            "intermediate_size": 8192, "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
            "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0, "rope_scaling": None, "tie_word_embeddings": False, "vocab_size": 32064,
            "bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000,
        }),
        # google/gemma-2-2b-it: a public copy of its config.json (transformers 4.42.4 wrote it) and
        # three public tests of Gemma 2 2B agree on every value here (search tool, 2026-12-02).
        # Four norms a layer, sliding and global layers alternating, attention and final softcaps.
        Preset("gemma-2-2b", "google/gemma-2-2b-it", {
            "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "attention_bias": False,
            "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
            "eos_token_id": [1, 107],
            "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216, "max_position_embeddings": 8192,
            "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0,
            "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
            "use_cache": True, "vocab_size": 256000,
        }),
        # microsoft/Phi-4-mini-instruct: four public copies of its config.json agree on these values,
        # the LongRoPE factors included (search tool, 2026-12-02). q/k/v and gate/up fused in the
        # checkpoint, 96 of 128 head dims rotated, tied embeddings.
        Preset("phi-4-mini", "microsoft/Phi-4-mini-instruct", {
            "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": 199999, "eos_token_id": 199999, "pad_token_id": 199999,
            "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 8192, "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096, "num_attention_heads": 24, "num_hidden_layers": 32,
            "num_key_value_heads": 8, "partial_rotary_factor": 0.75, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
            "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [
                1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649,
                2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845,
                5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158,
                11.70738129, 13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105,
                25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71,
                32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77]},
            "sliding_window": 262144, "tie_word_embeddings": True, "vocab_size": 200064,
        }),
        # ibm-granite/granite-3.3-2b-instruct: a trimmed copy of its config.json in a public test
        # and granite-speech-4.1-2b's text model (built on it) agree on every value here (found with
        # the search tool, 2026-12-02). Llama's code but for four multipliers; tied embeddings.
        Preset("granite-3.3-2b", "ibm-granite/granite-3.3-2b-instruct", {
            "model_type": "granite", "architectures": ["GraniteForCausalLM"], "attention_bias": False,
            "attention_multiplier": 0.015625, "embedding_multiplier": 12.0, "hidden_act": "silu", "hidden_size": 2048,
            "intermediate_size": 8192, "logits_scaling": 8.0, "max_position_embeddings": 131072, "mlp_bias": False,
            "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8, "residual_multiplier": 0.22,
            "rms_norm_eps": 1e-05, "rope_theta": 10000000.0, "rope_scaling": None, "tie_word_embeddings": True,
            "vocab_size": 49159,
        }),
        # HuggingFaceTB/SmolLM3-3B: three public copies of its config.json agree on these values
        # (search tool, 2026-12-02). Every fourth layer has no RoPE (NoPE: no_rope_layers 1,1,1,0).
        Preset("smollm3-3b", "HuggingFaceTB/SmolLM3-3B", {
            "model_type": "smollm3", "architectures": ["SmolLM3ForCausalLM"], "attention_bias": False,
            "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 11008, "max_position_embeddings": 65536,
            "no_rope_layer_interval": 4, "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(36)],
            "num_attention_heads": 16, "num_hidden_layers": 36, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
            "rope_theta": 5000000.0, "rope_scaling": None, "tie_word_embeddings": True, "vocab_size": 128256,
            "bos_token_id": 128000, "eos_token_id": 128012, "pad_token_id": 128004, "use_sliding_window": False,
        }),
        # Qwen/Qwen3.5-0.8B's text_config (the checkpoint is multimodal; users load the text decoder
        # through AutoModelForCausalLM): three public copies of that config.json agree value for
        # value (found with the search tool, 2026-12-01). 24 layers, three gated-DeltaNet to one gated
        # full-attention; MRoPE reduces to 1-D RoPE for text-only positions.
        Preset("qwen3.5-0.8b", "Qwen/Qwen3.5-0.8B", {
            "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], "attention_bias": False,
            "attention_dropout": 0.0, "attn_output_gate": True, "full_attention_interval": 4, "head_dim": 256,
            "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3584,
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 6, "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
            "linear_value_head_dim": 128, "max_position_embeddings": 262144, "num_attention_heads": 8,
            "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": True},
            "use_cache": True, "vocab_size": 248320,
        }),
        # Qwen/Qwen3.5-27B's text_config (the larger Qwen3.5 issue 16 asks for): public copies of its
        # config.json and of Megatron arguments written from it agree (found with the search tool,
        # 2026-12-02). 64 layers, three gated-DeltaNet to one gated full-attention, 16 key heads to
        # 48 value heads in the linear layers (q and k repeated 3x), untied embeddings. About 54 GB
        # of seeded bf16 weights when materialised: its shapes serve the inventory's Workloads.
        Preset("qwen3.5-27b", "Qwen/Qwen3.5-27B", {
            "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], "attention_bias": False,
            "attention_dropout": 0.0, "attn_output_gate": True, "full_attention_interval": 4, "head_dim": 256,
            "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 17408,
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16, "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
            "linear_value_head_dim": 128, "max_position_embeddings": 262144, "num_attention_heads": 24,
            "num_hidden_layers": 64, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": True},
            "use_cache": True, "vocab_size": 248320,
        }),
    ]
}


def preset_dir() -> Path:
    """Where materialised presets are cached (``$CUTILE_KERNELS_PRESET_DIR`` or
    ``~/.cache/cutile-kernels/presets``)."""
    env = os.environ.get(ENV_CACHE)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "cutile-kernels" / "presets"


def make_config(name: str):
    """The transformers config of a preset."""
    from transformers import AutoConfig

    cfg = dict(PRESETS[name].config)
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def materialize(name: str, out_dir: str | os.PathLike | None = None, seed: int = 0,
                device: str = "cpu") -> Path:
    """Build a preset's checkpoint (bf16, safetensors) once and return its directory.

    Args:
        name: a key of :data:`PRESETS`.
        out_dir: where to write it (default: ``preset_dir()/<name>-seed<seed>``).
        seed: the weight seed.
        device: where to draw the weights (``cuda`` is much faster for the 7B preset).

    Raises:
        KeyError: unknown preset.
        FileExistsError: ``out_dir`` is a non-empty directory that holds no preset.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    out = Path(out_dir) if out_dir is not None else preset_dir() / f"{name}-seed{seed}"
    marker = out / "cutile_preset.json"
    identity = {"preset": name, "source": PRESETS[name].source, "seed": seed, "weights": WEIGHTS_RECIPE,
                "config_sha256": hashlib.sha256(json.dumps(PRESETS[name].config, sort_keys=True).encode()).hexdigest()}
    if marker.is_file():
        held = json.loads(marker.read_text())
        if held == identity:
            return out
        if out_dir is not None and held.get("preset") != name:  # another seed of the same one is rebuilt
            raise FileExistsError(f"{out} holds preset {held.get('preset')} (seed {held.get('seed')}): refusing to "
                                  "replace it with another; choose another --out or remove it")
    elif out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty and holds no preset: refusing to overwrite it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        where = "--out" if out_dir is not None else f"${ENV_CACHE} (or ~/.cache)"
        raise FileNotFoundError(f"cannot create {out.parent} for the preset ({exc.strerror}): set {where} to a "
                                "writable directory") from None
    shutil.rmtree(out, ignore_errors=True)
    logger.info("materialising preset %s (seed %d) into %s", name, seed, out)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(make_config(name), dtype=torch.bfloat16)
    seed_norm_weights(model, torch.Generator(device=device).manual_seed(seed + 1))
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps(identity) + "\n")
    del model
    if out_dir is None:  # said once, when written: disk space in the user's home they did not ask for
        size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
        logger.warning("cutile-kernels: wrote preset %s (%s) to %s; later runs reuse it. Remove it with "
                       "`rm -r %s`; set %s to keep presets elsewhere", name, _human(size), out, out, ENV_CACHE)
    return out


def seed_norm_weights(model, gen) -> int:
    """Draw every RMSNorm weight of ``model`` so that the scale it applies is 1 + N(0, 0.1), not all
    ones (a wrong weight multiply shows): the weight itself for ``weight * x`` norms, the offset from
    1 for the ``(1 + weight) * x`` ones (Gemma, Qwen3.5), whose scale would otherwise be ~2 per norm
    and blow the seeded model's activations up. In place, in ``named_parameters`` order. Returns the
    number of weights drawn."""
    import torch

    from cutile_kernels.layers.norm import computes_gemma_rms_norm

    n = 0
    with torch.no_grad():
        for mname, m in model.named_modules():
            for pname, p in m.named_parameters(recurse=False):
                if "norm" in f"{mname}.{pname}" and p.dim() == 1:
                    base = 0.0 if computes_gemma_rms_norm(type(m)) else 1.0
                    p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32))
                    n += 1
    return n


def _human(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def resolve(model: str, seed: int = 0, device: str = "cpu") -> tuple[Path, str]:
    """A checkpoint directory for a preset name or a path, and a label for reports.

    Raises:
        FileNotFoundError: ``model`` is no preset and no directory with a ``config.json``, or the
            directory has no weights.
        ValueError: a weights file is truncated or not safetensors (:func:`check_weights`).
    """
    if model in PRESETS:
        return materialize(model, seed=seed, device=device), f"{model} (config of {PRESETS[model].source}, seed {seed})"
    path = Path(model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{model!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint directory")
    check_config(path)
    check_weights(path)
    return path, str(path)


def check_config(path: Path) -> None:
    """Fail early, in one line, on a ``config.json`` that transformers cannot read or whose
    ``model_type`` it does not know.

    Raises:
        ValueError: the reason, from transformers, with the file named.
    """
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"checkpoint {path}: its config.json cannot be used ({first}): fix or replace "
                         "the file (transformers writes it with save_pretrained)") from None


#: Weight files transformers loads from a directory, in its order of preference.
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def check_weights(path: Path) -> None:
    """Fail early, in one line, on a checkpoint directory whose weights transformers could not load:
    none there, or a safetensors file whose header is cut off or unreadable (each file's header is
    read with ``safetensors.safe_open``, which checks that the data it describes is all there).

    Raises:
        FileNotFoundError: no weights file (the fix: save the model with ``save_pretrained``).
        ValueError: a truncated or corrupt safetensors file, or a shard the index names is missing.
    """
    from safetensors import SafetensorError, safe_open

    found = [name for name in _WEIGHTS if (path / name).is_file()]
    if not found:
        raise FileNotFoundError(f"checkpoint {path} has a config.json but no weights ({', '.join(_WEIGHTS[:3])}): "
                                "save the model there with save_pretrained, or name a preset "
                                f"({', '.join(PRESETS)})")
    if found[0] == "model.safetensors.index.json":
        shards = sorted(set(json.loads((path / found[0]).read_text()).get("weight_map", {}).values()))
    elif found[0] == "model.safetensors":
        shards = [found[0]]
    else:
        return  # pickled weights: transformers reports on those itself
    for shard in shards:
        if not (path / shard).is_file():
            raise ValueError(f"checkpoint {path}: {found[0]} names {shard}, which is missing: copy the whole "
                             "checkpoint again")
        try:
            with safe_open(str(path / shard), framework="pt"):
                pass
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"checkpoint {path}: {shard} is truncated or not a safetensors file "
                             f"({str(exc).splitlines()[0]}): copy or save it again") from None
