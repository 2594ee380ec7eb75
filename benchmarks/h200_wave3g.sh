#!/usr/bin/env bash
# The DFlash2 step with its selector term and the candidates' gradient compiled (issue 30's
# MFU >= 0.70 at the Qwen3-8B shape), on one H200, in parts that each fit one 10-minute call;
# output also in $OUT/PART.log.
#   tests: the GPU tests of the CE pass, the grouped top-k, the drafter variants (DFlash2
#     captured and compiled), the FP8 drafter linears, the objective against its reference and
#     the step's no-host-sync check.
#   ab: `bench drafter --kind dflash2` of this tree against .ab/base's (the step before the
#     change: `git worktree add .ab/base REV`, carried), one process each, alternating, twice,
#     with the SM clock and power sampled by nvidia-smi (the step runs at the power cap).
#   prof: the profiled DFlash2 step with the 60 longest kernels of the graph replays.
#   b8: the block-8, 248k-vocabulary DFlash2 shape.
#   conv: (eighth session) the GPU tests of DFlash2's Triton convolutions (kernels/conv_kernel.py:
#     against the reference, mutants, compiled, in the step) and the DFlash2 drafter tests.
#   abconv: the DFlash2 step with those kernels (the default, variant today) against the torch
#     convolutions compiled into the layers (variant conv_compiled), alternating, twice, clocks.
#   ref: the DFlash and DFlash2 steps at the Qwen3-8B shape on the same machine, back to back,
#     with clocks sampled (machines differ by a few percent under the power cap).
#   kernels: (ninth session) the DFlash and the DFlash2 step, 8 timed steps each, then profiled
#     with every kernel of the graph replays listed, into $OUT/kernels_KIND.txt (to compare the
#     two steps kernel by kernel), clocks sampled.
#   gate: (tenth session, issue 31) the FP8 experts' SiLU gate and its quantization as one Triton
#     kernel (kernels/fp8_gate_kernel.py): its GPU tests and the FP8 targets', the experts module
#     alone (benchmarks/fp8_experts_gpu.py), the Qwen3-30B-A3B target bf16 against FP8.
#   routed: (eleventh session, issue 31) the FP8 experts' routed products as one Triton kernel
#     (kernels/fp8_moe_kernel.py): its GPU tests and the FP8 targets', its launches and the
#     experts module alone, the Qwen3-30B-A3B target bf16 against FP8, one forward profiled.
#   sweep: the routed kernel's products under more launches, the experts' kernels profiled.
#   tprof: the Qwen3-30B-A3B target forward's kernels, bf16 and FP8 (profile_target_gpu.py).
# Usage: benchmarks/h200_wave3g.sh tests|conv|ab|abconv|prof|b8|ref|kernels|gate|routed|sweep|tprof ...; carry .whl (and .ab for ab) as the
# device README says.
. "$(dirname "$0")/h200_lib.sh"  # set -uo pipefail, the environment, $out, part, shape

drafter() {  # TREE (new|base), KIND (dflash|dflash2), then bench drafter arguments
  local dir=$PWD kind=$2; [ "$1" = base ] && dir=$PWD/.ab/base
  shift 2
  part "bench drafter --kind $kind $* ($dir)"
  (cd "$dir" && PYTHONPATH=$dir:${PYTHONPATH#*:} timeout 170 python3 -m dflash_async bench \
    drafter --compile --modes graph --kind "$kind" "$@" 2>&1 | grep '^{"shape"' \
    | grep -o '"step_ms": [0-9.]*, "tflops": [0-9.]*, "mfu": [0-9.]*\|"peak_mem_gib": [0-9.]*')
}
experts_bench() {  # limit: the FP8 experts module, its products under the sweep, profiled
  part "benchmarks/fp8_experts_gpu.py --launches-only --sweep --profile"
  timeout "$1" python3 benchmarks/fp8_experts_gpu.py --launches-only --sweep --profile 2>&1 \
    | grep -v -e DEBUG -e Warning -e warn -e '^\s*$' | tail -80
}
clocks() {  # start sampling the SM clock and power every 200 ms into $out/clocks.csv
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader,nounits \
    -lms 200 > "$out/clocks.csv" 2>/dev/null &
  echo $!
}
clock_summary() {  # SAMPLER: stop it; the clock and power of all samples and of those > 600 W
  kill "$1" 2>/dev/null
  part "SM clock MHz and power W: all samples, then those above 600 W (the timed steps)"
  for floor in 0 600; do
    awk -F', ' -v floor="$floor" '$3 > floor {c+=$2; p+=$3; n++; if (n==1||$2<cmin) cmin=$2
                                              if ($3>pmax) pmax=$3}
      END {if (n) printf "> %d W, %d samples: clock mean %.0f min %d, power mean %.0f max %.0f\n",
           floor, n, c/n, cmin, p/n, pmax}' "$out/clocks.csv"
  done
}

for which in "$@"; do
  exec > >(tee -a "$out/$which.log") 2>&1
  if [ "$which" = tests ]; then
    part "GPU tests: CE pass, grouped top-k, drafter variants, FP8 drafter linears"
    timeout 300 python3 -m pytest -q -x tests/test_gpu_ce_kernel.py tests/model/test_grouped_topk.py \
      tests/test_gpu_drafter.py tests/test_fp8_training_gpu.py tests/model/test_objective_reference.py \
      tests/test_no_host_sync.py --tb=short 2>&1 | grep -v DEBUG | tail -60  # a failure's lines
  fi
  if [ "$which" = conv ]; then
    part "GPU tests: DFlash2's Triton convolutions, the DFlash2 drafter, the step's host syncs"
    timeout 400 python3 -m pytest -q -x tests/test_gpu_conv_kernel.py tests/test_gpu_drafter.py \
      tests/test_no_host_sync.py "tests/test_gpu_drafter_kernels.py::test_dflash2_triton_convolutions_equal_the_compiled_torch_ones_in_the_step" \
      --tb=short -s 2>&1 | grep -v DEBUG | grep -E 'passed|failed|error|Error|parity|assert|^E ' | tail -40
  fi
  if [ "$which" = abconv ]; then
    sampler=$(clocks)
    for variant in today conv_compiled today conv_compiled; do
      drafter new dflash2 --steps 8 --variants "$variant"
    done
    clock_summary "$sampler"
  fi
  if [ "$which" = ab ]; then
    sampler=$(clocks)
    for tree in new base new base; do drafter "$tree" dflash2 --steps 8; done
    clock_summary "$sampler"
  fi
  if [ "$which" = prof ]; then
    part "bench drafter --kind dflash2 --steps 3 --profile --profile-top 60"
    timeout 200 python3 -m dflash_async bench drafter --compile --modes graph --kind dflash2 \
      --steps 3 --profile --profile-top 60 2>&1 \
      | grep -v -e '^\s*$' -e DEBUG -e Warning -e _warn_once | tail -110
  fi
  if [ "$which" = ref ]; then
    sampler=$(clocks)
    drafter new dflash --steps 8
    drafter new dflash2 --steps 8
    clock_summary "$sampler"
  fi
  if [ "$which" = kernels ]; then
    sampler=$(clocks)
    for kind in dflash dflash2; do
      part "bench drafter --kind $kind --steps 8 --profile --profile-top 400"
      timeout 240 python3 -m dflash_async bench drafter --compile --modes graph --kind "$kind" \
        --steps 8 --profile --profile-top 400 2> >(grep -v -e '^\s*$' -e DEBUG -e Warning \
        -e _warn_once > "$out/kernels_$kind.txt") | grep '^{"shape"' \
        | grep -o '"step_ms": [0-9.]*, "tflops": [0-9.]*, "mfu": [0-9.]*\|"peak_mem_gib": [0-9.]*'
      sleep 2; head -c 3000 "$out/kernels_$kind.txt"
    done
    clock_summary "$sampler"
  fi
  if [ "$which" = gate ]; then
    part "GPU tests: the FP8 experts' gate kernel, FP8 targets, grouped experts"
    timeout 200 python3 -m pytest -q -x tests/test_gpu_fp8_gate_kernel.py tests/test_fp8_gpu.py \
      tests/test_grouped_experts.py --tb=short 2>&1 | grep -v DEBUG | tail -30
    part "benchmarks/fp8_experts_gpu.py"
    timeout 120 python3 benchmarks/fp8_experts_gpu.py 2>&1 | grep '^{'
    shape 240 qwen3-30b-a3b --experts compiled --quantize none,fp8-fast
  fi
  if [ "$which" = routed ]; then
    part "GPU tests: the routed kernel, the gate kernel, FP8 targets, grouped experts"
    timeout 240 python3 -m pytest -q -x tests/test_gpu_fp8_moe_kernel.py \
      tests/test_gpu_fp8_gate_kernel.py tests/test_fp8_gpu.py tests/test_grouped_experts.py \
      --tb=short -s 2>&1 | grep -v DEBUG | grep -e "worst row" -e "routed against" -e passed \
      -e failed -e Error -e error -e assert | tail -40
    experts_bench 300
    shape 240 qwen3-30b-a3b --experts compiled --quantize none,fp8-fast
  fi
  if [ "$which" = tprof ]; then
    part "benchmarks/profile_target_gpu.py --shape qwen3-30b-a3b --top 30"
    timeout 300 python3 benchmarks/profile_target_gpu.py --shape qwen3-30b-a3b --top 30 2>&1 \
      | grep -v -e DEBUG -e Warning -e warn -e '^\s*$' | tail -70
  fi
  if [ "$which" = sweep ]; then
    experts_bench 400
  fi
  if [ "$which" = b8 ]; then
    drafter new dflash2 --block-size 8 --vocab-size 248320 --num-anchors 2048 --steps 5
  fi
done
part "done"
