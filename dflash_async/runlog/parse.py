"""Read a run's JSON log back: events in file order, step lines by step, bad lines counted.

A log is what the run wrote (`OUTPUT_DIR/log.jsonl`) or what a person captured from stdout (which
may hold tracebacks, progress bars or a line cut off by a kill). Every line that is not a JSON
object with an `event` field is counted in `bad_lines` and skipped, never fatal. A resumed run
appends to the same file, so a step can appear twice: the last line of a step wins.

A file with none of the events every run logs (RUN_EVENTS) holds no run log: `read_run` raises
RunLogError (exit 2) rather than draw an empty report. On several nodes every event of a rank
carries `rank` and OUTPUT_DIR/log.jsonl holds rank 0's lines alone; a captured stdout of all
ranks holds each step once per rank, so the step lines kept are the lowest rank's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from dflash_async.usage import UsageError

LOG_NAME = "log.jsonl"
SETTINGS_NAME = "settings.json"
# Logged by every run: `settings_loaded` first (__main__), `run_summary` last (record.py), and
# `run_started` and `step` once training starts; a failed start-up still has the first two.
RUN_EVENTS = frozenset({"settings_loaded", "run_started", "step", "run_summary"})
# Events that open a new stretch of steps: a new process (a restart) or a resume.
SEGMENT_EVENTS = frozenset({"settings_loaded", "run_started", "resumed"})


class RunLogError(UsageError):
    """A path that holds no log (one line for the user: exit 2)."""


@dataclass
class RunLog:
    """One run's events. `steps` holds one `step` event per step number, in step order."""

    name: str
    path: Path
    events: list[dict[str, Any]]
    bad_lines: int
    settings: dict[str, Any] | None = None
    steps: list[dict[str, Any]] = field(init=False)
    segments: dict[int, int] = field(init=False)  # step -> its stretch (SEGMENT_EVENTS seen)

    def __post_init__(self) -> None:
        lines = [e for e in self.events if e["event"] == "step" and _is_number(e.get("step"))]
        rank = min((_rank(e) for e in lines), default=0)
        kept = {id(e) for e in lines if _rank(e) == rank}
        by_step: dict[int, dict[str, Any]] = {}
        self.segments, segment = {}, 0
        for event in self.events:
            if event["event"] in SEGMENT_EVENTS:
                segment += 1
            elif id(event) in kept:
                by_step[int(event["step"])] = event  # a resumed run's repeat replaces the first
                self.segments[int(event["step"])] = segment
        self.steps = [by_step[s] for s in sorted(by_step)]

    @property
    def world_size(self) -> int:
        """Nodes (ranks) of the run: `process_group_joined`'s world_size, or the ranks seen."""
        joined = [
            e["world_size"]
            for e in self.named("process_group_joined")
            if _is_number(e.get("world_size"))
        ]
        ranks = [_rank(e) for e in self.events if e["event"] == "step"]
        return int(max([*joined, max(ranks, default=0) + 1]))

    def named(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of a numeric step field, skipping lines without it."""
        pairs = [(int(e["step"]), float(e[key])) for e in self.steps if _is_number(e.get(key))]
        return [s for s, _ in pairs], [v for _, v in pairs]


def _rank(event: dict[str, Any]) -> int:
    """The rank that logged the event (0 without a process group: no `rank` field)."""
    rank = event.get("rank", 0)
    return int(rank) if _is_number(rank) else 0


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def timestamp_s(event: dict[str, Any]) -> float | None:
    """The event's ISO timestamp as POSIX seconds (None when absent or malformed)."""
    stamp = event.get("timestamp")
    if not isinstance(stamp, str):
        return None
    try:
        return datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return None


def parse_lines(lines: list[str]) -> tuple[list[dict[str, Any]], int]:
    """(events, bad line count). Blank lines are neither."""
    events, bad = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError:  # not JSON, or cut off mid-line
            bad += 1
            continue
        if isinstance(event, dict) and isinstance(event.get("event"), str):
            events.append(event)
        else:
            bad += 1
    return events, bad


def log_file(path: Path) -> Path:
    """The log inside a run folder, or the file itself."""
    if path.is_dir():
        path = path / LOG_NAME
    if not path.is_file():
        raise RunLogError(f"{path}: no such log (give a run folder holding {LOG_NAME}, or a log)")
    return path


def read_run(path: str | Path, name: str | None = None) -> RunLog:
    """A run from its folder (log.jsonl and settings.json) or from a log file."""
    file = log_file(Path(path))
    text = file.read_text(encoding="utf-8", errors="replace")  # bad bytes: a bad line, not a crash
    events, bad = parse_lines(text.splitlines())
    if not any(e["event"] in RUN_EVENTS for e in events):
        raise RunLogError(
            f"{file}: holds no run log (no JSON {', '.join(sorted(RUN_EVENTS))} event; "
            f"{len(events)} other events, {bad} lines that are not events)"
        )
    settings_file = file.parent / SETTINGS_NAME
    settings = None
    if settings_file.is_file():
        try:
            settings = json.loads(settings_file.read_text(encoding="utf-8"))
        except ValueError:
            settings = None
    default = file.parent.name if file.name == LOG_NAME else file.stem
    return RunLog(name or default, file, events, bad, settings)


def read_runs(paths: list[str | Path]) -> list[RunLog]:
    """Several runs; names made unique (parent folders prepended, then an index)."""
    runs = [read_run(p) for p in paths]
    names = [r.name for r in runs]
    seen: dict[str, int] = {}
    for run in runs:
        if names.count(run.name) > 1:
            base = f"{run.path.parent.parent.name}/{run.name}"
            seen[base] = seen.get(base, 0) + 1
            run.name = base if seen[base] == 1 else f"{base} ({seen[base]})"
    return runs
