"""`launch` (pipeline/launch.py): torch's launcher starting 2 gloo CPU ranks of the tiny run,
with the node's exit kept to the command contract, where plain torchrun ends
with its own tracebacks and exit 1. Plus the exit mapping itself, without processes.

Each launch is `python -m dflash_async launch --standalone --nproc-per-node 2` in a subprocess;
a rank-only setting comes from a sitecustomize.py on the ranks' PYTHONPATH that changes one
DFLASH_* variable in rank 0 alone (on several nodes: a node whose environment differs).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_run import finish
from test_cli_signals import wait_for
from tiny_run import tiny_env, tiny_inputs

from dflash_async.pipeline.launch import Outcome, RankExit, outcome

ROOT = Path(__file__).resolve().parents[2]
RANK0_ONLY = """
import os
if os.environ.get("RANK") == "0":
    os.environ[{name!r}] = {value!r}
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return tiny_inputs(tmp_path_factory.mktemp("launch"))


def start_launch(
    env: dict[str, str], tmp: Path, *, rank0: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """The launcher of 2 CPU ranks with `env`; `rank0`: one variable changed in rank 0 only."""
    path = [str(ROOT)]
    if rank0 is not None:
        ((name, value),) = rank0.items()
        (tmp / "hook").mkdir()
        (tmp / "hook" / "sitecustomize.py").write_text(RANK0_ONLY.format(name=name, value=value))
        path.insert(0, str(tmp / "hook"))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_", "SLURM_"))}
    full = (
        base
        | env
        | {
            "PYTHONPATH": os.pathsep.join(path),
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": "lo",
            "CUDA_VISIBLE_DEVICES": "",
            "HF_HUB_OFFLINE": "1",
        }
    )
    command = [
        sys.executable,
        "-m",
        "dflash_async",
        "launch",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--log-dir",
        str(tmp / "logs"),
        "--",
        "run",
    ]
    return subprocess.Popen(
        command, env=full, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def run_env(tiny: dict[str, str], out: Path, **extra: str) -> dict[str, str]:
    return tiny_env(tiny, out) | {
        "DFLASH_TRAIN__MAX_STEPS": "3",
        "DFLASH_TRAIN__SAVE_EVERY": "0",
        "DFLASH_EVAL__AT_END": "false",
        "DFLASH_LOG__FORMAT": "json",
        **extra,
    }


def events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_launch_of_two_ranks_that_finish_exits_0_with_nothing_on_stderr(
    tiny: dict, tmp_path: Path
) -> None:
    code, out, err = finish(start_launch(run_env(tiny, tmp_path / "out"), tmp_path))
    assert (code, err) == (0, ""), out[-3000:]
    steps = [(e["rank"], e["step"]) for e in events(out) if e["event"] == "step"]
    assert sorted(steps) == [(r, s) for r in (0, 1) for s in (1, 2, 3)]
    assert (tmp_path / "out" / "drafter").is_dir()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["every_rank", "rank0_only"])
def test_launch_with_a_bad_setting_exits_2_with_one_error_line_and_no_traceback(
    tiny: dict, tmp_path: Path, where: str
) -> None:
    env = run_env(tiny, tmp_path / "out")
    bad = {"DFLASH_TRAIN__MAX_STEPS": "-1"}
    # rank0_only: rank 1 waits in the rendezvous for rank 0, which the agent's SIGTERM does not
    # cut short; the agent kills it 30 s later (torch's fixed wait after a failure: ~40 s here)
    process = (
        start_launch(env | bad, tmp_path)
        if where == "every_rank"
        else (start_launch(env, tmp_path, rank0=bad))
    )
    code, out, err = finish(process)
    assert code == 2, (out[-3000:], err)
    (line,) = err.splitlines()  # the rank's one line, once (every rank may print it)
    assert line.startswith("error: ") and "MAX_STEPS" in line, err
    assert "Traceback" not in err + out
    assert "peer_lost" not in out  # rank 1 did not blame rank 0's exit on a lost peer


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_launch_interrupted_after_the_first_step_exits_130_and_the_ranks_saved(
    tiny: dict, tmp_path: Path
) -> None:
    env = run_env(tiny, tmp_path / "out", DFLASH_TRAIN__MAX_STEPS="100000")
    process = start_launch(env, tmp_path)
    wait_for(process, "step")  # a rank trained one step
    process.send_signal(signal.SIGINT)  # what Ctrl-C sends the launcher (the ranks: via torch)
    sent = time.monotonic()
    code, out, err = finish(process)
    assert (code, err) == (130, ""), out[-3000:]
    assert time.monotonic() - sent < 30  # before the agent's SIGKILL (30 s)
    later = events(out)
    assert "Traceback" not in out
    assert {e["rank"] for e in later if e["event"] == "train_interrupted"} == {0, 1}
    (saved,) = [e for e in later if e["event"] == "export_written"]  # rank 0 saved the drafter
    assert (tmp_path / "out" / "drafter").is_dir() and saved["step"] >= 1
    assert later[-1]["event"] == "launch_interrupted" and later[-1]["reason"] == "SIGINT"


@pytest.mark.parametrize(
    ("failures", "expected"),
    [
        ([], Outcome(0)),
        # rank 1's peer_lost seen first: rank 0's bad input is still the cause
        (
            [RankExit(1, 1), RankExit(0, 2, "error: DFLASH_X: bad")],
            Outcome(2, "error: DFLASH_X: bad"),
        ),
        ([RankExit(1, 143), RankExit(0, 143)], Outcome(143)),  # srun's SIGTERM to every rank
        ([RankExit(0, 130)], Outcome(130)),
        (
            [RankExit(1, 1), RankExit(0, 143)],
            Outcome(1, "error: rank 1 failed with exit code 1 (its traceback is in its log)"),
        ),
        (
            [RankExit(0, -9)],
            Outcome(1, "error: rank 0 was killed by SIGKILL (its traceback is in its log)"),
        ),
    ],
    ids=["all_0", "bad_input", "srun_sigterm", "sigint", "internal", "killed"],
)
def test_rank_exits_map_to_one_exit_code_of_the_contract(
    failures: list[RankExit], expected: Outcome
) -> None:
    assert outcome(failures) == expected


def test_launch_sets_torchruns_omp_default_as_one_event_without_its_banner(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from data_samples import EventLog

    from dflash_async.pipeline.launch import launch_config

    monkeypatch.setenv("OMP_NUM_THREADS", "restored after the test")
    monkeypatch.delenv("OMP_NUM_THREADS")
    log = EventLog()
    with caplog.at_level(logging.WARNING, logger="torch.distributed.run"):
        launch_config(["--standalone", "--nproc-per-node", "2", "--", "run"], log=log)
    assert os.environ["OMP_NUM_THREADS"] == "1"  # what the ranks inherit, as torchrun sets it
    (event,) = log.events
    assert (event["event"], event["omp_num_threads"], event["ranks_per_node"]) == (
        "launch_omp_threads",
        1,
        2,
    )
    assert "*****" not in caplog.text  # torchrun's banner never printed
