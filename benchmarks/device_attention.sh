#!/usr/bin/env bash
# The whole GPU check for attention (issue 3, part 4) on the H200: the GPU tests of
# tests/test_attention.py, then the microbenchmark against transformers' sdpa attention.
#
# On this machine, before the device run (from the project root):
#   ../shared/device/prepare.sh                                  # wheels the GPU lacks -> .device/
#   cutile-kernels build --arch sm_90                            # every family (attention: 30 variants)
# Device run (carry .device and build):
#   run(command="source scripts/device-setup.sh && bash benchmarks/device_attention.sh $OUT",
#       carry=[".device", "build"], timeout_s=600)
# Writes to $1 (default $OUT, else /tmp/attention-out): gpu-tests.log, attention-bench.json,
# attention-bench.log.
set -uo pipefail
out="${1:-${OUT:-/tmp/attention-out}}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
python3 - <<'PY' || exit 1
import cutile_kernels as c
pkg = c.registry.find_package_dir()
assert pkg, "no build: carry build/"
names = {v.kernel for v in c.registry.registry().variants(arch="sm_90")}
assert {"attention", "attention_combine"} <= names, f"the build lacks the attention kernels: {sorted(names)}"
print("build", pkg)
PY
status=0
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention.py 2>&1 \
  | tee "$out/gpu-tests.log" | tail -40
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout 220 python3 benchmarks/attention_bench.py --json "$out/attention-bench.json" 2>&1 \
  | tee "$out/attention-bench.log" | tail -70
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
