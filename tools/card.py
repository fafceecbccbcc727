"""The README (model card) of the Hub kernel repository, generated from what the checkout holds.

Every number in the card comes from a file, and the card names it next to the number:

* the build variant (``<build>/torch-cuda``): ``metadata.json`` (name, version, CUDA archs) and the
  package's ``manifest.json`` (kernels, variants, dtypes, archs, toolchain versions);
* the kernel inventory, a FlashInfer-Bench dataset (``inventory/``: ``definitions/**/*.json``,
  ``solutions/**/*.json``, ``traces/**/*.jsonl``), read as plain JSON: what each kernel computes,
  and per workload its status, error and speedup over the reference, with the hardware and
  library versions the trace records;
* end-to-end bench reports (``bench.json`` from ``cutile-kernels bench --out``, schema
  ``cutile-kernels/bench/1`` or ``/2``) measured on a GPU: prefill time and decode tokens/s of
  our path against stock transformers, with the GPU and versions of that run.

What a source does not say is left out rather than guessed; an absent source is said to be absent.
"""

from __future__ import annotations

import ast
import json
import statistics
from collections import Counter
from pathlib import Path

from cutile_kernels.kernel_src._spec import DTYPE_TAGS

#: Front matter keys the Hub reads (``library_name: kernels`` lists the repo among kernels).
CARD_TAGS = ("kernels", "cuda", "cutile", "cuda-tile", "transformers")


class CardError(ValueError):
    """A source the card needs is missing or malformed (the message names the file)."""


#: Variant tag prefix -> dtype.
_TAG_DTYPES = {tag: dtype for dtype, tag in DTYPE_TAGS.items()}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CardError(f"cannot read {path}: {exc}") from exc


def _rel(path: Path, root: Path | None) -> str:
    """``path`` relative to ``root`` when it lies inside it (what a reader of the card can find)."""
    path = Path(path).resolve()
    if root is not None:
        try:
            return path.relative_to(Path(root).resolve()).as_posix()
        except ValueError:
            pass
    return path.as_posix()


# ---------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------

def build_summary(variant_dir: Path) -> dict:
    """What one build variant ships, from its ``metadata.json`` and ``manifest.json``.

    Args:
        variant_dir: ``<build>/torch-cuda`` (holds ``metadata.json`` and the package directory).

    Returns:
        ``{"metadata", "manifest_file", "package", "archs", "cuda_tile", "tileiras", "kernels":
        [{"kernel", "dtypes", "variants", "archs", "cubin_bytes"}], "variants", "cubin_bytes"}``;
        ``variants`` counts (variant, arch) pairs, ``cubin_bytes`` is in bytes.

    Raises:
        CardError: no metadata.json, no manifest, or a manifest without variants.
    """
    variant_dir = Path(variant_dir)
    meta = _read_json(variant_dir / "metadata.json")
    package = meta.get("name", "").replace("-", "_")
    manifest_file = variant_dir / package / "manifest.json"
    manifest = _read_json(manifest_file)
    variants = manifest.get("variants") or []
    if not variants:
        raise CardError(f"{manifest_file} lists no variants")
    kernels: dict[str, dict] = {}
    for v in variants:
        k = kernels.setdefault(v["kernel"], {"kernel": v["kernel"], "dtypes": set(), "tags": set(),
                                             "archs": set(), "cubin_bytes": 0})
        # The variant tag starts with the data dtype (bf16.*, fp16.*, fp32.*); the first array
        # can be an auxiliary input (rope_cos_sin's float32 inv_freq).
        dtype = _TAG_DTYPES.get(v["variant"].split(".", 1)[0])
        arrays = [p for p in v["params"] if p["kind"] == "array"]
        if dtype is None and arrays:
            dtype = arrays[0]["dtype"]
        if dtype:
            k["dtypes"].add(dtype)
        k["tags"].add(v["variant"])
        k["archs"].add(v["arch"])
        k["cubin_bytes"] += int(v.get("cubin_bytes", 0))
    rows = [{"kernel": k["kernel"], "dtypes": sorted(k["dtypes"]), "variants": len(k["tags"]),
             "archs": sorted(k["archs"], key=_arch_order), "cubin_bytes": k["cubin_bytes"]}
            for k in kernels.values()]
    return {
        "metadata": meta,
        "manifest_file": manifest_file,
        "package": package,
        "archs": sorted(manifest.get("archs", []), key=_arch_order),
        "cuda_tile": manifest.get("cuda_tile"),
        "tileiras": manifest.get("tileiras"),
        "kernels": rows,
        "variants": len(variants),
        "cubin_bytes": sum(r["cubin_bytes"] for r in rows),
    }


def _arch_order(arch: str) -> int:
    digits = "".join(c for c in arch if c.isdigit())
    return int(digits) if digits else 0


def inventory_summary(inventory_dir: Path) -> dict | None:
    """Definitions, Solutions and Trace statistics of a FlashInfer-Bench dataset directory.

    Traces are grouped by (definition, solution, hardware). Per group: the number of evaluated
    workloads, how many ``PASSED``, the other statuses, the largest absolute and relative error,
    the median / min / max ``speedup_factor`` (reference latency / solution latency) and median
    latencies (ms) over the passed workloads, the library versions the traces record, and the
    trace files they came from. Workload-only traces (no solution or evaluation) are skipped.

    Returns:
        ``{"dir", "definitions", "solutions", "perf"}``, or None when ``inventory_dir`` does not
        exist.

    Raises:
        CardError: a file that is not valid JSON / JSON Lines (named in the message).
    """
    inventory_dir = Path(inventory_dir)
    if not inventory_dir.is_dir():
        return None
    definitions = []
    for f in sorted((inventory_dir / "definitions").rglob("*.json")):
        d = _read_json(f)
        definitions.append({"name": d.get("name", f.stem), "op_type": d.get("op_type", ""),
                            "description": d.get("description") or "", "tags": d.get("tags", []), "file": f})
    solutions = []
    for f in sorted((inventory_dir / "solutions").rglob("*.json")):
        s = _read_json(f)
        spec = s.get("spec") or {}
        hw = spec.get("target_hardware") or []
        solutions.append({"name": s.get("name", f.stem), "definition": s.get("definition", ""),
                          "language": spec.get("language", ""), "entry_point": spec.get("entry_point", ""),
                          "target_hardware": [hw] if isinstance(hw, str) else list(hw), "file": f})
    groups: dict[tuple, dict] = {}
    for f in sorted((inventory_dir / "traces").rglob("*.jsonl")):
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                t = json.loads(line)
            except ValueError as exc:
                raise CardError(f"{f}:{n}: not JSON: {exc}") from exc
            ev = t.get("evaluation")
            if not t.get("solution") or not ev:
                continue
            env = ev.get("environment") or {}
            key = (t.get("definition", ""), t["solution"], env.get("hardware", "unknown"))
            g = groups.setdefault(key, {"definition": key[0], "solution": key[1], "hardware": key[2],
                                        "statuses": Counter(), "abs": [], "rel": [], "speedup": [],
                                        "latency": [], "ref_latency": [], "libs": {}, "files": set()})
            g["statuses"][ev.get("status", "UNKNOWN")] += 1
            g["files"].add(f)
            for lib, ver in (env.get("libs") or {}).items():
                g["libs"].setdefault(lib, set()).add(str(ver))
            corr = ev.get("correctness") or {}
            if "max_absolute_error" in corr:
                g["abs"].append(float(corr["max_absolute_error"]))
            if "max_relative_error" in corr:
                g["rel"].append(float(corr["max_relative_error"]))
            perf = ev.get("performance") or {}
            if ev.get("status") == "PASSED" and perf.get("speedup_factor"):
                g["speedup"].append(float(perf["speedup_factor"]))
                g["latency"].append(float(perf.get("latency_ms", 0.0)))
                g["ref_latency"].append(float(perf.get("reference_latency_ms", 0.0)))
    perf_rows = []
    for g in groups.values():
        sp = g["speedup"]
        perf_rows.append({
            "definition": g["definition"], "solution": g["solution"], "hardware": g["hardware"],
            "workloads": sum(g["statuses"].values()), "passed": g["statuses"].get("PASSED", 0),
            "other_statuses": {s: c for s, c in g["statuses"].items() if s != "PASSED"},
            "max_abs_err": max(g["abs"]) if g["abs"] else None,
            "max_rel_err": max(g["rel"]) if g["rel"] else None,
            "speedup_median": statistics.median(sp) if sp else None,
            "speedup_min": min(sp) if sp else None, "speedup_max": max(sp) if sp else None,
            "latency_ms_median": statistics.median(g["latency"]) if sp else None,
            "reference_latency_ms_median": statistics.median(g["ref_latency"]) if sp else None,
            "libs": {lib: sorted(v) for lib, v in sorted(g["libs"].items())},
            "files": sorted(g["files"]),
        })
    perf_rows.sort(key=lambda r: (r["definition"], r["solution"], r["hardware"]))
    return {"dir": inventory_dir, "definitions": definitions, "solutions": solutions, "perf": perf_rows}


def find_bench_reports(results_dir: Path) -> list[Path]:
    """The newest GPU ``bench.json`` per model under ``results_dir`` (e.g. ``benchmarks/results``).

    "Newest" orders first by the top-level results directory's name (they are named
    ``<machine>-<date>``), then by modification time. Reports measured on a CPU are skipped:
    their timings say nothing about the kernels. Returns [] when there are none.
    """
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        return []
    best: dict[str, tuple] = {}
    for f in results_dir.rglob("bench.json"):
        try:
            report = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if not str(report.get("schema", "")).startswith("cutile-kernels/bench/"):
            continue
        if not str((report.get("environment") or {}).get("device", "")).startswith("cuda"):
            continue
        key = (f.relative_to(results_dir).parts[0], f.stat().st_mtime, str(f))
        model = report.get("model", str(f))
        if model not in best or key > best[model][0]:
            best[model] = (key, f)
    return sorted(f for _, f in best.values())


def bench_summary(path: Path) -> dict:
    """One bench report (schema ``cutile-kernels/bench/1`` or ``/2``) as card rows.

    Returns:
        ``{"file", "model", "schema", "gpu", "capability", "device", "versions", "settings",
        "rows": [{"path", "ok", "prefill_ms", "prefill_speedup", "decode": {batch: tokens/s},
        "decode_speedup": {batch: x}, "gate"}]}``. Speedups are stock's time over the path's
        (prefill) and the path's tokens/s over stock's (decode); ``gate`` is True/False/None (no
        gate: the stock path itself).

    Raises:
        CardError: unreadable report or an unknown schema.
    """
    path = Path(path)
    report = _read_json(path)
    schema = str(report.get("schema", ""))
    if not schema.startswith("cutile-kernels/bench/"):
        raise CardError(f"{path}: not a cutile-kernels bench report (schema {schema!r})")
    env = report.get("environment") or {}
    gates = report.get("gate") or {}
    if "passed" in gates:  # schema 1: one gate, ours against stock
        gates = {"cutile": gates}
    paths = report.get("paths") or {}
    stock = paths.get("stock") if (paths.get("stock") or {}).get("ok", True) else None

    def decode_rates(p):
        return {int(d["batch"]): float(d["tokens_per_s"]) for d in p.get("decode") or []}

    stock_prefill = stock["prefill_ms"]["median"] if stock and stock.get("prefill_ms") else None
    stock_decode = decode_rates(stock) if stock else {}
    rows = []
    for name, p in paths.items():
        if not p.get("ok", True) or not p.get("prefill_ms"):
            rows.append({"path": name, "ok": False, "error": p.get("error", "failed")})
            continue
        prefill = p["prefill_ms"]["median"]
        decode = decode_rates(p)
        rows.append({
            "path": name, "ok": True, "prefill_ms": prefill,
            "prefill_speedup": stock_prefill / prefill if stock_prefill and name != "stock" else None,
            "decode": decode,
            "decode_speedup": {b: r / stock_decode[b] for b, r in decode.items()
                               if name != "stock" and stock_decode.get(b)},
            "gate": gates[name]["passed"] if name in gates else None,
        })
    return {"file": path, "model": report.get("model", ""), "schema": schema, "gpu": env.get("gpu"),
            "capability": env.get("capability"), "device": env.get("device"),
            "versions": {k: v for k, v in (env.get("versions") or {}).items() if v},
            "settings": report.get("settings") or {}, "build": env.get("cutile_build"), "rows": rows}


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------

def _fmt(x, spec: str = ".3g", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def _literal(path: Path, name: str):
    """The literal value of a top-level ``name = <literal>`` in a Python file, or None."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and node.value is not None:
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                return None
    return None


def _family_modules(init: Path) -> set[str] | None:
    """The module names in ``layers/_registry.py``'s ``MAPPING_MODULES`` tuple (the ones whose
    ``MAPPING`` rows the package gathers), or None if it cannot be read."""
    try:
        tree = ast.parse(init.read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "MAPPING_MODULES"
                                                 for t in node.targets)
                and isinstance(node.value, ast.Tuple)):
            return {e.id for e in node.value.elts if isinstance(e, ast.Name)}
    return None


def shipped_api(package_dir: Path) -> tuple[dict, list[str]]:
    """The hub layer mapping and the functional API a built package ships, read statically (as
    kernel-builder reads ``__all__``) so that the card describes the build, not the checkout.

    Returns:
        (``{hub layer name: layer class}`` from the ``MAPPING`` literal of every ``layers/*.py``
        module the package gathers (``MAPPING_MODULES``), the names in ``ops/__init__.py``'s ``__all__`` without the ``*_reference`` ones).
    """
    package_dir = Path(package_dir)
    mapping: dict = {}
    shipped = _family_modules(package_dir / "layers" / "_registry.py")
    for f in sorted((package_dir / "layers").glob("*.py")):
        if shipped is not None and f.stem not in shipped:
            continue  # a layer module the package's MAPPING leaves out (e.g. mlp's SiLU)
        rows = _literal(f, "MAPPING")
        if isinstance(rows, dict):
            mapping.update({str(k): str(v) for k, v in rows.items()})
    names = _literal(package_dir / "ops" / "__init__.py", "__all__") or []
    return mapping, sorted(str(n) for n in names if not str(n).endswith("_reference"))


def render(repo_id: str, variant_dir: Path, inventory_dir: Path | None = None, bench_files=(),
           root: Path | None = None) -> str:
    """The kernel repository's README.md.

    Args:
        repo_id: ``ORG/NAME`` of the Hub kernel repository (used in the usage snippets).
        variant_dir: the build variant that is published (``<build>/torch-cuda``).
        inventory_dir: the FlashInfer-Bench inventory (None or absent: the card says so).
        bench_files: GPU ``bench.json`` reports to quote (see :func:`find_bench_reports`).
        root: the checkout; source files are named relative to it.

    Raises:
        CardError: the build variant or a given bench report cannot be read.
    """
    build = build_summary(variant_dir)
    meta = build["metadata"]
    version = meta.get("version")
    mapping, functions = shipped_api(Path(variant_dir) / build["package"])
    inv = inventory_summary(inventory_dir) if inventory_dir is not None else None
    benches = [bench_summary(f) for f in bench_files]
    license_ = str(meta.get("license", "")).lower()
    lines = ["---", "library_name: kernels"]
    if license_:
        lines.append(f"license: {license_}")
    lines += ["tags:", *[f"- {t}" for t in CARD_TAGS], "---", "",
              f"# {meta.get('name', repo_id)}", "",
              ("cuTile (`cuda-tile`) kernels for Hugging Face transformers models, packaged for the "
               "[`kernels`](https://github.com/huggingface/kernels) library: a noarch `torch-cuda` "
               f"build variant with cubins compiled ahead of time for {', '.join(build['archs'])}."),
              "",
              ("This card was generated by `cutile-kernels publish` from the build, the kernel inventory "
               "and the benchmark reports of the source checkout; each number names the file it comes from."),
              ""]

    # -- use ----------------------------------------------------------------------------------
    first_layer = next(iter(mapping.items()), ("RMSNorm", "CutileRMSNorm"))
    lines += [
        "## How to use", "",
        (f"Version {version} lives on the branch `v{version}`. The variant declares no `python-depends`: "
         "`kernels` 0.17 does not allow `cuda-tile` there yet (huggingface/kernels#444), so install it "
         "beside `kernels`. The kernels need an NVIDIA GPU of a listed arch and a CUDA 13 driver (r580+). "
         "`trust_remote_code=True` is needed unless the publishing organisation is a trusted kernel publisher."),
        "",
        "```bash",
        'pip install "kernels==0.17.2" "cuda-tile==1.7.0" "cuda-bindings>=13.0"',
        "```", "",
        "Functions:", "",
        "```python",
        "import torch",
        "from kernels import get_kernel", "",
        f'ck = get_kernel("{repo_id}", version={version}, trust_remote_code=True)',
        'x = torch.randn(8, 4096, dtype=torch.bfloat16, device="cuda")',
        'w = torch.rand(4096, dtype=torch.bfloat16, device="cuda")',
        "y = ck.rms_norm(x, w, 1e-6)" if "rms_norm" in functions else f"# ck.{functions[0] if functions else '...'}(...)",
        "```", "",
        "Layers, in a transformers model (`from_pretrained` kernelizes on load):", "",
        "```python",
        "from transformers import AutoModelForCausalLM, KernelConfig", "",
        "cfg = KernelConfig({",
        *[f'    "{hub}": ("{repo_id}:{cls}", {{"version": {version}, "trust_remote_code": True}}),'
          for hub, cls in mapping.items()],
        "})",
        "model = AutoModelForCausalLM.from_pretrained(",
        '    "path/or/id", dtype=torch.bfloat16, device_map="cuda", use_kernels=True, kernel_config=cfg)',
        "```", "",
        ("transformers refuses a `KernelConfig` entry whose layer name the model does not have: keep the "
         "entries your model uses."), "",
         "or with `kernels` directly, on a loaded model:", "",
         "```python",
         "from kernels import LayerRepository, Mode, kernelize, use_kernel_mapping", "",
        (f'repo = LayerRepository(repo_id="{repo_id}", layer_name="{first_layer[1]}", version={version}, '
        "trust_remote_code=True)"),
        f'with use_kernel_mapping({{"{first_layer[0]}": {{"cuda": repo}}}}, inherit_mapping=False):',
        '    model = kernelize(model, mode=Mode.INFERENCE, device="cuda")',
        "```", "",
        ("The `cutile-kernels` Python package (installed from its source repository, not on PyPI) does "
         "the same from a local build (`cutile_kernels.kernel_config()`), applies the fused-weight and "
         "fused-residual patches the hub mapping cannot express (`cutile_kernels.patch`; opt-in patches only "
         "when named), and adds the "
         "benchmark and the coverage report."), "",
    ]
    lines += ["## Available functions", "", *[f"- `{f}`" for f in functions], "",
              "## Available layers", "",
              *[f"- `{cls}`: replaces transformers' `{hub}` hub layer" for hub, cls in mapping.items()], ""]

    # -- build --------------------------------------------------------------------------------
    manifest_rel = f"build/{Path(variant_dir).name}/{build['package']}/manifest.json"  # its path in the repo
    caps = (meta.get("backend") or {}).get("archs") or []
    lines += ["## Build", "",
              (f"From `{manifest_rel}` and `metadata.json` on branch `v{version}`: "
               f"{build['variants']} cubins ({_bytes(build['cubin_bytes'])}) for {', '.join(build['archs'])} "
               f"(CUDA capabilities {', '.join(caps) or 'not declared'}), compiled by tileiras "
               f"{build['tileiras']} from cuda-tile {build['cuda_tile']}; kernel id `{meta.get('id')}`. "
               "Each variant is compiled with declared assumptions (dtype, unit stride, 16-byte alignment, "
               "divisibility); at run time the first variant whose assumptions the tensors satisfy is launched, "
               "and a call no variant fits takes the PyTorch reference (or the cuTile JIT when `tileiras` is installed)."),
              ""]
    lines += _table(["kernel", "dtypes", "variants per arch", "archs", "cubin bytes"],
                    [[f"`{k['kernel']}`", ", ".join(k["dtypes"]), k["variants"], ", ".join(k["archs"]),
                      _bytes(k["cubin_bytes"])] for k in build["kernels"]])
    lines.append("")

    # -- inventory ----------------------------------------------------------------------------
    lines += ["## Kernels and measured speedups", ""]
    if inv is None:
        lines += [("No kernel inventory was found in the source checkout, so this card quotes no "
                   "per-kernel measurements."), ""]
    else:
        inv_root = root if root is not None else inv["dir"].parent
        lines += [f"From the kernel inventory `{_rel(inv['dir'], inv_root)}` (FlashInfer-Bench layout).", ""]
        if inv["definitions"]:
            sols: dict[str, list] = {}
            for s in inv["solutions"]:
                sols.setdefault(s["definition"], []).append(s)
            lines += _table(["definition", "op type", "what it computes", "solutions (target hardware)"],
                            [[f"`{d['name']}`", d["op_type"], d["description"],
                              "; ".join(f"`{s['name']}` ({', '.join(s['target_hardware']) or '-'})"
                                        for s in sols.get(d["name"], [])) or "-"]
                             for d in inv["definitions"]])
            lines.append("")
        if inv["perf"]:
            lines += [("Per (definition, solution, hardware), over the workloads its traces evaluated: "
                       "speedup is the reference's latency over the solution's (`speedup_factor`), median "
                       "(min-max) over the passed workloads; errors are the largest over them. The reference is "
                       "the Definition's PyTorch formula run eagerly (host time included), not the library "
                       "transformers would dispatch to: attention's reference is a plain float32 softmax "
                       "attention, not sdpa / cuDNN, so its speedup says nothing about sdpa (the End to end "
                       "section below is the comparison that counts)."), ""]
            lines += _table(["definition", "solution", "hardware", "passed", "speedup", "latency ms (ref)",
                             "max abs err", "max rel err", "libraries", "source"],
                            [[f"`{r['definition']}`", f"`{r['solution']}`", r["hardware"],
                              f"{r['passed']}/{r['workloads']}" + (
                                  " (" + ", ".join(f"{c} {s}" for s, c in sorted(r["other_statuses"].items())) + ")"
                                  if r["other_statuses"] else ""),
                              f"{_fmt(r['speedup_median'], '.2f')}x ({_fmt(r['speedup_min'], '.2f')}-"
                              f"{_fmt(r['speedup_max'], '.2f')})" if r["speedup_median"] is not None else "-",
                              f"{_fmt(r['latency_ms_median'], '.4g')} ({_fmt(r['reference_latency_ms_median'], '.4g')})",
                              _fmt(r["max_abs_err"]), _fmt(r["max_rel_err"]),
                              ", ".join(f"{k} {'/'.join(v)}" for k, v in r["libs"].items()) or "-",
                              ", ".join(f"`{_rel(f, inv_root)}`" for f in r["files"])]
                             for r in inv["perf"]])
            lines.append("")
        else:
            lines += ["The inventory holds no evaluated traces yet.", ""]

    # -- end to end ---------------------------------------------------------------------------
    lines += ["## End to end", ""]
    if not benches:
        lines += [("No GPU bench report was found in the source checkout (`cutile-kernels bench <preset> "
                   "--out DIR` writes one)."), ""]
    else:
        lines += [("`cutile-kernels bench` on seeded-weight presets (real model configs): prefill speedup is "
                   "stock's median prefill time over the path's, decode speedup the "
                   "path's tokens/s over stock's; the gate compares the path's logits with a float32 reference "
                   "against stock's."), ""]
    for b in benches:
        batches = sorted({bs for r in b["rows"] if r["ok"] for bs in r["decode"]})
        src = _rel(b["file"], root)
        lines += [f"**{b['model']}** on {b['gpu'] or b['device']} (capability {b['capability'] or '-'}); "
                  + ", ".join(f"{k} {v}" for k, v in b["versions"].items())
                  + f"; settings: prefill {b['settings'].get('prefill_len', '-')} tokens, "
                  f"{b['settings'].get('dtype', '-')}; build measured: "
                  + (f"`{b['build'].get('id')}` with {', '.join(b['build'].get('kernels', []))}" if b.get("build")
                     else "not recorded (reports before the build was recorded: compare with care)")
                  + f". Source: `{src}` (schema `{b['schema']}`).", ""]
        header = ["path", "prefill ms", "prefill speedup", *[f"decode b={bs} tok/s" for bs in batches],
                  *[f"decode b={bs} speedup" for bs in batches], "gate vs stock"]
        rows = []
        for r in b["rows"]:
            if not r["ok"]:
                rows.append([r["path"], f"failed: {r.get('error', '')}"[:80], *[""] * (len(header) - 2)])
                continue
            rows.append([r["path"], _fmt(r["prefill_ms"], ".2f"),
                         f"{r['prefill_speedup']:.2f}x" if r["prefill_speedup"] else "-",
                         *[_fmt(r["decode"].get(bs), ".1f") for bs in batches],
                         *[f"{r['decode_speedup'][bs]:.2f}x" if bs in r["decode_speedup"] else "-" for bs in batches],
                         "-" if r["gate"] is None else ("passed" if r["gate"] else "FAILED")])
        lines += _table(header, rows)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
