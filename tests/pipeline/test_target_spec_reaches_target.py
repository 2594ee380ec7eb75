"""Every `TargetSpec` field reaches the loaded target, unsplit (STAGES=1) and split (STAGES=2).

Each field of the spec, one at a time, is set to a value other than its default on the spec the
border built (pipeline/specs.py) and the node is started (pipeline/startup.py: the targets are
loaded, their forwards chosen and warmed up); the field's check reads what it should have
changed: the logged `target_weights_loaded` and `target_path_chosen` lines, the loaded runners,
or the arguments the forward chooser got (targets/forward.py: select_target_forward, for the
settings only the chooser reads on this CPU target). The fields are iterated from
`dataclasses.fields(TargetSpec)`, so a field added without a check here fails.

QUANTIZE=fp8 on the CPU: the decoder weights are quantized to e4m3 and dequantized for compute
(targets/quantized.py, the CPU reference path), logged as weight_format "quantized-at-load" with
a kernel reason that says dequantized, for each stage of a split target as for the whole one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from structlog.testing import capture_logs
from test_pipeline import run_settings
from tiny_run import tiny_inputs

from dflash_async.log import get_logger
from dflash_async.pipeline.distributed import RankInfo
from dflash_async.pipeline.shutdown import Shutdown
from dflash_async.pipeline.specs import run_spec
from dflash_async.pipeline.startup import prepare_node, start_node
from dflash_async.stages import chain, produce
from dflash_async.stages.produce import TargetSpec
from dflash_async.targets.loading import text_model
from dflash_async.targets.quantized import dequantize_fp8, quantize_fp8

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("single_thread")]

PATHS = {
    "unsplit": {
        "DFLASH_PIPELINE__TARGET_DEVICES": "cpu",
        "DFLASH_PIPELINE__DRAFTER_DEVICES": "cpu",
    },
    "split": {"DFLASH_PIPELINE__DEVICES": "cpu,cpu", "DFLASH_TARGET__STAGES": "2"},
}


@dataclasses.dataclass
class Loaded:
    """What a started node's target shows: one runner per stage (one when unsplit)."""

    spec: TargetSpec
    runners: list[produce.TargetRunner]
    stages: int  # stage workers per replica (1 unsplit)
    weights_loaded: list[dict]  # target_weights_loaded lines
    paths_chosen: list[dict]  # target_path_chosen lines
    chooser_calls: list[dict]  # the keywords select_target_forward got


def _all(lines: list[dict], key: str, expected: Any, count: int) -> None:
    assert len(lines) == count, lines
    assert [line[key] for line in lines] == [expected] * count, lines


def _cuda_dtype(t: Loaded) -> None:
    # The dtype on a GPU: these CPU targets must not take it (its GPU check is test_fp8_gpu's
    # target_path_chosen dtype); here, the CPU dtype still holds on every stage.
    _all(t.paths_chosen, "dtype", "float32", t.stages)


def _cpu_dtype(t: Loaded) -> None:
    _all(t.paths_chosen, "dtype", "bfloat16", t.stages)
    for runner in t.runners:
        assert runner.inputs.features.dtype is torch.bfloat16


def _token_budget(t: Loaded) -> None:
    assert [r.inputs.num_tokens for r in t.runners] == [t.spec.token_budget] * t.stages
    _all(t.chooser_calls, "token_budget", t.spec.token_budget, t.stages)


def _chooser(key: str) -> Callable[[Loaded], None]:
    def check(t: Loaded) -> None:  # read by the chooser alone on a packed dense CPU target
        _all(t.chooser_calls, key, getattr(t.spec, key), t.stages)

    return check


def _stages(t: Loaded) -> None:
    assert len(t.runners) == t.stages == t.spec.stages
    _all(t.paths_chosen, "device", "cpu", t.stages)


def _on_the_fp8_grid(weight: torch.Tensor) -> bool:
    """A weight QUANTIZE=fp8 loaded is a fixed point of quantizing (128x128 blocks, as the
    loader's) and dequantizing; an unquantized one is not (tiny target: off by up to 4e-3)."""
    fp8, scale = quantize_fp8(weight, block=(128, 128))
    return torch.equal(dequantize_fp8(fp8, scale, block=(128, 128), dtype=weight.dtype), weight)


def _quantize(t: Loaded) -> None:
    for runner in t.runners:  # the weights first: the log could say one thing, load another
        layers = text_model(runner.model).layers
        assert all(_on_the_fp8_grid(layer.self_attn.q_proj.weight) for layer in layers)
    _all(t.weights_loaded, "weight_format", "quantized-at-load", 1)
    _all(t.paths_chosen, "weight_format", "quantized-at-load", t.stages)
    assert all("dequantized" in line["kernel_reason"] for line in t.paths_chosen)


def _weights(t: Loaded) -> None:
    _all(t.weights_loaded, "weight_format", "random", 1)
    _all(t.paths_chosen, "weight_format", "random", t.stages)


def _seed(t: Loaded) -> None:
    _all(t.weights_loaded, "seed", 7, 1)


def _decode(t: Loaded) -> None:  # the loader's default draws the lm_head (decode=True)
    _all(t.weights_loaded, "lm_head_on_meta", True, 1)


def _cuda_graph(t: Loaded) -> None:  # asked for, and the reason says why not here
    assert len(t.paths_chosen) == t.stages
    assert all("not graphed" in line["reason"] for line in t.paths_chosen), t.paths_chosen


# field -> (the fields set, other than their defaults; the check). `stages` is the path's own.
REACHES: dict[str, tuple[dict[str, Any], Callable[[Loaded], None]]] = {
    "cuda_dtype": ({"cuda_dtype": torch.float16}, _cuda_dtype),
    "cpu_dtype": ({"cpu_dtype": torch.bfloat16}, _cpu_dtype),
    "token_budget": ({"token_budget": 128}, _token_budget),  # the run's is 256
    "max_batch_tokens": ({"max_batch_tokens": 96}, _chooser("max_batch_tokens")),
    "packed_hybrid": ({"packed_hybrid": False}, _chooser("packed_hybrid")),
    "stages": ({}, _stages),
    "quantize": ({"quantize": "fp8"}, _quantize),
    "weights": ({"weights": "random"}, _weights),
    "seed": ({"weights": "random", "seed": 7}, _seed),
    "decode": ({"weights": "random", "decode": False}, _decode),
    "cuda_graph": ({"cuda_graph": True}, _cuda_graph),
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return tiny_inputs(tmp_path_factory.mktemp("spec"))


async def _started(spec, monkeypatch: pytest.MonkeyPatch) -> Loaded:
    """Start the node of `spec` (prepare_node, start_node), read its targets, stop it."""
    calls: list[dict] = []
    for module in (produce, chain):  # wherever the stages call the chooser from
        real = getattr(module, "select_target_forward", None)
        if real is not None:

            def spy(model, layer_ids, *, _real=real, **kwargs):
                calls.append(kwargs)
                return _real(model, layer_ids, **kwargs)

            monkeypatch.setattr(module, "select_target_forward", spy)
    log, shutdown = get_logger("test"), Shutdown(hard_exit=False)
    with capture_logs() as events, anyio.fail_after(60):
        prepared = await prepare_node(spec, RankInfo(), log=log, shutdown=shutdown)
        async with AsyncExitStack() as stack:
            node = await start_node(stack, prepared, log=log, shutdown=shutdown)
            assert node is not None
            stages = len(node.chains[0].stages) if node.chains else 1
            runners = node.target_runners
    lines = lambda name: [e for e in events if e["event"] == name]  # noqa: E731
    return Loaded(
        spec.target,
        runners,
        stages,
        lines("target_weights_loaded"),
        lines("target_path_chosen"),
        calls,
    )


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the loop does not matter to loading
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(TargetSpec)])
async def test_every_target_spec_field_reaches_the_loaded_target(
    name: str,
    path: str,
    inputs: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert name in REACHES, f"TargetSpec.{name} has no check of where it takes effect"
    changes, check = REACHES[name]
    spec = run_spec(run_settings(inputs, tmp_path / "out", **PATHS[path]))
    defaults = {f.name: f.default for f in dataclasses.fields(TargetSpec)}
    for key, value in changes.items():  # never the value a dropped field would fall back to
        assert value != defaults[key], key
    spec = dataclasses.replace(spec, target=dataclasses.replace(spec.target, **changes))
    check(await _started(spec, monkeypatch))
