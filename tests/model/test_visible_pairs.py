"""The step's visible-pair count (the FLOP accounting behind every MFU figure) equals the number
of True entries of the dense reference mask (model/attention.dense_rule_mask), per layer rule,
averaged over the layers: full, sliding-window (z-lab's per-slot window, W above and below B) and
causal layers, documents shorter and longer than the window, invalid anchors. Exact integers, so
the comparison is equality."""

from __future__ import annotations

import pytest
import torch

from dflash_async.model.attention_rule import FULL_RULE, dense_rule_mask
from dflash_async.model.layer_rules import AttentionRule
from dflash_async.model.step import visible_pairs

B = 4
DOC_IDS = torch.tensor([0] * 30 + [1] * 9 + [2] * 25)  # documents of 30, 9 and 25 rows
ANCHORS = torch.tensor([0, 5, 17, 29, 31, 36, 40, 52, 60, 3])
VALID = torch.tensor([True] * 9 + [False])  # the last anchor slot is padding


def _reference(rules) -> float:
    masks = [dense_rule_mask(DOC_IDS, ANCHORS, VALID, B, rule=r) for r in rules]
    return sum(int(m.sum()) for m in masks) / len(rules)


@pytest.mark.parametrize(
    "rules",
    [
        (FULL_RULE,),
        (AttentionRule(window=8),) * 3,
        (AttentionRule(window=8, causal=True), FULL_RULE),
        (AttentionRule(window=1), AttentionRule(causal=True), FULL_RULE),
        (AttentionRule(window=3), AttentionRule(window=2, causal=True)),
    ],
    ids=["full", "sliding", "sliding_causal+full", "window1+causal+full", "windows_below_B"],
)
def test_visible_pairs_equal_the_dense_masks_count_per_layer(rules) -> None:
    assert float(visible_pairs(DOC_IDS, ANCHORS, VALID, B, rules)) == _reference(rules)


def test_the_count_would_catch_a_window_one_row_too_wide() -> None:
    """The mutant: a window one row too wide ((anchor + k) - p <= W instead of < W)."""
    wide = _reference((AttentionRule(window=9),))
    assert float(visible_pairs(DOC_IDS, ANCHORS, VALID, B, (AttentionRule(window=8),))) != wide


def test_the_count_would_catch_the_window_taken_from_the_anchor_for_every_slot() -> None:
    """The old rule's count (every slot sees min(c, W - 1) context rows) differs."""
    rule = AttentionRule(window=8)
    starts = torch.tensor([0] * 30 + [30] * 9 + [39] * 25)  # each row's document start
    context = torch.where(VALID, ANCHORS - starts[ANCHORS], 0)
    old = B * int(context.clamp(max=rule.window - 1).sum()) + B * B * int(VALID.sum())
    assert float(visible_pairs(DOC_IDS, ANCHORS, VALID, B, (rule,))) == _reference((rule,)) != old
