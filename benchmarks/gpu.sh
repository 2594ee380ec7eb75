#!/usr/bin/env bash
# The GPU tests and the measurements behind BENCHMARKS.md, by part. Run from the repository root:
#
#   OUT=out benchmarks/gpu.sh PART [PART...]
#
# Every part writes what it measures under $OUT (default ./out): pytest's -v output straight into a
# .txt file, benchmark JSON lines into .jsonl files, run logs into .log files, and a copy of what
# it printed into PART.log. Each command runs under its own time limit, so a slow or failing one
# leaves the others' results. Scratch files (random targets, run folders) go to $WORK (default
# /tmp/dflash_bench). Optional: wheels in .whl/ ($WHEELS) are installed offline first
# (benchmarks/gpu_lib.sh). One GPU is enough for every part but `pipeline`'s two-GPU run.
#
# Parts:
#   tests        the GPU tests outside tests/model and tests/targets (python -m pytest -m gpu -v
#                tests ...), one test at a time
#   model-tests  the GPU tests of tests/model (whole compiled drafter steps: the longest part)
#   target-tests the GPU tests of tests/targets; the three test parts are split so that each
#                stays under TESTS_TIMEOUT (default 560 s) on one 80 GB card; each writes every
#                test's peak reserved GPU memory to gpu_test_memory.jsonl and pytest's 15
#                slowest tests to the end of its .txt
#   suite        the three test parts above at once, three pytest processes on one card (their
#                largest tests reserve 66, 21 and 20 GiB: a card of 141 GB; on 80 GB run
#                model-tests beside target-tests, then tests), each under TESTS_TIMEOUT
#   drafter      `bench drafter` at the Qwen3-8B drafter shape: DFlash at 1024 and 4096 anchors
#                and T = 49152, by part (--profile), DFlash2, block 8 with a 248k vocabulary,
#                sliding-window layers, FP8 linears, flash-attn-4 against Triton, the small shape
#   dspark       `bench drafter`: DSpark (block 7) beside DFlash at the Qwen3-8B shape (T 16384,
#                1024 anchors) and at SpecForge's geometry (the Qwen3-4B shape: 5 layers,
#                d 2560, ffn 9728, T 8192 as 2 documents x 4096, 1024 anchors)
#   kernels      the kernels' launch sweeps alone: CE pass, DFlash2 convolutions, DFlash2's extra
#                pieces, the FP8 experts' products; the step's clocks under the power limit
#   research     benchmarks/research: attention tiles and backends, the optimizer phase, the
#                working weights' linears, CUDA-graph parity and threads
#   memory       memory over 200 graph-replayed steps at T = 49152, 2048 anchors
#   target       `bench target`: HF against packed per family, bf16 against FP8, CUDA graph;
#                fp32 parity of the packed families; the Qwen3-30B-A3B forward's kernels; the
#                target split into stages on one GPU
#   families-a   `bench target --reference generic`: the packed forward of each 2026 family against the
#   families-b   generic path (each document alone), at its published shape or the layers that fit
#                (bench/target_shapes.py); a shape whose config class the installed transformers
#                lacks is skipped with the reason (put transformers >= 5.25 and its needs in .whl/)
#   pipeline     `run` co-located on one GPU (random Qwen3-8B target bf16 and FP8, Qwen3.5-9B,
#                Qwen3.5-35B-A3B, Qwen3-Next-80B-A3B FP8 drawn in the run), split over two GPUs
#   report       a 200-step co-located run and its report (the folder committed as docs/report/)
#   placement    the placement model's table, `run` with layout auto, two pairs on one GPU
#   eval         batched decoding throughput; evaluation during training and its cost
#   regen        in-process regeneration against HF generate
#   resume       checkpoint cost and resume parity at the Qwen3-8B shape
#   distributed  two torchrun ranks of one run on one GPU (gloo): equal weights every step
#   fp8curve     500-step demo loss curves, FP8 drafter linears against bf16
#   long-32k     long context (settings/long-context.env), co-located on GPU 0, random Qwen3-8B
#                drawn in the run: the 16k recipe, then 32768-token documents with full-attention
#                and with sliding-window (W 2048) drafter layers; one JSON line per run in
#                long_context.jsonl (tokens/s, peak reserved memory)
#   long-64k     the same at 65536-token documents
#   long-128k    the same at 131072-token documents (512 anchors, one slot: one 80 GB card)
#   images       image+text at the Qwen3-VL-8B shape (random weights): the target forward on
#                image packs beside text-only packs of the same lengths, packed and per document
#                (multimodal_target.jsonl),
#                then `run` co-located on GPU 0 (the wrapper drawn in the run, bf16, 20 steps) on
#                generated 448x448 image+text records and on text records of the same token
#                lengths: one JSON line per run in multimodal_pipeline.jsonl (tokens/s, images/s,
#                peak memory). Needs torchvision (Qwen3-VL's processor).
. "$(dirname "$0")/gpu_lib.sh"

parts="tests model-tests target-tests suite drafter dspark kernels research memory target families-a families-b pipeline report placement eval regen resume distributed fp8curve long-32k long-64k long-128k images"
[ $# -gt 0 ] || { echo "usage: $0 PART [PART...] (parts: $parts)" >&2; exit 2; }
for which in "$@"; do
  [[ " $parts " == *" $which "* ]] || { echo "unknown part $which (parts: $parts)" >&2; exit 2; }
done

python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
  "transformers", transformers.__version__,
  torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")'

for which in "$@"; do
  exec > >(tee -a "$out/$which.log") 2>&1
  case $which in
  tests)
    part "GPU tests outside tests/model and tests/targets"
    gpu_pytest gpu_tests -m gpu tests --ignore=tests/model --ignore=tests/targets
    ;;
  model-tests)
    part "GPU tests of tests/model"
    gpu_pytest gpu_model_tests -m gpu tests/model
    ;;
  target-tests)
    part "GPU tests of tests/targets"
    gpu_pytest gpu_target_tests -m gpu tests/targets
    ;;
  suite)
    part "the GPU tests, three parts at once"
    gpu_pytest gpu_tests -m gpu tests --ignore=tests/model --ignore=tests/targets &
    gpu_pytest gpu_model_tests -m gpu tests/model &
    gpu_pytest gpu_target_tests -m gpu tests/targets &
    wait
    ;;
  drafter)
    drafter 300 --steps 10
    drafter 300 --steps 10 --num-anchors 4096
    drafter 300 --steps 5 --token-budget 49152 --num-anchors 2048
    drafter 300 --steps 5 --profile  # the tables by part go to bench_drafter.err
    drafter 300 --steps 8 --kind dflash
    drafter 300 --steps 8 --kind dflash2
    drafter 300 --steps 5 --kind dflash --block-size 8 --vocab-size 248320 --num-anchors 2048
    drafter 300 --steps 5 --kind dflash2 --block-size 8 --vocab-size 248320 --num-anchors 2048
    drafter 300 --steps 3 --token-budget 49152
    drafter 300 --steps 3 --token-budget 49152 --layer-types sliding_attention --sliding-window 2048
    drafter 300 --steps 5 --fp8-matmuls
    drafter 300 --steps 10 --variants flex_triton,today
    drafter 300 --steps 10 --variants master_weights,today
    part "bench drafter, small shape, eager against graph"
    limited 200 python3 -m dflash_async bench drafter --shape small --token-budget 8192 \
      --num-anchors 512 --modes eager,graph --steps 20 | tee -a "$out/bench_drafter.jsonl"
    ;;
  dspark)
    for kind in dspark dflash; do
      drafter 300 --steps 10 --kind $kind --block-size 7 --token-budget 16384 --num-anchors 1024
      drafter 300 --steps 10 --kind $kind --block-size 7 --shape qwen3-4b --token-budget 8192 \
        --num-docs 2 --num-anchors 1024
    done
    drafter 300 --steps 5 --kind dspark --block-size 7 --token-budget 16384 --num-anchors 1024 \
      --profile  # the table by part goes to bench_drafter.err
    ;;
  kernels)
    part "CE pass launches"
    limited 200 python3 benchmarks/ce_launch_sweep.py --launches block | tee "$out/ce_launch.jsonl"
    part "DFlash2 convolution launches"
    limited 200 python3 benchmarks/conv_launch_sweep.py | tee "$out/conv_launch.jsonl"
    part "DFlash2's pieces alone"
    limited 200 python3 benchmarks/dflash2_pieces.py | tee "$out/dflash2_pieces.jsonl"
    part "FP8 experts module and its products"
    limited 400 python3 benchmarks/fp8_experts_gpu.py --launches-only --sweep \
      | tee "$out/fp8_experts.jsonl"
    part "the step's clock and power, 30 replays back to back and after rests"
    limited 400 python3 benchmarks/step_clocks.py --variants today,flex_triton \
      | tee "$out/step_clocks.jsonl"
    ;;
  research)
    for anchors in 1024 4096; do
      part "attention, $anchors anchors: torch's Triton kernels against flash-attn-4"
      limited 240 python3 benchmarks/research/attention_bench.py --num-anchors "$anchors" \
        --configs default,flash_backend | tee -a "$out/attention.jsonl"
    done
    part "the optimizer phase alone"
    limited 200 python3 benchmarks/research/optimizer_bench.py --shape qwen3-8b --replays 20 \
      --kernels | tee "$out/optimizer.jsonl"
    part "the working weights' linears"
    limited 200 python3 benchmarks/research/linear_bench.py | tee "$out/linear.jsonl"
    part "CUDA graphs: parity and threads, small shape"
    limited 200 python3 benchmarks/research/graph_bench.py --checks parity,threads --shape small \
      --steps 20 --threads 4 | tee "$out/graphs.jsonl"
    ;;
  memory)
    part "memory over 200 replayed steps, T = 49152, 2048 anchors"
    limited 600 python3 benchmarks/research/graph_bench.py --checks memory --shape qwen3-8b \
      --token-budget 49152 --num-anchors 2048 --steps 200 | tee "$out/memory.jsonl"
    ;;
  target)
    target 300 --shapes qwen3-8b --quantize none,fp8-fast --cuda-graph
    target 300 --shapes qwen3-30b-a3b --experts hf,compiled --quantize none,fp8-fast --cuda-graph
    target 300 --shapes qwen3.5-9b
    for shape in mistral-7b gemma3-12b gemma3-27b gemma4-31b-like gpt-oss-20b qwen3.5-35b-a3b \
                 glm-4.5-air-16l; do
      target 300 --shapes $shape
    done
    for shape in moonlight-16b-a3b minimax-m2-8l qwen3-next-80b-a3b-16l; do
      target 300 --shapes $shape --experts hf,compiled
    done
    part "packed families against fp32 truth"
    limited 300 python3 benchmarks/family_parity_gpu.py | tee "$out/family_parity.jsonl"
    limited 200 python3 benchmarks/family_parity_gpu.py --shapes gemma4-31b-like --layers 6 \
      | tee -a "$out/family_parity.jsonl"
    part "packed sliding-window forward against fp64 (tiny models)"
    PYTHONPATH=$PYTHONPATH:tests limited 120 python3 benchmarks/window_parity_gpu.py --part 1 \
      | tee "$out/window_parity.jsonl"
    part "Qwen3-30B-A3B forward's kernels, bf16 and FP8"
    limited 300 python3 benchmarks/profile_target_gpu.py --shape qwen3-30b-a3b --top 30 \
      > "$out/target_profile.txt" 2>&1
    part "a target split into stages on one GPU"
    limited 300 python3 benchmarks/split_chain_gpu.py --stages 2,3 --packs 20 \
      | tee "$out/split_chain.jsonl"
    ;;
  families-a)
    target 560 --shapes lfm2-2.6b,lfm2-8b-a1b,nemotron-h-8b,kimi-linear-48b-a3b,qwen3-vl-30b-a3b,muse-glimmer-30b,mistral-small-4-16l \
      --reference generic --experts compiled
    ;;
  families-b)
    target 560 --shapes deepseek-v3.2-7l,glm-5-8l,kimi-k2.5-4l,muse-spark-4l,deepseek-v4-flash-8l,inkling-2-small-4l,longcat-flash-3l \
      --reference generic --experts compiled
    ;;
  pipeline)
    random_target
    part "co-located on GPU 0, random Qwen3-8B, bf16 and FP8, 100 steps"
    pipeline_run pipeline_8b DFLASH_TRAIN__MAX_STEPS=100
    pipeline_run pipeline_8b_fp8 DFLASH_TRAIN__MAX_STEPS=100 DFLASH_TARGET__QUANTIZE=fp8
    part "co-located, targets drawn in the run from their config"
    for case in qwen3.5-35b-a3b:none:100 qwen3-next-80b-a3b:fp8:50; do
      IFS=: read -r shape quantize steps <<< "$case"
      [ -d "$work/$shape-config" ] ||
        python3 benchmarks/make_random_target.py "$work" --shape "$shape" --config-only
      pipeline_run "pipeline_$shape" DFLASH_TARGET__PATH="$work/$shape-config" \
        DFLASH_TARGET__WEIGHTS=random DFLASH_TARGET__QUANTIZE="$quantize" \
        DFLASH_TRAIN__MAX_STEPS="$steps"
    done
    part "co-located, random Qwen3.5-9B (packed hybrid), 35 steps"
    [ -d "$work/qwen3.5-9b-random" ] ||
      python3 benchmarks/make_random_target.py "$work" --shape qwen3.5-9b
    pipeline_run pipeline_qwen3.5-9b DFLASH_ENV_FILE=settings/qwen3_5_9b_1xh200.env \
      DFLASH_TARGET__PATH="$work/qwen3.5-9b-random" DFLASH_TRAIN__MAX_STEPS=35
    if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
      part "split: target on GPU 0, drafter on GPU 1, 40 steps"
      pipeline_run pipeline_split DFLASH_TRAIN__MAX_STEPS=40 \
        DFLASH_PIPELINE__TARGET_DEVICES=0 DFLASH_PIPELINE__DRAFTER_DEVICES=1
    fi
    ;;
  report)
    random_target
    part "200 co-located steps, a checkpoint every 100, and the report"
    pipeline_run report_run DFLASH_TRAIN__MAX_STEPS=200 DFLASH_TRAIN__SAVE_EVERY=100 \
      DFLASH_LOG__EVERY=20
    python3 -m dflash_async report "$work/report_run" --out "$out/report"
    cp "$work/report_run/log.jsonl" "$work/report_run/settings.json" "$out/report/"
    cat "$out/report/summary.json"
    ;;
  placement)
    part "the placement model's table (CPU)"
    python3 benchmarks/placement_model.py | tee "$out/placement_model.txt"
    random_target
    part "run with layout auto on GPU 0, 40 steps"
    pipeline_run placement_auto DFLASH_PIPELINE__LAYOUT=auto DFLASH_PIPELINE__DEVICES=0 \
      DFLASH_TRAIN__MAX_STEPS=40
    part "two target and two drafter workers on GPU 0"
    gpu_pytest placement_tests -m gpu tests/pipeline/test_placement_gpu.py
    ;;
  eval)
    part "batched decoding throughput, 64 prompts x 256 new tokens, batch 64"
    limited 300 python3 benchmarks/eval_throughput.py --prompts 64 --max-new-tokens 256 \
      --batch-size 64 | tee "$out/eval_throughput.jsonl"
    random_target
    python3 - "$work" << 'PY'
import json, random, sys
from transformers import AutoTokenizer
work = sys.argv[1]
vocab = AutoTokenizer.from_pretrained(f"{work}/qwen3-8b-random").get_vocab()
words = [w for w in vocab if w.isalpha()]
rng = random.Random(0)
with open(f"{work}/eval_prompts.jsonl", "w") as f:  # 64 prompts of 40..400 words
    for _ in range(64):
        f.write(json.dumps({"prompt": " ".join(rng.choices(words, k=rng.randint(40, 400)))}) + "\n")
PY
    part "60 steps, overlapping evaluations after steps 20 and 40, one after training"
    pipeline_run eval_run DFLASH_TRAIN__MAX_STEPS=60 DFLASH_EVAL__EVERY=20 DFLASH_EVAL__MODE=overlap \
      DFLASH_EVAL__JOB_MS=2000 DFLASH_EVAL__AT_END=true \
      DFLASH_EVAL__PROMPTS_PATH="$work/eval_prompts.jsonl" DFLASH_EVAL__NUM_PROMPTS=64 \
      DFLASH_EVAL__MAX_NEW_TOKENS=256 DFLASH_EVAL__BATCH_SIZE=64
    grep '"event": "eval"' "$out/eval_run.log" | cut -c1-1200
    python3 benchmarks/eval_lost_time.py "$out/eval_run.log"
    ;;
  regen)
    gpu_pytest regen_tests -m gpu tests/regen/test_regen_batched.py
    part "bench regen: 400 prompts x 512 new tokens, Qwen3-8B shape"
    limited 600 python3 -m dflash_async bench regen --prompts 400 --max-new-tokens 512 \
      2> "$out/bench_regen.err" | tee "$out/bench_regen.jsonl"
    tail -8 "$out/bench_regen.err"
    ;;
  resume)
    random_target
    part "run A: 30 steps, checkpoints after 10, 20, 30; run B: resumes A's step 20"
    pipeline_run resume_a DFLASH_TRAIN__MAX_STEPS=30 DFLASH_TRAIN__SAVE_EVERY=10
    du -sh "$work/resume_a/checkpoints"/* "$work/resume_a/drafter"
    rm -rf "$work/resume_a/checkpoints/step-00000030"
    pipeline_run resume_b DFLASH_TRAIN__MAX_STEPS=30 DFLASH_TRAIN__SAVE_EVERY=10 \
      DFLASH_TRAIN__RESUME="$work/resume_a/checkpoints/step-00000020"
    python3 benchmarks/resume_cost.py "$out/resume_a.log" "$out/resume_b.log"
    ;;
  distributed)
    part "two ranks of one run on GPU 0, joined by gloo, 20 steps"
    limited 400 python3 benchmarks/two_ranks_one_gpu.py "$work/distributed" --steps 20
    ;;
  fp8curve)
    part "500-step demo curves: bf16 and FP8 drafter linears, seeds 42 and 43"
    limited 1200 python3 benchmarks/fp8_drafter_curve.py --runs bf16:42,bf16:43,fp8:42,fp8:43 \
      --out "$out/fp8_curve" | tail -40
    ;;
  long-32k | long-64k | long-128k)
    # length:steps:anchors:slots:seconds per run; the steps and limits keep each part under 9
    # minutes (a run's start-up, weights drawn on the GPU and compiles, is about 100 s)
    case $which in
      long-32k) spec=32768:20:1024:2:170 ;;
      long-64k) spec=65536:14:1024:2:240 ;;
      long-128k) spec=131072:5:512:1:260 ;;
    esac
    IFS=: read -r length steps anchors slots limit <<< "$spec"
    [ -d "$work/qwen3-8b-config" ] ||
      python3 benchmarks/make_random_target.py "$work" --shape qwen3-8b --config-only
    python3 benchmarks/long_context.py data "$work" --length "$length" --documents $((steps + 2))
    long=(DFLASH_TARGET__PATH="$work/qwen3-8b-config" DFLASH_TARGET__WEIGHTS=random)
    if [ "$which" = long-32k ]; then
      part "the 16k recipe (settings/qwen3_8b_1xh200.env), 40 steps"
      RUN_TIMEOUT=150 pipeline_run long_16k_recipe "${long[@]}" DFLASH_TRAIN__MAX_STEPS=40
      python3 benchmarks/long_context.py summary "$work/long_16k_recipe" --case 16k_recipe \
        | tee -a "$out/long_context.jsonl"
    fi
    sliding=sliding_attention,sliding_attention,sliding_attention,sliding_attention,sliding_attention
    for layers in full sliding; do
      name=long_${length}_$layers
      part "$length-token documents, $layers-attention drafter layers, $steps steps"
      extra=()
      [ "$layers" = sliding ] &&
        extra=(DFLASH_DRAFTER__LAYER_TYPES=$sliding DFLASH_DRAFTER__SLIDING_WINDOW=2048)
      RUN_TIMEOUT=$limit pipeline_run "$name" DFLASH_ENV_FILE=settings/long-context.env \
        "${long[@]}" DFLASH_DATA__PATH="$work/long_$length.jsonl" DFLASH_DATA__MAX_LEN="$length" \
        DFLASH_TRAIN__TOKEN_BUDGET="$length" DFLASH_TRAIN__NUM_ANCHORS="$anchors" \
        DFLASH_PIPELINE__NUM_SLOTS="$slots" DFLASH_PIPELINE__TARGET_BATCH_TOKENS="$length" \
        DFLASH_TRAIN__MAX_STEPS="$steps" "${extra[@]}"
      python3 benchmarks/long_context.py summary "$work/$name" --case "${length}_$layers" \
        | tee -a "$out/long_context.jsonl"
    done
    ;;
  images)
    part "target forward, Qwen3-VL-8B shape: image+text and text-only packs of 16384 tokens"
    limited 240 python3 benchmarks/multimodal_target.py --shape qwen3-vl-8b \
      2> "$out/multimodal_target.err" | tee "$out/multimodal_target.jsonl"
    [ -d "$work/qwen3-vl-8b-config" ] ||
      python3 benchmarks/make_random_target.py "$work" --shape qwen3-vl-8b
    python3 benchmarks/multimodal_pipeline.py data "$work" --target "$work/qwen3-vl-8b-config"
    # the steps and limits keep the part near 9 minutes (a run's start-up is about 100 s)
    for case in image_text:vl_images text_only:vl_text; do
      IFS=: read -r name data <<< "$case"
      part "co-located on GPU 0, random Qwen3-VL-8B drawn in the run, $name data, 20 steps"
      RUN_TIMEOUT=150 pipeline_run "images_$name" DFLASH_TARGET__PATH="$work/qwen3-vl-8b-config" \
        DFLASH_TARGET__WEIGHTS=random DFLASH_DATA__PATH="$work/$data.jsonl" \
        DFLASH_TRAIN__MAX_STEPS=20
      python3 benchmarks/multimodal_pipeline.py summary "$work/images_$name" --case "$name" \
        | tee -a "$out/multimodal_pipeline.jsonl"
    done
    ;;
  esac
done
part "done"
