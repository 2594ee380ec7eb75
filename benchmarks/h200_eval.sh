#!/usr/bin/env bash
# Issue 14: evaluation on one H200 with a Qwen3-8B-shaped random target (about 5 minutes; 1 less
# when WORK_DIR already holds the target written by h200_pipeline.sh / make_random_target.py).
#  1. batched decoding throughput, 64 prompts x 256 new tokens, batch 64: plain greedy once, then
#     speculative with an untrained drafter and with an oracle drafter (eval_throughput.py);
#  2. a short training run (target and drafter co-located on GPU 0) with evaluations every 20 steps
#     in MODE (overlap: training goes on; pause: it waits) and one after training, 64 prompts x
#     256 tokens each, the baseline decoded once per run (the second reads it back); the training
#     time each costs is measured from the step log (eval_lost_time.py; goal: <= 60 s).
# Usage: benchmarks/h200_eval.sh [WORK_DIR] [STEPS] [MODE]; SKIP_THROUGHPUT=1 skips part 1.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
work=${1:-/tmp/dflash_bench}; steps=${2:-60}; mode=${3:-overlap}
mkdir -p "$work"
if [ -z "${SKIP_THROUGHPUT:-}" ]; then
echo "== batched decoding throughput"
python3 benchmarks/eval_throughput.py --prompts 64 --max-new-tokens 256 --batch-size 64 \
  2> "$work/eval_throughput.err" | tee "$work/eval_throughput.jsonl"
tail -3 "$work/eval_throughput.err"
fi
[ -d "$work/qwen3-8b-random" ] || python3 benchmarks/make_random_target.py "$work"
python3 - "$work" <<'PY'
import json, random, sys
from transformers import AutoTokenizer
work = sys.argv[1]
words = [w for w in AutoTokenizer.from_pretrained(f"{work}/qwen3-8b-random").get_vocab() if w.isalpha()]
rng = random.Random(0)
with open(f"{work}/eval_prompts.jsonl", "w") as f:  # 64 prompts of 40..400 words
    for _ in range(64):
        f.write(json.dumps({"prompt": " ".join(rng.choices(words, k=rng.randint(40, 400)))}) + "\n")
PY
echo "== evaluation during training ($steps steps, $mode evaluations every 20 steps, one at the end)"
env DFLASH_ENV_FILE=settings/qwen3_8b_1xh200.env DFLASH_TARGET__PATH="$work/qwen3-8b-random" \
    DFLASH_DATA__PATH="$work/synthetic.jsonl" DFLASH_OUTPUT_DIR="$work/eval_run" \
    DFLASH_TRAIN__MAX_STEPS="$steps" DFLASH_TRAIN__SAVE_EVERY=0 DFLASH_EVAL__EVERY=20 \
    DFLASH_EVAL__MODE="$mode" DFLASH_EVAL__JOB_MS=2000 DFLASH_EVAL__AT_END=true \
    DFLASH_EVAL__PROMPTS_PATH="$work/eval_prompts.jsonl" \
    DFLASH_EVAL__NUM_PROMPTS=64 DFLASH_EVAL__MAX_NEW_TOKENS=256 DFLASH_EVAL__BATCH_SIZE=64 \
    DFLASH_LOG__FORMAT=json python3 -m dflash_async run > "$work/eval_run.log" 2> "$work/eval_run.err"
echo "== rc=$?"
grep -E '"event": "(eval_ready|eval_skipped|eval_failed|startup_completed|train_completed|run_failed)"' \
  "$work/eval_run.log" | cut -c1-400
grep '"event": "eval"' "$work/eval_run.log" | cut -c1-1200
tail -3 "$work/eval_run.err"
python3 benchmarks/eval_lost_time.py "$work/eval_run.log"
[ -n "${OUT:-}" ] && cp "$work/eval_throughput.jsonl" "$work/eval_run.log" "$OUT/"
exit 0
