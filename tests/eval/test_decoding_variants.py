"""Decoding drafters with sliding-window or causal layers: each layer's mask rule as trained.

A block pass of the decoders (eval/speculative.py one sequence, eval/batched_decoding.py per row) must give
the same slot states as the training forward (the drafter on one packed document, the dense
mask of model/attention_rule.py) for the block at that anchor: in a sliding layer block slot k sees
only the context rows p with (anchor + k) - p < W (z-lab's per-slot window) and is causal inside
the block, `is_causal` overrides the in-block rule. The full bidirectional rule gives other states
here (asserted), and so does a decoder windowing every slot from the anchor (anchor - p < W, the
rule before z-lab's), so decoding with either is caught. Then speculative decoding with such
drafters (DFlash and DFlash2) is lossless and the batched decoder equals the reference, drafts
included.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import TinySpec, randomize_, tiny_config, tiny_target_weights
from tiny_decoding import VOCAB, tiny_qwen3_target

from dflash_async.eval import block_masks
from dflash_async.eval.batched_decoding import BatchedDecode, RowsBlockDrafter
from dflash_async.eval.lossless import check_lossless
from dflash_async.eval.sampling import Sampler, SamplingOptions
from dflash_async.eval.speculative import DFlashBlockDrafter, greedy_generate, speculative_decode
from dflash_async.model.attention_rule import dense_rule_mask, sdpa_attend
from dflash_async.model.drafter_config import drafter_config_from_target
from dflash_async.model.kinds import kind_of
from dflash_async.targets.loading import frozen_embeddings

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

B, T, ANCHORS = 5, 14, (3, 9, 13)  # every slot's window binds at anchor 13
VARIANTS = {
    "sliding_then_full": dict(
        layer_types=("sliding_attention", "full_attention"), sliding_window=4
    ),
    "sliding_window_1": dict(layer_types=("full_attention", "sliding_attention"), sliding_window=1),
    "sliding_window_above_B": dict(
        layer_types=("sliding_attention", "full_attention"), sliding_window=7
    ),
    "all_causal": dict(is_causal=True),
    "sliding_bidirectional": dict(
        layer_types=("sliding_attention", "sliding_attention"), sliding_window=3, is_causal=False
    ),
}


def tiny_variant(kind: str, variant: dict, seed: int = 5):
    """(fp64 drafter, its config, embed, lm_head, context features [T, k*d]) of one variant."""
    config = replace(tiny_config(TinySpec(block_size=B)), kind=kind, **variant)
    if kind == "dflash2":
        config = replace(config, conv_group_size=8, selector_rank=8, selector_top_k=4)
    drafter = kind_of(config.kind).make_drafter(config).double()
    randomize_(drafter, seed)
    drafter.eval().requires_grad_(False)
    embed, lm_head = tiny_target_weights(config, seed)
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(T, config.num_features * config.hidden_size, generator=gen).double()
    return drafter, config, embed, lm_head, features


def training_block_states(drafter, config, embed, features, anchor: int, token: int):
    """Slots 1..B-1 [B-1, d] of the block at `anchor` in the training forward (one document,
    rows 0..T-1, each layer's dense rule mask)."""
    doc = torch.zeros(T, dtype=torch.long)
    anchors, valid = torch.tensor([anchor]), torch.tensor([True])
    attends = [
        sdpa_attend(dense_rule_mask(doc, anchors, valid, B, rule=rule))
        for rule in config.attention_rules()
    ]
    block = torch.full((B,), config.mask_token_id)
    block[0] = token
    positions = anchor + torch.arange(B)
    hidden = drafter(embed[block], positions, features, torch.arange(T), attends)
    return hidden[1:]


def decoder_block_states(drafter, config, embed, lm_head, features, anchor: int, token: int):
    """(one-sequence states, batched row states) of the same block, context = rows < anchor."""
    one = DFlashBlockDrafter(drafter, config, embed, lm_head, max_context=32)
    one.extend_context(features[:anchor], torch.arange(anchor))
    rows = RowsBlockDrafter(drafter, config, embed, lm_head, batch=2, capacity=32)
    rows.extend_context(features[None].expand(2, -1, -1), torch.arange(T).expand(2, -1))
    both = rows.block_hidden(torch.tensor([token, token]), torch.tensor([anchor, anchor]))
    return one.block_hidden(token, anchor), both[0]


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANTS)
def test_a_decoding_block_pass_equals_the_training_forward_under_each_layers_rule(variant, kind):
    drafter, config, embed, lm_head, features = tiny_variant(kind, VARIANTS[variant])
    for anchor, token in zip(ANCHORS, (7, 40, 81), strict=True):
        expected = training_block_states(drafter, config, embed, features, anchor, token)
        one, row = decoder_block_states(drafter, config, embed, lm_head, features, anchor, token)
        torch.testing.assert_close(one, expected, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(row, expected, rtol=1e-9, atol=1e-9)
    # decoded under the full bidirectional rule (the same weights), the states differ
    full = replace(config, layer_types=(), sliding_window=None, is_causal=None)
    one, row = decoder_block_states(drafter, full, embed, lm_head, features, ANCHORS[2], 81)
    assert not torch.allclose(one, expected, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(row, expected, rtol=1e-6, atol=1e-6)


def _window_from_the_anchor(rule, anchors, *, slots, block_size):
    """The decoders' mask before z-lab's rule: every slot windowed from the anchor."""
    mask = ORIGINAL_RULE_MASK(
        replace(rule, window=None), anchors, slots=slots, block_size=block_size
    )
    if rule.window is not None:
        mask[..., :slots] &= anchors[:, None, None, None] - torch.arange(slots) < rule.window
    return mask


ORIGINAL_RULE_MASK = block_masks.rule_mask
SLIDING = [v for v in VARIANTS if "sliding" in v]


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("variant", SLIDING, ids=SLIDING)
def test_a_decoder_windowing_every_slot_from_the_anchor_differs_from_the_training_forward(
    variant, kind, monkeypatch
):
    drafter, config, embed, lm_head, features = tiny_variant(kind, VARIANTS[variant])
    anchor, token = ANCHORS[2], 81  # the window binds at 13
    expected = training_block_states(drafter, config, embed, features, anchor, token)
    monkeypatch.setattr(block_masks, "rule_mask", _window_from_the_anchor)
    one, row = decoder_block_states(drafter, config, embed, lm_head, features, anchor, token)
    assert not torch.allclose(one, expected, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(row, expected, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3_target()


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_sliding_drafters_decode_losslessly_and_batched_equals_the_reference(target, kind):
    config = drafter_config_from_target(
        target.config,
        num_hidden_layers=2,
        num_features=2,
        block_size=B,
        mask_token_id=VOCAB - 1,
        kind=kind,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=3,
        **(
            {"conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
            if kind == "dflash2"
            else {}
        ),
    )
    drafter = kind_of(config.kind).make_drafter(config)
    randomize_(drafter, 2)
    drafter.eval().requires_grad_(False)
    embed, lm_head = frozen_embeddings(target)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=gen).tolist() for n in (4, 13, 9)]
    reference = []
    for p in prompts:
        one = DFlashBlockDrafter(drafter, config, embed, lm_head, max_context=len(p) + 64)
        reference.append(
            speculative_decode(
                target,
                one,
                p,
                layer_ids=config.target_layer_ids,
                max_new_tokens=30,
                eos_token_id=None,
            )
        )
    rows = RowsBlockDrafter(drafter, config, embed, lm_head, batch=3, capacity=128)
    decode = BatchedDecode(
        target,
        prompts,
        draft=rows,
        layer_ids=config.target_layer_ids,
        max_new_tokens=30,
        eos=frozenset(),
        suppress=(),
    )
    while not decode.advance():
        pass
    batched = decode.results()
    assert [r.tokens for r in batched] == [r.tokens for r in reference]
    assert [r.accepted_lengths for r in batched] == [r.accepted_lengths for r in reference]
    for i, (p, spec) in enumerate(zip(prompts, reference, strict=True)):
        assert check_lossless(i, greedy_generate(target, p, 30, None), spec, 0.0) is None


def test_a_softcapped_dflash_drafters_sampled_q_is_the_softmax_of_its_transformed_logits():
    """T > 0: q is softmax(c * tanh(m * logits / c) / T), the distribution the drafter trained."""
    fields = dict(output_multiplier=3.0, final_logit_softcapping=0.5)
    drafter, config, embed, lm_head, features = tiny_variant("dflash", fields)
    one = DFlashBlockDrafter(drafter, config, embed, lm_head, max_context=32)
    one.extend_context(features[:9], torch.arange(9))
    sampler = Sampler.for_prompt(SamplingOptions(0.7), 0, torch.device("cpu"))
    _, q = one.draft_sampled(40, 9, sampler)
    z = 0.5 * torch.tanh(3.0 * one.block_logits(40, 9).double() / 0.5)
    torch.testing.assert_close(q.double(), (z / 0.7).softmax(-1), rtol=1e-6, atol=1e-9)
