"""What the read-stage tests share: the chat fixture file, a logger that records events, loading
samples the way `run` does (block size 2) and comparing two loads token for token.

One place for them, so that test_data*.py all read the same fixture and load it the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dflash_async.data.samples import DataOptions, TokenizedSamples, load_samples

CHATS = Path(__file__).parent / "fixtures" / "chats.jsonl"
BLOCK = 2  # a sample needs >= 4 supervised tokens


class EventLog:
    """A stand-in for the structlog logger: records events as dicts."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def info(self, event: str, **fields) -> None:
        self.events.append({"event": event, **fields})

    def warning(self, event: str, **fields) -> None:
        self.events.append({"event": event, "level": "warning", **fields})

    def of(self, event: str) -> dict:
        """The first recorded event named `event`."""
        return next(e for e in self.events if e["event"] == event)


def chat_records() -> list[dict]:
    """The chat fixture's records, one per line."""
    return [json.loads(line) for line in CHATS.read_text().splitlines()]


def load(path, tokenizer, log=None, **options) -> TokenizedSamples:
    """load_samples with DataOptions(**options), block size BLOCK and a recording logger."""
    return load_samples(
        str(path),
        tokenizer,
        options=DataOptions(**options),
        block_size=BLOCK,
        log=log or EventLog(),
    )


def assert_same(a: TokenizedSamples, b: TokenizedSamples) -> None:
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    np.testing.assert_array_equal(a.offsets, b.offsets)
