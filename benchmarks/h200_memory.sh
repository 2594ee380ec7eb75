#!/usr/bin/env bash
# Issue 5: flat memory over N replayed steps at the Qwen3-8B drafter shape, T=49152, A=2048.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # for benchmarks/research
python3 benchmarks/research/graph_bench.py --checks memory --shape qwen3-8b --token-budget 49152 --num-anchors 2048 --steps "${1:-200}" 2>&1 | grep -E '^\{|Error'
