"""The bench and the CLI on the embedded model (CPU), and the quickstart example."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cutile_kernels_tools import bench, cli, presets

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def preset_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(presets.ENV_CACHE, str(tmp_path / "presets"))
    return tmp_path / "presets"


def test_presets_are_real_configs():
    cfg = presets.make_config("llama-3.2-1b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.vocab_size) == (2048, 16, 8, 128256)
    assert cfg.rope_parameters["rope_type"] == "llama3"
    q = presets.make_config("qwen3-0.6b")
    assert (q.hidden_size, q.head_dim, q.num_hidden_layers) == (1024, 128, 28)
    assert presets.make_config("mistral-7b-v0.3").intermediate_size == 14336
    assert presets.make_config("qwen2.5-1.5b").num_key_value_heads == 2
    q35 = presets.make_config("qwen3.5-0.8b")
    assert type(q35).__name__ == "Qwen3_5TextConfig" and q35.layer_types.count("full_attention") == 6
    assert (q35.hidden_size, q35.linear_num_value_heads, q35.linear_key_head_dim) == (1024, 16, 128)
    q27 = presets.make_config("qwen3.5-27b")
    assert (q27.hidden_size, q27.num_hidden_layers, q27.layer_types.count("full_attention")) == (5120, 64, 16)
    assert (q27.linear_num_key_heads, q27.linear_num_value_heads, q27.tie_word_embeddings) == (16, 48, False)
    g = presets.make_config("granite-3.3-2b")
    assert type(g).__name__ == "GraniteConfig" and (g.embedding_multiplier, g.logits_scaling, g.vocab_size) == (
        12.0, 8.0, 49159)
    s = presets.make_config("smollm3-3b")
    assert type(s).__name__ == "SmolLM3Config" and s.no_rope_layers[:8] == [1, 1, 1, 0, 1, 1, 1, 0]
    assert (s.num_hidden_layers, s.num_key_value_heads, s.intermediate_size) == (36, 4, 11008)
    g2 = presets.make_config("gemma-2-2b")
    assert type(g2).__name__ == "Gemma2Config" and (g2.hidden_size, g2.head_dim, g2.num_hidden_layers) == (2304, 256, 26)
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.layer_types[:2]) == (
        50.0, 30.0, ["sliding_attention", "full_attention"])
    g3 = presets.make_config("gemma-3-1b")
    assert type(g3).__name__ == "Gemma3TextConfig" and (g3.hidden_size, g3.head_dim, g3.num_key_value_heads) == (
        1152, 256, 1)
    assert (g3.sliding_window, g3.layer_types[:6], g3.vocab_size) == (
        512, ["sliding_attention"] * 5 + ["full_attention"], 262144)
    assert {k: v["rope_theta"] for k, v in g3.rope_parameters.items()} == {"sliding_attention": 10000,
                                                                            "full_attention": 1000000}
    o2 = presets.make_config("olmo-2-1b")
    assert type(o2).__name__ == "Olmo2Config" and (o2.hidden_size, o2.intermediate_size, o2.num_hidden_layers) == (
        2048, 8192, 16)
    assert (o2.num_key_value_heads, o2.vocab_size, o2.max_position_embeddings, o2.tie_word_embeddings) == (
        16, 100352, 4096, False)
    assert o2.rope_parameters["rope_theta"] == 500000.0
    p4 = presets.make_config("phi-4-mini")
    assert type(p4).__name__ == "Phi3Config" and (p4.hidden_size, p4.num_key_value_heads, p4.vocab_size) == (
        3072, 8, 200064)
    assert p4.rope_parameters["rope_type"] == "longrope" and len(p4.rope_parameters["long_factor"]) == 48
    assert p4.rope_parameters["long_factor"][-1] == 47.77 and p4.partial_rotary_factor == 0.75
    with pytest.raises(KeyError):
        presets.materialize("nope")
    with pytest.raises(FileNotFoundError):
        presets.resolve("/nonexistent/dir")


@pytest.mark.parametrize("model_type,base", [("llama", 1.0), ("gemma3_text", 0.0), ("qwen3_5_text", 0.0)])
def test_seeded_norms_scale_by_one_plus_noise_whatever_the_formula(model_type, base):
    # (1 + weight) norms get their weight around 0, the others around 1: every norm scales by ~1.
    import families

    model = families.model(model_type)
    n = presets.seed_norm_weights(model, torch.Generator().manual_seed(0))
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert n >= len(norms) > 0
    weights = torch.cat([m.weight.detach().float() for m in norms])
    assert abs(weights.mean().item() - base) < 0.05 and 0.05 < weights.std().item() < 0.15
    if model_type == "qwen3_5_text":  # its gated norm multiplies by the weight itself: around 1
        gated = [m for m in model.modules() if type(m).__name__ == "Qwen3_5RMSNormGated"]
        assert gated and all(abs(m.weight.float().mean().item() - 1) < 0.1 for m in gated)


def test_materialize_writes_safetensors_once(preset_cache):
    path = presets.materialize("tiny", seed=3)
    files = {p.name for p in path.iterdir()}
    assert "model.safetensors" in files and "config.json" in files
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert presets.materialize("tiny", seed=3) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rewritten
    from safetensors.torch import load_file

    norms = {k: v for k, v in load_file(path / "model.safetensors").items() if "norm" in k}
    assert norms and all(not torch.all(v == 1) for v in norms.values())  # seeded, not all ones


def test_logit_metrics_values():
    ref = torch.randn(2, 3, 50)
    m = bench.logit_metrics(ref.clone(), ref)
    assert m["max_abs_err"] == 0 and m["rel_l2_err"] == 0 and m["kl"] < 1e-7 and m["top5_agreement"] == 1
    shuffled = ref[..., torch.randperm(50)]
    worse = bench.logit_metrics(shuffled, ref)
    assert worse["kl"] > 0.1 and worse["top5_agreement"] < 1 and worse["rel_l2_err"] > 0.5


def test_gate_uses_paired_top5_test():
    c = {"rel_l2_err": 1.0, "kl": 1.0, "top5_agreement": 0.9}
    paths = {"stock": {"correctness": dict(c)}, "cutile": {"correctness": dict(c)}}
    base = torch.zeros(1000, dtype=torch.bool)
    stock, ours = base.clone(), base.clone()
    stock[:30] = True
    ours[:27] = True  # 3 slots lost, 0 won: within noise (3 <= 2 * sqrt(3))
    assert bench.gate(paths, {"stock": stock, "cutile": ours})["cutile"]["passed"]
    ours[:] = False  # 30 lost: significant
    g = bench.gate(paths, {"stock": stock, "cutile": ours})["cutile"]
    assert not g["passed"] and g["checks"][2]["lost"] == 30 and g["checks"][2]["won"] == 0
    paths["cutile"]["correctness"]["rel_l2_err"] = 1.2
    assert not bench.gate(paths, {"stock": stock, "cutile": stock})["cutile"]["passed"]
    assert "stock" not in bench.gate(paths, {"stock": stock, "cutile": stock})


def test_gate_holds_each_decode_batch_to_stock():
    c = {"rel_l2_err": 1.0, "kl": 1.0, "top5_agreement": 0.9}
    d = {"rel_l2_err": 3.0, "kl": 2.0, "top5_agreement": 0.8}  # decode steps err more than the prompt
    paths = {"stock": {"correctness": dict(c), "decode_correctness": {"1": dict(d), "16": dict(d)}},
             "cutile": {"correctness": dict(c), "decode_correctness": {1: dict(d), "16": dict(d)}}}
    g = bench.gate(paths)["cutile"]  # each decode batch against stock's decode batch (keys as str or int)
    assert g["passed"] and [x["stock"] for x in g["checks"] if x["metric"] == "decode-b1 rel_l2_err"] == [3.0]
    del paths["cutile"]["decode_correctness"][1]
    paths["cutile"]["decode_correctness"]["1"] = dict(d)
    paths["cutile"]["decode_correctness"]["16"]["rel_l2_err"] = 3.6  # the prompt logits still pass
    g = bench.gate(paths)["cutile"]
    assert not g["passed"] and [x["metric"] for x in g["checks"] if not x["passed"]] == ["decode-b16 rel_l2_err"]
    del paths["cutile"]["decode_correctness"]  # unchecked where stock was checked: not a pass
    g = bench.gate(paths)["cutile"]
    assert not g["passed"] and {x["metric"] for x in g["checks"] if not x["passed"]} == {"decode-b1 checked",
                                                                                          "decode-b16 checked"}
    hits = torch.ones(1, 8, 5, dtype=torch.bool)  # the paired top-5 test per batch, as for the prompt
    miss = hits.clone()
    miss[..., 0] = False
    paths["cutile"]["decode_correctness"] = {"1": dict(d), "16": dict(d)}
    g = bench.gate(paths, decode_hits={"stock": {1: hits, 16: hits}, "cutile": {"1": miss, "16": hits}})["cutile"]
    assert not g["passed"] and [(x["metric"], x["lost"]) for x in g["checks"] if not x["passed"]] == [
        ("decode-b1 top5_agreement", 8)]


@pytest.mark.parametrize("static", [False, True], ids=["dynamic-cache", "static-cache"])
def test_forced_decode_is_a_forward_over_the_same_tokens_and_sees_a_cache_bug(static, monkeypatch):
    """The decode check's logits: a prompt prefilled, then steps fed given tokens through the
    decoder's cache, equal a float32 forward over prompt + tokens at those positions; a cache that
    loses the values written by decode steps (a bug the prompt logits, computed without a cache,
    cannot show) is far off. The static decoder's step is the eager model here (on a GPU it is the
    compiled call or the decode graphs)."""
    from families import model as tiny_model
    from transformers import cache_utils

    from cutile_kernels_tools.bench.worker import Decoder
    from cutile_kernels_tools.metrics import logit_metrics

    model = tiny_model("llama", layers=2)
    monkeypatch.setattr(model, "get_compiled_call", lambda config: model.__call__)
    gen = torch.Generator().manual_seed(5)
    ids, forced = torch.randint(1, 256, (3, 7), generator=gen), torch.randint(1, 256, (3, 5), generator=gen)
    dec = Decoder(model, 3, 7, 6, "cpu", False, 0, graphs=static)
    timed = dec.ids.clone()
    got = dec.forced_logits(ids, forced)
    with torch.no_grad():
        want = model(torch.cat([ids, forced], 1), use_cache=False, logits_to_keep=5).logits
    assert got.shape == (3, 5, 256)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(dec.ids, timed) and dec.pos == 7  # the timed prompt back, the cache reset
    with pytest.raises(ValueError, match="room for"):
        dec.forced_logits(ids, torch.ones(3, 7, dtype=torch.long)) if static else dec.forced_logits(ids[:2], forced)
    layer = cache_utils.StaticLayer if static else cache_utils.DynamicLayer
    real = layer.update

    def lossy(self, key_states, value_states, *args, **kwargs):
        if key_states.shape[-2] == 1:
            value_states = torch.zeros_like(value_states)
        return real(self, key_states, value_states, *args, **kwargs)

    monkeypatch.setattr(layer, "update", lossy)
    bad = logit_metrics(dec.forced_logits(ids, forced), want)
    assert bad["rel_l2_err"] > 0.05 and logit_metrics(got, want)["rel_l2_err"] < 1e-5


@pytest.mark.parametrize("batch", [1, 3])
def test_forced_steps_feed_what_the_timed_steps_feed(batch, monkeypatch):
    """A compiled step recompiles, and the decode graphs capture again, for an input of other
    strides or inference mode: the forced steps must feed token tensors like the timed steps'."""
    from families import model as tiny_model

    from cutile_kernels_tools.bench.worker import Decoder

    model = tiny_model("llama", layers=2)
    seen = []

    def spy(input_ids, **kw):
        seen.append((input_ids.shape, input_ids.stride(), input_ids.is_inference(), input_ids.is_contiguous()))
        return model(input_ids, **kw)

    monkeypatch.setattr(model, "get_compiled_call", lambda config: spy)
    dec = Decoder(model, batch, 7, 6, "cpu", False, 0, graphs=True)
    dec.prefill()
    dec.step()
    timed = seen[-1]
    forced = torch.randint(1, 256, (batch, 5), generator=torch.Generator().manual_seed(6))
    seen.clear()
    dec.forced_logits(torch.randint(1, 256, (batch, 7), generator=torch.Generator().manual_seed(7)), forced)
    assert len(seen) == 5 and all(s == timed for s in seen), (timed, seen)


def test_the_decode_check_saves_the_paths_top5_not_the_references():
    from families import model as tiny_model

    from cutile_kernels_tools.bench.worker import Decoder, PathSession
    from cutile_kernels_tools.metrics import logit_metrics

    model, other = tiny_model("llama", layers=2), tiny_model("llama", layers=2, seed=99)
    gen = torch.Generator().manual_seed(8)
    prompt, forced = torch.randint(1, 256, (3, 7), generator=gen), torch.randint(1, 256, (3, 4), generator=gen)
    with torch.no_grad():  # a reference from another model: its top 5 differ from the path's
        want = other(torch.cat([prompt, forced], 1), use_cache=False, logits_to_keep=4).logits
    session = PathSession.__new__(PathSession)
    session.decoders = {b: Decoder(model, b, 7, 6, "cpu", False, 0) for b in (1, 3)}
    metrics, top5 = session._decode_check({"decode_prompt": prompt, "decode_forced": forced, "decode_logits": want})
    for b in (1, 3):
        got = session.decoders[b].forced_logits(prompt[:b], forced[:b])
        assert torch.equal(top5[str(b)], got.topk(5, dim=-1).indices)
        assert metrics[str(b)] == logit_metrics(got, want[:b]) and metrics[str(b)]["rel_l2_err"] > 0.1


def test_a_bench_cut_short_leaves_its_rounds(preset_cache, tmp_path, monkeypatch):
    """A bench killed before its report (a device call's time limit) keeps what it measured: after
    each timing round the rounds so far are in bench.partial.json; the report replaces it."""
    from cutile_kernels_tools.bench import report as report_out, runner

    seen = []
    real = runner._write_partial
    monkeypatch.setattr(runner, "_write_partial", lambda *a: (real(*a), seen.append(
        json.loads((tmp_path / "out" / runner.PARTIAL).read_text())))[0])
    monkeypatch.setattr(report_out, "write", lambda report, out: (_ for _ in ()).throw(KeyboardInterrupt))
    settings = bench.BenchSettings.for_cpu(paths=["stock", "cutile"], decode_steps=2, repeats=1, rounds=2)
    with pytest.raises(KeyboardInterrupt):
        bench.run("tiny", settings, out_dir=str(tmp_path / "out"), progress=False)
    assert [p["partial"]["timing_rounds_done"] for p in seen] == [1, 2]
    last = json.loads((tmp_path / "out" / runner.PARTIAL).read_text())
    assert set(last["paths"]) == {"stock", "cutile"}
    assert all(len(p["prefill_ms"]["round_medians"]) == 2 and p["prefill_ms"]["median"] > 0
               for p in last["paths"].values())
    assert len(seen[0]["paths"]["stock"]["prefill_ms"]["round_medians"]) == 1


def test_cli_bench_on_embedded_model(preset_cache, tmp_path, capsys):
    from cutile_kernels_tools.bench.schema import BenchReport

    out = tmp_path / "out"
    rc = cli.main(["bench", "--out", str(out), "--quiet", "--decode-steps", "3", "--repeats", "2",
                   "--coverage-prefill-len", "24", "--decode-prompt-len", "10"])
    assert rc == 0
    assert not (out / "bench.partial.json").exists()  # replaced by the report
    report = json.loads((out / "bench.json").read_text())
    BenchReport.model_validate(report)
    assert report["schema"] == bench.SCHEMA
    assert set(report["paths"]) == {"stock", "cutile"}
    for name in ("stock-compile", "cutile-compile", "cutile-compile-attn", "cutile-graphs", "stock-graphs"):
        assert report["skipped"][name].startswith("compiled and decode-graph paths use CUDA graphs")
    assert "needs CUDA" in report["skipped"]["cutile-attn"]
    assert report["limits"]["copy_bandwidth_Bps"] > 0 and report["limits"]["matmul_flops"] > 0
    for p in report["paths"].values():
        assert p["ok"], p.get("error")
        assert p["prefill_ms"]["n"] == 2 * 2 and p["prefill_ms"]["median"] > 0  # 2 repeats x 2 rounds
        assert len(p["prefill_ms"]["round_medians"]) == 2 and len(p["decode"][0]["ttft_round_ms"]) == 2
        # on a CPU the host time is the whole call: the same samples
        assert p["prefill_host_ms"]["n"] == 4 and p["prefill_host_ms"]["median"] == pytest.approx(p["prefill_ms"]["median"])
        # a CPU forward computes on the timing thread (its intra-op pool's time is not counted)
        assert 0 < p["prefill_host_cpu_ms"]["median"] and p["prefill_host_cpu_ms"]["n"] == 4
        assert 0 <= p["prefill_gc_ms"]["median"] <= p["prefill_host_ms"]["median"]
        assert p["decode"][0]["step_ms"]["n"] == 3 * 2
        assert [d["batch"] for d in p["decode"]] == [1, 4]
        assert all(d["tokens_per_s"] > 0 and d["ttft_ms"] > 0 for d in p["decode"])
        assert 0 < p["roofline"]["prefill_fraction"] and all(0 < d["fraction"] for d in p["roofline"]["decode"])
        assert 0.5 < p["correctness"]["top5_agreement"] <= 1
        t = p["load_to_token"]
        assert 0 < t["load_s"] < t["first_token_s"] < t["decode_ready_s"] and t["batch"] == 1
        cov = p["coverage"]
        assert cov["launches"] > 50 and cov["ours_time_share"] == 0  # CPU: aten ops, none ours
        assert cov["by_class"].get("gemm", 0) > 0  # aten::mm's own time (it is not a leaf op)
        modules = {m for row in cov["uncovered"] for m in row["modules"]}
        assert any("input_layernorm" in m for m in modules) and any("self_attn" in m for m in modules)
        assert all(1 <= row["ceiling"] <= 2 for row in cov["uncovered"])
        # the prefill and the decode steps profiled apart: their launches and time make up the whole
        phases = cov["phases"]
        assert phases["prefill"]["launches"] + phases["decode"]["launches"] == cov["launches"]
        assert phases["prefill"]["device_us"] + phases["decode"]["device_us"] == pytest.approx(cov["device_us"])
        assert all(0 < ph["non_gemm_us"] < ph["device_us"] and ph["ours_non_gemm_share"] == 0 for ph in phases.values())
        # each decode batch size's teacher-forced steps against float32: bf16's distance, not 0, not noise
        assert set(p["decode_correctness"]) == {"1", "4"}
        assert all(1e-4 < c["rel_l2_err"] < 0.05 and c["top5_agreement"] > 0.8 for c in p["decode_correctness"].values())
    # On the CPU nothing is kernelized: both paths compute the same logits.
    assert report["paths"]["cutile"]["correctness"] == report["paths"]["stock"]["correctness"]
    assert report["paths"]["cutile"]["decode_correctness"] == report["paths"]["stock"]["decode_correctness"]
    steps = report["reference"]["decode_check_steps"]
    assert steps == 3 + 1  # warmup + decode_steps: what the timed caches have room for (8 asked)
    checks = {c["metric"] for c in report["gate"]["cutile"]["checks"]}
    assert {f"decode-b{b} {m}" for b in (1, 4) for m in ("rel_l2_err", "kl", "top5_agreement")} <= checks
    paired = [c for c in report["gate"]["cutile"]["checks"] if c["metric"].endswith("top5_agreement")]
    assert len(paired) == 3 and all(c["lost"] == c["won"] == 0 for c in paired)  # slot by slot, every set
    assert report["gate"]["cutile"]["passed"] and report["cutile_kernels_ran"] is False
    by_round = report["speedup_by_round"]["cutile"]
    assert set(by_round) == {"prefill", "decode-b1", "decode-b4"} and all(len(v) == 2 for v in by_round.values())
    stock_r, ours_r = (report["paths"][n]["prefill_ms"]["round_medians"] for n in ("stock", "cutile"))
    assert by_round["prefill"] == pytest.approx([s / o for s, o in zip(stock_r, ours_r)])
    assert "no cuTile kernel ran" in report["note"]
    text = capsys.readouterr().out
    assert "no cuTile kernel ran" in text and "skipped liger" in text
    assert f"decode check: {steps} teacher-forced steps per decode batch size (--decode-check-steps asked 32;" \
        in " ".join(text.split())
    skipped = [line for line in text.splitlines() if line.startswith("skipped ")]
    assert len(skipped) == len(set(skipped)) and any("stock-compile, " in line for line in skipped)  # one a reason
    # said before the speed table, where a CPU row's noise would read as a speedup
    assert text.index("no cuTile kernel ran") < text.index("speed: prefill")
    md = (out / "report.md").read_text()
    assert "The gate holds each to stock eager's" in md
    assert md.index("no cuTile kernel ran") < md.index("## Paths")
    from rich.console import Console

    from cutile_kernels_tools.bench import report as report_out

    ungated = {k: v for k, v in report.items() if k != "gate"}
    assert "Nothing was gated: no stock path." in report_out.markdown(ungated, [])
    wide = io.StringIO()
    bench.print_report(report, wide=True, console=Console(file=wide, width=250))
    assert "decode rel L2 (worst b)" in wide.getvalue()
    from cutile_kernels import registry

    reg = registry.registry()
    b = report["environment"]["cutile_build"]
    assert (b is None) == (reg.pkg_dir is None) and "Build measured:" in md
    assert report["settings"]["coverage_prefill_len"] == 24 and "over one prefill (24 tokens) and 2 decode steps" in md
    t = report["paths"]["cutile"]["load_to_token"]
    assert "## Load to token" in md and f"| cutile | {t['load_s']:.2f} | {t['first_token_s']:.2f} |" in md
    if b is not None:
        assert b["kernels"] == sorted({v.kernel for v in reg.variants()}) and b["id"] in md
    host = ", ".join(f"{x:.2f}" for x in report["paths"]["stock"]["prefill_host_ms"]["round_medians"])
    assert f"| {host} |" in md
    assert "## Speedup over stock by round" in md and "| cutile | " in md.split("## Speedup over stock by round")[1]
    assert "these ratios are the machine's noise" in md  # the CPU run: nothing of ours ran
    assert f"then {steps} decode steps through the path's own cache" in md and "| cutile | 4 | " in md
    assert report["settings"]["decode_prompt_len"] == 10 and "greedy after 10 prompt tokens" in md
    assert "Per decode batch size: 10 seeded prompt tokens prefilled" in md
    assert "## Rounds" in md and "## Coverage: cutile" in md and "![throughput.png](throughput.png)" in md
    for png in ("throughput.png", "breakdown.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_failing_path_is_reported_not_fatal(preset_cache, tmp_path):
    s = bench.BenchSettings.for_cpu()
    w = bench._Worker(tmp_path, "stock", "path", tmp_path / "no-checkpoint", s, path="stock",
                      top5=str(tmp_path / "t.pt"))
    result = w.call("setup")
    assert result["ok"] is False and "no-checkpoint" in result["error"] and "Traceback" in result["log_tail"]
    assert not w.proc.is_alive()


def test_schema_file_is_current():
    from cutile_kernels_tools.bench.schema import json_schema

    assert json.loads((ROOT / "docs" / "bench-schema.json").read_text()) == json_schema()


def test_amdahl_and_coverage_summary():
    from cutile_kernels_tools.bench import coverage

    assert coverage.amdahl(0.5, 2.0) == pytest.approx(1 / 0.75)
    assert coverage.amdahl(0.0, 10.0) == 1.0
    records = [
        {"kernel": "sym_ours", "us": 10.0, "op": None, "module": "model.layers.0.input_layernorm"},
        {"kernel": "gemm_k", "us": 60.0, "op": "aten::mm", "module": "model.layers.0.mlp.up_proj"},
        {"kernel": "gemm_k", "us": 20.0, "op": "aten::mm", "module": "model.layers.1.mlp.up_proj"},
        {"kernel": "ew", "us": 10.0, "op": "aten::mul", "module": None},
    ]
    cov = coverage.summarize(records, {"sym_ours"}, speedup=4.0)
    assert cov["launches"] == 4 and cov["ours_time_share"] == pytest.approx(0.1)
    assert cov["ours_launch_share"] == pytest.approx(0.25)
    top = cov["uncovered"][0]
    assert top["kernel"] == "gemm_k" and top["count"] == 2 and top["share"] == pytest.approx(0.8)
    assert top["modules"] == ["layers.*.mlp.up_proj"] and top["ops"] == ["aten::mm"]
    assert top["ceiling"] == pytest.approx(1 / (0.2 + 0.8 / 4))
    assert cov["by_class"] == {"ours": 10.0, "gemm": 80.0, "elementwise / other": 10.0}
    assert cov["ours"][0]["ops"] == ["?"]
    named = coverage.summarize(records, {"sym_ours": "rms_norm"}, speedup=4.0)
    assert named["ours"][0]["ops"] == ["cutile_kernels::rms_norm"] and named["by_class"] == cov["by_class"]
    # one phase's share of non-GEMM time: ours 10 of the 20 us outside the GEMMs
    share = coverage.phase_share(records, {"sym_ours"})
    assert share == {"device_us": 100.0, "launches": 4, "non_gemm_us": 20.0, "ours_us": 10.0,
                     "ours_non_gemm_share": 0.5,
                     "uncovered": [{"kernel": "ew", "op": "aten::mul", "count": 1, "us": 10.0, "non_gemm_share": 0.5}]}
    assert coverage.phase_share(records[1:3], {"sym_ours"})["ours_non_gemm_share"] == 0.0  # GEMMs only
    from cutile_kernels_tools.bench.report import _phase_line

    line = _phase_line({"phases": {"prefill": share, "decode": share}})
    assert line == (" Non-GEMM device time in our kernels: prefill 50.0% (10 of 20 us), "
                    "decode steps 50.0% (10 of 20 us).")
    assert _phase_line({}) == ""


def test_kernels_replayed_from_a_graph_are_classed_by_name():
    """A kernel replayed from a CUDA graph has no launching aten op: cuBLAS's GEMMs and attention
    kernels are told by name (else a replayed step's GEMMs counted as elementwise work)."""
    from cutile_kernels_tools.bench import coverage

    records = [{"kernel": "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", "us": 30.0, "op": None, "module": None},
               {"kernel": "cudnn_generated_fort_native_sdpa_sm80_flash_fprop", "us": 5.0, "op": None, "module": None},
               {"kernel": "void at::native::vectorized_elementwise_kernel<4>", "us": 2.0, "op": None, "module": None},
               {"kernel": "sym_ours", "us": 3.0, "op": None, "module": None},
               {"kernel": "gemm_named_but_launched_by_mul", "us": 1.0, "op": "aten::mul", "module": None}]
    cov = coverage.summarize(records, {"sym_ours"}, speedup=2.0)
    assert cov["by_class"] == {"gemm": 30.0, "attention": 5.0, "elementwise / other": 3.0, "ours": 3.0}


def test_cli_info_and_build_help(capsys):
    assert cli.main(["info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"build", "archs", "variants", "kernels", "jit_available"} <= set(info)
    with pytest.raises(SystemExit):
        cli.main(["build", "--help"])


def test_quickstart_example_runs_on_cpu(preset_cache):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True,
                         text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "hub layers none" in res.stdout and "max |stock - ours| = 0.000e+00" in res.stdout
    assert "no CUDA GPU here" in res.stdout  # why nothing was swapped


def test_materialize_refuses_to_overwrite_foreign_directories(preset_cache, tmp_path):
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        presets.materialize("tiny", out_dir=foreign)
    assert (foreign / "keep.txt").read_text() == "mine"
    path = presets.materialize("tiny", out_dir=tmp_path / "t", seed=1)
    marker = json.loads((path / "cutile_preset.json").read_text())
    assert marker["preset"] == "tiny" and marker["seed"] == 1 and len(marker["config_sha256"]) == 64
    # Another seed in the same directory is rebuilt, not returned as is.
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    presets.materialize("tiny", out_dir=path, seed=2)
    assert json.loads((path / "cutile_preset.json").read_text())["seed"] == 2
    assert (path / "model.safetensors").stat().st_mtime_ns != mtime


def test_cli_reports_bad_arguments_without_a_traceback(capsys, tmp_path):
    assert cli.main(["build", "--arch", "sm_75", "--out", str(tmp_path / "b")]) == 2
    assert "unsupported arch" in capsys.readouterr().err
    assert cli.main(["build", "--kernel", "rmsnorm", "--out", str(tmp_path / "b")]) == 2
    assert "unknown kernel" in capsys.readouterr().err
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())
    assert cli.main(["bench", str(tmp_path / "missing")]) == 2
    assert "neither a preset" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "--repeats", "0"])


def test_cuda_attribution_from_profiler_events():
    """The CUDA branch of coverage.attribute on synthetic profiler events: module ranges are GPU
    annotations (found on the H200: they are not kernels), the innermost containing range is the
    module, and the op is the innermost aten op around the runtime call torch hung the kernel on."""
    from types import SimpleNamespace as NS

    from cutile_kernels_tools.bench import coverage

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def dev(name, a, b, ann=False):
        return NS(name=name, device_type=cuda, time_range=NS(start=a, end=b), is_user_annotation=ann, cpu_parent=None)

    def host(name, a, b, kernels=()):
        return NS(name=name, device_type=cpu, time_range=NS(start=a, end=b), cpu_parent=None,
                  kernels=[NS(name=k, duration=d) for k, d in kernels])

    # CPU side: module range > aten::linear > aten::mm; torch hangs the kernels on the CUDA runtime
    # call, which CUPTI records under another thread id, so it has no CPU parent.
    events = [
        host("module::model.layers.0", 0, 100),
        host("aten::linear", 10, 40),
        host("aten::mm", 12, 38),
        host("cudaLaunchKernel", 30, 32, kernels=[("gemm_kernel", 30)]),
        host("aten::add", 41, 45),
        host("cutile_kernels::rms_norm", 55, 65),
        host("cuLaunchKernel", 60, 61, kernels=[("our_symbol", 10)]),
        host("cuLaunchKernel", 90, 91, kernels=[("orphan", 1)]),
        dev("module::model.layers.0", 0, 100, ann=True),
        dev("module::model.layers.0.mlp", 10, 60, ann=True),
        dev("gemm_kernel", 20, 50),
        dev("our_symbol", 70, 80),
        dev("orphan", 95, 96),
        dev("gpu_user_annotation_other", 0, 5, ann=True),
    ]
    recs = coverage.attribute(events, "cuda")
    assert recs == [
        {"kernel": "gemm_kernel", "us": 30, "op": "aten::mm", "module": "model.layers.0.mlp"},
        {"kernel": "our_symbol", "us": 10, "op": "cutile_kernels::rms_norm", "module": "model.layers.0"},
        {"kernel": "orphan", "us": 1, "op": None, "module": "model.layers.0"},
    ]


def test_path_specs_and_the_without_form(capsys):
    from cutile_kernels_tools.bench import paths

    assert paths.spec("cutile-attn").attn == "cutile_kernel" and paths.spec("cutile-attn").ours
    assert paths.spec("cutile").attn is None and paths.spec("stock").exclude == ()
    s = paths.spec("cutile~fused_gate_up")
    assert s.ours and s.exclude == ("fused_gate_up",) and s.name == "cutile~fused_gate_up"
    assert paths.spec("cutile~RMSNorm").exclude == ("RMSNorm",)  # a hub layer name works too
    w = paths.spec("cutile+rope_cos_sin")  # an opt-in patch is timed by adding it
    assert w.ours and w.include == ("rope_cos_sin",) and w.exclude == ()
    with pytest.raises(KeyError, match="is opt-in"):
        paths.spec("cutile~rope_cos_sin")  # would be the same model as cutile
    with pytest.raises(KeyError, match="no opt-in patch"):
        paths.spec("cutile+fused_gate_up")  # already in cutile
    c = paths.spec("cutile-compile~decoder_add_rms_norm")  # the compiled path takes both forms too
    assert c.compile and c.ours and c.exclude == ("decoder_add_rms_norm",)
    assert paths.spec("cutile-compile+rope_cos_sin").compile and not paths.spec("cutile+rope_cos_sin").compile
    assert paths.spec("cutile-compile~rotary_pos_emb~fused_gate_up").exclude == ("rotary_pos_emb", "fused_gate_up")
    assert paths.spec("cutile+rope_cos_sin+fused_qkv").include == ("rope_cos_sin", "fused_qkv")
    assert paths.spec("cutile~fused_gate_up_geglu~gemma_add_norm").exclude == ("fused_gate_up_geglu", "gemma_add_norm")
    g = paths.spec("cutile-graphs~fused_gate_up")  # the decode fast path keeps its attention and graphs
    assert g.graphs and g.attn == "cutile" and g.ours and not g.compile and g.exclude == ("fused_gate_up",)
    assert paths.spec("stock-graphs").graphs and not paths.spec("stock-graphs").ours
    # decode_graphs=True applies DECODE_GRAPH_PATCHES: the graph paths leave them out with ~, not add them
    assert paths.spec("cutile-graphs~fused_qkv").exclude == ("fused_qkv",)
    assert paths.spec("cutile-graphs-sdpa~gemma_add_norm~fused_qkv").exclude == (
        "cutile_attention", "gemma_add_norm", "fused_qkv")  # the base's own exclusion kept
    with pytest.raises(KeyError, match="no opt-in patch"):
        paths.spec("cutile-graphs+fused_qkv")
    with pytest.raises(KeyError, match="is opt-in"):
        paths.spec("cutile-compile~fused_qkv")
    ca = paths.spec("cutile-compile-attn+fused_qkv")  # compiled, with our attention, and a patch
    assert ca.compile and ca.attn == "cutile_kernel" and ca.ours and ca.include == ("fused_qkv",) and not ca.graphs
    assert paths.spec("cutile-compile").attn is None
    assert not paths.spec("cutile~fused_gate_up").graphs and paths.spec("cutile~fused_gate_up").attn is None
    for bad in ("cutile~nope", "stock~fused_gate_up", "stock-compile~RMSNorm", "cutile~", "cutile+", "cutile~RMSNorm~",
                "cutile~RMSNorm~nope", "cutile+gemma_add_norm+fused_gate_up", "warp-drive"):
        with pytest.raises(KeyError):
            paths.spec(bad)
    with pytest.raises(KeyError, match="not both"):
        paths.spec("cutile~fused_gate_up+rms_norm_olmo2")
    with pytest.raises(KeyError, match="twice"):
        paths.spec("cutile~RMSNorm~RMSNorm")
    with pytest.raises(SystemExit):
        cli.main(["bench", "--paths", "stock", "cutile~nope"])
    assert "no patch or hub layer of ours" in capsys.readouterr().err


def test_round_ratios_pair_rounds_and_refuse_mixed_runs():
    def path(prefill, b1):
        return {"prefill_ms": {"round_medians": prefill}, "decode": [{"batch": 1, "step_ms": {"round_medians": b1}}]}

    ours, stock = path([10.0, 20.0], [5.0, 8.0]), path([15.0, 22.0], [10.0, 8.0])
    assert bench.round_ratios(ours, stock) == {"prefill": [1.5, 1.1], "decode-b1": [2.0, 1.0]}
    assert bench.round_ratios(ours, {"prefill_ms": {"round_medians": [15.0, 22.0]}}) == {"prefill": [1.5, 1.1]}
    assert bench.round_ratios(path([0.0, 1.0], [5.0, 8.0]), stock) == {"decode-b1": [2.0, 1.0]}  # no zero times
    with pytest.raises(ValueError):
        bench.round_ratios(ours, path([15.0, 22.0, 30.0], [10.0, 8.0, 9.0]))  # rounds of different runs


def test_an_opt_in_patch_that_changes_nothing_is_said(capsys, monkeypatch):
    # cutile+rope_cos_sin on an OLMo 2 model (its own rotary code) measures the cutile model again: the
    # report says so.
    import families
    from cutile_kernels_tools.bench import paths
    from cutile_kernels_tools.bench.worker import inert_patches

    import cutile_kernels

    spec = paths.spec("cutile+rope_cos_sin")
    olmo2, llama = families.model("olmo2"), families.model("llama")
    for m in (olmo2, llama):
        cutile_kernels.patch(m, names=["rope_cos_sin"])
    assert inert_patches(olmo2, spec, "cuda") == ["rope_cos_sin"]
    assert inert_patches(llama, spec, "cuda") == [] and inert_patches(olmo2, spec, "cpu") == []
    assert inert_patches(olmo2, paths.spec("cutile"), "cuda") == []
    # An opt-in hub layer the model has no function of (Qwen3.5's chunked delta rule on Llama, as
    # when it was opt-in; none is today).
    monkeypatch.setattr(cutile_kernels.layers, "OPT_IN_LAYERS", {"chunk_gated_delta_rule"})
    hub = paths.spec("cutile+chunk_gated_delta_rule")
    assert inert_patches(llama, hub, "cuda") == ["chunk_gated_delta_rule"]
    assert inert_patches(families.model("qwen3_5_text"), hub, "cuda") == []
    report = json.loads((ROOT / "benchmarks/results/h200-2026-12-01/call4/bench-llama-3.2-1b/bench.json").read_text())
    report["paths"]["cutile+rope_cos_sin"] = dict(report["paths"]["cutile"], inert_patches=["rope_cos_sin"])
    bench.print_report(report)
    said = " ".join(capsys.readouterr().out.split())
    assert "cutile+rope_cos_sin: rope_cos_sin changed nothing in this model" in said


def test_only_the_fla_path_sees_flash_linear_attention(tmp_path, monkeypatch):
    # A stand-in fla package in a folder of its own, found through $CUTILE_BENCH_FLA_PATH.
    (tmp_path / "fla" / "ops").mkdir(parents=True)
    (tmp_path / "fla" / "__init__.py").write_text("WHO = 'fla'\n")
    (tmp_path / "fla" / "ops" / "__init__.py").write_text("")
    (tmp_path / "fla" / "ops" / "gated_delta_rule.py").write_text("def chunk_gated_delta_rule(): pass\n")
    (tmp_path / "causal_conv1d").mkdir()
    (tmp_path / "causal_conv1d" / "__init__.py").write_text("")
    from cutile_kernels_tools.bench import paths as bench_paths

    monkeypatch.setenv(bench_paths.FLA_DIR_ENV, str(tmp_path))
    assert bench_paths.spec("stock+fla").unavailable("cpu") is None
    assert bench_paths.spec("cutile+fla").ours and bench_paths.spec("cutile+fla").unavailable("cpu") is None
    probe = ("import importlib.util, sys; from cutile_kernels_tools.bench import paths as p; "
             "p.isolate_packages(sys.argv[1]); sys.path.append(sys.argv[2]); "
             "print([importlib.util.find_spec(m) is not None if sys.argv[1].endswith('+fla') else "
             "__import__('importlib').import_module(m) and 'imported' for m in ('fla',)])")
    seen = {}
    for path in ("stock+fla", "cutile+fla", "stock", "cutile"):
        r = subprocess.run([sys.executable, "-c", probe, path, str(tmp_path)], capture_output=True, text=True,
                           env={**os.environ, bench_paths.FLA_DIR_ENV: str(tmp_path)})
        seen[path] = (r.returncode, r.stdout.strip(), r.stderr.strip().splitlines()[-1:] if r.returncode else [])
    assert seen["stock+fla"] == seen["cutile+fla"] == (0, "[True]", [])
    for path in ("stock", "cutile"):  # hidden even when it is on sys.path
        assert seen[path][0] != 0 and "ModuleNotFoundError" in seen[path][2][0] and "hidden" in seen[path][2][0]
    # fla that imports but whose ops do not (no triton): the fla paths fail rather than time torch code.
    (tmp_path / "fla" / "ops" / "gated_delta_rule.py").write_text("import triton_not_here\n")
    r = subprocess.run([sys.executable, "-c", probe, "stock+fla", str(tmp_path)], capture_output=True, text=True,
                       env={**os.environ, bench_paths.FLA_DIR_ENV: str(tmp_path)})
    assert r.returncode != 0 and "fla.ops.gated_delta_rule does not import" in r.stderr
    monkeypatch.delenv(bench_paths.FLA_DIR_ENV)
    if importlib.util.find_spec("fla") is None:
        assert "not installed" in bench_paths.spec("stock+fla").unavailable("cpu")
        assert "not installed" in bench_paths.spec("cutile+fla").unavailable("cpu")


def test_a_static_decoder_resets_a_hybrid_cache_it_filled_in_inference_mode():
    """Qwen3.5's static cache allocates its linear-attention states in the first prefill (in the
    bench's inference mode): resetting it for the next run must not update inference tensors
    outside inference mode (what failed the H200 bench's `cutile-graphs` coverage pass)."""
    from families import model as tiny_model

    from cutile_kernels_tools.bench.worker import Decoder

    dec = Decoder(tiny_model("qwen3_5_text", layers=2), 1, 8, 4, "cpu", False, 0, graphs=True)
    dec.prefill()
    states = [t for layer in dec.cache.layers for t in vars(layer).values()
              if isinstance(t, torch.Tensor) and t.is_inference() and t.numel() > 1]
    assert states and any(bool(t.ne(0).any()) for t in states)  # the prefill wrote them
    dec.reset()
    assert all(not bool(t.ne(0).any()) for t in states)


def test_load_profile_times_the_load_and_the_first_prefill(preset_cache, capsys, monkeypatch):
    """dev/diagnostics/load_profile.py (run on the GPU by hand) on the embedded model: the preset is
    written before the timed span (in a child process), the load and the first prefill timed apart,
    the load positive, the total their sum, the profile printed by own time."""
    import re

    from cutile_kernels_tools.bench import paths

    from dev.diagnostics import load_profile

    monkeypatch.setattr(paths, "isolate_packages", lambda path: None)  # hides packages process-wide: not in a test
    assert not (preset_cache / "tiny-seed0").exists()

    load_profile.main(["tiny", "--path", "cutile", "--device", "cpu", "--prompt", "5", "--top", "5"])
    out = capsys.readouterr().out
    found = re.search(r"load ([\d.]+) s, first prefill ([\d.]+) s \(load to first token ([\d.]+) s", out)
    assert found, out
    load, first, total = map(float, found.groups())
    assert load > 0 and first >= 0 and abs(load + first - total) <= 0.0011  # a tiny prefill may round to 0
    assert "internal time" in out and "function calls" in out
    assert "wrote preset" not in out  # the child process wrote it, before the timed span
    assert (preset_cache / "tiny-seed0" / "model.safetensors").is_file()
