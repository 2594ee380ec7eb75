#!/usr/bin/env bash
# GPU checks and step benchmarks (issues 2 and 5) on an H200 machine; prints JSON lines.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # for benchmarks/research
python3 -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 | grep -vE "DEBUG|Warning|warn" | tail -15
python3 -m dflash_async bench drafter --modes eager --steps 10 --profile 2>&1 | grep -vE "^\s*$" | tail -40
python3 -m dflash_async bench drafter --modes graph --steps 10 2>&1 | grep '^{'
python3 -m dflash_async bench drafter --shape small --token-budget 8192 --num-anchors 512 --modes eager,graph --steps 20 2>&1 | grep '^{'
python3 benchmarks/research/graph_bench.py --checks parity,threads --shape small --steps 20 --threads 4 2>&1 | grep -E '^\{|Error'
