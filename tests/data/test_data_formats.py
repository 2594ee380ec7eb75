"""Every input format gives the same samples; roles, BOM, CRLF and truncated files."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_samples import CHATS, EventLog, assert_same, chat_records, load

from dflash_async.data.formats import DataError

HF_DATASET = CHATS.parent / "chats_hf_dataset"  # written by datasets' save_to_disk from chats.jsonl
SHAREGPT_NAMES = {"user": "human", "assistant": "gpt", "system": "system", "tool": "tool"}


def sharegpt_records(names=SHAREGPT_NAMES) -> list[dict]:
    return [
        {
            "conversations": [
                {"from": names[m["role"]], "value": m["content"]}
                | {k: v for k, v in m.items() if k not in ("role", "content")}
                for m in r["messages"]
            ]
        }
        for r in chat_records()
    ]


def jsonl(records: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def write_as(kind: str, folder: Path, records: list[dict]) -> Path:
    """The records as one data file (or folder) of the given kind."""
    if kind == "jsonl":
        (path := folder / "d.jsonl").write_bytes(jsonl(records))
    elif kind == "jsonl.gz":
        (path := folder / "d.jsonl.gz").write_bytes(gzip.compress(jsonl(records)))
    elif kind == "json array":
        (path := folder / "d.json").write_text(json.dumps(records, indent=2))
    elif kind == "json lines":
        (path := folder / "d.json").write_bytes(jsonl(records))
    elif kind == "parquet":
        pq.write_table(pa.Table.from_pylist(records), path := folder / "d.parquet")
    else:
        raise ValueError(kind)
    return path


FORMATS = ["jsonl", "jsonl.gz", "json array", "json lines", "parquet"]


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("form", ["openai", "sharegpt"])
def test_every_format_loads_the_same_conversations_to_the_same_ids_and_masks(
    tokenizer, tmp_path, kind, form
):
    records = chat_records() if form == "openai" else sharegpt_records()
    reference = load(CHATS, tokenizer)
    assert_same(load(write_as(kind, tmp_path, records), tokenizer), reference)


def test_a_datasets_save_to_disk_folder_loads_like_its_source_jsonl(tokenizer, tmp_path):
    assert_same(load(HF_DATASET, tokenizer), load(CHATS, tokenizer))
    # a DatasetDict folder (one sub-folder per split) is found the same way
    shutil.copytree(HF_DATASET, tmp_path / "train")
    (tmp_path / "dataset_dict.json").write_text('{"splits": ["train"]}')
    assert_same(load(tmp_path, tokenizer), load(CHATS, tokenizer))


@pytest.mark.parametrize("alias", ["gpt", "chatgpt", "bing", "bard"])
def test_sharegpt_role_aliases_load_by_default(tokenizer, tmp_path, alias):
    names = SHAREGPT_NAMES | {"assistant": alias}
    path = write_as("jsonl", tmp_path, sharegpt_records(names))
    assert_same(load(path, tokenizer), load(CHATS, tokenizer))


def test_a_role_map_setting_maps_other_names(tokenizer, tmp_path):
    names = SHAREGPT_NAMES | {"assistant": "narrator", "user": "reader"}
    path = write_as("jsonl", tmp_path, sharegpt_records(names))
    role_map = {"narrator": "assistant", "reader": "user"}
    assert_same(load(path, tokenizer, role_map=role_map), load(CHATS, tokenizer))


def test_an_unknown_role_is_rejected_with_file_and_line(tokenizer, tmp_path):
    records = sharegpt_records()
    records[2]["conversations"][1]["from"] = "narrator"
    path = write_as("jsonl", tmp_path, records)
    with pytest.raises(DataError, match=rf"^{path}:3: message 1 has unknown role from='narrator'"):
        load(path, tokenizer)
    json_path = write_as("json array", tmp_path, records)  # named by its opening brace's line
    starts = [i + 1 for i, text in enumerate(json_path.read_text().splitlines()) if text == "  {"]
    with pytest.raises(DataError, match=rf"^{json_path}:{starts[2]}: message 1 has unknown role"):
        load(json_path, tokenizer)


def test_crlf_line_ends_and_a_utf8_bom_load(tokenizer, tmp_path):
    path = tmp_path / "windows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + jsonl(chat_records()).replace(b"\n", b"\r\n"))
    assert_same(load(path, tokenizer), load(CHATS, tokenizer))
    array = tmp_path / "windows.json"
    array.write_bytes(b"\xef\xbb\xbf" + json.dumps(chat_records(), indent=1).encode())
    assert_same(load(array, tokenizer), load(CHATS, tokenizer))


def truncated_file(tmp_path: Path) -> tuple[Path, int]:
    lines = jsonl(chat_records()).splitlines(keepends=True)
    path = tmp_path / "cut.jsonl"
    path.write_bytes(b"".join(lines[:-1]) + lines[-1][:25])  # an interrupted copy
    return path, len(lines)


def test_a_truncated_last_line_is_an_error_naming_its_line(tokenizer, tmp_path):
    path, last = truncated_file(tmp_path)
    with pytest.raises(DataError, match=rf"^{path}:{last}: truncated last line"):
        load(path, tokenizer)


def test_with_skip_a_truncated_last_line_is_counted_and_the_rest_kept(tokenizer, tmp_path):
    path, last = truncated_file(tmp_path)
    log = EventLog()
    samples = load(path, tokenizer, log, on_bad_record="skip")
    assert len(samples) == last - 1
    assert log.events[-1]["truncated_last_line"] == 1 and log.events[-1]["bad_record"] == 0


def test_a_malformed_line_with_its_end_is_a_bad_record_not_a_truncation(tokenizer, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(jsonl(chat_records()[:1]) + b'{"messages": [\n' + jsonl(chat_records()))
    log = EventLog()
    load(path, tokenizer, log, on_bad_record="skip")
    assert (log.events[-1]["bad_record"], log.events[-1]["truncated_last_line"]) == (1, 0)


def test_an_unclosed_json_array_is_an_error(tokenizer, tmp_path):
    path = tmp_path / "open.json"
    path.write_text(json.dumps(chat_records())[:-1])
    with pytest.raises(DataError, match=r"not closed"):
        load(path, tokenizer)


def test_a_cut_off_json_array_is_named_in_a_whole_sentence(tmp_path):
    """json's own message stops mid-phrase ("Unterminated string starting at"): the error says
    where and that the file ends before the array closes."""
    from dflash_async.data.formats import iter_raw_records

    path = tmp_path / "cut.json"
    path.write_text(
        '[{"messages": [{"role": "user", "content": "hi"}]},\n {"messages": [{"role": "us'
    )
    with pytest.raises(DataError) as error:
        list(iter_raw_records(path))
    message = str(error.value)
    assert message.startswith(f"{path}:2: malformed JSON array: Unterminated string starting at")
    assert "at line 2" in message and "ends before the array's ']'" in message
