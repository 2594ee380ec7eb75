"""Qwen3's chat template in plain Python, used only where it renders exactly as jinja does.

Masking a 3-exchange conversation renders its template about 10 times (chat.py); in jinja that
is two thirds of the cost of tokenizing chat data. `render_qwen3` is a line-by-line translation
of Qwen3's template (tests/fixtures/qwen3_chat_template.jinja) for the conversations it supports
(roles system/user/assistant/tool, text contents, reasoning fields; no tools, no tool calls): it
returns None for anything else, and the caller renders that with jinja.

`choose_renderer` decides per run, before the first record is tokenized: the fast renderer is
used only if it renders every prefix of the probe conversations below and of a sample of the
run's own records exactly as jinja renders them (with and without the generation prompt);
otherwise every record goes through jinja and the logged event says why. A template that is not
Qwen3's differs on the probes at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dflash_async.data.chat import common_prefix_len
from dflash_async.data.rendering import render_chat

Message = dict[str, Any]
FastRenderer = Callable[..., str | None]
ROLES = ("system", "user", "assistant", "tool")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' alias order


def _reasoning(message: Message) -> Any:
    """The reasoning text as transformers passes it to templates (first non-None alias)."""
    return next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)


def _is_tool_response(content: str) -> bool:
    return content.startswith("<tool_response>") and content.endswith("</tool_response>")


def render_qwen3(
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool,
    enable_thinking: bool,
    tools: list[dict] | None = None,
) -> str | None:
    """Qwen3's template rendered in Python; None where jinja must render (see the docstring)."""
    if tools or not messages:
        return None
    for m in messages:
        content = m.get("content")
        if m.get("role") not in ROLES or m.get("tool_calls") or not isinstance(content, str | None):
            return None
    last = len(messages) - 1
    out = []
    if messages[0]["role"] == "system":
        if not isinstance(messages[0].get("content"), str):
            return None  # jinja raises on it: let it
        out.append("<|im_start|>system\n" + messages[0]["content"] + "<|im_end|>\n")
    last_query = last
    for index in range(last, -1, -1):
        content = messages[index].get("content")
        is_query = isinstance(content, str) and not _is_tool_response(content)
        if messages[index]["role"] == "user" and is_query:
            last_query = index
            break
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        if role == "user" or (role == "system" and i > 0):
            out.append("<|im_start|>" + role + "\n" + content + "<|im_end|>\n")
        elif role == "assistant":
            reasoning = _reasoning(m)
            if not isinstance(reasoning, str):
                reasoning = ""
                if "</think>" in content:
                    before = content.split("</think>")[0].rstrip("\n")
                    reasoning = before.split("<think>")[-1].lstrip("\n")
                    content = content.split("</think>")[-1].lstrip("\n")
            if i > last_query and (i == last or reasoning):
                out.append("<|im_start|>assistant\n<think>\n" + reasoning.strip("\n"))
                out.append("\n</think>\n\n" + content.lstrip("\n"))
            else:
                out.append("<|im_start|>assistant\n" + content)
            out.append("<|im_end|>\n")
        elif role == "tool":
            if i == 0 or messages[i - 1]["role"] != "tool":
                out.append("<|im_start|>user")
            out.append("\n<tool_response>\n" + content + "\n</tool_response>")
            if i == last or messages[i + 1]["role"] != "tool":
                out.append("<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
        if enable_thinking is False:
            out.append("<think>\n\n</think>\n\n")
    return "".join(out)


def _m(role: str, content: str | None = None, **extra: Any) -> Message:
    return {"role": role, **({} if content is None else {"content": content}), **extra}


# Every branch of Qwen3's template: a system prompt first and later, multi-turn, think blocks in
# the content, reasoning fields (and a non-string one), empty and missing contents, tool turns
# (one and two in a row, first), tool responses sent as user text, unicode, trailing newlines.
PROBES: list[list[Message]] = [
    [_m("system", "Be brief."), _m("user", "Hi ☃ é"), _m("assistant", "Hello!\n")],
    [
        _m("user", "2+2?"),
        _m("assistant", "<think>\nadd\n</think>\n\n4"),
        _m("user", "3+3?"),
        _m("assistant", "\n<think>x</think>6\n"),
    ],
    [
        _m("user", "q"),
        _m("assistant", "a", reasoning_content="r1"),
        _m("user", "q2"),
        _m("assistant", "b", thinking="r2"),
        _m("assistant", "c", reasoning="\nr3\n"),
    ],
    [
        _m("user", "q"),
        _m("assistant", "a", reasoning_content=7),
        _m("system", "late system"),
        _m("user", ""),
        _m("assistant", ""),
    ],
    [
        _m("user", "weather?"),
        _m("assistant", "Searching.", reasoning_content="tool"),
        _m("tool", "sunny"),
        _m("tool", "warm"),
        _m("assistant", "Sunny and warm.", name="bot"),
    ],
    [
        _m("tool", "first"),
        _m("user", "<tool_response>x</tool_response>"),
        _m("assistant", "ok"),
        _m("user", "<tool_response>y"),
        _m("assistant"),
    ],
    [_m("assistant", "I start."), _m("user", "fine"), _m("assistant", "</think>only end")],
]


def choose_renderer(
    template: str, sample: Sequence[Sequence[Message]], *, enable_thinking: bool
) -> tuple[FastRenderer | None, str]:
    """(render_qwen3, "") if it renders like jinja on PROBES and `sample`, else (None, why)."""
    checked = 0
    for messages in [*PROBES, *sample]:
        for n in range(1, len(messages) + 1):
            for add_generation_prompt in (False, True):
                kwargs = dict(
                    add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking
                )
                fast = render_qwen3(messages[:n], **kwargs)
                if fast is None:
                    continue
                try:
                    slow = render_chat(template, messages[:n], **kwargs)
                except Exception as exc:  # the template refuses what the fast renderer renders
                    return None, f"jinja raised {type(exc).__name__} where render_qwen3 did not"
                if fast != slow:
                    at = common_prefix_len(fast, slow)
                    return None, f"renders differently at character {at}: {slow[at : at + 40]!r}"
                checked += 1
    return (render_qwen3, "") if checked else (None, "nothing to check it on")
