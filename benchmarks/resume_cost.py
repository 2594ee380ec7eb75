"""What a checkpoint costs a run, and whether a resumed run continues it exactly, read from two
run logs (benchmarks/gpu.sh resume writes them):

    python benchmarks/resume_cost.py RUN_A_LOG RUN_B_LOG

Run A trains 30 steps with a checkpoint after steps 10, 20 and 30; run B resumes A's step-20
checkpoint in a new folder and trains steps 21-30. Prints each checkpoint's size, how long it
waited for the previous write, its host copy (the only part that holds training up), its
background write and the export's write; the training time lost to the first save (which
allocates and page-locks the host buffers once per run) and to the second, each also as a share
of 10 minutes; and the loss of A and B at every step 21-30.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def events(path: str) -> list[dict]:
    lines = Path(path).read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def main(log_a: str, log_b: str) -> None:
    a, b = events(log_a), events(log_b)
    steps = {e["step"]: e for e in a if e["event"] == "step"}
    exports = {e["step"]: e for e in a if e["event"] == "export_written"}
    saved = [e for e in a if e["event"] == "checkpoint_written"]
    print("| checkpoint step | size GiB | waited s | host copy s | write s | export s |")
    print("|---|---|---|---|---|---|")
    for e in saved:
        export = exports.get(e["step"], {})
        print(
            f"| {e['step']} | {e['bytes'] / 2**30:.2f} | {e.get('waited_s')} | {e['copy_s']} "
            f"| {e['write_s']} | {export.get('write_s')} |"
        )
    # step_ms is the wall time between two step lines: it holds a save's host copy and whatever
    # its background write takes from the steps after it. Steps 2-10 run before the first save.
    base = statistics.median(steps[s]["step_ms"] for s in range(2, 11))
    print(f"\nstep ms: median {base:.1f} over steps 2-10 (no save)")
    # Saves 10 steps apart wait for the previous write; at one save per 10 minutes that write is
    # long done, so the wait (logged as waited_s) is taken out of the cost.
    waited = {e["step"]: e.get("waited_s") or 0.0 for e in saved}
    for first, label in ((11, "first save (step 10)"), (21, "second save (step 20)")):
        window = range(first, first + 10)
        lost = sum(steps[s]["step_ms"] - base for s in window) / 1e3 - waited.get(first - 1, 0.0)
        print(
            f"training time lost to the {label}: {lost:.2f} s, "
            f"{100 * lost / 600:.2f}% at one save per 10 minutes"
        )
    resumed = {e["step"]: e for e in b if e["event"] == "step"}
    print("\n| step | loss A (uninterrupted) | loss B (resumed at 20) | difference |")
    print("|---|---|---|---|")
    diffs = []
    for s in sorted(resumed):
        la, lb = steps[s]["loss"], resumed[s]["loss"]
        diffs.append(abs(la - lb))
        print(f"| {s} | {la:.6f} | {lb:.6f} | {la - lb:+.2e} |")
    if diffs:
        print(f"\nmax |loss A - loss B| over steps {min(resumed)}-{max(resumed)}: {max(diffs):.2e}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python benchmarks/resume_cost.py RUN_A_LOG RUN_B_LOG")
    main(sys.argv[1], sys.argv[2])
