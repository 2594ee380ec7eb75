"""Qwen3's assistant-only character mask from one rendering, where that is what chat.py finds.

chat.assistant_char_mask renders a conversation's template about 10 times (each supervised turn:
the prompt with the generation prompt, the conversation up to the turn, and twice more with a
sentinel because Qwen3 writes an empty think block only into a last turn) and diffs them. For the
conversations most chat data holds, what those renders and diffs give is known in closed form:

- roles system (first only), user and assistant; every assistant turn after the first message
  follows a user turn; user and system contents are strings, none starting with
  "<tool_response>"; assistant contents are non-empty strings, none starting with "<" or "\\n" (a
  prefix of "<think>" or a newline is shared with the generation prompt's think block, and an
  empty content's "<|im_end|>" is such a prefix)
  and none holding "<think>", "</think>" or chat.TURN_END_SENTINEL; no reasoning fields, tool
  calls or tools;
- then each turn renders as "<|im_start|>{role}\\n{content}<|im_end|>\\n", except a last
  assistant turn, which gets "<think>\\n\\n</think>\\n\\n" after its header; and assistant turn
  i's supervised characters are its content and its "<|im_end|>", plus that think block when it
  is the last turn and thinking is on (the generation prompt then ends at the header).

`qwen3_char_mask` returns None for any other conversation (chat.py then renders and diffs), and
checks its rendering against render_qwen3's. It is used only where the run's renderer is
render_qwen3, itself checked against jinja first (fast_template.choose_renderer); a test holds
its masks equal to chat.py's on varied conversations, and a mutant fails that test.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dflash_async.data.chat import TURN_END_SENTINEL, supervised_turns
from dflash_async.data.fast_template import REASONING_FIELDS, render_qwen3

Message = dict[str, Any]
THINK_BLOCK = "<think>\n\n</think>\n\n"
END = "<|im_end|>"
_BARRED = ("<think>", "</think>", TURN_END_SENTINEL)


def _simple(messages: Sequence[Message]) -> bool:
    """Whether every turn is of the closed-form kind (see the module docstring)."""
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if m.get("tool_calls") or any(m.get(k) is not None for k in REASONING_FIELDS):
            return False
        if role == "assistant":
            if i > 0 and messages[i - 1].get("role") != "user":
                return False
            if not isinstance(content, str) or content[:1] in ("", "<", "\n"):
                return False
            if any(b in content for b in _BARRED):
                return False
        elif role == "user" or (role == "system" and i == 0):
            if not isinstance(content, str) or content.startswith("<tool_response>"):
                return False
        else:
            return False
    return True


def qwen3_char_mask(
    messages: Sequence[Message],
    *,
    enable_thinking: bool,
    loss_turns: str = "all",
    tools: list[dict] | None = None,
) -> tuple[str, np.ndarray] | None:
    """(full rendering, its supervised-character mask) as chat.assistant_char_mask with
    render_qwen3 gives it, or None where the closed form does not apply."""
    if tools or not messages or not _simple(messages):
        return None
    last = len(messages) - 1
    pieces, spans, at = [], {}, 0  # spans: assistant index -> (start, end) of its supervised text
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and i == last:
            head = "<|im_start|>assistant\n"
            lo = at + len(head) + (0 if enable_thinking else len(THINK_BLOCK))
            piece = head + THINK_BLOCK + content + END + "\n"
        else:
            head = "<|im_start|>" + role + "\n"
            lo = at + len(head)
            piece = head + content + END + "\n"
        spans[i] = (lo, at + len(piece) - 1)
        pieces.append(piece)
        at += len(piece)
    full = "".join(pieces)
    if full != render_qwen3(messages, add_generation_prompt=False, enable_thinking=enable_thinking):
        return None
    mask = np.zeros(len(full), dtype=bool)
    for i in supervised_turns(messages, loss_turns):
        lo, hi = spans[i]
        mask[lo:hi] = True
    return full, mask
