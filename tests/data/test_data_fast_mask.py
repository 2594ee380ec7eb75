"""fast_mask's one-rendering Qwen3 masks equal chat.py's render-and-diff masks, character for
character, and so token for token.

The reference is chat.assistant_char_mask, kept as it was: with jinja rendering Qwen3's template
(the plain path) and with render_qwen3. Conversations: written here (system prompts, multi-turn,
empty, missing and odd contents, unicode, thinking on and off, both loss_turns) plus random ones
drawn from pieces chosen to hit every rule of the closed form, on both sides of it. A mutant of
the masker (its "<|im_end|>" left unsupervised) must fail the same comparison.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from fixtures.chat_tokenizer import QWEN3_TEMPLATE, qwen3_like_tokenizer

from dflash_async.data import fast_mask
from dflash_async.data.chat import ChatMaskError, assistant_char_mask, supervised_turns
from dflash_async.data.fast_mask import qwen3_char_mask
from dflash_async.data.fast_template import choose_renderer, render_qwen3
from dflash_async.data.tokenization import EncodeOptions, encode_chunk, tokenize_batch
from dflash_async.data.tokenize_pool import finish_chunk
from dflash_async.targets.tiny import tiny_tokenizer

TEMPLATE = QWEN3_TEMPLATE.read_text()


def m(role: str, content: str | None = None, **extra) -> dict:
    return {"role": role, **({} if content is None else {"content": content}), **extra}


WRITTEN = [
    [m("user", "Bonjour, ça va? 日本語 🙂"), m("assistant", "Très bien.")],
    [
        m("system", "Be terse."),
        m("user", "a"),
        m("assistant", "b"),
        m("user", "c"),
        m("assistant", "d\n\n"),
    ],
    [m("user", ""), m("assistant", ""), m("user", "x"), m("assistant")],
    [m("assistant", "I open."), m("user", "ok"), m("assistant", "fine  ")],
    [m("user", "q"), m("assistant", "a"), m("user", "q2")],
    [m("user", "q"), m("assistant", "a"), m("assistant", "b")],  # closed form does not apply
    [m("user", "q"), m("assistant", "\nlead")],
    [m("user", "q"), m("assistant", "<b>bold</b>")],
    [m("user", "q"), m("assistant", "x</think>y"), m("user", "r"), m("assistant", "z")],
    [m("user", "q"), m("assistant", "a", reasoning_content="why")],
    [m("system", "s"), m("assistant", "a"), m("user", "q"), m("assistant", "b")],
    [m("user", "<tool_response>r</tool_response>"), m("assistant", "a")],
    [m("user", "q"), m("assistant", "a"), m("system", "late"), m("user", "q"), m("assistant", "b")],
    [m("user", "\n\n"), m("assistant", " \t"), m("user", "<|im_end|>"), m("assistant", "ok\n")],
]
PIECES = [
    "",
    "a",
    "hello world",
    " lead space",
    "\nlead",
    "\n\nlead2",
    "<x>",
    "<think>t</think>",
    "</think>",
    "trail\n",
    "trail \n\n",
    "日本語",
    "<|im_end|>",
    "x<think>",
    "tab\t",
]


def random_conversations(count: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        messages = [m("system", rng.choice(PIECES))] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 5)):
            if rng.random() < 0.9:
                messages.append(m("user", rng.choice(PIECES)))
            content = None if rng.random() < 0.05 else rng.choice(PIECES)
            messages.append(m("assistant", content))
        if rng.random() < 0.2:
            messages.append(m("user", rng.choice(PIECES)))
        out.append(messages)
    return out


def _reference(messages, jinja: bool, **kwargs):
    fast = None if jinja else render_qwen3
    try:
        return assistant_char_mask(TEMPLATE, messages, fast_render=fast, **kwargs)
    except ChatMaskError:
        return None


def mismatches(masker, conversations) -> tuple[int, int]:
    """(conversations the masker took and got wrong, conversations it took)."""
    wrong = taken = 0
    for messages in conversations:
        if not supervised_turns(messages, "all"):
            continue
        for enable_thinking in (False, True):
            for loss_turns in ("all", "last"):
                kwargs = dict(enable_thinking=enable_thinking, loss_turns=loss_turns)
                got = masker(messages, **kwargs)
                if got is None:
                    continue
                taken += 1
                for jinja in (False, True):
                    want = _reference(messages, jinja, **kwargs)
                    same = want is not None and got[0] == want[0]
                    wrong += not (same and np.array_equal(got[1], want[1]))
    return wrong, taken


def test_closed_form_masks_equal_render_and_diff():
    conversations = WRITTEN + random_conversations(400)
    wrong, taken = mismatches(qwen3_char_mask, conversations)
    assert wrong == 0
    assert taken > 200  # a good part of them take the closed form (of 1,656 cases)
    assert qwen3_char_mask(WRITTEN[5], enable_thinking=False) is None
    assert qwen3_char_mask(WRITTEN[6], enable_thinking=False) is None


def test_a_mutant_masker_fails_the_comparison(monkeypatch):
    def mutant(messages, **kwargs):
        found = qwen3_char_mask(messages, **kwargs)
        if found is None:
            return None
        full, mask = found
        mask = mask.copy()
        ends = [i for i in range(len(full)) if full.startswith(fast_mask.END, i)]
        mask[[e for e in ends if mask[e]]] = False  # "<|im_end|>" no longer supervised
        return full, mask

    assert mismatches(mutant, WRITTEN)[0] > 0


@pytest.mark.parametrize("enable_thinking", [False, True])
@pytest.mark.parametrize("which", ["qwen3_like", "tiny"])
def test_encode_chunk_gives_the_same_ids_and_masks(monkeypatch, enable_thinking, which):
    """Through tokenization, with Qwen3's template and with the tiny tokenizer's (Qwen3's too,
    so choose_renderer picks render_qwen3 for it): the closed form on, off, and jinja alone."""
    conversations = WRITTEN + random_conversations(60, seed=1)
    options = EncodeOptions(
        max_len=4096,
        enable_thinking=enable_thinking,
        loss_turns="all",
        too_long="truncate",
        block_size=1,
        role_map=(),
    )
    chunk = [(str(i), {"messages": c}) for i, c in enumerate(conversations)]
    if which == "tiny":
        tokenizer = tiny_tokenizer()
    else:
        tokenizer = qwen3_like_tokenizer()
        tokenizer.chat_template = TEMPLATE
    fast, why = choose_renderer(
        tokenizer.chat_template, conversations[:8], enable_thinking=enable_thinking
    )
    assert fast is render_qwen3, why
    got = encode_chunk(chunk, tokenizer, options, fast)
    monkeypatch.setattr("dflash_async.data.tokenization.qwen3_char_mask", lambda *a, **k: None)
    want = encode_chunk(chunk, tokenizer, options, fast)
    plain = encode_chunk(chunk, tokenizer, options, None)
    assert len(got.lengths) > 40
    for ref in (want, plain):
        assert np.array_equal(got.tokens, ref.tokens)
        assert np.array_equal(got.loss_mask, ref.loss_mask)
        assert np.array_equal(got.lengths, ref.lengths) and got.counts == ref.counts


class _RefusesSome:
    """A stand-in fast encoder: the tokenizer's own encodings, None for texts holding "é"."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode_batch(self, texts):
        return [None if "é" in t else tokenize_batch(self.tokenizer, [t])[0] for t in texts]


def test_texts_the_fast_encoder_refuses_are_finished_in_the_parent_in_record_order():
    """encode_chunk(defer=True) leaves refused renderings pending; finish_chunk encodes them
    with the parent's tokenizer and splices them back: the same chunk as encoding in place."""
    conversations = WRITTEN + random_conversations(60, seed=2)
    for k in range(0, len(conversations), 3):  # every third record refused, kept or filtered
        conversations[k] = [*conversations[k], m("user", "é"), m("assistant", "é " * (k % 5))]
    options = EncodeOptions(
        max_len=40,
        enable_thinking=False,
        loss_turns="all",
        too_long="truncate",
        block_size=2,
        role_map=(),
    )
    chunk = [(str(i), {"messages": c}) for i, c in enumerate(conversations)]
    tokenizer = qwen3_like_tokenizer()
    tokenizer.chat_template = TEMPLATE
    fast = _RefusesSome(tokenizer)
    deferred = encode_chunk(chunk, tokenizer, options, render_qwen3, fast, defer=True)
    assert len(deferred.pending) > 10
    got = finish_chunk(deferred, tokenizer, options)
    want = encode_chunk(chunk, tokenizer, options, render_qwen3, fast)
    assert not got.pending and not want.pending
    assert np.array_equal(got.tokens, want.tokens)
    assert np.array_equal(got.loss_mask, want.loss_mask)
    assert np.array_equal(got.lengths, want.lengths) and got.counts == want.counts


def test_a_worker_encodes_its_chunk_with_gc_off_and_turns_it_back_on(monkeypatch):
    import gc

    from dflash_async.data import tokenize_pool

    seen = []

    def fake_encode_chunk(*args, **kwargs):
        seen.append(gc.isenabled())
        raise RuntimeError("bad chunk")  # gc comes back on even when the chunk fails

    monkeypatch.setattr(tokenize_pool, "encode_chunk", fake_encode_chunk)
    monkeypatch.setitem(tokenize_pool._WORKER, "fast", (None, None))
    monkeypatch.setitem(tokenize_pool._WORKER, "tokenizer", None)
    monkeypatch.setitem(tokenize_pool._WORKER, "options", None)
    with pytest.raises(RuntimeError):
        tokenize_pool._encode_chunk_in_worker([], True)
    assert seen == [False] and gc.isenabled()
