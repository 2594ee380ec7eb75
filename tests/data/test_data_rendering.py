"""The fast chat-template renderer equals transformers' own renderer, sandbox included."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
from fixtures.chat_tokenizer import QWEN3_TEMPLATE

from dflash_async.data.rendering import render_chat, render_chat_reference

CHATS = Path(__file__).parents[1] / "fixtures" / "chats.jsonl"
TEMPLATE = QWEN3_TEMPLATE.read_text()
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
CONVERSATIONS = [json.loads(line)["messages"] for line in CHATS.read_text().splitlines()] + [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning": "call the tool",
            "tool_calls": [{"function": {"name": "search", "arguments": {"q": "sun"}}}],
        },
        {"role": "tool", "content": "<tool_response>sunny</tool_response>"},
        {"role": "assistant", "content": "<think>\nok\n</think>\n\nSunny.", "thinking": "x"},
    ]
]


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("enable_thinking", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_fast_rendering_equals_transformers_rendering_of_every_prefix(
    tools, enable_thinking, add_generation_prompt
):
    for messages in CONVERSATIONS:
        for n in range(1, len(messages) + 1):
            kwargs = dict(
                add_generation_prompt=add_generation_prompt,
                enable_thinking=enable_thinking,
                tools=tools,
            )
            want = render_chat_reference(TEMPLATE, messages[:n], **kwargs)
            assert render_chat(TEMPLATE, messages[:n], **kwargs) == want


# Each template is refused by transformers' sandbox. The first one asks for the same attribute
# name on a namespace (safe) and then on a class (unsafe): a check memoized by name alone passes.
UNSAFE = [
    "{% set ns = namespace(mro=1) %}{{ ns.mro }}{{ namespace.mro() }}",
    "{{ messages.append(1) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ ''.__class__.__name__ }}",
]


@pytest.mark.parametrize("template", UNSAFE)
def test_the_fast_renderer_refuses_what_the_sandbox_refuses(template):
    messages = [{"role": "user", "content": "hi"}]
    kwargs = dict(add_generation_prompt=False, enable_thinking=False)
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat_reference(template, messages, **kwargs)
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat(template, messages, **kwargs)


def test_a_missing_key_renders_as_undefined_like_the_reference():
    template = "{% for m in messages %}[{{ m.name }}|{{ m.name is defined }}]{% endfor %}"
    messages = [{"role": "user", "content": "a", "name": "n"}, {"role": "user", "content": "b"}]
    kwargs = dict(add_generation_prompt=False, enable_thinking=False)
    assert render_chat(template, messages, **kwargs) == render_chat_reference(
        template, messages, **kwargs
    )
