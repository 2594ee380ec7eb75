#!/usr/bin/env bash
# Issue 20: where the drafter step's time goes, and faster kernels, on one H200 in under 9 minutes.
#   0. the step's other GPU tests (capture in strict mode, no host sync, checkpoints, placement);
#   1. GPU parity of the kernel variants with today's path (tests/test_gpu_drafter_kernels.py,
#      those matching $PARITY, default all but flex_autotune, whose compile searches for minutes);
#   2. the step by part at the Qwen3-8B drafter shape, T=16384 / 1024 anchors (bench drafter
#      --profile: 2 eager steps of the compiled code, beside the graph-replayed whole step, then
#      the graph-replayed step's kernels by name);
#   3. today's path vs each variant of $VARIANTS, graph-replayed: step ms, MFU, peak GiB (one
#      process);
#   4. the step by part at T=16384 / 4096 anchors and (with ALL_SHAPES=1) T=49152 / 2048 anchors.
# Each part runs under its own `timeout`, so one slow part cannot starve the rest; everything
# printed also lands in $OUT/drafter_kernels.log. Usage: [PARITY=pytest -k expression]
# [VARIANTS=today,...] [ALL_SHAPES=1] benchmarks/h200_drafter_kernels.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/dflash_bench/out}; mkdir -p "$out"
log="$out/drafter_kernels.log"
exec > >(tee -a "$log") 2>&1
part() { echo; echo "== $1 ($(date +%T))"; }
bench=(python3 -m dflash_async bench drafter --shape qwen3-8b --compile --modes graph)
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")'

part "0. the step's GPU tests: strict capture, no host sync, checkpoints, placement"
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_drafter.py \
  tests/test_no_host_sync.py tests/test_checkpoint.py tests/test_placement_gpu.py 2>&1 \
  | grep -E 'passed|failed|skipped|Error|assert' | cut -c1-600

part "1. parity of the kernel variants with today's path (GPU tests matching: ${PARITY:-not autotune})"
timeout 120 python3 -m pytest -q -s -p no:cacheprovider -m gpu -k "${PARITY:-not autotune}" \
  tests/test_gpu_drafter_kernels.py 2>&1 \
  | grep -E '\{"check"|passed|failed|skipped|Error|assert' | cut -c1-600

part "2. by part: T=16384, 1024 anchors"
timeout 110 "${bench[@]}" --token-budget 16384 --num-anchors 1024 --steps 5 --profile 2>&1 \
  | grep -vE 'Warning|warn\(|^\s*$' | cut -c1-900

part "3. today vs each variant, graph-replayed: T=16384, 1024 anchors"
timeout 130 "${bench[@]}" --token-budget 16384 --num-anchors 1024 --steps 10 \
  --variants "${VARIANTS:-today,ce_chunk_4096,ce_chunk_8192,flex_dq_in_dkv_loop,flex_tma}" 2>&1 \
  | grep -iE '^\{|error' | cut -c1-900

part "4. by part: T=16384, 4096 anchors"
timeout 100 "${bench[@]}" --token-budget 16384 --num-anchors 4096 --steps 5 --profile 2>&1 \
  | grep -vE 'Warning|warn\(|^\s*$' | cut -c1-900

[ "${ALL_SHAPES:-0}" = 1 ] && part "5. by part: T=49152, 2048 anchors" &&
timeout 80 "${bench[@]}" --token-budget 49152 --num-anchors 2048 --steps 5 --profile 2>&1 \
  | grep -vE 'Warning|warn\(|^\s*$' | cut -c1-900

part "summary: whole step by variant and shape (graph-replayed)"
python3 - "$log" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{") and '"step_ms"' in l]
print("| variant | T | anchors | step ms | TFLOP/s | MFU | peak GiB (all) | loss |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['variant']} | {r['token_budget']} | {r['num_anchors']} | {r['step_ms']:.1f} | "
          f"{r['tflops']:.0f} | {r['mfu']:.3f} | {r['peak_all_gib']:.1f} | {r['loss']:.4f} |")
for l in open(sys.argv[1]):
    if l.startswith("{") and '"error"' in l:
        print("failed:", l.strip()[:300])
PY
part "done"
