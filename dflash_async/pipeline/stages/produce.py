"""Target stage: run the frozen target on a pack and write its features into a free slot.

Per pack (in the target's DeviceWorker thread): the fixed drafter layout is built on the host,
the pack is split into right-padded 2-D target batches (hybrid linear-attention targets stay
exact; no cross-document state), each batch's captured layers are gathered into a staging copy
of the layout on the target device, and the staging batch is copied into the slot in one go.
All copies run on the target thread's stream, so one event recorded after them tells the
consumer when the slot is written; it never blocks the host (no sync point on GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_async.data.packing import PackedBatch, layout_pack, pack_row_offsets, target_batches
from dflash_async.data.samples import TokenizedSamples
from dflash_async.pipeline.channels import ReceiveChannel, SlotRing
from dflash_async.pipeline.devices import DeviceWorker
from dflash_async.pipeline.meters import BusyMeter, timing_event
from dflash_async.pipeline.stages.read import PlannedPack
from dflash_async.target.loading import TargetFeatures, load_target


@dataclass
class TargetRunner:
    """A loaded target on one device plus its staging layout. Build and use in its worker."""

    model: torch.nn.Module
    features: TargetFeatures
    staging: PackedBatch  # [T] layout on the target device
    max_batch_tokens: int
    meter: BusyMeter = field(default_factory=BusyMeter)  # device time of fill_slot jobs

    @property
    def device(self) -> torch.device:
        return self.staging.features.device


def load_runner(
    path: str,
    *,
    device: torch.device,
    dtype: torch.dtype | None,
    layer_ids: tuple[int, ...],
    token_budget: int,
    max_batch_tokens: int,
) -> TargetRunner:
    """Load the target on `device` (call inside that device's worker thread)."""
    model = load_target(path, device=device, dtype=dtype)
    features = TargetFeatures(model, layer_ids)
    dim = len(layer_ids) * features.hidden_size
    feature_dtype = next(model.parameters()).dtype
    staging = PackedBatch.empty(token_budget, dim, device=device, feature_dtype=feature_dtype)
    return TargetRunner(model, features, staging, max_batch_tokens)


def _batch_tensors(docs: list[np.ndarray], rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input_ids and attention_mask [b, S] of the documents `rows`."""
    lengths = [len(docs[r]) for r in rows]
    ids = np.zeros((len(rows), max(lengths)), dtype=np.int64)
    mask = np.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : lengths[i]], mask[i, : lengths[i]] = docs[r], 1
    return torch.from_numpy(ids), torch.from_numpy(mask)


def _gather_index(docs, rows, offsets, width) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat source index into the [b*S] batch and destination row in the layout, real tokens."""
    src = np.concatenate([i * width + np.arange(len(docs[r])) for i, r in enumerate(rows)])
    dst = np.concatenate([offsets[r] + np.arange(len(docs[r])) for r in rows])
    return torch.from_numpy(src), torch.from_numpy(dst)


@torch.no_grad()
def fill_slot(
    runner: TargetRunner, samples: TokenizedSamples, pack: PlannedPack, slot_batch: PackedBatch
):
    """Write one pack (layout + target features) into `slot_batch`; returns the written event
    (CUDA) or None (CPU: everything already happened)."""
    staging, device = runner.staging, runner.device
    started = timing_event(device)
    docs = [samples.sample(int(i)) for i in pack.indices]
    layout = layout_pack(docs, staging.num_tokens)
    staging.copy_(layout, with_features=False)  # host -> target device
    ids = [d[0] for d in docs]
    offsets = pack_row_offsets(np.array([len(x) for x in ids]))
    total = int(offsets[-1])
    for rows in target_batches(np.diff(offsets), runner.max_batch_tokens):
        input_ids, attention_mask = _batch_tensors(ids, rows)
        feats = runner.features(input_ids.to(device), attention_mask.to(device))  # [b, S, k*d]
        src, dst = _gather_index(ids, rows, offsets, input_ids.shape[1])
        picked = feats.flatten(0, 1).index_select(0, src.to(device))
        staging.features.index_copy_(0, dst.to(device), picked.to(staging.features.dtype))
    staging.features[total:].zero_()  # padding rows must be finite: masked keys still multiply V
    slot_batch.copy_(staging)  # one copy of the whole pack into the slot
    written = timing_event(device)  # on this thread's stream: after every write to the slot
    if written is not None:
        runner.meter.add(started, written)
    return written


async def target_stage(
    worker: DeviceWorker,
    runner: TargetRunner,
    samples: TokenizedSamples,
    packs: ReceiveChannel[PlannedPack],
    ring: SlotRing,
) -> None:
    """Take packs until the channel closes; each waits for a free slot (the backpressure)."""
    try:
        async for pack in packs:
            slot = await ring.acquire_free()
            event = await worker.run(fill_slot, runner, samples, pack, slot.batch)
            slot.meta.update(
                cursor=pack.cursor,
                tokens=int(samples.lengths[pack.indices].sum()),
                documents=len(pack.indices),
            )
            ring.publish(slot, event)
    finally:
        packs.close()
