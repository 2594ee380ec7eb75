"""What a person sees while a run goes: compact step lines on a TTY, every N-th step on stdout
with the file keeping all, progress of long loops, and the run_summary's exit reason."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from logging_kit import Tty, logging_restored

from dflash_async.log import close_log_file, configure_logging, get_logger, progress, step_line
from dflash_async.runlog.record import exit_reason

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _restore_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with logging_restored(monkeypatch):
        yield
        close_log_file()


STEP = {
    "step": 120,
    "total_steps": 300,
    "loss": 4.65213,
    "acc": 0.5312,
    "tokens_per_s": 4675.6,
    "mfu": 0.3512,
    "eta_s": 3725.4,
}


def test_console_shows_a_step_as_one_compact_line() -> None:
    assert step_line(STEP) == (
        "step 120/300 | loss 4.6521 | acc 0.531 | 4.68k tok/s | MFU 35.1% | ETA 1:02:05"
    )
    tty = Tty()
    configure_logging("auto", "info", tty)
    get_logger("x").info("step", **STEP)
    assert tty.getvalue() == step_line(STEP) + "\n"


def test_every_nth_step_reaches_stdout_and_the_file_keeps_all(tmp_path: Path) -> None:
    stream, file = io.StringIO(), tmp_path / "log.jsonl"
    configure_logging("json", "info", stream, file=file, every=5)
    log = get_logger("x")
    for step in range(1, 13):
        log.info("step", step=step, total_steps=12)
    log.info("eval", step=12, tau=2.0)
    close_log_file()
    shown = [json.loads(line) for line in stream.getvalue().splitlines()]
    kept = [json.loads(line) for line in file.read_text().splitlines()]
    assert [e.get("step") for e in shown] == [1, 5, 10, 12, 12]  # first, multiples, last; eval
    assert [e["step"] for e in kept] == [*range(1, 13), 12]
    assert kept[-1]["event"] == "eval" and shown[-1] == kept[-1]


def test_progress_off_a_tty_logs_about_ten_events(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a TTY
    stream = io.StringIO()
    configure_logging("json", "info", stream)
    assert list(progress(range(95), total=95, task="regenerate")) == list(range(95))
    events = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert {e["event"] for e in events} == {"progress_reported"}
    assert [e["done"] for e in events] == [*range(9, 95, 9), 95]
    assert all(e["task"] == "regenerate" and e["total"] == 95 for e in events)


@pytest.mark.parametrize(
    ("code", "error", "reason"),
    [
        (0, None, "completed"),
        (130, None, "interrupted (SIGINT)"),
        (143, None, "terminated (SIGTERM)"),
        (None, ValueError("bad pack\nmore"), "error: ValueError: bad pack"),
        (None, BaseExceptionGroup("g", [RuntimeError("deep")]), "error: RuntimeError: deep"),
        (None, KeyboardInterrupt(), "interrupted: KeyboardInterrupt"),
    ],
)
def test_exit_reason_comes_from_what_the_run_returned_or_raised(code, error, reason) -> None:
    assert exit_reason(code, error) == reason


def test_tensorboard_dir_without_tensorboard_is_a_one_line_settings_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    from dflash_async.errors import SettingsError
    from dflash_async.settings.env import load_settings

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    env = {"DFLASH_ENV_FILE": "none", "DFLASH_LOG__TENSORBOARD_DIR": "tb"}
    with pytest.raises(SettingsError, match="DFLASH_LOG__TENSORBOARD_DIR='tb': needs tensorboard"):
        load_settings(env)
