"""Data a user should not train on silently: mostly unknown tokens, records lost to MAX_LEN."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from data_samples import CHATS, EventLog, load

from dflash_async.targets.tiny import tiny_tokenizer

pytestmark = pytest.mark.timeout(60)


def sharegpt(path: Path, answers: list[str]) -> Path:
    records = [
        {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": a}]}
        for a in answers
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_data_the_tokenizer_cannot_read_is_warned_about_with_the_fraction(tmp_path: Path) -> None:
    """Words outside the built-in tiny target's word-level vocabulary become its unknown token."""
    tokenizer = tiny_tokenizer()
    foreign = " ".join(["Quantenverschraenkung", "Schmetterlingseffekt"] * 40)
    log = EventLog()
    samples = load(sharegpt(tmp_path / "d.jsonl", [foreign] * 3), tokenizer, log, max_len=512)
    warning = log.of("data_unknown_tokens")
    unknown = int((samples.tokens == tokenizer.unk_token_id).sum())
    assert warning["unknown_tokens"] == unknown > 0
    assert warning["unknown_fraction"] == round(unknown / int(samples.lengths.sum()), 4) > 0.5
    assert warning["level"] == "warning" and "tokenizer" in warning["hint"]
    assert log.events[-1]["event"] == "data_loaded"  # the counts stay the last word


def test_data_the_tokenizer_reads_gives_no_unknown_token_warning(tokenizer) -> None:
    log = EventLog()
    load(CHATS, tokenizer, log, max_len=4096)
    assert [e["event"] for e in log.events if e.get("level") == "warning"] == []


@pytest.mark.parametrize("too_long", ["drop", "truncate"])
def test_records_lost_to_max_len_are_counted_with_a_hint(tokenizer, too_long: str) -> None:
    log = EventLog()
    load(CHATS, tokenizer, log, max_len=40, too_long=too_long)
    warning = log.of("data_too_long")
    loaded = log.of("data_loaded")
    counted = loaded["too_long_dropped"] + loaded["too_long_truncated"]
    assert warning["too_long_dropped"] + warning["too_long_truncated"] == counted > 0
    assert f"{counted} of {loaded['records']} records" in warning["hint"]
    assert "DFLASH_DATA__MAX_LEN=40" in warning["hint"]
    assert ("TOO_LONG=truncate" in warning["hint"]) == (too_long == "drop")
