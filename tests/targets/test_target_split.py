"""A target split by layers over 2 and 3 CPU stage workers (stages/chain.py) writes features bit
for bit equal to the unsplit target's, for a dense, an MoE and a hybrid target.

Bit for bit, not close: in fp32 on the CPU each stage runs exactly the ops the unsplit forward
runs for its layers (the mask and rotary tables are rebuilt from the same layout by the same ops,
the hidden states cross a boundary by an exact copy), so any difference is a bug of the split
(a layer run twice or skipped, a column written by the wrong stage, padding not zeroed).
The hybrid runs with the plain-torch reference kernels of test_target_hybrid.py (no fla on CPU).
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import anyio
import numpy as np
import pytest
import torch
from structlog.testing import capture_logs
from test_target_hybrid import REFERENCE, tiny_qwen35
from test_target_packed import _SMALL, _family

from dflash_async.data.packing import PackCursor, layout_pack
from dflash_async.errors import SettingsError
from dflash_async.log import get_logger
from dflash_async.runtime.channels import open_channel
from dflash_async.runtime.devices import open_device_worker
from dflash_async.runtime.rings import RingSet, SlotRing
from dflash_async.stages.chain import build_chain, chain_stage
from dflash_async.stages.produce import TargetSpec
from dflash_async.stages.read import PlannedPack
from dflash_async.targets.forward import TargetPath, select_target_forward
from dflash_async.targets.loading import random_target, text_model
from dflash_async.targets.packed.hybrid import PackedHybridForward
from dflash_async.targets.split import LayerSizes, split_layers

pytestmark = [pytest.mark.usefixtures("one_intra_op_thread"), pytest.mark.timeout(60)]

TOKEN_BUDGET = 48
LAYER_IDS = (1, 3, 4)
PACKS = ((7, 12, 5, 9), (20, 3), (11, 11, 11, 11), (30,))  # more packs than stages


class Samples:
    """The TokenizedSamples surface the chain reads: `sample(i)` -> (ids, loss mask)."""

    def __init__(self, vocab: int) -> None:
        rng = np.random.default_rng(0)
        self.docs = [
            (rng.integers(0, vocab, n), np.ones(n, dtype=bool))
            for lengths in PACKS
            for n in lengths
        ]

    def sample(self, i: int):
        return self.docs[i]


def _planned() -> list[PlannedPack]:
    packs, start = [], 0
    for index, lengths in enumerate(PACKS):
        packs.append(PlannedPack(PackCursor(0, index), np.arange(start, start + len(lengths))))
        start += len(lengths)
    return packs


def _unsplit(model, samples: Samples, forward) -> list[torch.Tensor]:
    out = []
    for pack in _planned():
        docs = [samples.sample(int(i)) for i in pack.indices]
        layout = layout_pack(docs, TOKEN_BUDGET)
        features = torch.full((TOKEN_BUDGET, len(LAYER_IDS) * 64), float("nan"))
        lengths = np.array([len(d[0]) for d in docs])
        forward(layout.input_ids, layout.position_ids, layout.doc_ids, features, lengths)
        out.append(features)
    return out


def _hybrid_stage(model, layers: range) -> TargetPath:
    forward = PackedHybridForward(
        text_model(model),
        LAYER_IDS,
        kernels=REFERENCE,
        mrope=True,  # Qwen3.5 (targets/families.py)
        attention="sdpa",
        compile=False,
        layers=layers,
    )
    return TargetPath(forward, "packed_hybrid", "reference kernels", forward.stage)


async def _through_chain(model, samples: Samples, stages: int, choose) -> list[torch.Tensor]:
    """Every pack through a chain of `stages` CPU workers into a 2-slot ring, in publish order."""
    spec = TargetSpec(torch.float32, torch.float32, TOKEN_BUDGET, TOKEN_BUDGET, False)
    ring = SlotRing(
        2,
        token_budget=TOKEN_BUDGET,
        feature_dim=len(LAYER_IDS) * 64,
        device=torch.device("cpu"),
        feature_dtype=torch.float32,
    )
    rings = RingSet([ring])
    got = []
    async with AsyncExitStack() as stack:
        workers = [
            await stack.enter_async_context(
                open_device_worker(torch.device("cpu"), f"stage{i}", grad_enabled=False)
            )
            for i in range(stages)
        ]
        chain = await build_chain(
            model, workers, spec=spec, layer_ids=LAYER_IDS, log=get_logger("test"), choose=choose
        )
        assert [len(r) for r in chain.split.ranges] and len(chain.split.ranges) == stages
        send, receive = open_channel(1, "packs")

        async def feed() -> None:
            async with send:
                for pack in _planned():
                    await send.send(pack)

        async def produce() -> None:
            await chain_stage(chain, samples, receive, rings.producer(0))
            rings.close()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(feed)
            tasks.start_soon(produce)
            async for slot in ring:  # CPU: written when published
                got.append((slot.meta["cursor"].index, slot.batch.features.clone()))
                ring.release(slot)
    assert [i for i, _ in got] == list(range(len(PACKS)))
    return [f for _, f in got]


def _dense_choose(model, layers: range) -> TargetPath:
    return select_target_forward(
        model, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=TOKEN_BUDGET, layers=layers
    )


@pytest.mark.anyio
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "qwen3_5"])
async def test_split_target_features_equal_the_unsplit_target_bit_for_bit(
    kind: str, stages: int
) -> None:
    if kind == "qwen3_5":
        model = random_target(tiny_qwen35(), seed=0)
        whole = PackedHybridForward(
            text_model(model),
            LAYER_IDS,
            kernels=REFERENCE,
            mrope=True,
            attention="sdpa",
            compile=False,
        )
        choose = _hybrid_stage
    else:
        model = random_target(_family(kind), seed=0)
        whole = select_target_forward(
            model, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=TOKEN_BUDGET
        ).forward
        assert whole.__class__.__name__ == "PackedCall"
        choose = _dense_choose
    samples = Samples(300)
    expected = _unsplit(model, samples, whole)
    with capture_logs() as events:
        got = await _through_chain(model, samples, stages, choose)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"pack {i}"
    (split,) = [e for e in events if e["event"] == "target_split"]
    assert split["stages"] == stages and split["layers"][-1][1] == max(LAYER_IDS) + 1


def test_layers_are_split_into_contiguous_ranges_balanced_by_bytes() -> None:
    split = split_layers(LayerSizes((10,) * 6, embedding=20), stages=2)
    assert split.ranges == (range(0, 2), range(2, 6))  # the embedding counts on the first stage
    assert split.stage_bytes == (40, 40)
    experts = split_layers(LayerSizes((10, 10, 10, 10, 60, 10), embedding=0), stages=3)
    assert experts.ranges == (range(0, 4), range(4, 5), range(5, 6))  # the big layer alone
    with pytest.raises(SettingsError, match="at most 6 stages"):
        split_layers(LayerSizes((1,) * 6, embedding=0), stages=7)


def test_the_hf_fallback_refuses_to_be_split_and_says_why() -> None:
    from transformers import GemmaConfig

    model = random_target(GemmaConfig(**_SMALL), seed=0)
    with pytest.raises(SettingsError, match=r"HF fallback .* cannot be split by layers"):
        select_target_forward(
            model,
            LAYER_IDS,
            token_budget=TOKEN_BUDGET,
            max_batch_tokens=TOKEN_BUDGET,
            layers=range(0, 3),
        )
