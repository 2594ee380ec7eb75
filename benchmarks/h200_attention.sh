#!/usr/bin/env bash
# Issue 20: the drafter's flex_attention tile configurations on one H200, in under 5 minutes.
# benchmarks/research/attention_bench.py at the Qwen3-8B drafter shape (T=16384, 4 documents)
# with 1024 and 4096 anchors: per configuration one compile, forward and backward ms and MFU on
# the step's real block mask, and its output and gradients against torch's default tiles.
# Everything printed also lands in $OUT/attention.log.
# Usage: benchmarks/h200_attention.sh [configs, comma-separated; default: all] [anchor counts]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # for benchmarks/research
out=${OUT:-/tmp/dflash_bench/out}; mkdir -p "$out"
exec > >(tee -a "$out/attention.log") 2>&1
configs=${1:+--configs $1}
for anchors in ${2:-1024 4096}; do
  echo; echo "== attention_bench.py, $anchors anchors ($(date +%T))"
  # shellcheck disable=SC2086
  timeout 240 python3 benchmarks/research/attention_bench.py --num-anchors "$anchors" $configs \
    2>&1 | grep -vE 'Warning|warn\(|^\s*$' | cut -c1-600
done
echo; echo "== done ($(date +%T))"
