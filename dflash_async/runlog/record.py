"""The run folder as the run's record: log.jsonl, settings.json and a closing `run_summary`.

`open_run_record` wraps a whole `run`: it sends every event, as JSON, to OUTPUT_DIR/log.jsonl
(appended: a resumed run continues the file), writes the effective settings with the versions
of Python, torch, transformers and this project to settings.json, and on the way out logs one
`run_summary` event computed from this process's lines of log.jsonl by the same code as the
report (summary.py), with the exit reason taken from what the run returned or raised.

The folder is written only once the run is accepted (`RunRecord.accept`, which the pipeline calls
when the resume point is known and checked): until then the file's lines wait in memory. A run
that ends before that (refused with exit 2, an internal error or a signal during start-up) writes
nothing into the folder, so a finished run's record stays as it was; its error goes to stderr
and, like every event, to stdout.
"""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_async.log import close_log_file, configure_logging, release_log_file
from dflash_async.runlog.parse import LOG_NAME, SETTINGS_NAME, RunLog, parse_lines
from dflash_async.runlog.summary import summarize
from dflash_async.settings import LogSettings

# Exit codes of `run` (pipeline/run.py, __main__) and what they mean.
EXIT_REASONS = {0: "completed", 130: "interrupted (SIGINT)", 143: "terminated (SIGTERM)"}


@dataclass
class RunRecord:
    """Set `exit_code` to what the run returned; an exception leaving the block is read too.
    `accept()` once the run may write its folder; without `on_accept` (a rank other than 0)
    it only notes it."""

    folder: Path
    log_offset: int  # bytes of log.jsonl written by earlier runs in this folder
    exit_code: int | None = None
    on_accept: Callable[[], None] | None = None
    accepted: bool = False

    def accept(self) -> None:
        if self.accepted:
            return
        self.accepted = True
        if self.on_accept is not None:
            self.on_accept()


def versions() -> dict[str, str]:
    import torch
    import transformers

    import dflash_async

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dflash_async": dflash_async.__version__,
    }


def write_settings(folder: Path, settings: dict[str, Any]) -> Path:
    """settings.json: {"settings": the effective settings, "versions": ..., "argv": ...}."""
    path = folder / SETTINGS_NAME
    record = {"settings": settings, "versions": versions(), "argv": sys.argv}
    path.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def exit_reason(exit_code: int | None, error: BaseException | None) -> str:
    """ "completed", "interrupted (SIGINT)", "error: DataError: ...", ... (one line)."""
    while isinstance(error, BaseExceptionGroup):  # the original error inside task groups
        error = error.exceptions[0]
    if error is not None:
        kind = "error" if isinstance(error, Exception) else "interrupted"
        text = str(error).strip().splitlines()
        return f"{kind}: {type(error).__name__}" + (f": {text[0][:200]}" if text else "")
    if exit_code is None:
        return "unknown"
    return EXIT_REASONS.get(exit_code, f"exit code {exit_code}")


def summary_since(log_path: Path, offset: int, exit_reason_text: str) -> dict[str, Any]:
    """The run_summary fields of the lines written after `offset`."""
    with log_path.open("rb") as f:
        f.seek(offset)
        text = f.read().decode("utf-8", errors="replace")
    events, bad = parse_lines(text.splitlines())
    summary = summarize(RunLog(log_path.parent.name, log_path, events, bad))
    return {**summary, "exit_reason": exit_reason_text}


@contextmanager
def open_run_record(
    *, output_dir: Path, settings_dict: dict[str, Any], log_settings: LogSettings, log
) -> Iterator[RunRecord]:
    """Route the logs to OUTPUT_DIR/log.jsonl too (held in memory until `record.accept()`,
    which writes settings.json and the held lines); at the end (normal or not) of an accepted
    run log `run_summary`. The file stays attached until the process ends (or
    `log.close_log_file()`), so what the CLI logs after the run, such as the traceback of an
    internal error, lands in it too. A run never accepted leaves the folder untouched; its
    `run_summary` (the exit reason) goes to stdout alone."""
    folder = Path(output_dir)
    log_path = folder / LOG_NAME
    configure_logging(
        log_settings.format,
        log_settings.level,
        file=log_path,
        hold_file=True,
        every=log_settings.every,
    )
    record = RunRecord(folder, 0)
    record.on_accept = lambda: _write_folder(record, settings_dict)
    error: BaseException | None = None
    try:
        yield record
    except BaseException as raised:
        error = raised
        raise
    finally:
        reason = exit_reason(record.exit_code, error)
        if record.accepted:
            log.info("run_summary", **summary_since(log_path, record.log_offset, reason))
        else:  # refused or stopped in start-up: drop the held lines (they went to stdout) and
            close_log_file()  # say how it ended on stdout alone
            empty = summarize(RunLog(folder.name, log_path, [], 0))
            log.info("run_summary", **{**empty, "exit_reason": reason})


def _write_folder(record: RunRecord, settings_dict: dict[str, Any]) -> None:
    """The accepted run's first writes: settings.json, then log.jsonl's held lines."""
    record.folder.mkdir(parents=True, exist_ok=True)
    log_path = record.folder / LOG_NAME
    record.log_offset = log_path.stat().st_size if log_path.exists() else 0
    write_settings(record.folder, settings_dict)
    release_log_file()
