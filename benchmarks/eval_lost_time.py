"""Training time lost to in-run evaluations, read from a run's JSON log.

    python benchmarks/eval_lost_time.py RUN_LOG.jsonl

The steady step interval is the median wall time between consecutive `step` events outside any
evaluation (the first 5 steps, compile and warm-up, left out). An evaluation runs from its
request (its `eval` event's time less eval_s and training_waited_s) to its `eval` event; the steps that completed meanwhile should have taken
(count x steady interval): the rest of the window is training time lost to the evaluation.
Prints one JSON line per evaluation.
"""

import itertools
import json
import statistics
import sys
from datetime import datetime


def seconds(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def main() -> None:
    with open(sys.argv[1]) as log:
        events = [json.loads(line) for line in log if line.startswith("{")]
    steps = {e["step"]: seconds(e) for e in events if e.get("event") == "step"}
    evals = [e for e in events if e.get("event") in ("eval", "eval_failed")]  # both timed
    windows = []  # an evaluation runs from its request (after step N) to its `eval` event
    for e in evals:
        asked = e["training_waited_s"] + (e["eval_s"] if e["mode"] == "overlap" else 0.0)
        windows.append((seconds(e) - asked, seconds(e)))
    ordered = sorted(steps.items())
    intervals = [
        b - a
        for (n, a), (_, b) in itertools.pairwise(ordered)
        if n >= 5 and not any(lo < b and a < hi for lo, hi in windows)
    ]
    steady = statistics.median(intervals) if intervals else float("nan")
    last_step = max(steps.values(), default=0.0)
    for e, (lo, end) in zip(evals, windows, strict=True):
        hi = min(end, last_step)  # after the last step no training is left to lose
        done = sum(1 for t in steps.values() if lo < t <= hi)
        print(
            json.dumps(
                {
                    "eval_step": e["step"],
                    "mode": e["mode"],
                    "eval_wall_s": round(end - lo, 1),
                    "steps_during_eval": done,
                    "steady_step_s": round(steady, 3),
                    "lost_training_s": round(max(0.0, hi - lo) - done * steady, 1),
                    "training_waited_s": e["training_waited_s"],
                    "target_busy_s": e["target_busy_s"],
                    "baseline_cached": e["baseline_cached"],
                    "tau": e.get("tau"),
                    "speculative_tokens_per_s": e.get("speculative_tokens_per_s"),
                    "plain_tokens_per_s": e.get("plain_tokens_per_s"),
                    "numerical_ties": e.get("numerical_ties"),
                    "failed": e["event"] == "eval_failed",
                }
            )
        )


if __name__ == "__main__":
    main()
