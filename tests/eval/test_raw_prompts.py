"""A raw-text prompt (no chat template) is encoded as its tokenizer encodes text by default.

A base Llama's tokenizer puts BOS first and its model was trained on text that starts with it;
without BOS the model continues from an input it never saw, and the drafter trained on its BOS
sequences drafts for another distribution. The tokenizer here is built in memory: a word-level
vocabulary whose post-processor adds `<s>`, as a Llama (sentencepiece) tokenizer's does.
"""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from dflash_async.data.tokenization import raw_text_ids
from dflash_async.eval.harness import prompt_token_ids

VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "once": 3, "upon": 4, "a": 5, "time": 6}


def bos_tokenizer(*, with_bos: bool) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    if with_bos:
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 1)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def test_a_raw_prompt_starts_with_the_tokenizers_bos():
    ids = prompt_token_ids(
        bos_tokenizer(with_bos=True), {"prompt": "once upon a time"}, enable_thinking=False
    )
    assert ids == [1, 3, 4, 5, 6]


def test_a_tokenizer_without_a_bos_rule_gets_none():
    ids = prompt_token_ids(
        bos_tokenizer(with_bos=False), {"prompt": "once upon a time"}, enable_thinking=False
    )
    assert ids == [3, 4, 5, 6]


def test_eval_and_raw_text_encode_alike():
    tokenizer = bos_tokenizer(with_bos=True)
    text = "a time once"
    assert prompt_token_ids(tokenizer, {"prompt": text}, enable_thinking=False) == raw_text_ids(
        tokenizer, text
    )
