"""The memory model at long packs: it grows linearly with the token budget, the co-located
Qwen3-8B recipe fits one 80 GB card up to 131072-token packs with the long-context settings, and
a pack too long for the device stops the run at start-up (exit 2) naming DFLASH_TRAIN__TOKEN_BUDGET.

The drafter is Qwen3-8B's (5 layers, d 4096, 8 x 128 key heads, ffn 12288, vocab 151936, k = 5
features), the target's weights 16.4 GB (bf16). An H100's 79.6 GiB, 90% usable (HEADROOM).
"""

from __future__ import annotations

import pytest
import torch

from dflash_async.errors import SettingsError
from dflash_async.model.build import StepSpec
from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.pipeline.placement import (
    GIB,
    Links,
    PlacementError,
    StageRates,
    decide,
    placing,
)
from dflash_async.pipeline.placement.placing import PlacementSpec

QWEN3_8B_DRAFTER = DrafterConfig(
    hidden_size=4096,
    num_hidden_layers=5,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    vocab_size=151936,
    num_target_layers=36,
    target_layer_ids=(1, 9, 17, 25, 33),
    mask_token_id=151669,
    block_size=16,
)
WEIGHTS = 16.4e9
H100 = 79.6 * GIB
LINKS = Links(grad_bytes=4 * 1.05e9, feature_bytes_per_token=5 * 4096 * 2)


def _step(token_budget: int, num_anchors: int) -> StepSpec:
    return StepSpec(
        token_budget=token_budget,
        num_anchors=num_anchors,
        gamma=7.0,
        lr=6e-4,
        warmup_frac=0.04,
        weight_decay=0.0,
        grad_clip=1.0,
        seed=0,
        attention="flex",
        compile=True,
        compiled_update=True,
        cuda_graph=True,
        ce_chunk_size=2048,
        ce_kernel="auto",
        flex_backend="auto",
    )


def _needs(token_budget: int, num_anchors: int = 1024, num_slots: int = 2, device=H100):
    spec = PlacementSpec(
        layout="colocated",
        devices=(torch.device("cpu"),),
        given=None,
        num_slots=num_slots,
        target_batch_tokens=16384,
        calibration_packs=0,
    )
    step = _step(token_budget, num_anchors)
    cpu = torch.device("cpu")
    needs = placing.memory_needs(spec, step, QWEN3_8B_DRAFTER, "", cpu, weight_bytes=WEIGHTS)
    return type(needs)(**{**needs.__dict__, "device_bytes": device})


def _colocated(needs):
    rates = StageRates(20e3, 50e3)
    return decide(
        "colocated", gpus=1, rates=rates, memory=needs, token_budget=needs.token_budget, links=LINKS
    )


def test_the_memory_model_grows_linearly_with_the_pack_length() -> None:
    """Above the target's batch (16384), every length term is rows x bytes per row: doubling
    the pack from 32k to 64k adds what 64k to 128k adds half of; the weights, the drafter's
    state and its block rows do not move."""
    a, b, c = (_needs(t) for t in (32768, 65536, 131072))
    assert c.colocated - b.colocated == pytest.approx(2 * (b.colocated - a.colocated), rel=1e-9)
    assert a.drafter_state == c.drafter_state and a.target_weights == c.target_weights
    assert c.length_bytes - b.length_bytes == pytest.approx(2 * (b.length_bytes - a.length_bytes))


@pytest.mark.parametrize(
    ("token_budget", "num_anchors", "num_slots"),
    [(16384, 1024, 2), (32768, 1024, 2), (65536, 1024, 2), (131072, 512, 1)],
)
def test_the_long_context_settings_fit_one_80_gb_card(token_budget, num_anchors, num_slots):
    placement = _colocated(_needs(token_budget, num_anchors, num_slots))
    assert placement.layout == "colocated"


def test_a_pack_too_long_for_the_card_is_a_settings_error_naming_the_token_budget() -> None:
    needs = _needs(262144, 512, 1)
    with pytest.raises(PlacementError, match=r"DFLASH_TRAIN__TOKEN_BUDGET=262144 accounts for"):
        _colocated(needs)
    assert issubclass(PlacementError, SettingsError)  # exit 2
    with pytest.raises(PlacementError, match=r"split needs at least 2 devices.*TOKEN_BUDGET"):
        decide(
            "auto",
            gpus=1,
            rates=StageRates(20e3, 50e3),
            memory=needs,
            token_budget=262144,
            links=LINKS,
        )
