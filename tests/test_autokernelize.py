"""autokernelize on the embedded model (CPU): ranked regions, a scaffold whose reference is the
module's own code, the keep/discard rule, the results log and a CPU score."""

from __future__ import annotations

import shutil
import types
from pathlib import Path

import pytest
import torch
from cutile_kernels_tools import autokernelize as ak
from cutile_kernels_tools import cli, inventory, presets
from cutile_kernels_tools.inventory import evaluate

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv(presets.ENV_CACHE, str(tmp_path_factory.mktemp("presets")))
    # No build: on a CPU the kernelize mapping does not apply anyway, and a shared build may lag the source.
    mp.setenv("CUTILE_KERNELS_BUILD_DIR", str(tmp_path_factory.mktemp("no-build")))
    model, label, device = ak.load_model("tiny", "cpu")
    found = ak.regions(model, device)
    yield model, label, found
    mp.undo()


def test_regions_rank_uncovered_time_with_amdahl_ceilings(tiny):
    model, _, found = tiny
    rows = found["regions"]
    uncovered = [r for r in rows if not r["covered"]]
    assert uncovered and [r["us"] for r in uncovered] == sorted((r["us"] for r in uncovered), reverse=True)
    assert rows[:len(uncovered)] == uncovered  # uncovered first
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    for r in rows:
        assert r["ceiling"] == pytest.approx(1 / (1 - r["share"] + r["share"] / 2))
        assert r["ceiling_max"] == pytest.approx(1 / (1 - r["share"]))
    norms = [r for r in rows if r["cls"] == "LlamaRMSNorm"]
    assert norms and all("RMSNorm" in r["covered"] for r in norms)  # mapped to our layer
    regions = {r["region"] for r in uncovered}
    assert {"layers.*.mlp", "layers.*.self_attn"} <= regions
    assert found["covered_share"] == pytest.approx(sum(r["share"] for r in norms))


def test_gemv_projections_are_ours_by_their_kernels_not_their_class():
    """Patch ``gemv``'s projections (class ``CutileGemvLinear``) run cuBLAS in the eager steps the
    regions are profiled on: covered only where the profile finds our kernel, not by the class name."""
    from torch import nn

    from cutile_kernels.layers.linear import CutileGemvLinear
    from cutile_kernels.layers.mlp import CutileSwiGLUMLP

    proj = nn.Linear(16, 16)
    proj.__class__ = CutileGemvLinear
    assert ak._covered_by_layer(proj) is None
    assert ak._covered_by_layer(CutileSwiGLUMLP()) == "kernelized (CutileSwiGLUMLP)"  # a layer of ours still is


def test_scaffold_refuses_a_target_that_is_not_a_checkout_before_writing(tiny, tmp_path):
    model, label, found = tiny
    region = next(r for r in found["regions"] if r["region"] == "layers.*.mlp")
    with pytest.raises(FileNotFoundError, match="not a cutile-kernels checkout"):
        ak.scaffold(model, region, label, tmp_path / "empty")
    assert not (tmp_path / "empty").exists()


def _checkout(tmp_path: Path) -> Path:
    """A scratch target for ``scaffold``: a checkout with only kernel_src/__init__.py."""
    (tmp_path / "kernel_src").mkdir()
    shutil.copy(ROOT / "kernel_src" / "__init__.py", tmp_path / "kernel_src" / "__init__.py")
    return tmp_path


def test_scaffold_writes_a_definition_that_reproduces_the_module(tiny, tmp_path):
    model, label, found = tiny
    _checkout(tmp_path)
    region = next(r for r in found["regions"] if r["region"] == "layers.*.mlp")
    out = ak.scaffold(model, region, label, tmp_path)
    assert out["definition"] == "llama_mlp" and out["registered"]
    from cutile_kernels.kernel_src import discover

    assert "llama_mlp" in discover(tmp_path / "kernel_src")  # found by its name, no list edited
    assert (tmp_path / "kernel_src" / "__init__.py").read_text() == (ROOT / "kernel_src" / "__init__.py").read_text()
    for f in out["files"]:
        assert Path(f).is_file()
    compile(Path(out["files"][2]).read_text(), "stub", "exec")
    compile(Path(out["files"][3]).read_text(), "test", "exec")

    inv = inventory.Inventory.load(tmp_path / "inventory")
    assert not inv.errors
    d = inv.definitions["llama_mlp"]
    assert list(d.inputs) == ["x", "gate_proj_weight", "up_proj_weight", "down_proj_weight"]
    assert d.var_axes == ["batch_size", "seq_len"]
    assert d.const_axes == {"hidden_size": 128, "intermediate_size": 256}
    assert any(t.startswith("source:transformers@v") and "modeling_llama.py::LlamaMLP.forward" in t for t in d.tags)
    # the reference is the module's code: exactly the module's output on the captured call
    args, expected = ak.capture(model, "model.layers.1.mlp")
    mlp = model.get_submodule("model.layers.1.mlp")
    got = inventory.load_reference(d)(args["x"], mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    assert torch.equal(got, expected)
    # and it validates: signature, workloads, outputs on the smallest workload
    rep = inventory.Report()
    inventory._check_definition(d, inv.workloads["llama_mlp"], rep)
    assert rep.errors == [] and rep.warnings == []
    assert {w.uuid.split("/")[1]: tuple(w.axes.values()) for w in inv.workloads["llama_mlp"]} == {
        "decode-b1": (1, 1), "decode-b16": (16, 1), "prefill-2048": (1, 2048), "captured": (3, 11)}
    with pytest.raises(FileExistsError):
        ak.scaffold(model, region, label, tmp_path)


def test_scaffold_of_the_rotary_embedding_names_outputs_and_state_axes(tiny, tmp_path):
    """Outputs take the names of the forward's ``return cos..., sin...``; a state size that equals a
    config value by coincidence does not take its name (inv_freq has head_dim / 2 entries)."""
    model, label, found = tiny
    _checkout(tmp_path)
    region = next(r for r in found["regions"] if r["region"] == "rotary_emb")
    ak.scaffold(model, region, label, tmp_path, name="rot_tiny")
    d = inventory.Inventory.load(tmp_path / "inventory").definitions["rot_tiny"]
    assert list(d.outputs) == ["cos", "sin"]
    assert d.inputs["inv_freq"].shape == ["inv_freq_dim0"]
    assert d.axes["inv_freq_dim0"].description == f"follows config.head_dim ({model.config.head_dim // 2} for " \
                                                   f"{model.config.head_dim})"
    assert ak.returned_names(type(model.model.rotary_emb).forward, 2) == ["cos", "sin"]
    assert ak.returned_names(type(model.model.rotary_emb).forward, 3) is None


def test_solution_entry_follows_the_op_signature():
    inv = inventory.Inventory.load(ROOT / "inventory")
    body = ak.entry_body(inv.definitions["rope_cos_sin"], "rope_cos_sin")
    assert body.splitlines()[-1] == ("return _op(inv_freq=inv_freq, position_ids=position_ids, "
                                     "attention_scaling=attention_scaling, dtype=torch.bfloat16)")
    assert ak.entry_body(inv.definitions["rms_norm"], "no_such_family") is None  # the plain call


def test_scaffold_of_attention_flattens_tuple_arguments(tiny, tmp_path):
    model, label, found = tiny
    _checkout(tmp_path)
    region = next(r for r in found["regions"] if r["region"] == "layers.*.self_attn")
    ak.scaffold(model, region, label, tmp_path, name="attn_tiny")
    d = inventory.Inventory.load(tmp_path / "inventory").definitions["attn_tiny"]
    assert list(d.inputs)[:3] == ["hidden_states", "position_embeddings_0", "position_embeddings_1"]
    args, expected = ak.capture(model, "model.layers.0.self_attn")
    attn = model.get_submodule("model.layers.0.self_attn")
    state = [p for _, p in attn.named_parameters()]
    cos, sin = args["position_embeddings"]
    extra = [args["kwargs"][k] for k in args["kwargs"] if isinstance(args["kwargs"][k], torch.Tensor)]
    got = inventory.load_reference(d)(args["hidden_states"], cos, sin, *extra, *state)
    assert torch.equal(got, expected[0])


def test_decide_keeps_only_what_passes_and_does_not_slow_down():
    base = {"prefill": 1000.0, "decode-b1": 100.0}
    assert ak.decide("PASSED", True, {"prefill": 1000.0, "decode-b1": 99.5}, base) == (
        True, "every gate passed; throughput did not drop")
    keep, why = ak.decide("PASSED", True, {"prefill": 1000.0, "decode-b1": 95.0}, base)
    assert not keep and why == "throughput dropped more than 1%: decode-b1 95.0 < 100.0"
    assert ak.decide("INCORRECT_NUMERICAL", True, base, base) == (False, "evaluate: INCORRECT_NUMERICAL")
    assert ak.decide("PASSED", False, base, base) == (False, "end-to-end logit gate failed")
    assert ak.decide("PASSED", True, {"prefill": 900.0}, base, tolerance=0.2)[0]
    # Per-round ratios decide when given: one drifted round (0.6) does not discard ...
    now = {"prefill": 800.0, "decode-b1": 90.0}
    assert ak.decide("PASSED", True, now, base, ratios={"prefill": [1.05, 0.6, 1.04], "decode-b1": [1.0, 1.1, 0.5]}) == (
        True, "every gate passed; throughput did not drop (median per-round ratio)")
    # ... a drop in most rounds does, with the rounds in the reason
    keep, why = ak.decide("PASSED", True, now, base, ratios={"prefill": [1.05, 1.0, 1.0], "decode-b1": [0.97, 0.9, 1.2]})
    assert not keep and why == ("throughput dropped more than 1% (median per-round ratio): "
                                "decode-b1 x0.970 (rounds 0.97, 0.90, 1.20)")
    # Two rounds are too few to outvote a drifted one: the all-sample figures decide then, and so
    # they do for a figure without ratios.
    keep, why = ak.decide("PASSED", True, now, base, ratios={"prefill": [1.05, 1.04], "decode-b1": [1.0, 1.1, 1.2]})
    assert not keep and why == ("throughput dropped more than 1% (median per-round ratio): prefill 800.0 < 1000.0")
    assert ak.decide("PASSED", True, {"prefill": 1000.0, "decode-b1": 80.0}, base,
                     ratios={"prefill": [1.0, 1.0, 1.0]})[1].endswith("decode-b1 80.0 < 100.0")


def test_results_log_round_trip(tmp_path):
    log = tmp_path / "results.tsv"
    ak.append_log(log, {"model": "m", "candidate": "a", "status": "discard", "reason": "evaluate: COMPILE_ERROR"})
    ak.append_log(log, {"model": "m", "candidate": "b", "status": "keep", "prefill_tok_s": "1200.5",
                        "decode_tok_s": '{"decode-b1": 97.0}', "description": "tabs\tand\nnewlines flattened"})
    ak.append_log(log, {"model": "other", "candidate": "c", "status": "keep", "prefill_tok_s": "1",
                        "decode_tok_s": '{"decode-b1": 1.0}'})
    rows = ak.read_log(log)
    assert [r["candidate"] for r in rows] == ["a", "b", "c"] and rows[1]["description"] == "tabs and newlines flattened"
    assert log.read_text().splitlines()[0].split("\t") == list(ak.LOG_COLUMNS)
    assert ak.last_kept(rows, "m") == {"prefill": 1200.5, "decode-b1": 97.0}
    assert ak.last_kept(rows, "nope") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_score_on_cpu_is_not_run_and_not_logged(tmp_path, capsys):
    root = tmp_path / "inventory"
    for sub in ("definitions", "solutions", "workloads"):
        shutil.copytree(ROOT / "inventory" / sub, root / sub)
    log = tmp_path / "log.tsv"
    row = ak.score("tiny", "rms_norm", root=root, log=log, description="norm", checkout=ROOT)
    assert row["candidate"] == "rms_norm_cutile" and row["status"] == "not_run"
    assert row["eval_status"] == evaluate.NOT_RUN and "no CUDA" in row["reason"]
    assert not log.exists()  # nothing measured: no keep/discard row
    rc = cli.main(["autokernelize", "tiny", "--score", "rms_norm", "--root", str(root), "--log", str(log),
                   "--device", "cpu", "--quiet"])
    assert rc == 3 and "not logged" in capsys.readouterr().out and not log.exists()
    with pytest.raises(KeyError, match="no Solution or Definition"):
        ak.score("tiny", "nothing", root=root, log=log, checkout=ROOT)


def _fake_path(prefill_tok_s, b1_tok_s, prefill_rounds=None, b1_rounds=None):
    path = {"ok": True, "prefill_tokens_per_s": prefill_tok_s, "decode": [{"batch": 1, "tokens_per_s": b1_tok_s}],
            "coverage": {"ours_time_share": 0.2}}
    if prefill_rounds:
        path["prefill_ms"] = {"round_medians": prefill_rounds}
        path["decode"][0]["step_ms"] = {"round_medians": b1_rounds}
    return path


@pytest.mark.parametrize("candidate,baseline,ours", [
    ("fused_gate_up", "cutile~fused_gate_up", "cutile"),   # a default patch: timed without it
    ("rope_cos_sin", "cutile", "cutile+rope_cos_sin"),      # an opt-in patch: timed with it
])
def test_score_benches_the_candidate_against_our_build_without_it(tmp_path, monkeypatch, candidate, baseline,
                                                                   ours):
    from cutile_kernels_tools import bench

    monkeypatch.setattr(evaluate, "evaluate", lambda *a, **k: evaluate.Result(f"{candidate}_cutile", candidate, "cuda"))
    monkeypatch.setattr(ak, "ensure_solution", lambda inv, c, checkout: f"{c}_cutile")
    monkeypatch.setattr(ak.inventory.Inventory, "load", lambda root: types.SimpleNamespace(
        root=tmp_path, definitions={candidate: types.SimpleNamespace(name=candidate)}))
    seen = {}

    def fake_run(model, s, out_dir=None, progress=False):
        seen["paths"] = s.paths
        return {"paths": {"stock": _fake_path(900.0, 50.0), baseline: _fake_path(1000.0, 100.0),
                          ours: _fake_path(1001.0, 94.0)},
                "gate": {ours: {"passed": True}}, "cutile_kernels_ran": True}

    monkeypatch.setattr(bench, "run", fake_run)
    log = tmp_path / "log.tsv"
    row = ak.score("tiny", candidate, log=log, checkout=ROOT, bench_overrides={"rounds": 2})
    assert seen["paths"] == ("stock", baseline, ours)
    assert row["baseline"] == baseline and row["gate"] == "passed" and row["status"] == "discard"
    assert row["reason"] == "throughput dropped more than 1%: decode-b1 94.0 < 100.0"
    assert ak.read_log(log)[0]["baseline"] == baseline


def test_score_decides_on_per_round_ratios_when_the_rounds_drift(tmp_path, monkeypatch):
    """Round 2 ran on a slow host for the candidate only: its all-sample figures fall below the
    baseline's, but round by round it is as fast or faster, so it is kept."""
    from cutile_kernels_tools import bench

    monkeypatch.setattr(evaluate, "evaluate", lambda *a, **k: evaluate.Result("fused_gate_up_cutile", "fused_gate_up", "cuda"))
    monkeypatch.setattr(ak, "ensure_solution", lambda inv, c, checkout: f"{c}_cutile")
    monkeypatch.setattr(ak.inventory.Inventory, "load", lambda root: types.SimpleNamespace(
        root=tmp_path, definitions={"fused_gate_up": types.SimpleNamespace(name="fused_gate_up")}))
    base = _fake_path(1000.0, 100.0, [10.0, 10.0, 10.0], [10.0, 10.0, 10.0])
    ours = _fake_path(900.0, 80.0, [9.5, 18.0, 9.8], [9.9, 17.0, 9.0])
    monkeypatch.setattr(bench, "run", lambda *a, **k: {
        "paths": {"stock": _fake_path(500.0, 50.0), "cutile~fused_gate_up": base, "cutile": ours},
        "gate": {"cutile": {"passed": True}}, "cutile_kernels_ran": True})
    row = ak.score("tiny", "fused_gate_up", log=tmp_path / "log.tsv", checkout=ROOT)
    assert row["status"] == "keep" and row["reason"].endswith("(median per-round ratio)")
    assert bench.round_ratios(ours, base) == {"prefill": [10 / 9.5, 10 / 18, 10 / 9.8],
                                              "decode-b1": [10 / 9.9, 10 / 17, 10 / 9]}


def test_cli_lists_regions(tiny, capsys):
    assert cli.main(["autokernelize", "tiny", "--device", "cpu", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "uncovered regions of tiny" in out and "ceiling 2x" in out and "covered: layers.*.input_layernorm" in out
    assert cli.main(["autokernelize", "tiny", "--device", "cpu", "--scaffold", "no.such.region"]) == 2


def test_bench_paths_for_each_kind_of_candidate():
    assert ak.bench_paths_for("fused_gate_up") == ("cutile~fused_gate_up", "cutile")  # a default patch
    assert ak.bench_paths_for("RMSNorm") == ("cutile~RMSNorm", "cutile")  # a hub layer
    assert ak.bench_paths_for("rope_cos_sin") == ("cutile", "cutile+rope_cos_sin")  # an opt-in patch
    assert ak.bench_paths_for("rms_norm") == (None, "cutile")  # a Definition with no patch of its name
    assert "baseline" in ak.LOG_COLUMNS
