"""Checkpoints of a run of several ranks: the per-rank part, gathered to rank 0 at save time,
and rank 0's checkpoint handed to every rank at resume.

What differs between ranks, and what does not (stages/train.py, data/packing.py):
- the drafter's weights, AdamW's state and the lr schedule are identical on every rank (one
  all-reduce a step: pipeline/reducer.NodeReducer), so rank 0's are the run's;
- the data cursor is an index into each rank's own strided share of the epoch (plan_epoch). With
  one target worker per rank it is the same index on every rank (each step takes one pack per
  drafter, in plan order), but with several target workers a rank may have trained a pack past
  another rank's (`Progress`), so it is not derivable from rank 0's in general;
- each drafter's anchor generator and torch's CPU generator are per process.
So the small per-rank part (`rank_part`: cursor and generators, a few KB) is SAVED FOR EVERY
RANK, rather than derived from rank 0's: at each save point (the same steps on every rank) every
other rank publishes its part in the rendezvous store, and rank 0 waits for them and writes them
all into its one checkpoint folder (`state["ranks"]`, index = rank). Nothing crosses the process
group for it: the store works whatever the backend, and the wait is a host wait only.

Resume: rank 0 alone reads the checkpoint (its folder need not be visible to the others, which
may be other machines) and `broadcast_state` hands it to every rank: the state's layout (JSON)
through the store, each tensor by one broadcast (start-up only). Resuming on another world size
is refused (state.check_run_identity names both sizes): the shares, and so each rank's cursor,
depend on it.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dflash_async.data.packing import PackCursor

_PART = "checkpoint_part/{step}/{rank}"
_LAYOUT = "resume_state_layout"


class RankView(Protocol):
    """What these helpers need of pipeline/distributed.RankInfo."""

    rank: int
    world_size: int
    store: Any


def rank_part(generators: Sequence[torch.Generator], cursor: PackCursor) -> dict[str, Any]:
    """This rank's own part of the training state after a step: its data cursor, each of its
    drafters' anchor generators and torch's CPU generator (host-side reads, no sync)."""
    return {
        "cursor": {"epoch": cursor.epoch, "index": cursor.index},
        "rng": {
            "anchor_generators": [g.get_state() for g in generators],
            "torch_cpu": torch.get_rng_state(),
        },
    }


def publish_part(node: RankView, step: int, part: dict[str, Any]) -> None:
    """A rank other than 0: hand its part of the checkpoint of `step` to rank 0 (the store)."""
    buffer = io.BytesIO()
    torch.save(part, buffer)
    node.store.set(_PART.format(step=step, rank=node.rank), buffer.getvalue())


def gather_parts(
    node: RankView, step: int, own: dict[str, Any], *, timeout_s: float
) -> list[dict[str, Any]]:
    """Rank 0: every rank's part of the checkpoint of `step`, in rank order (its own first).
    A host wait on the peers (they publish at the same step, at most one step behind: the
    all-reduce keeps the ranks in lockstep); RuntimeError when a rank failed, TimeoutError
    after `timeout_s`. Run in a thread."""
    parts = [own]
    for rank in range(1, node.world_size):
        key = _PART.format(step=step, rank=rank)
        wait_for_key(node.store, key, timeout_s)
        parts.append(torch.load(io.BytesIO(node.store.get(key)), weights_only=True))
        node.store.delete_key(key)
    return parts


def broadcast_state(
    state: dict[str, Any] | None, node: RankView, *, device: torch.device, timeout_s: float
) -> dict[str, Any]:
    """Rank 0's training state (loaded on the host) on every rank, on the host. Rank 0 passes
    it, the others None. Call on every rank, on drafter 0's worker (NCCL broadcasts device
    tensors: each goes through `device`; gloo broadcasts host tensors).

    Sync points: one per tensor (a broadcast, then the copy to the host), at start-up only."""
    through = device if dist.get_backend() == "nccl" else torch.device("cpu")
    if node.rank == 0:
        assert state is not None
        tensors: list[torch.Tensor] = []
        layout = _layout(state, tensors)
        node.store.set(_LAYOUT, json.dumps(layout))
    else:
        wait_for_key(node.store, _LAYOUT, timeout_s)
        layout, tensors = json.loads(node.store.get(_LAYOUT)), []
        _collect_slots(layout, tensors)
    received = []
    for tensor in tensors:  # the same order on every rank: the layout's
        if node.rank == 0:
            dist.broadcast(tensor.to(through), src=0)
            received.append(tensor)
        else:
            shape, dtype = tensor  # a slot: (shape, dtype name)
            buffer = torch.empty(shape, dtype=getattr(torch, dtype), device=through)
            dist.broadcast(buffer, src=0)
            received.append(buffer.cpu())  # sync point (NCCL): the broadcast, done
    return state if node.rank == 0 else _filled(layout, received)


def _layout(value: Any, tensors: list[torch.Tensor]) -> Any:
    """`value` as JSON with each tensor replaced by {"tensor": index, shape, dtype}."""
    if torch.is_tensor(value):
        tensors.append(value)
        return {
            "tensor": len(tensors) - 1,
            "shape": list(value.shape),
            "dtype": str(value.dtype).removeprefix("torch."),
        }
    if isinstance(value, dict):
        return {"dict": {k: _layout(v, tensors) for k, v in value.items()}}
    if isinstance(value, list | tuple):
        return {"list": [_layout(v, tensors) for v in value]}
    return {"value": value}


def _collect_slots(layout: Any, slots: list) -> None:
    """The (shape, dtype) of every tensor of a layout, in index order."""
    if "tensor" in layout:
        slots.append((layout["shape"], layout["dtype"]))
    for child in [*layout.get("dict", {}).values(), *layout.get("list", [])]:
        _collect_slots(child, slots)


def _filled(layout: Any, tensors: list[torch.Tensor]) -> Any:
    if "tensor" in layout:
        return tensors[layout["tensor"]]
    if "dict" in layout:
        return {k: _filled(v, tensors) for k, v in layout["dict"].items()}
    if "list" in layout:
        return [_filled(v, tensors) for v in layout["list"]]
    return layout["value"]


def wait_for_key(store: Any, key: str, timeout_s: float) -> None:
    """Until `key` is in the store; RuntimeError at once when a rank failed (it sets `failed`
    on its way out: pipeline/distributed.py), TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if store.check(["failed"]):
            raise RuntimeError(f"rank {store.get('failed').decode()} failed; {key!r} not reached")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key!r} not reached within {timeout_s} s")
        time.sleep(0.05)
