"""Two ranks of one run on one GPU, launched by torchrun and joined by gloo (NCCL refuses two
ranks on one GPU; gloo all-reduces the CUDA gradient buffer through the host): the GPU code path
of a multi-node run. Each rank trains the tiny target's drafter on GPU 0 with CUDA graphs and
torch.compile, and saves its drafter's flat weights after every step
(tests/pipeline/test_distributed.py's rank entry). Prints both ranks' loss and the largest weight
difference between the ranks at every step (it must be 0: every rank makes the same update), then
PASS or FAIL. The data are random tokens: the loss need not fall.

    python benchmarks/two_ranks_one_gpu.py WORK_DIR [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from dflash_async.targets.loading import load_target_tokenizer
from dflash_async.targets.tiny import ensure_tiny_target

REPO = Path(__file__).resolve().parent.parent


def prepare(work: Path) -> tuple[Path, int]:
    """The tiny target and 200 random pre-tokenized samples, built once before the ranks start."""
    target = ensure_tiny_target(work / "cache")
    tokenizer = load_target_tokenizer(target)
    rng = random.Random(0)
    with (work / "data.jsonl").open("w") as f:
        for _ in range(200):
            n = rng.randint(40, 200)
            ids = [rng.randrange(10, len(tokenizer)) for _ in range(n)]
            mask = [0] * (n // 4) + [1] * (n - n // 4)
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
    return target, tokenizer.mask_token_id


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    work, steps = args.work, args.steps
    shutil.rmtree(work, ignore_errors=True)
    (work / "weights").mkdir(parents=True)
    target, mask_token_id = prepare(work)
    env = os.environ | {
        "DFLASH_ENV_FILE": "none",
        "DFLASH_OUTPUT_DIR": str(work / "out"),
        "DFLASH_TARGET__PATH": str(target),
        "DFLASH_TARGET__NUM_FEATURES": "3",
        "DFLASH_DATA__PATH": str(work / "data.jsonl"),
        "DFLASH_DATA__MAX_LEN": "256",
        "DFLASH_DRAFTER__NUM_LAYERS": "1",
        "DFLASH_DRAFTER__MASK_TOKEN_ID": str(mask_token_id),
        "DFLASH_TRAIN__TOKEN_BUDGET": "1024",
        "DFLASH_TRAIN__NUM_ANCHORS": "64",
        "DFLASH_TRAIN__BLOCK_SIZE": "8",
        "DFLASH_TRAIN__MAX_STEPS": str(steps),
        "DFLASH_TRAIN__SAVE_EVERY": "0",
        "DFLASH_EVAL__AT_END": "false",
        "DFLASH_PIPELINE__TARGET_DEVICES": "0",
        "DFLASH_PIPELINE__DRAFTER_DEVICES": "0",
        "DFLASH_PIPELINE__TARGET_BATCH_TOKENS": "1024",
        "DFLASH_PIPELINE__DIST_BACKEND": "gloo",
        "DFLASH_PIPELINE__DIST_TIMEOUT_S": "120",
        "DFLASH_LOG__FORMAT": "json",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        str(REPO / "tests/pipeline/test_distributed.py"),
        str(work / "weights"),
    ]
    started = time.monotonic()
    with (work / "ranks.log").open("w") as log, (work / "torchrun.err").open("w") as err:
        rc = subprocess.run(command, env=env, stdout=log, stderr=err, timeout=300).returncode
    print(f"torchrun rc={rc} wall_s={time.monotonic() - started:.0f}")
    lines = (work / "ranks.log").read_text().splitlines()
    events = [json.loads(line) for line in lines if line.startswith("{")]
    for e in events:
        if e["event"] in ("process_group_joined", "drafter_ready", "run_failed", "peer_lost"):
            print(json.dumps(e)[:400])
    loss = {(e["rank"], e["step"]): e["loss"] for e in events if e["event"] == "step"}
    ok, worst = rc == 0, 0.0
    print(f"{'step':>4} {'loss_rank0':>10} {'loss_rank1':>10} {'max_abs_weight_diff':>20}")
    for step in range(1, steps + 1):
        files = [work / "weights" / f"rank{r}-step{step}.pt" for r in range(2)]
        if not all(f.exists() for f in files):
            print(f"{step:>4} missing weights")
            ok = False
            continue
        w0, w1 = (torch.load(f, map_location="cpu") for f in files)
        diff = float((w0.float() - w1.float()).abs().max())
        worst = max(worst, diff)
        l0, l1 = loss.get((0, step), float("nan")), loss.get((1, step), float("nan"))
        print(f"{step:>4} {l0:>10.4f} {l1:>10.4f} {diff:>20.3g}")
    finite = len(loss) == 2 * steps and all(v == v and abs(v) < 1e9 for v in loss.values())
    ends = [work / "weights" / f"rank0-step{s}.pt" for s in (1, steps)]
    moved = all(f.exists() for f in ends) and not torch.equal(*(torch.load(f) for f in ends))
    ok = ok and worst == 0.0 and finite and moved
    print(
        f"{'PASS' if ok else 'FAIL'}: rc={rc}, max weight difference between ranks {worst:g}, "
        f"loss finite on every step of both ranks: {finite}, weights moved: {moved}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
