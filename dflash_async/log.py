"""Structured logs: one JSON object per line on stdout, or a console renderer on a TTY.

Everything goes through one stdlib handler on the root logger, so structlog events, records of
other libraries (transformers, torch) and Python warnings land in the same stream, in order,
never interleaved mid-line (one handler, one lock). Event names are snake_case past tense
(`step_completed`); foreign records get the event `stdlib_logged` or `warning_issued` and keep
their text in `message`.

Context (`bound_context(run_id=...)`) rides in contextvars. A thread does not inherit them: a
DeviceWorker runs each job inside `contextvars.copy_context()` of the task that submitted it, so
events logged by a job carry the submitter's fields.
"""

from __future__ import annotations

import logging
import sys
import warnings
from contextlib import AbstractContextManager
from typing import Any, Literal, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

LogFormat = Literal["auto", "json", "console"]
HANDLER_NAME = "dflash_async"


def configure_logging(fmt: LogFormat, level: str, stream: TextIO | None = None) -> None:
    """Route structlog, stdlib logging and warnings to `stream` as JSON lines or console text.

    `fmt="auto"` picks the console renderer when `stream` is a TTY, else JSON. Idempotent: a
    second call replaces the handler the first one installed (other handlers are kept).
    """
    stream = stream or sys.stdout  # read at call time: pytest and others swap sys.stdout
    numeric_level = _numeric_level(level)
    renderer = _renderer(_resolve_format(fmt, stream), stream)
    shared = _shared_processors()
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,  # tests and the CLI may reconfigure
    )
    handler = logging.StreamHandler(stream)
    handler.set_name(HANDLER_NAME)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[_name_foreign_event, *shared],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
        )
    )
    root = logging.getLogger()
    root.handlers = [h for h in root.handlers if h.get_name() != HANDLER_NAME] + [handler]
    root.setLevel(numeric_level)
    # Process-wide on purpose: warnings from any thread become `warning_issued` events.
    warnings.showwarning = _log_warning
    _route_transformers_logs()


def _route_transformers_logs() -> None:
    """transformers keeps its own stderr handler and stops propagation: send its records to the
    root handler like every other library's, and drop its progress bars (not log lines)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A logger whose events carry `logger=name` and the contextvars bound where it logs."""
    return structlog.stdlib.get_logger(name)


def bound_context(**fields: Any) -> AbstractContextManager[None]:
    """`with bound_context(step=3):` every event logged inside carries `step=3` (contextvars)."""
    return structlog.contextvars.bound_contextvars(**fields)


def _numeric_level(level: str) -> int:
    levels = logging.getLevelNamesMapping()
    if level.upper() not in levels:
        raise ValueError(f"unknown log level {level!r}: use debug, info, warning or error")
    return levels[level.upper()]


def _resolve_format(fmt: LogFormat, stream: TextIO) -> Literal["json", "console"]:
    if fmt == "auto":
        isatty = getattr(stream, "isatty", None)
        return "console" if isatty is not None and isatty() else "json"
    if fmt not in ("json", "console"):
        raise ValueError(f"unknown log format {fmt!r}: use auto, json or console")
    return fmt


def _renderer(fmt: Literal["json", "console"], stream: TextIO) -> list[Processor]:
    """The last processors. Tracebacks never render locals: a CUDA tensor's repr syncs the GPU."""
    if fmt == "console":
        isatty = getattr(stream, "isatty", None)
        colors = isatty is not None and isatty()
        return [
            structlog.dev.ConsoleRenderer(
                colors=colors, exception_formatter=structlog.dev.plain_traceback
            )
        ]
    no_locals = structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
    return [
        structlog.processors.ExceptionRenderer(no_locals),
        # default=str: a Path or dtype in a field must not kill the log line.
        structlog.processors.JSONRenderer(default=str),
    ]


def _shared_processors() -> list[Processor]:
    """What every event gets, structlog's own and foreign ones alike."""
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]


def _name_foreign_event(logger: WrappedLogger, method: str, event_dict: EventDict) -> EventDict:
    """A stdlib record's text is prose, not an event name: keep it in `message`."""
    record: logging.LogRecord | None = event_dict.get("_record")
    is_warning = record is not None and record.name == "py.warnings"
    event_dict["message"] = event_dict.pop("event", "")
    event_dict["event"] = "warning_issued" if is_warning else "stdlib_logged"
    return event_dict


def _log_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """`warnings.showwarning` replacement: one structured event instead of stderr text."""
    fields: dict[str, Any] = {"category": category.__name__, "filename": filename, "lineno": lineno}
    get_logger("py.warnings").warning("warning_issued", message=str(message), **fields)
