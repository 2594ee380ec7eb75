"""A target split into stages on one GPU against the unsplit target, target side only.

One H200, a Qwen3-8B-shaped random bf16 target built on the GPU, the product's stage code:
- unsplit: `stages/produce.target_stage` (one DeviceWorker, the packed dense forward);
- split: `stages/chain.build_chain` + `chain_stage` with k DeviceWorkers on the same GPU (each its
  own thread and stream), the layers cut by bytes, one [1, T, d] copy per boundary.
Both write into the same 2-slot ring on the GPU; a consumer worker on the GPU clones a slot's
features (the first packs only, for the comparison) and releases it with an event, as a drafter
does. The consumer never waits on the GPU from the host, so the target side is what is timed.

Printed, one JSON line per configuration: steady-state tokens/s (packs after the warm ones, wall
clock from the first timed publish to the last pack's completion), the ratio to unsplit, whether
the captured features of the compared packs are bit for bit the unsplit ones, and whether the
steady state ran under `torch.cuda.set_sync_debug_mode("error")` without a synchronizing call
(any host sync in any thread raises there and ends the run with that error).

What one GPU cannot show: the copies between real GPUs (NVLink) and stages that run in parallel on
separate devices; here the k stages share one GPU's SMs, so this measures the chain's own
overhead (threads, events, boundary copies, the bubble of filling the chain).

    python benchmarks/split_chain_gpu.py [--stages 2,3] [--packs 24] [--token-budget 16384]
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import AsyncExitStack

import anyio
import numpy as np
import torch
from transformers import AutoModelForCausalLM

from dflash_async.bench.target_bench import document_lengths
from dflash_async.bench.target_shapes import shape_configs
from dflash_async.data.packing import PackCursor, PackedBatch
from dflash_async.log import get_logger
from dflash_async.runtime.channels import open_channel
from dflash_async.runtime.devices import open_device_worker
from dflash_async.runtime.rings import RingSet, SlotRing
from dflash_async.stages.chain import build_chain, chain_stage
from dflash_async.stages.produce import TargetRunner, TargetSpec, _warm_up, target_stage
from dflash_async.stages.read import PlannedPack
from dflash_async.targets.forward import select_target_forward

WARM_PACKS = 3  # not timed: the chain fills, allocator pools settle
COMPARED = 3  # packs whose features are kept and compared bit for bit


class Samples:
    """`sample(i)` -> (ids, loss mask) of chat-like documents, one pack per seed."""

    def __init__(self, token_budget: int, packs: int) -> None:
        rng = np.random.default_rng(0)
        self.docs, self.packs = [], []
        for seed in range(packs):
            lengths = document_lengths(token_budget, seed)
            start = len(self.docs)
            self.docs += [(rng.integers(0, 32000, n), np.ones(n, dtype=bool)) for n in lengths]
            self.packs.append(PlannedPack(PackCursor(0, seed), np.arange(start, len(self.docs))))
        self.tokens = [int(document_lengths(token_budget, s).sum()) for s in range(packs)]

    def sample(self, i: int):
        return self.docs[i]


async def run_config(model, samples: Samples, *, stages: int, token_budget: int, layer_ids):
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    width = len(layer_ids) * model.config.hidden_size
    ring = SlotRing(2, token_budget=token_budget, feature_dim=width, device=device)
    rings = RingSet([ring])
    kept: dict[int, torch.Tensor] = {}
    spec = TargetSpec(torch.bfloat16, torch.bfloat16, token_budget, token_budget, False)
    log = get_logger("split_chain_gpu")
    async with AsyncExitStack() as stack:
        opened = [
            await stack.enter_async_context(
                open_device_worker(device, f"stage{i}", grad_enabled=False)
            )
            for i in range(stages)
        ]
        consumer = await stack.enter_async_context(
            open_device_worker(device, "consumer", grad_enabled=False)
        )
        if stages == 1:
            path = await opened[0].run(
                select_target_forward,
                model,
                layer_ids,
                token_budget=token_budget,
                max_batch_tokens=token_budget,
            )
            inputs = PackedBatch.empty(
                token_budget, width, device=device, feature_dtype=torch.bfloat16
            )
            runner = TargetRunner(model, path, inputs)
            await opened[0].run(_warm_up, runner, token_budget, token_budget)
        else:
            chain = await build_chain(model, opened, spec=spec, layer_ids=layer_ids, log=log)
        send, receive = open_channel(1, "packs")

        async def feed() -> None:
            async with send:
                for pack in samples.packs:
                    await send.send(pack)

        async def produce() -> None:
            if stages == 1:
                await target_stage(opened[0], runner, samples, receive, ring)
            else:
                await chain_stage(chain, samples, receive, rings.producer(0))
            rings.close()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(feed)
            tasks.start_soon(produce)
            async for slot in ring:
                index = slot.meta["cursor"].index
                if index == WARM_PACKS:
                    await consumer.run(sync)  # sync point: before timing only
                    if cuda:
                        torch.cuda.set_sync_debug_mode("error")
                    started = time.perf_counter()
                event = await consumer.run(_consume, slot, index, kept)
                ring.release(slot, event)
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
        await consumer.run(sync)  # sync point: the end of the timing
        seconds = time.perf_counter() - started
    timed = sum(samples.tokens[WARM_PACKS:])
    return timed / seconds, kept


def _consume(slot, index: int, kept: dict) -> torch.cuda.Event:
    """In the consumer's thread, as a drafter's copy-out: its stream waits for the producer's
    event (no host wait), a compared pack's features are cloned, the returned event orders the
    slot's release."""
    if slot.ready is not None:
        torch.cuda.current_stream().wait_event(slot.ready)
    if WARM_PACKS <= index < WARM_PACKS + COMPARED:
        kept[index] = slot.batch.features.clone()
    if slot.batch.features.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", default="2")
    parser.add_argument("--packs", type=int, default=24)
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--cpu-dry-run", action="store_true", help="a 4-layer model, T=256")
    args = parser.parse_args()
    config, layer_ids = shape_configs()["qwen3-8b"]
    device = "cuda"
    if args.cpu_dry_run:
        device, layer_ids, args.token_budget, args.packs = "cpu", (1, 2, 3), 2048, 8
        config = type(config)(
            **{
                **config.to_dict(),
                "num_hidden_layers": 4,
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "layer_types": None,
            }
        )
    with torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    samples = Samples(args.token_budget, args.packs)
    base_rate, base = anyio.run(
        lambda: run_config(
            model, samples, stages=1, token_budget=args.token_budget, layer_ids=layer_ids
        )
    )
    print(
        json.dumps({"stages": 1, "tokens_per_s": round(base_rate), "no_host_sync": True}),
        flush=True,
    )
    for k in map(int, args.stages.split(",")):
        try:
            rate, got = anyio.run(
                lambda k=k: run_config(
                    model, samples, stages=k, token_budget=args.token_budget, layer_ids=layer_ids
                )
            )
            sync_ok = True
        except Exception as error:  # a host sync under the debug mode, or another failure
            if device == "cuda":
                torch.cuda.set_sync_debug_mode(0)
            print(json.dumps({"stages": k, "error": repr(error)[:600]}), flush=True)
            continue
        equal = all(torch.equal(got[i], base[i]) for i in base)
        print(
            json.dumps(
                {
                    "stages": k,
                    "tokens_per_s": round(rate),
                    "ratio_to_unsplit": round(rate / base_rate, 4),
                    "features_bit_equal": equal,
                    "packs_compared": len(base),
                    "no_host_sync": sync_ok,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
