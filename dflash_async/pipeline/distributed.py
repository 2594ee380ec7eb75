"""Several nodes: one process per node joined by torch.distributed (torchrun or srun).

Who is who comes from the launcher's environment: torchrun's RANK / WORLD_SIZE / LOCAL_RANK, or
Slurm's SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID (srun), with MASTER_ADDR / MASTER_PORT naming
rank 0's rendezvous store. With neither, or a world of one, there is no process group at all and
the run is exactly the single-node one.

Inside a node the drafters' gradients are combined on the devices (stages/train.py); across nodes
`NodeReducer` (reducer.py) then all-reduces drafter 0's flat gradient buffer and the loss-normalisation sums in
ONE collective per step, so every node divides by the global sum(w) (DFLASH.md s.4) and every
drafter everywhere makes the same update. The per-step FLOP count (visible pairs) stays per node.

A dead peer must end every rank within seconds, never a hang: collectives time out
(`timeout_s`), and a `Watchdog` thread per rank beats a counter in the rendezvous store, watches
the others' counters and a `failed` key that a failing rank sets on its way out; a silent or
failed peer, or a lost store (rank 0 gone), ends the process with exit 1 at once (`os._exit`:
a thread stuck in a collective cannot be cancelled; checkpoints are atomic, so none is torn).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import anyio
import torch
import torch.distributed as dist

from dflash_async.checkpoint.ranks import wait_for_key
from dflash_async.errors import SettingsError
from dflash_async.log import bound_context

EXIT_PEER_LOST = 1
BEAT_S = 1.0  # how often each rank beats, and how often it looks at the others


@dataclass(frozen=True)
class RankInfo:
    """This process's place among the nodes; world_size 1 means no process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = ""
    master_port: int = 0
    store: Any = field(default=None, compare=False, repr=False)  # the rendezvous store, joined

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_writer(self) -> bool:
        """Rank 0 alone writes exports, checkpoints, evaluations and the run's summary."""
        return self.rank == 0


@dataclass(frozen=True)
class NodesSpec:
    """How the nodes of a torchrun/srun launch talk (settings/sections.py: DFLASH_PIPELINE__DIST_*)."""

    backend: str  # nccl | gloo, resolved (pick_backend)
    timeout_s: float  # longest wait in a collective or at start-up
    silence_s: float  # a peer whose watchdog is this quiet is dead


def rank_info_from_env(environ: Mapping[str, str]) -> RankInfo:
    """torchrun's variables first, then srun's; neither: a single node (RankInfo())."""
    if "WORLD_SIZE" in environ:
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    elif "SLURM_NTASKS" in environ and "SLURM_PROCID" in environ:
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
    else:
        return RankInfo()
    rank, world, local = (_int_var(environ, name, default="0") for name in names)
    if world < 1 or not 0 <= rank < world:
        raise SettingsError(f"{names[0]}={rank} is not a rank of {names[1]}={world}")
    if world == 1:
        return RankInfo(local_rank=local)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not environ.get(name):
            raise SettingsError(
                f"{names[1]}={world} but {name} is not set: export rank 0's host name and a "
                "free port as MASTER_ADDR and MASTER_PORT (torchrun sets them)"
            )
    port = _int_var(environ, "MASTER_PORT", default="")
    return RankInfo(rank, world, local, environ["MASTER_ADDR"], port)


def _int_var(environ: Mapping[str, str], name: str, *, default: str) -> int:
    value = environ.get(name, default)
    try:
        return int(value)
    except ValueError:
        raise SettingsError(f"{name}={value!r} is not an integer") from None


def pick_backend(backend: str, drafter_devices: Sequence[torch.device]) -> str:
    """auto: NCCL when the drafters are GPUs, gloo on CPU. gloo also reduces CUDA tensors
    (through the host), which is how two ranks share one GPU (NCCL refuses that)."""
    if backend != "auto":
        return backend
    return "nccl" if drafter_devices[0].type == "cuda" else "gloo"


@asynccontextmanager
async def process_group(
    info: RankInfo, *, backend: str, timeout_s: float, silence_s: float, log
) -> AsyncIterator[RankInfo]:
    """Join the process group (no-op for one node); leave it on exit.

    On success every rank waits for every other at a store barrier before leaving (rank 0 may
    still be evaluating), so no rank mistakes a finished peer for a dead one. On an error this
    rank marks itself failed in the store, so its peers end at once instead of at a timeout.
    Every event logged inside carries `rank`. The rendezvous and the barrier wait in a thread:
    the event loop keeps handling signals.
    """
    if not info.distributed:
        yield info
        return
    started = time.perf_counter()
    with bound_context(rank=info.rank):
        store = await anyio.to_thread.run_sync(_join, info, backend, timeout_s)
        info = replace(info, store=store)
        log.info(
            "process_group_joined",
            world_size=info.world_size,
            backend=backend,
            master=f"{info.master_addr}:{info.master_port}",
            timeout_s=timeout_s,
            join_s=round(time.perf_counter() - started, 2),
        )
        watchdog = Watchdog(store, info, silence_s=silence_s, log=log)
        watchdog.start()
        try:
            yield info
        except BaseException as error:
            watchdog.stop()
            _mark_failed(store, info, error, log)
            raise
        else:
            store.set(f"done/{info.rank}", "1")  # peers' watchdogs stop watching this rank
            watchdog.stop()
            await anyio.to_thread.run_sync(_leave, store, info, timeout_s)
        finally:
            dist.destroy_process_group()
            log.info("process_group_left", world_size=info.world_size)


def _join(info: RankInfo, backend: str, timeout_s: float) -> dist.Store:
    """Rendezvous at MASTER_ADDR:MASTER_PORT (rank 0 hosts the store, or torchrun's agent does:
    torch's tcp:// rendezvous knows which) and join the default group. Returns the store under
    a prefix of our own for the watchdog and the start-up check."""
    timeout = timedelta(seconds=timeout_s)
    host = f"[{info.master_addr}]" if ":" in info.master_addr else info.master_addr
    url = f"tcp://{host}:{info.master_port}?rank={info.rank}&world_size={info.world_size}"
    store, _, _ = next(dist.rendezvous(url, timeout=timeout))
    dist.init_process_group(
        backend, store=store, rank=info.rank, world_size=info.world_size, timeout=timeout
    )
    return dist.PrefixStore("dflash_async/", store)


def _mark_failed(store: dist.Store, info: RankInfo, error: BaseException, log) -> None:
    log.warning("rank_failed", error=f"{type(error).__name__}: {error}"[:500])
    with suppress(RuntimeError, OSError):  # rank 0's store is gone: the peers see that instead
        store.set("failed", str(info.rank))


def _leave(store: dist.Store, info: RankInfo, timeout_s: float) -> None:
    """Every rank at the end; rank 0, whose process may host the store, leaves last (once the
    others are past the barrier and need the store no more)."""
    _store_barrier(store, "finished", info.world_size, timeout_s)
    if info.rank != 0:
        store.add("left", 1)
        return
    deadline = time.monotonic() + timeout_s
    while store.add("left", 0) < info.world_size - 1 and time.monotonic() < deadline:
        time.sleep(0.05)


def _store_barrier(store: dist.Store, key: str, world_size: int, timeout_s: float) -> None:
    """Wait until every rank has arrived (host only: works whatever the backend and device);
    RuntimeError at once when a rank failed meanwhile, TimeoutError after timeout_s."""
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < world_size:
        if store.check(["failed"]):
            raise RuntimeError(f"rank {store.get('failed').decode()} failed; {key!r} not reached")
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks did not all reach {key!r} within {timeout_s} s")
        time.sleep(0.05)


class Watchdog:
    """A thread that ends this process when a peer fails, falls silent or the store vanishes.

    Every BEAT_S it adds 1 to its own `beat/<rank>` counter and reads the others'. A counter
    that has not moved for `silence_s` (by this host's clock: no clock sync across nodes
    needed), a `failed` key, or a store error means the run cannot finish: it logs
    `peer_lost` and exits with EXIT_PEER_LOST at once.
    """

    def __init__(self, store: dist.Store, info: RankInfo, *, silence_s: float, log) -> None:
        self._store, self._info, self._silence_s, self._log = store, info, silence_s, log
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._main, name="dflash-watchdog", daemon=True)
        self._context: Any = None

    def start(self) -> None:
        import contextvars

        self._context = contextvars.copy_context()  # its events carry the rank
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _main(self) -> None:
        self._context.run(self._watch)

    def _watch(self) -> None:
        peers = [r for r in range(self._info.world_size) if r != self._info.rank]
        seen = {r: (-1, time.monotonic()) for r in peers}  # counter, when it last moved
        while not self._stopped.wait(BEAT_S):
            try:
                self._store.add(f"beat/{self._info.rank}", 1)
                if self._store.check(["refused"]):  # rank 0 refused the run: each rank exits 2
                    return
                if self._store.check(["failed"]):
                    self._lost(reason="failed", peer=int(self._store.get("failed").decode()))
                now = time.monotonic()
                for peer in peers:
                    if self._store.check([f"done/{peer}"]):  # finished; waiting for the others
                        continue
                    count = self._store.add(f"beat/{peer}", 0)
                    if count != seen[peer][0]:
                        seen[peer] = (count, now)
                    elif now - seen[peer][1] > self._silence_s:
                        self._lost(reason="silent", peer=peer, silent_s=round(now - seen[peer][1]))
            except (RuntimeError, OSError) as error:  # the store (on rank 0) is gone
                if not self._stopped.is_set():
                    self._lost(reason="store_lost", peer=0, error=str(error)[:200])

    def _lost(self, **fields: Any) -> None:
        if self._stopped.is_set():  # leaving normally: the peers may go first
            return
        self._log.error("peer_lost", exit_code=EXIT_PEER_LOST, **fields)
        with suppress(RuntimeError, OSError):  # tell the others at once (no store: they see that)
            self._store.set("failed", str(self._info.rank))
        os._exit(EXIT_PEER_LOST)


async def writer_first(node: RankInfo, work: Callable[[], Any], *, timeout_s: float) -> Any:
    """`work()` (host only, in a thread) on rank 0 first, then on the other ranks: caches that
    ranks of one machine share (the built-in tiny target, the demo corpus) are built once."""
    if node.distributed and not node.is_writer:
        await anyio.to_thread.run_sync(wait_for_key, node.store, "writer_first", timeout_s)
    result = await anyio.to_thread.run_sync(work)
    if node.distributed and node.is_writer:
        node.store.set("writer_first", "1")
    return result


async def writer_decides(
    node: RankInfo, key: str, decide: Callable[[], tuple[Any, Any]], *, timeout_s: float
) -> tuple[Any, Any]:
    """`decide()` (host only, in a thread) on rank 0 alone, which owns the output folder (the
    resume point): it returns (what rank 0 keeps, what every rank learns, JSON). The other ranks
    get (None, the shared part) through the store. A SettingsError of rank 0 ends every rank
    alike: the others raise it too, with the same line (exit 2 everywhere, not exit 1 for a
    rank whose peer failed)."""
    if node.is_writer:
        try:
            kept, shared = await anyio.to_thread.run_sync(decide, abandon_on_cancel=True)
        except SettingsError as error:
            if node.distributed:
                _share_refusal(node, key, str(error), timeout_s=timeout_s)
            raise
        if node.distributed:
            node.store.set(f"decided/{key}", json.dumps({"shared": shared}))
        return kept, shared
    await anyio.to_thread.run_sync(
        wait_for_key, node.store, f"decided/{key}", timeout_s, abandon_on_cancel=True
    )
    decided = json.loads(node.store.get(f"decided/{key}"))
    if "error" in decided:
        node.store.add(f"acked/{key}", 1)  # rank 0 leaves (and takes its store) after this
        raise SettingsError(decided["error"])
    return None, decided["shared"]


def _share_refusal(node: RankInfo, key: str, error: str, *, timeout_s: float) -> None:
    """Rank 0's refusal to every rank: `refused` tells the watchdogs that rank 0's failure is
    one that every rank ends with by itself (not a lost peer: exit 2, not 1); rank 0 waits a
    little for the others to have read it, since its exit takes the store with it."""
    node.store.set("refused", "1")
    node.store.set(f"decided/{key}", json.dumps({"error": error}))
    deadline = time.monotonic() + min(timeout_s, 10.0)
    while node.store.add(f"acked/{key}", 0) < node.world_size - 1 and time.monotonic() < deadline:
        time.sleep(0.02)


def check_same_run(info: RankInfo, *, timeout_s: float, **facts: Any) -> None:
    """Every rank must plan the same run (same data, drafters per node, steps): SettingsError
    naming the first fact that differs. Through the store, once at start-up."""
    if not info.distributed:
        return
    info.store.set(f"facts/{info.rank}", json.dumps(facts))
    _store_barrier(info.store, "facts_ready", info.world_size, timeout_s)
    for rank in range(info.world_size):
        theirs = json.loads(info.store.get(f"facts/{rank}"))
        for name, value in facts.items():
            if theirs[name] != value:
                raise SettingsError(
                    f"rank {rank} has {name}={theirs[name]} but rank {info.rank} has {value}: "
                    "every node needs the same data, settings and number of drafter devices"
                )
