#!/usr/bin/env bash
# The SwiGLU GPU check on the H200, in one device run: the GPU tests of tests/test_activation.py
# and tests/test_mlp.py, then benchmarks/swiglu_bench.py (silu_and_mul vs F.silu(g)*u, both tile
# configs, and the fused MLP vs LlamaMLP; CUDA-event medians and GB/s).
#
# On your machine: ../shared/device/prepare.sh (stages .device/) and a build with the activation
# kernels, e.g. `cutile-kernels build --arch sm_90` (into build/). Then one device run:
#   run(command="source scripts/device-setup.sh && bash benchmarks/device_swiglu.sh",
#       carry=[".device", "build"])
# Results land in $OUT (swiglu-gpu-tests.log, swiglu-bench.log, swiglu-bench.json).
# Exit status: the tests' (the benchmark runs either way, with fallbacks made errors).
set -uo pipefail
OUT="${OUT:-/tmp/swiglu-out}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
python3 -c "import cutile_kernels as ck; from cutile_kernels import registry; r = registry.registry(); \
print('build', r.pkg_dir, 'archs', r.archs, 'activation kernels', sorted({v.kernel for v in r.variants()} & {'silu', 'silu_and_mul', 'silu_and_mul_fused'}))"
python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_activation.py tests/test_mlp.py 2>&1 | tee "$OUT/swiglu-gpu-tests.log"
rc=${PIPESTATUS[0]}
CUTILE_KERNELS_STRICT=1 python3 benchmarks/swiglu_bench.py --json "$OUT/swiglu-bench.json" 2>&1 | tee "$OUT/swiglu-bench.log"
exit "$rc"
