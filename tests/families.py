"""Tiny configs of the model families the tests build models of, one row per family.

Each row is the family's real architecture (transformers' config class for its ``model_type``) at a
size the CPU runs in milliseconds: hidden 64, 4 query heads over 2 KV heads (GQA), head_dim 16,
vocabulary 256. :data:`CLAIMED` are the families whose layers our default kernels and patches cover;
the others are there for their opt-in patches and to check that what we do not cover is left alone.
"""

from __future__ import annotations

import contextlib
import sys

import torch

#: The model types the package claims by default (``cutile_kernels.layers.models``): every test of
#: a layer, patch or compiled path runs on each. A family's type without a row below fails
#: test_families.
from cutile_kernels.layers.models import claimed_model_types  # noqa: E402

CLAIMED = claimed_model_types()

_SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=256)

#: model_type -> config fields beyond :data:`_SMALL` (the family's own features).
FAMILIES = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "granite": {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2,
                "logits_scaling": 4.0},
    "smollm3": {"no_rope_layer_interval": 2, "pad_token_id": 0},  # every second layer NoPE
    # Qwen3.5's text decoder: gated DeltaNet layers, every second layer full attention.
    "qwen3_5_text": {"full_attention_interval": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                     "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4},
    # Its partial RoPE (phi3_rope), SwiGLU on the checkpoint's fused gate/up (phi3_mlp) and Llama-code norms.
    "phi3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1, "partial_rotary_factor": 0.5},
    # OLMo 2's float32-order norms and its float32-cos RoPE (its Llama-code MLP too);
    # Gemma's (1 + weight) norms by default, its GeGLU opt-in; Gemma 3's q/k norms, sliding windows.
    "olmo2": {},
    # OLMo 3: OLMo 2's code with sliding-window layers (3 of 4 in the real models; here every second
    # layer slides, so that even 2- and 3-layer models mix both kinds).
    "olmo3": {"sliding_window": 4,
              "layer_types": lambda n: ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]},
    "gemma": {},
    "gemma3_text": {"sliding_window": 4, "sliding_window_pattern": 2},
    # Gemma 2: its norms are GemmaRMSNorm's code; attention and final logit softcaps, sliding layers.
    "gemma2": {"sliding_window": 4},
}

#: Fields over the OLMo rows (olmo2, olmo3) that give heads qk_norm_rope_olmo2's tiles take (head_dim
#: 66 to 128; every OLMo 2 and 3 checkpoint has 128): the default patch olmo2_qk_norm_rope, and
#: fused_qkv that stacks only what it patches, leave the rows' head_dim 16 alone.
OLMO_KERNEL_HEADS = {"head_dim": 128}


def kernel_fields(model_type: str) -> dict:
    """Fields over ``model_type``'s tiny row under which every default patch of its family applies:
    :data:`OLMO_KERNEL_HEADS` for the OLMo rows, none for the others."""
    return OLMO_KERNEL_HEADS if model_type in ("olmo2", "olmo3") else {}


def config(model_type: str, layers: int = 3, **fields):
    """The tiny config of ``model_type`` with ``layers`` decoder layers (``fields`` override; a
    callable value is called with ``layers``: a per-layer list)."""
    from transformers import AutoConfig

    given = {**FAMILIES[model_type], **fields}
    given = {k: v(layers) if callable(v) else v for k, v in given.items()}  # per-layer lists
    return AutoConfig.for_model(model_type, **{**_SMALL, **given, "num_hidden_layers": layers})


def model(model_type: str, dtype=torch.float32, layers: int = 3, attn: str | None = None, seed: int = 1234,
          **fields):
    """A seeded causal LM of the tiny config in eval mode, its RMSNorm weights moved off 1 so that
    they matter (``attn``: ``attn_implementation``, default sdpa)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(config(model_type, layers, **fields), attn_implementation=attn)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
    return m.to(dtype).eval()



def save_kernel_row(model_type: str, path, layers: int = 3):
    """``model_type``'s seeded float32 model, at :func:`kernel_fields` (every default patch of its
    family applies), saved at ``path`` (safetensors) as a checkpoint to load; returns ``path``."""
    model(model_type, layers=layers, **kernel_fields(model_type)).save_pretrained(path)
    assert (path / "model.safetensors").is_file()
    return path

@contextlib.contextmanager
def transformers_functions(model):
    """``model`` runs transformers' own code in its hub-function modules (``apply_rotary_pos_emb``
    and the like: one module object per modeling file, shared by every model built from it) inside
    the block. kernelize binds our forward onto such a module for the whole process, so a stock
    model built after a kernelized one would run ours (and a float64 reference would fall back
    under ``strict``). Also the function modules of the modeling files themselves that the model's
    code calls by name (Qwen3.5's ``torch_chunk_gated_delta_rule`` and the like)."""
    homes = {sys.modules[type(m).__module__] for m in model.modules() if type(m).__module__ in sys.modules}
    shared = [v for home in homes for v in vars(home).values() if isinstance(v, torch.nn.Module)]
    seen, bound = set(), []
    for m in [*model.modules(), *shared]:
        if id(m) not in seen and "forward" in m.__dict__:
            seen.add(id(m))
            bound.append((m, m.__dict__.pop("forward")))
    try:
        yield model
    finally:
        for m, forward in bound:
            m.__dict__["forward"] = forward


def prefill_and_step(model, ids):
    """Logits of a prefill of ``ids`` (B, S) over a DynamicCache and of one cached decode step (the
    first token again), concatenated along the sequence: (B, S + 1, vocab)."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        first = model(ids, past_key_values=cache, use_cache=True).logits
        return torch.cat([first, model(ids[:, :1], past_key_values=cache, use_cache=True).logits], 1)


def compile_fullgraph(model, seed: int = 6):
    """Compile ``model`` with ``fullgraph=True`` (aot_eager) on a seeded (1, 7) prompt. Returns
    (frames dynamo compiled, the call targets of the graphs as strings, compiled logits, eager logits)."""
    import torch._dynamo.testing

    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = model(ids).logits
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    with torch.no_grad():
        got = torch.compile(model, backend=counter, fullgraph=True)(ids).logits
    targets = {str(n.target) for gm in counter.graphs for n in gm.graph.nodes if n.op == "call_function"}
    return counter.frame_count, targets, got, want


def relative_errors_vs_float32(model_type: str, patch_names, seq: int = 37, **fields):
    """On CUDA: the float32 model's logits as the reference, and the relative L2 error against it of
    the stock bf16 model and of the bf16 model patched with ``patch_names``. Returns (ours, stock,
    the PatchReport of the patch call)."""
    import cutile_kernels

    ref = model(model_type, **fields).cuda()
    stock = model(model_type, dtype=torch.bfloat16, **fields).cuda()
    ours = model(model_type, dtype=torch.bfloat16, **fields).cuda()
    report = cutile_kernels.patch(ours, names=list(patch_names))
    ids = torch.randint(0, 256, (3, seq), device="cuda")
    with torch.no_grad():
        with transformers_functions(ref), transformers_functions(stock):
            want, s = ref(ids).logits.double(), stock(ids).logits.double()
        o = ours(ids).logits.double()
    return ((o - want).norm() / want.norm()).item(), ((s - want).norm() / want.norm()).item(), report
