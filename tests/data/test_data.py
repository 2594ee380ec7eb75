"""The read stage: formats, filters, bad input, the tokenized cache and parallel tokenization."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_samples import CHATS, EventLog, assert_same, chat_records, load
from fixtures.chat_tokenizer import qwen3_like_tokenizer

from dflash_async.data.chat import encode_chat
from dflash_async.data.samples import DataError, DataOptions


def write_jsonl(path: Path, records: list, *, gz: bool = False) -> Path:
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
    path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    return path


def test_openai_messages_are_rendered_with_the_template_and_masked(tokenizer):
    samples = load(CHATS, tokenizer)
    assert len(samples) == 4
    for i, record in enumerate(chat_records()):
        ids, mask = encode_chat(tokenizer, record["messages"], enable_thinking=True)
        np.testing.assert_array_equal(samples.sample(i)[0], ids)
        np.testing.assert_array_equal(samples.sample(i)[1], mask)
    assert samples.tokens.dtype == np.int32 and samples.loss_mask.dtype == bool
    np.testing.assert_array_equal(samples.lengths, np.diff(samples.offsets))


def test_sharegpt_gz_gives_the_same_samples_as_openai_messages(tokenizer, tmp_path):
    names = {"user": "human", "assistant": "gpt", "system": "system", "tool": "observation"}
    sharegpt = [
        {
            "conversations": [
                {"from": names[m["role"]], "value": m["content"]}
                | {k: v for k, v in m.items() if k not in ("role", "content")}
                for m in r["messages"]
            ]
        }
        for r in chat_records()
    ]
    path = write_jsonl(tmp_path / "share.jsonl.gz", sharegpt, gz=True)
    assert_same(load(path, tokenizer), load(CHATS, tokenizer))


def test_parquet_rows_give_the_same_samples_as_jsonl_lines(tokenizer, tmp_path):
    records = chat_records()
    messages = [
        [{"role": m["role"], "content": m["content"]} for m in r["messages"]] for r in records
    ]
    pq.write_table(pa.table({"messages": messages}), tmp_path / "chats.parquet")
    write_jsonl(tmp_path / "plain.jsonl", [{"messages": m} for m in messages])
    assert_same(
        load(tmp_path / "chats.parquet", tokenizer), load(tmp_path / "plain.jsonl", tokenizer)
    )


def test_pretokenized_records_are_taken_as_they_are(tokenizer, tmp_path):
    records = [{"input_ids": [5, 6, 7, 8, 9, 10], "loss_mask": [0, 1, 1, True, 1, 0]}]
    samples = load(write_jsonl(tmp_path / "tok.jsonl", records), tokenizer)
    assert samples.sample(0)[0].tolist() == [5, 6, 7, 8, 9, 10]
    assert samples.sample(0)[1].tolist() == [False, True, True, True, True, False]


def test_a_folder_or_glob_reads_every_data_file_in_sorted_order(tokenizer, tmp_path):
    records = chat_records()
    write_jsonl(tmp_path / "b.jsonl", records[2:])
    write_jsonl(tmp_path / "a.jsonl.gz", records[:2], gz=True)
    (tmp_path / "notes.txt").write_text("not data")
    whole = load(CHATS, tokenizer)
    assert_same(load(tmp_path, tokenizer), whole)
    assert_same(load(f"{tmp_path}/*.jsonl*", tokenizer), whole)


def test_filters_are_counted_and_logged_once(tokenizer, tmp_path):
    long_answer = "The answer is four. " * 40
    records = [
        *chat_records(),
        {"messages": []},
        {"messages": [{"role": "user", "content": "Hi"}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]},
        {
            "messages": [
                {"role": "user", "content": "Q"},
                {"role": "assistant", "content": long_answer},
            ]
        },
    ]
    log = EventLog()
    path = write_jsonl(tmp_path / "d.jsonl", records)
    samples = load(path, tokenizer, log, max_len=96, enable_thinking=False)
    assert [e["event"] for e in log.events].count("data_loaded") == 1
    event = log.events[-1]
    assert (event["records"], event["samples"], event["empty"]) == (8, 5, 1)
    assert (event["no_assistant_turn"], event["too_few_supervised"]) == (1, 1)
    assert (event["too_long_truncated"], event["too_long_dropped"], event["bad_record"]) == (
        1,
        0,
        0,
    )
    assert samples.lengths.max() == 96 and event["tokens"] == samples.lengths.sum()
    assert event["supervised_tokens"] == samples.loss_mask.sum()


def test_too_long_drop_drops_the_sample_and_counts_it(tokenizer):
    log = EventLog()
    samples = load(CHATS, tokenizer, log, max_len=40, too_long="drop")
    assert log.events[-1]["too_long_dropped"] == 4 - len(samples) > 0
    assert samples.lengths.max() <= 40


BAD_LINES = {
    "malformed_json": b'{"messages": [',
    "neither_form": json.dumps({"text": "hello"}).encode(),
    "unknown_role": json.dumps({"messages": [{"role": "narrator", "content": "x"}]}).encode(),
    "not_utf8": b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',
}


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_a_bad_record_is_an_error_naming_file_and_line(tokenizer, tmp_path, kind):
    good = json.dumps(chat_records()[0]).encode()
    path = tmp_path / "bad.jsonl"
    path.write_bytes(good + b"\n" + BAD_LINES[kind] + b"\n" + good + b"\n")
    with pytest.raises(DataError, match=rf"^{path}:2: "):
        load(path, tokenizer)


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_with_skip_a_bad_record_is_counted_and_the_rest_kept(tokenizer, tmp_path, kind):
    good = json.dumps(chat_records()[0]).encode()
    path = tmp_path / "bad.jsonl"
    path.write_bytes(good + b"\n" + BAD_LINES[kind] + b"\n" + good + b"\n")
    log = EventLog()
    samples = load(path, tokenizer, log, on_bad_record="skip")
    assert len(samples) == 2 and log.events[-1]["bad_record"] == 1


def test_a_bad_parquet_row_is_named_by_file_and_row(tokenizer, tmp_path):
    rows = [[{"role": "user", "content": "a"}], [{"role": "narrator", "content": "b"}]]
    pq.write_table(pa.table({"messages": rows}), tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d\.parquet:row 2: message 0 has unknown role"):
        load(tmp_path / "d.parquet", tokenizer)


def test_an_empty_data_set_after_filtering_is_an_error_with_the_counts(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "e.jsonl", [{"messages": [{"role": "user", "content": "Hi"}]}])
    with pytest.raises(DataError, match=r"no usable samples.*no_assistant_turn=1"):
        load(path, tokenizer)


def test_missing_paths_and_unknown_file_types_are_data_errors(tokenizer, tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load(tmp_path / "nope.jsonl", tokenizer)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown data file type"):
        load(tmp_path / "x.csv", tokenizer)
    with pytest.raises(DataError, match="has no"):
        load(tmp_path, tokenizer)


def test_cached_and_uncached_runs_give_identical_arrays(tokenizer, tmp_path):
    cache = str(tmp_path / "cache")
    first_log, second_log = EventLog(), EventLog()
    first = load(CHATS, tokenizer, first_log, cache_dir=cache)
    second = load(CHATS, tokenizer, second_log, cache_dir=cache)
    assert (first_log.events[-1]["cached"], second_log.events[-1]["cached"]) == (False, True)
    assert_same(first, second)
    assert_same(second, load(CHATS, tokenizer))
    assert second.summary == first.summary


def test_the_cache_is_missed_when_data_options_or_tokenizer_change(tokenizer, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", chat_records())
    cache = str(tmp_path / "cache")
    load(data, tokenizer, cache_dir=cache)

    def cached(path=data, tok=tokenizer, **options) -> bool:
        log = EventLog()
        load(path, tok, log, cache_dir=cache, **options)
        return log.events[-1]["cached"]

    assert cached(workers=2)  # how it was computed does not matter
    assert not cached(enable_thinking=False)
    assert not cached(tok=qwen3_like_tokenizer(trim_offsets=True))
    os.utime(data, ns=(1, 1))
    assert not cached()


def test_parallel_tokenization_equals_serial(tokenizer, tmp_path):
    records = chat_records() * 160  # 640 records: 3 chunks for 2 processes
    path = write_jsonl(tmp_path / "many.jsonl", records)
    assert_same(load(path, tokenizer, workers=2), load(path, tokenizer))


def test_options_with_bad_values_name_them():
    with pytest.raises(ValueError, match="too_long='cut'"):
        DataOptions(too_long="cut")


def test_chat_data_with_a_tokenizer_without_template_is_a_data_error(tmp_path):
    bare = qwen3_like_tokenizer()
    bare.chat_template = None
    with pytest.raises(DataError, match=r"chats\.jsonl:1: tokenizer .* has no chat template"):
        load(CHATS, bare)
