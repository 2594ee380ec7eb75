"""The tokenized cache: reused when nothing changed, rebuilt when anything that shapes it did."""

from __future__ import annotations

import json
import os
from pathlib import Path

import data_samples
import numpy as np
import pytest
from data_samples import BLOCK, CHATS, EventLog, assert_same
from fixtures.chat_tokenizer import qwen3_like_tokenizer

from dflash_async.data import samples as samples_module
from dflash_async.data.samples import DataOptions, TokenizedSamples, load_samples


def load(path, tokenizer, **options) -> tuple[TokenizedSamples, bool]:
    """(samples, whether they came from the cache)."""
    log = EventLog()
    samples = data_samples.load(path, tokenizer, log, **options)
    return samples, log.events[-1]["cached"]


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_bytes(CHATS.read_bytes())
    return path


def test_a_second_load_reuses_the_cache_memory_mapped_and_identical(tokenizer, data, tmp_path):
    cache = str(tmp_path / "cache")
    first, first_cached = load(data, tokenizer, cache_dir=cache)
    second, second_cached = load(data, tokenizer, cache_dir=cache)
    assert (first_cached, second_cached) == (False, True)
    assert isinstance(second.tokens, np.memmap) and not second.tokens.flags.writeable
    assert_same(first, second)
    assert second.summary == first.summary
    assert second.max_token_id == int(np.asarray(first.tokens).max())


def test_the_cache_is_rebuilt_when_the_data_changes(tokenizer, data, tmp_path):
    cache = str(tmp_path / "cache")
    load(data, tokenizer, cache_dir=cache)
    records = CHATS.read_text().splitlines()
    data.write_text("\n".join(records[:2]) + "\n")  # new content (size and mtime)
    samples, cached = load(data, tokenizer, cache_dir=cache)
    assert not cached and len(samples) == 2
    os.utime(data, ns=(1, 1))  # same bytes, other mtime: rebuilt as well
    assert not load(data, tokenizer, cache_dir=cache)[1]


def test_the_cache_is_rebuilt_when_the_template_changes(tokenizer, data, tmp_path):
    cache = str(tmp_path / "cache")
    load(data, tokenizer, cache_dir=cache)
    other = qwen3_like_tokenizer()
    other.chat_template = other.chat_template.replace("<|im_start|>", "<|im_start|> ")
    samples, cached = load(data, other, cache_dir=cache)
    assert not cached
    assert len(samples.tokens) != len(load(data, tokenizer, cache_dir=cache)[0].tokens)


@pytest.mark.parametrize(
    "change",
    [
        {"max_len": 40},
        {"enable_thinking": False},
        {"loss_turns": "last"},
        {"too_long": "drop", "max_len": 40},
        {"role_map": {"gpt": "assistant"}},
    ],
)
def test_the_cache_is_rebuilt_when_a_sample_option_changes(tokenizer, data, tmp_path, change):
    cache = str(tmp_path / "cache")
    load(data, tokenizer, cache_dir=cache, max_len=40 if "too_long" in change else 3072)
    samples, cached = load(data, tokenizer, cache_dir=cache, **change)
    assert not cached
    assert_same(samples, load(data, tokenizer, **change)[0])


def test_how_samples_are_computed_does_not_change_the_key(tokenizer, data, tmp_path):
    cache = str(tmp_path / "cache")
    load(data, tokenizer, cache_dir=cache)
    assert load(data, tokenizer, cache_dir=cache, workers=2, chunk_records=1)[1]


def test_an_unfinished_entry_is_not_read(tokenizer, data, tmp_path):
    cache = tmp_path / "cache"
    load(data, tokenizer, cache_dir=str(cache))
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    (entry / "summary.json").unlink()  # as if the writer died before finishing
    samples, cached = load(data, tokenizer, cache_dir=str(cache))
    assert not cached and len(samples) == 4


def test_without_a_cache_dir_nothing_is_left_on_disk(tokenizer, data, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    samples, cached = load(data, tokenizer)
    assert not cached and len(samples) == 4 and json.dumps(samples.summary)
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_loader_waits_for_the_one_building_the_entry_and_then_reads_it(
    tokenizer, data, tmp_path, monkeypatch
):
    import shutil
    import threading

    from dflash_async.data import cache as data_cache

    built = tmp_path / "elsewhere"
    load(data, tokenizer, cache_dir=str(built))
    (entry,) = [p for p in built.iterdir() if p.is_dir()]
    key = entry.name.removeprefix("tokenized-")
    target, results, asking = tmp_path / "shared", [], threading.Event()
    entry_lock = data_cache.entry_lock

    def announced_lock(*args):
        asking.set()  # the loader is about to take the lock
        return entry_lock(*args)

    monkeypatch.setattr(data_cache, "entry_lock", announced_lock)
    with entry_lock(target, key):  # another rank is building this entry
        waiter = threading.Thread(
            target=lambda: results.append(load(data, tokenizer, cache_dir=str(target)))
        )
        waiter.start()
        assert asking.wait(timeout=60)
        shutil.copytree(entry, target / entry.name)  # ... and publishes it
    waiter.join(timeout=60)
    assert len(results) == 1 and results[0][1]  # read from the cache, not built again


def run_data_options(output_dir: Path, **env: str) -> DataOptions:
    """The DataOptions `run` gets from the demo preset in `output_dir` and `env` (DFLASH_DATA__*
    given without the prefix); one tokenizer process, so that the tests stay in this one."""
    from dflash_async.pipeline.specs import run_spec
    from dflash_async.settings.env import load_settings

    environ = {"DFLASH_OUTPUT_DIR": str(output_dir), "DFLASH_DATA__WORKERS": "1"}
    environ |= {f"DFLASH_DATA__{name.upper()}": value for name, value in env.items()}
    return run_spec(load_settings(environ)).data


def test_by_default_the_run_caches_tokenized_data_in_its_output_folder(tmp_path):
    assert run_data_options(tmp_path / "run").cache_dir == str(tmp_path / "run" / "cache")


def test_cache_dir_none_turns_the_cache_off_and_a_folder_is_used_as_given(tmp_path):
    assert run_data_options(tmp_path / "run", cache_dir="none").cache_dir is None
    shared = str(tmp_path / "shared")
    assert run_data_options(tmp_path / "run", cache_dir=shared).cache_dir == shared


def test_a_second_run_in_the_same_output_folder_does_not_tokenize_again(
    tokenizer, data, tmp_path, monkeypatch
):
    """A resume or a refused re-run reads the data again: with the default settings it comes
    from OUTPUT_DIR/cache, memory-mapped, equal to the first load, with no tokenizing at all."""
    options = run_data_options(tmp_path / "run")
    first_log, second_log = EventLog(), EventLog()
    first = load_samples(str(data), tokenizer, options=options, block_size=BLOCK, log=first_log)

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the second load tokenized the data again")

    monkeypatch.setattr(samples_module, "encode_all", no_tokenizing)
    second = load_samples(str(data), tokenizer, options=options, block_size=BLOCK, log=second_log)
    assert_same(first, second)
    assert second.summary == first.summary
    loaded = second_log.of("data_loaded")
    assert (first_log.of("data_loaded")["cached"], loaded["cached"]) == (False, True)
    assert loaded["cache_dir"] == str(tmp_path / "run" / "cache")  # the user sees where
