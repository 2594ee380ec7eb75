#!/usr/bin/env bash
# Wave 3's fifth GPU session on one H200 (2026-12-03), in parts that each fit one 10-minute call;
# output also in $OUT/PART.log.
#   d2: the DFlash2 step after the grouped top-k, the Triton CE pass and F.embedding codebooks
#     (issue 30: MFU >= 0.70 at the Qwen3-8B shape and at block 8 with a 248k vocabulary), with
#     the GPU tests of those parts first.
#   prof: where the DFlash2 step's time goes now (one profiled step), and the Qwen3-30B-A3B
#     target forward's kernels, bf16 against FP8 (issue 31's 1.4x).
#   moe: after the experts' combine became one gather-reduce and the FP8 experts quantize the
#     tokens before the gather: the GPU tests of both, the Qwen3-30B-A3B rows side by side (bf16
#     HF experts, bf16 CompiledExperts, FP8 fast), the kernel profile again, and the DFlash2
#     row at the Qwen3-8B shape a second time.
#   fp8d: DFLASH_TRAIN__FP8_MATMULS (issue 31): its GPU tests, the DFlash step at the Qwen3-8B
#     shape in bf16 and with FP8 linears;  curve: its GPU tests again (rowwise_mm is now shared)
#     and its 500-step demo runs against bf16 (CURVE_RUNS, CURVE_LIMIT).
#   moe2: the Qwen3-30B-A3B rows again after the combine became k pointwise terms (issue 31).
#   d3: the DFlash2 step once its CE pass also writes the top-k's group maxima (issue 30), its
#     GPU tests and those of the FP8 and experts paths, then moe2's rows.
#   k2: the graph-replayed kernel tables of the DFlash2 and the DFlash step (issue 30's margin).
# Usage: benchmarks/h200_wave3f.sh d2|prof|moe|fp8d|curve|k2|moe2|d3 ...; carry .whl as the device README says.
. "$(dirname "$0")/h200_lib.sh"  # set -uo pipefail, the environment, $out, part, shape

drafter() {  # limit, then bench drafter arguments
  local limit=$1; shift
  part "bench drafter $*"
  timeout "$limit" python3 -m dflash_async bench drafter --compile --modes graph "$@" 2>&1 \
    | grep -v '^\s*$' | grep -v DEBUG | tail -14
}

for which in "$@"; do
  exec > >(tee -a "$out/$which.log") 2>&1
  if [ "$which" = d2 ]; then
    part "GPU tests: grouped top-k, the CE kernel, the drafter variants"
    timeout 240 python3 -m pytest -q -x tests/model/test_grouped_topk.py tests/test_gpu_ce_kernel.py \
      tests/test_gpu_drafter.py 2>&1 | grep -v DEBUG | tail -8
    drafter 170 --kind dflash2 --steps 5
    drafter 170 --kind dflash2 --block-size 8 --vocab-size 248320 --num-anchors 2048 --steps 5
  fi
  if [ "$which" = prof ]; then
    drafter 200 --kind dflash2 --steps 3 --profile
    part "target kernels: Qwen3-30B-A3B, bf16 + CompiledExperts vs FP8"
    timeout 300 python3 benchmarks/profile_target_gpu.py --shape qwen3-30b-a3b --top 22 2>&1 \
      | grep -v DEBUG | tail -60
  fi
  if [ "$which" = moe ]; then
    part "GPU tests: grouped experts, FP8, targets"
    timeout 200 python3 -m pytest -q -x tests/test_fp8_gpu.py tests/test_grouped_experts.py \
      tests/test_target_gpu.py 2>&1 | grep -v DEBUG | tail -6
    shape 240 qwen3-30b-a3b --experts hf,compiled --quantize none,fp8-fast
    timeout 200 python3 benchmarks/profile_target_gpu.py --shape qwen3-30b-a3b --top 12 2>&1 \
      | grep -v -e DEBUG -e Warning -e _warn_once | tail -32
    drafter 170 --kind dflash2 --steps 5
  fi
  if [ "$which" = fp8d ]; then
    part "GPU tests: FP8 drafter linears"
    timeout 200 python3 -m pytest -q -x tests/test_fp8_training_gpu.py 2>&1 | grep -v DEBUG | tail -8
    drafter 170 --kind dflash --steps 5
    drafter 170 --kind dflash --steps 5 --fp8-matmuls
  fi
  if [ "$which" = k2 ]; then  # graph-replayed kernels by name, DFlash2 against DFlash
    for kind in dflash2 dflash; do
      part "bench drafter --kind $kind --steps 3 --profile: whole tables"
      timeout 200 python3 -m dflash_async bench drafter --compile --modes graph --kind $kind \
        --steps 3 --profile 2>&1 | grep -v -e '^\s*$' -e DEBUG -e Warning -e _warn_once | tail -100
    done
  fi
  if [ "$which" = moe2 ]; then  # the combine as k pointwise terms (coalesced row loads)
    part "GPU tests: grouped experts, FP8 targets"
    timeout 150 python3 -m pytest -q -x tests/test_grouped_experts.py tests/test_fp8_gpu.py \
      2>&1 | grep -v DEBUG | tail -4
    shape 240 qwen3-30b-a3b --experts compiled --quantize none,fp8-fast
  fi
  if [ "$which" = d3 ]; then  # the DFlash2 group maxima from the CE pass (issue 30), and moe2
    part "GPU tests: CE pass (+ group maxima), grouped top-k, drafters, FP8, grouped experts"
    timeout 240 python3 -m pytest -q -x tests/test_gpu_ce_kernel.py tests/model/test_grouped_topk.py \
      tests/test_gpu_drafter.py tests/test_grouped_experts.py tests/test_fp8_gpu.py \
      tests/test_fp8_training_gpu.py 2>&1 | grep -v DEBUG | tail -4
    drafter 150 --kind dflash2 --steps 5
    drafter 150 --kind dflash2 --steps 5
    drafter 150 --kind dflash2 --block-size 8 --vocab-size 248320 --num-anchors 2048 --steps 5
    shape 200 qwen3-30b-a3b --experts compiled --quantize none,fp8-fast
  fi
  if [ "$which" = curve ]; then
    if [ -z "${CURVE_NO_TESTS:-}" ]; then
      part "GPU tests: FP8 drafter linears and the target's FP8 (rowwise_mm now shared)"
      timeout 150 python3 -m pytest -q -x tests/test_fp8_training_gpu.py tests/test_fp8_gpu.py \
        2>&1 | grep -v DEBUG | tail -6
    fi
    part "500-step demo curves: ${CURVE_RUNS:-bf16:42,fp8:42,bf16:43}"
    # finished runs of an earlier call, carried in runs/fp8_curve, are read, not run again
    [ -d runs/fp8_curve ] && cp -r runs/fp8_curve "$out/"
    timeout "${CURVE_LIMIT:-420}" python3 benchmarks/fp8_drafter_curve.py \
      --runs "${CURVE_RUNS:-bf16:42,fp8:42,bf16:43}" --out "$out/fp8_curve" 2>&1 \
      | grep -v DEBUG | tail -40
  fi
done
part "done"
