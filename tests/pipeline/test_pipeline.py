"""The pipeline's behaviour: failures cancel everything, data parallel equals one big step, a short
run writes a servable export and logs every step field. On asyncio and uvloop.

Runs use the built-in tiny target (a random 6-layer Qwen3) built into a temporary folder, a
pre-tokenized jsonl written here, 256-row packs and a 1-layer drafter: a run takes about a second.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from conftest import TinySpec, doc_loss_mask, make_objective, tiny_config, tiny_drafter
from conftest import tiny_target_weights as frozen_weights
from safetensors import safe_open
from structlog.testing import capture_logs
from tiny_run import tiny_env, tiny_inputs

from dflash_async.checkpoint.export import expected_weight_shapes, load_drafter_export
from dflash_async.data.packing import PackedBatch, layout_pack
from dflash_async.log import get_logger
from dflash_async.model.objective import Anchors, sample_anchors
from dflash_async.model.optim import LrSchedule, build_optimizer
from dflash_async.model.step import STATS, DrafterStep
from dflash_async.pipeline import run as pipeline
from dflash_async.pipeline.specs import run_spec
from dflash_async.pipeline.startup import drafter_config_for
from dflash_async.runtime.devices import DeviceWorker
from dflash_async.settings import Settings
from dflash_async.settings.env import load_settings
from dflash_async.stages import produce as target_stage
from dflash_async.stages.train import DrafterRunner, combine_gradients

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("single_thread")]
RUN_DEADLINE_S = 30  # a run here takes ~1 s; past this it hangs
STEP_FIELDS = (  # docs/DESIGN.md "Settings, logs and errors": every `step` event carries these
    "step",
    "epoch",
    "loss",
    "acc",
    "tau_hat",
    "lr",
    "grad_norm",
    "tokens",
    "tokens_per_s",
    "padding_frac",
    "target_busy",
    "drafter_busy",
    "slot_queue",
    "supply_tokens_per_s",
    "demand_tokens_per_s",
    "step_ms",
    "mem_gib",
)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The tiny target folder, its mask token and a 40-sample data file (~6 packs per epoch)."""
    return tiny_inputs(tmp_path_factory.mktemp("pipeline"))


def run_settings(inputs: dict[str, str], output_dir: Path, **env: str) -> Settings:
    """A tiny CPU run (tiny_run.tiny_env) of 5 steps without saves."""
    steps = {"DFLASH_TRAIN__MAX_STEPS": "5", "DFLASH_TRAIN__SAVE_EVERY": "0"}
    return load_settings(tiny_env(inputs, output_dir) | steps | env)


def worker_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("dflash-") and t.is_alive()]


def fail_on_call(n: int, fn: Callable[..., Any], message: str) -> Callable[..., Any]:
    """`fn`, except that its n-th call raises RuntimeError(message)."""
    calls = 0

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == n:
            raise RuntimeError(message)
        return fn(*args, **kwargs)

    return wrapper


# ---- 1. a failure anywhere cancels the whole run ---------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("where", ["target_worker", "drafter_worker"])
async def test_a_failing_worker_cancels_the_run_and_joins_every_thread(
    where: str, inputs: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = run_settings(inputs, tmp_path / "out", DFLASH_TRAIN__MAX_STEPS="1000")
    if where == "target_worker":  # the 6th pack's target forward fails, in the target thread
        failing = fail_on_call(6, target_stage.fill_slot, "target failed on pack 6")
        monkeypatch.setattr(target_stage, "fill_slot", failing)
    else:  # the 3rd optimizer update fails, in the drafter thread
        failing = fail_on_call(3, DrafterRunner.update, "drafter failed at step 3")
        monkeypatch.setattr(DrafterRunner, "update", failing)
    message = "target failed on pack 6" if where == "target_worker" else "drafter failed at step 3"
    with capture_logs() as events, pytest.raises(BaseExceptionGroup) as raised:
        with anyio.fail_after(RUN_DEADLINE_S):  # a hang fails here, not at the pytest timeout
            await pipeline.run(settings, get_logger("test"))
    assert raised.group_contains(RuntimeError, match=message, depth=None)
    assert worker_threads() == []
    assert [e for e in events if e["event"] == "step"]  # it failed mid-run, after some steps
    assert not (tmp_path / "out" / "drafter").exists()  # no export of a failed run


# ---- 2. data parallel: M drafters' step equals one drafter's step on all M packs -----------


async def run_recording_weights(settings, monkeypatch) -> tuple[list, list]:
    """Run; return (per step: every drafter's flat weights, the captured log events)."""
    weights: list[list[torch.Tensor]] = []
    real_train_steps = pipeline.train_steps

    async def train_steps_checked(runners, *args, on_step_end=None, **kwargs) -> int:
        async def after_step(step: int) -> None:
            # CPU jobs have finished when their await returns: reading from here is safe.
            weights.append([flat_weights(r.step) for r in runners])
            if on_step_end is not None:
                await on_step_end(step)

        return await real_train_steps(runners, *args, on_step_end=after_step, **kwargs)

    monkeypatch.setattr(pipeline, "train_steps", train_steps_checked)
    with capture_logs() as events, anyio.fail_after(RUN_DEADLINE_S):
        assert await pipeline.run(settings, get_logger("test")) == 0
    return weights, events


@pytest.mark.anyio
async def test_two_drafter_workers_hold_identical_weights_after_every_step(
    inputs: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = run_settings(inputs, tmp_path / "out", DFLASH_TRAIN__MAX_STEPS="3")
    # The settings refuse `cpu,cpu` (a repeated device); the pipeline itself runs two CPU
    # drafters fine, so the validated settings are copied with the device list replaced.
    two = settings.pipeline.model_copy(update={"drafter_devices": ("cpu", "cpu")})
    settings = settings.model_copy(update={"pipeline": two})
    weights, events = await run_recording_weights(settings, monkeypatch)
    assert len(weights) == 3
    for step in weights:
        assert len(step) == 2 and torch.equal(step[0], step[1])
    assert not torch.equal(weights[0][0], weights[-1][0])  # the weights did move
    steps = [e for e in events if e["event"] == "step"]
    assert [e["tokens"] > 256 for e in steps] == [True] * 3  # two packs' tokens per step


@dataclass
class FixedAnchors:
    """An anchor sampler that returns whatever anchors the test set for the next step."""

    anchors: Anchors | None = None

    def __call__(self, batch: PackedBatch) -> Anchors:
        assert self.anchors is not None
        return self.anchors


SPEC = TinySpec()
NUM_ANCHORS = 8  # per pack
PACK_ROWS = 64  # T of each of the two drafters; the single drafter gets 2T
LR = 1e-2


def make_step(rows: int, num_anchors: int, sampler: FixedAnchors) -> DrafterStep:
    """A float32 CPU drafter step with the seeded tiny drafter: every call starts identical."""
    config = tiny_config(SPEC)
    drafter = tiny_drafter(config, seed=0, dtype=torch.float32)
    embed, lm_head = frozen_weights(config, seed=0, dtype=torch.float32)
    objective = make_objective(
        config, drafter, embed, lm_head, num_anchors=num_anchors, ce_chunk_size=16
    )
    schedule = LrSchedule(peak_lr=LR, warmup_steps=1, total_steps=10, device="cpu")
    optimizer = build_optimizer(drafter.parameters(), lr_tensor=schedule.lr, weight_decay=0.01)
    width = config.num_features * config.hidden_size
    batch = PackedBatch.empty(rows, width, device=torch.device("cpu"), feature_dtype=torch.float32)
    return DrafterStep(
        objective,
        optimizer,
        schedule,
        batch=batch,
        num_anchors=num_anchors,
        grad_clip=0.5,
        anchor_sampler=sampler,
    )


def random_docs(seed: int, lengths: tuple[int, ...]) -> tuple[list, torch.Tensor]:
    """Documents (ids, loss mask) and their target features [n, k*d], seeded."""
    config = tiny_config(SPEC)
    gen = torch.Generator().manual_seed(seed)
    docs = [
        (torch.randint(0, config.vocab_size - 1, (n,), generator=gen), doc_loss_mask(n))
        for n in lengths
    ]
    width = config.num_features * config.hidden_size
    return docs, torch.randn(sum(lengths), width, generator=gen)


def laid_out(docs: list, features: torch.Tensor, rows: int) -> PackedBatch:
    padded = torch.zeros(rows, features.shape[1])
    padded[: features.shape[0]] = features
    return layout_pack(docs, rows, features=padded)


def flat_weights(step: DrafterStep) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in step.params])


def test_two_drafters_update_equals_one_drafter_on_both_packs_blocks() -> None:
    """docs/DFLASH.md s.4 via step.py: grads summed across drafters and divided by the GLOBAL weight
    sum give one drafter's update on both packs' blocks, laid end to end with the same anchors.
    In float32 (the step's flat grad buffer takes fp32 params only), so with tolerances."""
    pair_samplers = [FixedAnchors(), FixedAnchors()]
    pair = [make_step(PACK_ROWS, NUM_ANCHORS, s) for s in pair_samplers]
    # combine_gradients on CPU reads only .step (and .worker.stream, None): never started
    cpu = torch.device("cpu")
    runners = [DrafterRunner(DeviceWorker(cpu, name=f"d{i}"), s) for i, s in enumerate(pair)]
    single_sampler = FixedAnchors()
    single = make_step(2 * PACK_ROWS, 2 * NUM_ANCHORS, single_sampler)
    gen = torch.Generator().manual_seed(7)
    for step in range(3):  # AdamW's moments make later steps depend on earlier ones
        docs_a, feats_a = random_docs(100 + step, (20, 25, 11))
        docs_b, feats_b = random_docs(200 + step, (9, 10, 8, 12, 7))  # short: cut blocks
        packs = [laid_out(docs_a, feats_a, PACK_ROWS), laid_out(docs_b, feats_b, PACK_ROWS)]
        anchors = [sample_anchors(p.loss_mask, p.doc_ids, NUM_ANCHORS, gen) for p in packs]
        assert all(bool(a.valid.all()) for a in anchors)
        for s, sampler, pack, a in zip(pair, pair_samplers, packs, anchors, strict=True):
            s.batch.copy_(pack)
            sampler.anchors = a
            s.phase_a()
        local_weight_sums = [s.stats[STATS.index("weight_sum")].item() for s in pair]
        assert local_weight_sums[0] != local_weight_sums[1]  # a per-drafter mean would differ
        combine_gradients(runners, [None, None])
        # one pack: A's documents then B's (doc ids continue), B's anchors shifted by A's tokens
        both = laid_out(docs_a + docs_b, torch.cat([feats_a, feats_b]), 2 * PACK_ROWS)
        single.batch.copy_(both)
        shift = feats_a.shape[0]
        single_sampler.anchors = Anchors(
            torch.cat([anchors[0].positions, anchors[1].positions + shift]),
            torch.cat([anchors[0].valid, anchors[1].valid]),
        )
        single.phase_a()
        assert torch.equal(pair[0].flat_grad, pair[1].flat_grad)
        torch.testing.assert_close(pair[0].flat_grad, single.flat_grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pair[0].stats, single.stats, rtol=1e-6, atol=0)
        for s in (*pair, single):
            s.phase_b()
        assert torch.equal(flat_weights(pair[0]), flat_weights(pair[1]))
        torch.testing.assert_close(pair[0].grad_norm, single.grad_norm, rtol=1e-5, atol=0)
        # AdamW divides by sqrt(v) + 1e-8: where a gradient is ~1e-8, fp32 rounding of the two
        # summation orders moves an update by up to ~1e-3 lr; a wrong normalisation moves many by ~lr
        torch.testing.assert_close(
            flat_weights(pair[0]), flat_weights(single), rtol=0, atol=LR * 1e-3
        )


# ---- 5. a short run end to end -------------------------------------------------------------


@pytest.mark.anyio
async def test_short_run_exports_a_servable_drafter_and_logs_every_step_field(
    inputs: dict[str, str], tmp_path: Path
) -> None:
    settings = run_settings(inputs, tmp_path / "out")
    with capture_logs() as events, anyio.fail_after(RUN_DEADLINE_S):
        assert await pipeline.run(settings, get_logger("test")) == 0
    names = [e["event"] for e in events]
    for event in ("run_started", "drafter_ready", "startup_completed", "train_completed"):
        assert event in names
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4, 5]
    for event in steps:
        missing = [f for f in STEP_FIELDS if f not in event]
        assert missing == [], f"step {event.get('step')} lacks {missing}"
        assert all(math.isfinite(event[f]) for f in STEP_FIELDS)
        assert "mfu" not in event and "node_mfu" not in event  # a CPU run: no GPU peak to share
        assert event["loss"] > 0 and event["lr"] > 0 and 0 < event["tokens"] <= 256
    export = tmp_path / "out" / "drafter"
    (saved,) = [e for e in events if e["event"] == "export_written"]
    assert saved["path"] == str(export) and saved["step"] == 5
    config = drafter_config_for(run_spec(settings).drafter, inputs["target"], builtin=False)
    assert_servable_export(export, config)


def assert_servable_export(folder: Path, expected_config: Any) -> None:
    """docs/DFLASH.md s.7: Qwen3 config.json with the DFlash fields, flat bf16 tensors."""
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"]["mask_token_id"] == expected_config.mask_token_id
    assert cfg["dflash_config"]["target_layer_ids"] == list(expected_config.target_layer_ids)
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 6
    assert cfg["tie_word_embeddings"] is False
    assert cfg["layer_types"] == ["full_attention"] * expected_config.num_hidden_layers
    config, tensors = load_drafter_export(folder)
    assert config == expected_config
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        stored = set(f.keys())
    assert stored == set(expected_weight_shapes(expected_config))  # no prefix, no embed/lm_head
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert all(bool(torch.isfinite(t).all()) for t in tensors.values())
