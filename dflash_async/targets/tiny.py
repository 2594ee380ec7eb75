"""The built-in tiny target: a small random Qwen3, its tokenizer and a synthetic demo prompt set.

With no settings, `run` trains a drafter for this target on the CPU so a newcomer sees the whole
pipeline work without a download. Everything here is deterministic:
- the tokenizer is word-level (about 1.2k tokens: the demo prompts' words, numbers 0..999, letters
  and punctuation), built at first use from the word lists below, with Qwen3's special tokens,
  Qwen3's chat template (shipped in `assets/`) and a DFlash mask token `<|mask|>`;
- the target is a seeded random Qwen3 (6 layers, hidden 128) cached under a name that hashes its
  config, seed and tokenizer, so changing any of them builds a new folder instead of reusing a
  stale one;
- the prompts are templated from word lists (arithmetic, lists, copying, sorting, spelling...) and
  split into train and held-out sets by a hash of their first question, so the two never share
  a question.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config

from dflash_async.atomic import atomic_directory
from dflash_async.targets.loading import random_target

TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_THINK_TOKENS = ("<think>", "</think>")  # added tokens, not special (decoding keeps them)
TINY_MASK_TOKEN = "<|mask|>"  # the DFlash mask token: `tokenizer.mask_token_id`
TINY_UNK_TOKEN = "<|unk|>"
TINY_SEED = 0
HELDOUT_ONE_IN = 10  # a prompt is held out when the hash of its text is 0 modulo this
_ASSETS = Path(__file__).parent.parent / "assets"
_CHAT_TEMPLATE_ASSET = "qwen3_chat_template.jinja"

_FRUITS = (
    "apples",
    "bananas",
    "cherries",
    "grapes",
    "lemons",
    "mangoes",
    "oranges",
    "pears",
    "plums",
    "peaches",
)
_COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white", "pink", "brown")
_ANIMALS = ("cat", "dog", "horse", "rabbit", "tiger", "lion", "zebra", "mouse", "eagle", "shark")
_CITIES = ("Paris", "London", "Tokyo", "Cairo", "Lima", "Oslo", "Rome", "Delhi", "Sydney", "Boston")
_WORDS = (
    _FRUITS + _COLORS + _ANIMALS + ("river", "mountain", "garden", "window", "pencil", "rocket")
)
_CATEGORIES = {"fruits": _FRUITS, "colors": _COLORS, "animals": _ANIMALS, "cities": _CITIES}
_SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a concise assistant. Answer briefly.")


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice(("plus", "minus", "times"))
    return rng.choice(
        (
            f"What is {a} {op} {b}?",
            f"Compute {a} {op} {b}.",
            f"Calculate {a} {op} {b} step by step.",
        )
    )


def _list_items(rng: random.Random) -> str:
    name = rng.choice(sorted(_CATEGORIES))
    return f"List {rng.randint(2, 6)} {name}, one per line."


def _copy(rng: random.Random) -> str:
    return "Repeat after me: " + " ".join(rng.choices(_WORDS, k=rng.randint(3, 8))) + "."


def _reverse(rng: random.Random) -> str:
    return "Write these words in reverse order: " + ", ".join(rng.sample(_WORDS, rng.randint(3, 6)))


def _sort_numbers(rng: random.Random) -> str:
    numbers = ", ".join(str(rng.randint(0, 999)) for _ in range(rng.randint(3, 8)))
    return f"Sort these numbers from smallest to largest: {numbers}."


def _spell(rng: random.Random) -> str:
    word = rng.choice(_WORDS)
    return rng.choice(
        (f"Spell the word {word} letter by letter.", f"How many letters are in the word {word}?")
    )


def _describe(rng: random.Random) -> str:
    color, animal, city = rng.choice(_COLORS), rng.choice(_ANIMALS), rng.choice(_CITIES)
    return f"Write one sentence about a {color} {animal} that lives in {city}."


_TASKS: tuple[Callable[[random.Random], str], ...] = (
    _arithmetic,
    _list_items,
    _copy,
    _reverse,
    _sort_numbers,
    _spell,
    _describe,
)


def _is_heldout(text: str) -> bool:
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % HELDOUT_ONE_IN == 0


def _conversation(rng: random.Random, multi_turn: bool) -> dict[str, Any]:
    """One prompt in OpenAI messages form; assistant turns are empty (regenerate fills them)."""
    messages: list[dict[str, str]] = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)})
    messages.append({"role": "user", "content": rng.choice(_TASKS)(rng)})
    if rng.random() < 0.1:  # a few two-turn prompts exercise multi-turn regeneration
        follow_up = rng.choice(_TASKS)(rng)  # drawn either way: same stream for both settings
        if multi_turn:
            messages.append({"role": "assistant", "content": ""})
            messages.append({"role": "user", "content": follow_up})
    return {"messages": messages}


def _first_question(record: dict[str, Any]) -> str:
    return next(m["content"] for m in record["messages"] if m["role"] == "user")


def demo_prompts(
    n: int, seed: int = TINY_SEED, *, split: str = "train", multi_turn: bool = True
) -> list[dict[str, Any]]:
    """`n` distinct synthetic prompts ({"messages": [...]}) from `split` ("train" or "heldout").

    Deterministic in the arguments, and a longer list extends a shorter one. A prompt is held out
    iff the hash of its first user message says so, so the splits never share a first question,
    whatever `multi_turn`. About 10% of the prompts have two user turns (with an empty assistant
    turn between them) unless `multi_turn` is False (e.g. for evaluation).
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split={split!r} must be 'train' or 'heldout'")
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    rng = random.Random(f"dflash-demo-{seed}")
    prompts: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _ in range(200 * n + 1000):
        if len(prompts) == n:
            return prompts
        record = _conversation(rng, multi_turn)
        text = json.dumps(record["messages"])
        if text not in seen and _is_heldout(_first_question(record)) == (split == "heldout"):
            seen.add(text)
            prompts.append(record)
    raise ValueError(f"only {len(prompts)} distinct {split} prompts exist, asked for n={n}")


def _lexicon() -> list[str]:
    """Every word the demo prompts use, numbers 0..999 and single letters, sorted (deterministic)."""
    texts = ["system user assistant", *_SYSTEM_PROMPTS, *_WORDS, *_CITIES, *_CATEGORIES]
    texts += [" ".join(map(str, range(1000))), " ".join(string.ascii_letters + string.punctuation)]
    for split, n in (("train", 2000), ("heldout", 200)):  # covers every template's words
        texts += [m["content"] for r in demo_prompts(n, split=split) for m in r["messages"]]
    words = {w for text in texts for w, _ in _pre_tokenizer().pre_tokenize_str(text)}
    return sorted(words)


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Split on whitespace, then every punctuation character on its own."""
    return pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation("isolated")]
    )


def build_tiny_tokenizer() -> Tokenizer:
    """The tiny word-level tokenizer: lexicon words first, then the special and added tokens.

    Word-level, not BPE, on purpose: no token holds whitespace, so decoding any sequence of the
    target's (non-special) tokens and encoding the text again gives the same ids back. With a
    byte-level BPE a random target emits partial UTF-8 bytes and non-canonical merges, and the
    regenerated text would no longer be what the target produced, which the drafter must learn.
    """
    vocab = {word: i for i, word in enumerate([*_lexicon(), TINY_UNK_TOKEN])}  # WordLevel needs unk
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=TINY_UNK_TOKEN))
    tokenizer.pre_tokenizer = _pre_tokenizer()
    specials = [*TINY_SPECIAL_TOKENS, TINY_UNK_TOKEN, TINY_MASK_TOKEN]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in TINY_THINK_TOKENS]
    )
    return tokenizer


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny tokenizer with Qwen3's chat template; `mask_token_id` is the DFlash mask token."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_tiny_tokenizer(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=TINY_UNK_TOKEN,
        mask_token=TINY_MASK_TOKEN,
        extra_special_tokens=list(TINY_SPECIAL_TOKENS),  # as in Qwen3's tokenizer_config
    )
    # A plain path, not importlib.resources: the package is never zipped, and resources misreads
    # an editable install recorded as a namespace package.
    tokenizer.chat_template = (_ASSETS / _CHAT_TEMPLATE_ASSET).read_text(encoding="utf-8")
    return tokenizer


def tiny_target_config(tokenizer: PreTrainedTokenizerFast) -> Qwen3Config:
    """A Qwen3 small enough to generate a few hundred demo answers in seconds on two CPU cores.

    Untied embeddings (tied ones make a random target repeat its last token forever) and an init
    a little wider than HF's 0.02 give greedy answers that cycle through short patterns which
    depend on the prompt: learnable by the demo drafter in a minute, yet not a constant (measured
    on 64 demo prompts x 64 tokens: the previous token fixes the next one 57% of the time; 0.1
    gives 26%, which no small drafter learns quickly).
    """
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        initializer_range=0.03,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )


def tiny_generation_config(tokenizer: PreTrainedTokenizerFast) -> GenerationConfig:
    """Greedy, ending at <|im_end|>; every other special or added token is suppressed.

    A random target would otherwise emit <|im_start|>, </think> or <|mask|> mid-answer: the
    chat template then re-renders the answer differently from what the target generated.
    """
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    added = [*TINY_SPECIAL_TOKENS, TINY_UNK_TOKEN, TINY_MASK_TOKEN, *TINY_THINK_TOKENS]
    suppressed = sorted(i for i in tokenizer.convert_tokens_to_ids(added) if i != im_end)
    return GenerationConfig(
        eos_token_id=im_end,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        suppress_tokens=suppressed,
    )


def _tiny_key(tokenizer: PreTrainedTokenizerFast, config: Qwen3Config) -> str:
    """Names the cached folder: a new config, seed, tokenizer or library version: a new folder."""
    parts = [config.to_json_string(use_diff=False), tokenizer.backend_tokenizer.to_str()]
    parts += [tiny_generation_config(tokenizer).to_json_string(use_diff=False)]
    parts += [tokenizer.chat_template, str(TINY_SEED), torch.__version__, transformers.__version__]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=6).hexdigest()


def builtin_cache_dir() -> Path:
    """Where the built-in tiny target and the demo corpus are built once and reused."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "dflash_async"


def ensure_tiny_target(cache_dir: Path) -> Path:
    """Build the tiny target folder (weights, tokenizer) under `cache_dir` once, atomically; reuse.

    Building takes about a second on the CPU; a second call returns the same folder untouched.
    """
    tokenizer = tiny_tokenizer()
    config = tiny_target_config(tokenizer)
    folder = Path(cache_dir) / f"tiny-qwen3-{_tiny_key(tokenizer, config)}"
    if (folder / "config.json").is_file():
        return folder
    model = random_target(config, TINY_SEED)
    model.generation_config = tiny_generation_config(tokenizer)
    with atomic_directory(folder) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return folder
