#!/usr/bin/env bash
# The wave-2 figures that fit one 10-minute call on one H200, in priority order, each part under
# its own time limit so that one slow part cannot starve the others:
#   1. the Qwen3-8B-shaped random target and synthetic data (make_random_target.py);
#   2. a 200-step run with the 1xH200 preset (co-located, packed target, graph step, a training
#      checkpoint every 100 steps) and its report (h200_report.sh): the pipeline tokens/s, node
#      MFU, the placement event, checkpoint time and size, docs/report/;
#   3. the GPU tests of the paths this wave changed (drafter step with the library clip, two
#      co-located pairs on one GPU, no host sync in target and drafter steps, packed dense/MoE).
# Usage: benchmarks/h200_wave2.sh WORK_DIR report|tests; everything it prints also lands in
# $OUT/wave2-PART.log, the report folder in $OUT/report.tgz. `report` takes about 7 minutes,
# `tests` about 3.
set -uo pipefail
export PYTHONUNBUFFERED=1
work=${1:-/tmp/dflash_bench}; which=${2:-report}; out=${OUT:-$work/out}; mkdir -p "$work" "$out"
exec > >(tee -a "$out/wave2-$which.log") 2>&1
part() { echo; echo "== $1 ($(date +%T))"; }

if [ "$which" = report ]; then
part "random target"
[ -d "$work/qwen3-8b-random" ] || timeout 170 python3 benchmarks/make_random_target.py "$work"

part "200-step co-located run and its report"
OUT="$work/report_out" timeout 330 bash benchmarks/h200_report.sh "$work" 200
grep -E '"event": "(placement|target_path_chosen|drafter_ready|startup_completed|checkpoint_written|export_written|train_completed|run_summary)"' \
  "$work/report_run/log.jsonl" | cut -c1-700
tar -C "$work/report_out" -czf "$out/report.tgz" report
fi

if [ "$which" = tests ]; then
part "GPU tests"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -k "not hybrid" \
  tests/test_placement_gpu.py tests/test_no_host_sync.py tests/test_target_packed.py \
  tests/test_gpu_drafter.py 2>&1 | tail -15
fi
part "done"
