#!/usr/bin/env bash
# Wave 3's fourth GPU session on one H200 (2026-12-03), in parts that each fit one 10-minute call;
# each measurement its own process under its own limit, output also in $OUT/PART.log.
#   target: `bench target` with the runs' new defaults (CompiledExperts in the packed MoE
#     forwards, FP8 fast accumulation): Moonlight-16B-A3B HF vs packed (issue 29's 1.8x), Gemma 4's
#     text layer at the 31B shape (issue 29: the last new family without a row); then the GPU
#     tests of the FP8 and grouped experts modules.
#   gemma4: the Gemma 4 row again after its wide-head flex fix, the GPU tests, and the DFlash
#     step at block 8 with a 248k vocabulary (issue 30: its memory next to DFlash2's).
#   pipe: the co-located pipeline with the 1xH200 preset and a random Qwen3-8B FP8 target, 100
#     steps (issue 31: >= 32k tokens/s).
# Usage: benchmarks/h200_wave3e.sh target|gemma4|pipe ...; carry .whl as the device README says.
. "$(dirname "$0")/h200_lib.sh"  # set -uo pipefail, the environment, $out, part, shape

for which in "$@"; do
  exec > >(tee -a "$out/$which.log") 2>&1
  if [ "$which" = target ]; then
    shape 80 moonlight-16b-a3b --experts hf,compiled  # (first call of the session only)
    shape 150 gemma4-31b-like
    part "GPU tests: FP8 and grouped experts"
    timeout 200 python3 -m pytest -q -x tests/test_fp8_gpu.py tests/test_grouped_experts.py \
      tests/test_target_gpu.py 2>&1 | grep -v DEBUG | tail -15
  fi
  if [ "$which" = gemma4 ]; then  # after the wide-head flex fix: the Gemma 4 row, GPU tests, DFlash
    shape 150 gemma4-31b-like
    part "GPU tests: FP8 and grouped experts"
    timeout 200 python3 -m pytest -q -x tests/test_fp8_gpu.py tests/test_grouped_experts.py \
      tests/test_target_gpu.py 2>&1 | grep -v DEBUG | tail -15
    part "bench drafter: DFlash at block 8, vocabulary 248320, 2048 anchors"
    timeout 180 python3 -m dflash_async bench drafter --compile --modes graph --kind dflash \
      --block-size 8 --vocab-size 248320 --num-anchors 2048 --steps 5 2>&1 | grep -v '^\s*$' | tail -12
  fi
  if [ "$which" = pipe ]; then
    part "pipeline: random Qwen3-8B FP8 target, 100 steps"
    RUN_TIMEOUT=400 bash benchmarks/h200_random.sh /tmp/dflash_bench 8b-fp8 100
  fi
done
part "done"
