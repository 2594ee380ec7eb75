#!/usr/bin/env bash
# Issue 13: two ranks of one run on ONE H200, launched by torchrun, joined by gloo (NCCL refuses
# two ranks on one GPU; gloo all-reduces the CUDA gradient buffer through the host). Each rank
# runs the tiny target and a drafter on GPU 0 with CUDA graphs and torch.compile on: the GPU code
# path of a multi-node run. Prints, per step, both ranks' loss and the largest weight difference
# between the ranks (must be 0: every rank makes the same update), then PASS or FAIL.
# The data are random tokens: the loss need not fall; the check is equality and finiteness.
# Usage: benchmarks/h200_distributed.sh [WORK_DIR] [STEPS]    (~1-2 min, mostly start-up/compile)
set -uo pipefail
export PYTHONUNBUFFERED=1
work=${1:-/tmp/dflash_distributed}; steps=${2:-20}
rm -rf "$work" && mkdir -p "$work/weights"
# The tiny target and 200 random pre-tokenized samples, built once before the ranks start.
python3 - "$work" <<'PY'
import json, random, sys
from pathlib import Path
from dflash_async.targets.loading import load_target_tokenizer
from dflash_async.targets.tiny import ensure_tiny_target
work = Path(sys.argv[1])
target = ensure_tiny_target(work / "cache")
tokenizer = load_target_tokenizer(target)
vocab = len(tokenizer)
(work / "mask_token_id").write_text(str(tokenizer.mask_token_id))
rng = random.Random(0)
with (work / "data.jsonl").open("w") as f:
    for _ in range(200):
        n = rng.randint(40, 200)
        ids = [rng.randrange(10, vocab) for _ in range(n)]
        f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * (n // 4) + [1] * (n - n // 4)}) + "\n")
(work / "target_path").write_text(str(target))
PY
started=$(date +%s)
env DFLASH_ENV_FILE=none DFLASH_OUTPUT_DIR="$work/out" DFLASH_TARGET__PATH="$(cat "$work/target_path")" \
    DFLASH_TARGET__NUM_FEATURES=3 DFLASH_DATA__PATH="$work/data.jsonl" DFLASH_DATA__MAX_LEN=256 \
    DFLASH_DRAFTER__NUM_LAYERS=1 DFLASH_DRAFTER__MASK_TOKEN_ID="$(cat "$work/mask_token_id")" \
    DFLASH_TRAIN__TOKEN_BUDGET=1024 DFLASH_TRAIN__NUM_ANCHORS=64 \
    DFLASH_TRAIN__BLOCK_SIZE=8 DFLASH_TRAIN__MAX_STEPS="$steps" DFLASH_TRAIN__SAVE_EVERY=0 \
    DFLASH_EVAL__AT_END=false DFLASH_PIPELINE__TARGET_DEVICES=0 DFLASH_PIPELINE__DRAFTER_DEVICES=0 \
    DFLASH_PIPELINE__TARGET_BATCH_TOKENS=1024 DFLASH_PIPELINE__DIST_BACKEND=gloo \
    DFLASH_PIPELINE__DIST_TIMEOUT_S=120 DFLASH_LOG__FORMAT=json GLOO_SOCKET_IFNAME=lo \
    timeout 300 python3 -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 2 \
    tests/test_distributed.py "$work/weights" > "$work/ranks.log" 2> "$work/torchrun.err"
rc=$?
echo "== torchrun rc=$rc wall_s=$(( $(date +%s) - started ))"
[ -n "${OUT:-}" ] && cp "$work/ranks.log" "$work/torchrun.err" "$OUT/"
python3 - "$work" "$steps" "$rc" <<'PY'
import json, sys
from pathlib import Path
import torch
work, steps, rc = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
events = [json.loads(l) for l in (work / "ranks.log").read_text().splitlines() if l.startswith("{")]
for e in events:
    if e["event"] in ("process_group_joined", "drafter_ready", "run_failed", "peer_lost", "rank_failed"):
        print(json.dumps(e)[:400])
loss = {(e["rank"], e["step"]): e["loss"] for e in events if e["event"] == "step"}
ok, worst = rc == 0, 0.0
print(f"{'step':>4} {'loss_rank0':>10} {'loss_rank1':>10} {'max_abs_weight_diff':>20}")
for step in range(1, steps + 1):
    files = [work / "weights" / f"rank{r}-step{step}.pt" for r in range(2)]
    if not all(f.exists() for f in files):
        print(f"{step:>4} missing weights"); ok = False; continue
    w0, w1 = (torch.load(f, map_location="cpu") for f in files)
    diff = float((w0.float() - w1.float()).abs().max())
    worst = max(worst, diff)
    print(f"{step:>4} {loss.get((0, step), float('nan')):>10.4f} {loss.get((1, step), float('nan')):>10.4f} {diff:>20.3g}")
finite = len(loss) == 2 * steps and all(v == v and abs(v) < 1e9 for v in loss.values())
ends = [work / "weights" / f"rank0-step{s}.pt" for s in (1, steps)]
moved = all(f.exists() for f in ends) and not torch.equal(*(torch.load(f) for f in ends))
ok = ok and worst == 0.0 and finite and moved
print(f"{'PASS' if ok else 'FAIL'}: rc={rc}, max weight difference between ranks {worst:g}, "
      f"loss finite on every step of both ranks: {finite}, weights moved: {moved}")
PY
