#!/usr/bin/env bash
# The whole GPU check for RoPE and the decoder add + RMSNorm patch (issue 3), on the H200.
#
# On this machine, before the device run (from the project root):
#   ../shared/device/prepare.sh            # wheels the GPU machine lacks -> .device/
#   cutile-kernels build --arch sm_90      # every family, so the patch's add_rms_norm has cubins too
# Device run (carry .device and build):
#   run(command="source scripts/device-setup.sh && bash benchmarks/device_rope.sh $OUT",
#       carry=[".device", "build"], timeout_s=600)
# Writes to $1 (default $OUT, else /tmp/rope-out): gpu-tests.log, rope-bench.json, rope-bench.log.
set -uo pipefail
out="${1:-${OUT:-/tmp/rope-out}}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
python3 -c "import cutile_kernels as c; assert c.registry.find_package_dir(), 'no build: carry build/'; \
print('build', c.registry.find_package_dir())" || exit 1
status=0
timeout 360 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_rope.py tests/test_patch.py 2>&1 \
  | tee "$out/gpu-tests.log" | tail -40
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout 200 python3 benchmarks/rope_bench.py --json "$out/rope-bench.json" 2>&1 | tee "$out/rope-bench.log" | tail -20
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
