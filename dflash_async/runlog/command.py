"""`python -m dflash_async report RUN_DIR_OR_LOG [...] [--out DIR]`: the report of one or more runs."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_DIR_OR_LOG",
        help="run folders (holding log.jsonl) or JSON log files; several: side by side",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="folder for report.html and the PNGs (default: FIRST_RUN/report)",
    )


def default_out(first: str) -> Path:
    path = Path(first)
    return (path if path.is_dir() else path.parent) / "report"


def report(runs: list[str], out: str | None) -> Path:
    """Read every log, then write the report; a missing log or an unwritable --out is a
    UsageError (one line, exit 2) raised before anything is drawn."""
    from dflash_async.runlog.page import write_report  # matplotlib: only when reporting
    from dflash_async.runlog.parse import read_runs
    from dflash_async.usage import check_writable_folder

    logs = read_runs(runs)
    folder = check_writable_folder(out or default_out(runs[0]), argument="--out")
    return write_report(logs, folder)
