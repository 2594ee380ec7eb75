"""Batched, chunked, parallel tokenization equals encode_chat one record at a time."""

from __future__ import annotations

import json

import numpy as np
import pytest
from data_samples import CHATS, EventLog, chat_records

from dflash_async.data.chat import encode_chat
from dflash_async.data.formats import chat_messages
from dflash_async.data.samples import DataOptions, encode_options, load_samples
from dflash_async.data.tokenize_all import encode_all


def mixed_records() -> list[dict]:
    """Chats with records that never reach the tokenizer in between (pre-tokenized, empty,
    bad, no assistant turn): a batched path that pairs texts with the wrong records fails."""
    chats = chat_records()
    return [
        chats[0],
        {"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 1, 1, 1, 1]},
        chats[1],
        {"messages": []},
        {"messages": [{"role": "narrator", "content": "x"}]},
        chats[2],
        {"messages": [{"role": "user", "content": "Hi"}]},
        chats[3],
        chats[1],
    ]


def expected(tokenizer, record: dict) -> tuple[list, list] | None:
    if "input_ids" in record:
        return record["input_ids"], [bool(m) for m in record["loss_mask"]]
    try:
        messages = chat_messages(record)
    except ValueError:
        return None
    if len(messages) < 2:
        return None
    ids, mask = encode_chat(tokenizer, messages, enable_thinking=True)
    return ids.tolist(), mask.tolist()


@pytest.mark.parametrize("chunk_records", [1, 4, 100])
def test_chunks_of_any_size_give_encode_chat_per_record(tokenizer, tmp_path, chunk_records):
    records = mixed_records()
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    options = DataOptions(on_bad_record="skip", chunk_records=chunk_records)
    log = EventLog()
    samples = load_samples(str(path), tokenizer, options=options, block_size=2, log=log)
    want = [e for e in (expected(tokenizer, r) for r in records) if e is not None]
    got = [(ids.tolist(), mask.tolist()) for ids, mask in map(samples.sample, range(len(samples)))]
    assert got == [(ids, mask) for ids, mask in want]
    event = log.events[-1]
    assert (event["bad_record"], event["empty"], event["no_assistant_turn"]) == (1, 1, 1)


def test_worker_processes_give_the_same_arrays_as_one_process(tokenizer, tmp_path):
    records = mixed_records() * 4  # 36 records, 9 chunks of 4: 2 processes, 4 chunks in flight
    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    load = lambda workers: load_samples(  # noqa: E731
        str(path),
        tokenizer,
        options=DataOptions(on_bad_record="skip", chunk_records=4, workers=workers),
        block_size=2,
        log=EventLog(),
    )
    serial, parallel = load(1), load(2)
    np.testing.assert_array_equal(serial.tokens, parallel.tokens)
    np.testing.assert_array_equal(serial.loss_mask, parallel.loss_mask)
    np.testing.assert_array_equal(serial.offsets, parallel.offsets)


def test_progress_is_logged_as_events_when_stderr_is_not_a_terminal(tokenizer):
    log = EventLog()
    options = encode_options(DataOptions(), block_size=2)
    records = [(f"c:{i}", line + b"\n") for i, line in enumerate(CHATS.read_bytes().split(b"\n"))]
    records = [r for r in records if r[1].strip()] * 3
    results = list(
        encode_all(
            records, tokenizer, options, workers=1, chunk_records=4, log=log, progress_every_s=0
        )
    )
    assert len(results) == 3
    progress = [e for e in log.events if e["event"] == "tokenization_progressed"]
    assert [e["records"] for e in progress] == [4, 8, 12]
    assert all(e["records_per_s"] > 0 for e in progress)
