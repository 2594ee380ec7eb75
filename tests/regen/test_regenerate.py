"""eval/regenerate.py: the target rewrites the assistant turns in process; jsonl output; the cached
demo corpus (the `regenerate` command's files, server and shards: test_regen.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import dflash_async.eval.regenerate as regen
from dflash_async.eval.regenerate import demo_corpus, regenerate, write_jsonl
from dflash_async.targets.loading import load_target, load_target_tokenizer
from dflash_async.targets.tiny import demo_prompts, ensure_tiny_target

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_target(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny(tiny_folder: Path) -> tuple[Any, Any]:
    return load_target(tiny_folder, device=torch.device("cpu")), load_target_tokenizer(tiny_folder)


def _user(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}]}


def _greedy_reference(model: Any, tokenizer: Any, messages: list[dict], n: int) -> str:
    """The target's greedy continuation by hand: full forward, argmax, no cache, no generate."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    suppressed = torch.tensor(model.generation_config.suppress_tokens)
    new: list[int] = []
    for _ in range(n):
        logits = model(input_ids=ids).logits[0, -1].index_fill(0, suppressed, float("-inf"))
        token = int(logits.argmax())
        if token == tokenizer.eos_token_id:
            break
        new.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokenizer.decode(new, skip_special_tokens=True)


def test_greedy_regeneration_equals_the_targets_greedy_continuation(tiny: tuple) -> None:
    model, tokenizer = tiny
    prompts = demo_prompts(5, seed=3)
    prompts = [p for p in prompts if len(p["messages"]) < 3][:3]
    records = regenerate(model, tokenizer, prompts, max_new_tokens=12, batch_size=4)
    for prompt, record in zip(prompts, records, strict=True):
        expected = _greedy_reference(model, tokenizer, prompt["messages"], 12)
        assert record["messages"][-1] == {"role": "assistant", "content": expected}


def test_batching_and_left_padding_do_not_change_the_answers(tiny: tuple) -> None:
    model, tokenizer = tiny
    prompts = [
        _user("What is 2 plus 3?"),
        _user("Repeat after me: red cat blue dog lion."),
        _user("List 4 fruits, one per line."),
    ]
    one_by_one = regenerate(model, tokenizer, prompts, max_new_tokens=10, batch_size=1)
    batched = regenerate(model, tokenizer, prompts, max_new_tokens=10, batch_size=3)
    assert batched == one_by_one


def test_a_target_without_a_pad_token_still_batches(
    tiny: tuple, tiny_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer = tiny
    prompts = [_user("What is 2 plus 3?"), _user("Repeat after me: red cat blue dog lion.")]
    expected = regenerate(model, tokenizer, prompts, max_new_tokens=6, batch_size=2)
    no_pad = load_target_tokenizer(tiny_folder)
    no_pad.pad_token = None  # like Llama's tokenizers
    monkeypatch.setattr(model.generation_config, "pad_token_id", None)
    assert regenerate(model, no_pad, prompts, max_new_tokens=6, batch_size=2) == expected


def test_records_are_openai_messages_with_input_keys_kept(tiny: tuple) -> None:
    model, tokenizer = tiny
    prompt = {
        "id": "x1",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Spell the word cat."},
        ],
    }
    (record,) = regenerate(model, tokenizer, [prompt], max_new_tokens=6, batch_size=2)
    assert record["id"] == "x1"
    assert [m["role"] for m in record["messages"]] == ["system", "user", "assistant"]
    assert isinstance(record["messages"][-1]["content"], str)
    assert len(prompt["messages"]) == 2  # the input is not modified


def test_every_assistant_turn_is_regenerated_given_the_previous_regenerated_ones(
    tiny: tuple,
) -> None:
    model, tokenizer = tiny
    conversation = {
        "messages": [
            {"role": "user", "content": "What is 2 plus 3?"},
            {"role": "assistant", "content": "an answer the target did not write"},
            {"role": "user", "content": "Spell the word cat."},
        ]
    }
    (record,) = regenerate(model, tokenizer, [conversation], max_new_tokens=8, batch_size=2)
    messages = record["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[1]["content"] == _greedy_reference(model, tokenizer, messages[:1], 8)
    assert messages[3]["content"] == _greedy_reference(model, tokenizer, messages[:3], 8)


def test_assistant_turns_with_tool_calls_are_kept_verbatim(tiny: tuple) -> None:
    model, tokenizer = tiny
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
        ],
    }
    conversation = {
        "messages": [
            {"role": "user", "content": "What is 2 plus 3?"},
            call,
            {"role": "tool", "content": "5"},
        ]
    }
    (record,) = regenerate(model, tokenizer, [conversation], max_new_tokens=4, batch_size=1)
    assert record["messages"][1] == call
    assert [m["role"] for m in record["messages"]][-1] == "assistant"


def test_sampling_is_seeded_and_does_not_leak_the_seed(tiny: tuple) -> None:
    model, tokenizer = tiny
    prompts = [_user("What is 7 times 8?")] * 2
    state = torch.get_rng_state()
    a = regenerate(model, tokenizer, prompts, max_new_tokens=8, batch_size=2, greedy=False, seed=1)
    b = regenerate(model, tokenizer, prompts, max_new_tokens=8, batch_size=2, greedy=False, seed=1)
    assert a == b and torch.equal(torch.get_rng_state(), state)


def test_malformed_conversations_name_the_record(tiny: tuple) -> None:
    model, tokenizer = tiny
    with pytest.raises(ValueError, match=r"conversation 1: messages\[0\] has role 'bot'"):
        regenerate(
            model,
            tokenizer,
            [_user("hi"), {"messages": [{"role": "bot"}]}],
            max_new_tokens=2,
            batch_size=1,
        )


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_write_jsonl_writes_one_object_a_line_and_leaves_no_temporary(tmp_path: Path) -> None:
    records = [_user("What is 2 plus 3?"), _user("Spell the word cat.")]
    path = write_jsonl(records, tmp_path / "out" / "data.jsonl")
    assert read_jsonl(path) == records
    assert [p.name for p in path.parent.iterdir()] == ["data.jsonl"]  # no temporary left


def test_turns_last_regenerates_only_the_last_turn_given_the_original_history(
    tiny: tuple,
) -> None:
    model, tokenizer = tiny
    original = {"role": "assistant", "content": "an answer the target did not write"}
    conversation = {
        "messages": [
            {"role": "user", "content": "What is 2 plus 3?"},
            original,
            {"role": "user", "content": "Spell the word cat."},
        ]
    }
    (record,) = regenerate(
        model, tokenizer, [conversation], max_new_tokens=8, batch_size=1, turns="last"
    )
    messages = record["messages"]
    assert messages[1] == original
    assert messages[3]["content"] == _greedy_reference(model, tokenizer, messages[:3], 8)


def test_demo_corpus_answers_the_train_prompts_and_is_cached(
    tiny_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = demo_corpus(tmp_path, tiny_folder, 12, max_new_tokens=6)
    records = read_jsonl(path)
    prompts = demo_prompts(12, split="train")
    assert len(records) == 12
    for prompt, record in zip(prompts, records, strict=True):
        asked = [m for m in record["messages"] if m["role"] != "assistant"]
        assert asked == [m for m in prompt["messages"] if m["role"] != "assistant"]
        assert record["messages"][-1]["role"] == "assistant"

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached corpus was regenerated")

    monkeypatch.setattr(regen, "regenerate", fail)
    assert demo_corpus(tmp_path, tiny_folder, 12, max_new_tokens=6) == path
