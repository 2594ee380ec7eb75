#!/usr/bin/env bash
# Issue 3: `python -m dflash_async run` with a Qwen3-8B-shaped random target on one H200
# (target and drafter workers on GPU 0) and on two (target on 0, drafter on 1).
# Usage: benchmarks/h200_pipeline.sh WORK_DIR STEPS [1gpu|2gpu|both]
set -uo pipefail
export PYTHONUNBUFFERED=1
work=${1:-/tmp/dflash_bench}; steps=${2:-40}; which=${3:-both}
[ -d "$work/qwen3-8b-random" ] || python3 benchmarks/make_random_target.py "$work"
common=(DFLASH_ENV_FILE=settings/qwen3_8b_1xh200.env DFLASH_TARGET__PATH="$work/qwen3-8b-random"
        DFLASH_DATA__PATH="$work/synthetic.jsonl" DFLASH_TRAIN__MAX_STEPS="$steps"
        DFLASH_TRAIN__SAVE_EVERY=0 DFLASH_EVAL__EVERY=0 DFLASH_LOG__FORMAT=json)
run() {  # name target_devices drafter_devices
  env "${common[@]}" DFLASH_OUTPUT_DIR="$work/$1" DFLASH_PIPELINE__TARGET_DEVICES="$2" \
      DFLASH_PIPELINE__DRAFTER_DEVICES="$3" python3 -m dflash_async run > "$work/$1.log" 2> "$work/$1.err"
  echo "== $1 rc=$?"
  grep -E '"(drafter_ready|startup_completed|train_completed|run_failed)"' "$work/$1.log" | cut -c1-600
  grep '"event": "step"' "$work/$1.log" | tail -3
  tail -3 "$work/$1.err"
  [ -n "${OUT:-}" ] && cp "$work/$1.log" "$OUT/$1.log"
}
[ "$which" != 2gpu ] && run pipeline_1gpu 0 0
[ "$which" != 1gpu ] && run pipeline_2gpu 0 1
exit 0
