"""What a new user hits on a CPU machine after the README's commands (issue 18): bad input ends in
one line that names the problem and the fix, the CLI starts fast and its output fits a terminal,
plots say where they came from. CLI items run the installed ``cutile-kernels`` command."""

from __future__ import annotations

import io
import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import cutile_kernels
import cutile_kernels_build.aot as aot
from cutile_kernels_tools import bench, cli, inventory, presets
from cutile_kernels_tools.bench import report

ROOT = Path(__file__).resolve().parents[1]
EXE = str(Path(sys.executable).parent / "cutile-kernels")
H200_REPORT = ROOT / "benchmarks/results/h200-2026-12-01/call4/bench-llama-3.2-1b/bench.json"
LOGGER = "cutile_kernels"


def _run(*args, timeout=300, **kw):
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=timeout, cwd=kw.pop("cwd", ROOT), **kw)


def _one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


@pytest.fixture
def no_toolchain(monkeypatch, tmp_path):
    """As after the README's first command: no tileiras, no build, nothing compiled in this process."""
    monkeypatch.setattr(aot, "toolchain_problem", lambda: f"no cuTile AOT toolchain (tileiras) installed: "
                                                         f"{aot.INSTALL_HINT}")
    monkeypatch.setattr(inventory, "_COMPILED", {})
    monkeypatch.setenv("CUTILE_KERNELS_BUILD_DIR", str(tmp_path / "no-build"))
    yield


@pytest.fixture(scope="module")
def tiny_checkpoint():
    path, _ = presets.resolve("tiny")
    return path


# ---------------------------------------------------------------------------------------------
# 1, 7: without the toolchain: said once, with the project's install command; nothing logged
# ---------------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only behaviour")
def test_score_without_toolchain_is_not_run_exit_3_and_logs_nothing(no_toolchain, tmp_path, capsys):
    root = tmp_path / "inventory"
    for sub in ("definitions", "solutions", "workloads"):
        shutil.copytree(ROOT / "inventory" / sub, root / sub)
    log = tmp_path / "log.tsv"
    rc = cli.main(["autokernelize", "tiny", "--score", "qk_norm_rope", "--root", str(root), "--log", str(log),
                   "--quiet"])
    out = capsys.readouterr().out
    assert rc == 3 and "not_run" in out and "not logged" in out
    assert not log.exists()


def test_validate_without_toolchain_says_it_once(no_toolchain, capsys):
    rc = cli.main(["inventory", "validate"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("tileiras") == 1 and out.count('pip install -e ".[build]"') == 1
    assert "cuda-tile[tileiras]" not in out and "compile not checked for" in out


def test_build_without_toolchain_is_one_line_with_the_install_command(no_toolchain, tmp_path, capsys):
    rc = cli.main(["build", "--arch", "sm_90", "--kernel", "silu", "--out", str(tmp_path / "b"), "--quiet"])
    err = _one_line(capsys.readouterr().err)
    assert rc == 2 and err.startswith("cutile-kernels build: no cuTile AOT toolchain") and '".[build]"' in err
    assert "cutile-kernels[build]" not in err  # not on PyPI: the checkout's extra is the way
    assert not (tmp_path / "b").exists()  # nothing written, not even the directory


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only behaviour")
def test_evaluate_all_without_toolchain_says_it_once(no_toolchain, capsys):
    rc = cli.main(["evaluate", "--all", "--no-write"])
    out = capsys.readouterr().out
    assert rc == 3  # not run: no CUDA, no toolchain
    assert out.count('pip install -e ".[build]"') == 1 and "cuda-tile[tileiras]" not in out
    assert "only the reference checks ran" in out


# ---------------------------------------------------------------------------------------------
# 3: plots
# ---------------------------------------------------------------------------------------------

def _cpu_report():
    r = json.loads(H200_REPORT.read_text())
    r["environment"] = {"device": "cpu", "versions": {"torch": "2.13.0+cpu", "transformers": "5.22.2"}}
    r["cutile_kernels_ran"] = False
    for p in r["paths"].values():
        p["coverage"] = {"by_class": {"gemm": 5000.0, "attention": 900.0, "elementwise / other": 300.0}}
    return r


def test_throughput_plot_starts_at_zero_and_says_where_it_came_from():
    plt, fig, ax = report.throughput_figure(_cpu_report())
    try:
        assert ax.get_ylim()[0] == 0
        text = " ".join(t.get_text() for t in fig.texts)
        assert "CPU, no cuTile kernel ran" in text and "torch 2.13.0+cpu" in text and "transformers 5.22.2" in text
    finally:
        plt.close(fig)
    plt, fig, ax = report.throughput_figure(json.loads(H200_REPORT.read_text()))
    try:
        text = " ".join(t.get_text() for t in fig.texts)
        assert "NVIDIA H200" in text and "cuTile kernels ran" in text and "no cuTile" not in text
    finally:
        plt.close(fig)


def test_breakdown_legend_sits_beside_the_bars():
    plt, fig, ax = report.breakdown_figure(_cpu_report())
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        legend = ax.get_legend().get_window_extent(renderer)
        axes = ax.get_window_extent(renderer)
        assert legend.x0 >= axes.x1  # outside the axes: it covers no bar
        assert any("no cuTile kernel ran" in t.get_text() for t in fig.texts)
    finally:
        plt.close(fig)


# ---------------------------------------------------------------------------------------------
# 4, 5, 6: one line, not a traceback
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def broken_checkpoints(tiny_checkpoint, tmp_path_factory):
    base = tmp_path_factory.mktemp("broken")
    truncated, config_only = base / "truncated", base / "config-only"
    shutil.copytree(tiny_checkpoint, truncated)
    with open(truncated / "model.safetensors", "r+b") as f:
        f.truncate(400_000)
    config_only.mkdir()
    shutil.copy(tiny_checkpoint / "config.json", config_only)
    return truncated, config_only


@pytest.mark.parametrize("command", ["bench", "autokernelize"])
def test_broken_checkpoints_fail_in_one_line(command, broken_checkpoints, tiny_checkpoint, tmp_path):
    bad_config = tmp_path / "bad-config"
    shutil.copytree(tiny_checkpoint, bad_config)
    (bad_config / "config.json").write_text("{bad")
    r = _run(command, str(bad_config))
    line = _one_line(r.stderr)
    assert r.returncode == 2 and "its config.json cannot be used" in line and "fix or replace" in line
    truncated, config_only = broken_checkpoints
    r = _run(command, str(truncated))
    line = _one_line(r.stderr)
    assert r.returncode == 2 and "model.safetensors is truncated" in line and "save it again" in line
    r = _run(command, str(config_only))
    line = _one_line(r.stderr)
    assert r.returncode == 2 and "no weights" in line and "save_pretrained" in line


def test_the_example_says_it_in_one_line_too(broken_checkpoints):
    for path, words in zip(broken_checkpoints, ("is truncated", "no weights")):
        r = subprocess.run([sys.executable, str(ROOT / "examples/quickstart.py"), str(path)], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 2 and words in _one_line(r.stderr)  # bad input: the CLI's exit status


@pytest.mark.parametrize("device", ["gpu", "mps"], ids=["named-gpu", "named-mps"])  # an id "gpu" would read as the marker
def test_bench_unknown_device_is_one_line(device):
    r = _run("bench", "--device", device, timeout=60)
    line = _one_line(r.stderr)
    assert r.returncode == 2 and f"'{device}' is not a device here: use cuda (or cuda:N)" in line


def test_inventory_show_into_head_ends_quietly():
    p = subprocess.Popen([EXE, "inventory", "show", "rms_norm"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         cwd=ROOT)
    p.stdout.close()  # the reader is gone before the first write, as when `| head` has had its lines
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141  # SIGPIPE's exit status, as Unix tools end
    assert "Traceback" not in err and "BrokenPipe" not in err


# ---------------------------------------------------------------------------------------------
# 8, 9: start-up time and the terminal table
# ---------------------------------------------------------------------------------------------

def test_help_is_fast_and_imports_neither_torch_nor_transformers():
    code = ("import sys\nfrom cutile_kernels_tools import cli\n"
            "for argv in (['--help'], ['bench', '--help'], ['build', '--help'], ['inventory', '--help']):\n"
            "    try:\n        cli.main(argv)\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'cutile_kernels') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip().splitlines()[-1] == "[]"
    t0 = time.perf_counter()
    r = _run("--help", timeout=60)
    assert r.returncode == 0 and "bench" in r.stdout
    assert time.perf_counter() - t0 < 1.0


def test_default_arch_help_is_the_build_matrix_default():
    from cutile_kernels.kernel_src._spec import DEFAULT_ARCHS

    assert cli.DEFAULT_ARCHS_HELP == " ".join(DEFAULT_ARCHS)
    from cutile_kernels_tools import presets

    assert cli.PRESETS_HELP == ", ".join(presets.PRESETS)


def test_bench_table_fits_100_columns():
    # The H200 report, plus what autokernelize --score runs: long path names, three batch sizes.
    import copy

    from rich.console import Console

    r = json.loads(H200_REPORT.read_text())
    for name in ("cutile~decoder_add_rms_norm", "cutile+rope_cos_sin"):
        r["paths"][name] = copy.deepcopy(r["paths"]["cutile"])
    for p in r["paths"].values():
        p["decode"].insert(1, dict(p["decode"][0], batch=4, tokens_per_s=12345.6))
        p["coverage"] = {"ours_time_share": 0.123, "ours_launch_share": 0.456}
        # the decode check's worst batch size (reports since 2026-12-06)
        p["decode_correctness"] = {b: dict(p["correctness"], rel_l2_err=e)
                                   for b, e in (("1", 2.954e-2), ("4", 3.125e-2), ("16", 2.92e-2))}
    buf = io.StringIO()
    bench.print_report(r, console=Console(file=buf, width=100))
    out = buf.getvalue()
    assert max(len(line) for line in out.splitlines()) <= 100 and "…" not in out
    for name in r["paths"]:  # every path and figure whole
        assert name in out
    assert "564.7" in out and "7595.1" in out and "12345.6" in out and "2.745e-02" in out
    assert "decode" in out and "3.12e-02" in out and "2.95e-02" not in out
    assert "12.3%/45.6%" in out and out.count("12.3%/45.6%") == 4  # ours only; stock's share is "-"
    buf = io.StringIO()
    bench.print_report(json.loads(H200_REPORT.read_text()), wide=True, console=Console(file=buf, width=200))
    assert "decode % roof" in buf.getvalue() and "…" not in buf.getvalue()


def test_a_run_without_stock_says_nothing_was_gated(tmp_path):
    r = _run("bench", "--paths", "cutile", "--decode-steps", "2", "--repeats", "1", "--rounds", "1",
             "--decode-batch", "1", "--no-coverage", "--quiet", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    said = " ".join(r.stdout.split())  # rich wraps long lines
    assert "nothing was gated: the gates compare each path with stock eager (add stock to --paths)" in said
    assert json.loads((tmp_path / "bench.json").read_text())["ungated"].startswith("nothing was gated")


def test_a_run_where_no_path_can_run_exits_3(tmp_path):
    # On a CPU the compiled paths are skipped: nothing is measured, which is no success.
    r = _run("bench", "--paths", "stock-compile", "cutile-compile~RMSNorm", "--quiet", "--no-coverage",
             "--out", str(tmp_path))
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "no path ran" in r.stderr and "skipped stock-compile" in " ".join(r.stdout.split())


def test_bad_out_dir_fails_before_the_run():
    t0 = time.perf_counter()
    r = _run("bench", "--out", "/etc/passwd/x", timeout=120)
    line = _one_line(r.stderr)
    assert r.returncode == 2 and "--out /etc/passwd/x: cannot create it" in line
    assert time.perf_counter() - t0 < 20  # refused up front, not after the bench


def test_cuda_device_without_gpu_names_it_and_the_fix():
    if torch.cuda.is_available():
        pytest.skip("the CPU-only behaviour")
    r = _run("bench", "--device", "cuda:1", timeout=60)
    line = _one_line(r.stderr)
    assert r.returncode == 2 and "--device cuda:1, but torch sees no CUDA device here: run with --device cpu" in line


# ---------------------------------------------------------------------------------------------
# 10: what kernelizing did, once, at INFO; no per-module warnings from kernels
# ---------------------------------------------------------------------------------------------

def _load_logged(caplog, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    with caplog.at_level(logging.INFO):
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, use_kernels=True,
                                                     kernel_config=cutile_kernels.kernel_config())
    return model


def test_from_pretrained_on_cpu_says_once_why_nothing_changed(caplog, tiny_checkpoint):
    _load_logged(caplog, tiny_checkpoint)
    assert not [r for r in caplog.records if "No kernel mapping found" in r.getMessage()]
    ours = [r for r in caplog.records if r.name == LOGGER]
    assert len(ours) == 1 and ours[0].levelno == logging.INFO
    assert "nothing kernelized: the model is on cpu and our kernels run on CUDA GPUs" in ours[0].getMessage()


def test_kernels_own_warning_stays_outside_our_kernelization(caplog, tiny_checkpoint):
    import kernels
    from transformers import AutoModelForCausalLM

    _load_logged(caplog, tiny_checkpoint)  # installs our filter on kernels' logger
    caplog.clear()
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    with caplog.at_level(logging.WARNING), kernels.use_kernel_mapping({}, inherit_mapping=False):
        kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu", use_fallback=True)
    assert [r for r in caplog.records if "No kernel mapping found for layer `RMSNorm`" in r.getMessage()]


def test_kernelize_on_cpu_says_once_why_nothing_changed(caplog, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        cutile_kernels.kernelize(model)
    ours = [r for r in caplog.records if r.name == LOGGER]
    assert len(ours) == 1 and ours[0].levelno == logging.INFO
    assert "kernelize changed nothing: the model is on cpu" in ours[0].getMessage()


def test_from_pretrained_on_cuda_lists_what_is_ours_and_warns_for_nothing(caplog, tiny_checkpoint, monkeypatch,
                                                                          built_package_dir):
    import transformers.utils.kernel_config as kc

    monkeypatch.setattr(kc, "infer_device", lambda model: "cuda")
    _load_logged(caplog, tiny_checkpoint)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    said = [r.getMessage() for r in caplog.records if r.name == LOGGER and "kernelizes" in r.getMessage()]
    assert said == ["cutile_kernels: from_pretrained kernelizes RMSNorm, rotary_pos_emb with our layers; "
                    "left stock (no layer of ours for them): SiLU"]


# ---------------------------------------------------------------------------------------------
# 11: build progress, profiler noise, info
# ---------------------------------------------------------------------------------------------

def test_quiet_build_keeps_a_progress_line_naming_the_destination(tmp_path, capsys):
    if aot.toolchain_problem():
        pytest.skip("needs the build extra (tileiras)")
    out = tmp_path / "b"
    assert cli.main(["build", "--quiet", "--arch", "sm_90", "--kernel", "silu", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    variant = out / "torch-cuda"
    assert f"cuTile AOT -> {variant}" in captured.err and "100%" in captured.err
    assert captured.out.strip().endswith(f"-> {variant}")


def test_autokernelize_output_carries_no_profiler_lines():
    r = _run("autokernelize", "tiny", "--top", "3")
    assert r.returncode == 0, r.stderr
    assert "USDT" not in r.stderr and "USDT" not in r.stdout


def test_info_says_jit_needs_a_gpu(capsys):
    assert cli.main(["info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["cuda_available"] == torch.cuda.is_available()
    assert info["jit_available"] == (torch.cuda.is_available() and info["jit_toolchain"])
    import importlib.metadata

    assert info["installed_cuda_tile"] == importlib.metadata.version("cuda-tile")
    # what compiled the build found, or None without one (not a dict of nulls beside an installed toolchain)
    assert (info["build_toolchain"] is None) == (info["build"] is None)
    if info["build"] is not None:
        assert set(info["build_toolchain"]) == {"cuda_tile", "tileiras"}


def test_patch_after_a_use_kernels_load_applies(tiny_checkpoint):
    # kernels' fallback binds the stock forward on each norm instance: still a Llama-formula norm.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, use_kernels=True,
                                                 kernel_config=cutile_kernels.kernel_config())
    assert any("forward" in m.__dict__ for m in model.modules() if type(m).__name__ == "LlamaRMSNorm")
    report = cutile_kernels.patch(model)
    assert report.changed["decoder_add_rms_norm"] == model.config.num_hidden_layers


# ---------------------------------------------------------------------------------------------
# 12: where a preset went
# ---------------------------------------------------------------------------------------------

def test_preset_out_refuses_to_replace_another_preset(tmp_path, tiny_checkpoint):
    out = tmp_path / "mine"
    shutil.copytree(tiny_checkpoint, out)
    with pytest.raises(FileExistsError, match=r"holds preset tiny \(seed 0\): refusing to replace it"):
        presets.materialize("qwen3-0.6b", out_dir=out)
    assert presets.materialize("tiny", out_dir=out) == out  # the same one: reused

def test_a_new_preset_says_where_it_is_and_how_to_remove_it(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv(presets.ENV_CACHE, str(tmp_path / "presets"))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        path = presets.materialize("tiny")
        presets.materialize("tiny")  # reused: said once, when written
    said = [r.getMessage() for r in caplog.records if "wrote preset" in r.getMessage()]
    assert len(said) == 1 and str(path) in said[0] and f"rm -r {path}" in said[0] and presets.ENV_CACHE in said[0]
    assert path.parent == tmp_path / "presets" and (path / "model.safetensors").is_file()


# ---------------------------------------------------------------------------------------------
# The README's counts follow the code (a new user found two stale ones)

def test_verbose_is_taken_before_or_after_the_command(capsys):
    # -v makes a usage error raise with its traceback; without it, one line and exit 2.
    assert cli.main(["inventory", "show", "no_such_kernel"]) == 2
    assert "no Definition or Solution named" in capsys.readouterr().err
    for argv in (["-v", "inventory", "show", "no_such_kernel"], ["inventory", "show", "no_such_kernel", "-v"],
                 ["inventory", "--verbose", "show", "no_such_kernel"]):
        with pytest.raises(KeyError):
            cli.main(argv)


@pytest.mark.parametrize("command", [["preset", "tiny", "--seed", "-1"], ["bench", "--seed", "-3"]])
def test_a_negative_seed_is_a_usage_error(command, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(command)
    assert info.value.code == 2 and "must be at least 0" in capsys.readouterr().err


def test_readme_counts_the_variants_and_pins_the_code_has():
    import re

    import cutile_kernels.layers  # noqa: F401  (the family modules register their pins on import)
    from cutile_kernels import kernel_src
    from cutile_kernels.kernel_src._spec import DEFAULT_ARCHS
    from cutile_kernels.layers import _pins

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    per_arch = len(kernel_src.all_variants())
    m = re.search(r"compiles all (\d+) kernel variants \((\d+) for each of (\w+) archs\)", readme)
    assert m, "the README's build sentence changed: update this test"
    assert (int(m[1]), int(m[2]), m[3]) == (per_arch * len(DEFAULT_ARCHS), per_arch, "four"), m[0]
    assert len(DEFAULT_ARCHS) == 4
    m = re.search(r"\((\d+) pins today\)", readme)
    assert m and int(m[1]) == len(_pins.PINS), (m and m[0], len(_pins.PINS))
