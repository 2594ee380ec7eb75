#!/usr/bin/env bash
# Wave 3's third GPU session on one H200, in parts that each fit one 10-minute call, each shape
# or run in its own process under its own limit (one failure leaves the others' rows), the
# output also in $OUT/PART.log.
#   target: `bench target` rows: FP8 beside bf16 at the Qwen3-8B and Qwen3-30B-A3B shapes
#     (issue 31), HF vs packed for the new families: Gemma-3-12B, gpt-oss-20b, Moonlight-16B-A3B
#     (the DeepSeek-V3 architecture), Qwen3.5-35B-A3B (issue 29);
#   pipe: co-located pipeline runs on random-weight targets drawn in the run
#     (benchmarks/h200_random.sh): Qwen3.5-35B-A3B bf16, 100 steps (issue 29), Qwen3-8B FP8,
#     100 steps (issue 31);
#   check: where the FP8 experts' time goes (benchmarks/fp8_experts_gpu.py), the Qwen3-30B-A3B
#     FP8 row again with the experts' parts compiled, and the new families' packed paths against
#     fp32 truth (benchmarks/family_parity_gpu.py);
#   big: the largest target beside its drafter, Qwen3-Next-80B-A3B FP8, 50 steps (issue 31).
# Usage: benchmarks/h200_wave3c.sh target|pipe|check|big ...; carry .whl (structlog, pydantic,
# pydantic-settings, python-dotenv, flash-linear-attention) as the device README says.
. "$(dirname "$0")/h200_lib.sh"  # set -uo pipefail, the environment, $out, part, shape

for which in "$@"; do
  exec > >(tee -a "$out/$which.log") 2>&1
  if [ "$which" = target ]; then
    shape 110 qwen3-8b --quantize none,fp8
    shape 110 qwen3-30b-a3b --quantize none,fp8
    shape 80 gemma3-12b
    shape 80 gpt-oss-20b
    shape 80 moonlight-16b-a3b
    shape 110 qwen3.5-35b-a3b
  fi
  if [ "$which" = pipe ]; then
    part "pipeline: Qwen3.5-35B-A3B bf16, 100 steps"
    RUN_TIMEOUT=330 benchmarks/h200_random.sh /tmp/b 35b 100
    rm -rf /tmp/b/random_35b_100
    part "pipeline: Qwen3-8B FP8, 100 steps"
    RUN_TIMEOUT=220 benchmarks/h200_random.sh /tmp/b 8b-fp8 100
    rm -rf /tmp/b/random_8b-fp8_100
  fi
  if [ "$which" = check ]; then
    part "FP8 experts at the Qwen3-30B-A3B shape, and one FP8 linear"
    timeout 100 python3 benchmarks/fp8_experts_gpu.py 2>&1 | grep -E '^\{|Error' | tail -12
    shape 110 qwen3-30b-a3b --quantize none,fp8
    part "new families against fp32 truth (4 layers, T = 4096)"
    timeout 200 python3 benchmarks/family_parity_gpu.py 2>&1 | grep -E '^\{|Error' | tail -8
    part "FP8 GPU tests"
    timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
      tests/test_fp8_gpu.py 2>&1 | grep -v "^\s*$" | tail -15
  fi
  if [ "$which" = big ]; then
    part "pipeline: Qwen3-Next-80B-A3B FP8, 50 steps"
    RUN_TIMEOUT=420 benchmarks/h200_random.sh /tmp/b next80b 50
  fi
done
part "done"
