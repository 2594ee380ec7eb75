"""A refused re-run leaves the run folder's record as it was; an accepted one appends to it.

Each case finishes a tiny CPU run of two steps with `python -m dflash_async run` in this process,
then runs again in its folder: with a changed run-defining setting (exit 2: settings.json and
log.jsonl byte-identical afterwards, the error on stderr), or unchanged (a resume: log.jsonl
grows by the resume's own lines, ending in its run_summary).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import structlog
from tiny_run import tiny_run_settings, write_pretokenized

from dflash_async.__main__ import main
from dflash_async.log import close_log_file

pytestmark = pytest.mark.timeout(120)


def run_cli(settings: dict[str, str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `run` in this process; environment and logging put back."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("DFLASH_")}
    saved_env, handlers = dict(os.environ), list(logging.getLogger().handlers)
    showwarning = warnings.showwarning
    os.environ.clear()
    os.environ.update(env | {"CUDA_VISIBLE_DEVICES": ""} | settings)
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(["run"])
    finally:
        close_log_file()
        os.environ.clear()
        os.environ.update(saved_env)
        logging.getLogger().handlers = handlers
        warnings.showwarning = showwarning
        structlog.reset_defaults()
    return code, stdout.getvalue(), stderr.getvalue()


def record_bytes(out: Path) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in ("settings.json", "log.jsonl")}


@pytest.fixture
def finished(tmp_path: Path) -> dict[str, Any]:
    """A completed two-step run: its settings, folder and record bytes."""
    settings = tiny_run_settings(tmp_path, tmp_path / "cache") | {
        "DFLASH_TRAIN__MAX_STEPS": "2",
        "DFLASH_EVAL__AT_END": "false",
    }
    code, _, err = run_cli(settings)
    assert code == 0, err
    out = Path(settings["DFLASH_OUTPUT_DIR"])
    return {"settings": settings, "out": out, "record": record_bytes(out), "root": tmp_path}


def test_a_rerun_with_another_learning_rate_exits_2_and_leaves_settings_and_log_byte_identical(
    finished: dict[str, Any],
) -> None:
    code, _, err = run_cli(finished["settings"] | {"DFLASH_TRAIN__LR": "1e-3"})
    assert code == 2
    assert err.startswith("error: ") and "LR" in err
    assert record_bytes(finished["out"]) == finished["record"]


def test_a_rerun_with_other_data_exits_2_and_leaves_settings_and_log_byte_identical(
    finished: dict[str, Any],
) -> None:
    other = write_pretokenized(finished["root"] / "other.jsonl", records=40, vocab=64, seed=1)
    code, _, err = run_cli(finished["settings"] | {"DFLASH_DATA__PATH": str(other)})
    assert code == 2
    assert err.startswith("error: ")
    assert record_bytes(finished["out"]) == finished["record"]


def test_a_resume_after_a_refused_rerun_appends_only_its_own_lines_to_the_log(
    finished: dict[str, Any],
) -> None:
    assert run_cli(finished["settings"] | {"DFLASH_TRAIN__LR": "1e-3"})[0] == 2
    code, stdout, err = run_cli(finished["settings"])  # the same run: it resumes at its end
    assert code == 0, err
    log = (finished["out"] / "log.jsonl").read_bytes()
    before = finished["record"]["log.jsonl"]
    assert log.startswith(before) and log[len(before) :].decode() == stdout
    events = [json.loads(line) for line in stdout.splitlines()]
    assert events[0]["event"] == "settings_loaded"  # held until accepted, then written in order
    assert any(e["event"] == "resumed" for e in events)
    assert events[-1]["event"] == "run_summary" and events[-1]["exit_reason"] == "completed"
