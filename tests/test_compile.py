"""A kernelized model under ``torch.compile``: no graph break, our ops in the graph, the eager numbers.

What users run for speed is a static KV cache with a compiled decode step: ``generate(...,
cache_implementation="static")`` compiles it by itself (``fullgraph=False``), the bench and
gpt-fast style code compile the forward with ``fullgraph=True``. A check that dynamo cannot trace
(source inspection, frames) inside a layer's ``forward`` breaks the graph at every layer, or
raises under ``fullgraph=True``; both happened (the RMSNorm hub layer's code-identity check).

CPU: each claimed family (``tests/families.py``), kernelized through ``kernels`` with the build's
layers (capability faked) and every patch applied, compiles with ``fullgraph=True``: zero graph
breaks for the forward and for ``generate``'s static-cache decode step, with and without our
attention; the graphs hold our custom ops; logits equal the eager kernelized model's (on the CPU
the ops take their reference paths). GPU: the same through ``from_pretrained(..., use_kernels=True)``
with inductor, and ``generate``'s own compile (CUDA graphs), against the eager kernelized model.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections import Counter

import pytest
import torch

import cutile_kernels
from cutile_kernels.layers import patch as patcher
from cutile_kernels.layers._match import class_verdict

from families import CLAIMED, OLMO_KERNEL_HEADS, model as tiny_model

transformers = pytest.importorskip("transformers")
kernels = pytest.importorskip("kernels")

from torch._dynamo.backends.registry import lookup_backend  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from transformers.generation import CompileConfig  # noqa: E402

#: Our ops per family in a decoder's graph (the name after the op namespace, which differs between
#: the installed package and a build copy). ``rms_norm`` is the final norm and Qwen3's nothing else.
FAMILY_OPS = {
    "llama": {"rms_norm", "add_rms_norm", "rope", "silu_and_mul_fused"},
    "mistral": {"rms_norm", "add_rms_norm", "rope", "silu_and_mul_fused"},
    "qwen2": {"rms_norm", "add_rms_norm", "rope", "silu_and_mul_fused"},
    "qwen3": {"rms_norm", "add_rms_norm", "qk_norm_rope", "silu_and_mul_fused"},
    "granite": {"rms_norm", "add_rms_norm", "rope", "silu_and_mul_fused"},  # branch times residual_multiplier, then our add
    "smollm3": {"rms_norm", "add_rms_norm", "rope", "silu_and_mul_fused"},
    "gemma": {"rms_norm_gemma", "rope", "gelu_tanh_and_mul_fused"},  # (1 + weight) norms, GeGLU on fused gate/up
    # the attention residual add fused into the next norm (gemma_add_norm), q/k norms + RoPE in one
    # launch (gemma3_qk_norm_rope)
    "gemma3_text": {"rms_norm_gemma", "add_rms_norm_gemma", "qk_norm_rope_gemma", "gelu_tanh_and_mul_fused"},
    # no sdpa path: patch gemma2_attention runs ours
    "gemma2": {"rms_norm_gemma", "add_rms_norm_gemma", "rope", "gelu_tanh_and_mul_fused", "attention"},
    "phi3": {"add_rms_norm", "rms_norm", "rope", "silu_and_mul"},  # Llama-code norms and adds; phi3_rope; phi3_mlp
    # float32-order norms (offset 0): the final one and the q/k norms alone, the post-norms with their
    # adds, the float32-cos RoPE (the tiny head_dim 16, which olmo2_qk_norm_rope's tiles do not take:
    # at head_dim 128 OLMO_FUSED_QK replaces the q/k norms and RoPE)
    "olmo2": {"rms_norm_gemma", "rms_norm_add_gemma", "rope_cast", "silu_and_mul_fused"},
    "olmo3": {"rms_norm_gemma", "rms_norm_add_gemma", "rope_cast", "silu_and_mul_fused"},  # + sliding layers
    # (1 + weight) norms (one fused with the residual add), SwiGLU, the gated norm, the gates (the
    # block's hub layer). The delta rule and conv layers give CPU calls to
    # transformers' functions; on CUDA they are ours (test_gpu_static_generate_... traces them).
    # and the gated attention's q/k norms + partial RoPE and its output gate (patch qwen3_5_rope).
    "qwen3_5_text": {"rms_norm_gemma", "add_rms_norm_gemma", "silu_and_mul_fused", "rms_norm_gated",
                     "gated_delta_gates", "qk_norm_rope_gemma", "sigmoid_and_mul"},
}
#: OLMo's ops at head_dim 128 (every OLMo 2 and 3 checkpoint's): the q/k norms and RoPE as one
#: qk_norm_rope_olmo2 a layer (patch olmo2_qk_norm_rope), the final norm alone.
OLMO_FUSED_QK = {"rms_norm_gemma", "rms_norm_add_gemma", "qk_norm_rope_olmo2", "silu_and_mul_fused"}
#: Families whose sliding layers get a boolean mask at this prefill (20 tokens, a window of 4): under
#: "cutile" (patch masked_prefill_attention) the kernel takes them (the tiny head dim 16 loads as 64).
MASKED_PREFILL = {"gemma3_text", "olmo3"}


@functools.lru_cache(maxsize=None)
def _compile_keeps_masks() -> bool:
    """Whether transformers builds, under torch.compile, the causal masks it skips in eager
    (``masking_utils._ignore_causal_mask_sdpa`` never skips while ``is_torchdynamo_exporting()``,
    which dynamo before torch 2.14 traces as a constant True)."""
    from transformers.utils.import_utils import is_torchdynamo_exporting

    probe = torch.compile(lambda x: x + 1 if is_torchdynamo_exporting() else x, backend="eager", fullgraph=True)
    return bool(probe(torch.zeros(1)).item())


#: Ops a CUDA prefill adds: hub-function layers that give CPU calls to transformers' functions.
CUDA_PREFILL_OPS = {"qwen3_5_text": {"gated_delta_rule", "causal_conv1d"}}


class Recorder:
    """A dynamo backend that records our ops in each graph it gets, then hands the graph to
    ``backend`` (``aot_eager`` on the CPU: fake tensors and functionalization, as inductor
    sees them, without a C++ build)."""

    def __init__(self, backend: str = "aot_eager"):
        self.backend = lookup_backend(backend)
        self.graphs = 0
        self.ops: Counter = Counter()

    def __call__(self, gm, example_inputs, **kwargs):
        self.graphs += 1
        for node in gm.graph.nodes:
            name = str(node.target)
            if node.op == "call_function" and "cutile_kernels" in name:
                self.ops[name.split(".")[-2]] += 1
        return self.backend(gm, example_inputs, **kwargs)

    def __deepcopy__(self, memo):  # CompileConfig.to_dict() deep-copies its backend: keep recording here
        return self


@pytest.fixture
def no_breaks():
    """Fresh dynamo state; fails the test if any graph break was counted."""
    torch._dynamo.reset()
    counters.clear()
    yield
    breaks = dict(counters["graph_break"])
    torch._dynamo.reset()
    assert breaks == {}, breaks


@pytest.fixture(scope="module")
def variant(built_package_dir):
    return built_package_dir.parent


def _kernelize_on_cpu(model, variant, monkeypatch, patches=None):
    """``kernels.kernelize`` for "cuda" with every hub layer of ours from the build (capability
    faked), then the patches (default ones, or ``patches``): what ``cutile_kernels.kernelize``
    does on a GPU."""
    import kernels.layer.repos as repos
    from kernels import Mode

    monkeypatch.setattr(repos, "_find_capability", lambda: 90)
    mapping = {hub: {"cuda": {Mode.INFERENCE: kernels.LocalLayerRepository(variant, layer_name=cls)}}
               for hub, cls in cutile_kernels.layers.MAPPING.items()}
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(model, mode=Mode.INFERENCE, device="cuda", use_fallback=True)
    cutile_kernels.patch(model, names=patches)
    return model


def _all_norms_swapped(model) -> bool:
    """Every RMSNorm runs one of ours: the hub layer (Llama's formula, or a float-order patch's mark
    where kernelize came after the patch), the zero-centered norm's hub layer (Qwen3.5's) or a
    float-order patch's forward."""
    from cutile_kernels.layers.norm import FLOAT_NORM_MARK, computes_gemma_rms_norm, computes_llama_rms_norm

    def ours(m):
        name = getattr(m.__dict__.get("forward"), "__qualname__", "")
        if name == "CutileRMSNorm.forward":
            return computes_llama_rms_norm(type(m)) or FLOAT_NORM_MARK in m.__dict__
        if name == "CutileZeroCenteredRMSNorm.forward":
            return computes_gemma_rms_norm(type(m))
        return name in ("gemma_norm_forward", "olmo2_norm_forward")

    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    return bool(norms) and all(ours(m) for m in norms)


def _compile_config(backend, fullgraph=True):
    cfg = CompileConfig(fullgraph=fullgraph, backend=backend)
    cfg._compile_all_devices = True  # transformers compiles generate's decode step on a GPU only, by default
    return cfg


def _generate(model, ids, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static",
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kw)


# ---------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------

def test_class_verdict_runs_its_judge_once_per_class_and_is_a_constant_when_traced(no_breaks):
    calls = Counter()

    @class_verdict
    def reads_source(cls):
        calls[cls] += 1
        return "* 2" in inspect.getsource(cls.forward)  # what dynamo cannot trace

    class Twice(torch.nn.Module):
        def forward(self, x):
            return x * 2

    class Thrice(torch.nn.Module):
        def forward(self, x):
            return x * 3

    def f(m, x):
        return x + 1 if reads_source(type(m)) else x - 1

    x = torch.ones(3)
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    assert torch.equal(compiled(Twice(), x), x + 1) and torch.equal(compiled(Thrice(), x), x - 1)
    assert torch.equal(f(Twice(), x), x + 1) and torch.equal(f(Thrice(), x), x - 1)
    assert calls == {Twice: 1, Thrice: 1}
    reads_source.cache_clear()
    assert reads_source(Twice) and calls[Twice] == 2


def _route_as_on_a_gpu(monkeypatch):
    """``"cutile"`` chooses sdpa for every call off the GPU and in float32; here it chooses as on one
    in bf16 (the op then computes its reference), in this package's attention module and in the
    build copy's."""
    import sys

    for name, mod in list(sys.modules.items()):
        if name.endswith(".layers.attention") and hasattr(mod, "_KERNEL_DEVICES"):
            monkeypatch.setattr(mod, "_KERNEL_DEVICES", ("cuda", "cpu"))
            monkeypatch.setattr(mod, "KERNEL_DTYPES", (*mod.KERNEL_DTYPES, torch.float32))


#: ``attn_implementation`` at load: transformers' default (sdpa), which the default patch
#: ``cutile_attention`` switches to ``"cutile"`` (Gemma 2's eager: ``gemma2_attention``), and our
#: kernel on every call.
ATTNS = pytest.mark.parametrize("attn", [None, "cutile_kernel"], ids=["default", "cutile-kernel"])


@ATTNS
@pytest.mark.parametrize("model_type", CLAIMED)
def test_kernelized_forward_compiles_fullgraph_with_our_ops(model_type, attn, variant, monkeypatch, no_breaks):
    model = _kernelize_on_cpu(tiny_model(model_type, attn=attn), variant, monkeypatch)
    _route_as_on_a_gpu(monkeypatch)
    assert _all_norms_swapped(model)
    assert model.config._attn_implementation == (attn or "cutile")
    ids = torch.randint(0, 256, (2, 20))  # a prefill (> DECODE_MAX_SQ queries): "cutile" gives it to sdpa unmasked
    with torch.no_grad():
        want = model(ids).logits
        rec = Recorder()
        got = torch.compile(model, backend=rec, fullgraph=True)(ids).logits
    assert rec.graphs == 1
    # "cutile" hands an unmasked prefill to sdpa (a softcap's to the kernel: Gemma 2's; a masked one too)
    masked = model_type in MASKED_PREFILL or _compile_keeps_masks()
    assert set(rec.ops) == FAMILY_OPS[model_type] | ({"attention"} if attn or masked else set())
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("model_type", ["olmo2", "olmo3"])
def test_kernelized_olmo_at_head_dim_128_compiles_fullgraph_with_the_fused_qk_op(model_type, variant, monkeypatch,
                                                                                  no_breaks):
    """At a head dim the kernel's tiles take, the default patch olmo2_qk_norm_rope owns every
    attention module: one qk_norm_rope_olmo2 op a layer in the graph, no RoPE op of its own."""
    model = _kernelize_on_cpu(tiny_model(model_type, **OLMO_KERNEL_HEADS), variant, monkeypatch)
    assert "olmo2_qk_norm_rope" in patcher.applied(model)
    ids = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        want = model(ids).logits
        rec = Recorder()
        got = torch.compile(model, backend=rec, fullgraph=True)(ids).logits
    assert rec.graphs == 1
    assert set(rec.ops) - {"attention"} == OLMO_FUSED_QK
    assert rec.ops["qk_norm_rope_olmo2"] == model.config.num_hidden_layers
    torch.testing.assert_close(got, want)


def test_every_patch_compiles_fullgraph(variant, monkeypatch, no_breaks):
    # The opt-in patches too (rope_cos_sin, fused_qkv), on the family that takes all but Qwen3's and
    # the other families' own (tests/test_rms_norm_gemma.py and tests/test_phi3.py compile those).
    model = _kernelize_on_cpu(tiny_model("llama"), variant, monkeypatch, patches=list(patcher.PATCHES))
    assert set(patcher.applied(model)) == set(patcher.PATCHES) - {"gemma2_attention", "qk_norm_rope",
                                                                  "rms_norm_gemma", "rms_norm_olmo2",
                                                                  "olmo2_norm_add", "olmo2_qk_norm_rope",
                                                                  "phi3_mlp", "phi3_rope",
                                                                  "fused_gate_up_geglu",
                                                                  "qwen3_5_add_norm", "qwen3_5_rope", "gemma_add_norm",
                                                                  "qwen3_5_stacked_proj", "gemma3_qk_norm_rope"}
    ids = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        want = model(ids).logits
        rec = Recorder()
        got = torch.compile(model, backend=rec, fullgraph=True)(ids).logits
    assert set(rec.ops) == FAMILY_OPS["llama"] | {"rope_cos_sin"}
    torch.testing.assert_close(got, want)


#: Families whose compiled decode step runs RoPE and the static cache write as one rope_append (the
#: Llama code's attention, reproduced under dynamo, and Phi-3's). The others keep transformers' writes
#: (their RoPE is another op, or Mistral's tiny layers all slide; a write alone on kv_append lost to
#: inductor's two index_copy_ kernels: _direct.compiled_static_layer).
ROPE_APPENDED = {"llama", "qwen2", "granite", "phi3"}


def _decode_ops(model_type: str) -> set:
    ops = FAMILY_OPS[model_type] | {"attention"}
    return ops - {"rope"} | {"rope_append"} if model_type in ROPE_APPENDED else ops


@ATTNS
@pytest.mark.parametrize("model_type", CLAIMED)
def test_static_cache_generate_compiles_the_decode_step_without_breaks(model_type, attn, variant, monkeypatch,
                                                                      no_breaks):
    model = _kernelize_on_cpu(tiny_model(model_type, attn=attn), variant, monkeypatch)
    _route_as_on_a_gpu(monkeypatch)
    ids = torch.randint(1, 256, (2, 7))
    want = _generate(model, ids, disable_compile=True)
    rec = Recorder()
    got = _generate(model, ids, compile_config=_compile_config(rec))
    # generate runs the prefill eagerly and compiles the decode step (one graph; Mistral's sliding
    # window mask makes a second one when the cache position changes its shape class).
    assert rec.graphs >= 1 and _decode_ops(model_type) <= set(rec.ops)  # decode: the kernel, our cache writes
    assert not {"rope_append", "kv_append"} & set(rec.ops) - _decode_ops(model_type)
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.logits, want.logits):
        torch.testing.assert_close(g, w)


def _compiled_rope_attend_on(monkeypatch, float32: bool = True):
    """``_direct.COMPILED_ROPE_ATTEND`` on, and (``float32``) the one launch's dtype rule widened to
    float32 (a CPU model exact against stock takes it: its reference), in this package's copy and
    the build's."""
    import sys

    for name, mod in list(sys.modules.items()):
        if name.endswith(".layers._direct") and hasattr(mod, "COMPILED_ROPE_ATTEND"):
            monkeypatch.setattr(mod, "COMPILED_ROPE_ATTEND", True)
        if float32 and name.endswith(".ops.attention") and hasattr(mod, "_one_launch"):
            monkeypatch.setattr(mod, "KERNEL_DTYPES", (*mod.KERNEL_DTYPES, torch.float32))


@ATTNS
@pytest.mark.parametrize("padded", [False, True], ids=["plain", "left-padded"])
def test_compiled_decode_step_takes_rope_append_attention_with_its_mask(attn, padded, variant, monkeypatch,
                                                                        no_breaks):
    """With ``COMPILED_ROPE_ATTEND``: a compiled static-cache decode step of the Llama code at a head
    dim the one launch is built for runs RoPE, the cache write and the attention as one
    ``rope_append_attention`` per layer with the step's mask (no ``rope_append``, no decode
    ``attention``), with zero graph breaks; tokens and logits are the uncompiled generate's, for a
    plain and a left-padded batch."""
    model = _kernelize_on_cpu(tiny_model("llama", attn=attn, head_dim=64), variant, monkeypatch)
    _route_as_on_a_gpu(monkeypatch)
    _compiled_rope_attend_on(monkeypatch)
    ids = torch.randint(1, 256, (2, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :3], mask[1, :3] = 0, 0
    want = _generate(model, ids, attention_mask=mask, disable_compile=True)
    rec = Recorder()
    got = _generate(model, ids, attention_mask=mask, compile_config=_compile_config(rec))
    assert rec.graphs >= 1
    assert rec.ops["rope_append_attention"] == model.config.num_hidden_layers * rec.graphs
    assert not {"rope_append", "attention", "kv_append"} & set(rec.ops)
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.logits, want.logits):
        torch.testing.assert_close(g, w)


def test_compiled_rope_attend_is_on_by_default_and_declines_what_the_kernel_would_not_take(variant, monkeypatch,
                                                                                           no_breaks):
    """On by default (since 2026-12-07); switched off the compiled step keeps ``rope_append`` and the
    attention kernel, and on, so do a head dim the one launch has no variant for (16) and
    transformers' sdpa."""
    import sys

    from cutile_kernels.layers import _direct

    assert _direct.COMPILED_ROPE_ATTEND is True
    ids = torch.randint(1, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    for head_dim, attn, on in ((64, "cutile_kernel", False), (16, "cutile_kernel", True), (64, "sdpa", True)):
        model = _kernelize_on_cpu(tiny_model("llama", attn=attn, head_dim=head_dim, layers=2), variant, monkeypatch)
        if attn == "sdpa":
            model.set_attn_implementation("sdpa")  # after the default patch switched it to ours
        _route_as_on_a_gpu(monkeypatch)
        _compiled_rope_attend_on(monkeypatch)  # and float32 taken, as on a GPU in 16 bits
        if not on:
            for name, mod in list(sys.modules.items()):
                if name.endswith(".layers._direct") and hasattr(mod, "COMPILED_ROPE_ATTEND"):
                    monkeypatch.setattr(mod, "COMPILED_ROPE_ATTEND", False)
        rec = Recorder()
        _generate(model, ids, compile_config=_compile_config(rec))
        assert "rope_append_attention" not in rec.ops and rec.ops["rope_append"] == 2 * rec.graphs
        monkeypatch.undo()


def test_graph_step_switches_name_staged_attributes_of_every_package_copy(monkeypatch):
    """``graph_step.py --ab-compiled``'s switches exist where it flips them (a renamed switch would
    make its A/B time the shipped step twice), each flipped to a value that differs from the shipped
    one; and ``graph_step_ab.py`` flips the same table (and the twins switch) in every copy."""
    import runpy

    from cutile_kernels_tools.bench.worker import runtime_copies
    from dev.diagnostics import graph_step

    for name in graph_step.COMPILED_SWITCHES:
        mods, attr, on = graph_step.switch_modules(name)
        assert mods and all(hasattr(m, attr) for m in mods)
        assert all(getattr(m, attr) != on for m in mods), (name, attr)
    assert graph_step.switch_modules("residual")[2] == importlib.import_module("cutile_kernels.kernel_src.gemv").TILES
    ab = runpy.run_path(str(graph_step.__file__).replace("graph_step.py", "graph_step_ab.py"), run_name="ab")
    assert ab["VARIANTS"] == ("none", "twins", *graph_step.COMPILED_SWITCHES, *ab["ENV_VARIANTS"])
    from cutile_kernels import dispatch
    from cutile_kernels.ops._define import OPS

    assert ab["NO_CACHES"] == {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}  # the FX graph cache ignores op tags
    for env in ab["ENV_VARIANTS"].values():  # each changes what is shipped (else the A/B times one side twice)
        names = [n for n in env.get(dispatch.ENV_FLEXIBLE, "").split(",") if n]
        assert all(n in OPS and OPS[n].mutated and not OPS[n].flexible for n in names), names
        assert names or (env.get(dispatch.ENV_FIXED_LAYOUT) == "1" and any(o.flexible for o in OPS.values()))
    for name in graph_step.COMPILED_SWITCHES:
        mods, attr, on = graph_step.switch_modules(name)
        for m in mods:
            monkeypatch.setattr(m, attr, getattr(m, attr))  # put back after the test
        ab["_flip"](name)
        assert all(getattr(m, attr) == on for m in mods)
    for d in runtime_copies():
        monkeypatch.setattr(d, "CAPTURE_TWINS", d.CAPTURE_TWINS)
    ab["_flip"]("twins")
    assert all(d.CAPTURE_TWINS for d in runtime_copies())


#: Guard sources that cost a compiled call's host-side guard check far more than their number says
#: (torch 2.11, the H200's: a Qwen3 step's check 352 us against stock's 67 before they went;
#: dev/diagnostics/guards.py): a child module class's ``__call__`` (``_direct._plain_call``) and a
#: forward's ``__globals__`` reached through its class (the reproduced attention forwards).
_COSTLY_GUARDS = (re.compile(r"^type\(L\['self'\]\._modules.*\)\.__call__$"), re.compile(r"\.forward\.__globals__"))


def _costly_guards(model) -> set[str]:
    return {name for name in _guard_names(model) if any(p.search(name) for p in _COSTLY_GUARDS)}


def _guard_names(model, batch: int = 2) -> set[str]:
    # The sources of the guards of ``model``'s compiled decode step over a StaticCache.
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=32)
    ids = torch.randint(1, 256, (batch, 5))
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        explained = torch._dynamo.explain(model.forward)(ids[:, :1], past_key_values=cache, use_cache=True,
                                                         cache_position=torch.tensor([5]))
    torch._dynamo.reset()
    return {g.name for g in explained.out_guards}


def _op_calls(code: str, op: str) -> list[list[str]]:
    """The top-level arguments of each ``<namespace>.<op>.default(...)`` call in inductor's code."""
    calls = []
    for m in re.finditer(rf"\.{op}\.default\(", code):
        args, depth, start, i = [], 0, m.end(), m.end()
        while depth >= 0:
            c = code[i]
            if c in "([":
                depth += 1
            elif c in ")]":
                depth -= 1
            if (c == "," and depth == 0) or depth < 0:
                args.append(code[start:i].strip())
                start = i + 1
            i += 1
        calls.append(args)
    return calls


def _buffer(arg: str) -> str:
    # `reinterpret_tensor(buf13, (1, 1, 1, 64), ...)` and `buf13` both name buf13
    return re.sub(r"^reinterpret_tensor\(", "", arg).split(",")[0].strip()


def _inductor_step(model) -> tuple:
    """One decode step of ``model`` (batch 2, 6 prompt tokens, the step's attention mask) over a StaticCache
    of 16, eager and compiled by inductor with its caches off (its FX graph cache does not key on the ops'
    layout tags): ``(inductor's code, compiled logits, eager logits, the two caches)``."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code
    from transformers import StaticCache

    ids = torch.randint(1, 256, (2, 6), generator=torch.Generator().manual_seed(3))
    step = dict(use_cache=True, cache_position=torch.tensor([6]), attention_mask=torch.ones(2, 7, dtype=torch.long))
    caches = [StaticCache(config=model.config, max_cache_len=16) for _ in range(2)]
    with torch.no_grad(), inductor_config.patch(force_disable_caches=True):
        for cache in caches:
            model(ids, past_key_values=cache, use_cache=True)
        want = model(ids[:, -1:], past_key_values=caches[0], **step).logits
        compiled = torch.compile(model.forward, backend="inductor", fullgraph=True)
        out, codes = run_and_get_code(compiled, ids[:, -1:], past_key_values=caches[1], **step)
    return "\n".join(codes), out.logits, want, caches


#: (family, the op taking RoPE's tables, their argument positions, the op writing the cache): one mask
#: and one cos/sin pair a step, however many layers read them.
_SHARED_INPUTS = [("llama", "rope_append", (3, 4), "rope_append"), ("qwen3", "qk_norm_rope", (5, 6), None)]


@pytest.mark.parametrize("model_type,rope_op,table_args,write_op", _SHARED_INPUTS,
                         ids=[m for m, *_ in _SHARED_INPUTS])
def test_inductor_builds_a_decode_steps_mask_and_rope_tables_once(model_type, rope_op, table_args, write_op, variant,
                                                                   monkeypatch, no_breaks):
    """A compiled decode step over a StaticCache, under inductor: every layer's attention op reads
    the one mask buffer the step built, every layer's RoPE op the one cos/sin pair (our ops let
    inductor pass inputs as they are: ``ops/_define.py``, flexible_layout; with inductor's default
    the step computed the mask again for each layer, 16 launches a step in Llama-3.2-1B's CUDA
    graph). Llama's RoPE and cache write are one op of ours a layer, writing the cache in place (no
    ``index_copy``, no copy of the cache; ``_direct.rope_and_cache``); Qwen3's writes stay
    transformers'. Logits and caches as the eager kernelized step's."""
    layers = 4
    model = _kernelize_on_cpu(tiny_model(model_type, layers=layers), variant, monkeypatch)
    _route_as_on_a_gpu(monkeypatch)
    code, logits, want, caches = _inductor_step(model)
    attention = _op_calls(code, "attention")
    tables = _op_calls(code, rope_op)
    assert len(attention) == layers and len(tables) == layers
    assert len({_buffer(args[3]) for args in attention}) == 1
    assert all(len({_buffer(args[i]) for args in tables}) == 1 for i in table_args)
    if write_op is None:
        assert "index_copy" in code
    else:  # the cache's keys: graph inputs written where they are, then read by the layer's attention
        writes = _op_calls(code, write_op)
        assert all(re.fullmatch(r"arg\d+_1", args[5]) for args in writes) and "index_copy" not in code
        assert [args[1] for args in attention] == [args[5] for args in writes]
    torch.testing.assert_close(logits, want)
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@ATTNS
def test_inductor_gives_every_layers_one_launch_the_steps_mask_and_rope_tables(attn, variant, monkeypatch, no_breaks):
    """A compiled decode step of the Llama code at head dim 64 (the one launch, ``rope_append_attention``,
    declared ``flexible_layout`` as ``rope_append`` is): every layer's call reads the one mask buffer
    and the one cos/sin pair the step built, and writes its own layer's cache tensors (graph inputs,
    no ``index_copy``); with inductor's default layout each layer after the first got copies of all
    three. Logits and caches as the eager kernelized step's, within float32 rounding (the eager step
    rotates the keys as transformers does, and inductor fuses the layers' float32 math)."""
    layers = 4
    model = _kernelize_on_cpu(tiny_model("llama", attn=attn, layers=layers, head_dim=64), variant, monkeypatch)
    _route_as_on_a_gpu(monkeypatch)
    _compiled_rope_attend_on(monkeypatch)
    code, logits, want, caches = _inductor_step(model)
    calls = _op_calls(code, "rope_append_attention")
    assert len(calls) == layers and all(args[8] != "None" for args in calls)  # the step's mask passed
    for i in (3, 4, 8):  # cos, sin, mask
        assert len({_buffer(args[i]) for args in calls}) == 1, i
    written = [args[i] for args in calls for i in (5, 6)]  # keys, values
    assert all(re.fullmatch(r"arg\d+_1", a) for a in written) and len(set(written)) == 2 * layers
    assert "index_copy" not in code
    torch.testing.assert_close(logits, want)
    for a, b in zip(caches[0].layers, caches[1].layers):  # float32: the compiled layers round apart
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)


def _skipping_past_the_end(keys, values, k, v, length):
    # The kernels' contract (ops/kv_cache.py, ops/rope.py's rope_append): rows whose slot is past the
    # cache's end are not written.
    slots = torch.arange(k.shape[2], device=keys.device) + length.reshape(())
    keep = slots < keys.shape[2]
    keys.index_copy_(2, slots[keep], k[:, :, keep])
    values.index_copy_(2, slots[keep], v[:, :, keep])


@pytest.mark.parametrize("model_type", ["llama", "phi3"])
def test_compiled_step_past_a_static_caches_end_fails(model_type, variant, monkeypatch, no_breaks):
    """transformers' ``StaticLayer.update`` fails a write past the cache's end (its ``index_copy_``
    asserts the slot; inductor compiles that check into the write's kernel). ``rope_append``'s kernels
    skip such rows instead, so a compiled step asserts the bound itself (``_direct._advance``, fused by
    inductor into the length's advance). The CPU reference here skips those rows as the kernels do:
    only that assert can fail the step. One step with room left runs. Llama's RoPE and Phi-3's
    partial one (patch ``phi3_rope``)."""
    from transformers import StaticCache

    from cutile_kernels.ops import rope as rope_ops

    model = _kernelize_on_cpu(tiny_model(model_type, layers=2), variant, monkeypatch)
    _route_as_on_a_gpu(monkeypatch)
    monkeypatch.setattr(rope_ops, "kv_append_reference", _skipping_past_the_end)
    ids = torch.randint(1, 256, (1, 7), generator=torch.Generator().manual_seed(6))
    cache = StaticCache(config=model.config, max_cache_len=8)
    step = torch.compile(model.forward, backend="inductor", fullgraph=True)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        step(ids[:, -1:], past_key_values=cache, use_cache=True, cache_position=torch.tensor([7]))  # slot 7: the last
        assert int(cache.layers[0].cumulative_length) == 8
        with pytest.raises(RuntimeError, match="past the cache's end"):
            step(ids[:, -1:], past_key_values=cache, use_cache=True, cache_position=torch.tensor([8]))


@pytest.mark.parametrize("model_type", ["llama", "phi3"])
def test_compiled_steps_with_our_cache_writes_compile_once_and_with_dynamic_shapes(model_type, variant, monkeypatch,
                                                                                  no_breaks):
    """Compiled decode steps whose RoPE and cache write are one ``rope_append`` reuse one graph step
    after step, with eager steps between them (the op's eager layout cache is not read while tracing:
    its lookups were guards, and an eager insert recompiled the step), and steps of changing lengths
    compile under ``dynamic=True`` (that cache's sort failed on symbolic strides). Logits and caches
    as eager's."""
    from transformers import StaticCache

    model = _kernelize_on_cpu(tiny_model(model_type, layers=2), variant, monkeypatch)
    _route_as_on_a_gpu(monkeypatch)
    ids = torch.randint(1, 256, (2, 14), generator=torch.Generator().manual_seed(7))
    spans = {"once": [(4, 5), (5, 6), (6, 7), (7, 8)], "dynamic": [(4, 6), (6, 9), (9, 10)]}
    for name, steps in spans.items():
        caches = [StaticCache(config=model.config, max_cache_len=16) for _ in range(2)]
        rec = Recorder()
        step = torch.compile(model.forward, backend=rec, fullgraph=True, dynamic=name == "dynamic")
        with torch.no_grad():
            for cache in caches:
                model(ids[:, :4], past_key_values=cache, use_cache=True)
            for a, b in steps:
                kwargs = dict(use_cache=True, cache_position=torch.arange(a, b))
                want = model(ids[:, a:b], past_key_values=caches[0], **kwargs).logits  # eager, between steps
                got = step(ids[:, a:b], past_key_values=caches[1], **kwargs).logits
                torch.testing.assert_close(got, want)
        assert rec.ops["rope_append"] >= 2, (name, rec.ops)
        if name == "once":
            assert rec.graphs == 1, rec.graphs
        for x, y in zip(caches[0].layers, caches[1].layers):
            torch.testing.assert_close(x.keys, y.keys)
            assert torch.equal(x.cumulative_length, y.cumulative_length)
        torch._dynamo.reset()


def test_stock_cache_writes_variable_keeps_transformers_writes_in_compiled_steps(variant, monkeypatch, no_breaks):
    """``CUTILE_KERNELS_STOCK_CACHE_WRITES=1`` (read at import; an A/B switch): a compiled step writes
    its static cache with transformers' ``StaticLayer.update`` and runs RoPE on its own."""
    import os
    import subprocess
    import sys

    from transformers import StaticCache

    from cutile_kernels.layers import _direct

    probe = "import cutile_kernels.layers._direct as d; print(d.COMPILED_CACHE_WRITES)"
    for value, want in (("1", "False"), ("", "True")):
        env = {**os.environ, "CUTILE_KERNELS_STOCK_CACHE_WRITES": value}
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split()[-1] == want
    monkeypatch.setattr(_direct, "COMPILED_CACHE_WRITES", False)
    model = _kernelize_on_cpu(tiny_model("llama", layers=2), variant, monkeypatch)
    _route_as_on_a_gpu(monkeypatch)
    ids = torch.randint(1, 256, (1, 5))
    cache = StaticCache(config=model.config, max_cache_len=8)
    rec = Recorder()
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        torch.compile(model.forward, backend=rec, fullgraph=True)(ids[:, -1:], past_key_values=cache, use_cache=True,
                                                                  cache_position=torch.tensor([5]))
    assert rec.ops["rope"] == 2 and not {"rope_append", "kv_append"} & set(rec.ops)


def test_compiled_step_guards_no_forward_of_projections_or_input_norms(variant, monkeypatch, no_breaks):
    """A compiled step checks its guards on the host before each replay, and a forward bound on an
    instance costs guards on its function, closure and ``__self__``. Patch ``gemv`` switches the
    projections' class (``CutileGemvLinear``) instead of binding a forward on each, and the fused
    decoder forward runs a Llama-formula ``input_layernorm`` (checked at patch time) as its op under
    compile, without the module call to the hub layer's instance-bound forward; the step still runs
    our GEMV and RMSNorm ops, and nothing of the eager cross-layer hand-off is read."""
    from torch import nn
    from transformers import StaticCache

    from cutile_kernels.layers.linear import CutileGemvLinear

    model = _kernelize_on_cpu(tiny_model("llama", layers=2, dtype=torch.bfloat16), variant, monkeypatch)
    projections = [m for m in model.model.layers.modules() if isinstance(m, nn.Linear)]
    assert projections and all(type(m) is CutileGemvLinear for m in projections)
    assert all(layer._cutile_input_norm is type(layer.input_layernorm) for layer in model.model.layers)
    names = _guard_names(model, batch=1)
    assert [n for n in names if "layers" in n]
    assert not [n for n in names if re.search(r"(_proj|input_layernorm)'\]\.(__dict__\['forward'\]|forward)", n)]
    assert not [n for n in names if "_cutile_inbox" in n or "_cutile_next" in n]
    _route_as_on_a_gpu(monkeypatch)
    rec = Recorder()
    ids = torch.randint(1, 256, (1, 5))
    cache = StaticCache(config=model.config, max_cache_len=8)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        torch.compile(model.forward, backend=rec, fullgraph=True)(ids[:, -1:], past_key_values=cache, use_cache=True,
                                                                  cache_position=torch.tensor([5]))
    assert rec.ops["gemv"] > 0 and rec.ops["rms_norm"] == len(model.model.layers) + 1, rec.ops  # + the final norm
    assert "gemv_residual" not in rec.ops  # not routed (ops.gemv.RESIDUAL_TILES is empty)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_compiled_step_adds_the_mlp_residual_in_the_gemv_unless_hooked(act, variant, monkeypatch, no_breaks):
    """With the residual GEMV routed (``ops.gemv.RESIDUAL_TILES``), under compile each layer's last line,
    ``residual + mlp(h)``, is one ``gemv_residual`` (SwiGLU or GeGLU MLP, stacked by our patches), except
    in a layer whose down projection or MLP has a forward hook, which runs (the module calls stay there);
    the logits are the eager stock model's to bf16 rounding (the stacked gate/up GEMM sums in another
    order on the CPU)."""
    from transformers import StaticCache

    import sys

    from cutile_kernels.kernel_src import gemv as kgemv

    for name, mod in list(sys.modules.items()):  # this package's ops and the build copy's
        if name.endswith(".ops.gemv") and hasattr(mod, "RESIDUAL_TILES"):
            monkeypatch.setattr(mod, "RESIDUAL_TILES", kgemv.TILES)

    stock = tiny_model("llama", layers=3, dtype=torch.bfloat16, hidden_act=act)
    model = _kernelize_on_cpu(tiny_model("llama", layers=3, dtype=torch.bfloat16, hidden_act=act), variant,
                              monkeypatch)
    fired = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: fired.append("down"))
    model.model.layers[1].mlp.register_forward_pre_hook(lambda m, i: fired.append("mlp"))
    _route_as_on_a_gpu(monkeypatch)
    rec = Recorder()
    ids = torch.randint(1, 256, (1, 5))
    got = []
    for m in (stock, model):
        cache = StaticCache(config=m.config, max_cache_len=8)
        with torch.no_grad():
            m(ids, past_key_values=cache, use_cache=True)
            step = torch.compile(m.forward, backend=rec, fullgraph=True) if m is model else m.forward
            out = step(ids[:, -1:], past_key_values=cache, use_cache=True, cache_position=torch.tensor([5]))
            got.append(out.logits)
    assert rec.ops["gemv_residual"] == 1, rec.ops  # the third layer's; the first two are hooked
    assert "down" in fired and "mlp" in fired
    torch.testing.assert_close(got[1].float(), got[0].float(), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("change", ["another class", "accelerate hook"])
def test_compiled_step_calls_an_input_norm_changed_later(change, variant, monkeypatch, no_breaks):
    """The input norm's op runs in its place under compile only while it is of the class checked at
    patch time and carries no accelerate hook (``add_hook_to_module`` sets ``_hf_hook`` and replaces the
    forward): a norm of another formula put in afterwards, or one whose forward such a hook replaced, is
    called as a module (its numbers)."""
    import types

    from transformers import StaticCache

    class Doubled(torch.nn.Module):  # not RMSNorm at all
        def forward(self, x):
            return 2 * x

    stock = tiny_model("llama", layers=2)
    model = _kernelize_on_cpu(tiny_model("llama", layers=2), variant, monkeypatch)
    for m in (stock, model):
        if change == "another class":
            m.model.layers[1].input_layernorm = Doubled()
        else:
            norm = m.model.layers[1].input_layernorm
            norm._hf_hook = object()
            norm.forward = types.MethodType(lambda self, x: 2 * x, norm)
    ids = torch.randint(1, 256, (1, 5))
    caches = [StaticCache(config=m.config, max_cache_len=8) for m in (stock, model)]
    with torch.no_grad():
        for m, cache in zip((stock, model), caches):
            m(ids, past_key_values=cache, use_cache=True)
        want = stock(ids[:, -1:], past_key_values=caches[0], use_cache=True, cache_position=torch.tensor([5])).logits
        got = torch.compile(model.forward, backend="aot_eager", fullgraph=True)(
            ids[:, -1:], past_key_values=caches[1], use_cache=True, cache_position=torch.tensor([5])).logits
    torch.testing.assert_close(got, want)


#: Patches whose forwards read their modeling module too, each on a family it applies to, named on
#: top of the defaults: the opt-in fused_qkv, and gemma3_qk_norm_rope, a default patch since the A/B of
#: 2026-12-05 (its case asserts that it applied; gemma3_text-None runs the same patches).
#: (family, patch, config fields): OLMo's stacking needs olmo2_qk_norm_rope, so heads its kernel takes.
_OPT_IN_FORWARDS = [("gemma3_text", "gemma3_qk_norm_rope", {}), ("qwen3", "fused_qkv", {}),
                    ("olmo3", "fused_qkv", OLMO_KERNEL_HEADS)]


@pytest.mark.parametrize("model_type,opt_in,fields", [(m, None, {}) for m in CLAIMED] + _OPT_IN_FORWARDS,
                         ids=[f"{m}-None" for m in CLAIMED] + [f"{m}-{p}" for m, p, _ in _OPT_IN_FORWARDS])
def test_compiled_decode_step_adds_no_costly_guards(model_type, opt_in, fields, variant, monkeypatch, no_breaks):
    """Every compiled call checks its guards on the host before the CUDA graph replays, so a guard
    our forwards add is paid on each decode step. The kernelized and patched model's decode step
    (the default patches, and the opt-in ones with their own attention forwards) holds none of the
    costly kinds that the stock model's lacks: our helpers decide ``torch.compiler.is_compiling()``
    before their eager-only checks, and the reproduced forwards reach their modeling module through
    ``sys.modules`` (``_patching.modeling_globals``)."""
    patches = None
    if opt_in is not None:
        patches = [name for name, p in patcher.PATCHES.items() if p.default] + [opt_in]
    stock = _costly_guards(tiny_model(model_type, **fields))
    model = _kernelize_on_cpu(tiny_model(model_type, **fields), variant, monkeypatch, patches=patches)
    if opt_in is not None:
        assert opt_in in patcher.applied(model)
    ours = _costly_guards(model)
    assert ours <= stock, sorted(ours - stock)[:5]


@pytest.mark.parametrize("model_type", ["olmo2"])
def test_layers_left_alone_compile_fullgraph_with_stock_numbers(model_type, variant, monkeypatch, no_breaks):
    """Olmo2's RMSNorm (hub name "RMSNorm", another rounding) takes our layer, whose verdict sends it
    to its own forward (the default patch rms_norm_olmo2 then runs that formula as our op): the
    verdict is a constant in the graph and the numbers are the stock ones."""
    stock = tiny_model(model_type)
    model = _kernelize_on_cpu(tiny_model(model_type), variant, monkeypatch)
    ids = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        want = stock(ids).logits
        got = torch.compile(model, backend="aot_eager", fullgraph=True)(ids).logits
    torch.testing.assert_close(got, want)


# ---------------------------------------------------------------------------------------------
# GPU: the built kernels under inductor and CUDA graphs
# ---------------------------------------------------------------------------------------------

def _error(logits, ref):
    return ((logits.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny seeded bf16 checkpoints of the claimed families (safetensors), loaded as users load."""
    out = {}
    for model_type in CLAIMED:
        path = tmp_path_factory.mktemp(model_type)
        tiny_model(model_type, dtype=torch.bfloat16, layers=4).save_pretrained(path)
        out[model_type] = path
    return out


def _load(path, attn=None):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda", use_kernels=True,
                                                kernel_config=cutile_kernels.kernel_config(),
                                                attn_implementation=attn).eval()


def _load_stock(path, attn=None):
    from transformers import AutoModelForCausalLM

    # No kernels: stock layers (with attn="cutile_kernel" our attention, registered by name, like the model
    # compared).
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda",
                                                attn_implementation=attn).eval()


@pytest.mark.gpu
@ATTNS
@pytest.mark.parametrize("model_type", CLAIMED)
def test_gpu_forward_under_inductor_fullgraph(model_type, attn, checkpoints, strict, no_breaks):
    model = _load(checkpoints[model_type], attn)
    assert _all_norms_swapped(model)
    ids = torch.randint(0, 256, (2, 37), device="cuda")
    with torch.no_grad():
        want = model(ids).logits
        rec = Recorder("inductor")
        got = torch.compile(model, backend=rec, fullgraph=True)(ids).logits
    # "cutile" sends a masked prefill to the kernel (patch masked_prefill_attention; the tiny head dim
    # loads as 64): the sliding layers' masks, and every layer's where transformers keeps the causal
    # mask under compile (before torch 2.14 dynamo reads torch.compiler.is_exporting() as True).
    masked = model_type in MASKED_PREFILL or _compile_keeps_masks()
    assert set(rec.ops) == FAMILY_OPS[model_type] | CUDA_PREFILL_OPS.get(model_type, set()) | (
        {"attention"} if attn or masked else set())
    err = _error(got, want)
    if err >= 1e-2:
        # Inductor rounds the stock parts it fuses differently from eager; tiny bf16 Gemma 3 amplifies
        # that (0.0118 on the H200, 2026-12-01, the same with sdpa and our attention). Then the bound
        # is what compiling does to the stock model itself.
        stock = _load_stock(checkpoints[model_type], attn)
        with torch.no_grad():
            stock_err = _error(torch.compile(stock, backend="inductor", fullgraph=True)(ids).logits, stock(ids).logits)
        assert err <= 1.5 * stock_err, (err, stock_err)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["olmo2", "olmo3"])
def test_gpu_olmo_at_head_dim_128_runs_the_fused_qk_op_under_inductor(model_type, tmp_path, strict, no_breaks):
    """The tiny OLMo rows above have head dim 16, which olmo2_qk_norm_rope declines: at a head dim
    its tiles take, the compiled forward runs one qk_norm_rope_olmo2 a layer on the GPU (strict: no
    fallback) and matches eager."""
    tiny_model(model_type, dtype=torch.bfloat16, layers=4, **OLMO_KERNEL_HEADS).save_pretrained(tmp_path)
    model = _load(tmp_path)
    assert "olmo2_qk_norm_rope" in patcher.applied(model)
    ids = torch.randint(0, 256, (2, 37), device="cuda")
    with torch.no_grad():
        want = model(ids).logits
        rec = Recorder("inductor")
        got = torch.compile(model, backend=rec, fullgraph=True)(ids).logits
    assert rec.ops["qk_norm_rope_olmo2"] == model.config.num_hidden_layers
    err = _error(got, want)
    if err >= 1e-2:  # bounded, as above, by what compiling does to the stock model itself
        stock = _load_stock(tmp_path)
        with torch.no_grad():
            stock_err = _error(torch.compile(stock, backend="inductor", fullgraph=True)(ids).logits, stock(ids).logits)
        assert err <= 1.5 * stock_err, (err, stock_err)


@pytest.mark.gpu
@ATTNS
@pytest.mark.parametrize("model_type", CLAIMED)
def test_gpu_static_generate_compiles_and_replays_cuda_graphs(model_type, attn, checkpoints, strict, no_breaks):
    """transformers' own recipe: ``cache_implementation="static"`` compiles the decode step
    (inductor, ``reduce-overhead``: CUDA graphs) with ``fullgraph=False``, where a break would cost
    speed silently; zero breaks, and the replayed steps' logits match the eager kernelized model."""
    model = _load(checkpoints[model_type], attn)
    ids = torch.randint(1, 256, (3, 21), device="cuda")
    want = _generate(model, ids, disable_compile=True)
    got = [_generate(model, ids) for _ in range(3)]  # compile, record, replay
    assert counters["stats"]["unique_graphs"] >= 1  # the decode step was compiled
    for run in got:
        for g, w in zip(run.logits, want.logits):
            assert _error(g, w) < 2e-2, _error(g, w)


def _stand_in_caches() -> list[dict]:
    """``ops.attention._DUMMIES`` of this package and of the build's copy."""
    import sys

    return [m._DUMMIES for n, m in list(sys.modules.items()) if n.endswith(".ops.attention") and hasattr(m, "_DUMMIES")]


def _compiled_steps_match_eager(model, ids, feed, max_cache_len: int, mask=None):
    """An eager prefill of ``ids`` (B, P) over a fresh StaticCache, then one decode step per column
    of ``feed`` (teacher-forced tokens), the steps under ``torch.compile(mode="reduce-overhead",
    fullgraph=True)`` and again eagerly: each step's last logits within 2e-2 rel L2. ``mask``: the
    (B, P + steps) padding mask, its prefix passed to each call."""
    from transformers import StaticCache

    p = ids.shape[1]

    def run(step_fn):
        cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        out = []
        with torch.inference_mode():
            model(ids, attention_mask=None if mask is None else mask[:, :p], past_key_values=cache, use_cache=True,
                  cache_position=torch.arange(p, device=ids.device))
            for i in range(feed.shape[1]):
                pos = torch.tensor([p + i], device=ids.device)
                logits = step_fn(feed[:, i:i + 1], attention_mask=None if mask is None else mask[:, :p + 1 + i],
                                 past_key_values=cache, use_cache=True, cache_position=pos).logits
                out.append(logits[:, -1].float().clone())
        return out

    got = run(torch.compile(model.forward, mode="reduce-overhead", fullgraph=True))
    want = run(model)
    for g, w in zip(got, want):
        assert _error(g, w) < 2e-2, _error(g, w)


@pytest.mark.gpu
@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "made-per-launch"])
def test_gpu_compiled_decode_whose_first_kernel_call_is_compiled(prepared, checkpoints, strict, no_breaks):
    """The bench's order: an eager prefill over a StaticCache (``"cutile"`` gives it to sdpa), then
    decode steps under ``torch.compile(mode="reduce-overhead", fullgraph=True)``, so that the
    kernel's first call runs in the CUDA-graph warm-up (an array kept from there failed cudagraph
    trees' pool check on the H200). With the kernel's stand-in arrays made when the model was
    patched, or made per launch (the cache cleared; nothing may be kept from inside a call), the
    graphs record and replay the eager steps' logits (teacher-forced tokens)."""
    model = _load(checkpoints["qwen3"])
    assert model.config._attn_implementation == "cutile"
    caches = _stand_in_caches()
    assert any(key[1].type == "cuda" for c in caches for key in c)  # made by the patch
    if not prepared:
        for c in caches:
            c.clear()
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 256, (2, 21), generator=gen).cuda()
    feed = torch.randint(1, 256, (2, 8), generator=gen).cuda()

    _compiled_steps_match_eager(model, ids, feed, max_cache_len=40)
    if not prepared:
        assert not any(c for c in caches)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_gpu_compiled_decode_over_a_cache_whose_mask_rows_inductor_pads(model_type, checkpoints, strict, no_breaks):
    """Our ops take inputs in the layout inductor gives them (``ops/_define.py``: flexible_layout);
    on a GPU inductor pads a stride past 1024 elements that is not a multiple of 128 bytes, so a
    1100-slot StaticCache's mask reaches the attention kernel with padded rows. A left-padded batch
    (the mask hides keys the length does not) decoded by compiled steps (``reduce-overhead``,
    strict: no fallback) gives the eager steps' logits (teacher-forced tokens)."""
    model = _load(checkpoints[model_type])
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 256, (2, 21), generator=gen).cuda()
    feed = torch.randint(1, 256, (2, 6), generator=gen).cuda()
    mask = torch.ones(2, 21 + feed.shape[1], dtype=torch.long, device="cuda")
    mask[1, :7] = 0  # the second row left-padded by 7
    _compiled_steps_match_eager(model, ids, feed, max_cache_len=1100, mask=mask)


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [False, True], ids=["plain", "left-padded"])
def test_gpu_compiled_decode_takes_the_masked_one_launch(padded, tmp_path, monkeypatch, strict, no_breaks):
    """With ``COMPILED_ROPE_ATTEND`` (the default): a bf16 Llama at head dim 64 decoded by compiled steps
    (``reduce-overhead``, ``fullgraph=True``, strict: no fallback) launches the masked
    ``rope_append_attention`` variant, and no ``rope_append``, and gives the eager steps' logits
    (teacher-forced tokens; a left-padded row too), over a cache whose length crosses a KV tile."""
    from launches import launched_variants

    tiny_model("llama", dtype=torch.bfloat16, layers=3, head_dim=64).save_pretrained(tmp_path)
    model = _load(tmp_path)
    _compiled_rope_attend_on(monkeypatch, float32=False)
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(1, 256, (2, 123), generator=gen).cuda()
    feed = torch.randint(1, 256, (2, 9), generator=gen).cuda()  # lengths 124..132 cross the 128-key tile
    mask = None
    if padded:
        mask = torch.ones(2, ids.shape[1] + feed.shape[1], dtype=torch.long, device="cuda")
        mask[1, :70] = 0
    before = dict(cutile_kernels.stats()["launches"])
    _compiled_steps_match_eager(model, ids, feed, max_cache_len=200, mask=mask)
    launched = {(v.kernel, v.constants.get("MASKED")) for v in launched_variants(before)}
    assert ("rope_append_attention", 1) in launched and not any(k == "rope_append" for k, _ in launched)


_PAST_THE_END = """
import sys, torch, cutile_kernels
from transformers import AutoModelForCausalLM, StaticCache
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, device_map="cuda", use_kernels=True,
                                             kernel_config=cutile_kernels.kernel_config()).eval()
ids = torch.randint(1, 256, (1, 8), device="cuda")
cache = StaticCache(config=model.config, max_cache_len=8)
step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
with torch.inference_mode():
    model(ids, past_key_values=cache, use_cache=True)
    print("launches", sum(cutile_kernels.stats()["launches"].values()), flush=True)
    try:
        step(ids[:, -1:], past_key_values=cache, use_cache=True, cache_position=torch.tensor([8], device="cuda"))
        torch.cuda.synchronize()
    except Exception as error:  # torch.AcceleratorError, a RuntimeError
        # The first CUDA call after the assert reports it, in its own words (cuBLAS: EXECUTION_FAILED);
        # the context's sticky error says what it was.
        print("step failed:", str(error).splitlines()[0], flush=True)
        try:
            torch.cuda.synchronize()
        except Exception as sticky:
            print("sticky:", str(sticky).splitlines()[0], flush=True)
        sys.exit(1)
print("no error", flush=True)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_gpu_compiled_step_past_a_static_caches_end_fails_loudly(model_type, checkpoints):
    """A compiled step (``reduce-overhead``) past a full StaticCache's end stops the process with a
    device-side assert: Llama's, whose ``rope_append`` writes would skip the rows (this checkpoint's
    head dim, 16, has no ``rope_append_attention`` variant, so the one launch, which skips them
    too and asserts the same bound, is not what runs here), by our bound
    (``_direct._advance``); Qwen3's (transformers' writes) by inductor's check of ``index_copy_``, for
    comparison. In a subprocess: the assert ends its CUDA context."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PAST_THE_END, str(checkpoints[model_type])], capture_output=True,
                         text=True, timeout=400)
    text = out.stdout + out.stderr
    assert "launches" in out.stdout and int(out.stdout.split("launches")[1].split()[0]) > 0  # our kernels ran
    assert out.returncode != 0 and "no error" not in out.stdout, text[-2000:]
    assert "sticky: CUDA error: device-side assert triggered" in out.stdout or "past the cache's end" in text, text[-2000:]


@pytest.mark.gpu
def test_gpu_attention_calls_launch_with_the_arrays_the_patch_made(checkpoints, strict, monkeypatch):
    """The forwards transformers calls for ``"cutile"`` belong to the copy of the package whose
    stand-in arrays the patch made (the source package and the build variant ``kernels`` loads each
    have their own): a decode step over a static cache launches none of the fill kernels that the
    same step launches with that copy's arrays cleared (three a call: 48 a Llama-3.2-1B step on the
    H200 before the patch registered its own copy)."""
    import sys

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    from transformers import AttentionInterface, StaticCache

    for c in _stand_in_caches():  # no copy's arrays made before this model's patch
        c.clear()
    model = _load(checkpoints["llama"])
    forward = AttentionInterface._global_mapping["cutile"]
    ops = sys.modules[forward.__module__.rsplit(".layers.", 1)[0] + ".ops.attention"]
    assert any(key[1] == torch.device("cuda", 0) for key in ops._DUMMIES)
    ids = torch.randint(1, 256, (2, 21), device="cuda")

    def fills() -> int:
        cache = StaticCache(config=model.config, max_cache_len=40)
        with torch.inference_mode():
            model(ids, past_key_values=cache, use_cache=True)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                model(ids[:, :1], past_key_values=cache, use_cache=True)
                torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
        assert any(n.startswith("attention_kernel") for n in names)
        return sum("FillFunctor" in n for n in names)

    prepared = fills()
    monkeypatch.setattr(ops, "_DUMMIES", {})
    assert fills() - prepared >= 2 * model.config.num_hidden_layers


def test_qwen3_5_zero_centered_norms_take_our_hub_layer_after_the_patches(variant, monkeypatch, no_breaks):
    # Qwen3_5RMSNorm is decorated "RMSNormZeroCentered": kernelize rebinds it after the patches ran
    # (so rms_norm_gemma cannot keep it); our hub layer for that name runs the same kernel (on the
    # CPU its reference, counted), with stock numbers, and traces with the op in the graph.
    stock = tiny_model("qwen3_5_text")
    model = tiny_model("qwen3_5_text")
    cutile_kernels.patch(model)  # from_pretrained's order: the patches first, then kernelize
    model = _kernelize_on_cpu(model, variant, monkeypatch, patches=[])
    norms = [m for m in model.modules() if type(m).__name__ == "Qwen3_5RMSNorm"]
    assert norms and all(m.forward.__func__.__qualname__ == "CutileZeroCenteredRMSNorm.forward" for m in norms)
    # The bound layer is the build's copy of the package, with its own counters.
    build_pkg = norms[0].forward.__func__.__module__.rpartition(".layers")[0]
    build_dispatch = importlib.import_module(f"{build_pkg}.dispatch")
    ids = torch.randint(0, 256, (2, 11))
    build_dispatch.reset_stats()
    cutile_kernels.dispatch.reset_stats()
    with torch.no_grad():
        want, got = stock(ids).logits, model(ids).logits
    assert torch.equal(got, want)
    # The post-attention norms run in the fused add + norm of the patch qwen3_5_add_norm (the
    # source package's op: cutile_kernels.patch applied it).
    # The attention's q/k norms run in the fused q/k norm + RoPE of the patch qwen3_5_rope.
    calls = cutile_kernels.dispatch.stats()["reference_calls"]
    fused, fused_qk = calls["add_rms_norm_gemma"], 2 * calls["qk_norm_rope_gemma"]
    assert build_dispatch.stats()["reference_calls"]["rms_norm_gemma"] + fused + fused_qk == len(norms)
    assert fused > 0 and fused_qk > 0
    # Every gated DeltaNet block (the stacked class's forward is the installed package's, the bound
    # functions the build's) asks the recurrent layer beside it to update the cache's state in place.
    blocks = [m for m in model.modules() if "fused_recurrent_gated_delta_rule" in getattr(m, "_kernel_funcs", {})]
    assert blocks and all(b.forward.__qualname__ == "CutileGatedDeltaNet.forward" for b in blocks)
    for b in blocks:
        names = b.forward.__func__.__globals__
        assert names["_is_ours"](b._kernel_funcs["fused_recurrent_gated_delta_rule"],
                                 names["CutileFusedRecurrentGatedDeltaRule"])
        assert not names["_is_ours"](b._kernel_funcs["chunk_gated_delta_rule"],
                                     names["CutileFusedRecurrentGatedDeltaRule"])
    rec = Recorder()
    with torch.no_grad():
        compiled = torch.compile(model, backend=rec, fullgraph=True)(ids).logits
    assert "rms_norm_gemma" in rec.ops
    torch.testing.assert_close(compiled, want)


def test_patch_identity_checks_trace_as_they_run_eagerly():
    """What the reproduced forwards ask while dynamo traces them: ``swapped`` (Qwen3's attention:
    its own swap or a stacked class's forward) and ``_direct._gemv_patched`` (the gemv class) answer as in
    eager Python. Under torch 2.11, ``getattr(m.__dict__.get("forward"), "__func__", None)`` traced to None
    and compiled Qwen3 steps took the stock q/k norm + RoPE lines (H200, 2026-12-03; reproduced and
    fixed with torch 2.11 on the CPU)."""
    from cutile_kernels.layers._direct import _gemv_patched
    from cutile_kernels.layers._patching import swapped
    from cutile_kernels.layers.models.qwen3 import fused_attention_forward

    model = tiny_model("qwen3", seed=0)
    cutile_kernels.patch(model)
    attn, down, head = model.model.layers[0].self_attn, model.model.layers[0].mlp.down_proj, model.lm_head
    attn.q_norm.forward = lambda x: x  # a plain function on an instance (as a user's wrapper)

    def answers():
        return (swapped(attn, fused_attention_forward), swapped(attn.q_norm, fused_attention_forward),
                _gemv_patched(down), _gemv_patched(head))

    traced = []

    def probe(x):
        traced.append(answers())
        return x + 1

    torch._dynamo.reset()
    torch.compile(probe, backend="eager", fullgraph=True)(torch.ones(2))
    torch._dynamo.reset()
    assert answers() == (True, False, True, False)
    assert traced == [answers()]
