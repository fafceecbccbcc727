"""Every family row of ``tests/families.py`` loaded as users load it, ``from_pretrained(...,
use_kernels=True, kernel_config=kernel_config())`` on a tiny safetensors checkpoint, against the
stock model loaded from the same checkpoint.

Why: each family's own tests check its patches one or a few at a time, mostly on unpadded
prompts. A user gets every default hub layer and patch at once, and where they meet (a left-padded
batch, a sliding window the prompt outruns, generate over a DynamicCache and over a StaticCache) a
wrong mask, position, window or cache length shows only in the whole model.

CPU: the load kernelizes as on a GPU (``kernelize_as_on_cuda``) and ``"cutile"`` routes as on a GPU,
so our ops serve the attention calls (and the norms, RoPE, activations) with their reference
formulas: a left-padded batch's logits on every real position of every row, each row alone as in the
batch, and greedy generate over both caches give stock's tokens and scores (float32, 1e-4); the
stock side ran none of our ops and ours ran them in the forward and in every decode step of each
generate, in every attention layer.

GPU (bf16, the cubins, ``strict``: no fallback): the left-padded batch's logits and a teacher-forced
decode over a StaticCache and over a DynamicCache, each against the float32 stock model: relative L2
and KL within 1.25x of stock bf16's plus a small epsilon (the bench gate's rule,
``tools/bench/runner.py::_checks``, with the other GPU model tests' factor for these few positions), no NaN
where stock bf16 has none, and every decode step's attention on our kernel.
"""

from __future__ import annotations

import sys

import pytest
import torch

import cutile_kernels
import families
from cutile_kernels.layers import patch as patcher

transformers = pytest.importorskip("transformers")
pytest.importorskip("kernels")

from cutile_kernels_tools.bench.worker import merged_stats, our_symbols, runtime_copies  # noqa: E402
from cutile_kernels_tools.metrics import logit_metrics  # noqa: E402
from test_attention import forward_logits, generate_scores, padded_batch, valid  # noqa: E402
from test_compile import _all_norms_swapped  # noqa: E402
import test_kernelize  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

#: test_kernelize's fixtures these tests use: the build's variant, and from_pretrained kernelizing a CPU
#: model as on a GPU.
variant, pretend_cuda, kernelize_as_on_cuda = (test_kernelize.variant, test_kernelize.pretend_cuda,
                                              test_kernelize.kernelize_as_on_cuda)

ROWS = list(families.FAMILIES)
CACHES = ("dynamic", "static")
#: Left-padded prompt lengths on the CPU: the longest outruns every row's sliding window (4).
LENGTHS = [11, 7, 3]
#: Tokens each CPU generate makes (its prefill, then one decode step per token after the first).
GENERATE_STEPS = 6

#: Default patches in effect on every row after from_pretrained, and each row's own on top: a
#: patch that stops applying fails here (a new default patch does not).
EVERY_ROW = {"dynamic_cache_prefill", "masked_prefill_attention", "gemv"}
_LLAMA_CODE = {"cutile_attention", "decoder_add_rms_norm", "fused_gate_up"}
_OLMO = {"cutile_attention", "fused_gate_up", "olmo2_norm_add", "olmo2_qk_norm_rope", "rms_norm_olmo2"}
ROW_PATCHES = {
    "llama": _LLAMA_CODE, "mistral": _LLAMA_CODE, "qwen2": _LLAMA_CODE, "granite": _LLAMA_CODE,
    "smollm3": _LLAMA_CODE, "qwen3": _LLAMA_CODE | {"qk_norm_rope"},
    "qwen3_5_text": {"cutile_attention", "fused_gate_up", "qwen3_5_add_norm", "qwen3_5_rope", "qwen3_5_stacked_proj",
                     "rms_norm_gemma"},
    "phi3": {"cutile_attention", "decoder_add_rms_norm", "phi3_mlp", "phi3_rope"},
    "olmo2": _OLMO, "olmo3": _OLMO,
    "gemma": {"cutile_attention", "fused_gate_up_geglu", "rms_norm_gemma"},
    "gemma3_text": {"cutile_attention", "fused_gate_up_geglu", "gemma_add_norm", "gemma3_qk_norm_rope", "rms_norm_gemma"},
    "gemma2": {"gemma2_attention", "fused_gate_up_geglu", "gemma_add_norm", "rms_norm_gemma"},
}


def load(path, **kw):
    return AutoModelForCausalLM.from_pretrained(path, **kw).eval()


def assert_kernelized(model_type: str, model) -> None:
    """Every RMSNorm runs one of ours and the row's default patches are in effect."""
    applied = patcher.applied(model)
    assert EVERY_ROW | ROW_PATCHES[model_type] <= set(applied), (model_type, applied)
    assert _all_norms_swapped(model)


def attention_layers(model) -> int:
    """The decoder layers with softmax attention (``self_attn``; Qwen3.5's gated DeltaNet layers have none)."""
    return sum(1 for name, _ in model.named_modules() if name.endswith(".self_attn"))


def reset_stats() -> None:
    for d in runtime_copies():  # this package and the build copy kernelize bound, each with its counters
        d.reset_stats()


def route_as_on_a_gpu(monkeypatch) -> None:
    """``"cutile"`` routes as on a GPU (``test_attention._route_as_on_a_gpu``) in every loaded copy
    of the package (the build's, which kernelize imported, too): padded and windowed prefills and
    every masked or static-cache decode step go to our attention op, its reference on the CPU."""
    copies = [m for name, m in sys.modules.items() if name.endswith("layers.attention") and hasattr(m, "_KERNEL_DEVICES")]
    assert copies
    for m in copies:
        monkeypatch.setattr(m, "_KERNEL_DEVICES", ("cuda", "cpu"))
        monkeypatch.setattr(m, "KERNEL_DTYPES", (*m.KERNEL_DTYPES, torch.float32))


# ---------------------------------------------------------------------------------------------
# CPU: every default, as on a GPU, against the stock model (float32)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ROWS)
def test_cpu_padded_batch_and_generate_match_stock(model_type, variant, kernelize_as_on_cuda, tmp_path, monkeypatch):
    """Float32, our ops' reference formulas: stock's logits, tokens and scores (module docstring)."""
    path = families.save_kernel_row(model_type, tmp_path)
    stock = load(path)
    ours = load(path, use_kernels=True, kernel_config=cutile_kernels.kernel_config(build_dir=variant.parent))
    assert_kernelized(model_type, ours)
    route_as_on_a_gpu(monkeypatch)
    cfg = ours.config
    if "sliding_window" in families.FAMILIES[model_type]:
        assert cfg.sliding_window < max(LENGTHS)
    ids, mask = padded_batch(cfg.vocab_size, LENGTHS, "cpu")
    reset_stats()
    with families.transformers_functions(stock):  # stock's own functions (kernelize rebinds the shared ones)
        want = forward_logits(stock, ids, mask)
        want_gen = {cache: generate_scores(stock, ids, mask, cache, steps=GENERATE_STEPS) for cache in CACHES}
    assert merged_stats()["reference_calls"] == {}  # the stock side ran none of our ops

    got = forward_logits(ours, ids, mask)
    calls = merged_stats()["reference_calls"]
    assert calls.get("attention", 0) > 0 and len(calls) >= 3, calls
    # Every real position of every row (the padded ones too).
    torch.testing.assert_close(valid(got, mask), valid(want, mask), rtol=1e-4, atol=1e-4)
    for b, n in enumerate(LENGTHS):  # each row alone gives what it gave in the padded batch
        alone = forward_logits(ours, ids[b:b + 1, -n:], mask[b:b + 1, -n:])
        torch.testing.assert_close(alone[0], got[b, -n:], rtol=1e-4, atol=1e-4)
    layers = attention_layers(ours)
    for cache in CACHES:
        reset_stats()
        seq, scores = generate_scores(ours, ids, mask, cache, steps=GENERATE_STEPS)
        # Every decode step's attention on ours, in every attention layer (the prefill's may not be).
        assert merged_stats()["reference_calls"].get("attention", 0) >= (GENERATE_STEPS - 1) * layers, cache
        assert torch.equal(seq, want_gen[cache][0]), (cache, seq, want_gen[cache][0])
        torch.testing.assert_close(scores, want_gen[cache][1], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# GPU: bf16 with the cubins against the float32 stock model
# ---------------------------------------------------------------------------------------------

#: Left-padded prompt lengths on the GPU, and the teacher-forced decode steps after them.
GPU_LENGTHS = [40, 29, 9]
STEPS = 8
#: The bound over stock bf16's relative L2 and KL: 1.25x (the other GPU model tests' factor: 24 decode
#: positions of a 256-token vocab are noisier than the bench's prompts) plus epsilons well under
#: stock's own (relative L2 0.6e-2 to 2e-2, KL 5e-9 to 2e-5 on these tiny models: bf16 on the CPU).
RATIO, REL_EPS, KL_EPS = 1.25, 1e-3, 1e-9


def forced_decode(model, ids, mask, forced, cache: str, after_prefill=None) -> torch.Tensor:
    """Logits (B, K, vocab) float32 of a teacher-forced decode: ``ids`` (B, S) under ``mask``
    prefilled into a new ``cache`` ("dynamic" or "static", room for S + K), then one step per
    column of ``forced`` (B, K), each fed that column's token; row ``j`` is what a forward over
    ``cat(ids, forced)`` gives at position ``S + j``; ``after_prefill()`` runs between the two."""
    from transformers import DynamicCache, StaticCache

    (B, S), K = ids.shape, forced.shape[1]
    past = (DynamicCache(config=model.config) if cache == "dynamic"
            else StaticCache(config=model.config, max_cache_len=S + K))
    full = torch.cat([mask, torch.ones(B, K, dtype=mask.dtype, device=mask.device)], 1)
    rows = []
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=past, use_cache=True,
              cache_position=torch.arange(S, device=ids.device))
        if after_prefill is not None:
            after_prefill()
        for j in range(K):
            out = model(input_ids=forced[:, j:j + 1], attention_mask=full[:, :S + j + 1], past_key_values=past,
                        use_cache=True, cache_position=torch.tensor([S + j], device=ids.device))
            rows.append(out.logits[:, -1].float())
    return torch.stack(rows, 1)


def launched() -> dict[str, int]:
    """{kernel: launches} since the last :func:`reset_stats`, over every copy of the package."""
    names = our_symbols()
    out: dict[str, int] = {}
    for symbol, n in merged_stats()["launches"].items():
        out[names.get(symbol, symbol)] = out.get(names.get(symbol, symbol), 0) + n
    return out


def assert_no_new_nan(what: str, ours: torch.Tensor, stock: torch.Tensor) -> None:
    assert not (ours.isnan() & ~stock.isnan()).any(), (what, ours.isnan().sum().item(), stock.isnan().sum().item())


def assert_as_close_as_stock(what: str, ours: torch.Tensor, stock: torch.Tensor, ref: torch.Tensor) -> None:
    """The bench gate's rule (with :data:`RATIO`) on ``ours`` and ``stock`` (bf16 logits, (B, S, V))
    against ``ref`` (float32), and no NaN in ``ours`` where ``stock`` has none."""
    assert_no_new_nan(what, ours, stock)
    o, s = logit_metrics(ours, ref), logit_metrics(stock, ref)
    assert o["rel_l2_err"] <= RATIO * s["rel_l2_err"] + REL_EPS, (what, o, s)
    assert o["kl"] <= RATIO * s["kl"] + KL_EPS, (what, o, s)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ROWS)
def test_gpu_bf16_padded_batch_and_decode_are_as_close_to_float32_as_stock(model_type, tmp_path, strict):
    """bf16 on the cubins: as close to float32 stock as stock bf16 (module docstring)."""
    path = families.save_kernel_row(model_type, tmp_path, layers=4)
    # The stock sides first, with transformers' own functions (an earlier kernelize in this process
    # rebinds the shared ones; the float32 model would fall back under strict).
    ref = load(path, dtype=torch.float32, device_map="cuda")
    stock = load(path, dtype=torch.bfloat16, device_map="cuda")
    cfg = stock.config
    if "sliding_window" in families.FAMILIES[model_type]:
        assert cfg.sliding_window < min(GPU_LENGTHS)
    ids, mask = padded_batch(cfg.vocab_size, GPU_LENGTHS, "cuda")
    forced = torch.randint(3, cfg.vocab_size, (len(GPU_LENGTHS), STEPS), generator=torch.Generator().manual_seed(1))
    forced = forced.cuda()
    S = ids.shape[1]
    full_ids, full_mask = torch.cat([ids, forced], 1), torch.cat([mask, torch.ones_like(forced)], 1)
    with families.transformers_functions(ref), families.transformers_functions(stock):
        want = forward_logits(ref, full_ids, full_mask)
        base = {"prefill": forward_logits(stock, ids, mask),
                **{cache: forced_decode(stock, ids, mask, forced, cache) for cache in CACHES}}
    assert torch.isfinite(valid(want[:, :S], mask)).all() and torch.isfinite(want[:, S:]).all()
    del ref, stock

    ours = load(path, dtype=torch.bfloat16, device_map="cuda", use_kernels=True,
                kernel_config=cutile_kernels.kernel_config())
    assert_kernelized(model_type, ours)
    reset_stats()
    got = forward_logits(ours, ids, mask)
    assert sum(launched().values()) > 0
    assert_no_new_nan("prefill, padding too", got, base["prefill"])
    assert_as_close_as_stock("prefill", valid(got, mask)[None], valid(base["prefill"], mask)[None],
                             valid(want[:, :S], mask)[None])  # every real position of every row
    for cache in CACHES:
        got = forced_decode(ours, ids, mask, forced, cache, after_prefill=reset_stats)
        kernels = launched()  # the decode steps' alone: every attention layer's every step on ours
        attended = kernels.get("attention", 0) + kernels.get("rope_append_attention", 0)
        assert attended >= STEPS * attention_layers(ours), (cache, kernels)
        assert_as_close_as_stock(f"{cache} decode", got, base[cache], want[:, S:])
