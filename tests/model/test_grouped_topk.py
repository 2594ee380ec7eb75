"""model/kinds/dflash2/grouped_topk.py's two-step top-k gives torch.topk's values, and its indices where no two
values tie, on rows built so that a wrong reduction fails: the top k all in one group, the top k
spread one per group, and the group maxima tied; purpose-made mutants of the algorithm fail on
the same rows. Also on a GPU at a DFlash2 chunk's real shape (2048 x 248320 bf16)."""

from __future__ import annotations

import pytest
import torch

from dflash_async.model.kinds.dflash2.grouped_topk import group_maxima, group_width, grouped_topk

# V = 1024, k = 4: 256- and 128-wide groups leave 4 and 8 groups, under 4k = 16, so the width
# is 64 (16 groups), which the rows below are built around
K, WIDTH, GROUPS = 4, 64, 16
VOCAB = WIDTH * GROUPS


def _clustered() -> torch.Tensor:
    """Row 0: the k largest in one group; row 1: one in each of k groups, each group's other
    values far below; row 2: random distinct values (a permutation)."""
    g = torch.Generator().manual_seed(0)
    z = torch.randperm(3 * VOCAB, generator=g).float().view(3, VOCAB) / 100  # distinct, < 31
    z[0, 5 * WIDTH : 5 * WIDTH + K] = torch.tensor([100.0, 99.0, 98.0, 97.0])
    z[1, torch.arange(K) * WIDTH * 3 + 3] = torch.tensor([90.0, 91.0, 92.0, 93.0])
    return z


def test_group_width_divides_the_vocabulary_and_leaves_enough_groups():
    assert group_width(248320, 16) == 256 and group_width(151936, 16) == 128
    assert group_width(VOCAB, K) == WIDTH
    assert group_width(1001, 4) is None  # odd: no width divides it
    assert group_width(64, 16) is None  # 4 groups of 16 < 4k


def test_grouped_topk_equals_torch_topk_on_adversarial_rows():
    z = _clustered()
    values, indices = grouped_topk(z, K)
    expected = z.topk(K, dim=-1)
    torch.testing.assert_close(values, expected.values, rtol=0, atol=0)
    assert torch.equal(indices, expected.indices)  # distinct values: the indices are determined
    assert torch.equal(z.gather(1, indices), values)


def test_grouped_topk_keeps_the_values_under_tied_group_maxima():
    # every group's maximum is 5.0 (tied) and 2k columns hold it: any k of them are a right
    # answer; torch.topk and grouped_topk may pick different ones, never other values
    z = torch.zeros(2, VOCAB)
    z[:, torch.arange(GROUPS) * WIDTH] = 5.0
    z[1, 3 * WIDTH + 1] = 6.0
    values, indices = grouped_topk(z, K)
    torch.testing.assert_close(values, z.topk(K, dim=-1).values, rtol=0, atol=0)
    assert torch.equal(z.gather(1, indices), values)
    assert all(len(set(row.tolist())) == K for row in indices)  # k distinct columns


def test_grouped_topk_falls_back_to_one_top_k_without_a_group_width():
    z = torch.randn(3, 1001, generator=torch.Generator().manual_seed(1))
    values, indices = grouped_topk(z, 4)
    expected = z.topk(4, dim=-1)
    assert torch.equal(values, expected.values) and torch.equal(indices, expected.indices)


def test_grouped_topk_with_maxima_given_equals_torch_topk_and_wrong_maxima_are_caught():
    """The maxima the CE pass hands in (group_max=) are used as given: exactly
    group_maxima(z, width) gives torch.topk's answer; maxima one group off (rolled) or of the
    wrong width (each pair of groups merged) do not, on the rows built for it."""
    z = _clustered()
    expected = z.topk(K, dim=-1)
    maxima = group_maxima(z, WIDTH)
    torch.testing.assert_close(maxima, z.view(3, GROUPS, WIDTH).amax(-1), rtol=0, atol=0)
    values, indices = grouped_topk(z, K, group_max=maxima)
    assert torch.equal(values, expected.values) and torch.equal(indices, expected.indices)
    rolled = maxima.roll(1, dims=-1)
    assert not torch.equal(grouped_topk(z, K, group_max=rolled)[0][0], expected.values[0])
    merged = group_maxima(z, 2 * WIDTH).repeat_interleave(2, dim=-1)  # [3, 16], wrong width
    assert not torch.equal(grouped_topk(z, K, group_max=merged)[0][1], expected.values[1])


def test_the_dflash2_reference_pass_is_the_ce_pass_and_the_group_maxima():
    from dflash_async.model.kinds.dflash2.objective import ce_grad_and_group_max
    from dflash_async.model.objective import ce_and_grad_from_logits

    z = _clustered()
    labels, weights = torch.tensor([3, 700, 5]), torch.tensor([1.0, 0.0, 0.5])
    *ce, maxima = ce_grad_and_group_max(z, labels, weights, group_width=WIDTH)
    for got, want in zip(ce, ce_and_grad_from_logits(z, labels, weights), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(maxima, group_maxima(z, WIDTH))


def _best_group_mutant(z: torch.Tensor, k: int, groups_kept: int, per_group: int):
    """The algorithm with `groups_kept` best groups and `per_group` members read from each."""
    rows, width = z.shape[0], WIDTH
    grouped = z.view(rows, -1, width)
    best = grouped.amax(-1).topk(groups_kept, dim=-1).indices
    members = grouped.gather(1, best[:, :, None].expand(rows, groups_kept, width))
    members = members.topk(per_group, dim=-1).values  # per_group < width drops members
    return members.flatten(1).topk(k, dim=-1).values


@pytest.mark.parametrize(
    ("groups_kept", "per_group", "fails_on_row"),
    [(K - 1, WIDTH, 1), (K, 1, 0)],
    ids=["one_group_too_few", "only_each_groups_maximum"],
)
def test_the_rows_catch_mutants(groups_kept, per_group, fails_on_row):
    z = _clustered()
    values = _best_group_mutant(z, K, groups_kept, per_group)
    expected = z.topk(K, dim=-1).values
    assert not torch.equal(values[fails_on_row], expected[fails_on_row])
    assert torch.equal(_best_group_mutant(z, K, K, WIDTH), expected)  # unmutated: passes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_topk_equals_torch_topk_at_a_dflash2_chunk_on_a_gpu():
    g = torch.Generator("cuda").manual_seed(0)
    for vocab in (248320, 151936):
        z = (torch.randn(2048, vocab, generator=g, device="cuda") * 3).to(torch.bfloat16)
        z[7, 1000:1016] = 40.0  # a block of 16 tied maxima in one group
        values, indices = grouped_topk(z, 16)
        expected = z.topk(16, dim=-1)
        # bf16 values tie often at this size: compare values (exact), and that the indices
        # point at those values
        assert torch.equal(values, expected.values)
        assert torch.equal(z.gather(1, indices), values)
