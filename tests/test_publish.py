"""Publishing to the Hugging Face Hub and loading back, offline: ``build.toml`` as kernels parses it,
the dry run's staging (exactly the files of each revision), the Hub calls a real publish makes
(against a recording fake of ``HfApi``), the generated card, and the staged build loaded through
``kernels``' own Hub resolution (``get_kernel``, ``LayerRepository``, transformers' ``KernelConfig``)
from a Hub cache laid out as a download would leave it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

import cutile_kernels_build as builder
from cutile_kernels_tools import card, publish
from cutile_kernels_tools.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]
KID = "_cutile_kernels_cuda_0123456789"


def _fake_build(build: Path, version: int = 1, kid: str = KID) -> Path:
    """A small build in the layout ``cutile-kernels build`` writes (two cubins, no real code), plus
    what must not be uploaded: bytecode and the builder's staging directory."""
    variant = build / "torch-cuda"
    pkg = variant / "cutile_kernels"
    for sub in ("cubins/sm_90", "cubins/sm_100", "layers", "ops", "__pycache__"):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text('"""fake"""\n')
    (pkg / "_ops.py").write_text(f"NAMESPACE = {kid!r}\n")
    (pkg / "layers" / "__init__.py").write_text("")
    (pkg / "layers" / "norm.py").write_text('MAPPING = {"RMSNorm": "CutileRMSNorm"}\n')
    (pkg / "ops" / "__init__.py").write_text('__all__ = ["rms_norm", "rms_norm_reference"]\n')
    (pkg / "__pycache__" / "registry.cpython-311.pyc").write_bytes(b"bytecode")
    entries = []
    for arch, size in (("sm_90", 100), ("sm_100", 60)):
        cubin = f"cubins/{arch}/rms_norm_kernel_x.cubin"
        (pkg / cubin).write_bytes(b"\x7fELF" + bytes(range(size)))
        entries.append({"kernel": "rms_norm", "variant": "bf16.n64.r128.aligned", "arch": arch, "cubin": cubin,
                        "cubin_bytes": size + 4, "params": [{"kind": "array", "dtype": "bfloat16"}]})
    (pkg / "manifest.json").write_text(json.dumps({"format": 1, "package": "cutile_kernels", "archs": ["sm_90", "sm_100"],
                                                   "cuda_tile": "1.7.0", "tileiras": "13.4.92", "variants": entries}))
    (variant / "metadata.json").write_text(json.dumps({
        "name": "cutile-kernels", "id": kid, "version": version, "license": "Apache-2.0", "python-depends": [],
        "backend": {"type": "cuda", "archs": ["9.0a", "10.0a"]}}))
    staging = build / ".torch-cuda.staging"
    staging.mkdir(exist_ok=True)
    (staging / "metadata.json").write_text("{}")
    return build


@pytest.fixture
def fake_build(tmp_path):
    return _fake_build(tmp_path / "build")


def _stage(fake_build, out, **kw):
    kw.setdefault("inventory_dir", fake_build.parent / "no-inventory")
    kw.setdefault("bench_files", [])
    return publish.stage("acme/cutile-kernels", build_dir=fake_build, out_dir=out, **kw)


# ---------------------------------------------------------------------------------------------
# build.toml
# ---------------------------------------------------------------------------------------------

def _build_toml() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:
        import tomlkit as tomllib
    return tomllib.loads((ROOT / "build.toml").read_text())


def test_build_toml_is_what_kernels_parses_and_matches_the_builder():
    from kernels._rust import Backend, Build

    parsed = Build.open(ROOT)  # kernels' own (Rust) parser for kernel-builder's build.toml, edition 5
    assert parsed.general.backends == [Backend.CUDA]
    general = _build_toml()["general"]
    assert general["edition"] == 5
    assert general["name"] == builder.DIST_NAME and general["version"] == builder.KERNEL_VERSION
    assert general["python-depends"] == []
    assert set(_build_toml()) == {"general", "torch-noarch"}  # a noarch (Python-only) kernel
    assert {"py", "json", "cubin"} <= set(_build_toml()["torch-noarch"]["pyext"])
    from cutile_kernels.kernel_src._spec import DEFAULT_ARCHS

    assert _build_toml()["torch-noarch"]["cuda_capabilities"] == [builder._ARCH_CAPABILITY[a] for a in DEFAULT_ARCHS]
    assert publish.default_repo_id(ROOT) == general["hub"]["repo-id"]


def test_build_metadata_agrees_with_build_toml(built_package_dir):
    meta = json.loads((built_package_dir.parent / "metadata.json").read_text())
    general = _build_toml()["general"]
    assert (meta["name"], meta["version"], meta["license"]) == (general["name"], general["version"], general["license"])
    assert meta["backend"]["type"] == "cuda" and built_package_dir.parent.name == "torch-cuda"


# ---------------------------------------------------------------------------------------------
# Staging (what a dry run writes and lists)
# ---------------------------------------------------------------------------------------------

def test_stage_writes_exactly_the_upload(fake_build, tmp_path):
    out = tmp_path / "out"
    plan = _stage(fake_build, out)
    assert (plan.repo_id, plan.version, plan.branch, plan.kernel_id) == ("acme/cutile-kernels", 1, "v1", KID)
    assert plan.revisions == ["main", "v1"] and plan.variants == ["torch-cuda"]
    pkg = "build/torch-cuda/cutile_kernels"
    want = {("main", "README.md"), ("v1", "build/torch-cuda/metadata.json"),
            *{("v1", f"{pkg}/{p}") for p in ("__init__.py", "_ops.py", "manifest.json", "layers/__init__.py",
                                             "layers/norm.py", "ops/__init__.py",
                                             "cubins/sm_90/rms_norm_kernel_x.cubin",
                                             "cubins/sm_100/rms_norm_kernel_x.cubin")}}
    assert {(f.revision, f.path_in_repo) for f in plan.files} == want  # no bytecode, no builder staging
    # On disk: exactly the listed files, each where its revision and path say, plus the list itself.
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert on_disk == {f"{r}/{p}" for r, p in want} | {publish.PLAN_FILE}
    for f in plan.files:
        assert f.local == out / f.revision / f.path_in_repo
        data = f.local.read_bytes()
        assert f.size == len(data) and f.sha256 == hashlib.sha256(data).hexdigest()
        if f.revision == "v1":  # the build, byte for byte
            assert data == (fake_build / f.path_in_repo.removeprefix("build/")).read_bytes()
    listed = json.loads((out / publish.PLAN_FILE).read_text())
    assert listed == plan.to_json() and listed["repo_type"] == "kernel"
    assert sum(e["bytes"] for r in listed["revisions"].values() for e in r) == plan.total_bytes
    readme = (out / "main" / "README.md").read_text()
    assert readme.startswith("---\nlibrary_name: kernels\nlicense: apache-2.0\n")
    assert 'get_kernel("acme/cutile-kernels", version=1' in readme


def test_stage_replaces_an_earlier_staging_but_nothing_else(fake_build, tmp_path):
    out = tmp_path / "out"
    _stage(fake_build, out)
    (out / "v1" / "leftover").write_text("from an earlier run")
    plan = _stage(fake_build, out)
    assert not (out / "v1" / "leftover").exists() and len(plan.files) == 10
    other = tmp_path / "precious"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    with pytest.raises(publish.PublishError, match="not empty"):
        _stage(fake_build, other)
    assert (other / "notes.txt").read_text() == "keep"


def test_stage_default_out_is_a_new_temporary_directory(fake_build):
    plan = _stage(fake_build, None)
    try:
        assert plan.out_dir.is_dir() and (plan.out_dir / publish.PLAN_FILE).is_file()
        assert Path(plan.out_dir).name.startswith("cutile-kernels-publish-")
    finally:
        shutil.rmtree(plan.out_dir)


@pytest.mark.parametrize("repo_id", ["acme", "acme/", "/ck", "a/b/c", "ac me/ck", "acme/c..k", "", "acme/ck!"])
def test_bad_repo_ids(fake_build, tmp_path, repo_id):
    with pytest.raises(publish.PublishError, match="ORG/NAME"):
        publish.stage(repo_id, build_dir=fake_build, out_dir=tmp_path / "out", bench_files=[])
    assert not (tmp_path / "out").exists()


def _break_metadata(b):
    meta = json.loads((b / "torch-cuda/metadata.json").read_text())
    meta["backend"]["type"] = "universal"  # kernels 0.17 refuses it
    (b / "torch-cuda/metadata.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("breakage, message", [
    (lambda b: shutil.rmtree(b / "torch-cuda"), "no build variant"),
    (_break_metadata, "kernels cannot parse"),
    (lambda b: (b / "torch-cuda/cutile_kernels/cubins/sm_100/rms_norm_kernel_x.cubin").unlink(), "1 cubins that are missing"),
    (lambda b: (b / "torch-cuda/cutile_kernels/manifest.json").unlink(), "manifest.json is missing"),
    (lambda b: (b / "torch-cuda/cutile_kernels/_ops.py").write_text("NAMESPACE = 'other'\n"), "does not declare the namespace"),
    (lambda b: (b / "torch-cuda/cutile_kernels/__init__.py").unlink(), "kernels imports the variant"),
    (lambda b: _fake_build(b.parent / "b2", version=2).joinpath("torch-cuda").rename(b / "torch-cpu"), "several versions"),
], ids=["no-variant", "metadata", "cubin", "manifest", "namespace", "package", "versions"])
def test_stage_refuses_broken_builds(fake_build, tmp_path, breakage, message):
    breakage(fake_build)
    with pytest.raises(publish.PublishError, match=message):
        _stage(fake_build, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# The CLI
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def no_network(monkeypatch):
    """Any Hub client construction fails the test (a dry run must not touch the network)."""
    import huggingface_hub

    def refuse(*a, **k):
        raise AssertionError("a dry run created a Hub client")

    monkeypatch.setattr(huggingface_hub.HfApi, "__init__", refuse)
    monkeypatch.setattr(publish, "upload", refuse)


def test_cli_dry_run_summarizes_by_folder_and_the_plan_lists_every_file(fake_build, tmp_path, capsys, no_network):
    # A real build is thousands of cubins: the output gives each folder's count and size, upload.json each file.
    out = tmp_path / "out"
    rc = cli(["publish", "--repo-id", "acme/cutile-kernels", "--dry-run", "--out", str(out), "--build", str(fake_build),
              "--inventory", str(tmp_path / "none")])
    assert rc == 0
    text = capsys.readouterr().out
    plan = json.loads((out / publish.PLAN_FILE).read_text())
    for revision, files in plan["revisions"].items():
        assert f"{revision}: {len(files)} files, " in text
        folders = {}
        for f in files:
            assert f"  {f['path']}  " not in text  # no line per file
            folders.setdefault(str(Path(f["path"]).parent), []).append(f["bytes"])
        for folder, sizes in folders.items():
            assert f"  {folder}/  {len(sizes)} files, {publish.human_bytes(sum(sizes))}\n" in text
    v1 = {f["path"]: f["bytes"] for f in plan["revisions"]["v1"]}
    assert v1["build/torch-cuda/cutile_kernels/cubins/sm_90/rms_norm_kernel_x.cubin"] == 104
    assert "dry run: nothing uploaded; 10 files" in text and "kernel repo acme/cutile-kernels" in text
    assert len(text.splitlines()) < 15


def test_cli_dry_run_default_repo_id_comes_from_build_toml(fake_build, tmp_path, capsys, no_network):
    rc = cli(["publish", "--dry-run", "--out", str(tmp_path / "out"), "--build", str(fake_build)])
    assert rc == 0
    repo_id = _build_toml()["general"]["hub"]["repo-id"]
    assert f"kernel repo {repo_id} staged" in capsys.readouterr().out
    assert f'get_kernel("{repo_id}"' in (tmp_path / "out" / "main" / "README.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--repo-id", "not-a-repo-id"], "repo id must be ORG/NAME"),
    (["--repo-id", "acme/ck", "--build", "/nonexistent/build"], "no build variant under /nonexistent/build"),
    (["--repo-id", "acme/ck", "--bench", "/nonexistent/bench.json"], "cannot read /nonexistent/bench.json"),
])
def test_cli_errors_exit_2_without_traceback(fake_build, tmp_path, capsys, no_network, args, message):
    if "--build" not in args:
        args = [*args, "--build", str(fake_build)]
    rc = cli(["publish", "--dry-run", "--out", str(tmp_path / "out"), *args])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("cutile-kernels publish: ") and message in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# A real publish, against a recording HfApi
# ---------------------------------------------------------------------------------------------

class RecordingApi:
    """Records the calls a publish makes; the repository starts with ``branches`` and the version
    branch holds ``existing`` files."""

    def __init__(self, branches=("main",), existing=(), fail_on=None):
        self.branches, self.existing, self.fail_on = list(branches), list(existing), fail_on
        self.calls, self.urls = [], []

    def _call(self, name, **kw):
        self.calls.append((name, kw))
        if name == self.fail_on:
            raise OSError(f"403 Forbidden ({name})")

    def whoami(self):
        self._call("whoami")
        return {"name": "tester"}

    def create_repo(self, repo_id, **kw):
        self._call("create_repo", repo_id=repo_id, **kw)
        from huggingface_hub import RepoUrl

        return RepoUrl(f"https://huggingface.co/kernels/{repo_id}")

    def list_repo_refs(self, repo_id, **kw):
        self._call("list_repo_refs", repo_id=repo_id, **kw)
        return SimpleNamespace(branches=[SimpleNamespace(name=b) for b in self.branches])

    def create_branch(self, repo_id, **kw):
        self._call("create_branch", repo_id=repo_id, **kw)
        self.branches.append(kw["branch"])

    def list_repo_files(self, repo_id, **kw):
        self._call("list_repo_files", repo_id=repo_id, **kw)
        return list(self.existing)

    def create_commit(self, repo_id, operations, **kw):
        self._call("create_commit", repo_id=repo_id, operations=list(operations), **kw)
        self.urls.append(f"https://huggingface.co/kernels/{repo_id}/commit/{len(self.urls):040x}")
        return SimpleNamespace(commit_url=self.urls[-1])

    def commits(self):
        return [kw for name, kw in self.calls if name == "create_commit"]


EXISTING = [".gitattributes", "README.md", "build/torch-universal/old.py", "build/torch-cuda/cutile_kernels/stale.py",
            "build/torch-cuda/metadata.json", "benchmarks/benchmark.py"]


def _ops_summary(commit):
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    adds = {op.path_in_repo: op.path_or_fileobj for op in commit["operations"] if isinstance(op, CommitOperationAdd)}
    deletes = {op.path_in_repo for op in commit["operations"] if isinstance(op, CommitOperationDelete)}
    return adds, deletes


@pytest.mark.parametrize("new_branch", [True, False], ids=["new-branch", "existing-branch"])
def test_upload_makes_the_kernel_builder_calls(fake_build, tmp_path, new_branch):
    plan = _stage(fake_build, tmp_path / "out")
    api = RecordingApi(branches=("main",) if new_branch else ("main", "v1"), existing=EXISTING)
    commits = publish.upload(plan, api=api, private=True)
    names = [n for n, _ in api.calls]
    assert names[:3] == ["whoami", "create_repo", "list_repo_refs"]
    assert api.calls[1][1] == {"repo_id": "acme/cutile-kernels", "repo_type": "kernel", "private": True, "exist_ok": True}
    assert ("create_branch" in names) is new_branch
    if new_branch:
        assert dict(api.calls[names.index("create_branch")][1]) == {"repo_id": "acme/cutile-kernels", "branch": "v1",
                                                                  "repo_type": "kernel"}
    assert all(kw.get("repo_type") == "kernel" for n, kw in api.calls if n != "whoami")
    main, v1 = api.commits()
    assert (main["revision"], v1["revision"]) == ("main", "v1")
    adds, deletes = _ops_summary(main)
    assert adds == {"README.md": str(plan.out_dir / "main" / "README.md")} and not deletes
    adds, deletes = _ops_summary(v1)
    assert adds == {f.path_in_repo: str(f.local) for f in plan.revision_files("v1")}
    # A new branch keeps nothing of an older build; an existing one loses only the uploaded
    # variant's stale files. Files outside build/ are never touched.
    stale = {"build/torch-cuda/cutile_kernels/stale.py"}
    assert deletes == (stale | {"build/torch-universal/old.py"} if new_branch else stale)
    assert commits == {"main": [api.urls[0]], "v1": [api.urls[1]]}


def test_upload_batches_large_commits(fake_build, tmp_path, monkeypatch):
    monkeypatch.setattr(publish, "COMMIT_BATCH", 3)
    plan = _stage(fake_build, tmp_path / "out")
    api = RecordingApi()
    commits = publish.upload(plan, api=api)
    v1 = [c for c in api.commits() if c["revision"] == "v1"]
    assert [len(c["operations"]) for c in v1] == [3, 3, 3] and len(commits["v1"]) == 3
    assert [c["commit_message"][-5:] for c in v1] == ["(1/3)", "(2/3)", "(3/3)"]
    uploaded = [op.path_in_repo for c in v1 for op in c["operations"]]
    assert sorted(uploaded) == sorted(f.path_in_repo for f in plan.revision_files("v1"))


@pytest.mark.parametrize("fail_on, message", [("whoami", "HF_TOKEN"), ("create_repo", "refused"),
                                              ("create_commit", "403 Forbidden")])
def test_upload_errors_are_publish_errors(fake_build, tmp_path, fail_on, message):
    plan = _stage(fake_build, tmp_path / "out")
    api = RecordingApi(fail_on=fail_on)
    with pytest.raises(publish.PublishError, match=message):
        publish.upload(plan, api=api)
    if fail_on == "whoami":
        assert [n for n, _ in api.calls] == ["whoami"]  # nothing is created without a token


def test_real_publish_stages_in_a_temporary_directory_and_removes_it(fake_build, monkeypatch):
    api = RecordingApi()
    plan, commits = publish.publish("acme/cutile-kernels", dry_run=False, build_dir=fake_build,
                                    inventory_dir=fake_build / "none", bench_files=[], api=api)
    assert set(commits) == {"main", "v1"} and len(api.commits()) == 2
    assert not plan.out_dir.exists()


# ---------------------------------------------------------------------------------------------
# The card
# ---------------------------------------------------------------------------------------------

def _trace(solution, status, hw="NVIDIA_H200", speedup=None, abs_err=1e-3, rel_err=2e-3, n=4096):
    ev = {"status": status, "environment": {"hardware": hw, "libs": {"torch": "2.11.0", "cuda-tile": "1.7.0"}},
          "timestamp": "2026-12-01T10:00:00"}
    if status in ("PASSED", "INCORRECT_NUMERICAL"):
        ev["correctness"] = {"max_absolute_error": abs_err, "max_relative_error": rel_err}
    if status == "PASSED":
        ev["performance"] = {"latency_ms": 0.01, "reference_latency_ms": 0.01 * speedup, "speedup_factor": speedup}
    return {"definition": "rms_norm", "workload": {"axes": {"m": n}, "inputs": {}, "uuid": f"w{n}"},
            "solution": solution, "evaluation": ev}


@pytest.fixture
def inventory(tmp_path):
    inv = tmp_path / "checkout" / "inventory"
    for kind, name, obj in (
        ("definitions", "rms_norm", {"name": "rms_norm", "op_type": "rmsnorm", "description": "RMSNorm | LlamaRMSNorm order",
                                     "axes": {}, "inputs": {}, "outputs": {}, "reference": "def run(): pass"}),
        ("solutions", "rms_norm_cutile", {"name": "rms_norm_cutile", "definition": "rms_norm",
                                          "spec": {"language": "cuda-tile", "target_hardware": ["sm_90", "sm_100"],
                                                   "entry_point": "kernel_src/norm.py::rms_norm_kernel"}}),
    ):
        path = inv / kind / "norm" / f"{name}.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(obj))
    traces = [_trace("rms_norm_cutile", "PASSED", speedup=s, abs_err=e, n=i)
              for i, (s, e) in enumerate([(1.5, 1e-3), (3.0, 4e-3), (2.0, 2e-3)])]
    traces += [_trace("rms_norm_cutile", "INCORRECT_NUMERICAL", abs_err=0.5, rel_err=0.25),
               {"definition": "rms_norm", "workload": {"axes": {"m": 7}, "inputs": {}, "uuid": "w"}},  # workload only
               _trace("rms_norm_cutile", "RUNTIME_ERROR", hw="NVIDIA_B200")]
    (inv / "traces" / "norm").mkdir(parents=True)
    (inv / "traces" / "norm" / "rms_norm.jsonl").write_text("\n".join(json.dumps(t) for t in traces) + "\n")
    return inv


def _bench_report(device="cuda", stock_ms=10.0, ours_ms=8.0, schema=2, model="llama-3.2-1b (config of x, seed 0)"):
    def path(ms, tok):
        return {"ok": True, "prefill_ms": {"median": ms, "min": ms, "max": ms, "n": 5},
                "decode": [{"batch": 1, "tokens_per_s": tok[0]}, {"batch": 16, "tokens_per_s": tok[1]}]}

    gate = {"passed": True, "checks": []}
    return {"schema": f"cutile-kernels/bench/{schema}", "model": model,
            "environment": {"device": device, "gpu": "NVIDIA H200" if device == "cuda" else None, "capability": "9.0",
                            "versions": {"torch": "2.11.0", "transformers": "5.22.2", "liger-kernel": None}},
            "settings": {"prefill_len": 2048, "dtype": "bfloat16"},
            "paths": {"stock": path(stock_ms, (100.0, 1000.0)), "cutile": path(ours_ms, (120.0, 1500.0))},
            "gate": gate if schema == 1 else {"cutile": gate}}


def _write(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))
    return path


def test_inventory_summary_statistics(inventory):
    inv = card.inventory_summary(inventory)
    assert [d["name"] for d in inv["definitions"]] == ["rms_norm"]
    assert inv["solutions"][0]["target_hardware"] == ["sm_90", "sm_100"]
    h200, b200 = sorted(inv["perf"], key=lambda r: r["hardware"] != "NVIDIA_H200")
    assert (h200["workloads"], h200["passed"], h200["other_statuses"]) == (4, 3, {"INCORRECT_NUMERICAL": 1})
    assert (h200["speedup_median"], h200["speedup_min"], h200["speedup_max"]) == (2.0, 1.5, 3.0)
    assert h200["max_abs_err"] == 0.5 and h200["max_rel_err"] == 0.25  # the failed workload's error counts
    assert h200["latency_ms_median"] == pytest.approx(0.01) and h200["reference_latency_ms_median"] == pytest.approx(0.02)
    assert h200["libs"] == {"cuda-tile": ["1.7.0"], "torch": ["2.11.0"]}
    assert (b200["passed"], b200["speedup_median"], b200["max_abs_err"]) == (0, None, None)
    assert card.inventory_summary(inventory.parent / "absent") is None


def test_bench_summary_both_schemas(tmp_path):
    for schema in (1, 2):
        b = card.bench_summary(_write(tmp_path / f"s{schema}.json", _bench_report(schema=schema)))
        stock, ours = b["rows"]
        assert (stock["path"], stock["prefill_speedup"], stock["decode_speedup"], stock["gate"]) == ("stock", None, {}, None)
        assert ours["prefill_speedup"] == pytest.approx(1.25) and ours["gate"] is True
        assert ours["decode_speedup"] == {1: pytest.approx(1.2), 16: pytest.approx(1.5)}
        assert b["gpu"] == "NVIDIA H200" and b["versions"] == {"torch": "2.11.0", "transformers": "5.22.2"}
    with pytest.raises(card.CardError, match="not a cutile-kernels bench report"):
        card.bench_summary(_write(tmp_path / "other.json", {"schema": "something/else"}))


def test_find_bench_reports_takes_the_newest_gpu_report_per_model(tmp_path):
    results = tmp_path / "results"
    _write(results / "h200-2026-11-30" / "llama" / "bench.json", _bench_report(ours_ms=9.0))
    newest = _write(results / "h200-2026-12-02" / "llama" / "bench.json", _bench_report(ours_ms=7.0))
    qwen = _write(results / "h200-2026-11-30" / "qwen" / "bench.json", _bench_report(model="qwen3-0.6b"))
    _write(results / "h200-2026-12-03" / "cpu" / "bench.json", _bench_report(device="cpu"))  # not a GPU run
    _write(results / "h200-2026-12-03" / "x" / "bench.json", {"schema": "other"})
    (results / "h200-2026-12-03" / "y").mkdir()
    (results / "h200-2026-12-03" / "y" / "bench.json").write_text("{not json")
    assert card.find_bench_reports(results) == sorted([newest, qwen])
    assert card.find_bench_reports(tmp_path / "absent") == []


def test_card_names_every_source(fake_build, inventory, tmp_path):
    root = inventory.parent
    bench_file = _write(root / "benchmarks" / "results" / "h200-2026-12-02" / "llama" / "bench.json", _bench_report())
    text = card.render("acme/cutile-kernels", fake_build / "torch-cuda", inventory_dir=inventory,
                       bench_files=[bench_file], root=root)
    assert text.startswith("---\nlibrary_name: kernels\nlicense: apache-2.0\ntags:\n- kernels\n")
    # Build: counts and archs from the manifest, named by its path on the version branch.
    assert "From `build/torch-cuda/cutile_kernels/manifest.json` and `metadata.json` on branch `v1`: 2 cubins (168 B) " \
           "for sm_90, sm_100 (CUDA capabilities 9.0a, 10.0a), compiled by tileiras 13.4.92 from cuda-tile 1.7.0" in text
    assert "| `rms_norm` | bfloat16 | 1 | sm_90, sm_100 | 168 B |" in text
    # API from the build itself: the reference functions are not advertised.
    assert "- `rms_norm`\n" in text and "rms_norm_reference" not in text
    assert "- `CutileRMSNorm`: replaces transformers' `RMSNorm` hub layer" in text
    assert '"RMSNorm": ("acme/cutile-kernels:CutileRMSNorm", {"version": 1, "trust_remote_code": True}),' in text
    # Inventory: the definition (a '|' in prose escaped), and measured numbers with hardware, libraries and file.
    assert "From the kernel inventory `inventory` (FlashInfer-Bench layout)." in text
    assert "| `rms_norm` | rmsnorm | RMSNorm \\| LlamaRMSNorm order | `rms_norm_cutile` (sm_90, sm_100) |" in text
    assert ("| `rms_norm` | `rms_norm_cutile` | NVIDIA_H200 | 3/4 (1 INCORRECT_NUMERICAL) | 2.00x (1.50-3.00) | "
            "0.01 (0.02) | 0.5 | 0.25 | cuda-tile 1.7.0, torch 2.11.0 | `inventory/traces/norm/rms_norm.jsonl` |") in text
    assert "| NVIDIA_B200 | 0/1 (1 RUNTIME_ERROR) | - |" in text
    # End to end: machine, versions, settings and the report's path; speedups against stock.
    assert ("**llama-3.2-1b (config of x, seed 0)** on NVIDIA H200 (capability 9.0); torch 2.11.0, transformers 5.22.2; "
            "settings: prefill 2048 tokens, bfloat16; build measured: not recorded (reports before the build was "
            "recorded: compare with care). Source: `benchmarks/results/h200-2026-12-02/llama/bench.json` "
            "(schema `cutile-kernels/bench/2`).") in text
    assert "| cutile | 8.00 | 1.25x | 120.0 | 1500.0 | 1.20x | 1.50x | passed |" in text
    assert "| stock | 10.00 | - | 100.0 | 1000.0 | - | - | - |" in text


def test_card_without_inventory_or_bench_says_so(fake_build, tmp_path):
    text = card.render("acme/ck", fake_build / "torch-cuda", inventory_dir=tmp_path / "none", bench_files=[])
    assert "No kernel inventory was found in the source checkout" in text
    assert "No GPU bench report was found in the source checkout" in text
    assert "speedup" not in text.split("## End to end")[1]


# ---------------------------------------------------------------------------------------------
# Loading the staged build back through kernels, offline, as a Hub download would have left it
# ---------------------------------------------------------------------------------------------

LOAD_SCRIPT = textwrap.dedent('''
    import json, sys
    from pathlib import Path

    import torch
    from packaging.version import Version

    import kernels
    import kernels.backends as backends
    import kernels.layer.repos as repos
    import kernels.validate as validate

    # This CPU-only torch reports the cpu backend; a CUDA torch would report this (variant choice
    # and dependency checks read it), and an H200 capability 90 (layer choice).
    cuda = backends.CUDA(version=Version("13.0"))
    backends._backend = validate._backend = lambda: cuda
    repos._find_capability = lambda: 90

    repo_id, branch_dir = sys.argv[1], Path(sys.argv[2])
    meta = json.loads((branch_dir / "build/torch-cuda/metadata.json").read_text())
    out = {}
    mod = kernels.get_kernel(repo_id, version=1)  # refs/v1 -> snapshot -> build/torch-cuda
    out["get_kernel"] = [mod.__name__, mod.__file__]
    x, w = torch.randn(3, 64, dtype=torch.bfloat16), torch.rand(64, dtype=torch.bfloat16)
    out["rms_norm_equal"] = torch.equal(mod.rms_norm(x, w, 1e-6), mod.rms_norm_reference(x, w, 1e-6))
    hub_layer = kernels.LayerRepository(repo_id, layer_name="CutileRMSNorm", version=1).load()
    out["LayerRepository"] = [hub_layer.__module__, hub_layer.__qualname__]
    local = kernels.get_local_kernel(branch_dir)  # the branch's tree: build/ -> torch-cuda
    out["get_local_kernel"] = [local.__name__, local.__file__]
    out["LocalLayerRepository"] = kernels.LocalLayerRepository(branch_dir, layer_name="CutileRMSNorm").load().__module__

    from kernels import Mode
    from transformers import KernelConfig, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        want = model(ids).logits
    mapping = {"RMSNorm": {"cuda": {Mode.INFERENCE: kernels.LayerRepository(repo_id, layer_name="CutileRMSNorm", version=1)}}}
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(model, mode=Mode.INFERENCE, device="cuda")
    out["kernelized"] = sorted({m.forward.__func__.__module__ for m in model.modules()
                                if "forward" in vars(m) and m.forward.__qualname__ == "CutileRMSNorm.forward"})
    out["kernelized_count"] = sum(1 for m in model.modules()
                                  if "forward" in vars(m) and m.forward.__qualname__ == "CutileRMSNorm.forward")
    with torch.no_grad():
        out["logits_equal"] = torch.equal(model(ids).logits, want)  # CPU tensors: the reference path

    # transformers resolves a Hub id in a KernelConfig through the same cache ("org/name:Layer" is version 1).
    import transformers.utils.kernel_config as kc

    kc.infer_device = lambda model: "cuda"
    model.save_pretrained(branch_dir.parent / "llama")
    kcfg = KernelConfig({"RMSNorm": f"{repo_id}:CutileRMSNorm"})
    LlamaForCausalLM.from_pretrained(branch_dir.parent / "llama", use_kernels=True, kernel_config=kcfg)
    out["KernelConfig"] = [repr(mode) + ":" + repo.load().__module__
                           for mode, repo in kcfg.kernel_mapping["RMSNorm"]["cuda"].items()]
    print("RESULT " + json.dumps(out))
''')


def test_staged_build_loads_through_kernels_hub_resolution_offline(built_package_dir, tmp_path):
    """The dry run's version branch, laid out as ``huggingface_hub`` caches a download (a ``refs/v1``
    ref and a snapshot), loads through ``get_kernel(repo_id, version=1)``, ``LayerRepository``,
    transformers' ``KernelConfig`` with the Hub id, and (from the branch's tree) ``get_local_kernel``
    and ``LocalLayerRepository``, with ``HF_HUB_OFFLINE=1``."""
    plan = publish.stage("acme/cutile-kernels", build_dir=built_package_dir.parent.parent, out_dir=tmp_path / "out",
                         inventory_dir=tmp_path / "none", bench_files=[])
    kid = plan.kernel_id
    cache = tmp_path / "hub"
    commit = "0" * 39 + "1"
    repo_cache = cache / "kernels--acme--cutile-kernels"
    shutil.copytree(plan.out_dir / "v1", repo_cache / "snapshots" / commit)
    (repo_cache / "refs").mkdir()
    (repo_cache / "refs" / "v1").write_text(commit)
    snapshot = repo_cache / "snapshots" / commit / "build" / "torch-cuda"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "KERNELS_CACHE": str(cache),
           "HF_HOME": str(tmp_path / "hf-home"), "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, "acme/cutile-kernels", str(plan.out_dir / "v1")],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT "):])
    assert out["get_kernel"] == [kid, str(snapshot / "cutile_kernels" / "__init__.py")]
    assert out["rms_norm_equal"] is True
    assert out["LayerRepository"] == [f"{kid}.layers.norm", "CutileRMSNorm"]
    assert out["get_local_kernel"] == [kid, str(plan.out_dir / "v1" / "build" / "torch-cuda" / "cutile_kernels" / "__init__.py")]
    assert out["LocalLayerRepository"] == f"{kid}.layers.norm"
    assert out["kernelized"] == [f"{kid}.layers.norm"] and out["kernelized_count"] == 2 * 2 + 1
    assert out["logits_equal"] is True
    assert out["KernelConfig"] == [f"<Mode.INFERENCE: 4>:{kid}.layers.norm"]


def test_card_lists_only_the_layers_the_package_maps(tmp_path):
    from cutile_kernels_tools.card import shipped_api

    layers = tmp_path / "pkg" / "layers"
    layers.mkdir(parents=True)
    (tmp_path / "pkg" / "ops").mkdir()
    (tmp_path / "pkg" / "ops" / "__init__.py").write_text('__all__ = ["rms_norm", "rms_norm_reference"]\n')
    (layers / "_registry.py").write_text("from . import norm, mlp\nMAPPING_MODULES = (norm,)\n")
    (layers / "norm.py").write_text('MAPPING = {"RMSNorm": "CutileRMSNorm"}\n')
    (layers / "mlp.py").write_text('MAPPING = {"SiLU": "CutileSiLU"}\n')
    assert shipped_api(tmp_path / "pkg") == ({"RMSNorm": "CutileRMSNorm"}, ["rms_norm"])
    (layers / "_registry.py").write_text("")  # no tuple to read: every module's rows
    assert shipped_api(tmp_path / "pkg")[0] == {"RMSNorm": "CutileRMSNorm", "SiLU": "CutileSiLU"}


def test_card_mapping_of_the_build_is_the_one_kernelize_uses(built_package_dir):
    from cutile_kernels.layers import MAPPING
    from cutile_kernels_tools.card import shipped_api

    assert shipped_api(built_package_dir)[0] == MAPPING
