#!/usr/bin/env bash
# Issue 20: flex_attention's FLASH backend (flash-attn-4 on the CuTe DSL) for the drafter's
# attention, on one H200. Its libraries wheel is larger than one call carries, so it travels in
# two device calls made back to back (the machine stays warm ~30 s after a call, and what a call
# leaves outside the repository stays with it), then later calls on the warm machine reuse it:
#   a [checks]  (carry .fa/a and .whl): keep the first half of the CuTe DSL libraries wheel and
#     the small wheels in /tmp/fa; with `checks`, also linear_bench.py (the fp32 master weights'
#     dtype passes around a layer's matmuls, against bf16 copies and fp32-accumulating weight
#     gradients, ~1 minute) and the GPU tests of the drafter step's defaults (~1 minute);
#   b [TASK...]  (carry .fa/b and .whl): join the halves (checked against the sha256), install
#     everything into /tmp/site, then run the TASKs (default: experiment);
#   TASK...  (carry .whl, and .ab for ab*): more tasks on the same warm machine, or on a fresh
#     one without flash-attn-4 (auto is then Triton).
# Tasks:
#   experiment: attention_bench.py `--configs default,flash_backend` at 1024 and 4096 anchors
#     (forward and backward ms and MFU on the step's block mask; output and gradients against
#     torch's Triton kernels, tolerance 2^-7), the GPU parity test of the `flex_flash` step
#     variant (loss, gradients, 20 graph-replayed steps) and `bench drafter --variants
#     flex_triton,flex_flash`;
#   step: the default step (auto = flash here) against flex_triton at 1024 anchors in both
#     orders and at 4096 anchors;
#   profile: `bench drafter --profile` of the default step at 1024 anchors (by part, and the
#     graph-replayed GPU activity with the idle gaps), its Chrome trace in $OUT;
#   clocks: benchmarks/step_clocks.py, today (flash) then flex_triton: per-step wall time over 30
#     back-to-back replays and after rests, with the SM clock and power from nvidia-smi;
#   tests: the GPU tests of the drafter step with flash-attn-4 installed (auto = flash);
#   ce: benchmarks/ce_launch_sweep.py (the CE pass's launch shapes);
#   ab1, ab2, ab4096: `bench drafter` of this tree's default step against .ab/base's (a git
#     worktree of the revision before, carried), one process each, base first (ab1) or second;
#   triton_step: this tree's step with torch's Triton kernels for flex_attention; triton_ab: that
#     step against .ab/base's, this tree first;
#   working: this tree's step with and without the matmul weights' working copies, both orders;
#   resume: benchmarks/h200_resume.sh (a `run`, then a resumed one) with every default.
# Make the wheels first, here: benchmarks/fa4_wheels.sh. Everything printed lands in
# $OUT/flash_backend.log. Usage: benchmarks/h200_flash_backend.sh a [checks] | b [TASK...] | TASK...
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/dflash_bench/out}; mkdir -p "$out"
exec > >(tee -a "$out/flash_backend.log") 2>&1
part() { echo; echo "== $1 ($(date +%T))"; }
# the CuTe DSL's `cutlass` package sits in a folder a .pth file adds, and PYTHONPATH folders run
# no .pth files: name it here
site=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
wheels() {  # WHEEL...: into /tmp/site, offline
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$@"
}
stage_a() {
  mkdir -p /tmp/fa && cp .fa/a/* /tmp/fa/ && ls -la /tmp/fa
  wheels .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
  [ "${1:-}" = checks ] || { echo "stage a done: now stage b, at once"; return 0; }
  part "linear_bench.py, 1024 anchors"
  timeout 120 python3 benchmarks/research/linear_bench.py 2>&1 | grep -E '^\{|rror' | cut -c1-600
  part "GPU tests of the drafter step's defaults"
  timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu -k "not hybrid and not flex_flash" \
    tests/test_gpu_drafter.py tests/test_no_host_sync.py tests/test_checkpoint.py \
    tests/model/test_objective_reference.py tests/test_gpu_ce_kernel.py 2>&1 | tail -15 | cut -c1-400
  echo "stage a done: now stage b, at once (the machine stays warm ~30 s)"
}
install() {  # stage b: join the halves, check them, install everything in one go
  [ -f /tmp/fa/libs_cu13.part1 ] || { echo "stage a's files are gone (the machine went cold)"
                                      return 1; }
  local name; name=$(cat .fa/b/libs_cu13.name)
  cat /tmp/fa/libs_cu13.part1 .fa/b/libs_cu13.part2 > "/tmp/fa/$name"
  echo "$(cat .fa/b/libs_cu13.sha256)  /tmp/fa/$name" | sha256sum -c - || return 1
  rm /tmp/fa/libs_cu13.part1
  wheels .whl/*.whl /tmp/fa/*.whl
}
experiment() {  # the FLASH backend against torch's Triton kernels, as first tried
  # timeouts: 150 + 100 + 120 + 180 s, inside one call's 600 with the install
  for anchors in 1024 4096; do
    part "1. attention_bench.py, $anchors anchors: torch's default vs the FLASH backend"
    timeout $([ "$anchors" = 1024 ] && echo 150 || echo 100) \
      python3 benchmarks/research/attention_bench.py --num-anchors "$anchors" \
      --configs default,flash_backend 2>&1 | grep -E '^\{|Error|error' | cut -c1-700
  done
  part "2. the flex_flash step: GPU parity, then flex_triton vs flex_flash (1024 anchors)"
  timeout 120 python3 -m pytest -q -s -p no:cacheprovider -m gpu -k flex_flash \
    tests/test_gpu_drafter_kernels.py 2>&1 | grep -E '\{"check"|passed|failed|skipped|Error' \
    | cut -c1-600
  timeout 180 python3 -m dflash_async bench drafter --shape qwen3-8b --compile --modes graph \
    --token-budget 16384 --num-anchors 1024 --steps 10 --variants flex_triton,flex_flash 2>&1 \
    | grep -E '^\{|rror' | cut -c1-600
}
step() {  # the default (auto: flash, installed here) against triton, whole step, both orders
  for order in flex_triton,today today,flex_triton; do
    part "bench drafter, 1024 anchors: $order"
    timeout 150 python3 -m dflash_async bench drafter --shape qwen3-8b --compile --modes graph \
      --token-budget 16384 --num-anchors 1024 --steps 10 --variants $order 2>&1 \
      | grep -E '^\{|rror' | cut -c1-700
  done
  part "bench drafter, 4096 anchors: today (flash), flex_triton"
  timeout 200 python3 -m dflash_async bench drafter --shape qwen3-8b --compile --modes graph \
    --token-budget 16384 --num-anchors 4096 --steps 10 --variants today,flex_triton 2>&1 \
    | grep -E '^\{|rror' | cut -c1-700
}
profile() {  # the default step by part and its graph-replayed GPU activity with the idle gaps
  timeout 240 python3 -m dflash_async bench drafter --shape qwen3-8b --compile --modes graph \
    --token-budget 16384 --num-anchors 1024 --steps 10 --variants today --profile \
    --trace "$out/profile_trace.json.gz" 2>&1 | grep -vE 'Warning|warn' | tail -90 | cut -c1-400
}
clocks() {  # per-step time against the GPU's clock and power
  timeout 400 python3 benchmarks/step_clocks.py --variants today,flex_triton 2>&1 \
    | grep -E '^\{|rror' | cut -c1-900
}
tests() {  # the drafter step's GPU tests, with auto resolving to flash
  timeout 500 python3 -m pytest -q -s -p no:cacheprovider -m gpu -k "not hybrid" \
    tests/test_gpu_drafter.py tests/test_no_host_sync.py tests/test_checkpoint.py \
    tests/model/test_objective_reference.py tests/test_gpu_ce_kernel.py \
    tests/test_gpu_drafter_kernels.py 2>&1 | grep -E '\{"check"|passed|failed|skipped|Error' \
    | cut -c1-500
}
resume() {  # `run` and resume with every default, flash included (benchmarks/h200_resume.sh)
  timeout 420 bash benchmarks/h200_resume.sh /tmp/dflash_bench
  grep -h drafter_kernels_chosen /tmp/dflash_bench/resume_a.log | cut -c1-600
}
ce() {  # launch shapes of the CE pass's kernel, each checked against the reference, timed
  timeout 200 python3 benchmarks/ce_launch_sweep.py 2>&1 | grep -E '^\{|rror' | cut -c1-400
}
bench_tree() {  # TREE ANCHORS [VARIANTS]: the default step of this tree (new) or of .ab/base
  local dir=$PWD; [ "$1" = base ] && dir=$PWD/.ab/base
  part "bench drafter, $2 anchors, ${3:-today}: $1"
  (cd "$dir" && timeout 240 python3 -m dflash_async bench drafter --shape qwen3-8b --compile \
    --modes graph --token-budget 16384 --num-anchors "$2" --steps 10 --variants "${3:-today}" \
    2>&1 | grep -E '^\{|rror' | cut -c1-700)
}
# the step before this round's changes (.ab/base: `git worktree add .ab/base REV`, carried)
# against this tree's, one process each, in both orders
ab1() { bench_tree base 1024; bench_tree new 1024; }
ab2() { bench_tree new 1024; bench_tree base 1024; }
ab4096() { bench_tree new 4096; bench_tree base 4096; }
triton_step() { bench_tree new 1024 flex_triton; }
# this tree's step with the matmul weights' working copies (today) and without, both orders
working() { bench_tree new 1024 master_weights,today; bench_tree new 1024 today,master_weights; }
triton_ab() { bench_tree new 1024 flex_triton; bench_tree base 1024 flex_triton; }
tasks="experiment step profile clocks tests resume ce ab1 ab2 ab4096 triton_step triton_ab working"
case "${1:-}" in
  a) stage_a "${2:-}"; exit $? ;;
  b) install || exit 1; shift; run=${*:-experiment} ;;
  *) run=$* ;;
esac
for task in $run; do
  [[ " $tasks " == *" $task "* ]] || { echo "usage: $0 a [checks] | b [TASK...] | TASK..." \
    "(tasks: $tasks)" >&2; exit 2; }
done
[ -d /tmp/site/structlog ] || wheels .whl/*.whl
[ -d /tmp/site/flash_attn ] || echo "flash-attn-4 is not installed here (a, then b): auto = Triton"
export PYTHONPATH=$site
python3 -c 'import flash_attn.cute, cutlass; print("flash_attn.cute", flash_attn.cute.__file__)' \
  2>/dev/null
for task in $run; do $task; done
part "done"
