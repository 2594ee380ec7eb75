#!/usr/bin/env bash
# Wave 3's second GPU session on one H200, in parts that each fit one 10-minute call; every part
# under its own limit, its output also in $OUT/PART.log.
#   verify: the GPU tests of the paths changed since the last GPU run (DFlash2 and sliding
#     drafter steps captured strictly; the hybrid targets' rotary fix; the merged flex block
#     mask; the batched decoder), the packed-window parity against fp64
#     (benchmarks/window_parity_gpu.py part 1), the split target on one GPU
#     (benchmarks/split_chain_gpu.py);
#   drafter: the DFlash2 step at the Qwen3-8B shape and at block 8 with a 248k vocabulary, and a
#     sliding-window drafter
#     (W 2048) against full attention at T = 49152;
#   target: the FP8 GPU tests, `bench target` with FP8 beside bf16 at the Qwen3-8B shape, and for
#     the new families (gpt-oss-20b, Qwen3.5-35B-A3B, Gemma-3-12B, Moonlight-16B-A3B = the
#     DeepSeek-V3 architecture).
#   final: the in-process regeneration engine's GPU test and `bench regen` (issue 33), the FP8
#     GPU tests (issue 31), the DFlash2 step at the Qwen3-8B shape (issue 30).
# Usage: benchmarks/h200_wave3b.sh verify|drafter|target|final ...; carry .whl (structlog, pydantic,
# pydantic-settings, python-dotenv, flash-linear-attention) as the device README says.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
out=${OUT:-/tmp/dflash_bench/out}; mkdir -p "$out"
part() { echo; echo "== $1 ($(date +%T))"; }
drafter() {  # label, then bench drafter arguments
  local label=$1; shift
  part "bench drafter: $label"
  timeout "${DRAFTER_TIMEOUT:-120}" python3 -m dflash_async bench drafter --compile --modes graph "$@" 2>&1 \
    | tee -a "$out/drafter_raw.log" | grep '^{' | python3 -c "import json,sys
for l in sys.stdin:
    r=json.loads(l); keep=('kind','block_size','vocab_size','token_budget','num_anchors','layer_types','sliding_window','step_ms','tflops','mfu','peak_mem_gib','peak_all_gib','loss','flex_backend','error')
    print(json.dumps({'label':'$label',**{k:r.get(k) for k in keep if k in r}}))"
}

for which in "$@"; do
  exec > >(tee -a "$out/$which.log") 2>&1
  if [ "$which" = verify ]; then
    part "GPU tests"
    timeout 250 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
      tests/test_gpu_drafter.py tests/test_target_hybrid.py tests/test_target_hybrid_moe.py \
      tests/test_target_hybrid_next.py tests/test_no_host_sync.py tests/test_target_packed.py \
      tests/test_evaluate_batched.py 2>&1 | grep -v "^\s*$" | tail -60
    part "packed window parity against fp64 (tiny, fp32)"
    PYTHONPATH=$PYTHONPATH:tests timeout 90 python3 benchmarks/window_parity_gpu.py --part 1 \
      2>&1 | grep '^{'
    part "split target on one GPU, Qwen3-8B shape"
    timeout 200 python3 benchmarks/split_chain_gpu.py --stages 2,3 --packs 20 2>&1 \
      | grep -E '^\{|Error|error' | tail -8
  fi
  if [ "$which" = drafter ]; then
    part "GPU tests of the DFlash2 step"
    timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short -k dflash2 \
      tests/test_gpu_drafter.py 2>&1 | grep -v "^\s*$" | tail -20
    drafter "dflash2 qwen3-8b" --kind dflash2 --steps 10
    drafter "dflash2 block 8, vocab 248320, 2048 anchors" --kind dflash2 --block-size 8 \
      --vocab-size 248320 --num-anchors 2048 --steps 10
    drafter "dflash full attention T=49152" --token-budget 49152 --steps 3
    drafter "dflash sliding W=2048 T=49152" --token-budget 49152 --steps 3 \
      --layer-types sliding_attention --sliding-window 2048
  fi
  if [ "$which" = target ]; then
    part "FP8 GPU tests"
    timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
      tests/test_fp8_gpu.py 2>&1 | grep -v "^\s*$" | tail -25
    part "bench target: FP8 beside bf16, and the new families (bf16)"
    timeout 330 python3 -m dflash_async bench target --quantize none,fp8 --shapes qwen3-8b \
      --repeats 3 2>&1 | grep -E '^\{|Error' | tail -4
    timeout 330 python3 -m dflash_async bench target --repeats 3 \
      --shapes gpt-oss-20b,qwen3.5-35b-a3b,gemma3-12b,moonlight-16b-a3b 2>&1 \
      | grep -E '^\{|Error' | tail -8
  fi
  if [ "$which" = final ]; then
    part "GPU test of the batched regeneration engine"
    timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
      tests/test_regen_batched.py 2>&1 | grep -v "^\s*$" | tail -12
    part "bench regen, Qwen3-8B shape, 512 new tokens"
    timeout 240 python3 -m dflash_async bench regen --prompts 400 --max-new-tokens 512 \
      2> "$out/bench_regen.err" | tee "$out/bench_regen.jsonl"
    tail -8 "$out/bench_regen.err"
    part "FP8 GPU tests"
    timeout 75 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
      tests/test_fp8_gpu.py 2>&1 | grep -v "^\s*$" | tail -25
    DRAFTER_TIMEOUT=175 drafter "dflash2 qwen3-8b" --kind dflash2 --steps 5
  fi
done
part "done"
