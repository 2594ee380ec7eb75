#!/usr/bin/env bash
# Issue 16: a Qwen3-8B-shaped run on one H200 (target and drafter workers on GPU 0, preset
# settings/qwen3_8b_1xh200.env, random bf16 target as in h200_pipeline.sh) and its report:
# report.html + PNGs + summary.json (+ the run's log.jsonl and settings.json) in $OUT/report
# (or WORK_DIR/report). Commit that folder as docs/report/. About 6 minutes for 240 steps.
# Usage: benchmarks/h200_report.sh WORK_DIR [STEPS]
set -uo pipefail
export PYTHONUNBUFFERED=1
work=${1:-/tmp/dflash_bench}; steps=${2:-240}
[ -d "$work/qwen3-8b-random" ] || python3 benchmarks/make_random_target.py "$work"
run_dir="$work/report_run"; rm -rf "$run_dir"
tb=(); python3 -c "import tensorboard" 2>/dev/null && tb=(DFLASH_LOG__TENSORBOARD_DIR="$run_dir/tb")
env DFLASH_ENV_FILE=settings/qwen3_8b_1xh200.env DFLASH_TARGET__PATH="$work/qwen3-8b-random" \
    DFLASH_DATA__PATH="$work/synthetic.jsonl" DFLASH_TRAIN__MAX_STEPS="$steps" \
    DFLASH_TRAIN__SAVE_EVERY=100 DFLASH_EVAL__EVERY=0 DFLASH_LOG__FORMAT=json \
    DFLASH_LOG__EVERY=20 DFLASH_OUTPUT_DIR="$run_dir" "${tb[@]}" \
    python3 -m dflash_async run > "$work/report_run.stdout" 2> "$work/report_run.err"
echo "== run rc=$?"; tail -3 "$work/report_run.err"
out="${OUT:-$work}/report"
python3 -m dflash_async report "$run_dir" --out "$out"
cp "$run_dir/log.jsonl" "$run_dir/settings.json" "$out/"
[ -d "$run_dir/tb" ] && echo "tensorboard files: $(ls "$run_dir/tb")"
cat "$out/summary.json"
