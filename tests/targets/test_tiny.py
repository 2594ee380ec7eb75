"""tiny.py: the built-in tiny target, its tokenizer and the demo prompts."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest
import torch

from dflash_async.targets.loading import load_target, load_target_tokenizer
from dflash_async.targets.tiny import (
    TINY_MASK_TOKEN,
    demo_prompts,
    ensure_tiny_target,
    tiny_tokenizer,
)

QWEN3_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")


def test_tokenizer_has_qwen3_special_tokens_and_a_mask_token() -> None:
    tokenizer = tiny_tokenizer()
    ids = tokenizer.convert_tokens_to_ids([*QWEN3_TOKENS, TINY_MASK_TOKEN])
    assert len(set(ids)) == 6 and tokenizer.unk_token_id not in ids
    assert tokenizer.mask_token_id == tokenizer.convert_tokens_to_ids(TINY_MASK_TOKEN)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert 1000 <= len(tokenizer) <= 2000


def test_chat_template_renders_like_qwen3() -> None:
    tokenizer = tiny_tokenizer()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 plus 3?"}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    assert text == (
        "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.unk_token_id not in ids


def test_demo_prompts_of_both_splits_encode_without_unknown_tokens() -> None:
    tokenizer = tiny_tokenizer()
    for split in ("train", "heldout"):
        for record in demo_prompts(300, seed=5, split=split):
            text = tokenizer.apply_chat_template(record["messages"], tokenize=False)
            assert tokenizer.unk_token_id not in tokenizer(text, add_special_tokens=False).input_ids


def test_decoding_then_encoding_any_plain_tokens_gives_them_back() -> None:
    # Why: regenerated answers are stored as text; the drafter must see the target's exact ids.
    tokenizer = tiny_tokenizer()
    plain = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    plain = [i for i in plain if tokenizer.convert_ids_to_tokens(i) not in ("<think>", "</think>")]
    rng = random.Random(0)
    for _ in range(50):
        ids = rng.choices(plain, k=rng.randint(1, 40))
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert tokenizer(text, add_special_tokens=False).input_ids == ids


def test_demo_prompts_are_deterministic_openai_messages() -> None:
    prompts = demo_prompts(50, seed=1)
    assert prompts == demo_prompts(50, seed=1)
    assert prompts != demo_prompts(50, seed=2)
    assert demo_prompts(20, seed=1) == prompts[:20]  # a longer list extends a shorter one
    for record in prompts:
        roles = [m["role"] for m in record["messages"]]
        assert roles[-1] == "user" and set(roles) <= {"system", "user", "assistant"}
        assert all(isinstance(m["content"], str) for m in record["messages"])
    texts = [str(r["messages"]) for r in prompts]
    assert len(set(texts)) == len(texts)


def _first_question(record: dict) -> str:
    return next(m["content"] for m in record["messages"] if m["role"] == "user")


@pytest.mark.parametrize("multi_turn", [True, False])
def test_train_and_heldout_prompts_never_share_a_first_question(multi_turn: bool) -> None:
    train = demo_prompts(500, seed=0, split="train", multi_turn=multi_turn)
    heldout = demo_prompts(100, seed=0, split="heldout", multi_turn=multi_turn)
    assert len(heldout) == 100
    assert not {_first_question(r) for r in train} & {_first_question(r) for r in heldout}


def test_multi_turn_false_gives_prompts_with_one_question() -> None:
    def questions(record: dict) -> int:
        return sum(m["role"] == "user" for m in record["messages"])

    assert any(questions(r) == 2 for r in demo_prompts(200, seed=0, multi_turn=True))
    single = demo_prompts(200, seed=0, multi_turn=False)
    assert all(questions(r) == 1 and r["messages"][-1]["role"] == "user" for r in single)


def test_bad_split_is_rejected_with_the_value() -> None:
    with pytest.raises(ValueError, match="split='test'"):
        demo_prompts(3, split="test")


def _digest(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def test_tiny_target_builds_identically_twice_then_is_reused(tmp_path: Path) -> None:
    first = ensure_tiny_target(tmp_path / "a")
    second = ensure_tiny_target(tmp_path / "b")
    assert first.name == second.name and _digest(first) == _digest(second)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_target(tmp_path / "a") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert [p.name for p in (tmp_path / "a").iterdir()] == [first.name]  # no temporaries left


def test_tiny_target_loads_as_a_qwen3_with_its_tokenizer(tmp_path: Path) -> None:
    folder = ensure_tiny_target(tmp_path)
    model = load_target(folder, device=torch.device("cpu"))
    tokenizer = load_target_tokenizer(folder)
    config = model.config
    assert config.model_type == "qwen3" and config.vocab_size == len(tokenizer)
    assert config.num_hidden_layers == 6 and config.hidden_size == 128
    assert tokenizer.mask_token_id == tokenizer.convert_tokens_to_ids(TINY_MASK_TOKEN)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert tokenizer.mask_token_id in model.generation_config.suppress_tokens
