#!/usr/bin/env bash
# The GPU checks of one session as stages, several per device call (each call has 600 s):
#
#   tests      the `gpu`-marked tests ($TESTS, default: all of tests/; $TESTS_K a `-k` expression, which
#              $TESTS cannot carry: it is split at spaces), $TESTS_LIMIT s (default 240)
#   attention  the attention microbenchmark (dev/microbench/attention_bench.py $ATTENTION_ARGS, e.g. --prefill
#              for the masked prefills only), attention-bench.json
#   gemv       one-row projections, every built GEMV tile against cuBLAS on the presets' shapes
#              (dev/microbench/gemv_bench.py); gemv.log holds the table
#   evaluate   every inventory Solution through `cutile-kernels evaluate --all` (one process):
#              Traces and the summary come back in evaluate.tgz
#   kernels    `cutile-kernels kernel-table`: every kernel against the stock code path on the presets'
#              shapes (device time, eager time, roofline fraction); table and JSON in kernels.tgz
#   attnsweep  the attention prefill tile sweep (dev/sweeps/attention_sweep.py run), $ATTNSWEEP_LIMIT s
#              (default 500; its rows print as they finish; $ATTENTION_SWEEP_SHAPES picks shapes,
#              $ATTENTION_SWEEP_TAGS candidates, $ATTENTION_SWEEP_WATCHDOG s ends a stuck run with its stack), over
#              the candidates compiled on the dev machine and carried as .device/attn-sweep.tgz:
#                python -m dev.sweeps.attention_sweep export --out /tmp/sweep-attn &&
#                tar czf .device/attn-sweep.tgz -C /tmp sweep-attn
#   normsweep  the RMSNorm / fused add + RMSNorm tile sweep (dev/sweeps/norm_sweep.py run), $NORMSWEEP_LIMIT s
#              (default 300; $NORM_SWEEP_SHAPES, e.g. 512x2048,512x3072, and $NORM_SWEEP_KINDS pick a subset),
#              over the candidates compiled on the dev machine and carried as .device/norm-sweep.tgz:
#                python dev/sweeps/norm_sweep.py export --out /tmp/sweep-norm &&
#                tar czf .device/norm-sweep.tgz -C /tmp sweep-norm
#   hostops    per-call host time of our ops on the GPU, with cuBLAS, SDPA and our bare launch for
#              scale (benchmarks/host_overhead.py --real, $CALLS calls each); host-ops.json
#   hostprof   where the host time of an eager prefill of $MODEL goes, stock and ours
#              (dev/diagnostics/host_profile.py: cProfile, synchronizing calls, $DRIFT prefills GC on/off;
#              also ours with the opt-in patches $HOSTPROF_INCLUDE)
#   hostab     the same paths timed against each other in one process, $ROUNDS_AB rounds of one prefill
#              each in rotating order (host_profile.py --interleave; $HOSTPROF_EXCLUDE adds ours without those
#              default patches): a drifting host slows all alike;
#              hostab-$MODEL.log
#   rank       autokernelize's ranking of $MODEL's uncovered regions on the GPU (default llama-3.2-1b)
#   score      `autokernelize $MODEL --score $CANDIDATE`: evaluate, then the bench of stock and
#              our build without / with the candidate (cutile~NAME and cutile, or cutile and
#              cutile+NAME for an opt-in patch), $SCORE_ARGS added; the results log and the bench report
#              come back
#   bench      `cutile-kernels bench` of $PRESETS (default: llama-3.2-1b qwen3-0.6b), paths
#              $PATHS (default: stock cutile), decode b=1 and 16, $ROUNDS rounds (default 3); one .tgz per preset
#              (a bench its limit cut leaves bench.partial.json: the timing rounds it finished)
#   staticgen  transformers' `generate(..., cache_implementation="static")` (its own compile) of $PRESETS
#              (default: llama-3.2-1b qwen3-0.6b), paths $PATHS (default: stock cutile) in alternating
#              processes, $ROUNDS rounds (benchmarks/static_generate.py $STATICGEN_ARGS); staticgen.log,
#              one JSON line a run
#   ab         dev/diagnostics/graph_step_ab.py in alternating processes: for each of $ROUNDS rounds (default 2),
#              each variant of $AB_VARIANTS (default: none twins) with the graph_step arguments $AB_ARGS
#              (default: llama-3.2-1b --path cutile-compile --batch 1 16 --steps 60 --host --top 0), $AB_LIMIT s
#              in all (default 400); ab.log holds every run's output, each JSON line tagged with its variant.
#              For a switch the compiled step reads while dynamo traces, abcompiled is fairer (one process)
#   abcompiled dev/diagnostics/graph_step.py --ab-compiled NAME for each NAME of $ABC_SWITCHES (default: residual;
#              graph_step.COMPILED_SWITCHES): the compiled step as shipped and with the switch flipped in one
#              process, alternating rounds, with the arguments $ABC_ARGS (default: llama-3.2-1b --path cutile-compile
#              --batch 1 16 --steps 40 --top 0), $ABC_LIMIT s in all (default 400); abcompiled.log
#   notebooks  every cell of the example notebooks (benchmarks/device_notebooks.sh), notebooks.tgz
#
# On the dev machine first (see /work/shared/device/README.md and benchmarks/device_notebooks.sh):
#   ../shared/device/prepare.sh <wheels>; bash benchmarks/device_notebooks.sh prepare
#   cutile-kernels build --arch sm_90 --out /tmp/b90/build && tar cJf .device/build.txz -C /tmp/b90 build
# then e.g.
#   run(command="source scripts/device-setup.sh && TESTS=tests/test_patch.py bash benchmarks/device_session.sh tests evaluate",
#       carry=[".device"])
# At most 8 files come back per call: every stage writes one log (<stage>.log) and at most one .tgz.
set -uo pipefail
: "${OUT:?set by the device tool}"
[ $# -gt 0 ] || { echo "usage: $0 STAGE... (tests attention gemv attnsweep normsweep evaluate kernels hostops hostprof hostab rank score bench staticgen ab abcompiled notebooks)" >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
status=0
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, keep going
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "=== $name (limit ${limit}s)"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$name.log"
    tail -15 "$OUT/$name.log"
    [ "$rc" -eq 0 ] || [ "$status" -gt 1 ] || status=1
}
for stage in "$@"; do
  case "$stage" in
    tests)
      cd "$root" && step tests "${TESTS_LIMIT:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider \
          ${TESTS_K:+-k "$TESTS_K"} ${TESTS:-tests} ;;
    attention)
      cd "$root/dev/microbench" && step attention "${ATTENTION_LIMIT:-100}" python3 attention_bench.py \
          --json "$OUT/attention-bench.json" ${ATTENTION_ARGS:-} ;;
    gemv)
      cd "$root" && step gemv 150 python3 dev/microbench/gemv_bench.py ;;
    evaluate)
      rm -rf /tmp/eval && mkdir -p /tmp/eval
      cd "$root" && step evaluate 300 python3 -m cutile_kernels_tools.cli evaluate --all --root inventory \
          --device cuda --repeats ${EVAL_REPEATS:-30} --out /tmp/eval/dataset --summary /tmp/eval/summary.json
      tar czf "$OUT/evaluate.tgz" -C /tmp/eval . ;;
    kernels)
      rm -rf /tmp/kt && mkdir -p /tmp/kt
      cd "$root" && step kernels 150 python3 -m cutile_kernels_tools.cli kernel-table --out /tmp/kt/kernel-table.md \
          --json /tmp/kt/kernel-table.json
      tar czf "$OUT/kernels.tgz" -C /tmp/kt . ;;
    attnsweep)
      [ -f "$root/.device/attn-sweep.tgz" ] || { echo "attnsweep: carry .device/attn-sweep.tgz" >&2; status=2; continue; }
      rm -rf /tmp/sweep-attn && tar xzf "$root/.device/attn-sweep.tgz" -C /tmp
      cd "$root" && step attnsweep "${ATTNSWEEP_LIMIT:-500}" python3 -m dev.sweeps.attention_sweep run --dir /tmp/sweep-attn \
          --json "$OUT/attention-sweep.json" ;;
    normsweep)
      [ -f "$root/.device/norm-sweep.tgz" ] || { echo "normsweep: carry .device/norm-sweep.tgz" >&2; status=2; continue; }
      rm -rf /tmp/sweep-norm && tar xzf "$root/.device/norm-sweep.tgz" -C /tmp
      cd "$root" && step normsweep "${NORMSWEEP_LIMIT:-300}" python3 -m dev.sweeps.norm_sweep run --dir /tmp/sweep-norm \
          --json "$OUT/norm-sweep.json" ;;
    hostops)
      cd "$root" && step hostops 120 python3 benchmarks/host_overhead.py --real --calls ${CALLS:-20000} \
          --json "$OUT/host-ops.json" ;;
    hostprof)
      cd "$root/dev/diagnostics" && step hostprof 120 python3 host_profile.py "${MODEL:-llama-3.2-1b}" --sync-debug --drift ${DRIFT:-40} \
          ${HOSTPROF_INCLUDE:+--include $HOSTPROF_INCLUDE} ;;
    hostab)
      cd "$root/dev/diagnostics" && step "hostab-${MODEL:-llama-3.2-1b}" 150 python3 host_profile.py "${MODEL:-llama-3.2-1b}" --interleave ${ROUNDS_AB:-60} \
          ${HOSTPROF_INCLUDE:+--include $HOSTPROF_INCLUDE} ${HOSTPROF_EXCLUDE:+--exclude $HOSTPROF_EXCLUDE} ;;
    rank)
      cd /tmp && step rank 90 python3 -m cutile_kernels_tools.cli autokernelize "${MODEL:-llama-3.2-1b}" --top 12 \
          --json /tmp/rank.json ;;
    score)
      [ -n "${CANDIDATE:-}" ] || { echo "score: set CANDIDATE to the Definition or Solution to score" >&2; status=2; continue; }
      rm -rf /tmp/score /tmp/autokernelize.tsv
      cp "$root/benchmarks/results/autokernelize.tsv" /tmp/autokernelize.tsv 2>/dev/null || true
      cd "$root" && step score "${SCORE_LIMIT:-300}" python3 -m cutile_kernels_tools.cli autokernelize "${MODEL:-llama-3.2-1b}" \
          --score "$CANDIDATE" --log /tmp/autokernelize.tsv --description "${DESCRIPTION:-}" \
          --decode-batch 1 16 --rounds 3 ${SCORE_ARGS:-} --bench-out /tmp/score/bench --quiet
      mkdir -p /tmp/score && cp /tmp/autokernelize.tsv /tmp/score/ 2>/dev/null
      cp -r "$root/inventory/traces" /tmp/score/ 2>/dev/null
      tar czf "$OUT/score.tgz" -C /tmp/score . ;;
    bench)
      cd /tmp
      for preset in ${PRESETS:-llama-3.2-1b qwen3-0.6b}; do
        rm -rf "/tmp/bench/$preset"
        step "bench-$preset" "${BENCH_LIMIT:-200}" python3 -m cutile_kernels_tools.cli bench "$preset" \
            --paths ${PATHS:-stock cutile} --decode-batch 1 16 --rounds ${ROUNDS:-3} ${BENCH_ARGS:-} --out "/tmp/bench/$preset" --quiet
        [ -d "/tmp/bench/$preset" ] && tar czf "$OUT/bench-$preset.tgz" -C /tmp/bench "$preset"
      done ;;
    staticgen)
      cd "$root" && step staticgen "${STATICGEN_LIMIT:-300}" bash -c '
        for r in $(seq ${ROUNDS:-2}); do for preset in ${PRESETS:-llama-3.2-1b qwen3-0.6b}; do
          for p in ${PATHS:-stock cutile}; do python3 benchmarks/static_generate.py "$preset" --path "$p" ${STATICGEN_ARGS:-} || exit 1; done
        done; done' ;;
    ab)
      cd "$root" && step ab "${AB_LIMIT:-400}" bash -c 'set -o pipefail
        for r in $(seq ${ROUNDS:-2}); do for v in ${AB_VARIANTS:-none twins}; do
          echo "--- round $r AB=$v"
          AB=$v python3 dev/diagnostics/graph_step_ab.py ${AB_ARGS:-llama-3.2-1b --path cutile-compile --batch 1 16 \
              --steps 60 --host --top 0} 2>&1 | grep -v "it/s\]" | sed "s/^{/{\"ab\": \"$v\", \"round\": $r, /" || exit 1
        done; done' ;;
    abcompiled)
      cd "$root" && step abcompiled "${ABC_LIMIT:-400}" bash -c 'set -o pipefail
        for s in ${ABC_SWITCHES:-residual}; do
          echo "--- --ab-compiled $s"
          python3 dev/diagnostics/graph_step.py ${ABC_ARGS:-llama-3.2-1b --path cutile-compile --batch 1 16 \
              --steps 40 --top 0} --ab-compiled "$s" 2>&1 | grep -v "it/s\]" || exit 1
        done' ;;
    notebooks)
      rm -rf /tmp/nb && mkdir -p /tmp/nb && OUT=/tmp/nb step nb 330 bash "$root/benchmarks/device_notebooks.sh"
      cp /tmp/nb/nb.log "$OUT/notebooks.log"; tar czf "$OUT/notebooks.tgz" -C /tmp/nb . ;;
    *) echo "unknown stage $stage" >&2; status=2 ;;
  esac
done
exit $status
