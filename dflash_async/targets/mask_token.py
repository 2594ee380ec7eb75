"""The DFlash mask token of a target when DFLASH_DRAFTER__MASK_TOKEN_ID is not set: `mask_token`.

The drafter fills a block's unknown positions with one token id and learns its embedding's meaning
only from there, so the id must be one the data never contains and the target's vocabulary holds.
The rule, first match wins:
1. the tokenizer's own `mask_token` (the built-in tiny target's `<|mask|>`);
2. the first embedding row past the tokenizer (config vocab_size > len(tokenizer)): no text
   encodes to it; for Qwen3 this is 151669 and for Qwen3.5 248070, the ids z-lab's drafters use;
3. the highest-numbered added special token that the chat template never writes and that is
   not one of the tokenizer's named tokens (bos, eos, pad, unk...): a reserved token (Llama 3's
   `<|reserved_special_token_N|>`, gpt-oss's `<|reserved_N|>`), which rendered chats never hold.
No match: None (start-up then asks for DFLASH_DRAFTER__MASK_TOKEN_ID, exit 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MaskToken:
    id: int
    token: str | None  # its text (None: an embedding row no token text names)
    rule: str  # which rule of the module doc chose it


def _named_tokens(tokenizer: Any) -> set[str]:
    names = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token")
    return {str(t) for t in (getattr(tokenizer, n, None) for n in names) if t is not None}


def _reserved_special(tokenizer: Any) -> MaskToken | None:
    """Rule 3: the highest-numbered added special token the chat template never writes."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    named = _named_tokens(tokenizer)
    candidates = [
        (i, added.content)
        for i, added in tokenizer.added_tokens_decoder.items()
        if added.special and added.content not in named and added.content not in template
    ]
    if not candidates:
        return None
    i, content = max(candidates)
    return MaskToken(int(i), content, "an added special token unused by the chat template")


def mask_token(tokenizer: Any, *, vocab_size: int) -> MaskToken | None:
    """The mask token of a target with this tokenizer and embedding rows (see the module doc)."""
    if tokenizer.mask_token_id is not None and 0 <= tokenizer.mask_token_id < vocab_size:
        return MaskToken(int(tokenizer.mask_token_id), tokenizer.mask_token, "the mask_token")
    if len(tokenizer) < vocab_size:
        return MaskToken(len(tokenizer), None, "the first embedding row past the tokenizer")
    found = _reserved_special(tokenizer)
    return found if found is not None and found.id < vocab_size else None
