#!/usr/bin/env bash
# Issue 20: flex_attention's FLASH backend (flash-attn-4 on the CuTe DSL) for the drafter's
# attention, on one H200, in two device calls made back to back (the machine stays warm ~30 s
# after a call, and what a call leaves outside the repository stays with it):
#   stage a (carry .fa/a and .whl): keep the first half of the CuTe DSL libraries wheel and the
#     small wheels in /tmp/fa; meanwhile `bench linear` (the fp32 master weights' dtype passes
#     around each of a layer's matmuls, against bf16 copies and fp32-accumulating weight
#     gradients, ~1 minute);
#   stage b (carry .fa/b and .whl): join the halves (checked against the sha256), install
#     everything into /tmp/site, then
#     1. `bench attention --configs default,flash_backend` at 1024 and 4096 anchors: forward and
#        backward ms and MFU on the step's block mask, and the output and gradients against
#        torch's default Triton kernels (relative Frobenius difference, tolerance 2^-7);
#     2. where that works: the GPU parity test of the `flex_flash` step variant (loss,
#        gradients, 20 graph-replayed steps) and `bench drafter --variants today,flex_flash`.
# Make the wheels first, here: benchmarks/fa4_wheels.sh. Everything printed lands in
# $OUT/flash_backend.log. Usage: benchmarks/h200_flash_backend.sh a|b
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/dflash_bench/out}; mkdir -p "$out"
exec > >(tee -a "$out/flash_backend.log") 2>&1
case "${1:-}" in
  a)
    mkdir -p /tmp/fa && cp .fa/a/* /tmp/fa/ && ls -la /tmp/fa
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
    echo; echo "== bench linear, 1024 anchors ($(date +%T))"
    timeout 120 python3 -m dflash_async bench linear 2>&1 | grep -E '^\{|rror' | cut -c1-600
    echo "stage a done: now stage b, at once (the machine stays warm ~30 s)"
    exit 0 ;;
  b) ;;
  *) echo "usage: $0 a|b" >&2; exit 2 ;;
esac
[ -f /tmp/fa/libs_cu13.part1 ] || { echo "stage a's files are gone (the machine went cold)"; exit 1; }
name=$(cat .fa/b/libs_cu13.name)
cat /tmp/fa/libs_cu13.part1 .fa/b/libs_cu13.part2 > "/tmp/fa/$name"
echo "$(cat .fa/b/libs_cu13.sha256)  /tmp/fa/$name" | sha256sum -c - || exit 1
rm /tmp/fa/libs_cu13.part1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl /tmp/fa/*.whl || exit 1
# the CuTe DSL's `cutlass` package sits in a folder a .pth file adds, and PYTHONPATH folders run
# no .pth files: name it here
export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
python3 -c 'import flash_attn.cute, cutlass; print("flash_attn.cute", flash_attn.cute.__file__)'
part() { echo; echo "== $1 ($(date +%T))"; }
# timeouts: 150 + 100 + 120 + 180 s, inside one call's 600 with the install
for anchors in 1024 4096; do
  part "1. bench attention, $anchors anchors: torch's default vs the FLASH backend"
  timeout $([ "$anchors" = 1024 ] && echo 150 || echo 100) python3 -m dflash_async bench attention --num-anchors "$anchors" \
    --configs default,flash_backend 2>&1 | grep -E '^\{|Error|error' | cut -c1-700
done
part "2. the flex_flash step: GPU parity, then today vs flex_flash (1024 anchors)"
timeout 120 python3 -m pytest -q -s -p no:cacheprovider -m gpu -k flex_flash \
  tests/test_gpu_drafter_kernels.py 2>&1 | grep -E '\{"check"|passed|failed|skipped|Error' \
  | cut -c1-600
timeout 180 python3 -m dflash_async bench drafter --shape qwen3-8b --compile --modes graph \
  --token-budget 16384 --num-anchors 1024 --steps 10 --variants today,flex_flash 2>&1 \
  | grep -E '^\{|rror' | cut -c1-600
part "done"
