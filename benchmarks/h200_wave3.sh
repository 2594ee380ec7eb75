#!/usr/bin/env bash
# Wave 3's first GPU check (issue 28's last "Done when" line, and the GPU paths that wave 3's
# first session changed without a GPU): one 10-minute call on one H200, each part under its own
# limit, everything printed also in $OUT/wave3-PART.log.
#   tests: every GPU-marked test (flash-attn-4 not installed: auto = Triton; hybrid tests skip
#     without flash-linear-attention), then the DFlash2 and architecture CPU tests on the GPU box
#     (transformers 5.17 there: the new target families' config classes and key mappings);
#   step: `bench drafter` at the Qwen3-8B shape, graph mode, 1024 anchors (the fifth round: 257.8
#     ms, MFU 0.750 against the 780 TFLOP/s bf16 peak, with flash-attn-4), now built by the
#     product's one step builder (model/build.py); a DFlash2 step benchmark is issue 30's.
# Usage: benchmarks/h200_wave3.sh tests|step; carry structlog, pydantic(-settings) and
# python-dotenv wheels (.whl) as the device README says.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
which=${1:-tests}; out=${OUT:-/tmp/dflash_bench/out}; mkdir -p "$out"
exec > >(tee -a "$out/wave3-$which.log") 2>&1
part() { echo; echo "== $1 ($(date +%T))"; }

if [ "$which" = tests ]; then
  part "GPU tests"
  timeout 360 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 | tail -15
  part "new families and DFlash2 on this machine's transformers"
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_architectures.py \
    tests/test_dflash2.py tests/test_layering.py 2>&1 | tail -8
fi
if [ "$which" = step ]; then
  part "bench drafter, Qwen3-8B shape, 1024 anchors, graph"
  timeout 300 python3 -m dflash_async bench drafter --shape qwen3-8b --compile --modes graph \
    --steps 10 2>&1 | grep '^{'
fi
part "done"
