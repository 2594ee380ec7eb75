"""The placement decision and its cost model (pure functions, no loop, no devices).

H200 figures (BENCHMARKS.md, "Placement model"): target 21.0k tokens/s alone (41.1k on the
compiled packed path), drafter step 288.2 ms per 16384-row pack (56.85k tokens/s), both
co-located 19.9k; 1.05 B trainable drafter parameters; k*d = 5 x 4096 features.
"""

from __future__ import annotations

import pytest

from dflash_async.errors import SettingsError
from dflash_async.pipeline.placement import (
    GIB,
    Links,
    MemoryNeeds,
    PlacementError,
    StageRates,
    best_split,
    colocated_pair_rate,
    combine_seconds,
    decide,
    overlap_from,
    predict,
)

T = 16384
H200_TARGET, FAST_TARGET, H200_DRAFTER = 21.0e3, 41.1e3, T / 0.2882
LINKS = Links(grad_bytes=4 * 1.05e9, feature_bytes_per_token=5 * 4096 * 2)
H200 = 141e9  # bytes


def memory(target_gib: float, drafter_gib: float, device_bytes: float | None = H200):
    return MemoryNeeds(target_gib * GIB, 0, drafter_gib * GIB, 0, 0, device_bytes)


def test_the_default_overlap_reproduces_the_measured_colocated_h200_rate() -> None:
    rates = StageRates(H200_TARGET, H200_DRAFTER)
    # overlap 0.85 was fitted to this measurement: the model must give it back within 0.1%
    assert colocated_pair_rate(H200_TARGET, H200_DRAFTER, rates) == pytest.approx(19.9e3, rel=1e-3)
    assert overlap_from(19.9e3, H200_TARGET, H200_DRAFTER) == pytest.approx(0.85, abs=1e-3)


def test_overlap_from_inverts_the_colocated_rate() -> None:
    for overlap in (-0.5, 0.0, 0.3, 0.9):
        rates = StageRates(30e3, 9e3, overlap=overlap)
        rate = colocated_pair_rate(30e3, 9e3, rates)
        assert overlap_from(rate, 30e3, 9e3) == pytest.approx(overlap, abs=1e-9)


def test_the_gradient_combine_costs_a_ring_all_reduce_per_step() -> None:
    assert combine_seconds(1, LINKS) == 0.0
    # docs/GPU.md: 1.05 B fp32 gradients over 2 H200s in 12.1 ms
    assert combine_seconds(2, LINKS) == pytest.approx(12.1e-3, rel=0.01)
    assert combine_seconds(8, LINKS) == pytest.approx(12.1e-3 * 2 * 7 / 8, rel=0.01)


def test_the_best_split_balances_target_and_drafter_gpus() -> None:
    # a drafter costing 4.5x the target: of 8 GPUs, the n_t that maximises min(n_t t, n_d d)
    rates = StageRates(41.1e3, 41.1e3 / 4.5)
    targets, rate = best_split(rates, gpus=8, token_budget=T, links=LINKS)
    assert targets == 2 and rate == pytest.approx(min(2 * 41.1e3, 6 * 41.1e3 / 4.5), rel=0.05)
    assert best_split(rates, gpus=1, token_budget=T, links=LINKS) is None


def test_auto_picks_colocated_when_both_fit_and_says_why() -> None:
    rates = StageRates(H200_TARGET, H200_DRAFTER, source="measured")
    placement = decide(
        "auto", gpus=8, rates=rates, memory=memory(20, 40), token_budget=T, links=LINKS
    )
    assert (placement.layout, placement.num_targets, placement.num_drafters) == ("colocated", 8, 8)
    assert "fits" in placement.reason and "colocated predicts" in placement.reason
    assert placement.predicted["colocated"] > 1.3 * placement.predicted["split"]


def test_auto_picks_split_when_the_target_does_not_fit_beside_the_drafter_and_says_why() -> None:
    rates = StageRates(FAST_TARGET, H200_DRAFTER)
    # a 64 GiB target and a 70 GiB drafter: each fits an H200 alone, not both together
    placement = decide(
        "auto", gpus=8, rates=rates, memory=memory(64, 70), token_budget=T, links=LINKS
    )
    assert placement.layout == "split"
    assert "does not fit beside the drafter" in placement.reason
    assert "target 64.0 GiB + drafter 70.0 GiB" in placement.reason  # the numbers behind it
    assert placement.num_targets + placement.num_drafters == 8
    event = placement.event_fields(rates, memory(64, 70))
    assert event["layout"] == "split" and event["colocated_gib"] == 134.0


def test_auto_picks_split_when_the_stages_measurably_slow_each_other_down() -> None:
    # measured together slower than one after the other: overlap < 0
    rates = StageRates(30e3, 30e3, overlap=overlap_from(12e3, 30e3, 30e3))
    placement = decide(
        "auto", gpus=2, rates=rates, memory=memory(20, 40), token_budget=T, links=LINKS
    )
    assert placement.layout == "split" and "split predicts" in placement.reason


def test_one_device_that_cannot_hold_both_is_a_settings_error_naming_the_numbers() -> None:
    rates = StageRates(H200_TARGET, H200_DRAFTER)
    with pytest.raises(SettingsError, match=r"split needs at least 2 devices"):
        decide("auto", gpus=1, rates=rates, memory=memory(64, 70), token_budget=T, links=LINKS)
    with pytest.raises(PlacementError, match=r"neither layout fits: target 140.0 GiB"):
        decide("auto", gpus=2, rates=rates, memory=memory(140, 10), token_budget=T, links=LINKS)
    with pytest.raises(PlacementError, match=r"colocated does not fit"):
        decide("colocated", gpus=2, rates=rates, memory=memory(64, 70), token_budget=T, links=LINKS)


def test_cpu_memory_is_unbounded_and_a_requested_layout_is_kept() -> None:
    rates = StageRates(1e3, 1e3)
    for layout in ("colocated", "split"):
        placement = decide(
            layout, gpus=2, rates=rates, memory=memory(64, 70, None), token_budget=T, links=LINKS
        )
        assert placement.layout == layout and placement.reason == "requested"


def test_a_compute_bound_colocated_pair_cannot_exceed_the_mfu_ceiling() -> None:
    # 41.1k tokens/s at 13.1 GFLOP/token is MFU 0.69 alone; with the drafter's 9.2 GFLOP/token
    # the pair is bounded by 0.72 * 780e12 / 22.3e9 = 25.2k tokens/s, not the overlap's 37k
    rates = StageRates(
        FAST_TARGET, H200_DRAFTER, target_flops_per_token=13.1e9, drafter_flops_per_token=9.2e9
    )
    rate = predict(rates, gpus=1, token_budget=T, links=LINKS)["colocated"]
    assert rate == pytest.approx(0.72 * 780e12 / 22.3e9, rel=1e-6)


# The placement model table of BENCHMARKS.md (benchmarks/placement_model.py): one H200's rates,
# FLOPs per token of the Qwen3-8B target (34 layers) and drafter at the two anchor densities.
TARGET_FPT = 13.337e9
SPARSE = (T / 0.2882, 8.809e9)  # 1024 anchors per 16384 rows: measured step
DENSE = (21524.6, 23.265e9)  # 512 anchors per 3072 tokens: scaled by FLOPs


@pytest.mark.parametrize(
    ("target", "drafter", "gpus", "colocated", "split", "split_targets"),
    [
        (H200_TARGET, SPARSE, 1, 19_897, None, 0),
        (H200_TARGET, SPARSE, 8, 19_821, 13_640, 6),
        (H200_TARGET, DENSE, 4, 15_343, 10_500, 2),
        (FAST_TARGET, SPARSE, 2, 25_359, 20_550, 1),
        (FAST_TARGET, DENSE, 8, 15_343, 13_119, 3),
    ],
)
def test_the_auto_placement_event_agrees_with_the_benchmarks_model_table(
    target, drafter, gpus, colocated, split, split_targets
) -> None:
    rates = StageRates(
        target,
        drafter[0],
        source="measured",
        target_flops_per_token=TARGET_FPT,
        drafter_flops_per_token=drafter[1],
    )
    fits = memory(20, 40)
    placement = decide("auto", gpus=gpus, rates=rates, memory=fits, token_budget=T, links=LINKS)
    event = placement.event_fields(rates, fits)
    assert event["layout"] == "colocated"  # every row of the table: co-location wins
    # the table prints whole tokens/s; the FLOPs above are rounded to 4 digits: 0.05%
    assert event["colocated_tokens_per_s_per_gpu"] == pytest.approx(colocated, rel=5e-4)
    if split is None:
        assert event["split_tokens_per_s_per_gpu"] is None
    else:
        assert event["split_tokens_per_s_per_gpu"] == pytest.approx(split, rel=5e-4)
        assert best_split(rates, gpus=gpus, token_budget=T, links=LINKS)[0] == split_targets
