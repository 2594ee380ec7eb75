"""Chat templates and assistant-only loss masks, found by rendering turn by turn and diffing.

The training sequence of a conversation is the chat template's rendering of the whole conversation
(`full`). Assistant turn i's supervised text is what the model generates for it: render the prompt
`messages[:i]` with the generation prompt (G) and the conversation up to turn i without it (B); the
generated text is B after their common prefix, up to B's end less trailing whitespace (generation
stops at the end-of-turn token; the newline a template writes after it is never generated). This
needs no `{% generation %}` markers, so it works with any template.

Templates may render a turn differently once later turns exist: Qwen3 keeps an assistant turn's
`<think>` block only after the last user query, so B is not always a prefix of `full`. Then turn
i's end in `full` is found with a sentinel appended to its content, and B's generated characters
are mapped into that one turn of `full` by an alignment (a dropped block is found in linear time;
anything else by difflib over lines, then characters): a character of `full` is supervised iff it
aligns to a generated character. Text a template dropped (an earlier turn's reasoning) is simply
not in the sequence. Tokens are supervised iff they contain a supervised character. Anything that
cannot be aligned raises ChatMaskError rather than guessing a mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from difflib import SequenceMatcher
from itertools import accumulate
from typing import Any

import numpy as np

from dflash_async.data.rendering import render_chat

# Appended to one assistant turn's content to find where that turn ends in the full rendering.
# Invisible separators around ASCII: no template strips or splits on it.
TURN_END_SENTINEL = "\u2063dflash-turn-end\u2063"

Message = dict[str, Any]


class ChatMaskError(ValueError):
    """A conversation that cannot be rendered and masked (no template, turns not locatable)."""


def chat_template_of(tokenizer: Any) -> str:
    """The tokenizer's chat template source; a dict of named templates gives its "default"."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    if not isinstance(template, str) or not template:
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise ChatMaskError(f"tokenizer {name!r} has no chat template; chat data needs one")
    return template


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix; binary search over C-speed slice compares."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def supervised_turns(messages: Sequence[Message], loss_turns: str) -> list[int]:
    """Indices of the assistant turns to supervise: all, or only the last ("last").

    An assistant message that opens the conversation is context: nothing prompted it.
    """
    if loss_turns not in ("all", "last"):
        raise ValueError(f"loss_turns={loss_turns!r} must be 'all' or 'last'")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]
    return turns[-1:] if loss_turns == "last" else turns


def assistant_char_mask(
    template: str,
    messages: Sequence[Message],
    *,
    enable_thinking: bool,
    loss_turns: str = "all",
    tools: list[dict] | None = None,
    fast_render: Any = None,
) -> tuple[str, np.ndarray]:
    """The full rendering and its per-character mask of supervised (assistant-generated) text.

    `fast_render` (fast_template.choose_renderer's pick) renders what it can, jinja the rest.
    """

    def render(msgs: Sequence[Message], add_generation_prompt: bool = False) -> str:
        if fast_render is not None:
            text = fast_render(
                msgs,
                add_generation_prompt=add_generation_prompt,
                enable_thinking=enable_thinking,
                tools=tools,
            )
            if text is not None:
                return text
        return render_chat(
            template,
            msgs,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            tools=tools,
        )

    full = render(messages)
    mask = np.zeros(len(full), dtype=bool)
    for i in supervised_turns(messages, loss_turns):
        upto = full if i == len(messages) - 1 else render(messages[: i + 1])
        start = common_prefix_len(render(messages[:i], True), upto)
        end = len(upto.rstrip())
        if start >= end:
            raise ChatMaskError(f"assistant turn {i} renders no generated text")
        if full.startswith(upto[:end]):  # the template rendered turn i the same in context
            mask[start:end] = True
        else:
            turn_end = _turn_end_in_full(render, messages, i, full)
            _mark_aligned(mask, full, upto, start, end, turn_end)
    return full, mask


def _with_sentinel(message: Message) -> Message:
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise ChatMaskError(f"assistant content must be a string, got {type(content).__name__}")
    return {**message, "content": (content or "") + TURN_END_SENTINEL}


def _turn_end_in_full(render: Any, messages: Sequence[Message], i: int, full: str) -> int:
    """Where assistant turn i's rendering (end-of-turn text included) ends inside `full`.

    Render once with a sentinel after turn i's content: what follows the sentinel is the turn's
    closing text (tool calls, end-of-turn token: read off the turn rendered alone) and then the
    rest of the conversation, which `full` must end with. Only text after the turn is compared,
    so a sentinel that changes the turn itself (a non-empty content adds a newline before tool
    calls in Qwen3) does no harm.
    """
    marked = [*messages[:i], _with_sentinel(messages[i]), *messages[i + 1 :]]
    marked_full = render(marked)
    if marked_full.count(TURN_END_SENTINEL) != 1:
        raise ChatMaskError(f"the chat template does not render assistant turn {i}'s content")
    marked_upto = render(marked[: i + 1])
    closing = marked_upto[marked_upto.index(TURN_END_SENTINEL) + len(TURN_END_SENTINEL) :]
    after = marked_full[marked_full.index(TURN_END_SENTINEL) + len(TURN_END_SENTINEL) :]
    rest = after[len(closing) :]
    if not after.startswith(closing) or not full.endswith(rest):
        raise ChatMaskError(f"assistant turn {i} ends differently in the full conversation")
    return len(full) - len(rest)


def _mark_aligned(
    mask: np.ndarray, full: str, upto: str, start: int, end: int, turn_end: int
) -> None:
    """Mark the characters of full[:turn_end] that align to upto[start:end] (one turn's diff).

    Skip the common prefix (up to the turn's start); if what remains of one rendering is a
    suffix of the other's, the template dropped one block (Qwen3's <think>) and the alignment is
    that suffix, found in linear time. Otherwise `matching_blocks` aligns the remainders.
    """
    # Past the turn's start a character-level prefix could pair the "<" of a dropped "<think>"
    # with the "<" of "<|im_end|>"; a suffix alone could pair a header's "\n" with a dropped
    # block's last "\n" once the prefix stopped in an earlier turn: hence both rules above.
    same = min(common_prefix_len(upto, full[:turn_end]), start)
    a, b = upto[same:], full[same:turn_end]  # the rest as rendered alone / in context
    if a.endswith(b) or b.endswith(a):
        shorter = min(len(a), len(b))
        blocks = [(len(a) - shorter, len(b) - shorter, shorter)]
    else:
        blocks = matching_blocks(a, b)
    before = int(mask.sum())
    for a_at, b_at, size in blocks:
        lo, hi = max(same + a_at, start), min(same + a_at + size, end)
        if lo < hi:
            shift = b_at - a_at  # full position = upto position + shift inside this block
            mask[lo + shift : hi + shift] = True
    if int(mask.sum()) == before:
        raise ChatMaskError(
            "an assistant turn's generated text does not appear in the conversation"
        )


def matching_blocks(a: str, b: str) -> list[tuple[int, int, int]]:
    """Character blocks (a_at, b_at, size) that a and b share, in order: lines first, then
    characters inside the gaps between matched lines.

    Lines keep a template's header ("<|im_start|>assistant\n") in one piece, so its newline
    pairs with the header's and not with a dropped block's; and difflib over a few hundred
    lines is fast where difflib over ~10k characters takes a second.
    """
    a_lines, b_lines = a.splitlines(keepends=True), b.splitlines(keepends=True)
    a_starts = [0, *accumulate(len(line) for line in a_lines)]
    b_starts = [0, *accumulate(len(line) for line in b_lines)]
    blocks, a_done, b_done = [], 0, 0  # lines aligned so far
    for i, j, n in SequenceMatcher(None, a_lines, b_lines, autojunk=False).get_matching_blocks():
        if i > a_done and j > b_done:  # unmatched lines on both sides: align their characters
            a_gap, b_gap = a_starts[a_done], b_starts[b_done]
            gap = SequenceMatcher(
                None, a[a_gap : a_starts[i]], b[b_gap : b_starts[j]], autojunk=False
            )
            blocks += [(a_gap + x, b_gap + y, k) for x, y, k in gap.get_matching_blocks() if k]
        if n:
            blocks.append((a_starts[i], b_starts[j], a_starts[i + n] - a_starts[i]))
        a_done, b_done = i + n, j + n
    return blocks


def token_mask(char_mask: np.ndarray, offsets: Sequence[tuple[int, int]]) -> np.ndarray:
    """Per-token mask: a token is supervised iff its characters include a supervised one.

    A token's characters are taken as [previous token's end, its own end): tokenizers that trim
    whitespace from offsets move it out of the span, and this gives it back to the token it
    belongs to.
    """
    if len(offsets) == 0:
        return np.zeros(0, dtype=bool)
    ends = np.maximum.accumulate(np.asarray(offsets, dtype=np.int64).reshape(-1, 2)[:, 1])
    starts = np.concatenate([[0], ends[:-1]])
    counts = np.concatenate([[0], np.cumsum(char_mask, dtype=np.int64)])
    return counts[ends] > counts[starts]


def encode_chat(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    enable_thinking: bool,
    loss_turns: str = "all",
    tools: list[dict] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (int32) of the rendered conversation and its assistant-only loss mask (bool)."""
    full, char_mask = assistant_char_mask(
        chat_template_of(tokenizer),
        messages,
        enable_thinking=enable_thinking,
        loss_turns=loss_turns,
        tools=tools,
    )
    encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoding["input_ids"], dtype=np.int32)
    return ids, token_mask(char_mask, encoding["offset_mapping"])
