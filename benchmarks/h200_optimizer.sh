#!/usr/bin/env bash
# Issue 20: the drafter step's optimizer phase (phase B) alone on one H200, in under 3 minutes.
#   1. the CPU tests of the candidate sequences (benchmarks/research/tests/
#      test_optimizer_updates.py, ~2 s);
#   2. benchmarks/research/optimizer_bench.py at the Qwen3-8B drafter's 58 parameter tensors
#      (1.05 B fp32): today's sequence (DrafterStep._update), each piece alone, memory-speed
#      references (copy, one flat norm, one flat scale) and the candidate sequences, each
#      captured in a CUDA graph and replayed 20 times: ms, GB moved (analytic), GB/s, and each
#      full sequence's largest relative difference from today's after 3 steps (p, exp_avg,
#      exp_avg_sq, grad norm) against the derived tolerance; then the kernels one eager call of
#      each full sequence launches.
# Each part runs under its own `timeout`; everything printed also lands in $OUT/optimizer.log.
# Usage: benchmarks/h200_optimizer.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # for benchmarks/research
out=${OUT:-/tmp/dflash_bench/out}; mkdir -p "$out"
log="$out/optimizer.log"
exec > >(tee -a "$log") 2>&1
part() { echo; echo "== $1 ($(date +%T))"; }
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")'

part "1. the candidate sequences equal today's update (CPU tests)"
timeout 30 python3 -m pytest -q -p no:cacheprovider \
  benchmarks/research/tests/test_optimizer_updates.py 2>&1 | tail -3

part "2. phase B alone, Qwen3-8B drafter parameters, graph-replayed (table at the end)"
timeout 150 python3 benchmarks/research/optimizer_bench.py --shape qwen3-8b --replays 20 \
  --kernels 2>&1 | grep -vE 'Warning|warn\(|^\s*$' | cut -c1-900

part "done"
