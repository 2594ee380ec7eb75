"""The target stage's start-up: the dtype setting, the chosen path and the preflight are logged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from dflash_async.stages.produce import TargetSpec, load_runner
from dflash_async.targets.loading import resolve_target_dtype
from dflash_async.targets.tiny import ensure_tiny_target


@pytest.mark.parametrize(
    ("name", "device", "dtype"),
    [
        ("auto", "cpu", torch.float32),
        ("auto", "cuda", torch.bfloat16),
        ("bfloat16", "cpu", torch.bfloat16),
        ("float32", "cuda", torch.float32),
    ],
)
def test_dtype_setting_names_the_target_dtype(name: str, device: str, dtype: torch.dtype) -> None:
    assert resolve_target_dtype(name, torch.device(device)) is dtype


def test_loading_a_runner_logs_its_path_and_warms_up_in_the_asked_dtype(tmp_path: Path) -> None:
    with capture_logs() as events:
        runner = load_runner(
            str(ensure_tiny_target(tmp_path)),
            spec=TargetSpec(
                cuda_dtype=torch.bfloat16,
                cpu_dtype=torch.bfloat16,
                token_budget=64,
                max_batch_tokens=64,
                packed_hybrid=True,
            ),
            device=torch.device("cpu"),
            layer_ids=(1, 3),
        )
    chosen = [e for e in events if e["event"] == "target_path_chosen"]
    assert (
        chosen and chosen[0]["target_path"] == "packed_dense" and chosen[0]["dtype"] == "bfloat16"
    )
    assert (chosen[0]["weight_format"], chosen[0]["kernel"]) == ("bf16", "bf16")
    assert any(e["event"] == "target_warmed_up" for e in events)
    assert next(runner.model.parameters()).dtype is torch.bfloat16
