"""The ahead-of-time build: what a build directory contains, incremental rebuilds, errors that
name the failing variant, and the build-matrix vocabulary. CPU only (cuTile compiles without a
GPU); only a handful of variants are compiled here."""

from __future__ import annotations

import ast
import json
import sys
import textwrap

import pytest

from cutile_kernels import kernel_src, registry
from cutile_kernels.kernel_src import _spec
from cutile_kernels.kernel_src._spec import ArrayParam, ConstParam, ScalarParam, VariantSpec
from cutile_kernels.kernel_src.norm import VARIANTS

import cutile_kernels_build as builder
from cutile_kernels_build import BuildError, aot

ENTRY_FIELDS = {"kernel", "variant", "arch", "symbol", "params", "constants", "hash", "cuda_tile",
                "tileiras", "cubin_bytes"}


@pytest.fixture(scope="module")
def manifest(built_package_dir):
    return json.loads((built_package_dir / "manifest.json").read_text())


# ---------------------------------------------------------------------------------------------
# The build directory the tests run against
# ---------------------------------------------------------------------------------------------

def test_flat_dims_past_an_arrays_rank_are_refused(monkeypatch):
    # A name declared for a kernel where it has fewer dims (gated_delta's g: 3-D in the delta-rule
    # kernels, 2-D in the gates kernel) stops the build instead of reaching the manifest.
    from cutile_kernels.kernel_src import gated_delta

    gates = next(s for s in gated_delta.VARIANTS if s.kernel == "gated_delta_gates")
    assert {p["name"]: p["flat_dims"] for p in builder._params_json(gates) if p["kind"] == "array"}["g"] == []
    monkeypatch.setattr(gated_delta, "ARRAY_FLAT_DIMS", {**gated_delta.ARRAY_FLAT_DIMS, "g": (0, 2)})
    with pytest.raises(BuildError, match=r"ARRAY_FLAT_DIMS\['g'\] = \[0, 2\].* has 2 dims"):
        builder._params_json(gates)
    scan = next(s for s in gated_delta.VARIANTS if s.kernel == "gated_delta_scan")
    assert {p["name"]: p["flat_dims"] for p in builder._params_json(scan) if p["kind"] == "array"}["g"] == [0, 2]


def test_manifest_covers_every_variant_and_arch(built_package_dir, manifest):
    archs = manifest["archs"]
    assert archs and set(archs) <= {"sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"}
    specs = kernel_src.all_variants()
    assert len(specs) > 0
    by_key: dict = {}
    for e in manifest["variants"]:
        by_key.setdefault((e["kernel"], e["variant"], e["arch"]), []).append(e)
    assert len(manifest["variants"]) == len(specs) * len(archs)
    for arch in archs:
        for spec in specs:
            entries = by_key.get((spec.kernel, spec.tag, arch), [])
            assert len(entries) == 1, f"{spec.kernel} {spec.tag} {arch}: {len(entries)} manifest entries"
            e = entries[0]
            missing = ENTRY_FIELDS - e.keys()
            assert not missing, f"{spec.tag} {arch} lacks {missing}"
            assert e["symbol"] == aot.signature(spec).symbol
            assert e["constants"] == spec.constants
            assert e["params"] == json.loads(json.dumps(builder._params_json(spec)))
            flat = getattr(sys.modules.get(f"{kernel_src.__name__}.{spec.module}"), "ARRAY_FLAT_DIMS", {})
            for p in e["params"]:  # each array's flat dims: its family's declaration (one kernel's first), else none
                want = flat.get((spec.function, p["name"]), flat.get(p["name"], ()))
                assert p.get("flat_dims") == (list(want) if p["kind"] == "array" else None)
            assert e["function"] == spec.function and e["module"] == spec.module
            assert e["calling_convention"] == "cutile_python_v1"
            assert e["cuda_tile"] == manifest["cuda_tile"] and e["tileiras"] == manifest["tileiras"]
            assert isinstance(e["hash"], str) and len(e["hash"]) == 20
            int(e["hash"], 16)
            path = built_package_dir / e["cubin"]
            assert e["cubin"] == f"cubins/{arch}/{builder.cubin_file(e['symbol'])}"
            assert path.is_file(), path
            size = path.stat().st_size
            assert size > 0 and size == e["cubin_bytes"]
    # Hashes differ per arch (the arch is part of what a cubin depends on).
    if len(archs) > 1:
        for spec in specs[:3]:
            hashes = {by_key[(spec.kernel, spec.tag, a)][0]["hash"] for a in archs}
            assert len(hashes) == len(archs)


def test_no_stray_cubins(built_package_dir, manifest):
    on_disk = {p.relative_to(built_package_dir).as_posix() for p in (built_package_dir / "cubins").rglob("*.cubin")}
    assert on_disk == {e["cubin"] for e in manifest["variants"]}


def test_symbols_are_unique_per_arch(manifest):
    seen = [(e["arch"], e["symbol"]) for e in manifest["variants"]]
    assert len(seen) == len(set(seen))
    tags = [(e["kernel"], e["variant"]) for e in manifest["variants"] if e["arch"] == manifest["archs"][0]]
    assert len(tags) == len(set(tags))


def test_metadata_json(built_package_dir, manifest):
    variant = built_package_dir.parent
    meta = json.loads((variant / "metadata.json").read_text())
    assert meta["name"] == "cutile-kernels"
    assert meta["id"].startswith("_cutile_kernels_cuda_")
    assert len(meta["id"]) > len("_cutile_kernels_cuda_")
    assert meta["version"] == 1
    assert meta["backend"]["type"] == "cuda"
    assert len(meta["backend"]["archs"]) == len(manifest["archs"])
    for cap, arch in zip(meta["backend"]["archs"], manifest["archs"]):
        assert cap.replace(".", "").rstrip("a") == arch.removeprefix("sm_")

    from kernels._rust import Backend, Metadata

    parsed = Metadata.read_from_file(str(variant / "metadata.json"))
    assert parsed.id == meta["id"]
    assert str(parsed.name) == "cutile-kernels"
    assert parsed.version == 1
    assert parsed.backend.backend_type == Backend.CUDA
    assert list(parsed.backend.archs) == meta["backend"]["archs"]


def test_ops_namespace_matches_metadata_id(built_package_dir):
    meta = json.loads((built_package_dir.parent / "metadata.json").read_text())
    tree = ast.parse((built_package_dir / "_ops.py").read_text())
    assigns = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
               for t in node.targets if isinstance(t, ast.Name)}
    assert "NAMESPACE" in assigns
    assert ast.literal_eval(assigns["NAMESPACE"]) == meta["id"]


def test_built_package_carries_runtime_layers_and_kernel_src(built_package_dir):
    for rel in ("__init__.py", "registry.py", "cubin.py", "launcher.py", "dispatch.py", "ops/norm.py",
                "layers/__init__.py", "layers/norm.py", "layers/hub.py", "kernel_src/_spec.py",
                "kernel_src/norm.py"):
        assert (built_package_dir / rel).is_file(), rel


# ---------------------------------------------------------------------------------------------
# Incremental builds (a tiny custom spec list, compiled for sm_90 only)
# ---------------------------------------------------------------------------------------------

def _cubins(out):
    return {p.name: p for p in (out / "torch-cuda" / "cutile_kernels" / "cubins").rglob("*.cubin")}


def _build(out, specs, **kw):
    return builder.build(out, archs=["sm_90"], jobs=1, progress=False, specs=specs, **kw)


@pytest.mark.slow
def test_incremental_build(tmp_path):
    # rms_norm bf16 BLOCK_N=64: its aligned and its generic variant.
    specs = [next(s for s in VARIANTS if s.kernel == "rms_norm" and s.tag.startswith("bf16.")
                  and s.tag.endswith(layout) and s.constants.get("BLOCK_N") == 64)
             for layout in ("aligned", "generic")]
    assert specs[0].params[0].base_addr_divisible_by == 16 and specs[1].params[0].base_addr_divisible_by == 1
    names = {builder.cubin_file(aot.signature(s).symbol) for s in specs}
    out = tmp_path / "b"

    m1 = _build(out, specs)
    assert m1["build_stats"]["compiled"] == 2 and m1["build_stats"]["reused"] == 0
    assert m1["build_stats"]["variant_dir"] == str((out / "torch-cuda").resolve())
    files = _cubins(out)
    assert set(files) == names
    assert all(p.stat().st_size > 0 for p in files.values())
    written = json.loads((out / "torch-cuda" / "cutile_kernels" / "manifest.json").read_text())
    assert written["archs"] == ["sm_90"] and "build_stats" not in written
    assert [e["variant"] for e in written["variants"]] == [s.tag for s in specs]
    assert all(e["cubin_bytes"] == files[builder.cubin_file(e["symbol"])].stat().st_size for e in written["variants"])
    meta = json.loads((out / "torch-cuda" / "metadata.json").read_text())
    assert meta["backend"]["archs"] == ["9.0a"]

    inodes = {n: p.stat().st_ino for n, p in files.items()}
    m2 = _build(out, specs)
    assert m2["build_stats"]["compiled"] == 0 and m2["build_stats"]["reused"] == 2
    assert {n: p.stat().st_ino for n, p in _cubins(out).items()} == inodes  # nothing rewritten
    assert m2["variants"] == m1["variants"]
    meta2 = json.loads((out / "torch-cuda" / "metadata.json").read_text())
    assert meta2["id"] == meta["id"]  # unchanged package -> unchanged namespace

    m3 = _build(out, specs, force=True)
    assert m3["build_stats"]["compiled"] == 2 and m3["build_stats"]["reused"] == 0

    # Delete one cubin: exactly that one is recompiled; the other file is left alone.
    files = _cubins(out)
    victim = builder.cubin_file(aot.signature(specs[1]).symbol)
    keeper = builder.cubin_file(aot.signature(specs[0]).symbol)
    keeper_ino = files[keeper].stat().st_ino
    files[victim].unlink()
    m4 = _build(out, specs)
    assert m4["build_stats"]["compiled"] == 1 and m4["build_stats"]["reused"] == 1
    files = _cubins(out)
    assert set(files) == names and files[victim].stat().st_size > 0
    assert files[keeper].stat().st_ino == keeper_ino

    # Shrink the spec list: the dropped variant's cubin and manifest entry go away.
    m5 = _build(out, specs[:1])
    assert m5["build_stats"]["compiled"] == 0 and m5["build_stats"]["reused"] == 1
    assert set(_cubins(out)) == {keeper}
    assert [e["variant"] for e in m5["variants"]] == [specs[0].tag]
    on_disk = json.loads((out / "torch-cuda" / "cutile_kernels" / "manifest.json").read_text())
    assert [e["variant"] for e in on_disk["variants"]] == [specs[0].tag]
    # The tmp build is a usable registry.
    reg = registry.Registry(out.resolve() / "torch-cuda" / "cutile_kernels")
    assert reg.archs == ["sm_90"] and [v.tag for v in reg.variants()] == [specs[0].tag]


def test_build_refuses_bad_arguments_before_writing(tmp_path):
    out = tmp_path / "b"
    with pytest.raises(ValueError, match="unknown kernel"):
        builder.build(out, archs=["sm_90"], jobs=1, progress=False, specs=[VARIANTS[0]], kernels=["rmsnorm"])
    with pytest.raises(ValueError, match="unsupported arch"):
        builder.build(out, archs=["sm_75"], jobs=1, progress=False, specs=[VARIANTS[0]])
    with pytest.raises(ValueError, match="unsupported arch"):
        builder.build(out, archs=["sm90"], jobs=1, progress=False, specs=[VARIANTS[0]])
    assert not out.exists() or not any(out.iterdir())
    with pytest.raises(BuildError, match="duplicate symbol"):
        builder.build(tmp_path / "c", archs=["sm_90"], jobs=1, progress=False, specs=[VARIANTS[0], VARIANTS[0]])


def test_failed_build_leaves_the_previous_build_intact(tmp_path, broken_spec):
    out = tmp_path / "b"
    builder.build(out, archs=["sm_90"], jobs=1, progress=False, specs=[VARIANTS[0]])
    variant = out / builder.VARIANT_DIR
    before = {p.relative_to(variant): p.read_bytes() for p in variant.rglob("*") if p.is_file()}
    with pytest.raises(BuildError):
        builder.build(out, archs=["sm_90"], jobs=1, progress=False, specs=[VARIANTS[0], broken_spec])
    after = {p.relative_to(variant): p.read_bytes() for p in variant.rglob("*") if p.is_file()}
    assert after == before
    ops = (variant / builder.PACKAGE / "_ops.py").read_text()
    meta = json.loads((variant / "metadata.json").read_text())
    assert f"NAMESPACE = {meta['id']!r}" in ops


def test_variant_hash_depends_on_arch_and_params():
    a, b = VARIANTS[0], VARIANTS[1]
    assert aot.variant_hash(a, "sm_90") == aot.variant_hash(a, "sm_90")
    assert aot.variant_hash(a, "sm_90") != aot.variant_hash(a, "sm_80")
    assert aot.variant_hash(a, "sm_90") != aot.variant_hash(b, "sm_90")
    assert aot.signature(a).symbol != aot.signature(b).symbol
    assert aot.signature(a).symbol.startswith(a.function)


# ---------------------------------------------------------------------------------------------
# Compile errors name the variant
# ---------------------------------------------------------------------------------------------

BROKEN = textwrap.dedent('''
    import cuda.tile as ct


    @ct.kernel
    def broken_kernel(x, y):
        t = ct.load(x, index=(0,), shape=(96,))  # 96 is not a power of two
        ct.store(y, index=(0,), tile=t)
''')


@pytest.fixture
def broken_spec(tmp_path, monkeypatch):
    pkg = tmp_path / "cutile_test_brokenpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "k.py").write_text(BROKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield VariantSpec("broken_norm", "cutile_test_brokenpkg.k", "broken_kernel", "fp32.n96.generic",
                      (_spec.array("x", "float32", 1, "generic"), _spec.array("y", "float32", 1, "generic")))
    for name in [n for n in sys.modules if n.startswith("cutile_test_brokenpkg")]:
        del sys.modules[name]


def test_compile_variant_error_names_kernel_variant_arch(broken_spec):
    with pytest.raises(BuildError) as info:
        aot.compile_variant(broken_spec, "sm_90")
    msg = str(info.value)
    assert "broken_norm" in msg and "fp32.n96.generic" in msg and "sm_90" in msg
    assert "power of two" in msg  # the compiler's own diagnosis is kept
    assert info.value.__cause__ is not None


@pytest.mark.slow
def test_build_error_names_kernel_variant_arch(broken_spec, tmp_path):
    with pytest.raises(BuildError) as info:
        builder.build(tmp_path / "out", archs=["sm_90"], jobs=1, progress=False, specs=[broken_spec])
    msg = str(info.value)
    assert "broken_norm" in msg and "fp32.n96.generic" in msg and "sm_90" in msg
    # A failed build writes no manifest claiming the variant exists.
    assert not (tmp_path / "out" / "torch-cuda" / "cutile_kernels" / "manifest.json").exists()


# ---------------------------------------------------------------------------------------------
# The build-matrix vocabulary
# ---------------------------------------------------------------------------------------------

def test_constant_must_come_last():
    x = _spec.array("x", "float32", 2, "generic")
    with pytest.raises(ValueError, match="must come last"):
        VariantSpec("k", "norm", "f", "t", (x, ConstParam("B", 4), ScalarParam("eps", "float32")))
    with pytest.raises(ValueError, match="must come last"):
        VariantSpec("k", "norm", "f", "t", (ConstParam("B", 4), x))
    ok = VariantSpec("k", "norm", "f", "t", (x, ScalarParam("eps", "float32"), ConstParam("B", 4), ConstParam("R", 2)))
    assert ok.constants == {"B": 4, "R": 2}
    assert [p["kind"] for p in ok.params_json()] == ["array", "scalar", "constant", "constant"]


@pytest.mark.parametrize("dtype,vec", [("bfloat16", 8), ("float16", 8), ("float32", 4)])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_aligned_layout(dtype, vec, ndim):
    p = _spec.array("x", dtype, ndim, "aligned")
    assert vec == 16 // _spec.DTYPE_BYTES[dtype]
    assert p.stride_one == (ndim - 1,)
    assert p.shape_divisible_by == (1,) * (ndim - 1) + (16,)
    assert p.base_addr_divisible_by == 16
    assert p.stride_divisible_by == (vec,) * (ndim - 1) + (1,)
    assert p.index_dtype == "int32" and p.kind == "array" and p.ndim == ndim


def test_generic_layout_and_errors():
    g = _spec.array("x", "bfloat16", 2, "generic")
    assert g == ArrayParam("x", "bfloat16", 2)
    assert g.stride_one == () and g.stride_divisible_by == (1, 1) and g.shape_divisible_by == (1, 1)
    assert g.base_addr_divisible_by == 1
    with pytest.raises(ValueError, match="unknown layout"):
        _spec.array("x", "bfloat16", 2, "tma")
    with pytest.raises(ValueError, match="needs 2 entries"):
        ArrayParam("x", "bfloat16", 2, stride_divisible_by=(8,))


def test_next_power_of_2():
    assert [_spec.next_power_of_2(n) for n in (1, 2, 3, 64, 65, 1000, 4096, 4097)] == \
        [1, 2, 4, 64, 128, 1024, 4096, 8192]


def test_next_power_of_2_of_zero():
    assert _spec.next_power_of_2(0) == 1


def test_matrix_order_and_tags():
    every = kernel_src.all_variants()
    tags = [(s.kernel, s.tag) for s in every]
    assert len(tags) == len(set(tags))
    # The programmatic dependent launch twins (kernel_src/_pdl.py, tests/test_pdl.py) follow the rest.
    specs = [s for s in every if not s.constants.get("PDL")]
    # Within a kernel and dtype, every aligned variant precedes every generic one (preference order).
    # Families built for one layout only (attention: TMA tiles, bf16/fp16) carry no layout suffix.
    for kernel in {s.kernel for s in specs}:
        dtypes = {s.tag.split(".", 1)[0] for s in specs if s.kernel == kernel}
        # A dtype tag, "c32" after it where another operand is float32 (rope's OLMo 2 variants: cos/sin);
        # "i8" for a kernel of int8 arrays only (attention_mask_tiles: a boolean mask's bytes).
        assert dtypes and {d.removesuffix("c32") for d in dtypes} <= {"bf16", "fp16", "fp32", "i8"}, (kernel, dtypes)
        suffixes = {s.tag.rsplit(".", 1)[1] for s in specs if s.kernel == kernel}
        if not suffixes <= {"aligned", "generic"}:
            assert not suffixes & {"aligned", "generic"}, kernel  # all or nothing
            continue
        for d in dtypes:
            mine = [s for s in specs if s.kernel == kernel and s.tag.startswith(d + ".")]
            layouts = [s.tag.rsplit(".", 1)[1] for s in mine]
            assert layouts == sorted(layouts)  # "aligned" < "generic"
            assert layouts.count("aligned") > 0 and layouts.count("generic") > 0
            # Every request an aligned variant serves has a generic variant for inputs it refuses: the
            # tile width (the constants but ROWS), and a decode tile (ROWS=1) where one was asked for.
            tiles = {lay: [(tuple(sorted((k, v) for k, v in s.constants.items() if k != "ROWS")),
                            s.constants.get("ROWS") == 1) for s in mine if s.tag.endswith(lay)]
                     for lay in ("aligned", "generic")}
            assert {w for w, _ in tiles["aligned"]} == {w for w, _ in tiles["generic"]}, (kernel, d)
            assert {w for w, one in tiles["aligned"] if one} <= {w for w, one in tiles["generic"] if one}, (kernel, d)


def test_build_id_ignores_compile_times(tmp_path):
    # Two builds of one tree differ only in how long each variant took: same id.
    import json

    from cutile_kernels_build import _package_digest

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "ops.py").write_text("x = 1\n")
    manifest = {"format": 1, "variants": [{"kernel": "k", "variant": "v", "compile_s": 1.5, "cubin_bytes": 10}]}
    (pkg / "manifest.json").write_text(json.dumps(manifest))
    first = _package_digest(pkg)
    manifest["variants"][0]["compile_s"] = 9.25
    (pkg / "manifest.json").write_text(json.dumps(manifest, indent=1))
    assert _package_digest(pkg) == first
    manifest["variants"][0]["cubin_bytes"] = 11  # what the build holds does change it
    (pkg / "manifest.json").write_text(json.dumps(manifest))
    assert _package_digest(pkg) != first


def test_every_spec_and_sweep_candidate_names_its_functions_parameters():
    """Each VariantSpec of the build and of the GPU sweeps (dev/sweeps, compiled by hand for a device
    run) lists its device function's parameters by name and in order: a parameter added to a kernel
    (e.g. kernel_src/_pdl.py's ``PDL`` constant) that a spec misses would fail to compile there, or
    shift its constants."""
    import importlib

    from dev.sweeps import attention_sweep, decode_attention_sweep, decode_mask_sweep, decode_rows_sweep
    from dev.sweeps import gemv_sweep, norm_sweep

    specs = [*kernel_src.all_variants(), *gemv_sweep.candidates(), *norm_sweep.sweep_specs(),
             *decode_attention_sweep.candidates(), *attention_sweep.candidates(), *decode_mask_sweep.candidates(),
             *decode_rows_sweep.candidates()]
    for s in specs:
        module = importlib.import_module(s.module if "." in s.module else f"{kernel_src.__name__}.{s.module}")
        code = getattr(module, s.function)._pyfunc.__code__
        assert [p.name for p in s.params] == list(code.co_varnames[:code.co_argcount]), (s.module, s.function, s.tag)


def test_sass_compare_ignores_what_a_new_argument_moves_and_finds_a_changed_instruction(tmp_path):
    """dev/diagnostics/sass_compare.py over two fake builds (a stand-in nvdisasm prints each cubin's
    text): parameter offsets, the symbol and spacing do not count, an instruction does; a constant the
    old build lacks reads as 0, a variant it lacks is new."""
    import json
    import stat
    import sys

    from dev.diagnostics import sass_compare

    def build(name, variants):
        root = tmp_path / name / "torch-cuda" / "cutile_kernels"
        (root / "cubins").mkdir(parents=True)
        entries = []
        for i, (consts, text) in enumerate(variants):
            (root / "cubins" / f"{i}.cubin").write_text(text)
            entries.append({"kernel": "k", "arch": "sm_90", "constants": consts, "params": [{"dtype": "bfloat16"}],
                            "cubin": f"cubins/{i}.cubin"})
        (root / "manifest.json").write_text(json.dumps({"variants": entries}))
        return tmp_path / name

    fake = tmp_path / "nvdisasm"
    fake.write_text(f"#!{sys.executable}\nimport sys\nprint(open(sys.argv[-1]).read())\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    body = "/*0000*/ LDC R1, c[0x0][{off}] ;\n/*0010*/ IADD3 R2, R1, {imm}, RZ ;\n/*0020*/ RET.REL `({sym}) ;\n"
    old = build("old", [({"D": 64}, body.format(off="0x3c0", imm="0x1", sym="k_A")),
                        ({"D": 128}, body.format(off="0x3c0", imm="0x1", sym="k_B"))])
    new = build("new", [({"D": 64, "M": 0}, body.format(off="0x3e0", imm="0x1", sym="k_A2")),
                        ({"D": 128, "M": 0}, body.format(off="0x3e0", imm="0x2", sym="k_B2")),
                        ({"D": 64, "M": 1}, body.format(off="0x3e0", imm="0x1", sym="k_C"))])
    got = sass_compare.compare(old, new, "k", "sm_90", str(fake), {"M": 0})
    assert got == {"compared": 2, "differ": [{"D": 128, "M": 0}], "missing": []}
    assert sass_compare.compare(old, new, "k", "sm_90", str(fake), {"M": 1})["missing"] == [{"D": 64, "M": 1}]
