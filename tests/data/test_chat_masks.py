"""Assistant-only loss masks on the real Qwen3 chat template, at every boundary.

Each case spells out the expected rendering as (text, supervised) segments. The expected token
mask tokenizes each segment on its own; the claim is that encode_chat's ids equal the whole
rendering's ids and its mask equals the segments' mask token for token.
"""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.chat_tokenizer import qwen3_like_tokenizer

from dflash_async.data.chat import ChatMaskError, assistant_char_mask, encode_chat, token_mask

S, U = "<|im_start|>", "<|im_end|>"


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str, **extra: str) -> dict:
    return {"role": "assistant", "content": text, **extra}


def expected(tokenizer, segments: list[tuple[str, bool]]) -> tuple[np.ndarray, np.ndarray]:
    """Ids of the whole rendering; a token is supervised iff it lies in a supervised segment."""
    text = "".join(t for t, _ in segments)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    bounds = np.cumsum([0] + [len(t) for t, _ in segments])
    mask = []
    for start, end in encoding["offset_mapping"]:
        segment = int(np.searchsorted(bounds, start, side="right")) - 1
        assert end <= bounds[segment + 1], f"a token straddles segment {segment}'s end"
        mask.append(segments[segment][1])
    return np.array(encoding["input_ids"]), np.array(mask, dtype=bool)


def supervised_runs(full: str, mask: np.ndarray) -> list[str]:
    runs, current = [], ""
    for ch, supervised in zip(full, mask, strict=True):
        if supervised:
            current += ch
        elif current:
            runs, current = [*runs, current], ""
    return runs + ([current] if current else [])


def assert_mask(tokenizer, messages, segments, *, enable_thinking, loss_turns="all"):
    ids, mask = encode_chat(
        tokenizer, messages, enable_thinking=enable_thinking, loss_turns=loss_turns
    )
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=False, enable_thinking=enable_thinking
    )
    assert rendered == "".join(text for text, _ in segments)  # the case is spelled right
    want_ids, want_mask = expected(tokenizer, segments)
    np.testing.assert_array_equal(ids, want_ids)
    tokens = tokenizer.convert_ids_to_tokens(ids.tolist())
    got = [(t, bool(m)) for t, m in zip(tokens, mask, strict=True)]
    assert got == [(t, bool(m)) for t, m in zip(tokens, want_mask, strict=True)]


def test_single_turn_with_thinking_supervises_think_block_answer_and_im_end(tokenizer):
    messages = [user("What is two plus two?"), assistant("<think>\nstep by step\n</think>\n\nfour")]
    segments = [
        (f"{S}user\nWhat is two plus two?{U}\n{S}assistant\n", False),
        ("<think>\nstep by step\n</think>\n\nfour" + U, True),
        ("\n", False),
    ]
    assert_mask(tokenizer, messages, segments, enable_thinking=True)


def test_reasoning_content_field_is_rendered_and_supervised_like_inline_think(tokenizer):
    messages = [user("Hi"), assistant("Hello", reasoning_content="greet them")]
    segments = [
        (f"{S}user\nHi{U}\n{S}assistant\n", False),
        ("<think>\ngreet them\n</think>\n\nHello" + U, True),
        ("\n", False),
    ]
    assert_mask(tokenizer, messages, segments, enable_thinking=True)


def test_thinking_off_leaves_the_prompted_empty_think_block_unsupervised(tokenizer):
    messages = [user("Hi"), assistant("Hello")]
    segments = [
        (f"{S}user\nHi{U}\n{S}assistant\n<think>\n\n</think>\n\n", False),
        ("Hello" + U, True),
        ("\n", False),
    ]
    assert_mask(tokenizer, messages, segments, enable_thinking=False)


def test_thinking_on_without_reasoning_supervises_the_empty_think_block(tokenizer):
    messages = [user("Hi"), assistant("Hello")]
    segments = [
        (f"{S}user\nHi{U}\n{S}assistant\n", False),
        ("<think>\n\n</think>\n\nHello" + U, True),
        ("\n", False),
    ]
    assert_mask(tokenizer, messages, segments, enable_thinking=True)


def test_multi_turn_thinking_drops_earlier_think_and_masks_what_remains(tokenizer):
    """Qwen3 renders turn 1 without its <think> once a later user query exists."""
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        user("What is two plus two?"),
        assistant("<think>\nadd them\n</think>\n\nfour"),
        user("And the sum?"),
        assistant("42", reasoning_content="the numbers"),
    ]
    segments = [
        (f"{S}system\nYou are a helpful assistant.{U}\n", False),
        (f"{S}user\nWhat is two plus two?{U}\n{S}assistant\n", False),
        ("four" + U, True),
        (f"\n{S}user\nAnd the sum?{U}\n{S}assistant\n", False),
        ("<think>\nthe numbers\n</think>\n\n42" + U, True),
        ("\n", False),
    ]
    assert_mask(tokenizer, messages, segments, enable_thinking=True)


def test_multi_turn_thinking_off_masks_every_answer_and_its_im_end(tokenizer):
    messages = [user("Hi"), assistant("Hello there!"), user("How are you?"), assistant("fine")]
    segments = [
        (f"{S}user\nHi{U}\n{S}assistant\n", False),
        ("Hello there!" + U, True),
        (f"\n{S}user\nHow are you?{U}\n{S}assistant\n<think>\n\n</think>\n\n", False),
        ("fine" + U, True),
        ("\n", False),
    ]
    assert_mask(tokenizer, messages, segments, enable_thinking=False)


def test_loss_turns_last_supervises_only_the_final_answer(tokenizer):
    messages = [user("Hi"), assistant("Hello there!"), user("How are you?"), assistant("fine")]
    segments = [
        (f"{S}user\nHi{U}\n{S}assistant\nHello there!{U}\n", False),
        (f"{S}user\nHow are you?{U}\n{S}assistant\n<think>\n\n</think>\n\n", False),
        ("fine" + U, True),
        ("\n", False),
    ]
    assert_mask(tokenizer, messages, segments, enable_thinking=False, loss_turns="last")


def test_tool_chain_turns_lose_reasoning_in_context_and_stay_supervised(tokenizer):
    messages = [
        user("weather?"),
        assistant("searching", reasoning_content="use the tool"),
        {"role": "tool", "content": "sunny"},
        assistant("It is sunny.", reasoning_content="read it"),
        user("thanks"),
        assistant("You are welcome."),
    ]
    segments = [
        (f"{S}user\nweather?{U}\n{S}assistant\n", False),
        ("searching" + U, True),
        (f"\n{S}user\n<tool_response>\nsunny\n</tool_response>{U}\n{S}assistant\n", False),
        ("It is sunny." + U, True),
        (f"\n{S}user\nthanks{U}\n{S}assistant\n", False),
        ("<think>\n\n</think>\n\nYou are welcome." + U, True),
        ("\n", False),
    ]
    assert_mask(tokenizer, messages, segments, enable_thinking=True)


def test_empty_earlier_answer_supervises_its_im_end_only(tokenizer):
    messages = [user("Hi"), assistant(""), user("again"), assistant("ok")]
    segments = [
        (f"{S}user\nHi{U}\n{S}assistant\n", False),
        (U, True),
        (f"\n{S}user\nagain{U}\n{S}assistant\n<think>\n\n</think>\n\n", False),
        ("ok" + U, True),
        ("\n", False),
    ]
    assert_mask(tokenizer, messages, segments, enable_thinking=False)


def test_offsets_trimmed_of_whitespace_give_the_same_mask():
    messages = [user("Hi  there"), assistant("<think>\n  a b\n</think>\n\n  Hello  you")]
    plain = encode_chat(qwen3_like_tokenizer(), messages, enable_thinking=True)
    trimmed = encode_chat(qwen3_like_tokenizer(trim_offsets=True), messages, enable_thinking=True)
    np.testing.assert_array_equal(plain[0], trimmed[0])
    np.testing.assert_array_equal(plain[1], trimmed[1])


def test_template_without_generation_markers_or_thinking_is_masked_by_diffing():
    chatml = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    full, mask = assistant_char_mask(
        chatml, [user("a"), assistant("b c"), user("d"), assistant("e")], enable_thinking=True
    )
    assert supervised_runs(full, mask) == ["b c<|im_end|>", "e<|im_end|>"]


def test_a_template_that_hides_an_answer_is_an_error_not_a_wrong_mask():
    hides = (
        "{% for m in messages %}{% if m.role == 'user' %}U:{{ m.content }}\n"
        "{% elif loop.last %}A:{{ m.content }}\n{% else %}A:\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}A:{% endif %}"
    )
    with pytest.raises(ChatMaskError):
        assistant_char_mask(
            hides, [user("a"), assistant("bbb"), user("c"), assistant("d")], enable_thinking=True
        )


def test_token_mask_counts_a_token_supervised_if_any_of_its_characters_is():
    char_mask = np.array([0, 0, 1, 1, 0, 0], dtype=bool)
    offsets = [(0, 2), (2, 3), (3, 5), (5, 6)]
    assert token_mask(char_mask, offsets).tolist() == [False, True, True, False]


def test_a_tool_call_turn_without_content_is_supervised_through_its_call(tokenizer):
    call = {"type": "function", "function": {"name": "search", "arguments": {"query": "weather"}}}
    messages = [
        user("weather?"),
        {"role": "assistant", "content": "", "reasoning_content": "use it", "tool_calls": [call]},
        {"role": "tool", "content": "sunny"},
        assistant("It is sunny."),
        user("thanks"),
        assistant("ok"),
    ]
    tool_call = '<tool_call>\n{"name": "search", "arguments": {"query": "weather"}}\n</tool_call>'
    segments = [
        (f"{S}user\nweather?{U}\n{S}assistant\n", False),
        (tool_call + U, True),
        (f"\n{S}user\n<tool_response>\nsunny\n</tool_response>{U}\n{S}assistant\n", False),
        ("It is sunny." + U, True),
        (f"\n{S}user\nthanks{U}\n{S}assistant\n", False),
        ("<think>\n\n</think>\n\nok" + U, True),
        ("\n", False),
    ]
    assert_mask(tokenizer, messages, segments, enable_thinking=True)
