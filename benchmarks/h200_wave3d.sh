#!/usr/bin/env bash
# Wave 3's fourth GPU session on one H200 (prepared 2026-12-02, not yet run), in parts that each
# fit one 10-minute call; each shape its own process under its own limit, output also in
# $OUT/PART.log.
#   target: `bench target` rows still missing or to re-measure: HF vs packed for mistral-7b,
#     minimax-m2 (8 of 62 layers), qwen3-next-80b-a3b (16 of 48 layers) (issue 29); the bf16
#     MoE experts with their parts compiled (grouped_experts.CompiledExperts, `--experts
#     hf,compiled`) at Moonlight-16B-A3B (packed 1.63x HF, goal 1.8x), Qwen3.5-35B-A3B and
#     GLM-4.5-Air (issue 29); FP8 with fast accumulation beside FP8 and bf16 at the Qwen3-8B and
#     Qwen3-30B-A3B shapes (issue 31).
# Usage: benchmarks/h200_wave3d.sh target ...; carry .whl as the device README says.
. "$(dirname "$0")/h200_lib.sh"  # set -uo pipefail, the environment, $out, part, shape

for which in "$@"; do
  exec > >(tee -a "$out/$which.log") 2>&1
  if [ "$which" = target ]; then
    shape 90 moonlight-16b-a3b --experts hf,compiled
    shape 100 qwen3-8b --quantize none,fp8,fp8-fast
    shape 120 qwen3-30b-a3b --quantize none,fp8,fp8-fast --experts hf,compiled
    shape 60 mistral-7b
    shape 70 minimax-m2-8l --experts hf,compiled
    shape 80 qwen3-next-80b-a3b-16l --experts hf,compiled
  fi
done
part "done"
