"""The pieces of several-node runs that need no second process: who is who (launcher variables),
each rank's share of the packs, the peer watchdog and the start-up agreement check."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import numpy as np
import pytest
import torch.distributed as dist
from structlog.testing import capture_logs

from dflash_async.data.packing import plan_epoch
from dflash_async.errors import SettingsError
from dflash_async.log import get_logger
from dflash_async.pipeline import distributed
from dflash_async.pipeline.distributed import (
    RankInfo,
    Watchdog,
    check_same_run,
    rank_info_from_env,
)

pytestmark = pytest.mark.timeout(30)
LENGTHS = np.random.default_rng(0).integers(1, 200, size=300)  # ~55 packs of 512 tokens
BUDGET, SEED = 512, 3


# ---- who is who -------------------------------------------------------------------------------


def test_no_launcher_variables_mean_a_single_node_without_a_process_group() -> None:
    assert rank_info_from_env({"PATH": "/bin"}) == RankInfo()
    assert not RankInfo().distributed and RankInfo().is_writer


def test_torchrun_and_srun_variables_name_the_rank_and_world() -> None:
    master = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    torchrun = rank_info_from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "0"} | master)
    assert torchrun == RankInfo(3, 4, 0, "node0", 29500)
    assert torchrun.distributed and not torchrun.is_writer
    srun = rank_info_from_env(
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"} | master
    )
    assert srun == RankInfo(0, 2, 0, "node0", 29500) and srun.is_writer
    assert not rank_info_from_env({"RANK": "0", "WORLD_SIZE": "1"}).distributed  # torchrun, 1 node


def test_several_ranks_without_a_master_address_are_a_settings_error_naming_it() -> None:
    with pytest.raises(SettingsError, match="MASTER_ADDR"):
        rank_info_from_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"})
    with pytest.raises(SettingsError, match="RANK=2 is not a rank of WORLD_SIZE=2"):
        rank_info_from_env({"RANK": "2", "WORLD_SIZE": "2"})


# ---- each rank's share of an epoch --------------------------------------------------------------


def test_default_rank_and_world_size_give_todays_plan() -> None:
    today = plan_epoch(LENGTHS, BUDGET, SEED, 1)
    alone = plan_epoch(LENGTHS, BUDGET, SEED, 1, rank=0, world_size=1)
    assert [p.tolist() for p in alone] == [p.tolist() for p in today]


@pytest.mark.parametrize("world_size", [2, 3, 7])
def test_rank_shares_are_disjoint_equal_sized_and_cover_the_epoch(world_size: int) -> None:
    full = [p.tolist() for p in plan_epoch(LENGTHS, BUDGET, SEED, 0)]
    shares = [
        [p.tolist() for p in plan_epoch(LENGTHS, BUDGET, SEED, 0, rank=r, world_size=world_size)]
        for r in range(world_size)
    ]
    assert len({len(s) for s in shares}) == 1  # every rank makes the same number of steps
    assert len(shares[0]) == -(-len(full) // world_size)
    # step s of rank r is pack s*W + r of the whole plan; the padded tail repeats the first packs
    padded = full + full[: len(shares[0]) * world_size - len(full)]
    for rank, share in enumerate(shares):
        assert share == padded[rank::world_size]
    firsts = [pack for share in shares for pack in share[: len(full) // world_size]]
    assert sorted(map(tuple, firsts)) == sorted(map(tuple, full[: len(firsts)]))  # disjoint


def test_rank_shares_change_with_the_epoch_and_repeat_with_the_seed() -> None:
    def share(epoch: int) -> list[list[int]]:
        plan = plan_epoch(LENGTHS, BUDGET, SEED, epoch, rank=1, world_size=2)
        return [p.tolist() for p in plan]

    assert share(0) == share(0) and share(0) != share(1)


# ---- the watchdog and the start-up check (a real store, in this process) ------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master_store(world_size: int) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1",
        free_port(),
        world_size,
        is_master=True,
        timeout=timedelta(seconds=10),
        wait_for_workers=False,
    )


class Exits:
    """os._exit calls recorded instead of ending pytest (the watchdog thread then stops)."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self._done = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self._done.set()  # returns: the test stops the watchdog

    def wait(self) -> bool:
        return self._done.wait(10)


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> Exits:
    recorder = Exits()
    monkeypatch.setattr(distributed.os, "_exit", recorder)
    monkeypatch.setattr(distributed, "BEAT_S", 0.05)
    return recorder


def test_watchdog_ends_the_process_when_a_peer_falls_silent(exits) -> None:
    store = master_store(2)
    watchdog = Watchdog(store, RankInfo(0, 2), silence_s=0.5, log=get_logger("test"))
    with capture_logs() as events:
        watchdog.start()
        assert exits.wait()  # rank 1 never beats
        watchdog.stop()
    assert set(exits.codes) == {1}
    lost = [e for e in events if e["event"] == "peer_lost"]
    assert lost[0]["reason"] == "silent" and lost[0]["peer"] == 1


def test_watchdog_ends_the_process_at_once_when_a_peer_failed(exits) -> None:
    store = master_store(2)
    store.set("failed", "1")
    watchdog = Watchdog(store, RankInfo(0, 2), silence_s=60, log=get_logger("test"))
    with capture_logs() as events:
        watchdog.start()
        assert exits.wait()
        watchdog.stop()
    assert {e["reason"] for e in events if e["event"] == "peer_lost"} == {"failed"}


def test_a_stopped_watchdog_never_ends_the_process(exits) -> None:
    store = master_store(2)
    watchdog = Watchdog(store, RankInfo(0, 2), silence_s=0.2, log=get_logger("test"))
    watchdog.start()
    watchdog.stop()
    store.set("failed", "1")
    threading.Event().wait(0.3)
    assert exits.codes == []


def test_ranks_that_plan_different_runs_are_refused_naming_the_difference() -> None:
    store = master_store(2)
    errors: list[BaseException] = []

    def rank(r: int, drafters: int) -> None:
        info = RankInfo(r, 2, store=store)
        try:
            check_same_run(info, timeout_s=10, samples=40, drafters=drafters)
        except SettingsError as error:
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(r, d)) for r, d in ((0, 2), (1, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 2 and all("drafters=" in str(e) for e in errors)
    check_same_run(RankInfo(), timeout_s=1, samples=1)  # one node: nothing to agree on
