"""``cutile-kernels kernel-table``: workload selection, bytes and roofline arithmetic, the fallback
marking and the markdown on the CPU (timers injected); the real table on a GPU."""

from __future__ import annotations

import pytest
import torch
from cutile_kernels_tools import cli, inventory
from cutile_kernels_tools.inventory import kernel_table


@pytest.fixture(scope="module")
def inv():
    return inventory.Inventory.load()


def test_moved_bytes_counts_tensors_once_and_no_scalars():
    x = torch.empty(3, 5, dtype=torch.bfloat16)
    w = torch.empty(5, dtype=torch.float32)
    out = (torch.empty(3, 5, dtype=torch.bfloat16), torch.empty(3, 5, dtype=torch.bfloat16))
    assert kernel_table.moved_bytes([x, w, 1e-6], out) == 30 + 20 + 60
    assert kernel_table.moved_bytes([x], x) == 60  # a single output tensor, not a tuple


def test_roofline_fraction_is_bytes_per_second_over_bandwidth():
    assert kernel_table.roofline_fraction(4_000_000, 2.0, 4e12) == pytest.approx(0.5)
    assert kernel_table.roofline_fraction(4_000_000, None, 4e12) is None
    assert kernel_table.roofline_fraction(4_000_000, 2.0, 0.0) is None


def test_input_sets_move_twice_the_l2_per_round():
    assert kernel_table.input_sets(10 << 20, 50 << 20) == 10  # 10 MiB per call, 50 MiB L2: 100 MiB a round
    assert kernel_table.input_sets(300 << 20, 50 << 20) == 1  # one call already streams
    assert kernel_table.input_sets(1000, 50 << 20) == 32  # decode-sized: capped
    assert kernel_table.input_sets(0, 50 << 20, most=4) == 4


def test_select_filters_by_model_and_leaves_out_non_stock_references(inv):
    triples, skipped = kernel_table.select(inv)
    solutions = {s.name for s, _, _ in triples}
    assert "rms_norm_cutile" in solutions and "qk_norm_rope_cutile" in solutions
    # attention's reference is a float32 softmax, not sdpa: never compared as if it were stock
    assert all(d.name not in kernel_table.NOT_STOCK for _, d, _ in triples)
    assert {n for n, s in inv.solutions.items() if s.definition == "attention"} == set(skipped)
    qwen, _ = kernel_table.select(inv, ["rms_norm_cutile"], ["qwen3-0.6b"])
    assert qwen and all(w.uuid.startswith("qwen3-0.6b/") and s.name == "rms_norm_cutile" for s, _, w in qwen)
    assert len(qwen) == sum(w.uuid.startswith("qwen3-0.6b/") for w in inv.workloads["rms_norm"])
    with pytest.raises(KeyError, match="unknown Solutions"):
        kernel_table.select(inv, ["no_such_kernel"])


def test_measure_marks_a_fallback_and_times_the_rest(inv):
    triples, _ = kernel_table.select(inv, ["rms_norm_cutile"], ["llama-3.2-1b"])
    timed, outs = [], []

    def graph(fn, n):
        timed.append(n)
        fn()  # n calls, each on its own input set
        return 2.0 if len(timed) % 2 else 6.0  # ours, then stock

    w = triples[0][2]
    tokens, hidden = w.axes["num_tokens"], w.axes["hidden_size"]
    nbytes = 2 * tokens * hidden * 2 + hidden * 2  # x in, y out (bf16), weight
    from cutile_kernels.ops import norm

    real = norm.rms_norm
    with pytest.MonkeyPatch.context() as mp:  # the Solution's entry calls the op: record its inputs
        mp.setattr(norm, "rms_norm", lambda x, *a, **k: outs.append(x) or real(x, *a, **k))
        rows = kernel_table.measure(inv, triples[:2], "cpu", bandwidth_Bps=1e9, l2_bytes=2 * nbytes,
                                    graph_timer=graph, eager_timer=lambda fn, n: 10.0)
    assert len(rows) == 2 and all(r.speedup == pytest.approx(3.0) for r in rows)
    assert timed[0] == 4  # twice the "L2" per round: 4 input sets of this size
    first = outs[:5]  # the untimed check call, then the 4 sets of the first graph timing
    assert torch.equal(first[0], first[1]) and not any(torch.equal(first[1], x) for x in first[2:])
    assert rows[0].bytes_moved == nbytes
    assert rows[0].ours_roofline == pytest.approx(rows[0].bytes_moved / 2e-6 / 1e9)
    # on the CPU our op serves the reference: with a launch counter that does not move, it is a fallback
    fallback = kernel_table.measure(inv, triples[:1], "cpu", bandwidth_Bps=1e9, launches=lambda: 0,
                                    graph_timer=graph, eager_timer=lambda fn, n: 10.0)
    assert fallback[0].note.startswith("fallback") and fallback[0].ours_graph_us is None


def test_markdown_lists_rows_medians_and_skips():
    row = kernel_table.Row("rms_norm_cutile", "rms_norm", "llama-3.2-1b/hidden/decode-b1", 8_196, 2.0, 6.0, 9.0, 27.0,
                           0.25, 0.08)
    fb = kernel_table.Row("silu_cutile", "silu", "llama-3.2-1b/mlp/decode-b1", 100, note="fallback: none ran")
    report = {"limits": {"copy_bandwidth_Bps": 4.2e12},
              "rows": [{**vars(r), "speedup": r.speedup} for r in (row, fb)],
              "skipped": {"attention_cutile": "see attention_bench"}}
    text = kernel_table.markdown(report)
    assert "4.20 TB/s" in text
    assert "| rms_norm_cutile | llama-3.2-1b/hidden/decode-b1 | 0.008 | 2.0 | 6.0 | 3.00x | 25% | 8% | 9.0 | 27.0 |" in text
    assert "| silu_cutile | llama-3.2-1b/mlp/decode-b1 | 0.000 | - | - | - | - | - | - | - | fallback: none ran |" in text
    assert "| rms_norm_cutile | 1 | 3.00x | 3.00x |" in text  # medians: the fallback row is left out
    assert "attention_cutile: not in the table, see attention_bench." in text


def test_cli_refuses_without_cuda_and_checks_names_first(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["kernel-table", "rms_norm_cutile"]) == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err
    assert cli.main(["kernel-table", "rms_norm_cutile", "--device", "cpu"]) == 2
    assert "needs a CUDA device, not 'cpu'" in capsys.readouterr().err
    assert cli.main(["kernel-table", "no_such"]) == 2
    assert "unknown Solutions ['no_such']" in capsys.readouterr().err
    # a preset name that matches no Workload (a typo, or no uuid prefix) is an error, not an empty table
    assert cli.main(["kernel-table", "rms_norm_cutile", "--model", "qwen3"]) == 2
    err = capsys.readouterr().err
    assert "no Workload of these Solutions for ['qwen3']" in err and "qwen3-0.6b" in err


def test_stock_of_the_fused_activation_is_the_stock_mlp(inv):
    """The stock MLP runs silu(gate) * up on two GEMM outputs; the reference's copy of the gate half
    (for CPU bit-matching) must not be timed as stock."""
    (s, d, w), *_ = kernel_table.select(inv, ["silu_and_mul_fused_cutile"], ["llama-3.2-1b"])[0]
    x = torch.randn(3, 2 * 8, dtype=torch.bfloat16)
    fn, (gate, up) = kernel_table.STOCK[d.name](x)
    assert gate.is_contiguous() and up.is_contiguous() and torch.equal(gate, x[:, :8])
    assert torch.equal(fn(gate, up), torch.nn.functional.silu(x[:, :8]) * x[:, 8:])
    seen = []
    kernel_table.measure(inv, [(s, d, w)], "cpu", bandwidth_Bps=1e9,
                         graph_timer=lambda f, n: seen.append(f) or 1.0, eager_timer=lambda f, n: 1.0)
    calls = []
    with pytest.MonkeyPatch.context() as mp:  # the timed stock call is the stock MLP's, not the reference
        mp.setattr(torch.nn.functional, "silu", lambda t: calls.append(t.is_contiguous()) or t)
        seen[1]()
    assert calls == [True]


@pytest.mark.gpu
def test_kernel_table_on_the_gpu(tmp_path, strict):
    rc = cli.main(["kernel-table", "rms_norm_cutile", "qk_norm_rope_cutile", "--model", "qwen3-0.6b",
                   "--out", str(tmp_path / "t.md"), "--json", str(tmp_path / "t.json")])
    import json

    report = json.loads((tmp_path / "t.json").read_text())
    assert rc == 0 and report["rows"] and not any(r["note"] for r in report["rows"])
    for r in report["rows"]:
        assert r["ours_graph_us"] > 0 and r["stock_graph_us"] > 0 and r["ours_eager_us"] > 0
        assert 0 < r["ours_roofline"] < 1.2  # under the copy bandwidth, within timing noise
    big = [r for r in report["rows"] if r["solution"] == "rms_norm_cutile" and r["bytes_moved"] > 4e6]
    assert big and all(r["speedup"] > 1.5 for r in big)  # one launch against LlamaRMSNorm's seven
    assert "| kernel | workloads |" in (tmp_path / "t.md").read_text()
