"""Structured logs: one JSON object per line on stdout, or a console renderer on a TTY.

Everything goes through one stdlib handler on the root logger, so structlog events, records of
other libraries (transformers, torch) and Python warnings land in the same stream, in order,
never interleaved mid-line (one handler, one lock). Event names are snake_case past tense
(`step_completed`); foreign records get the event `stdlib_logged` or `warning_issued` and keep
their text in `message`.

A run also writes every event as JSON to a file (`file=`, the run folder's `log.jsonl`), whatever
stdout shows; with `hold_file=True` the file's lines wait in memory and the file is not touched
until `release_log_file()` (a run writes its folder only once accepted: runlog/record.py). On a TTY the console view prints each `step` event as one compact line (step/total,
loss, acc, tokens/s, MFU, ETA); `every=N` keeps only every N-th step line on stdout (the file keeps
them all). `progress()` shows long loops: tqdm on a TTY, else a few `progress_reported` events.

Context (`bound_context(run_id=...)`) rides in contextvars. A thread does not inherit them: a
DeviceWorker runs each job inside `contextvars.copy_context()` of the task that submitted it, so
events logged by a job carry the submitter's fields.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal, TextIO, TypeVar

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

LogFormat = Literal["auto", "json", "console"]
HANDLER_NAME = "dflash_async"
FILE_HANDLER_NAME = "dflash_async.file"
T = TypeVar("T")


def configure_logging(
    fmt: LogFormat,
    level: str,
    stream: TextIO | None = None,
    *,
    file: Path | None = None,
    hold_file: bool = False,
    every: int = 1,
) -> None:
    """Route structlog, stdlib logging and warnings to `stream` as JSON lines or console text,
    and to `file` (appended) as JSON lines when given; `hold_file`: keep those lines in memory,
    the file untouched, until `release_log_file()` (never, if `close_log_file()` comes first).

    `fmt="auto"` picks the console renderer when `stream` is a TTY, else JSON. `every`: only
    every N-th `step` event reaches `stream` (and the last of a run). Idempotent: a second call
    replaces the handlers the first one installed (other handlers are kept).
    """
    stream = stream or sys.stdout  # read at call time: pytest and others swap sys.stdout
    numeric_level = _numeric_level(level)
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
    handler.setFormatter(_formatter(shared, _renderer(_resolve_format(fmt, stream), stream)))
    if every > 1:
        handler.addFilter(_EveryNthStep(every))
    handlers = [handler]
    if file is not None:
        file_handler = _HeldFileHandler(file, held=hold_file)
        file_handler.set_name(FILE_HANDLER_NAME)
        file_handler.setFormatter(_formatter(shared, _renderer("json", stream)))
        handlers.append(file_handler)
    ours = (HANDLER_NAME, FILE_HANDLER_NAME)
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() in ours]:
        old.close()
    root.handlers = [h for h in root.handlers if h.get_name() not in ours] + handlers
    root.setLevel(numeric_level)
    # Process-wide on purpose: warnings from any thread become `warning_issued` events.
    warnings.showwarning = _log_warning
    _route_transformers_logs()


def release_log_file() -> None:
    """Write the held lines to the file and send every later one straight there."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, _HeldFileHandler):
            handler.write_held()


def close_log_file() -> None:
    """Detach and close the file handler (the run is over; later events go to stdout only)."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h.get_name() == FILE_HANDLER_NAME]:
        root.removeHandler(handler)
        handler.close()


class _HeldFileHandler(logging.FileHandler):
    """A FileHandler (appending, flushed per line) that, while held, keeps its formatted lines in
    memory and neither creates nor opens the file: closed before release, it leaves no trace."""

    def __init__(self, path: Path, *, held: bool) -> None:
        if not held:
            path.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(path, mode="a", encoding="utf-8", delay=held)
        self.held: list[str] | None = [] if held else None

    def emit(self, record: logging.LogRecord) -> None:
        if self.held is None:
            super().emit(record)
            return
        try:  # formatted now, as stdout shows it: the timestamp and traceback of this moment
            self.held.append(self.format(record) + self.terminator)
        except Exception:
            self.handleError(record)

    def write_held(self) -> None:  # not release(): Handler.release() frees its lock
        with self.lock:  # emit() runs under this lock too: no line slips between the two
            lines, self.held = self.held, None
            if lines is None:
                return
            Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
            self.stream = self.stream or self._open()
            self.stream.write("".join(lines))
            self.flush()


def _formatter(shared: list[Processor], renderer: list[Processor]) -> logging.Formatter:
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[_name_foreign_event, *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
    )


class _EveryNthStep(logging.Filter):
    """Pass `step` events only at multiples of N, the first and the last (`step == total_steps`)."""

    def __init__(self, every: int) -> None:
        super().__init__()
        self.every = every

    def filter(self, record: logging.LogRecord) -> bool:
        event = record.msg
        if not isinstance(event, dict) or event.get("event") != "step":
            return True
        step = event.get("step")
        if not isinstance(step, int):
            return True
        return step % self.every == 0 or step == 1 or step == event.get("total_steps")


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
        console = structlog.dev.ConsoleRenderer(
            colors=colors, exception_formatter=structlog.dev.plain_traceback, sort_keys=False
        )
        return [_StepLines(console)]
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


# On the console these fields come first (a reader looks for them), the rest in the event's order.
CONSOLE_FIRST = (
    "tau",
    "eval_tau",
    "warnings",
    "notes",
    "hint",
    "error",
    "reason",
    "path",
    "output",
)
# A list or mapping whose JSON is longer than this is shown by size and first keys on the console
# (the JSON log keeps it whole): a line stays readable on a terminal.
CONSOLE_VALUE_CHARS = 80


class _StepLines:
    """Console renderer: a `step` event as one compact line, every other event as `console`
    with `console_fields` (the key fields first, long lists and mappings shortened)."""

    def __init__(self, console: Processor) -> None:
        self.console = console

    def __call__(self, logger: WrappedLogger, method: str, event_dict: EventDict) -> str:
        if event_dict.get("event") != "step":
            return self.console(logger, method, console_fields(event_dict))  # type: ignore[return-value]
        return step_line(event_dict)


def console_fields(event_dict: EventDict) -> EventDict:
    """The event for a terminal: CONSOLE_FIRST fields first, and each list or mapping longer
    than CONSOLE_VALUE_CHARS as JSON replaced by `<N keys: a, b, ...>` / `<N items: ...>` (the
    settings event of a run is ~2,000 characters as JSON; an `eval_completed` ~750, its tau past
    character 700 in key order)."""
    if event_dict.get("event") == "settings_loaded":  # every value: OUTPUT_DIR/settings.json
        sections = [k for k, v in event_dict.items() if isinstance(v, dict)]
        event_dict = {k: v for k, v in event_dict.items() if k not in sections}
        event_dict["sections"] = f"{', '.join(sections)} (every value: OUTPUT_DIR/settings.json)"
    first = {k: event_dict[k] for k in ("event", *CONSOLE_FIRST) if k in event_dict}
    ordered = first | {k: v for k, v in event_dict.items() if k not in first}
    whole = ("warnings", "notes")  # what a user must read in full, however long
    return {k: v if k.startswith("_") or k in whole else _short(v) for k, v in ordered.items()}


def _short(value: Any) -> Any:
    if isinstance(value, float):  # 4 significant digits on a terminal; the JSON keeps them all
        return float(f"{value:.4g}")
    if not isinstance(value, dict | list | tuple):
        return value
    text = json.dumps(value, default=str)
    if len(text) <= CONSOLE_VALUE_CHARS:
        return value
    if isinstance(value, dict):
        shown = f"<{len(value)} keys: {', '.join(map(str, value))}"
    else:
        items = (json.dumps(_short(v), default=str) for v in value)
        shown = f"<{len(value)} items: {', '.join(items)}"
    return shown[: CONSOLE_VALUE_CHARS - 2] + (
        "...>" if len(shown) > CONSOLE_VALUE_CHARS - 2 else ">"
    )


def step_line(e: dict[str, Any]) -> str:
    """`step 120/300 | loss 4.652 | acc 0.531 | 4.68k tok/s | MFU 0.002% | ETA 0:00:42`."""
    total = e.get("total_steps")
    parts = [f"step {e.get('step')}" + (f"/{total}" if total else "")]
    for key, label, spec in (("loss", "loss", ".4f"), ("acc", "acc", ".3f")):
        if isinstance(e.get(key), int | float):
            parts.append(f"{label} {e[key]:{spec}}")
    if isinstance(e.get("tokens_per_s"), int | float):
        parts.append(f"{_si(e['tokens_per_s'])} tok/s")
    if isinstance(e.get("mfu"), int | float):
        parts.append(f"MFU {e['mfu'] * 100:.3g}%")
    if isinstance(e.get("eta_s"), int | float):
        parts.append(f"ETA {_clock(e['eta_s'])}")
    return " | ".join(parts)


def _si(value: float) -> str:
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g}{suffix}"
    return f"{value:.3g}"


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def progress(
    items: Iterable[T], *, total: int, task: str, log: Any = None, reports: int = 10
) -> Iterator[T]:
    """Yield `items`, showing progress: a tqdm bar when stderr is a TTY, else about `reports`
    `progress_reported` events (task, done, total, elapsed_s) through `log`."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        yield from tqdm(items, total=total, desc=task)
        return
    log = log or get_logger("dflash_async")
    every, started = max(1, total // reports), time.perf_counter()
    for done, item in enumerate(items, start=1):
        yield item  # the caller's work on `item` happens here: report after it
        if done % every == 0 or done == total:
            elapsed = round(time.perf_counter() - started, 2)
            log.info("progress_reported", task=task, done=done, total=total, elapsed_s=elapsed)
