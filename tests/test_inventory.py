"""The kernel inventory (FlashInfer-Bench format): validation of the real tree (this is the CI
check), negative cases, compatibility with flashinfer_bench's models, and `evaluate`'s plumbing on
the CPU (its kernel path runs on a GPU only)."""

from __future__ import annotations

import importlib
import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch
from cutile_kernels_tools import cli, inventory
from cutile_kernels_tools.inventory import evaluate, fib_schema, families as inventory_families

ROOT = Path(__file__).resolve().parents[1]
INVENTORY = ROOT / "inventory"
STRUCTURE = Path(__file__).parent / "data" / "flashinfer_bench_0.1.2_structure.json"

try:
    import flashinfer_bench.data as fib
except ImportError:  # it depends on flashinfer-python; `pip install --no-deps flashinfer-bench` is enough
    fib = None
needs_fib = pytest.mark.skipif(fib is None, reason="flashinfer_bench is not importable")


@pytest.fixture
def copy(tmp_path):
    """A writable copy of the real inventory (definitions, solutions, workloads)."""
    dst = tmp_path / "inventory"
    for sub in ("definitions", "solutions", "workloads"):
        shutil.copytree(INVENTORY / sub, dst / sub)
    return dst


#: Every kernel of the tree (what validate checks the inventory's Solutions against).
KERNELS = inventory.kernel_functions()


# ---------------------------------------------------------------------------------------------
# The real tree
# ---------------------------------------------------------------------------------------------

def test_inventory_validates_for_every_kernel_in_the_tree():
    rep = inventory.validate(INVENTORY)
    assert rep.ok, "\n".join(rep.errors)
    kernels = inventory.kernel_functions()
    inv = inventory.Inventory.load(INVENTORY)
    for k in kernels:
        s = inv.solution_for_kernel(k)
        assert s is not None and s.definition in inv.definitions
        # one line per target arch: from the build manifest or a compile
        assert {line.split(" ")[1].rstrip(":") for line in rep.compiled if line.startswith(s.name + " ")} == set(
            s.spec.target_hardware)
    assert rep.checked["kernels"] == len(kernels) >= 2


def test_generated_files_are_in_sync_with_the_code():
    inv = inventory.Inventory.load(INVENTORY)
    gen = inventory_families.generated(ROOT)
    for d in gen["definitions"]:
        assert inv.definitions[d.name].to_dict() == d.to_dict(), f"{d.name}: run `cutile-kernels inventory sync`"
        assert [w.to_dict() for w in inv.workloads[d.name]] == [w.to_dict() for w in gen["workloads"][d.name]]
    for s, _ in gen["solutions"]:
        assert inv.solutions[s.name].to_dict() == s.to_dict(), f"{s.name}: run `cutile-kernels inventory sync`"


def test_norm_definitions_reproduce_the_ops_reference_and_real_shapes():
    from cutile_kernels.ops.norm import add_rms_norm_reference

    inv = inventory.Inventory.load(INVENTORY)
    d = inv.definitions["add_rms_norm"]
    assert list(d.inputs) == ["x", "residual", "weight", "eps"] and list(d.outputs) == ["y", "residual_out"]
    assert any(t.startswith("source:transformers@v5.22.2:") for t in d.tags)
    run = inventory.load_reference(d)
    x, r, w = torch.randn(3, 96, dtype=torch.bfloat16), torch.randn(3, 96, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    for got, want in zip(run(x, r, w, 1e-6), add_rms_norm_reference(x, r, w, 1e-6)):
        assert torch.equal(got, want)
    axes = {(w.uuid, w.axes["num_tokens"], w.axes["hidden_size"]) for w in inv.workloads["rms_norm"]}
    assert ("mistral-7b-v0.3/hidden/prefill-2048", 2048, 4096) in axes
    assert ("qwen2.5-1.5b/hidden/decode-b16", 16, 1536) in axes
    assert ("qwen3-0.6b/q_norm/prefill-2048", 2048 * 16, 128) in axes  # per-head q norm: tokens x heads rows
    eps = {w.uuid: w.inputs["eps"].value for w in inv.workloads["rms_norm"]}
    assert eps["qwen3-0.6b/hidden/decode-b1"] == 1e-6 and eps["llama-3.2-1b/hidden/decode-b1"] == 1e-5


def _workload_axes(name: str) -> dict:
    return {w.uuid: w.axes for w in inventory.Inventory.load(INVENTORY).workloads[name]}


def test_new_families_have_the_presets_shapes():
    from cutile_kernels_tools.inventory import families as fam

    assert {p: b * s for p, (b, s) in fam.PHASES.items()} == inventory.TOKEN_COUNTS
    mlp = _workload_axes("silu_and_mul")
    assert mlp["mistral-7b-v0.3/mlp/prefill-2048"] == {"num_tokens": 2048, "intermediate_size": 14336}
    assert mlp["qwen2.5-1.5b/mlp/decode-b16"] == {"num_tokens": 16, "intermediate_size": 8960}
    assert _workload_axes("silu")["qwen3-0.6b/mlp/decode-b1"] == {"num_tokens": 1, "intermediate_size": 3072}
    fused = _workload_axes("silu_and_mul_fused")
    assert fused["llama-3.2-1b/mlp/decode-b16"] == {"num_tokens": 16, "gate_up_size": 16384, "intermediate_size": 8192}
    assert len(fused) == len(mlp) == 12
    rope = _workload_axes("rope")
    assert rope["qwen2.5-1.5b/decode-b16"] == {"batch": 16, "seq_len": 1, "num_q_heads": 12, "num_kv_heads": 2,
                                               "head_dim": 128}  # head_dim = hidden / heads: no head_dim key
    assert rope["llama-3.2-1b/prefill-2048"] == {"batch": 1, "seq_len": 2048, "num_q_heads": 32, "num_kv_heads": 8,
                                                 "head_dim": 64}
    attn = inventory.Inventory.load(INVENTORY).workloads["attention"]
    by_uuid = {w.uuid: w for w in attn}
    assert by_uuid["qwen3-0.6b/decode-b1/kv8192"].axes == {"batch": 1, "num_q_heads": 16, "num_kv_heads": 8,
                                                           "head_dim": 128, "q_len": 1, "kv_len": 8192}
    assert by_uuid["qwen3-0.6b/decode-b1/kv8192"].inputs["scale"].value == 128 ** -0.5
    assert by_uuid["mistral-7b-v0.3/prefill-2048"].axes == {"batch": 1, "num_q_heads": 32, "num_kv_heads": 8,
                                                            "head_dim": 128, "q_len": 2048, "kv_len": 2048}
    assert len(attn) == 4 * (1 + 2 * len(fam.DECODE_KV_LENS))
    assert attn[0].uuid == "llama-3.2-1b/decode-b16/kv2048"  # the boundaries' base, on purpose
    # OLMo 3 runs OLMo 2's norm and RoPE code: its preset's shapes are Workloads of those kernels.
    norm = {w.uuid: w for w in inventory.Inventory.load(INVENTORY).workloads["rms_norm_gemma"]}
    assert norm["olmo-3-7b/k_norm/decode-b16"].axes == {"num_tokens": 16, "hidden_size": 32 * 128}  # 32 KV heads
    assert norm["olmo-3-7b/hidden/prefill-2048"].inputs["offset"].value == 0.0
    assert "olmo-3-7b/hidden/decode-b1" in _workload_axes("rms_norm_add_gemma")
    # Gemma 2 runs Gemma's (1 + weight) norms (no q/k norms) and, as Gemma 3, the fused attention add.
    assert norm["gemma-2-2b/hidden/decode-b16"].axes == {"num_tokens": 16, "hidden_size": 2304}
    assert norm["gemma-2-2b/hidden/decode-b16"].inputs["offset"].value == 1.0
    assert not any(u.startswith("gemma-2-2b/") and "/hidden/" not in u for u in norm)
    add = {w.uuid: w for w in inventory.Inventory.load(INVENTORY).workloads["add_rms_norm_gemma"]}
    assert add["gemma-3-1b/hidden/prefill-2048"].axes == {"num_tokens": 2048, "hidden_size": 1152}
    assert add["gemma-2-2b/hidden/decode-b1"].inputs["offset"].value == 1.0
    assert _workload_axes("rope_cast")["olmo-3-7b/decode-b16"] == {"batch": 16, "seq_len": 1, "num_q_heads": 32,
                                                                   "num_kv_heads": 32, "head_dim": 128}


def test_new_definitions_reproduce_transformers():
    """Each Definition's run against the transformers code it names (v5.22.2), bit for bit where
    the math is the same ops (activation, RoPE: Llama's and OLMo 2's), to float32 rounding for attention."""
    from transformers import LlamaConfig
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama import modeling_llama

    inv = inventory.Inventory.load(INVENTORY)
    run = {name: inventory.load_reference(inv.definitions[name])
           for name in ("silu_and_mul", "silu_and_mul_fused", "silu", "rope", "rope_cast", "attention")}
    for name in run:
        assert any(t.startswith("source:transformers@v5.22.2:src/transformers/") for t in inv.definitions[name].tags)
    torch.manual_seed(0)
    # LlamaMLP.forward itself, with weights that make gate_proj(x) = g, up_proj(x) = u, down_proj = [I; 0].
    n = 96
    mlp = modeling_llama.LlamaMLP(LlamaConfig(hidden_size=2 * n, intermediate_size=n, hidden_act="silu")).to(torch.bfloat16)
    eye, zero = torch.eye(n, dtype=torch.bfloat16), torch.zeros(n, n, dtype=torch.bfloat16)
    with torch.no_grad():
        mlp.gate_proj.weight.copy_(torch.cat([eye, zero], 1))
        mlp.up_proj.weight.copy_(torch.cat([zero, eye], 1))
        mlp.down_proj.weight.copy_(torch.cat([eye, zero], 0))
    x = torch.randn(7, 2 * n).to(torch.bfloat16) * 3
    with torch.no_grad():
        want = mlp(x)[:, :n]
    assert torch.equal(run["silu_and_mul"](x[:, :n], x[:, n:]), want)
    assert torch.equal(run["silu_and_mul_fused"](x), want)
    assert torch.equal(run["silu"](x), mlp.act_fn(x))
    # RoPE with the cos/sin of Llama-3.2-1B's rotary embedding (llama3 scaling), per-row positions.
    from cutile_kernels_tools import presets

    cfg = presets.make_config("llama-3.2-1b")
    q, k = torch.randn(2, 32, 5, 64).to(torch.bfloat16), torch.randn(2, 8, 5, 64).to(torch.bfloat16)
    cos, sin = modeling_llama.LlamaRotaryEmbedding(cfg)(q, torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]]))
    got, want = run["rope"](q, k, cos, sin), modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # OLMo 2's, with the float32 cos/sin of OLMo-2-1B's rotary embedding.
    from transformers.models.olmo2 import modeling_olmo2

    cfg = presets.make_config("olmo-2-1b")
    q, k = torch.randn(2, 16, 5, 128).to(torch.bfloat16), torch.randn(2, 16, 5, 128).to(torch.bfloat16)
    cos, sin = modeling_olmo2.Olmo2RotaryEmbedding(cfg)(q, torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]]))
    assert cos.dtype == torch.float32
    got, want = run["rope_cast"](q, k, cos, sin), modeling_olmo2.apply_rotary_pos_emb(q, k, cos, sin)
    assert all(torch.equal(a, b) and a.dtype == torch.bfloat16 for a, b in zip(got, want))
    # Attention: sdpa's prefill (is_causal) and decode (no mask) paths, eager's with a causal mask.
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 4, True
    for sq, skv in ((9, 9), (1, 13)):
        q, k, v = torch.randn(2, 8, sq, 32), torch.randn(2, 2, skv, 32), torch.randn(2, 2, skv, 32)
        got = run["attention"](q, k, v, 0.3).transpose(1, 2)
        torch.testing.assert_close(got, sdpa_attention_forward(module, q, k, v, None, scaling=0.3)[0],
                                   rtol=1e-5, atol=1e-6)
        causal = torch.full((sq, skv), float("-inf")).triu(skv - sq + 1)
        torch.testing.assert_close(got, modeling_llama.eager_attention_forward(module, q, k, v, causal, 0.3)[0],
                                   rtol=1e-5, atol=1e-6)


def test_window_softcap_attention_reproduces_gemma2s_eager_attention():
    """attention_window_softcap's run against Gemma 2's eager_attention_forward (v5.22.2) with the
    sliding-window causal mask of masking_utils, in float32: logits large enough that the softcap
    bends them, windows that bind (prefill and a decode step past the window), a full layer
    (window 0) and Gemma 3's case (no softcap)."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gemma2 import modeling_gemma2

    inv = inventory.Inventory.load(INVENTORY)
    d = inv.definitions["attention_window_softcap"]
    assert any(t.endswith("gemma2/modeling_gemma2.py::eager_attention_forward") for t in d.tags)
    run = inventory.load_reference(d)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 4, False
    torch.manual_seed(0)
    for sq, skv, window, softcap in ((11, 11, 4, 5.0), (1, 13, 4, 5.0), (11, 11, 0, 5.0), (1, 13, 6, 0.0)):
        q, k, v = torch.randn(2, 8, sq, 32) * 3, torch.randn(2, 2, skv, 32) * 3, torch.randn(2, 2, skv, 32)
        rule = sliding_window_causal_mask_function(window) if window else causal_mask_function
        i = torch.arange(sq).view(sq, 1) + (skv - sq)  # the queries are the last sq positions
        visible = rule(0, 0, i, torch.arange(skv).view(1, skv))
        additive = torch.zeros(sq, skv).masked_fill(~visible, float("-inf"))
        want = modeling_gemma2.eager_attention_forward(module, q, k, v, additive, scaling=0.3,
                                                       softcap=softcap or None)[0]
        got = run(q, k, v, 0.3, window, softcap).transpose(1, 2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if window and skv > window:  # the window binds: plain causal attention differs
            assert not torch.allclose(run(q, k, v, 0.3, 0, softcap), got.transpose(1, 2), atol=1e-3)
        if softcap:  # so does the softcap
            assert not torch.allclose(run(q, k, v, 0.3, window, 0.0), got.transpose(1, 2), atol=1e-3)


def test_every_solution_entry_loads_with_the_definition_inputs():
    inv = inventory.Inventory.load(INVENTORY)
    for s in inv.solutions.values():
        params = list(inspect.signature(evaluate.load_entry(s)).parameters)
        assert params == list(inv.definitions[s.definition].inputs), s.name
    assert {s.spec.build_matrix.kernel: s.definition for s in inv.solutions.values()}["attention_combine"] == "attention"


# ---------------------------------------------------------------------------------------------
# Negative cases
# ---------------------------------------------------------------------------------------------

def _edit_json(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def test_reference_signature_mismatch_fails(copy):
    path = copy / "definitions" / "norm" / "rms_norm.json"
    _edit_json(path, lambda d: d.update(reference=d["reference"].replace("def run(x, weight, eps)", "def run(x, eps, weight)")))
    rep = inventory.validate(copy, compile=False, kernels=KERNELS)
    assert not rep.ok
    assert any("'rms_norm'" in e and "does not take its inputs ('x', 'weight', 'eps')" in e for e in rep.errors)


def test_reference_outputs_must_match_the_definition(copy):
    path = copy / "definitions" / "norm" / "add_rms_norm.json"
    _edit_json(path, lambda d: d.update(reference=d["reference"].replace(
        "return add_rms_norm_reference(x, residual, weight, eps)", "return add_rms_norm_reference(x, residual, weight, eps)[0]")))
    rep = inventory.validate(copy, compile=False, kernels=KERNELS)
    assert any("add_rms_norm" in e and "1 outputs, the Definition has 2" in e for e in rep.errors), rep.errors


def test_kernel_without_definition_is_reported(copy):
    kernels = {**KERNELS, "gelu_and_mul": ["gelu_and_mul_kernel"]}
    rep = inventory.validate(copy, compile=False, kernels=kernels)
    assert rep.errors == ["kernel 'gelu_and_mul' (gelu_and_mul_kernel) has no Definition (and no Solution naming it "
                          "in spec.build_matrix.kernel)"]
    (copy / "solutions" / "norm" / "add_rms_norm_cutile.json").unlink()
    rep = inventory.validate(copy, compile=False, kernels=KERNELS)
    assert rep.errors == ["kernel 'add_rms_norm' (add_rms_norm_kernel, add_rms_norm_chunked_kernel) has a Definition "
                          "but no Solution"]
    assert "Definition 'add_rms_norm' has no Solution" in rep.warnings


def test_stale_sources_workload_mismatch_and_bad_json_fail(copy):
    _edit_json(copy / "solutions" / "norm" / "rms_norm_cutile.json",
               lambda s: s["sources"][1].update(content=s["sources"][1]["content"] + "# edited\n"))
    with (copy / "workloads" / "norm" / "rms_norm.jsonl").open("a") as f:
        f.write(json.dumps({"definition": "rms_norm", "workload": {"axes": {"num_tokens": 4}, "inputs": {
            "x": {"type": "random"}, "weight": {"type": "random"}, "eps": {"type": "random"}}, "uuid": "bad"}}) + "\n")
    (copy / "definitions" / "norm" / "broken.json").write_text('{"name": "broken"}')
    rep = inventory.validate(copy, compile=False, kernels=KERNELS, checkout=ROOT)
    text = "\n".join(rep.errors)
    assert "Solution 'rms_norm_cutile': sources ['kernel_src/norm.py'] differ from the tree" in text
    assert "workload 'bad': axes ['num_tokens'] != the var axes ['hidden_size', 'num_tokens']" in text
    assert "workload 'bad': scalar input 'eps' must be given a value" in text
    assert "definitions/norm/broken.json" in text
    # sync repairs the stale copy (and only touches what changed)
    changed = inventory_families.sync(copy, ROOT)
    assert copy / "solutions" / "norm" / "rms_norm_cutile.json" in changed
    assert copy / "workloads" / "norm" / "rms_norm.jsonl" in changed


def test_compile_check_trusts_a_current_manifest_else_compiles():
    from cutile_kernels import kernel_src
    from cutile_kernels_build.aot import variant_hash

    specs = [s for s in kernel_src.all_variants() if s.kernel == "rms_norm"]
    manifest = {"archs": ["sm_90"], "variants": [{"kernel": s.kernel, "variant": s.tag, "arch": "sm_90",
                                                  "hash": variant_hash(s, "sm_90")} for s in specs]}
    assert inventory.check_compiles("rms_norm", "sm_90", manifest) == f"{len(specs)} variants in the build manifest, hashes current"
    manifest["variants"][0]["hash"] = "stale"
    how = inventory.check_compiles("rms_norm", "sm_90", manifest)
    assert how.startswith(f"compiled {specs[0].tag} (") and "bytes" in how
    with pytest.raises(KeyError):
        inventory.check_compiles("no_such_kernel", "sm_90", manifest)


# ---------------------------------------------------------------------------------------------
# FlashInfer-Bench compatibility
# ---------------------------------------------------------------------------------------------

OURS = {"Definition": fib_schema.Definition, "AxisConst": fib_schema.AxisConst, "AxisVar": fib_schema.AxisVar,
        "TensorSpec": fib_schema.TensorSpec, "Solution": fib_schema.Solution, "BuildSpec": fib_schema.BuildSpec,
        "SourceFile": fib_schema.SourceFile, "Workload": fib_schema.Workload, "RandomInput": fib_schema.RandomInput,
        "ScalarInput": fib_schema.ScalarInput, "SafetensorsInput": fib_schema.SafetensorsInput,
        "Trace": fib_schema.Trace, "Evaluation": fib_schema.Evaluation, "Correctness": fib_schema.Correctness,
        "Performance": fib_schema.Performance, "Environment": fib_schema.Environment}
EXTENSIONS = {"BuildSpec": {"build_matrix"}}


def test_models_cover_flashinfer_bench_fields():
    """Every field FlashInfer-Bench 0.1.2 has, we have; every field it requires, we require; our
    only extra field is the documented build-matrix link; its enums are subsets of ours."""
    ref = json.loads(STRUCTURE.read_text())
    for name, model in OURS.items():
        theirs = ref["models"][name]
        fields = set(model.model_fields)
        required = {k for k, f in model.model_fields.items() if f.is_required()}
        assert set(theirs["fields"]) <= fields, name
        assert fields - set(theirs["fields"]) == EXTENSIONS.get(name, set()), name
        assert set(theirs["required"]) <= required, name
    assert ref["enums"]["dtype"] == sorted(e.value for e in fib_schema.DType)
    assert ref["enums"]["status"] == sorted(e.value for e in fib_schema.EvaluationStatus)
    assert set(ref["enums"]["language"]) == set(fib_schema.FIB_LANGUAGES)
    assert "cuda-tile" not in ref["enums"]["language"]  # why to_flashinfer_bench maps it


@needs_fib
def test_structure_snapshot_is_flashinfer_bench_itself():
    from flashinfer_bench.data.definition import DType

    ref = json.loads(STRUCTURE.read_text())
    for name in OURS:
        m = getattr(fib, name)
        assert ref["models"][name] == {"fields": sorted(m.model_fields),
                                       "required": sorted(k for k, f in m.model_fields.items() if f.is_required())}
    assert ref["enums"]["language"] == sorted(e.value for e in fib.SupportedLanguages)
    assert ref["enums"]["dtype"] == sorted(e.value for e in DType)


@needs_fib
def test_round_trip_through_flashinfer_bench_models(tmp_path):
    inv = inventory.Inventory.load(INVENTORY)
    for d in inv.definitions.values():
        theirs = fib.Definition.model_validate_json(d.to_json())
        back = json.loads(theirs.model_dump_json(exclude_unset=True))
        assert back == d.to_dict()
        assert fib_schema.Definition.model_validate(back) == d
    for s in inv.solutions.values():
        assert s.spec.language == "cuda-tile"
        with pytest.raises(ValueError):  # its enum lacks cuda-tile: hence the export mapping
            fib.Solution.model_validate(s.to_dict())
        data = fib_schema.to_flashinfer_bench(s)
        theirs = fib.Solution.model_validate(data)
        assert theirs.spec.language.value == "python" and "cuda-tile==1.7.0" in theirs.spec.dependencies
        back = json.loads(theirs.model_dump_json(exclude_unset=True))
        data["spec"].pop("build_matrix")  # the one key FlashInfer-Bench ignores
        assert back == data
    for dname, ws in inv.workloads.items():
        for w in ws:
            t = fib_schema.Trace(definition=dname, workload=w)
            assert json.loads(fib.Trace.model_validate_json(t.to_json()).model_dump_json(exclude_unset=True)) == t.to_dict()
    out = inventory.export(inv, tmp_path / "fib")
    ts = fib.TraceSet.from_path(str(out))
    assert set(ts.definitions) == set(inv.definitions)
    assert {s.name for v in ts.solutions.values() for s in v} == set(inv.solutions)
    assert {k: len(v) for k, v in ts.workloads.items()} == {k: len(v) for k, v in inv.workloads.items()}


def test_schema_checks_mirror_flashinfer_bench_rules():
    d = json.loads((INVENTORY / "definitions" / "norm" / "rms_norm.json").read_text())
    with pytest.raises(ValueError, match="undefined axis"):
        fib_schema.Definition.model_validate({**d, "outputs": {"y": {"shape": ["rows"], "dtype": "bfloat16"}}})
    with pytest.raises(ValueError, match="no top-level function `run`"):
        fib_schema.Definition.model_validate({**d, "reference": "def main(x):\n    return x\n"})
    env = fib_schema.Environment(hardware="cpu")
    with pytest.raises(ValueError, match="needs performance"):
        fib_schema.Evaluation(status="PASSED", environment=env, timestamp="t", correctness=fib_schema.Correctness())
    with pytest.raises(ValueError, match="takes no correctness"):
        fib_schema.Evaluation(status="RUNTIME_ERROR", environment=env, timestamp="t", correctness=fib_schema.Correctness())
    with pytest.raises(ValueError, match="relative without"):
        fib_schema.SourceFile(path="../x.py", content="x")


# ---------------------------------------------------------------------------------------------
# evaluate
# ---------------------------------------------------------------------------------------------

def _norm_setup():
    inv = inventory.Inventory.load(INVENTORY)
    d = inv.definitions["rms_norm"]
    by_uuid = {w.uuid: w for w in inv.workloads["rms_norm"]}
    return d, [by_uuid["qwen2.5-1.5b/hidden/decode-b16"], by_uuid["qwen3-0.6b/k_norm/decode-b1"]]


def _checks(fn, launches=None):
    d, ws = _norm_setup()
    return evaluate.run_checks(d, fn, ws, "cpu", launches=launches, warmup=1, repeats=3,
                               result=evaluate.Result("candidate", d.name, "cpu"))


def test_pipeline_passes_the_reference_path_and_writes_traces():
    from cutile_kernels.ops.norm import rms_norm

    r = _checks(lambda x, w, eps: rms_norm(x, w, eps))
    assert r.status == "PASSED", r.message
    assert [s["stage"] for s in r.stages] == ["reference", "dispatch", "parity", "boundaries", "benchmark"]
    assert [t.workload.uuid for t in r.traces] == ["qwen2.5-1.5b/hidden/decode-b16", "qwen3-0.6b/k_norm/decode-b1"]
    for t in r.traces:
        ev = t.evaluation
        assert ev.status.value == "PASSED" and ev.correctness.max_absolute_error == 0
        assert ev.performance.latency_ms > 0 and ev.performance.reference_latency_ms > 0
        assert ev.performance.speedup_factor == pytest.approx(ev.performance.reference_latency_ms / ev.performance.latency_ms)
        if fib is not None:
            assert fib.Trace.model_validate_json(t.to_json()).evaluation.status.value == "PASSED"


def test_pipeline_stops_at_the_first_failure_with_its_status():
    from cutile_kernels.ops.norm import rms_norm_reference

    off = _checks(lambda x, w, eps: (rms_norm_reference(x, w, eps).float() * 1.03).to(x.dtype))
    assert off.status == "INCORRECT_NUMERICAL" and off.message.startswith("parity: output 'y'")
    assert len(off.traces) == 1 and off.traces[0].evaluation.correctness.max_absolute_error > 0.01
    assert [s["status"] for s in off.stages][-1] == "failed" and off.stages[-1]["stage"] == "parity"

    shape = _checks(lambda x, w, eps: rms_norm_reference(x, w, eps)[:1])
    assert shape.status == "INCORRECT_SHAPE" and "expected (16, 1536)" in shape.message

    dtype = _checks(lambda x, w, eps: rms_norm_reference(x, w, eps).float())
    assert dtype.status == "INCORRECT_DTYPE"

    def fails(x, w, eps):
        raise RuntimeError("boom")
    crash = _checks(fails)
    assert crash.status == "RUNTIME_ERROR" and crash.message == "dispatch: RuntimeError: boom"
    assert len(crash.traces) == 2  # not tied to one workload: every workload's trace says so

    # A kernel that is right on the model's shapes but wrong on an odd width is caught by the boundaries.
    odd = _checks(lambda x, w, eps: rms_norm_reference(x, w, eps) * (2 if x.shape[-1] % 2 and x.shape[-1] > 1 else 1))
    assert odd.status == "INCORRECT_NUMERICAL" and odd.message.startswith("boundaries:")
    assert odd.traces[0].workload.uuid.endswith("#hidden_size=1537")

    quiet = _checks(rms_norm_reference, launches=lambda: 0)  # no kernel launched: a fallback cannot pass
    assert quiet.status == "RUNTIME_ERROR" and "launched no cuTile kernel" in quiet.message


def test_compare_accepts_rounding_no_worse_than_the_reference():
    d, ws = _norm_setup()
    x = torch.randn(16, 1536)
    ref32 = x * 1.001
    ref = ref32.to(torch.bfloat16)
    # differs from ref by one bf16 ulp in places but is no further from float32 than ref is: passes
    nudged = (ref32 * (1 + 2 ** -9)).to(torch.bfloat16)
    status, _, corr = evaluate.compare(d, nudged, ref, ref32, ws[0].axes)
    assert status is None and corr.max_absolute_error > 0
    status, msg, _ = evaluate.compare(d, (ref32 * 1.1).to(torch.bfloat16), ref, ref32, ws[0].axes)
    assert status == fib_schema.EvaluationStatus.INCORRECT_NUMERICAL and "error vs float32" in msg
    nan = ref.clone()
    nan[0, 0] = float("nan")
    assert evaluate.compare(d, nan, ref, ref32, ws[0].axes)[0] == fib_schema.EvaluationStatus.INCORRECT_NUMERICAL


def test_derived_workloads_respect_constraints():
    d, ws = _norm_setup()
    got = [(w.uuid, s) for w, s in evaluate.derived_workloads(d, ws)]
    base = ws[0].uuid
    assert got == [(f"{base}#num_tokens=1", 1.0), (f"{base}#num_tokens=17", 1.0), (f"{base}#hidden_size=1",
                   1.0), (f"{base}#hidden_size=1537", 1.0), (f"{base}#scale=64", 64.0), (f"{base}#scale=0.015625", 1 / 64)]
    limited = d.model_copy(update={"constraints": ["hidden_size % 8 == 0"]})
    assert all(w.axes["hidden_size"] % 8 == 0 for w, _ in evaluate.derived_workloads(limited, ws))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_evaluate_cli_on_cpu_says_the_kernel_did_not_run(tmp_path, capsys):
    rc = cli.main(["evaluate", "add_rms_norm_cutile", "--workload", "llama-3.2-1b/hidden/decode-b1",
                   "--out", str(tmp_path), "--summary", str(tmp_path / "summary.json")])
    out = capsys.readouterr().out
    assert rc == 3
    assert "NOT_RUN_NO_CUDA" in out and "no Trace was written" in out and "compile     passed" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary[0]["status"] == "NOT_RUN_NO_CUDA" and summary[0]["traces"] == []
    assert not (tmp_path / "traces").exists()
    assert cli.main(["evaluate", "no_such_solution"]) == 2


def test_cli_inventory_commands(tmp_path, capsys, copy):
    assert cli.main(["inventory", "validate", "--root", str(copy), "--no-compile", "--json"]) in (0, 1)
    report = json.loads(capsys.readouterr().out)
    inv = inventory.Inventory.load(copy)
    assert report["checked"]["definitions"] == len(inv.definitions) >= 7
    assert report["checked"]["solutions"] == len(inv.solutions) >= 8
    assert cli.main(["inventory", "show", "rms_norm", "--root", str(copy)]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "rms_norm"
    assert cli.main(["inventory", "export", str(tmp_path / "fib"), "--root", str(copy)]) == 0
    assert json.loads((tmp_path / "fib" / "solutions" / "norm" / "rms_norm_cutile.json").read_text())["spec"]["language"] == "python"
    assert cli.main(["inventory", "export", str(tmp_path / "fib"), "--root", str(copy)]) == 2  # not empty
    sol = copy / "solutions" / "norm" / "add_rms_norm_cutile.json"
    before = sol.read_text()
    sol.unlink()
    assert cli.main(["inventory", "new-solution", "add_rms_norm", "--root", str(copy)]) == 0
    assert sol.read_text() == before
    assert cli.main(["inventory", "new-solution", "add_rms_norm", "--root", str(copy)]) == 2  # exists


def test_cli_finds_the_checkouts_inventory_from_any_directory(tmp_path, monkeypatch, capsys):
    # A new user found `inventory show` failing outside the checkout's root (the lookup took the
    # tools folder for the checkout, then fell back to the current directory).
    monkeypatch.chdir(tmp_path)
    assert inventory.repo_root() == INVENTORY.parent and inventory.default_root() == INVENTORY
    assert cli.main(["inventory", "show", "rms_norm"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "rms_norm"


def _family_checks(name: str, uuids: list[str], fn, launches=None):
    """run_checks of Definition ``name`` on the CPU with the candidate ``fn`` on these Workloads
    (the boundaries come from the first)."""
    inv = inventory.Inventory.load(INVENTORY)
    d = inv.definitions[name]
    by_uuid = {w.uuid: w for w in inv.workloads[name]}
    return evaluate.run_checks(d, fn, [by_uuid[u] for u in uuids], "cpu", launches=launches, warmup=1, repeats=3,
                               result=evaluate.Result("candidate", name, "cpu"))


MLP_UUIDS = ["qwen3-0.6b/mlp/decode-b16", "qwen3-0.6b/mlp/decode-b1"]
ROPE_UUIDS = ["llama-3.2-1b/decode-b1", "qwen3-0.6b/decode-b16"]
# not the inventory's first Workload (Llama's batch-16 decode over 2048 keys): on two CPU cores its
# reference and boundaries take minutes; Qwen2.5's 12 / 2 heads keep the GQA mapping visible.
ATTN_UUIDS = ["qwen2.5-1.5b/decode-b1/kv128", "qwen3-0.6b/decode-b1/kv128"]


def _failed_at(r, status: str, stage: str, workload_suffix: str | None = None) -> None:
    assert r.status == status and r.message.startswith(f"{stage}:"), (r.status, r.message)
    if workload_suffix is not None:
        assert len(r.traces) == 1 and r.traces[0].workload.uuid.endswith(workload_suffix), r.traces[0].workload.uuid


def test_new_families_pass_with_their_ops_and_fail_with_wrong_kernels():
    """The ops (on the CPU: their references) pass every stage; kernels with a planted bug fail at
    the stage that should see it. Each bug is one a real kernel could have."""
    from cutile_kernels.ops import activation, apply_rope, apply_rope_reference, attention, attention_reference

    for name, uuids, fn in (("silu_and_mul", MLP_UUIDS, activation.silu_and_mul),
                            ("silu_and_mul_fused", MLP_UUIDS, activation.silu_and_mul_fused),
                            ("silu", MLP_UUIDS, activation.silu),
                            ("rope", ROPE_UUIDS, apply_rope),
                            ("attention", ATTN_UUIDS, lambda q, k, v, scale: attention(q, k, v, scale=scale))):
        r = _family_checks(name, uuids, fn)
        assert r.status == "PASSED", (name, r.message)
        assert [t.workload.uuid for t in r.traces] == uuids
        assert all(t.evaluation.correctness.max_absolute_error == 0 for t in r.traces), name
        assert next(st for st in r.stages if st["stage"] == "boundaries")["status"] == "passed"

    ref = activation.silu_and_mul_reference
    # gate and up swapped
    _failed_at(_family_checks("silu_and_mul", MLP_UUIDS, lambda g, u: ref(u, g)), "INCORRECT_NUMERICAL", "parity")
    # the fused input's halves read as up first
    _failed_at(_family_checks("silu_and_mul_fused", MLP_UUIDS, lambda x: ref(*reversed(x.chunk(2, -1)))),
               "INCORRECT_NUMERICAL", "parity")

    # right at 1 and 16 rows, wrong on a partial block of 4 rows: only 17 rows (a boundary) shows it
    def drops_tail(x):
        out = activation.silu_and_mul_fused_reference(x)
        if x.shape[0] > 16 and x.shape[0] % 4:
            out[-1] = 0
        return out
    _failed_at(_family_checks("silu_and_mul_fused", MLP_UUIDS, drops_tail), "INCORRECT_NUMERICAL", "boundaries",
               "#num_tokens=17")

    # the last column of an odd width > 1 lost, as a 2-wide vector loop would (the fused input's
    # gate_up_size follows intermediate_size to 6146)
    def even_only(x):
        out = activation.silu_and_mul_fused_reference(x)
        if out.shape[-1] % 2 and out.shape[-1] > 1:
            out[:, -1] = 0
        return out
    _failed_at(_family_checks("silu_and_mul_fused", MLP_UUIDS, even_only), "INCORRECT_NUMERICAL", "boundaries",
               "#intermediate_size=3073")
    _failed_at(_family_checks("silu", MLP_UUIDS, lambda x: x * torch.sigmoid(x.float()).to(x.dtype) * 1.02),
               "INCORRECT_NUMERICAL", "parity")

    # RoPE rotating the wrong way
    _failed_at(_family_checks("rope", ROPE_UUIDS, lambda q, k, c, s: apply_rope_reference(q, k, c, -s)),
               "INCORRECT_NUMERICAL", "parity")
    # cos/sin of batch row 0 for every row (per-row positions, e.g. left padding, lost): batch 16 shows it
    _failed_at(_family_checks("rope", ROPE_UUIDS, lambda q, k, c, s: apply_rope_reference(q, k, c[:1], s[:1])),
               "INCORRECT_NUMERICAL", "parity", "qwen3-0.6b/decode-b16")

    # the last KV head skipped when there is a single one: the num_kv_heads=1 boundary
    def one_kv_head(q, k, c, s):
        qe, ke = apply_rope_reference(q, k, c, s)
        return qe, (k.clone() if k.shape[1] == 1 else ke)
    _failed_at(_family_checks("rope", ROPE_UUIDS, one_kv_head), "INCORRECT_NUMERICAL", "boundaries",
               "#num_kv_heads=1")

    # attention with query head h on KV head h % Hkv instead of h // (Hq / Hkv)
    def interleaved_gqa(q, k, v, scale):
        g = q.shape[1] // k.shape[1]
        return attention_reference(q, k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1), None, scale, True)
    _failed_at(_family_checks("attention", ATTN_UUIDS, interleaved_gqa), "INCORRECT_NUMERICAL", "parity")
    # not causal: decode (one query) cannot tell, the q_len=2 boundary can
    _failed_at(_family_checks("attention", ATTN_UUIDS, lambda q, k, v, scale: attention_reference(
        q, k, v, None, scale, False)), "INCORRECT_NUMERICAL", "boundaries", "#q_len=2")

    # keys past the last full 64-key tile dropped: right at the models' KV lengths, not at 129
    def full_tiles_only(q, k, v, scale):
        n = k.shape[2] // 64 * 64 if k.shape[2] > 64 else k.shape[2]
        return attention_reference(q, k[:, :, :n], v[:, :, :n], None, scale, True)
    _failed_at(_family_checks("attention", ATTN_UUIDS, full_tiles_only), "INCORRECT_NUMERICAL", "boundaries",
               "#kv_len=129")


def _emulated_attention(monkeypatch):
    """The attention op's launches run by the NumPy cuTile interpreter (tests/cutile_numpy.py: logic,
    not bf16 numerics), in float32, the dtype it computes in. Returns (the ops module, the list of
    kernels launched, appended to on each launch)."""
    from cutile_numpy import emulate

    kattn = importlib.import_module("cutile_kernels.kernel_src.attention")
    attn_ops = importlib.import_module("cutile_kernels.ops.attention")  # the package re-exports `attention`
    ran = []

    def emulated_run(kernel, want, args, n_inputs, grid, layout=None, optional=False):
        # the plain launch (PDL 0) of the variant: a twin computes the same (tests/test_pdl.py)
        (spec,) = {s.function: s for s in kattn.VARIANTS  # bf16 and fp16 variants run the same code
                   if s.kernel == kernel and s.constants.get("PDL", 0) == 0
                   and all(s.constants[a] == b for a, b in want)}.values()
        args = layout(tuple(args)) if layout is not None else tuple(args)
        emulate(getattr(kattn, spec.function), kattn)(grid(spec.constants), args + tuple(spec.constants.values()))
        ran.append(kernel)
        return True

    monkeypatch.setattr(attn_ops.dispatch, "run", emulated_run)
    monkeypatch.setattr(attn_ops, "KERNEL_DTYPES", (torch.float32,))
    return attn_ops, ran


def _float32_copy(d):
    """Definition ``d`` with its tensors (not its scalars) in float32: what the interpreter computes."""
    return d.model_copy(update={
        "inputs": {n: t.model_copy(update={"dtype": "float32"} if t.shape else {}) for n, t in d.inputs.items()},
        "outputs": {n: t.model_copy(update={"dtype": "float32"}) for n, t in d.outputs.items()}})


WINDOW_SOFTCAP_UUIDS = ["gemma-3-1b/prefill-2048/sliding", "gemma-2-2b/decode-b1/full/kv8192"]


def test_window_softcap_attention_passes_with_the_op_and_fails_with_wrong_kernels():
    """The attention op (on the CPU: its reference) passes attention_window_softcap on Gemma 3's
    sliding prefill (the window binds: 512 of up to 2048 keys) and Gemma 2's softcapped full layer;
    a kernel that ignores the window, that ignores the softcap, or that caps without dividing
    (c * tanh(s) for c * tanh(s / c)) fails."""
    from cutile_kernels.ops import attention, attention_reference

    def op(q, k, v, scale, window, softcap):
        return attention(q, k, v, scale=scale, window=window, softcap=softcap)
    r = _family_checks("attention_window_softcap", WINDOW_SOFTCAP_UUIDS, op)
    assert r.status == "PASSED", r.message
    assert [t.workload.uuid for t in r.traces] == WINDOW_SOFTCAP_UUIDS
    _failed_at(_family_checks("attention_window_softcap", WINDOW_SOFTCAP_UUIDS[:1],
                              lambda q, k, v, scale, window, softcap: attention_reference(
                                  q, k, v, None, scale, True, None, softcap or None)),
               "INCORRECT_NUMERICAL", "parity")
    # Ignoring a cap of 50 barely shows on standard normal inputs; the boundaries' scaled ones show it.
    r = _family_checks("attention_window_softcap", ["gemma-2-2b/decode-b1/sliding/kv4096"],
                       lambda q, k, v, scale, window, softcap: attention_reference(
                           q, k, v, None, scale, True, window or None, None))
    assert r.status == "INCORRECT_NUMERICAL" and r.message.split(":")[0] in ("parity", "boundaries"), r.message

    def undivided_cap(q, k, v, scale, window, softcap):
        # queries times c: the reference's c * tanh(c s / c) is the bug's c * tanh(s)
        return attention_reference(q * softcap, k, v, None, scale, True, window or None, softcap)
    _failed_at(_family_checks("attention_window_softcap", WINDOW_SOFTCAP_UUIDS[1:], undivided_cap),
               "INCORRECT_NUMERICAL", "parity")


def test_window_softcap_workloads_follow_the_presets(monkeypatch):
    """The Workloads' scale, window and softcap are read from the presets' configs (scale from
    query_pre_attn_scalar, which both presets set to head_dim, so a change shows it), and a sliding
    layer's decode reads the window's keys: what its cache holds."""
    from cutile_kernels_tools import presets
    from cutile_kernels_tools.inventory import families

    monkeypatch.setitem(presets.PRESETS["gemma-2-2b"].config, "query_pre_attn_scalar", 144)
    monkeypatch.setitem(presets.PRESETS["gemma-3-1b"].config, "sliding_window", 256)
    rows = {w.uuid: w for w in families._attention_window_softcap().workloads}
    g2 = rows["gemma-2-2b/decode-b1/sliding/kv4096"]
    assert g2.inputs["scale"].value == pytest.approx(1 / 12) and g2.inputs["softcap"].value == 50.0
    assert g2.inputs["window"].value == 4096 and rows["gemma-2-2b/decode-b1/full/kv8192"].inputs["window"].value == 0
    g3 = rows["gemma-3-1b/decode-b16/sliding/kv256"]
    assert g3.inputs["window"].value == 256 and g3.inputs["softcap"].value == 0.0
    assert g3.axes["kv_len"] == 256 and g3.axes["head_dim"] == 256 and g3.inputs["scale"].value == 1 / 16
    assert rows["gemma-2-2b/prefill-8192/sliding"].axes["q_len"] == 8192  # past the window: it binds


def test_window_softcap_solutions_run_the_kernels(monkeypatch):
    """attention_window_softcap's kernels through evaluate on the CPU, run by the NumPy cuTile
    interpreter (float32 copy of the Definition, small shapes, as the combine's
    test): the window as an argument and as sdpa_mask's boolean mask, with a softcap that bends
    (logits ~N(0, 8) under a cap of 5), on prefill and decode tiles and every boundary."""
    from cutile_kernels_tools.inventory.fib_schema import ScalarInput

    attn_ops, ran = _emulated_attention(monkeypatch)
    monkeypatch.setattr(attn_ops.dispatch, "sm_count", lambda index: 132)  # an H100's: the decode split's count
    monkeypatch.setattr(evaluate, "SCALES", ())  # float32 softmax at 64x: see the combine's test
    inv = inventory.Inventory.load(INVENTORY)
    d = inv.definitions["attention_window_softcap"]
    d32 = _float32_copy(d)
    base = inv.workloads["attention_window_softcap"][0]
    scalars = {"scale": ScalarInput(value=0.5), "window": ScalarInput(value=40), "softcap": ScalarInput(value=5.0)}
    ws = [base.model_copy(update={"axes": axes, "uuid": uuid, "inputs": {**base.inputs, **scalars}}) for uuid, axes in (
        ("decode", {"batch": 2, "num_q_heads": 8, "num_kv_heads": 2, "q_len": 1, "kv_len": 300, "head_dim": 32}),
        ("prefill", {"batch": 1, "num_q_heads": 2, "num_kv_heads": 1, "q_len": 130, "kv_len": 130, "head_dim": 32}))]

    def window_argument(q, k, v, scale, window, softcap):
        # attention_window_softcap_cutile's call (the op, which on a CPU tensor takes its reference)
        # at the launch: the window as the kernels' argument
        out = q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])
        assert attn_ops.attention_into(q, k, v, None, out, scale, True, window or None, softcap or None)
        return out.transpose(1, 2)
    mask_tiles = evaluate.load_entry(inv.solutions["attention_window_softcap_mask_tiles_cutile"])
    for name, entry in (("window argument", window_argument), ("mask tiles", mask_tiles)):
        ran.clear()
        r = evaluate.run_checks(d32, entry, ws, "cpu", launches=lambda: len(ran), warmup=1, repeats=1,
                                result=evaluate.Result(name, d.name, "cpu"))
        assert r.status == "PASSED", (name, r.message)
        assert all(t.evaluation.correctness.max_absolute_error < 1e-5 for t in r.traces), name
        assert "attention" in ran and ("attention_mask_tiles" in ran) == (entry is mask_tiles), (name, set(ran))


def test_attention_combine_solution_runs_the_split_kernels(monkeypatch):
    """The attention_combine Solution's entry through evaluate on the CPU, its kernels run by the
    NumPy cuTile interpreter (tests/cutile_numpy.py: logic, not bf16 numerics, so on a float32 copy
    of the Definition at small shapes): the forced split, the combine and the output layout
    compute the Definition, on prefill and decode tiles and every boundary."""
    attn_ops, ran = _emulated_attention(monkeypatch)
    # No scaled inputs: at 64x, logits reach ~1e4 and a float32 softmax is ill-conditioned (seen:
    # the float32 reference 0.04 from exact, the interpreted kernel 0.12, outputs ~200); in float32
    # evaluate's criterion (no worse than the reference against itself) cannot pass. The bf16
    # Definition on the GPU judges that case with bf16's tolerance.
    monkeypatch.setattr(evaluate, "SCALES", ())
    inv = inventory.Inventory.load(INVENTORY)
    d32 = _float32_copy(inv.definitions["attention"])
    base = inv.workloads["attention"][0]
    ws = [base.model_copy(update={"axes": axes, "uuid": uuid}) for uuid, axes in (
        ("decode", {"batch": 2, "num_q_heads": 8, "num_kv_heads": 2, "q_len": 1, "kv_len": 300, "head_dim": 64}),
        ("prefill", {"batch": 1, "num_q_heads": 2, "num_kv_heads": 1, "q_len": 130, "kv_len": 130, "head_dim": 32}))]
    entry = evaluate.load_entry(inv.solutions["attention_combine_cutile"])
    r = evaluate.run_checks(d32, entry, ws, "cpu", launches=lambda: len(ran), warmup=1, repeats=1,
                            result=evaluate.Result("attention_combine_cutile", "attention", "cpu"))
    assert r.status == "PASSED", r.message
    # every call split then combined: dispatch, parity (2), each boundary, and the benchmark's calls
    assert ran.count("attention_combine") == ran.count("attention") > 3 + len(evaluate.derived_workloads(d32, ws)) > 10
    assert all(t.evaluation.correctness.max_absolute_error < 1e-5 for t in r.traces)

    monkeypatch.setattr(attn_ops, "attention_into", lambda *a, **kw: False)  # a declared fallback
    r = _family_checks("attention", ATTN_UUIDS, evaluate.load_entry(inv.solutions["attention_combine_cutile"]))
    assert r.status == "RUNTIME_ERROR" and "no cuTile path" in r.message


def test_rope_append_attention_solutions_run_the_one_launch(monkeypatch):
    """Both rope_append_attention Solutions through evaluate on the CPU, the kernel run by the NumPy
    cuTile interpreter (float32 copy of the Definition, small caches): the plain variants, and the
    MASKED ones with the mask a compiled step passes for an unpadded batch, compute the Definition
    (output and both caches) on every Workload and boundary; a mask that hides the step's own key
    fails parity."""
    from cutile_kernels_tools.inventory.fib_schema import ScalarInput

    attn_ops, ran = _emulated_attention(monkeypatch)

    def on_the_kernel(*args):  # the op's CUDA body on CPU tensors (the CPU path is the reference)
        attn_ops._rope_append_attention_check(*args)
        attn_ops._rope_append_attention_cuda(*args)
    monkeypatch.setattr(attn_ops, "_rope_append_attention", on_the_kernel)
    masked, emulated = [], attn_ops.dispatch.run

    def run(kernel, want, *args, **kwargs):
        masked.append(dict(want)["MASKED"])
        return emulated(kernel, want, *args, **kwargs)
    monkeypatch.setattr(attn_ops.dispatch, "run", run)
    monkeypatch.setattr(evaluate, "SCALES", ())  # float32 softmax at 64x: see the combine's test
    inv = inventory.Inventory.load(INVENTORY)
    d = inv.definitions["rope_append_attention"]
    d32 = _float32_copy(d)
    base = inv.workloads["rope_append_attention"][0]
    ws = [base.model_copy(update={"axes": {**base.axes, **axes}, "uuid": uuid, "inputs": {
        **base.inputs, "length": ScalarInput(value=n)}}) for uuid, axes, n in (
        ("b1-two-tiles", {"batch": 1, "num_q_heads": 8, "num_kv_heads": 2, "cache_len": 150, "head_dim": 64}, 100),
        ("b3-first-slot", {"batch": 3, "num_q_heads": 4, "num_kv_heads": 1, "cache_len": 40, "head_dim": 64}, 0))]
    names = ("rope_append_attention_cutile", "rope_append_attention_mask_cutile")
    for name, variants in zip(names, (0, 1)):
        ran.clear(), masked.clear()
        r = evaluate.run_checks(d32, evaluate.load_entry(inv.solutions[name]), ws, "cpu", launches=lambda: len(ran),
                                warmup=1, repeats=1, result=evaluate.Result(name, d.name, "cpu"))
        assert r.status == "PASSED", (name, r.message)
        assert all(t.evaluation.correctness.max_absolute_error < 1e-5 for t in r.traces), name
        assert set(ran) == {"rope_append_attention"} and set(masked) == {variants}, (name, set(ran), set(masked))
    assert "mask=mask" in inv.solutions[names[1]].sources[0].content

    real = attn_ops._rope_append_attention

    def hides_the_new_key(q, k, v, cos, sin, keys, values, length, mask, out, *rest):
        if mask is not None:
            mask = mask.clone()
            mask[..., int(length)] = False
        real(q, k, v, cos, sin, keys, values, length, mask, out, *rest)
    monkeypatch.setattr(attn_ops, "_rope_append_attention", hides_the_new_key)
    r = evaluate.run_checks(d32, evaluate.load_entry(inv.solutions[names[1]]), ws, "cpu", launches=lambda: len(ran),
                            warmup=1, repeats=1, result=evaluate.Result(names[1], d.name, "cpu"))
    assert r.status == "INCORRECT_NUMERICAL", r.message


def test_boundaries_follow_the_constraints():
    inv = inventory.Inventory.load(INVENTORY)
    d = inv.definitions["silu_and_mul_fused"]
    assert list(evaluate.dependent_axes(d)) == ["gate_up_size"]
    got = {w.uuid.split("#")[1]: w.axes for w, s in evaluate.derived_workloads(d, inv.workloads[d.name]) if s == 1}
    assert got["intermediate_size=8193"]["gate_up_size"] == 16386 and got["intermediate_size=1"]["gate_up_size"] == 2
    assert not any(k.startswith("gate_up_size") for k in got)  # a dependent axis is not varied itself
    d = inv.definitions["attention"]
    derived = evaluate.derived_workloads(d, inv.workloads["attention"])
    names = [w.uuid.split("#")[1] for w, _ in derived]
    # the nearest values the constraints allow (32 query heads over 8 KV heads, head_dim % 16)
    for want in ("num_q_heads=8", "num_q_heads=40", "num_kv_heads=1", "num_kv_heads=16", "head_dim=16",
                 "head_dim=80", "kv_len=1", "kv_len=2049", "q_len=2", "batch=17"):
        assert want in names, names
    assert all(not d.satisfies(w.axes) for w, _ in derived)
    rope = inv.definitions["rope"]
    assert {w.axes["head_dim"] for w, _ in evaluate.derived_workloads(rope, inv.workloads["rope"])} == {2, 64, 66}


@pytest.mark.gpu
def test_every_solution_passes_evaluate_on_the_gpu(strict):
    inv = inventory.Inventory.load(INVENTORY)
    for name in inv.solutions:
        r = evaluate.evaluate(name, INVENTORY, "cuda", repeats=5, warmup=2)
        assert r.status == "PASSED", f"{name}: {r.message}"
        assert len(r.traces) == len(inv.workloads[r.definition])
