"""Long-context pipeline runs for BENCHMARKS.md (benchmarks/gpu.sh parts long-32k, long-64k,
long-128k): their synthetic documents, and one JSON line per run.

    python benchmarks/long_context.py data OUT_DIR --length 131072 [--documents 24]
    python benchmarks/long_context.py summary RUN_DIR --case NAME

`data` writes OUT_DIR/long_<length>.jsonl: pre-tokenized documents of exactly `length` tokens
(ids below the built-in tiny tokenizer's size, which the random targets carry: a random target's
throughput does not depend on which ids it reads), the first 30% a prompt (not supervised), the
rest supervised, so anchors spread over the whole document. `summary` reads a run folder's
log.jsonl (runlog/summary.py's medians: the first 10% of the steps are left out) and prints the
run's median tokens/s and MFU, its peak reserved GPU memory over the steps, the pack length and
the drafter's layer types.
"""

import argparse
import json
from pathlib import Path

import numpy as np

from dflash_async.runlog.parse import read_run
from dflash_async.runlog.summary import steady_median
from dflash_async.targets.tiny import tiny_tokenizer

PROMPT_FRACTION = 0.3


def write_documents(out: Path, *, length: int, documents: int) -> Path:
    path = out / f"long_{length}.jsonl"
    if path.is_file():
        return path
    vocab = len(tiny_tokenizer())
    rng = np.random.default_rng(length)
    prompt = int(length * PROMPT_FRACTION)
    mask = [0] * prompt + [1] * (length - prompt)
    out.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _ in range(documents):
            ids = rng.integers(0, vocab, length).tolist()
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
    return path


def summary(run_dir: Path, case: str) -> dict:
    run = read_run(run_dir)
    settings = json.loads((run_dir / "settings.json").read_text())["settings"]
    memory = [e["mem_gib"] for e in run.steps if isinstance(e.get("mem_gib"), int | float)]
    return {
        "case": case,
        "token_budget": settings["train"]["token_budget"],
        "num_anchors": settings["train"]["num_anchors"],
        "layer_types": settings["drafter"]["layer_types"] or "full_attention",
        "sliding_window": settings["drafter"]["sliding_window"],
        "steps": len(run.steps),
        "median_tokens_per_s": steady_median(run, "tokens_per_s"),
        "median_mfu": steady_median(run, "mfu"),
        "median_step_ms": steady_median(run, "step_ms"),
        "peak_reserved_gib": max(memory, default=None),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    data = commands.add_parser("data")
    data.add_argument("out", type=Path)
    data.add_argument("--length", type=int, required=True)
    data.add_argument("--documents", type=int, default=24)
    report = commands.add_parser("summary")
    report.add_argument("run_dir", type=Path)
    report.add_argument("--case", required=True)
    args = parser.parse_args()
    if args.command == "data":
        path = write_documents(args.out, length=args.length, documents=args.documents)
        print(json.dumps({"data": str(path), "documents": args.documents, "length": args.length}))
    else:
        print(json.dumps(summary(args.run_dir, args.case)))


if __name__ == "__main__":
    main()
