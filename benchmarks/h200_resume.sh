#!/usr/bin/env bash
# Issue 12 on one H200: checkpoint time and size, the step-time cost of periodic saves, and resume
# parity, with the Qwen3-8B-shaped random target of benchmarks/make_random_target.py and the
# 1-GPU preset (target and drafter workers on GPU 0, 5 drafter layers, CUDA graph + compile).
#   run A: 30 steps, checkpoints after steps 10, 20 and 30 (the newest 2 kept)
#   run B: resume A's step-20 checkpoint in a new folder, steps 21-30  -> loss vs A, step by step
# The first save allocates and page-locks the host staging buffers (once per run); the second is
# the steady state of a long run, so both are reported. A checkpoint here is 11.7 GiB (1.05 B fp32
# parameters + AdamW's two moments): A's step-30 one is deleted before B so that the disk holds
# at most target + 3 checkpoints (~51 GB of 64).
# Usage: benchmarks/h200_resume.sh [WORK_DIR] ; about 4 minutes (target ~1 min, each run ~1 min).
set -uo pipefail
export PYTHONUNBUFFERED=1
work=${1:-/tmp/dflash_bench}
[ -d "$work/qwen3-8b-random" ] || python3 benchmarks/make_random_target.py "$work"
rm -rf "$work/resume_a" "$work/resume_b"
common=(DFLASH_ENV_FILE=settings/qwen3_8b_1xh200.env DFLASH_TARGET__PATH="$work/qwen3-8b-random"
        DFLASH_DATA__PATH="$work/synthetic.jsonl" DFLASH_TRAIN__MAX_STEPS=30
        DFLASH_TRAIN__SAVE_EVERY=10 DFLASH_EVAL__EVERY=0 DFLASH_EVAL__AT_END=false
        DFLASH_LOG__FORMAT=json)
run() {  # name extra settings...
  local name=$1; shift
  env "${common[@]}" DFLASH_OUTPUT_DIR="$work/$name" "$@" python3 -m dflash_async run \
      > "$work/$name.log" 2> "$work/$name.err"
  echo "== $name rc=$?"
  grep -E '"(run_failed|train_interrupted)"' "$work/$name.log" | cut -c1-600
  tail -2 "$work/$name.err"
  [ -n "${OUT:-}" ] && cp "$work/$name.log" "$OUT/$name.log"
}
run resume_a
du -sh "$work/resume_a/checkpoints"/* "$work/resume_a/drafter"
rm -rf "$work/resume_a/checkpoints/step-00000030"
run resume_b DFLASH_TRAIN__RESUME="$work/resume_a/checkpoints/step-00000020"
python3 - "$work" <<'EOF'
import json, statistics, sys
work = sys.argv[1]
def events(name):
    return [json.loads(l) for l in open(f"{work}/{name}.log") if l.startswith("{")]
a, b = events("resume_a"), events("resume_b")
steps = {e["step"]: e for e in a if e["event"] == "step"}
print("\n| checkpoint step | size GiB | waited for the previous write s | host copy s (blocks training) | write s (background) | export s |")
print("|---|---|---|---|---|---|")
exports = {e["step"]: e for e in a if e["event"] == "export_written"}
saved = [e for e in a if e["event"] == "checkpoint_written"]
for e in saved:
    x = exports.get(e["step"], {})
    print(f"| {e['step']} | {e['bytes'] / 2**30:.2f} | {e.get('waited_s')} | {e['copy_s']} | {e['write_s']} | {x.get('write_s')} |")
# step_ms is the wall time between two step lines: it includes a save's host copy (between
# steps) and whatever its background write takes from the steps after it. Steps 2-10 run before
# the first save (step 1 includes warm-up); the first save (step 10, allocating the staging)
# falls in steps 11-20, the second (reusing it) in steps 21-30.
base = statistics.median(steps[s]["step_ms"] for s in range(2, 11))
print(f"\nstep ms: median {base:.1f} over steps 2-10 (no save)")
# Saves 10 steps (~7 s) apart wait for the previous write (~20 s): at one save per 10 minutes
# that write is long done, so the wait (logged as waited_s) is taken out of the cost.
waited = {e["step"]: e.get("waited_s") or 0.0 for e in saved}
for first, label in ((11, "first save (step 10)"), (21, "second save (step 20)")):
    window = range(first, first + 10)
    extra_s = sum(steps[s]["step_ms"] - base for s in window) / 1e3 - waited[first - 1]
    print(f"steps {first}-{first + 9}: " + ", ".join(f"{steps[s]['step_ms']:.0f}" for s in window))
    print(f"training time lost to the {label}, its wait for the previous write taken out: "
          f"{extra_s:.2f} s -> {100 * extra_s / 600:.2f}% at one save per 10 min")
print("\n| step | loss A (uninterrupted) | loss B (resumed at 20) | diff |")
print("|---|---|---|---|")
resumed = {e["step"]: e for e in b if e["event"] == "step"}
print("resumed:", [ {k: e[k] for k in ("step", "epoch", "pack")} for e in b if e["event"] == "resumed"])
diffs = []
for s in sorted(resumed):
    la, lb = steps[s]["loss"], resumed[s]["loss"]
    diffs.append(abs(la - lb))
    print(f"| {s} | {la:.6f} | {lb:.6f} | {la - lb:+.2e} |")
print(f"\nmax |loss A - loss B| over steps 21-30: {max(diffs):.2e}")
EOF
exit 0
