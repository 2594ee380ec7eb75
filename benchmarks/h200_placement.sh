#!/usr/bin/env bash
# Issue 11 on one H200 (about 4 minutes of GPU time, most of it creating the 16 GB random target
# and compiling):
#   1. `run` with layout auto on GPU 0 at the Qwen3-8B shape (settings/qwen3_8b_1xh200.env, 40
#      steps): the `placement` event (calibrated stage rates, predicted tokens/s per GPU) and the
#      measured tokens/s, GPU busy and node MFU of the last steps; compare with 19.9k tokens/s.
#   2. pytest -m gpu tests/test_placement_gpu.py: two target + two drafter workers on GPU 0 (tiny
#      target, CUDA graphs) end every step with equal weights; the gradient combine makes no host
#      sync. (The one-pair-per-GPU cases skip on one GPU.)
#   3. with `all`: the same two pairs on GPU 0 at the Qwen3-8B shape, 10 steps (adds ~2 minutes).
# Usage: benchmarks/h200_placement.sh WORK_DIR [STEPS] [all]
set -uo pipefail
export PYTHONUNBUFFERED=1
work=${1:-/tmp/dflash_bench}; steps=${2:-40}; which=${3:-}
[ -d "$work/qwen3-8b-random" ] || python3 benchmarks/make_random_target.py "$work"
common=(DFLASH_ENV_FILE=settings/qwen3_8b_1xh200.env DFLASH_TARGET__PATH="$work/qwen3-8b-random"
        DFLASH_DATA__PATH="$work/synthetic.jsonl" DFLASH_TRAIN__SAVE_EVERY=0 DFLASH_EVAL__EVERY=0
        DFLASH_EVAL__AT_END=false DFLASH_LOG__FORMAT=json)
summary() {  # the placement event and the mean of the last 10 step lines
  python3 - "$1" <<'EOF'
import json, sys
events = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for e in events:
    if e["event"] in ("placement", "drafter_ready", "startup_completed", "run_failed"):
        print(json.dumps(e)[:900])
steps = [e for e in events if e["event"] == "step"][-10:]
if steps:
    mean = lambda k: sum(e[k] for e in steps) / len(steps)
    print(f"last {len(steps)} steps: tokens/s {mean('tokens_per_s'):.0f} (19.9k before), "
          f"demand {mean('demand_tokens_per_s'):.0f}, step_ms {mean('step_ms'):.0f}, "
          f"node_mfu {mean('node_mfu'):.3f}, drafter mfu {mean('mfu'):.3f}, "
          f"target_busy {mean('target_busy'):.2f}, drafter_busy {mean('drafter_busy'):.2f}, "
          f"gpu_busy {steps[-1]['gpu_busy']}, slot_queues {steps[-1]['slot_queues']}, "
          f"mem_gib {steps[-1]['mem_gib']:.1f}")
EOF
}
run() {  # name devices max_steps
  env "${common[@]}" DFLASH_OUTPUT_DIR="$work/$1" DFLASH_PIPELINE__LAYOUT=auto \
      DFLASH_PIPELINE__DEVICES="$2" DFLASH_TRAIN__MAX_STEPS="$3" \
      python3 -m dflash_async run > "$work/$1.log" 2> "$work/$1.err"
  echo "== $1 rc=$?"
  summary "$work/$1.log"
  tail -3 "$work/$1.err"
  [ -n "${OUT:-}" ] && cp "$work/$1.log" "$OUT/$1.log"
}
run placement_auto_1gpu 0 "$steps"
echo "== pytest -m gpu tests/test_placement_gpu.py"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_placement_gpu.py 2>&1 | tail -5
[ "$which" = all ] && run placement_two_pairs_1gpu 0,0 10
exit 0
