"""Decoding with a DSpark drafter: anchor-first chain drafting through the Markov head.

The drafts (model/kinds/dspark/decoding.py, both decoders) are compared with an independent loop
written here from the contract: every block slot k = 0..B-1 drafts; slot k's logits are
lm_head(h_k) + W2 W1[prev], prev = the token drafted for slot k-1 (the anchor for slot 0); the
draft is their argmax. The Markov head is scaled up so that it really changes drafts (asserted).
Then the batched decoder equals the reference decoder on a DSpark drafter, both lossless against
plain greedy decoding, and at T > 0 slot 0's q is the contract's softmax.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import TinySpec, randomize_, tiny_config, tiny_target_weights
from tiny_decoding import VOCAB, tiny_qwen3_target

from dflash_async.eval.batched_decoding import BatchedDecode, RowsBlockDrafter
from dflash_async.eval.evaluation import confidence_by_slot, confidence_sums
from dflash_async.eval.lossless import check_lossless
from dflash_async.eval.sampling import Sampler, SamplingOptions
from dflash_async.eval.speculative import DFlashBlockDrafter, greedy_generate, speculative_decode
from dflash_async.model.drafter_config import drafter_config_from_target
from dflash_async.model.kinds.dspark import decoding
from dflash_async.model.kinds.dspark.drafter import DSparkDrafter
from dflash_async.targets.loading import frozen_embeddings

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

MARKOV_GAIN, MAX_NEW = 30.0, 40
ANCHORS = (5, 17, 60)  # one block per row, all at position 9


def strong_markov_(drafter: DSparkDrafter, seed: int) -> DSparkDrafter:
    randomize_(drafter, seed)
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.mul_(MARKOV_GAIN)
    return drafter.eval().requires_grad_(False)


def tiny_block_drafters(seed: int = 3):
    config = replace(tiny_config(TinySpec(block_size=5)), kind="dspark", markov_rank=8)
    drafter = strong_markov_(DSparkDrafter(config).double(), seed)
    embed, lm_head = tiny_target_weights(config, seed)
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(9, config.num_features * config.hidden_size, generator=gen).double()
    one = DFlashBlockDrafter(drafter, config, embed, lm_head, max_context=32)
    one.extend_context(features, torch.arange(9))
    rows = RowsBlockDrafter(drafter, config, embed, lm_head, batch=3, capacity=32)
    rows.extend_context(features.expand(3, -1, -1), torch.arange(9).expand(3, -1))
    return drafter, one, rows, lm_head


def contract_chain(drafter, hidden, lm_head, anchor: int) -> list[int]:
    w1 = drafter.markov_head.markov_w1.weight.double()
    w2 = drafter.markov_head.markov_w2.weight.double()
    prev, path = anchor, []
    for h in hidden.double():
        z = lm_head.double() @ h + w2 @ w1[prev]
        prev = int(z.argmax())
        path.append(prev)
    return path


def decoder_drafts(one, rows) -> list[list[int]]:
    single = [one.draft(a, 9).tolist() for a in ANCHORS]
    batched = rows.draft(torch.tensor(ANCHORS), torch.full((3,), 9)).tolist()
    assert single == batched
    return single


def test_every_slot_drafts_and_the_chain_equals_the_contract_loop():
    drafter, one, rows, lm_head = tiny_block_drafters()
    hidden = {a: one.block_hidden(a, 9) for a in ANCHORS}
    assert all(h.shape[0] == drafter.config.block_size for h in hidden.values())  # anchor-first
    expected = [contract_chain(drafter, hidden[a], lm_head, a) for a in ANCHORS]
    assert decoder_drafts(one, rows) == expected
    argmax = [one.block_logits(a, 9).argmax(-1).tolist() for a in ANCHORS]
    assert argmax != expected  # the Markov head changes drafts: the chain is what is compared


def _previous_is_always_the_anchor(drafter, hidden, unary, anchors):
    drafts = [
        decoding.chain_logits(drafter, hidden[:, i], unary[:, i], anchors).argmax(-1)
        for i in range(hidden.shape[1])
    ]
    return torch.stack(drafts, dim=1)


def _no_markov_bias(drafter, hidden, unary, previous):
    return unary.float()


@pytest.mark.parametrize(
    ("name", "mutant"),
    [("draft_tokens", _previous_is_always_the_anchor), ("chain_logits", _no_markov_bias)],
)
def test_each_chain_mutant_breaks_the_agreement(name, mutant, monkeypatch):
    drafter, one, rows, lm_head = tiny_block_drafters()
    expected = [contract_chain(drafter, one.block_hidden(a, 9), lm_head, a) for a in ANCHORS]
    monkeypatch.setattr(decoding, name, mutant)
    assert decoder_drafts(one, rows) != expected


def test_calibration_counts_each_slot_over_the_steps_that_reached_it():
    # 3 drafts per step; steps accepting 0, 2 and 3 drafts (accepted lengths 1, 3, 4)
    predicted = [[0.9, 0.5, 0.1], [0.8, 0.6, 0.2], [0.7, 0.4, 0.3]]
    sums = confidence_sums(predicted, [1, 3, 4])
    assert sums == [
        [3, pytest.approx(2.4), 2],  # slot 1: reached 3 times, accepted by the 2nd and 3rd
        [2, pytest.approx(1.0), 2],  # slot 2: reached by steps 2 and 3, both accepted it
        [2, pytest.approx(0.5), 1],  # slot 3: accepted by step 3 only
    ]
    rows = confidence_by_slot([{"confidence_sums": sums}, {"confidence_sums": sums}])
    assert rows[0] == {"slot": 1, "steps": 6, "predicted": pytest.approx(0.8), "measured": 2 / 3}


def test_a_sampled_first_slot_is_drawn_from_the_contracts_softmax():
    drafter, one, _, lm_head = tiny_block_drafters()
    sampler = Sampler.for_prompt(SamplingOptions(0.7), 0, torch.device("cpu"))
    drafts, q = one.draft_sampled(ANCHORS[1], 9, sampler)
    h = one.block_hidden(ANCHORS[1], 9)[0].double()
    w1 = drafter.markov_head.markov_w1.weight.double()
    w2 = drafter.markov_head.markov_w2.weight.double()
    expected = ((lm_head.double() @ h + w2 @ w1[ANCHORS[1]]) / 0.7).softmax(-1)
    # fp64 drafter, q made in fp32 by the sampler's filter: 1e-5 absolute is fp32 rounding
    torch.testing.assert_close(q[0].double(), expected, rtol=1e-4, atol=1e-5)
    assert drafts.shape == (drafter.config.block_size,)


def test_batched_dspark_decoding_equals_the_reference_and_both_are_lossless():
    target = tiny_qwen3_target()
    config = drafter_config_from_target(
        target.config,
        num_hidden_layers=2,
        num_features=2,
        block_size=5,
        mask_token_id=VOCAB - 1,
        kind="dspark",
        markov_rank=8,
    )
    drafter = strong_markov_(DSparkDrafter(config), seed=1)
    embed, lm_head = frozen_embeddings(target)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=gen).tolist() for n in (3, 11, 24, 7)]
    reference = []
    for p in prompts:
        one = DFlashBlockDrafter(drafter, config, embed, lm_head, max_context=len(p) + 64)
        reference.append(
            speculative_decode(
                target,
                one,
                p,
                layer_ids=config.target_layer_ids,
                max_new_tokens=MAX_NEW,
                eos_token_id=None,
            )
        )
    rows = RowsBlockDrafter(drafter, config, embed, lm_head, batch=4, capacity=128)
    decode = BatchedDecode(
        target,
        prompts,
        draft=rows,
        layer_ids=config.target_layer_ids,
        max_new_tokens=MAX_NEW,
        eos=frozenset(),
        suppress=(),
    )
    while not decode.advance():
        pass
    batched = decode.results()
    assert [r.tokens for r in batched] == [r.tokens for r in reference]
    assert [r.accepted_lengths for r in batched] == [r.accepted_lengths for r in reference]
    assert max(max(r.accepted_lengths) for r in reference) <= config.block_size + 1
    # the confidence head's predictions of every step's drafts, the same in both decoders
    for r, b in zip(reference, batched, strict=True):
        assert len(r.confidence) == len(r.accepted_lengths)
        torch.testing.assert_close(torch.tensor(b.confidence), torch.tensor(r.confidence))
    for i, (p, spec) in enumerate(zip(prompts, reference, strict=True)):
        assert check_lossless(i, greedy_generate(target, p, MAX_NEW, None), spec, 0.0) is None
