"""An exact fast encoder for byte-level BPE tokenizers (GPT-2, Qwen2/Qwen3, Llama 3 kind):
tiktoken built in memory from the HF tokenizer's own vocabulary, split regex and added tokens,
used only where it is shown to give the HF tokenizer's ids and offsets.

Why it can be exact. tiktoken merges, within each regex piece, the adjacent pair whose joined bytes
form the lowest-ranked token (rank = HF id), leftmost first; HF merges the adjacent pair highest in
its merges list, leftmost first. `check_tokenizer` requires the pair that rank-BPE on each
multi-byte token's bytes with only lower ranks ends in to be that token's HF merge, and the HF
merges to be in id order (shown by running HF's BPE on every token: `_merges_why`). Then each
pair tiktoken merges is one HF has, with ranks in merge order (BPE inside a token's span runs as
on the token alone, so a merged pair is that token's derived pair), and both pick the same pair
at every step; every token is what BPE makes of its own bytes, so tiktoken's whole-piece lookup
and HF's `ignore_merges` change nothing.

The rest must match too, or `check_tokenizer` says why not and the HF tokenizer is used:
normalizer none or NFC; pre-tokenizer one Split(regex, isolated) + ByteLevel without prefix space
or regex, or ByteLevel with its GPT-2 regex, the regex one of KNOWN_PATTERNS; the two regex engines
(HF's Oniguruma, tiktoken's fancy-regex) agree on \\p{L}, \\p{N} and \\s for every code point below
CHECKED_BELOW and on the case-insensitive contractions; added tokens split as HF does (no strip,
no single-word, not normalized, ASCII under NFC, none a prefix of another); no offset trimming.
Per text, HF encodes what this does not: a text with a code point from CHECKED_BELOW up, a lone
surrogate, or one that HF's normalizer would change (tried on its non-ASCII runs only: NFC leaves
ASCII alone).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import pairwise
from typing import Any

import numpy as np

GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
# Named by the tokenizer that introduced them (GPT-2's, Qwen2's one digit per piece, Llama 3's up
# to three digits per piece), not by any target model_type: many families share each one.
KNOWN_PATTERNS = {  # regexes made of \p{L}, \p{N}, \s, \r\n and case-insensitive ASCII only
    "gpt2_split": GPT2_PATTERN,
    "qwen2_split": _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama3_split": _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
CHECKED_BELOW = 0x30000  # the code points the engine check covers: planes 0-2 (BMP, emoji, CJK)
_NON_ASCII_RUNS = re.compile(
    r"[\x00-\x7f]?[^\x00-\x7f]+"
)  # with the ASCII char before: it composes


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character standing for each byte, inverted."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = sorted(set(range(256)) - set(printable))  # stand-ins from U+0100 on, in byte order
    return {chr(c): b for c, b in zip(printable, printable, strict=True)} | {
        chr(256 + i): b for i, b in enumerate(others)
    }


@dataclass
class FastBPE:
    """tiktoken ranks, regex and added tokens of a checked tokenizer; pickles as that data (the
    tiktoken object is built again, in memory, in each process that encodes)."""

    ranks: dict[bytes, int]
    pattern: str
    added: dict[str, int]
    nfc: bool  # the HF normalizer is NFC (else none)
    _built: Any = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_built": None}

    def _parts(self) -> tuple[Any, np.ndarray, Any]:
        if self._built is None:
            import tiktoken
            from tokenizers import normalizers

            encoding = tiktoken.Encoding(  # from memory: never downloads anything
                "dflash_fast_bpe",
                pat_str=self.pattern,
                mergeable_ranks=self.ranks,
                special_tokens=self.added,
            )
            lengths = np.zeros(encoding.max_token_value + 1, dtype=np.int64)  # [V] bytes
            for token, rank in self.ranks.items():
                lengths[rank] = len(token)
            for text, rank in self.added.items():
                lengths[rank] = len(text.encode())
            self._built = (encoding, lengths, normalizers.NFC() if self.nfc else None)
        return self._built

    def encodable(self, text: str) -> bool:
        """Whether this encoder gives HF's result for `text` (else HF must encode it)."""
        if text.isascii():
            return True
        if max(text) >= chr(CHECKED_BELOW) or _has_surrogate(text):
            return False
        normalizer = self._parts()[2]
        if normalizer is None:
            return True
        runs = "\n".join(_NON_ASCII_RUNS.findall(text))  # NFC does not act across ASCII chars
        return normalizer.normalize_str(runs) == runs

    def encode_batch(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray] | None]:
        """(ids int32, offsets [L, 2] int64 in characters) as the HF tokenizer gives them with
        add_special_tokens=False, or None for a text that HF must encode."""
        encoding, lengths, _ = self._parts()
        ok = [i for i, text in enumerate(texts) if self.encodable(text)]
        out: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(texts)
        # One thread where TOKENIZERS_PARALLELISM=false (tokenizer worker processes), as HF:
        # there each text goes straight to a numpy array (encode_to_numpy: the same core call
        # as encode, no list of Python ints, no thread pool; encode_batch with one thread costs
        # ~1.9x the CPU on 2,500 real ShareGPT records, 1.80 against 0.96 CPU s).
        if os.environ.get("TOKENIZERS_PARALLELISM") == "false":
            for i in ok:
                ids = encoding.encode_to_numpy(texts[i], allowed_special="all")
                out[i] = _with_offsets(texts[i], ids.astype(np.int32), lengths)
            return out
        encoded = encoding.encode_batch(
            [texts[i] for i in ok], num_threads=_cpus(), allowed_special="all"
        )
        for i, ids in zip(ok, encoded, strict=True):
            out[i] = _with_offsets(texts[i], np.array(ids, dtype=np.int32), lengths)
        return out


def _with_offsets(text: str, ids: np.ndarray, lengths: np.ndarray) -> tuple:
    """Character offsets from token byte lengths: a token's span runs from the character holding
    its first byte to the end of the one holding its last (HF's spans for split characters)."""
    byte_ends = np.cumsum(lengths[ids])  # [L]
    byte_starts = byte_ends - lengths[ids]
    if text.isascii():
        return ids, np.stack([byte_starts, byte_ends], axis=1)
    utf8 = np.frombuffer(text.encode(), dtype=np.uint8)
    chars_through = np.cumsum((utf8 & 0xC0) != 0x80)  # [bytes] characters begun up to each byte
    starts = chars_through[byte_starts] - 1
    ends = chars_through[byte_ends - 1]
    return ids, np.stack([starts, ends], axis=1).astype(np.int64)


def _has_surrogate(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_tokenizer(backend: Any) -> tuple[FastBPE | None, str]:
    """(FastBPE, "") for a `tokenizers.Tokenizer` it encodes exactly, else (None, why not)."""
    fast, why, spec = fast_candidate(backend)
    if fast is not None and (why := proof_why(fast, spec)):
        return None, why
    return fast, why


def fast_candidate(
    backend: Any, *, spec_json: str | None = None
) -> tuple[FastBPE | None, str, dict]:
    """The tables of the encoder and the tokenizer's spec, if the cheap checks pass (~0.8 s for
    150k tokens); it may be used only once `proof_why(fast, spec)` is "" (~1.5 s more).
    `spec_json`: the backend's `to_str()` where the caller has it already."""
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        return None, "tiktoken is not installed", {}
    if backend.encode_special_tokens:
        return None, "special tokens are split as text (encode_special_tokens)", {}
    spec = json.loads(backend.to_str() if spec_json is None else spec_json)
    for check in (_normalizer_why, _post_processor_why, _model_why):
        if why := check(spec):
            return None, why, spec
    pattern, why = _pattern(spec.get("pre_tokenizer"))
    if pattern is None:
        return None, why, spec
    added, why = _added_tokens(spec["added_tokens"], normalized_ok=spec.get("normalizer") is None)
    if added is None:
        return None, why, spec
    ranks, why = _ranks(spec["model"]["vocab"], set(added.values()))
    if ranks is None:
        return None, why, spec
    return FastBPE(ranks, pattern, added, nfc=spec.get("normalizer") is not None), "", spec


def proof_why(fast: FastBPE, spec: dict) -> str:
    """ "" if the candidate's merges and regex engines are shown to act as HF's; else why not."""
    model = spec["model"]
    if why := _merges_why(model["vocab"], set(fast.added.values()), model["merges"]):
        return why
    return engines_disagree(fast.pattern)


def _normalizer_why(spec: dict) -> str:
    normalizer = spec.get("normalizer")
    if normalizer is None or normalizer == {"type": "NFC"}:
        return ""
    return f"normalizer {normalizer.get('type')} (only NFC or none are checked)"


def _post_processor_why(spec: dict) -> str:
    """Offsets as encoded: no trimming (template processors add nothing without special tokens)."""
    post = spec.get("post_processor")
    steps = post.get("processors", []) if post and post["type"] == "Sequence" else [post]
    for step in steps:
        if step is None or step["type"] == "TemplateProcessing":
            continue
        if step["type"] != "ByteLevel" or step.get("trim_offsets"):
            return f"post-processor {step['type']} changes offsets"
    return ""


def _model_why(spec: dict) -> str:
    model = spec["model"]
    if model["type"] != "BPE":
        return f"model {model['type']} (not BPE)"
    for name in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(name):
            return f"BPE {name}={model[name]!r}"
    return ""


def _pattern(pre: dict | None) -> tuple[str | None, str]:
    """The split regex of a byte-level pre-tokenizer, if it is one of KNOWN_PATTERNS."""
    steps = pre.get("pretokenizers", []) if pre and pre["type"] == "Sequence" else [pre]
    if len(steps) == 1 and steps[0] and steps[0]["type"] == "ByteLevel" and steps[0]["use_regex"]:
        pattern, level = GPT2_PATTERN, steps[0]
    elif (
        len(steps) == 2
        and steps[0]["type"] == "Split"
        and "Regex" in steps[0]["pattern"]
        and steps[0]["behavior"] == "Isolated"
        and not steps[0]["invert"]
        and steps[1]["type"] == "ByteLevel"
        and not steps[1]["use_regex"]
    ):
        pattern, level = steps[0]["pattern"]["Regex"], steps[1]
    else:
        kinds = [s["type"] if s else None for s in steps]
        return None, f"pre-tokenizer {kinds} (not one regex Split and ByteLevel)"
    if level["add_prefix_space"]:
        return None, "ByteLevel add_prefix_space"
    if pattern not in KNOWN_PATTERNS.values():
        return None, "split regex is not one of the checked ones (GPT-2, Qwen2, Llama 3)"
    return pattern, ""


def _added_tokens(tokens: list[dict], *, normalized_ok: bool) -> tuple[dict | None, str]:
    """{content: id} of tokens HF splits off as tiktoken splits special tokens off."""
    for token in tokens:
        if token["lstrip"] or token["rstrip"] or token["single_word"] or not token["content"]:
            return None, f"added token {token['content']!r} strips or matches single words"
        if not normalized_ok and (token["normalized"] or not token["content"].isascii()):
            # HF normalizes the text between added tokens; encodable() checks NFC on runs that
            # start at an ASCII character, which are those pieces only if the tokens are ASCII.
            return None, f"added token {token['content']!r} is normalized or not ASCII under NFC"
    contents = sorted(t["content"] for t in tokens)  # a prefix sorts right before its extensions
    for a, b in pairwise(contents):
        if b.startswith(a):  # HF takes the longest match, tiktoken the first alternative
            return None, f"added token {a!r} is a prefix of {b!r}"
    return {t["content"]: t["id"] for t in tokens}, ""


def _ranks(vocab: dict[str, int], added_ids: set[int]) -> tuple[dict | None, str]:
    """{token bytes: id} of the BPE vocabulary less the added tokens; every byte a token."""
    # byte-level characters -> their bytes as latin-1 characters; any other character is left
    # or made one latin-1 cannot encode, so a token holding it fails the encode below
    decode = byte_decoder()
    table = {c: 0x10FFFF for c in range(256)} | {ord(c): b for c, b in decode.items()}
    ranks = {}
    for text, rank in vocab.items():
        if rank in added_ids:
            continue
        try:
            ranks[text.translate(table).encode("latin-1")] = rank
        except UnicodeEncodeError:
            return None, f"vocabulary token {text!r} is not byte-level"
    if len({t for t in ranks if len(t) == 1}) != 256:
        return None, "not every byte is a token"
    return ranks, ""


def _merges_why(vocab: dict[str, int], added_ids: set[int], merges: list) -> str:
    """ "" if HF's merges are, pair for pair, what rank-BPE on each token's bytes with lower ranks
    ends in (the module's docstring); else why not. Shown without running rank-BPE in Python:
    (a) merge k joins two tokens of lower ids into the multi-byte token of the k-th lowest id (so
    merge order is rank order and every multi-byte token has one merge), and (b) HF's own BPE,
    whole-word lookup off, turns every multi-byte token's bytes into that one token. By induction
    on the id, HF's and rank-BPE's runs on a token then pick the same pair at every step: they
    can differ first only where rank-BPE merges a pair HF does not list into a token u of lower
    id than HF's pick, but u's span ran as u alone, which ends in u's listed merge. So the pair
    rank-BPE ends in is HF's merge; tests hold this equal to deriving the pairs directly."""
    from tokenizers import Tokenizer, models

    bpe = {text: rank for text, rank in vocab.items() if rank not in added_ids}
    words = sorted((r, t) for t, r in bpe.items() if len(t) > 1)  # byte-level: 1 char, 1 byte
    pairs = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
    if len(pairs) != len(words):
        return f"{len(pairs)} merges where the vocabulary's ranks give {len(words)}"
    for i, ((a, b), (rank, text)) in enumerate(zip(pairs, words, strict=True)):
        if a + b != text or not bpe.get(a, rank) < rank or not bpe.get(b, rank) < rank:
            return f"merge {i} is {(a, b)!r} where rank order gives a split of {text!r}"
    hf = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=False))
    got = hf.encode([t for _, t in words], is_pretokenized=True, add_special_tokens=False).ids
    if got != [r for r, _ in words]:
        first = next(t for (r, t) in words if hf.encode([t], is_pretokenized=True).ids != [r])
        return f"token {first!r} is not what HF's merges make of its bytes"
    return ""


@lru_cache(maxsize=8)
def engines_disagree(pattern: str) -> str:
    """ "" if HF's regex engine and tiktoken's class every code point below CHECKED_BELOW alike as
    \\p{L}, \\p{N} and \\s, and match the case-insensitive contractions alike; else where not.
    About 0.5 s on a 2-core machine, once per process and pattern."""
    import tiktoken
    from tokenizers import Regex, pre_tokenizers

    def matched_hf(regex: str, text: str) -> str:
        split = pre_tokenizers.Split(Regex(regex), behavior="removed", invert=True)
        return "".join(piece for piece, _ in split.pre_tokenize_str(text))

    def matched_tiktoken(regex: str, text: str) -> str:
        encoding = tiktoken.Encoding(
            "dflash_probe",
            pat_str=regex,
            special_tokens={},
            mergeable_ranks={bytes([b]): b for b in range(256)},
        )
        return encoding.decode_bytes(encoding.encode_ordinary(text)).decode()

    space = "".join(chr(c) for c in range(CHECKED_BELOW) if not 0xD800 <= c < 0xE000)
    for regex in (r"\p{L}", r"\p{N}", r"\s"):  # runs ("+"): the same characters, fewer pieces
        hf, fast = matched_hf(regex + "+", space), matched_tiktoken(regex + "+", space)
        if hf != fast:
            differ = sorted(set(hf) ^ set(fast))[:3]
            return f"the regex engines class {[hex(ord(c)) for c in differ]} differently as {regex}"
    if "(?i:" in pattern:
        letters = frozenset("stremvld")
        alike = [c for c in space if not letters.isdisjoint(c.casefold() + c.lower() + c.upper())]
        probe = " ".join("'" + a + b for a in alike for b in alike)
        if matched_hf(_CONTRACTIONS, probe) != matched_tiktoken(_CONTRACTIONS, probe):
            return "the regex engines match the case-insensitive contractions differently"
    return ""
