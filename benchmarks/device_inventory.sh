#!/usr/bin/env bash
# Evaluate every Solution of the kernel inventory on the GPU and bring back the Traces.
#
# On your machine, in the checkout (see /work/shared/device/README.md):
#   ../shared/device/prepare.sh pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
#   cutile-kernels build --arch sm_90          # the cubins the runtime launches (carried as build/)
#   cutile-kernels inventory validate          # sources in sync: evaluate refuses stale Solutions
# then one device run from the checkout root:
#   run(command="source scripts/device-setup.sh && bash benchmarks/device_inventory.sh",
#       carry=[".device", "build"], timeout_s=600)
# Arguments, if any, name the Solutions to evaluate (default: all of them), e.g. to split the
# inventory over two runs of the 600 s limit:
#   ... bash benchmarks/device_inventory.sh attention_cutile attention_combine_cutile
#
# Each Solution is evaluated in its own process (`python3 -m cutile_kernels_tools.cli evaluate`,
# CUTILE_KERNELS_STRICT semantics inside: a fallback fails the run), so one crash does not hide the
# others. Comes back in $OUT (3 files, the device returns at most 8):
#   evaluate.log          what each evaluation printed (stages, per-workload latency and speedup)
#   evaluate-summary.tgz  one JSON summary per Solution (stages, status, traces)
#   traces.tgz            traces/<family>/<definition>.jsonl, FlashInfer-Bench Traces to merge
#                         into inventory/traces/ (tar xzf traces.tgz -C inventory)
set -uo pipefail
: "${OUT:?OUT must be set (the device run sets it)}"
work=$(mktemp -d)
mkdir -p "$work/dataset" "$work/summary"
status=0
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 2
solutions="$*"
[ -n "$solutions" ] || solutions=$(python3 -c "
import pathlib
from cutile_kernels_tools import inventory
print(' '.join(sorted(inventory.Inventory.load(pathlib.Path('inventory')).solutions)))")
echo "solutions: $solutions" | tee "$OUT/evaluate.log"
for s in $solutions; do
  echo "=== $s" | tee -a "$OUT/evaluate.log"
  python3 -m cutile_kernels_tools.cli evaluate "$s" --root inventory --device cuda \
      --out "$work/dataset" --summary "$work/summary/$s.json" 2>&1 | tee -a "$OUT/evaluate.log"
  rc=${PIPESTATUS[0]}
  echo "exit $rc" | tee -a "$OUT/evaluate.log"
  [ "$rc" -ne 0 ] && status=1
  # Packed after every Solution: a run stopped at its time limit still brings back what it did.
  tar czf "$OUT/traces.tgz" -C "$work/dataset" traces 2>/dev/null
  tar czf "$OUT/evaluate-summary.tgz" -C "$work/summary" .
done
[ -f "$OUT/traces.tgz" ] || echo "no traces written" | tee -a "$OUT/evaluate.log"
exit $status
