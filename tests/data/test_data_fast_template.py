"""The Python Qwen3 renderer and the direct tokenizer call give what jinja and transformers give.

The reference is the plain path: transformers' jinja rendering (encode_chat without a fast
renderer) and `tokenizer(text, return_offsets_mapping=True)`. The conversations here are written
for this test, apart from the module's own probes, so the check is not circular.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from data_samples import EventLog
from fixtures.chat_tokenizer import QWEN3_TEMPLATE, qwen3_like_tokenizer

from dflash_async.data.chat import encode_chat
from dflash_async.data.fast_template import choose_renderer, render_qwen3
from dflash_async.data.rendering import render_chat
from dflash_async.data.samples import DataOptions, load_samples
from dflash_async.data.tokenization import tokenize_batch

TEMPLATE = QWEN3_TEMPLATE.read_text()
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def m(role: str, content: str | None = None, **extra) -> dict:
    return {"role": role, **({} if content is None else {"content": content}), **extra}


CONVERSATIONS = [
    [m("user", "Bonjour, ça va? 日本語 🙂"), m("assistant", "Très bien, merci.")],
    [
        m("system", "You are terse."),
        m("user", "a"),
        m("assistant", "b"),
        m("user", "c"),
        m("assistant", "d\n\n"),
    ],
    [
        m("user", "think"),
        m("assistant", "<think>\nstep 1\nstep 2\n</think>\n\nanswer"),
        m("user", "again"),
        m("assistant", "<think>\n\n</think>\n\nshort"),
    ],
    [
        m("user", "x"),
        m("assistant", "first", reasoning_content="why first"),
        m("user", "y"),
        m("assistant", "second", reasoning="why second"),
    ],
    [
        m("user", "look it up"),
        m("assistant", "Looking.", thinking="use the tool"),
        m("tool", "result one"),
        m("tool", "result two"),
        m("assistant", "Found both."),
    ],
    [m("user", ""), m("assistant", ""), m("user", "still there?"), m("assistant", "yes")],
    [
        m("user", "q"),
        m("assistant", "a"),
        m("system", "a mid-conversation system turn"),
        m("user", "<tool_response>r</tool_response>"),
        m("assistant", "after the tool text"),
    ],
    [m("assistant", "I open."), m("user", "ok"), m("assistant", "\n\nleading newlines")],
]


@pytest.mark.parametrize("enable_thinking", [False, True])
def test_python_qwen3_renders_every_prefix_like_jinja(enable_thinking):
    for messages in CONVERSATIONS:
        for n in range(1, len(messages) + 1):
            for add_generation_prompt in (False, True):
                kwargs = dict(
                    add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking
                )
                want = render_chat(TEMPLATE, messages[:n], **kwargs)
                assert render_qwen3(messages[:n], **kwargs) == want, (messages[:n], kwargs)


@pytest.mark.parametrize("enable_thinking", [False, True])
def test_the_fast_path_gives_the_reference_token_ids_and_loss_masks(
    tokenizer, tmp_path, enable_thinking
):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    log = EventLog()
    options = DataOptions(enable_thinking=enable_thinking, on_bad_record="skip")
    samples = load_samples(str(path), tokenizer, options=options, block_size=1, log=log)
    assert log.of("chat_renderer_chosen")["renderer"] == "python_qwen3"
    want = [encode_chat(tokenizer, c, enable_thinking=enable_thinking) for c in CONVERSATIONS]
    want = [(ids.tolist(), mask.tolist()) for ids, mask in want if mask.sum() >= 2]
    got = [(ids.tolist(), mask.tolist()) for ids, mask in map(samples.sample, range(len(samples)))]
    assert got == want


def test_a_template_other_than_qwen3s_is_rendered_by_jinja_and_says_why(tokenizer, tmp_path):
    chatml = qwen3_like_tokenizer()
    chatml.chat_template = CHATML
    assert choose_renderer(CHATML, [], enable_thinking=True)[0] is None
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS[:2]))
    log = EventLog()
    samples = load_samples(str(path), chatml, options=DataOptions(), block_size=1, log=log)
    assert log.of("chat_renderer_chosen")["renderer"] == "jinja"
    assert "differently" in log.of("chat_renderer_chosen")["why"]
    ids, mask = encode_chat(chatml, CONVERSATIONS[1], enable_thinking=True)
    np.testing.assert_array_equal(samples.sample(1)[0], ids)
    np.testing.assert_array_equal(samples.sample(1)[1], mask)


def test_tool_calls_tools_and_a_system_prompt_without_text_are_left_to_jinja():
    call = [{"function": {"name": "f", "arguments": {"x": 1}}}]
    messages = [m("user", "q"), m("assistant", "", tool_calls=call)]
    kwargs = dict(add_generation_prompt=False, enable_thinking=True)
    assert render_qwen3(messages, **kwargs) is None
    assert render_qwen3(messages[:1], tools=[{"type": "function"}], **kwargs) is None
    assert render_qwen3([m("system"), m("user", "q")], **kwargs) is None  # jinja raises on it


@pytest.mark.parametrize("truncation", [False, True])
def test_batched_tokenization_equals_the_tokenizer_call_per_text(truncation):
    tokenizer = qwen3_like_tokenizer()
    if truncation:  # a tokenizer.json with truncation set: the direct call would truncate
        tokenizer.backend_tokenizer.enable_truncation(max_length=8)
    texts = [
        render_chat(TEMPLATE, c, add_generation_prompt=False, enable_thinking=True)
        for c in CONVERSATIONS
    ]
    for text, (ids, offsets) in zip(texts, tokenize_batch(tokenizer, texts), strict=True):
        want = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        assert ids.tolist() == want["input_ids"] and len(ids) > 8
        assert offsets.tolist() == [list(o) for o in want["offset_mapping"]]
