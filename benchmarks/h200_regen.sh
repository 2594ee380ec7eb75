#!/usr/bin/env bash
# Issue 33: in-process regeneration on one H200 (about 3-4 minutes): the GPU test of the batched
# engine (its compiled decode step in the worker thread, one graph), then `bench regen`: a
# Qwen3-8B-shaped random target, 400 chat-length prompts x 512 new tokens, HF generate at batch 32
# (one batch of a sample) against the static-cache pool at the batch that fits; JSON lines in
# OUT/bench_regen.jsonl, the table in OUT/bench_regen.err.
# Usage: benchmarks/h200_regen.sh [OUT]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
out=${1:-${OUT:-/tmp/dflash_bench}}
mkdir -p "$out"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
echo "== GPU test of the batched engine"
timeout 300 python3 -m pytest -q -m gpu tests/test_regen_batched.py 2>&1 | tail -15
echo "== bench regen"
timeout 420 python3 -m dflash_async bench regen 2> "$out/bench_regen.err" | tee "$out/bench_regen.jsonl"
echo "== rc=$?"
tail -8 "$out/bench_regen.err"
