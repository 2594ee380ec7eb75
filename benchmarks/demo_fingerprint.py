"""Fingerprint of a finished run folder: its deterministic step fields, evaluations and export.

    python benchmarks/demo_fingerprint.py runs/demo

Prints one JSON line: how many `step` events, a hash of their fields that do not depend on timing
(step, epoch, loss, acc, tau_hat, lr, grad_norm, tokens, padding_frac), each `eval` event's step,
tau and accepted-length histogram, and a hash of the export's files. Two runs of the CPU demo on
two versions of the code print the same line when a change left training bit for bit as it was
(the check behind "behaviour unchanged" in BENCHMARKS.md).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

STEP_FIELDS = (
    "step",
    "epoch",
    "loss",
    "acc",
    "tau_hat",
    "lr",
    "grad_norm",
    "tokens",
    "padding_frac",
)


def fingerprint(run: Path) -> dict:
    steps, evals = [], []
    for line in (run / "log.jsonl").read_text(encoding="utf-8").splitlines():
        event = json.loads(line)
        if event.get("event") == "step":
            steps.append(tuple(event.get(k) for k in STEP_FIELDS))
        elif event.get("event") == "eval":
            evals.append((event["step"], event["tau"], event.get("accepted_length_histogram")))
    export = hashlib.sha256()
    for path in sorted((run / "drafter").iterdir()):
        export.update(path.name.encode())
        export.update(path.read_bytes())
    return {
        "steps": len(steps),
        "steps_sha": hashlib.sha256(repr(steps).encode()).hexdigest()[:16],
        "evals": evals,
        "export_sha": export.hexdigest()[:16],
    }


if __name__ == "__main__":
    print(json.dumps(fingerprint(Path(sys.argv[1])), default=str))
