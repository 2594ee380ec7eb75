"""The per-step collective across nodes: gradients, loss-normalisation sums and the stop vote.

Inside a node the drafters' gradients are combined on the devices (stages/train.py); across nodes
`NodeReducer` then all-reduces drafter 0's flat gradient buffer and the loss-normalisation sums in
ONE collective per step, so every node divides by the global sum(w) (DFLASH.md s.4) and every
drafter everywhere makes the same update. The same buffer carries each rank's stop vote and which
signal it saw, so every rank stops after the same step for the same reason (shutdown.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dflash_async.model.step import STATS
from dflash_async.pipeline.shutdown import EXIT_CODES

# Summed across nodes: everything but visible_pairs (FLOP accounting stays per node).
NODE_STATS = STATS.index("visible_pairs")


class NodeReducer:
    """Sums drafter gradients and loss-normalisation sums across nodes, one collective a step,
    and agrees on when to stop, and why.

    Called on drafter 0's worker after the drafters inside the node were combined (each holds
    the node's sum). Packs [flat_grad | sums | votes] into one buffer, all-reduces it over the
    process group, and writes the global sums back into every drafter of the node.

    Stopping (a signal reaching some ranks) must happen after the same step everywhere, or a
    rank waits in a collective that its peers never join; and every rank must then end alike
    (`train_interrupted`, a checkpoint by rank 0, 130/143), not only the one that got the
    signal. So the vote carries the signal: one slot per signal of `SIGNALS`, to which a rank
    that wants to stop adds 1 in its signal's slot (`signal_of()`, read when `stop_requested`).
    Every rank reads the reduced slots of the PREVIOUS step (copied to the host asynchronously,
    finished long ago in steady state), so all decide alike, one step late, and the step itself
    does not wait for its own all-reduce. `agreed_signal` is then the first signal of SIGNALS
    (SIGINT before SIGTERM) that any rank voted for: the same on every rank, whichever got it.
    """

    SIGNALS = tuple(EXIT_CODES)  # (SIGINT, SIGTERM): one vote slot each, in this priority

    def __init__(self, *, signal_of: Callable[[], int | None] = lambda: None) -> None:
        self._signal_of = signal_of
        self._buffer: torch.Tensor | None = None  # [n + NODE_STATS + votes] on drafter 0's device
        self._votes_host: torch.Tensor | None = None  # the previous step's reduced votes
        self._votes_ready: Any = None  # event after which _votes_host holds them (CUDA)
        self.agreed_signal: int | None = None  # set once the ranks agreed to stop

    def __call__(self, runners: Sequence[Any], stop_requested: bool) -> bool:
        """Reduce this step; True when every rank must stop after this step."""
        first = runners[0].step
        n, cuda, votes = first.flat_grad.numel(), first.device.type == "cuda", len(self.SIGNALS)
        if self._buffer is None:
            self._buffer = torch.empty(
                n + NODE_STATS + votes, dtype=torch.float32, device=first.device
            )
            self._votes_host = torch.zeros(votes, pin_memory=cuda)
        buffer = self._buffer
        several_gpus = len(runners) > 1 and cuda
        if several_gpus:  # sync points (M > 1 GPUs): the node's combine done on every device
            for runner in runners:
                torch.cuda.synchronize(runner.step.device)
        buffer[:n].copy_(first.flat_grad)
        buffer[n : n + NODE_STATS].copy_(first.stats[:NODE_STATS])
        buffer[n + NODE_STATS :].zero_()
        if stop_requested:
            buffer[n + NODE_STATS + self._slot(self._signal_of())] = 1.0
        agreed = self._previous_votes()
        # NCCL: enqueued on drafter 0's stream, no host sync. gloo with CUDA tensors: a sync point
        # (gloo stages through the host).
        dist.all_reduce(buffer)
        if several_gpus:
            torch.cuda.synchronize(first.device)  # sync point (M > 1 GPUs): buffer ready
        for runner in runners:
            runner.step.flat_grad.copy_(buffer[:n])
            runner.step.stats[:NODE_STATS].copy_(buffer[n : n + NODE_STATS])
            if several_gpus:
                torch.cuda.synchronize(runner.step.device)  # sync point: before its phase B
        self._votes_host.copy_(buffer[n + NODE_STATS :], non_blocking=True)
        self._votes_ready = torch.cuda.Event() if cuda else None
        if cuda:
            self._votes_ready.record()
        if agreed is not None:
            self.agreed_signal = agreed
        return agreed is not None

    def _slot(self, signum: int | None) -> int:
        """A stop without a known signal counts as SIGINT (the documented default, 130)."""
        return self.SIGNALS.index(signum) if signum in self.SIGNALS else 0

    def _previous_votes(self) -> int | None:
        """The signal the ranks agreed on at the previous step, or None to go on."""
        if self._votes_ready is not None:
            self._votes_ready.synchronize()  # sync point: the previous step's all-reduce, done
        counts = self._votes_host.tolist()
        voted = [s for s, count in zip(self.SIGNALS, counts, strict=True) if count > 0]
        return int(voted[0]) if voted else None
