"""What the logging tests share: a stream that says it is a terminal, and putting back the
process-wide logging state that `configure_logging` (or a CLI command run in this process)
changes: the root logger's handlers and level, warnings.showwarning and structlog's configuration.

One place for them, so that every test module that configures logging restores the same state.
"""

from __future__ import annotations

import io
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import structlog


class Tty(io.StringIO):
    """An in-memory stream that the console renderer takes for a terminal."""

    def isatty(self) -> bool:
        return True


@contextmanager
def logging_restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The logging state as it was on entry, put back on exit (warnings.showwarning through
    `monkeypatch`, so at its teardown)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    yield
    root.handlers, root.level = handlers, level
    structlog.reset_defaults()
