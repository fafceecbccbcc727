"""Whether two builds compiled a kernel's variants to the same machine code.

For every variant of ``KERNEL`` in the new build (``cutile-kernels build --out DIR``) for ``--arch``, the
variant of the old build with the same constants and parameter dtypes, both disassembled with nvdisasm
(from the ``nvidia-cuda-nvdisasm`` wheel or a CUDA toolkit; ``--nvdisasm`` gives its path). Instructions
are compared after dropping what a new argument moves without changing the code: constant-bank offsets
of the parameters (``c[0x0][...]``), the kernel's own symbol and spacing. A change that must leave a
shipped variant's code alone (a new constant whose other value is a new variant, an argument the old
variants do not read) shows up here as zero differing variants::

    python dev/diagnostics/sass_compare.py /tmp/old/build /tmp/new/build rope_append_attention --where MASKED=0
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from pathlib import Path

_PARAM = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")
_SYMBOL = re.compile(r"`\(\w+\)")
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);")


def variants(build: Path, kernel: str, arch: str) -> dict[tuple, Path]:
    """``{(sorted constants, parameter dtypes): cubin path}`` of ``kernel``'s variants for ``arch`` in a
    build directory (its ``torch-cuda/cutile_kernels/manifest.json``)."""
    root = Path(build) / "torch-cuda" / "cutile_kernels"
    manifest = json.loads((root / "manifest.json").read_text())
    return {(tuple(sorted(v["constants"].items())), tuple(p.get("dtype") for p in v["params"])): root / v["cubin"]
            for v in manifest["variants"] if v["kernel"] == kernel and v["arch"] == arch}


def instructions(cubin: Path, nvdisasm: str) -> list[str]:
    """The cubin's instructions, parameter offsets, the kernel symbol and spacing normalised away."""
    text = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    return [" ".join(_SYMBOL.sub("`(SYM)", _PARAM.sub("c[P]", i)).split()) for i in _INSTRUCTION.findall(text)]


def compare(old: Path, new: Path, kernel: str, arch: str, nvdisasm: str, where: dict[str, int]) -> dict:
    """``{"compared": n, "differ": [tags...], "missing": [keys...]}`` over the new build's variants
    whose constants include ``where``; a variant the old build lacks is ``missing`` (a new one)."""
    before, after = variants(old, kernel, arch), variants(new, kernel, arch)
    out = {"compared": 0, "differ": [], "missing": []}
    for key, cubin in sorted(after.items()):
        consts = dict(key[0])
        if any(consts.get(k, 0) != v for k, v in where.items()):
            continue
        # the old build had no such constant where a new one defaults to 0
        old_key = next((k for k in before if k[1][:1] == key[1][:1] and all(
            dict(k[0]).get(c, 0) == v for c, v in consts.items())), None)
        if old_key is None:
            out["missing"].append(consts)
            continue
        out["compared"] += 1
        if instructions(before[old_key], nvdisasm) != instructions(cubin, nvdisasm):
            out["differ"].append(consts)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path, help="the earlier build directory")
    ap.add_argument("new", type=Path, help="the later build directory")
    ap.add_argument("kernel", help="kernel name, e.g. rope_append_attention")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--where", nargs="*", default=[], metavar="NAME=VALUE",
                    help="only variants with these constants (a constant the old build lacks reads as 0)")
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
    args = ap.parse_args(argv)
    where = {k: int(v) for k, v in (w.split("=", 1) for w in args.where)}
    result = compare(args.old, args.new, args.kernel, args.arch, args.nvdisasm, where)
    print(json.dumps(result))
    if result["differ"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
