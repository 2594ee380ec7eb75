#!/usr/bin/env bash
# Issues 29 and 31: co-located pipeline runs on one H200 with targets too big for the machine's
# 64 GiB disk (and, in bf16, its 128 GB of host RAM), drawn in the run from config.json alone
# (DFLASH_TARGET__WEIGHTS=random: dflash_async/targets/random_weights.py, layer by layer on the
# GPU, each layer swapped to FP8 before the next with QUANTIZE=fp8).
#   35b        Qwen3.5-35B-A3B shape (bench target's shape_configs()["qwen3.5-35b-a3b"]), bf16
#              (~69 GB of weights), STEPS steps (issue 29: 100): tokens/s and node MFU
#   35b-fp8    the same target with QUANTIZE=fp8 (~35 GB; issue 31's FP8 pipeline row)
#   8b         Qwen3-8B shape, bf16 (the 1xH200 preset's own target; the baseline of 8b-fp8)
#   8b-fp8     the same with QUANTIZE=fp8 (issue 31: the co-located pipeline with an FP8 target)
#   next80b    Qwen3-Next-80B-A3B shape with QUANTIZE=fp8 (~80 GB e4m3 + 0.6 GB bf16 embeddings;
#              160 GB in bf16 would not fit): the largest target that fits one H200 beside its
#              drafter (issue 31: 50 steps)
# Usage: [RUN_TIMEOUT=s] benchmarks/h200_random.sh WORK_DIR CASE [STEPS]   (CASE: 8b | 8b-fp8 | 35b | 35b-fp8 | next80b)
# Needs flash-linear-attention (+ causal-conv1d) for the packed hybrid path, as h200_hybrid.sh.
set -uo pipefail
export PYTHONUNBUFFERED=1
work=${1:-/tmp/dflash_bench}; case=${2:-35b}; steps=${3:-100}
out=${OUT:-$work/out}; mkdir -p "$work" "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export FLA_CACHE_MODE=default FLA_CONFIG_DIR="$PWD/benchmarks/fla_configs"  # fixed fla configs
case "$case" in
  8b) shape=qwen3-8b; quantize=none ;;
  8b-fp8) shape=qwen3-8b; quantize=fp8 ;;
  35b) shape=qwen3.5-35b-a3b; quantize=none ;;
  35b-fp8) shape=qwen3.5-35b-a3b; quantize=fp8 ;;
  next80b) shape=qwen3-next-80b-a3b; quantize=fp8 ;;
  *) echo "unknown case $case (8b | 8b-fp8 | 35b | 35b-fp8 | next80b)"; exit 2 ;;
esac
target="$work/$shape-config"  # config.json + tokenizer only: seconds, a few KB
[ -d "$target" ] || python3 benchmarks/make_random_target.py "$work" --shape "$shape" --config-only
name="random_${case}_${steps}"
env DFLASH_ENV_FILE=settings/qwen3_8b_1xh200.env DFLASH_TARGET__PATH="$target" \
    DFLASH_TARGET__WEIGHTS=random DFLASH_TARGET__QUANTIZE="$quantize" \
    DFLASH_DATA__PATH="$work/synthetic.jsonl" DFLASH_TRAIN__MAX_STEPS="$steps" \
    DFLASH_TRAIN__SAVE_EVERY=0 DFLASH_EVAL__EVERY=0 DFLASH_EVAL__AT_END=false \
    DFLASH_OUTPUT_DIR="$work/$name" DFLASH_LOG__FORMAT=json \
    timeout "${RUN_TIMEOUT:-590}" python3 -m dflash_async run > "$work/$name.log" 2> "$work/$name.err"
echo "== $name rc=$?"
grep -E '"(target_weights_loaded|target_path_chosen|placement|drafter_ready|startup_completed|train_completed|run_failed)"' \
  "$work/$name.log" | cut -c1-700
grep '"event": "step"' "$work/$name.log" | tail -3
tail -5 "$work/$name.err"
cp "$work/$name.log" "$work/$name.err" "$out/" 2>/dev/null
exit 0
