"""The tiktoken encoder of fast_bpe gives the HF tokenizer's ids and offsets, and is refused for any
tokenizer it is not shown to match."""

from __future__ import annotations

import json
import pickle
import random
import sys

import numpy as np
import pytest
from data_samples import EventLog, chat_records
from fast_bpe_reference import derived_merges, merges_match
from fixtures.chat_tokenizer import QWEN_SPLIT, qwen3_like_tokenizer, qwen_style_tokenizer
from tokenizers import Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from dflash_async.data import fast_bpe, tokenize_all
from dflash_async.data.fast_bpe import check_tokenizer
from dflash_async.data.samples import DataOptions, encode_options
from dflash_async.data.tokenization import encode_chunk, tokenize_batch
from dflash_async.data.tokenize_all import encode_all
from dflash_async.targets.tiny import tiny_tokenizer

pytest.importorskip("tiktoken")

TEXTS = [
    "",
    "Hello world! It's 4:30, isn't it? I'LL go; you'Re late. We've 12345 apples.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4",
    "a<|im_end|>b<|endoftext|><|im_start|><think>x</think>",  # added tokens inside words
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트",
    "emoji 🎉👍🏽🇩🇪 👨‍👩‍👧 and ✓ ★ … «quotes» — dash",
    "spaces     between\t\ttabs   \n\n\n   trailing   ",
    "crlf line\r\nnext\r\n\r\nlast\r",
    " " * 300 + "x" + "\n" * 50 + "\t" * 7,
    "digits 3.14159 2718281828 ١٢٣ ½ Ⅻ ⁴²",
    "café naïve résumé Ångström ſ's 'ſ ﬅ K",  # precomposed (NFC already) and case folds
    "x" * 3000 + " " + "ab" * 1000,
    "code: def f(x):\n    return {'a': [1, 2]}  # ok\n\tprint(x!r)",
    "mixed ASCII, العربية, עברית, русский, ελληνικά, हिन्दी, ไทย",
]
NOT_NFC = ["e\u0301 cafe\u0301", "A\u030a", "\u1100\u1161 Hangul jamo", "a\u0328\u0301"]


@pytest.fixture(scope="module")
def qwen_style():
    return qwen_style_tokenizer()


def hf(tokenizer, text: str) -> tuple[list, list]:
    want = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return want["input_ids"], [list(o) for o in want["offset_mapping"]]


def fuzz_texts(count: int, seed: int = 0) -> list[str]:
    """Random strings over characters where the split regex and byte-level BPE have edges."""
    pool = [*"aAzZ09 '\t\n\r.,!?-_/", "'s", "'LL", "  ", "\r\n", "<|im_end|>", "<think>"]
    pool += list("éüßſ中日한🎉👍🏽\u00a0\u2003\u3000١½ـ\u200d")
    rng = random.Random(seed)
    return ["".join(rng.choices(pool, k=rng.randrange(0, 60))) for _ in range(count)]


def test_byte_alphabet_is_gpt2s():
    assert fast_bpe.byte_decoder() == {c: b for b, c in bytes_to_unicode().items()}


@pytest.mark.parametrize("parallelism", ["false", "true"])  # worker processes' path: numpy
@pytest.mark.parametrize("name", ["qwen_style", "qwen3_like"])
def test_ids_and_offsets_equal_the_hf_tokenizers(name, parallelism, qwen_style, monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", parallelism)
    tokenizer = qwen_style if name == "qwen_style" else qwen3_like_tokenizer()
    fast, why = check_tokenizer(tokenizer.backend_tokenizer)
    assert fast is not None, why
    texts = TEXTS + fuzz_texts(400)
    encoded = fast.encode_batch(texts)
    assert all(e is not None for e in encoded)  # NFC already, no code point past U+30000
    for text, (ids, offsets) in zip(texts, encoded, strict=True):
        assert ids.dtype == np.int32 and offsets.dtype == np.int64
        assert (ids.tolist(), offsets.tolist()) == hf(tokenizer, text), repr(text)


def test_texts_nfc_would_change_go_to_hf_and_still_equal_it(qwen_style):
    fast, _ = check_tokenizer(qwen_style.backend_tokenizer)
    beyond = ["\U00030001 past the checked planes", "tag \U000e0041 and private \U000f0000"]
    texts = NOT_NFC + beyond + ["plain"]
    assert [e is None for e in fast.encode_batch(texts)] == [True] * 6 + [False]
    for text, (ids, offsets) in zip(texts, tokenize_batch(qwen_style, texts, fast), strict=True):
        assert (ids.tolist(), offsets.tolist()) == hf(qwen_style, text)


def test_the_encoder_pickles_as_its_tables_and_encodes_the_same_after(qwen_style):
    fast, _ = check_tokenizer(qwen_style.backend_tokenizer)
    fast.encode_batch(["warm"])  # builds the tiktoken object: it must not travel
    copy = pickle.loads(pickle.dumps(fast))
    assert copy._built is None and len(pickle.dumps(fast)) < 1_000_000
    for a, b in zip(fast.encode_batch(TEXTS), copy.encode_batch(TEXTS), strict=True):
        assert all(map(np.array_equal, a, b))


def mutant(tokenizer, change) -> Tokenizer:
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    change(spec)
    spec.pop("competing", None)
    return Tokenizer.from_str(json.dumps(spec))


def _competing(spec) -> tuple[int, int]:
    """The first merges i < j, (x, y) and (y, z), whose x+y+z is no token: their order decides
    whether "xyz" encodes as (xy, z) or (x, yz)."""
    merges, vocab = spec["model"]["merges"], spec["model"]["vocab"]
    for i, (x, y) in enumerate(merges):
        for j in range(i + 1, len(merges)):
            if merges[j][0] == y and x + y + merges[j][1] not in vocab:
                spec["competing"] = x + y + merges[j][1]
                return i, j
    raise AssertionError("no competing merges")


def _swap_merges(spec):  # HF loads it; the ranks no longer give its merges
    i, j = _competing(spec)
    merges = spec["model"]["merges"]
    merges[i], merges[j] = merges[j], merges[i]


def _swap_ids(spec):  # the same merges, the ids of the two competing tokens exchanged
    vocab = spec["model"]["vocab"]
    a, b = ("".join(spec["model"]["merges"][k]) for k in _competing(spec))
    vocab[a], vocab[b] = vocab[b], vocab[a]


def _split(regex):
    return lambda spec: spec["pre_tokenizer"]["pretokenizers"][0].update(pattern={"Regex": regex})


def _added(**flags):
    def change(spec):
        spec["added_tokens"][1].update(flags)

    return change


def _prefix_token(spec):
    spec["added_tokens"].append({**spec["added_tokens"][1], "id": 16384, "content": "<|im_"})


MUTANTS = {
    "merges reordered": (_swap_merges, "merge"),
    "ids of two tokens exchanged": (_swap_ids, "merge"),
    "merge removed": (lambda s: s["model"]["merges"].pop(), "merges where"),
    "NFKC normalizer": (lambda s: s.update(normalizer={"type": "NFKC"}), "normalizer"),
    "other split regex": (_split(QWEN_SPLIT.replace(r"\p{N}|", r"\p{N}{1,2}|")), "regex"),
    "Whitespace pre-tokenizer": (
        lambda s: s.update(pre_tokenizer={"type": "Whitespace"}),
        "pre-tokenizer",
    ),
    "prefix space": (
        lambda s: s["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True),
        "add_prefix_space",
    ),
    "added token lstrip": (_added(lstrip=True), "strips"),
    "added token normalized": (_added(normalized=True), "normalized"),
    "non-ASCII added token under NFC": (_added(content="<｜im_start｜>"), "not ASCII"),
    "added token a prefix of another": (_prefix_token, "prefix"),
    "offsets trimmed": (lambda s: s["post_processor"].update(trim_offsets=True), "offsets"),
    "BPE dropout": (lambda s: s["model"].update(dropout=0.1), "dropout"),
}


@pytest.mark.parametrize("name", MUTANTS)
def test_a_tokenizer_that_encodes_otherwise_is_refused(name, qwen_style):
    change, why_has = MUTANTS[name]
    fast, why = check_tokenizer(mutant(qwen_style, change))
    assert fast is None and why_has in why, why


@pytest.mark.parametrize("change", [_swap_merges, _swap_ids])
def test_tiktoken_from_a_refused_tokenizers_tables_would_encode_otherwise(change, qwen_style):
    """The refusals matter: built from such a tokenizer's tables anyway, tiktoken gives other ids
    than it on the word its two merges compete for."""
    spec = json.loads(qwen_style.backend_tokenizer.to_str())
    change(spec)
    other = mutant(qwen_style, change)
    added, _ = fast_bpe._added_tokens(spec["added_tokens"], normalized_ok=False)
    ranks, _ = fast_bpe._ranks(spec["model"]["vocab"], set(added.values()))
    unchecked = fast_bpe.FastBPE(ranks, QWEN_SPLIT, added, nfc=True)
    word = bytes(fast_bpe.byte_decoder()[c] for c in spec["competing"]).decode()
    (ids, _), *_ = unchecked.encode_batch([word])
    assert ids.tolist() != other.encode(word, add_special_tokens=False).ids


def test_word_level_and_missing_tiktoken_are_refused(monkeypatch, qwen_style):
    assert "not BPE" in check_tokenizer(tiny_tokenizer().backend_tokenizer)[1]
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import raises ImportError
    assert check_tokenizer(qwen_style.backend_tokenizer) == (None, "tiktoken is not installed")


def test_derived_merges_follow_rank_bpe_on_lower_ranks():
    ranks = {bytes([b]): b for b in range(256)} | {b"bc": 256, b"ab": 257, b"abc": 258}
    assert derived_merges(ranks) == ([(b"b", b"c"), (b"a", b"b"), (b"a", b"bc")], "")
    ranks |= {b"aa": 259, b"aaa": 260}  # a tie: the leftmost pair first, as tiktoken merges
    assert derived_merges(ranks)[0][-1] == (b"aa", b"a")
    ranks[b"xyz"] = 261  # no lower token joins any two of its bytes
    assert "not a merge" in derived_merges(ranks)[1]


def _byte_vocab(tokens: list[str]) -> dict[str, int]:
    alphabet = sorted(fast_bpe.byte_decoder(), key=fast_bpe.byte_decoder().get)
    return {c: i for i, c in enumerate(alphabet)} | {t: 256 + i for i, t in enumerate(tokens)}


def _verdicts(tokens: list[str], merges: list[tuple[str, str]]) -> tuple[bool, bool]:
    """(fast_bpe's merge check passes, the Python derivation matches) on one vocabulary."""
    vocab = _byte_vocab(tokens)
    decode = fast_bpe.byte_decoder()
    ranks = {bytes(decode[c] for c in t): r for t, r in vocab.items()}
    return fast_bpe._merges_why(vocab, set(), merges) == "", merges_match(ranks, merges)


def test_the_merge_check_refuses_merges_in_rank_order_that_rank_bpe_would_not_make():
    """ab < bc < abc: rank-BPE on "abc" merges ab first and ends in (ab, c); merges listing
    (a, bc) are in rank order with lower parts, so only running BPE tells them apart."""
    tokens = ["ab", "bc", "abc"]
    assert _verdicts(tokens, [("a", "b"), ("b", "c"), ("ab", "c")]) == (True, True)
    assert _verdicts(tokens, [("a", "b"), ("b", "c"), ("a", "bc")]) == (False, False)
    why = fast_bpe._merges_why(_byte_vocab(tokens), set(), [("a", "b"), ("b", "c"), ("a", "bc")])
    assert "'abc'" in why and "HF's merges" in why


def test_the_merge_check_agrees_with_deriving_the_merges_on_random_vocabularies():
    rng = random.Random(0)
    seen = {True: 0, False: 0}
    for _ in range(400):
        tokens, merges = [], []
        for _ in range(rng.randrange(1, 14)):  # joins of random earlier tokens over "abc"
            parts = list("abc") + tokens
            a, b = rng.choice(parts), rng.choice(parts)
            if a + b not in tokens and len(a + b) <= 6:
                tokens.append(a + b)
                merges.append((a, b))
        if rng.random() < 0.3 and len(tokens) > 1:  # ranks no longer in creation order
            i, j = rng.sample(range(len(tokens)), 2)
            tokens[i], tokens[j] = tokens[j], tokens[i]
            merges[i], merges[j] = merges[j], merges[i]
        fast, reference = _verdicts(tokens, merges)
        assert fast == reference, (tokens, merges)
        seen[fast] += 1
    assert min(seen.values()) > 40, seen  # both verdicts were tried often


def test_encode_chunk_with_the_fast_encoder_equals_the_hf_path(qwen_style):
    chats = [
        {"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": u}]}
        for t, u in zip(TEXTS[1:], NOT_NFC + TEXTS[::-1], strict=False)
    ]
    chunk = [(f"record {i}", c) for i, c in enumerate(chats)]
    options = encode_options(DataOptions(max_len=100_000, enable_thinking=False), block_size=1)
    fast, _ = check_tokenizer(qwen_style.backend_tokenizer)
    a = encode_chunk(chunk, qwen_style, options)
    b = encode_chunk(chunk, qwen_style, options, fast_encode=fast)
    assert a.counts == b.counts and len(a.lengths) > 5
    for name in ("tokens", "loss_mask", "lengths"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def run_encode_all(tokenizer, log) -> list:
    chats = chat_records()
    options = encode_options(DataOptions(max_len=100_000, enable_thinking=True), block_size=1)
    records = [(f"line {i}", c) for i, c in enumerate(chats * 3)]
    return list(encode_all(records, tokenizer, options, workers=1, chunk_records=4, log=log))


def test_a_run_logs_the_encoder_it_chose_and_why():
    log = EventLog()
    run_encode_all(qwen3_like_tokenizer(), log)
    chosen = log.of("tokenizer_chosen")
    assert chosen["encoder"] == "tiktoken" and chosen["checked_records"] > 0
    log = EventLog()
    run_encode_all(tiny_tokenizer(), log)
    assert log.of("tokenizer_chosen")["encoder"] == "huggingface"
    assert "not BPE" in log.of("tokenizer_chosen")["why"]


def test_an_encoder_that_differs_on_the_runs_first_records_is_not_used(monkeypatch, qwen_style):
    """Passing every static check is not enough: the run's first renderings must encode alike.
    Here the encoder of another tokenizer stands in for one that passed wrongly."""
    wrong, _ = check_tokenizer(qwen3_like_tokenizer().backend_tokenizer)
    monkeypatch.setattr(tokenize_all, "check_tokenizer", lambda backend: (wrong, ""))
    log = EventLog()
    got = run_encode_all(qwen_style, log)
    chosen = log.of("tokenizer_chosen")
    assert chosen["encoder"] == "huggingface" and "rendering 0" in chosen["why"]
    monkeypatch.setattr(tokenize_all, "check_tokenizer", lambda backend: (None, "off"))
    for a, b in zip(got, run_encode_all(qwen_style, EventLog()), strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)


def run_in_processes(tokenizer, log) -> list:
    chats = chat_records()
    options = encode_options(DataOptions(max_len=100_000, enable_thinking=True), block_size=1)
    records = [(f"line {i}", c) for i, c in enumerate(chats * 6)]  # 6 chunks for 2 processes
    return list(encode_all(records, tokenizer, options, workers=2, chunk_records=4, log=log))


def assert_same_chunks(got: list, want: list) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.counts == b.counts and a.bad == b.bad
        for name in ("tokens", "loss_mask", "lengths"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def test_processes_that_start_before_the_proof_give_what_one_process_gives(monkeypatch):
    """The proof runs while the tokenizer processes encode with the candidate tables: proven,
    their chunks equal one process's; refused (here by a stand-in proof that fails), every chunk
    is the HF tokenizer's, the ones encoded before the verdict included."""
    tokenizer = qwen3_like_tokenizer()
    log = EventLog()
    fast = run_in_processes(tokenizer, log)
    assert log.of("tokenizer_chosen")["encoder"] == "tiktoken"
    assert_same_chunks(fast, run_encode_all(tokenizer, EventLog()) * 2)
    monkeypatch.setattr(tokenize_all, "proof_why", lambda fast, spec: "refused for the test")
    log = EventLog()
    refused = run_in_processes(tokenizer, log)
    chosen = log.of("tokenizer_chosen")
    assert chosen["encoder"] == "huggingface" and chosen["why"] == "refused for the test"
    monkeypatch.setattr(tokenize_all, "check_tokenizer", lambda backend: (None, "off"))
    assert_same_chunks(refused, run_encode_all(tokenizer, EventLog()) * 2)
    # the HF path and the fast one agree here, so the test would pass without the redo: the
    # mutant encoder below differs, and its chunks must not reach the output
    wrong, _ = check_tokenizer(qwen_style_tokenizer().backend_tokenizer)
    monkeypatch.setattr(tokenize_all, "fast_candidate", lambda backend, **_: (wrong, "", {}))
    assert_same_chunks(
        run_in_processes(tokenizer, EventLog()), run_encode_all(tokenizer, EventLog()) * 2
    )
