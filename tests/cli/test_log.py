"""Logging: JSON lines with event fields, stdlib and warnings in the same stream, context in threads."""

from __future__ import annotations

import contextvars
import io
import json
import logging
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
import torch
from logging_kit import Tty, logging_restored
from structlog.testing import capture_logs

from dflash_async.log import HANDLER_NAME, bound_context, configure_logging, get_logger
from dflash_async.runtime.devices import open_device_worker

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _restore_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """configure_logging changes process-wide state: put it all back after each test."""
    with logging_restored(monkeypatch):
        yield
    structlog.contextvars.clear_contextvars()


def _lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_events_are_json_lines_with_level_logger_and_timestamp() -> None:
    stream = io.StringIO()
    configure_logging("json", "info", stream)
    get_logger("dflash_async.train").info("step_completed", step=3, loss=1.5, path=torch.float32)
    [line] = _lines(stream)
    assert line["event"] == "step_completed"
    assert (line["step"], line["loss"], line["path"]) == (3, 1.5, "torch.float32")
    assert (line["level"], line["logger"]) == ("info", "dflash_async.train")
    assert line["timestamp"].endswith("Z")


def test_auto_format_is_json_off_a_tty_and_console_on_one() -> None:
    plain, tty = io.StringIO(), Tty()
    configure_logging("auto", "info", plain)
    get_logger("x").info("run_started")
    assert _lines(plain)[0]["event"] == "run_started"
    configure_logging("auto", "info", tty)
    get_logger("x").info("run_started")
    with pytest.raises(json.JSONDecodeError):
        json.loads(tty.getvalue())
    assert "run_started" in tty.getvalue()


def test_level_filters_lower_events() -> None:
    stream = io.StringIO()
    configure_logging("json", "warning", stream)
    get_logger("x").info("hidden")
    get_logger("x").warning("slot_ring_starved")
    assert [line["event"] for line in _lines(stream)] == ["slot_ring_starved"]


def test_stdlib_records_and_warnings_reach_the_same_stream() -> None:
    stream = io.StringIO()
    configure_logging("json", "info", stream)
    logging.getLogger("transformers.modeling").warning("loaded %d shards", 4)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("flex_attention falls back", UserWarning, stacklevel=1)
    library, warning = _lines(stream)
    assert library["event"] == "stdlib_logged"
    assert (library["message"], library["logger"]) == ("loaded 4 shards", "transformers.modeling")
    assert warning["event"] == "warning_issued"
    assert (warning["message"], warning["category"]) == ("flex_attention falls back", "UserWarning")
    assert warning["filename"].endswith("test_log.py")


def test_bound_context_reaches_a_thread_that_runs_in_a_copied_context() -> None:
    stream = io.StringIO()
    configure_logging("json", "info", stream)
    with bound_context(run_id="r7"):
        context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(get_logger("x").info, "pack_planned"))
    thread.start()
    thread.join()
    [line] = _lines(stream)
    assert line["run_id"] == "r7"


@pytest.mark.anyio
async def test_device_worker_jobs_log_with_the_submitters_context() -> None:
    stream = io.StringIO()
    configure_logging("json", "info", stream)
    async with open_device_worker(torch.device("cpu"), "target0") as worker:
        with bound_context(worker="target0", step=12):
            await worker.run(get_logger("x").info, "target_forward_done", tokens=1024)
    [line] = _lines(stream)
    assert (line["worker"], line["step"], line["tokens"]) == ("target0", 12, 1024)


def test_exceptions_are_structured_tracebacks_without_locals() -> None:
    stream = io.StringIO()
    configure_logging("json", "info", stream)
    secret_tensor = torch.ones(3)  # noqa: F841  (a local that must not be rendered)
    try:
        raise RuntimeError("worker drafter0 failed")
    except RuntimeError:
        get_logger("x").exception("pipeline_failed")
    [line] = _lines(stream)
    [exception] = line["exception"]
    assert (exception["exc_type"], exception["exc_value"]) == (
        "RuntimeError",
        "worker drafter0 failed",
    )
    assert all("locals" not in frame for frame in exception["frames"])


def test_reconfiguring_replaces_only_its_own_handler() -> None:
    other = logging.NullHandler()
    logging.getLogger().addHandler(other)
    configure_logging("json", "info", io.StringIO())
    configure_logging("json", "debug", io.StringIO())
    names = [h.get_name() for h in logging.getLogger().handlers]
    assert names.count(HANDLER_NAME) == 1 and other in logging.getLogger().handlers


def test_events_can_be_asserted_as_dicts_with_capture_logs() -> None:
    configure_logging("json", "info", io.StringIO())
    with capture_logs() as events:
        get_logger("x").info("checkpoint_saved", step=100, path="runs/demo/step_100")
    assert events == [
        {
            "event": "checkpoint_saved",
            "step": 100,
            "path": "runs/demo/step_100",
            "log_level": "info",
        }
    ]


def test_unknown_level_or_format_is_rejected_with_the_value() -> None:
    with pytest.raises(ValueError, match="'loud'"):
        configure_logging("json", "loud", io.StringIO())
    with pytest.raises(ValueError, match="'xml'"):
        configure_logging("xml", "info", io.StringIO())  # type: ignore[arg-type]
