"""sample_anchors (docs/DFLASH.md s.3): fixed slot count, candidates only, per-document proportional, uniform."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import pytest
import torch
from conftest import doc_loss_mask
from reference_dflash import candidate_anchors

from dflash_async.model.objective import Anchors, sample_anchors

pytestmark = pytest.mark.usefixtures("single_thread")


def pack(candidates_per_doc: list[int], num_pad: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_mask, doc_ids) where document i has exactly candidates_per_doc[i] candidates.

    Each document is [prompt, response of n+1 supervised tokens, prompt-like tail]: the response's
    first n tokens are the candidates (the last one's successor is still supervised).
    """
    mask, docs = [], []
    for doc, n in enumerate(candidates_per_doc):
        body = [False, False] + [True] * (n + 1 if n else 0) + [False]
        mask += body
        docs += [doc] * len(body)
    mask += [False] * num_pad
    docs += [-1] * num_pad
    return torch.tensor(mask), torch.tensor(docs)


def realistic_pack(doc_lengths: list[int], num_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt, response with a hole, as in conftest; the LAST document is supervised to its end."""
    mask, docs = [], []
    for doc, length in enumerate(doc_lengths):
        mask += doc_loss_mask(length)
        docs += [doc] * length
    mask[-1] = mask[-2] = True  # the row after the last real token is padding
    return torch.tensor(mask + [False] * num_pad), torch.tensor(docs + [-1] * num_pad)


def draw(loss_mask, doc_ids, num_anchors: int, seed: int) -> Anchors:
    gen = torch.Generator().manual_seed(seed)
    return sample_anchors(loss_mask, doc_ids, num_anchors, generator=gen)


def valid_positions(anchors: Anchors) -> list[int]:
    return anchors.positions[anchors.valid].tolist()


def check_layout(anchors: Anchors, num_anchors: int) -> None:
    """Shapes, dtypes, valid slots first and sorted strictly ascending, invalid positions 0."""
    assert anchors.positions.shape == (num_anchors,) and anchors.valid.shape == (num_anchors,)
    assert anchors.positions.dtype == torch.long and anchors.valid.dtype == torch.bool
    n = int(anchors.valid.sum())
    assert anchors.valid.tolist() == [True] * n + [False] * (num_anchors - n)
    pos = anchors.positions.tolist()
    assert all(x < y for x, y in pairwise(pos[:n])), pos[:n]
    assert pos[n:] == [0] * (num_anchors - n), pos[n:]


@pytest.mark.parametrize("num_anchors", [1, 5, 16, 40, 200])
def test_returns_exactly_num_anchors_slots_in_the_fixed_layout(num_anchors: int) -> None:
    loss_mask, doc_ids = realistic_pack([20, 35, 9, 50], num_pad=7)
    for seed in range(5):
        check_layout(draw(loss_mask, doc_ids, num_anchors, seed), num_anchors)


def test_every_valid_anchor_is_a_candidate_and_never_padding() -> None:
    loss_mask, doc_ids = realistic_pack([20, 35, 9, 50], num_pad=7)
    candidates = set(candidate_anchors(loss_mask, doc_ids))
    last_real = int((doc_ids >= 0).sum()) - 1
    assert last_real not in candidates  # its successor is padding
    for seed in range(20):
        chosen = valid_positions(draw(loss_mask, doc_ids, 30, seed))
        assert set(chosen) <= candidates, sorted(set(chosen) - candidates)
        assert all(doc_ids[p] >= 0 for p in chosen)


def test_the_last_row_of_a_document_is_never_a_candidate() -> None:
    """Fully supervised documents back to back: p+1 must be in p's document, not just supervised."""
    doc_ids = torch.tensor([0] * 6 + [1] * 4 + [2] * 5 + [-1] * 3)
    loss_mask = doc_ids >= 0
    last_rows = {5, 9, 14}
    for seed in range(10):
        chosen = valid_positions(draw(loss_mask, doc_ids, 14, seed))
        assert not set(chosen) & last_rows, chosen
        assert len(chosen) == 12  # 5 + 3 + 4 candidates, all taken


def test_enough_candidates_fill_every_slot_with_distinct_anchors() -> None:
    loss_mask, doc_ids = pack([30, 12, 25])
    for seed in range(10):
        anchors = draw(loss_mask, doc_ids, 40, seed)
        check_layout(anchors, 40)
        assert bool(anchors.valid.all()) and len(set(valid_positions(anchors))) == 40


def test_exactly_as_many_candidates_as_slots_takes_them_all() -> None:
    loss_mask, doc_ids = pack([7, 3, 6])
    anchors = draw(loss_mask, doc_ids, 16, seed=0)
    assert valid_positions(anchors) == candidate_anchors(loss_mask, doc_ids)


def test_too_few_candidates_takes_them_all_and_marks_the_rest_invalid() -> None:
    loss_mask, doc_ids = pack([4, 0, 6])
    for seed in range(5):
        anchors = draw(loss_mask, doc_ids, 25, seed)
        check_layout(anchors, 25)
        assert valid_positions(anchors) == candidate_anchors(loss_mask, doc_ids)


def test_no_candidates_gives_only_invalid_slots() -> None:
    loss_mask, doc_ids = pack([0, 0])
    anchors = draw(loss_mask, doc_ids, 8, seed=0)
    check_layout(anchors, 8)
    assert not bool(anchors.valid.any())


@pytest.mark.parametrize(
    "candidates_per_doc",
    [[30, 12, 25], [100, 3, 3, 40, 1, 9], [5, 5, 5, 5, 5, 5, 5], [60, 2]],
)
def test_documents_get_anchors_in_proportion_to_their_candidates(candidates_per_doc) -> None:
    """Counted per document (not per packed row): each within one of A * c_d / sum(c)."""
    loss_mask, doc_ids = pack(candidates_per_doc)
    total, num_anchors = sum(candidates_per_doc), 17
    for seed in range(30):
        counts = Counter(
            int(doc_ids[p]) for p in valid_positions(draw(loss_mask, doc_ids, 17, seed))
        )
        for doc, c in enumerate(candidates_per_doc):
            expected = num_anchors * c / total
            assert abs(counts[doc] - expected) <= 1, (seed, doc, counts[doc], expected)


def test_draws_are_uniform_over_candidates_and_over_subsets() -> None:
    """Two documents, 20 and 40 candidates, 12 slots: quotas 4 and 8.

    Marginals: every candidate has probability 1/5 per draw; Pearson chi-square over the 60 cells
    (59 dof: mean 59, sd ~11). Joint: a uniformly random q-subset of c candidates holds on average
    q(q-1)/c pairs of neighbours (0.6 + 1.4 = 2.0 here); a sampler that spreads anchors evenly in
    row order has the right marginals but almost no neighbour pairs.
    """
    loss_mask, doc_ids = pack([20, 40])
    candidates = candidate_anchors(loss_mask, doc_ids)
    draws, gen = 2000, torch.Generator().manual_seed(1234)
    hits, neighbour_pairs = Counter(), 0
    for _ in range(draws):
        chosen = valid_positions(sample_anchors(loss_mask, doc_ids, 12, generator=gen))
        hits.update(chosen)
        neighbour_pairs += len(set(chosen) & {p + 1 for p in chosen})
    expected = draws / 5
    chi2 = sum((hits[p] - expected) ** 2 / expected for p in candidates)
    assert set(hits) == set(candidates)
    assert chi2 < 59 + 6 * 11, f"chi-square {chi2:.1f}: not uniform over candidates"
    mean_pairs = neighbour_pairs / draws  # per-draw sd ~1.2, so the standard error is ~0.03
    assert abs(mean_pairs - 2.0) < 0.2, f"{mean_pairs:.3f} neighbour pairs per draw, expected 2.0"


def test_same_seed_gives_the_same_anchors_and_other_seeds_differ() -> None:
    loss_mask, doc_ids = realistic_pack([20, 35, 9, 50], num_pad=7)
    first = draw(loss_mask, doc_ids, 16, seed=42)
    again = draw(loss_mask, doc_ids, 16, seed=42)
    assert torch.equal(first.positions, again.positions) and torch.equal(first.valid, again.valid)
    others = {tuple(valid_positions(draw(loss_mask, doc_ids, 16, seed))) for seed in range(5)}
    assert len(others) > 1, "different seeds gave identical anchors"
