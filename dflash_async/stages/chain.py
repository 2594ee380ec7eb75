"""The stage chain: one target replica split by layers (targets/split.py) over k stage workers.

Per pack: the first stage builds the fixed layout on the host (pinned on CUDA), takes a free slot
(the slot counts as held from here to the last stage's publish), and every stage, in its own
DeviceWorker, copies the layout onto its device, runs its layer range and writes the captured
layers it owns into the slot (in place when the slot is on its device, else through its staging
buffer). A stage hands its output hidden states [1, T, d] to the next by ONE copy, straight into
a receive buffer on the next stage's device (`Boundary`, two per boundary, a bounded pool), so
the next pack enters the first stage while the previous one runs further down: up to k packs in
flight (more waiting in the bounded links between stages). The last stage copies the layout rows
into the slot and publishes it with its event.

Ordering without host syncs: each stage records an event after its writes (`ready`); the next
stage's stream waits on it before reading the buffer (stream wait, no CPU-GPU sync), and records
`consumed` after its job, on which the producing stage's stream waits before it overwrites that
buffer for a later pack. The last stage's stream has (transitively) waited on every earlier
stage's event, so its event covers every write into the slot. On the CPU every job is
synchronous and the events are None. All tasks live in one task group: a stage's failure ends the
run; closing is the end signal (the packs channel, then each link in turn).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

import anyio
import numpy as np
import torch

from dflash_async.data.packing import PackedBatch, layout_pack
from dflash_async.data.samples import TokenizedSamples
from dflash_async.runtime.channels import ReceiveChannel, SendChannel, open_channel
from dflash_async.runtime.devices import DeviceWorker
from dflash_async.runtime.meters import BusyMeter, timing_event
from dflash_async.runtime.rings import RingProducer
from dflash_async.stages.produce import (
    TargetRunner,
    TargetSpec,
    choose_forward,
    load_target_weights,
    log_path_chosen,
)
from dflash_async.stages.read import PlannedPack
from dflash_async.targets.forward import TargetPath
from dflash_async.targets.loading import _checked_folder, text_config, text_model
from dflash_async.targets.quantized import WeightFormat
from dflash_async.targets.random_weights import meta_model
from dflash_async.targets.split import Split, layer_sizes, split_layers

Chooser = Callable[[torch.nn.Module, range], TargetPath]  # a stage's forward for its range


@dataclass
class Boundary:
    """A receive buffer [1, T, d] on a stage's device for the previous stage's output, and the
    events that order its reuse (None on the CPU)."""

    buffer: torch.Tensor
    ready: torch.cuda.Event | None = None  # the producing stage's writes are done
    consumed: torch.cuda.Event | None = None  # the receiving stage has read it


@dataclass
class ChainStage:
    """One stage: its worker, its runner (model, stage forward, layout staging, meter), its
    layer range and the column blocks of the features it writes."""

    worker: DeviceWorker
    runner: TargetRunner
    layers: range
    columns: tuple[int, ...]
    width: int  # d: one column block

    @property
    def device(self) -> torch.device:
        return self.runner.device


@dataclass
class TargetChain:
    """A target replica as a chain of stages; `inbound[i]`: the receive buffers of stage i+1."""

    stages: list[ChainStage]
    split: Split
    inbound: list[list[Boundary]]
    home: int | None = None  # the ring its packs go to first


@dataclass(frozen=True)
class HostPack:
    """A pack's layout on the host (pinned on CUDA) and its host facts."""

    layout: PackedBatch
    lengths: np.ndarray  # [n] tokens of each document
    tokens: int
    documents: int


@dataclass(frozen=True)
class InFlight:
    """A pack between two stages: its slot (held) and the buffer holding its hidden states."""

    pack: PlannedPack
    host: HostPack
    slot: object  # runtime.rings.Slot
    boundary: Boundary | None


# ---- loading (in the stage workers' threads) ------------------------------------------------


async def load_chain(
    path: str,
    workers: Sequence[DeviceWorker],
    *,
    spec: TargetSpec,
    layer_ids: tuple[int, ...],
    log,
) -> TargetChain:
    """Load the target once on the host (in the first stage's thread; loading each stage's layers
    straight onto its device is not done yet), by the unsplit target's loader
    (`load_target_weights`: the same spec, so every DFLASH_TARGET__* setting holds, in the
    stages' dtype), then `build_chain`. A random target (spec.weights) is drawn instead, each
    stage's layers straight onto its device (`_random_chain_model`)."""
    host = torch.device("cpu")
    if spec.random_seed is not None:
        model, split, served = await workers[0].run(
            _random_chain_model, path, workers, spec=spec, last_layer=max(layer_ids), log=log
        )
        return await build_chain(
            model, workers, spec=spec, layer_ids=layer_ids, log=log, split=split, served=served
        )
    model, served = await workers[0].run(
        load_target_weights,
        path,
        spec=spec,
        device=host,
        runs_on=workers[0].device,
        last_layer=max(layer_ids),
        log=log,
    )
    return await build_chain(model, workers, spec=spec, layer_ids=layer_ids, log=log, served=served)


def _random_chain_model(
    path: str, workers: Sequence[DeviceWorker], *, spec: TargetSpec, last_layer: int, log
):
    """(the random target, its split, its WeightFormat): the split from the meta-built model's
    bytes (as `build_chain` would cut it), then every stage's layers drawn on that stage's
    device, the embedding and rotary on the first; with spec.decode the layers past the last
    captured one and the lm_head on the host (where a loaded split target keeps them)."""
    devices = [w.device for w in workers]
    meta = meta_model(_checked_folder(path), dtype=spec.dtype_on(devices[0]))
    split = split_layers(layer_sizes(text_model(meta), last_layer=last_layer), stages=len(devices))
    stage_of = {i: s for s, r in enumerate(split.ranges) for i in r}
    model, served = load_target_weights(
        path,
        spec=spec,
        device=devices[0],
        last_layer=last_layer,
        log=log,
        layer_device=lambda i: devices[stage_of[i]],
        tail_device=torch.device("cpu"),
    )
    return model, split, served


async def build_chain(
    model,
    workers: Sequence[DeviceWorker],
    *,
    spec: TargetSpec,
    layer_ids: tuple[int, ...],
    log,
    choose: Chooser | None = None,
    split: Split | None = None,
    served: WeightFormat | None = None,
) -> TargetChain:
    """Split the model's layers by bytes (unless `split` is given: a random target's, cut
    before its layers were drawn), move each stage's layers (and the embedding, to the first)
    onto its device in its thread, choose each stage's forward (`choose(model, layers)`, by
    default the unsplit target's `choose_forward`: exit 2 for the HF fallback), log it per
    stage (`target_path_chosen`, with `served`: the weights' format) and warm the chain up."""
    if split is None:
        sizes = layer_sizes(text_model(model), last_layer=max(layer_ids))
        split = split_layers(sizes, stages=len(workers))
    choose = choose or partial(_choose_stage, spec=spec, layer_ids=layer_ids)
    d = text_config(model).hidden_size
    stages = []
    for s, (worker, layers) in enumerate(zip(workers, split.ranges, strict=True)):
        runner = await worker.run(  # one at a time: compile
            _stage_runner,
            model,
            layers,
            worker.device,
            choose=choose,
            token_budget=spec.token_budget,
            width=len(layer_ids) * d,
        )
        log_path_chosen(
            log,
            runner.path,
            device=worker.device,
            dtype=runner.inputs.features.dtype,
            served=served,
            stage=s,
            layers=[layers.start, layers.stop],
        )
        columns = tuple(j for j, i in enumerate(layer_ids) if i in layers)
        stages.append(ChainStage(worker, runner, layers, columns, d))
    inbound = [await s.worker.run(_boundaries, s, spec.token_budget) for s in stages[1:]]
    chain = TargetChain(stages, split, inbound)
    log.info(
        "target_split",
        stages=len(stages),
        layers=[[r.start, r.stop] for r in split.ranges],
        stage_bytes=list(split.stage_bytes),
        devices=[str(w.device) for w in workers],
        target_path=stages[0].runner.path.name,
    )
    started = time.perf_counter()
    await _warm_up(chain, spec.token_budget)
    log.info(
        "target_warmed_up",
        target_path=stages[0].runner.path.name,
        stages=len(stages),
        warm_up_s=round(time.perf_counter() - started, 2),
    )
    return chain


def _choose_stage(model, layers: range, *, spec: TargetSpec, layer_ids) -> TargetPath:
    return choose_forward(model, spec=spec, layer_ids=layer_ids, layers=layers)


def _stage_runner(
    model, layers: range, device: torch.device, *, choose: Chooser, token_budget: int, width: int
) -> TargetRunner:
    """Move a stage's layers (and the embedding, for the first) to its device; its forward.
    The rotary table stays where the embedding is: HF's rotary module moves its small inv_freq
    to the input's device on each call (a device copy, no host sync)."""
    inner = text_model(model)
    inner.layers[layers.start : layers.stop].to(device)
    if layers.start == 0:
        inner.embed_tokens.to(device)
    chosen = choose(model, layers)
    dtype = next(inner.layers[layers.start].parameters()).dtype
    inputs = PackedBatch.empty(token_budget, width, device=device, feature_dtype=dtype)
    return TargetRunner(model, chosen, inputs, BusyMeter())


def _boundaries(stage: ChainStage, token_budget: int, count: int = 2) -> list[Boundary]:
    """`count` receive buffers on the stage's device (two: one being read, one being filled)."""
    dtype = stage.runner.inputs.features.dtype
    shape = (1, token_budget, stage.width)
    return [Boundary(torch.zeros(shape, dtype=dtype, device=stage.device)) for _ in range(count)]


async def _warm_up(chain: TargetChain, token_budget: int) -> None:
    """One made-up pack through every stage (the first calls compile on CUDA)."""
    n = min(token_budget, 8)
    docs = [(np.zeros(n, dtype=np.int64), np.ones(n, dtype=bool))]
    host = HostPack(layout_pack(docs, token_budget), np.array([n]), n, 1)
    boundary = None
    for i, stage in enumerate(chain.stages):
        out = chain.inbound[i][0] if i < len(chain.inbound) else None
        await stage.worker.run(
            run_stage,
            stage,
            host,
            stage.runner.inputs,
            inbound=boundary,
            outbound=out,
            last=out is None,
        )
        boundary = out


# ---- one stage's job ----------------------------------------------------------------------------


def host_pack(samples: TokenizedSamples, pack: PlannedPack, *, token_budget: int, pin: bool):
    """The pack's layout on the host; in fresh pinned blocks on CUDA (the caching host allocator
    reuses one only after every copy recorded from it has completed: no host wait)."""
    docs = [samples.sample(int(i)) for i in pack.indices]
    layout = layout_pack(docs, token_budget)
    if pin:
        layout = PackedBatch(*(t.pin_memory() for t in layout.tensors()))
    lengths = np.array([len(d[0]) for d in docs], dtype=np.int64)
    return HostPack(layout, lengths, int(lengths.sum()), len(docs))


def _wait(event: torch.cuda.Event | None) -> None:
    """This thread's stream waits for `event` (a stream wait on the device, not a host sync)."""
    if event is not None:
        torch.cuda.current_stream().wait_event(event)


@torch.no_grad()
def run_stage(
    stage: ChainStage,
    host: HostPack,
    slot_batch: PackedBatch,
    *,
    inbound: Boundary | None,
    outbound: Boundary | None,
    last: bool,
):
    """A stage's part of one pack (see the module doc); returns its written event (CPU: None)."""
    runner, device = stage.runner, stage.device
    ins = runner.inputs
    ins.copy_(host.layout, with_features=False)  # non_blocking from pinned host, this stream
    started = timing_event(device)
    hidden = None
    if inbound is not None:
        _wait(inbound.ready)
        hidden = inbound.buffer
    in_place = slot_batch.features.device == device
    features = slot_batch.features if in_place else ins.features
    out = runner.path.stage(
        hidden, ins.input_ids, ins.position_ids, ins.doc_ids, features, host.lengths
    )
    if not in_place:
        _copy_columns(slot_batch.features, ins.features, stage.columns, stage.width)
    if outbound is not None:
        _wait(outbound.consumed)  # the next stage has read this buffer's previous pack
        outbound.buffer.copy_(out, non_blocking=True)  # the boundary's one activation copy
    if last:
        slot_batch.copy_(ins, with_features=False)
    written = timing_event(device)  # after every write of this stage
    if inbound is not None:
        inbound.consumed = written
    if outbound is not None:
        outbound.ready = written
    if written is not None:
        runner.meter.add(started, written)
    return written


def _copy_columns(dst: torch.Tensor, src: torch.Tensor, columns: Sequence[int], d: int) -> None:
    for j in columns:  # device copies on this thread's stream
        dst[:, j * d : (j + 1) * d].copy_(src[:, j * d : (j + 1) * d], non_blocking=True)


# ---- the chain's tasks ----------------------------------------------------------------------


async def chain_stage(
    chain: TargetChain,
    samples: TokenizedSamples,
    packs: ReceiveChannel[PlannedPack],
    ring: RingProducer,
) -> None:
    """Run packs through the chain until the packs channel closes (then each link closes)."""
    k = len(chain.stages)
    links = [open_channel(1, f"stage{i + 1}") for i in range(k - 1)]
    pools = [
        await _pool(boundaries, f"boundary{i + 1}") for i, boundaries in enumerate(chain.inbound)
    ]
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(_first, chain.stages[0], samples, packs, ring, links[0][0], pools[0])
            for i in range(1, k):
                onward = (links[i][0], pools[i]) if i < k - 1 else (None, None)
                tasks.start_soon(
                    _later, chain.stages[i], links[i - 1][1], pools[i - 1], *onward, ring
                )
    finally:
        packs.close()


@dataclass
class _Pool:
    """A bounded pool of receive buffers: take waits while both are in use."""

    take: Callable[[], Awaitable[Boundary]]
    give: Callable[[Boundary], Awaitable[None]]


async def _pool(boundaries: list[Boundary], name: str) -> _Pool:
    send, receive = open_channel(len(boundaries), name)
    for b in boundaries:
        await send.send(b)  # never waits: room for all of them
    return _Pool(receive.receive, send.send)


async def _first(
    stage: ChainStage,
    samples: TokenizedSamples,
    packs: ReceiveChannel[PlannedPack],
    ring: RingProducer,
    send: SendChannel[InFlight],
    pool: _Pool,
) -> None:
    pin = stage.device.type == "cuda"
    budget = stage.runner.inputs.num_tokens
    async with send:
        async for pack in packs:
            host = await stage.worker.run(host_pack, samples, pack, token_budget=budget, pin=pin)
            slot = await ring.acquire_free()  # the backpressure; held until the last stage
            out = await pool.take()
            await stage.worker.run(
                run_stage, stage, host, slot.batch, inbound=None, outbound=out, last=False
            )
            await send.send(InFlight(pack, host, slot, out))


async def _later(
    stage: ChainStage,
    receive: ReceiveChannel[InFlight],
    inbound: _Pool,
    send: SendChannel[InFlight] | None,
    pool: _Pool | None,
    ring: RingProducer,
) -> None:
    try:
        async for item in receive:
            out = await pool.take() if pool is not None else None
            event = await stage.worker.run(
                run_stage,
                stage,
                item.host,
                item.slot.batch,
                inbound=item.boundary,
                outbound=out,
                last=send is None,
            )
            await inbound.give(item.boundary)  # reusable once its `consumed` event completes
            if send is not None:
                await send.send(replace(item, boundary=out))
                continue
            host = item.host
            item.slot.meta.update(
                cursor=item.pack.cursor, tokens=host.tokens, documents=host.documents
            )
            ring.publish(item.slot, event)
    finally:
        receive.close()
        if send is not None:
            send.close()


def chain_workers(chains: Sequence[TargetChain]) -> list[tuple[DeviceWorker, TargetRunner]]:
    """Every stage's (worker, runner), replica by replica (the step line's meters)."""
    return [(s.worker, s.runner) for c in chains for s in c.stages]
