#!/usr/bin/env bash
# Issue 31's last line, the Qwen3-30B-A3B FP8 target at >= 1.4x bf16 (eleventh session), on one
# H200, in parts that each fit one 10-minute call; output also in $OUT/PART.log.
#   tests: the GPU tests of the FP8 experts (every way), the gate and
#     row kernels, the FP8 targets, the compiled experts and the packed targets (the MoE router
#     compiled with the attention).
#   experts: the FP8 experts module alone every way, the grouped products alone (torch's,
#     fbgemm's, the routed kernel's), the row quantization's launches
#     (benchmarks/fp8_experts_gpu.py --launches-only).
#   target: `bench target --shapes qwen3-30b-a3b --experts compiled --quantize none,fp8-fast`
#     with one FP8 row per experts way ($WAYS, default: default,routed).
#   graph: the GPU tests of the CUDA-graphed target forward (targets/graphed.py) and the FP8
#     targets, then `bench target --cuda-graph` at Qwen3-30B-A3B (bf16 and FP8, each fast path
#     eager and replayed from one CUDA graph).
#   graph8b: the same `bench target --cuda-graph` at Qwen3-8B.
#   gdemo: the demo's pipeline on the GPU (the tiny target and a drafter co-located on one
#     device, 40 steps) with DFLASH_TARGET__CUDA_GRAPH=true: the capture in the target worker,
#     replays in its slots.
#   tprof: the Qwen3-30B-A3B target forward's kernels, bf16 and FP8, and each forward captured
#     as one CUDA graph and replayed (profile_target_gpu.py --graph).
# Usage: benchmarks/h200_wave3h.sh tests|experts|target|graph|graph8b|gdemo|tprof ...; carry .whl as the device
# README says (fbgemm-gpu-genai's wheel for the fbgemm rows).
. "$(dirname "$0")/h200_lib.sh"  # set -uo pipefail, the environment, $out, part, shape

for which in "$@"; do
  exec > >(tee -a "$out/$which.log") 2>&1
  if [ "$which" = tests ]; then
    part "GPU tests: FP8 experts every way, gate and row kernels, FP8 targets, packed targets"
    timeout 240 python3 -m pytest -q tests/test_gpu_fp8_moe_kernel.py \
      tests/test_gpu_fp8_gate_kernel.py tests/test_fp8_gpu.py tests/test_grouped_experts.py \
      tests/test_target_gpu.py --tb=short -s 2>&1 | grep -v DEBUG | grep -e "against sorted" \
      -e "worst row" -e passed -e failed -e Error -e error -e assert -e SKIP | tail -40
  fi
  if [ "$which" = experts ]; then
    part "benchmarks/fp8_experts_gpu.py --launches-only"
    timeout 200 python3 benchmarks/fp8_experts_gpu.py --launches-only 2>&1 \
      | grep -v -e DEBUG -e Warning -e warn -e '^\s*$' | tail -60
  fi
  if [ "$which" = target ]; then
    shape 300 qwen3-30b-a3b --experts compiled --quantize none,fp8-fast \
      --experts-way "${WAYS:-default,routed}"
  fi
  if [ "$which" = graph ]; then
    part "GPU tests: the target forward in one CUDA graph, the packed and FP8 targets"
    timeout 150 python3 -m pytest -q tests/test_target_gpu.py tests/test_fp8_gpu.py --tb=short \
      2>&1 | grep -v DEBUG | grep -e passed -e failed -e Error -e error -e assert | tail -20
    shape 220 qwen3-30b-a3b --experts compiled --quantize none,fp8-fast --cuda-graph
  fi
  if [ "$which" = gdemo ]; then
    part "python -m dflash_async run: the demo on cuda:0, the target forward in one CUDA graph"
    DFLASH_PIPELINE__TARGET_DEVICES=cuda:0 DFLASH_PIPELINE__DRAFTER_DEVICES=cuda:0 \
      DFLASH_TARGET__DTYPE=bfloat16 DFLASH_TARGET__CUDA_GRAPH=true DFLASH_TRAIN__MAX_STEPS=40 \
      DFLASH_TRAIN__SAVE_EVERY=40 DFLASH_EVAL__AT_START=false DFLASH_EVAL__AT_END=false \
      DFLASH_LOG__FORMAT=json DFLASH_OUTPUT_DIR=/tmp/gdemo timeout 200 python3 -m dflash_async \
      run 2>&1 | grep -e target_path_chosen -e target_warmed_up -e train_completed -e run_summary \
      -e Error -e error | cut -c1-600 | tail -12
    echo "exit status: ${PIPESTATUS[0]}"
  fi
  if [ "$which" = graph8b ]; then
    shape 200 qwen3-8b --quantize none,fp8-fast --cuda-graph
  fi
  if [ "$which" = tprof ]; then
    part "benchmarks/profile_target_gpu.py --shape qwen3-30b-a3b --top 30 --graph"
    timeout 300 python3 benchmarks/profile_target_gpu.py --shape qwen3-30b-a3b --top 30 --graph 2>&1 \
      | grep -v -e DEBUG -e Warning -e warn -e '^\s*$' | tail -70
  fi
done
part "done"
