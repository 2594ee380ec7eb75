"""Any anchor count trains on flex: the step pads the sampled anchors with invalid slots up to
whole 128-row tiles, which change no loss, gradient or count; a token budget off the tile is
refused (exit 2) before anything loads."""

from __future__ import annotations

import pytest
import torch
from conftest import TinySpec, make_objective, tiny_config, tiny_drafter
from conftest import tiny_target_weights as frozen_weights

from dflash_async.bench.drafter_bench import synthetic_pack
from dflash_async.errors import SettingsError
from dflash_async.model.attention_rule import flex_block_mask
from dflash_async.model.objective import anchor_multiple, pad_anchors, sample_anchors
from dflash_async.model.optim import LrSchedule, build_optimizer
from dflash_async.model.step import DrafterStep
from dflash_async.pipeline.specs import run_spec
from dflash_async.settings.env import load_settings

pytestmark = pytest.mark.timeout(60)
SPEC = TinySpec()


@pytest.mark.parametrize(("block_size", "multiple"), [(16, 8), (10, 64), (8, 16), (7, 128)])
def test_anchor_counts_are_padded_to_whole_tiles_of_block_rows(
    block_size: int, multiple: int
) -> None:
    assert anchor_multiple(block_size, 128) == multiple
    for count in (1, 6, 1366, 1024):
        positions = torch.arange(1, count + 1)
        padded = pad_anchors(_anchors(positions), multiple)
        n = padded.positions.shape[0]
        assert n * block_size % 128 == 0 and count <= n < count + multiple
        assert torch.equal(padded.positions[:count], positions)
        assert padded.valid[:count].all() and not padded.valid[count:].any()
        assert not padded.positions[count:].any()


def _anchors(positions: torch.Tensor):
    from dflash_async.model.objective import Anchors

    return Anchors(positions, torch.ones_like(positions, dtype=torch.bool))


def test_an_anchor_count_that_fills_whole_tiles_is_left_as_it_is() -> None:
    anchors = _anchors(torch.arange(1024))
    assert pad_anchors(anchors, 8) is anchors


def test_padded_anchors_change_no_step_sum_and_no_gradient() -> None:
    """Invalid slots hold no weight and are no block: the counts are those of the unpadded
    anchors exactly, the sums up to order (the padded rows add exact zeros; every row of
    attention and CE is computed on its own). The CE sum and the weight gradients sum over 128
    instead of 96 block rows, so only their summation order changes: in float64 at most 128 u = 128 * 2^-53 = 1.4e-14 of the sum
    of the terms' magnitudes; 1e-12 leaves a factor 70 for cancellation, while a padded slot
    counted as valid moves the gradients by O(1e-2)."""
    config = tiny_config(SPEC)
    embed, lm_head = frozen_weights(config, seed=0, dtype=torch.float64)
    pack = synthetic_pack(config, token_budget=128, num_docs=2, device="cpu")
    pack.features = pack.features.double()
    anchors = sample_anchors(pack.loss_mask, pack.doc_ids, 6, torch.Generator().manual_seed(0))
    results = []
    for given in (anchors, pad_anchors(anchors, anchor_multiple(config.block_size, 128))):
        drafter = tiny_drafter(config, seed=0, dtype=torch.float64)
        objective = make_objective(config, drafter, embed, lm_head, num_anchors=6, ce_chunk_size=16)
        sums = objective(pack, given)
        sums.ce_sum.backward()
        grads = torch.cat([p.grad.flatten() for p in drafter.parameters()])
        results.append((sums, grads))
    (unpadded, grads_u), (padded, grads_p) = results
    for name in unpadded._fields:  # counts exactly, the float sums up to summation order
        torch.testing.assert_close(
            getattr(padded, name), getattr(unpadded, name), rtol=1e-12, atol=0, msg=name
        )
    torch.testing.assert_close(grads_p, grads_u, rtol=1e-12, atol=1e-12)


def test_a_flex_step_pads_the_anchors_its_mask_needs() -> None:
    """6 anchors of 16 rows (Q = 96) are refused by the flex mask; the step's anchors are 8
    (Q = 128), the 2 extra invalid, and its mask builds."""
    config = tiny_config(TinySpec(block_size=16))
    drafter = tiny_drafter(config, seed=0, dtype=torch.float32)
    embed, lm_head = frozen_weights(config, seed=0, dtype=torch.float32)
    objective = make_objective(config, drafter, embed, lm_head, num_anchors=6, attention="flex")
    schedule = LrSchedule(peak_lr=1e-3, warmup_steps=1, total_steps=10, device="cpu")
    step = DrafterStep(
        objective,
        build_optimizer(drafter.parameters(), lr_tensor=schedule.lr, weight_decay=0.0),
        schedule,
        batch=synthetic_pack(config, token_budget=128, num_docs=2, device="cpu"),
        num_anchors=6,
        grad_clip=1.0,
    )
    anchors = step._anchors()
    assert anchors.positions.shape == (8,) and int(anchors.valid.sum()) == 6
    args = (step.batch.doc_ids, anchors.positions, anchors.valid, 16)
    flex_block_mask(*args)  # whole tiles: builds
    with pytest.raises(ValueError, match="multiples of 128"):
        flex_block_mask(step.batch.doc_ids, anchors.positions[:6], anchors.valid[:6], 16)


def _gpu_settings(**values: str):
    return load_settings({"DFLASH_ENV_FILE": "none", "DFLASH_TRAIN__MAX_STEPS": "1"} | values)


def test_any_anchor_count_passes_the_border_and_a_budget_off_the_tile_is_refused() -> None:
    ok = _gpu_settings(DFLASH_TRAIN__TOKEN_BUDGET="8192", DFLASH_TRAIN__NUM_ANCHORS="1366")
    assert run_spec(ok, visible_gpus=1).step.num_anchors == 1366  # sampled; padded in the step
    bad = _gpu_settings(DFLASH_TRAIN__TOKEN_BUDGET="8000", DFLASH_DATA__MAX_LEN="3000")
    with pytest.raises(SettingsError, match=r"TOKEN_BUDGET=8000: .* \(7936 or 8064\)"):
        run_spec(bad, visible_gpus=1)
    cpu = _gpu_settings(DFLASH_TRAIN__TOKEN_BUDGET="8000", DFLASH_DATA__MAX_LEN="3000")
    assert run_spec(cpu, visible_gpus=0).step.attention == "sdpa"  # no tile on the CPU
