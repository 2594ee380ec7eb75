"""A full disk, as a user meets it: `python -m dflash_async run` in a child process (tiny target,
tiny settings) whose output filesystem is too small for the run's checkpoints exits 2 before
training with one line naming DFLASH_TRAIN__KEEP_CHECKPOINTS; one whose disk fills up during a
save keeps the previous checkpoint loadable, leaves no partial folder, logs `checkpoint_failed`
and exits 2 with one line. The space estimates themselves: test_checkpoint.py.

The child fakes what a test cannot make for real without root (a tiny filesystem): the free
space shutil.disk_usage reports, or a torch.save that writes part
of the file and then fails with ENOSPC, as a full disk makes a write fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import finish
from tiny_run import tiny_env, tiny_inputs

from dflash_async.checkpoint.state import list_checkpoints, load_checkpoint

REPO = Path(__file__).resolve().parents[2]

# Every filesystem has 64 KiB free (the tiny run needs ~1.5 MiB), as shutil.disk_usage says.
SMALL_FILESYSTEM = """
import shutil, sys
real_disk_usage = shutil.disk_usage
shutil.disk_usage = lambda path: real_disk_usage(path)._replace(free=64 << 10)
from dflash_async.__main__ import main
sys.exit(main(["run"]))
"""

# The second torch.save writes half its file, then fails as a full disk makes write(2) fail.
FULL_AT_SECOND_SAVE = """
import errno, io, os, sys, torch
from dflash_async.__main__ import main
real_save, calls = torch.save, []
def save(obj, path, *args, **kwargs):
    calls.append(path)
    if len(calls) < 2:
        return real_save(obj, path, *args, **kwargs)
    buffer = io.BytesIO()
    real_save(obj, buffer)
    open(path, "wb").write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
torch.save = save
sys.exit(main(["run"]))
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """DFLASH_* settings of a tiny CPU run of 4 steps with a checkpoint after each."""
    return tiny_env(tiny_inputs(tmp_path_factory.mktemp("disk_full"))) | {
        "DFLASH_LOG__FORMAT": "json",
        "DFLASH_TRAIN__MAX_STEPS": "4",
        "DFLASH_TRAIN__SAVE_EVERY": "1",
        "DFLASH_EVAL__AT_END": "false",
    }


def run_child(script: str, settings: dict[str, str], cwd: Path) -> tuple[int, list[dict], str]:
    """(exit code, stdout's JSON events, stderr) of `script` with a clean DFLASH_* environment."""
    environ = {k: v for k, v in os.environ.items() if not k.upper().startswith("DFLASH_")}
    environ |= settings | {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        env=environ,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    code, out, err = finish(process)
    return code, [json.loads(line) for line in out.splitlines() if line.strip()], err


def test_an_output_filesystem_too_small_for_the_checkpoints_exits_2_before_training(
    env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    code, events, err = run_child(SMALL_FILESYSTEM, env | {"DFLASH_OUTPUT_DIR": str(out)}, tmp_path)
    assert code == 2, err
    assert err.startswith(f"error: DFLASH_OUTPUT_DIR={out}: needs ~"), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "for 2+1 checkpoints and the export, 64.0 KiB free" in err
    assert "DFLASH_TRAIN__KEEP_CHECKPOINTS=2" in err
    names = [e["event"] for e in events]
    assert "drafter_ready" in names and "step" not in names  # refused once built, before training
    assert list_checkpoints(out) == []


def test_a_full_disk_at_the_second_save_keeps_the_first_checkpoint_and_exits_2(
    env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    code, events, err = run_child(
        FULL_AT_SECOND_SAVE, env | {"DFLASH_OUTPUT_DIR": str(out)}, tmp_path
    )
    assert code == 2, err
    partial = out / "checkpoints" / "step-00000002"
    (failed,) = [e for e in events if e["event"] == "checkpoint_failed"]
    assert (failed["step"], failed["path"]) == (2, str(partial))
    assert failed["needed_bytes"] > 0 and failed["free_bytes"] > 0
    assert err.startswith(f"error: no space left on device writing {partial} (needs ~"), err
    assert err.endswith(" free)\n") and err.count("\n") == 1 and "Traceback" not in err
    ((step, folder),) = list_checkpoints(out)  # the first checkpoint, complete
    assert step == 1 and load_checkpoint(folder)["step"] == 1
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000001"]
    assert "train_completed" not in [e["event"] for e in events]
