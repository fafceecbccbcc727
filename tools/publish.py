"""Publish the build as a Hugging Face kernel repository, or stage exactly what would be uploaded.

The repository follows what ``kernels`` 0.17 loads and what ``kernel-builder upload`` writes
(huggingface/kernels, ``kernel-builder/src/upload.rs``):

* repository type ``kernel`` (``kernels`` downloads with ``repo_type="kernel"`` only), created
  when missing;
* branch ``main``: ``README.md``, the card :func:`card.render` generates;
* branch ``v<version>``, the version being ``metadata.json``'s (``get_kernel(repo_id,
  version=N)`` resolves the branch ``vN``): ``build/<variant>/...`` for each build variant (ours:
  ``build/torch-cuda/``). The branch is created from ``main`` when missing; files under
  ``build/`` that are not uploaded are deleted on a new branch, and under the uploaded variants'
  directories on an existing one.

Both a dry run and a real publish first stage the files of each revision under
``<out>/<revision>/`` (hard links where possible) and write ``<out>/upload.json`` listing them
with sizes and SHA-256; a real publish then uploads from there, so the dry run is exactly what
would be uploaded. Only the real publish touches the network (and needs a token: ``HF_TOKEN`` or
``hf auth login``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import card

#: The Hub repository type of a kernel repository.
REPO_TYPE = "kernel"
MAIN = "main"
#: Operations per commit (kernel-builder's batch size).
COMMIT_BATCH = 1000
#: Never uploaded (``kernels`` ignores bytecode on download anyway).
IGNORE = ("__pycache__", "*.pyc", "*.pyo")
PLAN_FILE = "upload.json"

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class PublishError(ValueError):
    """The build, the arguments or the Hub refused the publish (the message says which)."""


@dataclass(frozen=True)
class StagedFile:
    """One file of the upload: where it goes (revision, path in the repo) and what it is."""

    revision: str
    path_in_repo: str
    local: Path
    size: int
    sha256: str


@dataclass
class Plan:
    """What a publish uploads, staged under ``out_dir``."""

    repo_id: str
    version: int
    kernel_id: str
    variants: list[str]
    out_dir: Path
    files: list[StagedFile] = field(default_factory=list)

    @property
    def branch(self) -> str:
        """The version branch (``v1``), the ``kernels`` convention for ``version=1``."""
        return f"v{self.version}"

    @property
    def revisions(self) -> list[str]:
        return [MAIN, self.branch]

    def revision_files(self, revision: str) -> list[StagedFile]:
        return [f for f in self.files if f.revision == revision]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> dict:
        return {
            "repo_id": self.repo_id, "repo_type": REPO_TYPE, "version": self.version,
            "kernel_id": self.kernel_id, "variants": self.variants,
            "revisions": {r: [{"path": f.path_in_repo, "bytes": f.size, "sha256": f.sha256}
                              for f in self.revision_files(r)] for r in self.revisions},
        }


def checkout_root() -> Path | None:
    """The source checkout this module runs from (None for an installed package)."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "kernel_src").is_dir() else None


def default_repo_id(root: Path | None = None) -> str:
    """``[general.hub] repo-id`` of ``build.toml`` (kernel-builder's default for uploads).

    Raises:
        PublishError: no checkout, no build.toml, or no repo-id in it.
    """
    root = root if root is not None else checkout_root()
    path = root / "build.toml" if root is not None else None
    if path is None or not path.is_file():
        raise PublishError("no --repo-id given and no build.toml to read [general.hub] repo-id from")
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: tomlkit comes with kernels
        import tomlkit as tomllib
    repo_id = ((tomllib.loads(path.read_text()).get("general") or {}).get("hub") or {}).get("repo-id")
    if not repo_id:
        raise PublishError(f"no --repo-id given and {path} has no [general.hub] repo-id")
    return str(repo_id)


def check_repo_id(repo_id: str) -> str:
    """``ORG/NAME`` as the Hub spells repository ids.

    Raises:
        PublishError: anything else (no slash, several slashes, characters the Hub refuses).
    """
    if not isinstance(repo_id, str) or not _REPO_ID.match(repo_id) or ".." in repo_id or "--" in repo_id:
        raise PublishError(f"repo id must be ORG/NAME (letters, digits, '-', '_', '.'), got {repo_id!r}")
    return repo_id


def find_variants(build_dir: Path) -> list[Path]:
    """The build variant directories of ``build_dir`` that ``kernels`` recognises.

    A variant is a directory whose name ``kernels`` parses as a variant (``torch-cuda``,
    ``torch29-cxx11-cu128-x86_64-linux``, ...) and that holds a ``metadata.json``. Anything else
    (the builder's ``.torch-cuda.staging``, stray files) is not uploaded.
    """
    from kernels.variants import parse_variant

    found = []
    for d in sorted(Path(build_dir).iterdir()) if Path(build_dir).is_dir() else []:
        if not d.is_dir() or not (d / "metadata.json").is_file():
            continue
        try:
            parse_variant(d.name)
        except ValueError:
            continue
        found.append(d)
    return found


def check_variant(variant: Path) -> dict:
    """Check that ``variant`` is a build ``kernels`` can load, and return its metadata.

    Checks: ``metadata.json`` parses with ``kernels``' own parser; the package
    ``<python_name>/__init__.py`` that ``kernels`` imports exists; the manifest lists variants and
    every cubin it names is present; ``_ops.py`` declares the metadata's id as its torch.library
    namespace (a build is written as a whole; a mismatch means it was edited by hand).

    Raises:
        PublishError: the first check that fails, naming the file.
    """
    from kernels._rust import Metadata

    meta_file = variant / "metadata.json"
    try:
        parsed = Metadata.read_from_file(meta_file)
    except ValueError as exc:
        raise PublishError(f"{meta_file}: kernels cannot parse it: {exc}") from exc
    meta = json.loads(meta_file.read_text())
    if not isinstance(meta.get("version"), int):
        raise PublishError(f"{meta_file}: no integer `version` (the Hub branch is v<version>)")
    package = variant / parsed.name.python_name
    if not (package / "__init__.py").is_file():
        raise PublishError(f"{package}/__init__.py is missing: kernels imports the variant from there")
    manifest_file = package / "manifest.json"
    if manifest_file.is_file():
        manifest = json.loads(manifest_file.read_text())
        entries = manifest.get("variants") or []
        if not entries:
            raise PublishError(f"{manifest_file} lists no variants")
        missing = [e["cubin"] for e in entries if not (package / e["cubin"]).is_file()]
        if missing:
            raise PublishError(f"{manifest_file} names {len(missing)} cubins that are missing, e.g. {missing[0]}")
    else:
        raise PublishError(f"{manifest_file} is missing: not a `cutile-kernels build` output")
    ops = package / "_ops.py"
    if f"NAMESPACE = {meta['id']!r}" not in (ops.read_text() if ops.is_file() else ""):
        raise PublishError(f"{ops} does not declare the namespace {meta['id']!r} of metadata.json")
    return meta


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _prepare_out(out_dir: Path | None) -> Path:
    if out_dir is None:
        return Path(tempfile.mkdtemp(prefix="cutile-kernels-publish-"))
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not (out / PLAN_FILE).is_file():
            raise PublishError(f"{out} is not empty and holds no staged upload ({PLAN_FILE}): refusing to overwrite it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def stage(repo_id: str, build_dir=None, out_dir=None, inventory_dir=None, bench_files=None,
          root: Path | None = None) -> Plan:
    """Write every file the publish uploads under ``out_dir``, per revision, and list them.

    Args:
        repo_id: ``ORG/NAME`` of the kernel repository.
        build_dir: the ``build/`` directory (default: ``registry.default_build_dir()``).
        out_dir: staging directory (default: a new temporary directory, kept). A non-empty one
            must hold an earlier staging (``upload.json``); it is replaced.
        inventory_dir: the kernel inventory for the card (default: ``<checkout>/inventory``).
        bench_files: bench reports for the card (default: :func:`card.find_bench_reports` on
            ``<checkout>/benchmarks/results``).
        root: the checkout, to name sources in the card (default: :func:`checkout_root`).

    Returns:
        The :class:`Plan`; ``<out>/upload.json`` holds the same list.

    Raises:
        PublishError: a bad repo id, no build variant, a variant ``kernels`` could not load,
            variants of different versions, or a non-empty ``out_dir`` that is no staging.
        card.CardError: a card source that cannot be read.
    """
    from cutile_kernels import registry

    check_repo_id(repo_id)
    build = Path(build_dir) if build_dir is not None else registry.default_build_dir()
    variants = find_variants(build)
    if not variants:
        raise PublishError(f"no build variant under {build} (run `cutile-kernels build`)")
    metas = {v.name: check_variant(v) for v in variants}
    versions = {m["version"] for m in metas.values()}
    if len(versions) != 1:
        raise PublishError(f"build variants of several versions {sorted(versions)}: publish one version at a time")
    root = root if root is not None else checkout_root()
    if inventory_dir is None and root is not None:
        inventory_dir = root / "inventory"
    if bench_files is None:
        bench_files = card.find_bench_reports(root / "benchmarks" / "results") if root is not None else []
    readme = card.render(repo_id, variants[0], inventory_dir=inventory_dir, bench_files=bench_files, root=root)

    out = _prepare_out(out_dir)
    plan = Plan(repo_id=repo_id, version=versions.pop(), kernel_id=metas[variants[0].name]["id"],
                variants=[v.name for v in variants], out_dir=out)
    (out / MAIN).mkdir()
    (out / MAIN / "README.md").write_text(readme)
    for v in variants:
        shutil.copytree(v, out / plan.branch / "build" / v.name, ignore=shutil.ignore_patterns(*IGNORE),
                        copy_function=_link_or_copy)
    for revision in plan.revisions:
        base = out / revision
        for path in sorted(p for p in base.rglob("*") if p.is_file()):
            plan.files.append(StagedFile(revision, path.relative_to(base).as_posix(), path, path.stat().st_size,
                                         _sha256(path)))
    (out / PLAN_FILE).write_text(json.dumps(plan.to_json(), indent=1) + "\n")
    return plan


def _operations(plan: Plan, existing: list[str], new_branch: bool) -> dict[str, list]:
    """Commit operations per revision: README on main; the build, and the deletion of stale build
    files, on the version branch (kernel-builder's rules, see the module docstring)."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    ops = {MAIN: [CommitOperationAdd(path_in_repo=f.path_in_repo, path_or_fileobj=str(f.local))
                  for f in plan.revision_files(MAIN)]}
    uploads = plan.revision_files(plan.branch)
    uploaded = {f.path_in_repo for f in uploads}
    prefixes = ["build/"] if new_branch else [f"build/{v}/" for v in plan.variants]
    stale = [p for p in existing if any(p.startswith(x) for x in prefixes) and p not in uploaded]
    ops[plan.branch] = [CommitOperationDelete(path_in_repo=p) for p in sorted(stale)] + [
        CommitOperationAdd(path_in_repo=f.path_in_repo, path_or_fileobj=str(f.local)) for f in uploads]
    return ops


def upload(plan: Plan, api=None, private: bool = False) -> dict[str, list[str]]:
    """Upload a staged :class:`Plan` to the Hub.

    Args:
        plan: from :func:`stage`.
        api: a ``huggingface_hub.HfApi`` (default: a new one, with the token from ``HF_TOKEN`` or
            the login cache).
        private: create the repository as private (an existing repository keeps its visibility).

    Returns:
        ``{revision: [commit url, ...]}`` (one commit per 1000 operations).

    Raises:
        PublishError: no usable token, or the Hub refused a request (the message names it).
    """
    from huggingface_hub import HfApi

    api = api or HfApi()
    repo_id = plan.repo_id
    try:
        api.whoami()
    except OSError as exc:  # LocalTokenNotFoundError, HfHubHTTPError (401), network errors
        raise PublishError(f"cannot authenticate to the Hugging Face Hub ({exc}); set HF_TOKEN or run "
                           "`hf auth login` (a write token with kernel-creation access)") from exc
    try:
        url = api.create_repo(repo_id, repo_type=REPO_TYPE, private=private, exist_ok=True)
        repo_id = getattr(url, "repo_id", None) or repo_id
        refs = api.list_repo_refs(repo_id, repo_type=REPO_TYPE)
        new_branch = plan.branch not in {b.name for b in refs.branches}
        if new_branch:
            api.create_branch(repo_id, branch=plan.branch, repo_type=REPO_TYPE)
        existing = api.list_repo_files(repo_id, revision=plan.branch, repo_type=REPO_TYPE)
        commits: dict[str, list[str]] = {}
        for revision, ops in _operations(plan, existing, new_branch).items():
            what = "model card" if revision == MAIN else f"build of kernel {plan.kernel_id}"
            batches = [ops[i:i + COMMIT_BATCH] for i in range(0, len(ops), COMMIT_BATCH)]
            for n, batch in enumerate(batches, 1):
                suffix = f" ({n}/{len(batches)})" if len(batches) > 1 else ""
                info = api.create_commit(repo_id, batch, commit_message=f"cutile-kernels publish: {what}{suffix}",
                                         revision=revision, repo_type=REPO_TYPE)
                commits.setdefault(revision, []).append(getattr(info, "commit_url", str(info)))
    except OSError as exc:  # HfHubHTTPError and network errors
        raise PublishError(f"the Hub refused the upload to {repo_id}: {exc}") from exc
    return commits


def publish(repo_id: str, dry_run: bool = True, out_dir=None, build_dir=None, inventory_dir=None,
            bench_files=None, private: bool = False, api=None) -> tuple[Plan, dict]:
    """Stage the upload and, unless ``dry_run``, upload it (see :func:`stage`, :func:`upload`).

    A real publish without ``out_dir`` stages into a temporary directory that is removed after
    the upload. Returns ``(plan, commits)``; ``commits`` is empty for a dry run.
    """
    tmp = None
    if out_dir is None and not dry_run:
        tmp = tempfile.TemporaryDirectory(prefix="cutile-kernels-publish-")
        out_dir = tmp.name
    try:
        plan = stage(repo_id, build_dir=build_dir, out_dir=out_dir, inventory_dir=inventory_dir,
                     bench_files=bench_files)
        commits = {} if dry_run else upload(plan, api=api, private=private)
    finally:
        if tmp is not None:
            tmp.cleanup()
    return plan, commits


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024 or unit == "MiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
