"""The held-out teacher-forced tau: decoded tau is the walk over a(p), not the mean of a(p).

On a prompt followed by the target's own greedy continuation, a(p) (the leading drafts of the
block at anchor p equal to the sequence) decides greedy speculative decoding completely: decoding
visits p0 = prompt length, then p + a(p) + 1. The first test decodes with a drafter whose
acceptance clusters (every draft right in one stretch, every draft wrong after it) and finds the
decoder's accepted lengths equal to the walk, step for step, and far below 1 + mean a(p) (the
step lines' tau_hat definition): the cause of tau_hat overstating decoded tau on real targets.
The second checks that `anchor_drafts`, one drafter pass over every anchor in the training
layout, drafts what the decoder's cached drafter drafts at each anchor, for every drafter kind.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import randomize_
from tiny_decoding import VOCAB, tiny_qwen3_target

from dflash_async.eval.speculative import (
    DFlashBlockDrafter,
    captured_layers,
    greedy_generate,
    speculative_decode,
)
from dflash_async.eval.teacher_forced import (
    accepted_runs,
    anchor_drafts,
    uniform_tau,
    walk_steps,
    walk_tau,
)
from dflash_async.model.drafter_config import drafter_config_from_target
from dflash_async.model.kinds import KINDS, kind_of
from dflash_async.targets.loading import frozen_embeddings

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# taps short of the tiny target's last layer (5), which a DSpark drafter reads for itself
B, MAX_NEW, LAYER_IDS = 8, 48, (1, 3, 4)
PROMPT = [5, 17, 60, 2, 33, 71]


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3_target()


@pytest.fixture(scope="module")
def sequence(target) -> list[int]:
    """PROMPT and the target's greedy continuation, B tokens past MAX_NEW (the last decode step
    drafts up to B-1 tokens past MAX_NEW: the gold must cover them)."""
    return PROMPT + greedy_generate(target, PROMPT, MAX_NEW + B, None).tokens


class ClusteredOracle:
    """Drafts the sequence's own tokens for anchors before `easy_until` (all B-1 accepted) and a
    wrong token at every slot from there on (none accepted): acceptance in two stretches."""

    def __init__(self, sequence: list[int], easy_until: int) -> None:
        self.sequence, self.easy_until = sequence, easy_until

    def extend_context(self, features: torch.Tensor, positions: torch.Tensor) -> None:
        pass

    def draft(self, anchor_token: int, anchor_position: int) -> torch.Tensor:
        gold = torch.tensor(self.sequence[anchor_position + 1 : anchor_position + B])
        return gold if anchor_position < self.easy_until else (gold + 1) % VOCAB


def test_decoded_tau_is_the_walk_over_teacher_forced_runs_not_their_mean(target, sequence):
    P = len(PROMPT)
    oracle = ClusteredOracle(sequence, easy_until=P + MAX_NEW // 2)
    decoded = speculative_decode(
        target, oracle, PROMPT, layer_ids=LAYER_IDS, max_new_tokens=MAX_NEW, eos_token_id=None
    )
    assert decoded.tokens == sequence[P : P + MAX_NEW]  # lossless: the oracle's drafts are gold
    # the anchors decoding can visit: P .. P+MAX_NEW-2 (it stops once MAX_NEW tokens are in)
    drafts = torch.stack([oracle.draft(0, p) for p in range(P, P + MAX_NEW - 1)])
    runs = accepted_runs(drafts, sequence, P)
    assert walk_steps(runs) == decoded.accepted_lengths
    tau = sum(decoded.accepted_lengths) / len(decoded.accepted_lengths)
    assert walk_tau(runs) == pytest.approx(tau)
    # 24 easy anchors (a = 7) then 23 hard (a = 0): the uniform mean is ~4.6, decoding needs 3
    # steps for the easy half and 23 for the hard one: 47 tokens / 26 steps ~ 1.8
    assert uniform_tau(runs) > 4.0 > 2.0 > tau


@pytest.mark.parametrize("kind", list(KINDS))
def test_anchor_drafts_equal_the_decoders_drafts_at_every_anchor(target, sequence, kind):
    config = drafter_config_from_target(
        target.config,
        num_hidden_layers=2,
        num_features=len(LAYER_IDS),
        block_size=B,
        mask_token_id=VOCAB - 1,
        target_layer_ids=LAYER_IDS,
    )
    config = replace(config, kind=kind)
    drafter = kind_of(kind).make_drafter(config)
    randomize_(drafter, seed=7)
    drafter = drafter.float().eval().requires_grad_(False)
    embed, lm_head = frozen_embeddings(target)
    P = len(PROMPT)
    drafts = anchor_drafts(target, drafter, embed, lm_head, sequence, P)
    assert drafts.shape == (len(sequence) - 1 - P, config.drafts_per_block)
    with captured_layers(target, LAYER_IDS) as outputs:
        target(input_ids=torch.tensor([sequence]))
        features = torch.cat([outputs[i][0] for i in LAYER_IDS], dim=-1)
    for p in range(P, len(sequence) - 1, 7):  # every 7th anchor: the cached decoder is slow
        one = DFlashBlockDrafter(drafter, config, embed, lm_head, max_context=len(sequence))
        one.extend_context(features[:p], torch.arange(p))
        assert one.draft(sequence[p], p).tolist() == drafts[p - P].tolist(), p
