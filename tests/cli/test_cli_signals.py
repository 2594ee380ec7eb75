"""SIGINT and SIGTERM for every command but `run` (test_signals.py has run's safe stops): each
command in a subprocess, signalled once it printed an event that shows it is mid-work, ends with
130 (SIGINT) or 143 (SIGTERM), one `<command>_interrupted` log line naming the signal, no
traceback, and what it had completed still on disk (nothing partial: its writes are atomic).

eval and regenerate run for real on the built-in tiny target, with far more work than the time a
stop takes (~20 s or more left when signalled); report and bench run the CLI's main() with the
command's work replaced by a wait, since the handling is the dispatch's, shared by all commands.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cli_run import finish

from dflash_async.atomic import stale_siblings
from dflash_async.targets.tiny import ensure_tiny_target

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
SIGNALS = pytest.mark.parametrize("signum", list(EXIT_CODES), ids=["SIGINT", "SIGTERM"])
STOP_WITHIN_S = 10.0  # from the signal to the exit; the work left takes ~20 s or more
START_DEADLINE_S = 90  # imports and the tiny target's load take ~3-10 s

# main() with a command's work replaced by: print an event, then wait to be stopped
WAITING = """
import importlib, json, sys, time
module, name = sys.argv[1].rsplit(":", 1)
def wait(*args, **kwargs):
    print(json.dumps({"event": "waiting"}), flush=True)
    time.sleep(120)
setattr(importlib.import_module(module), name, wait)
from dflash_async.__main__ import main
sys.exit(main(sys.argv[2:]))
"""


def start(argv: list[str], cwd: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("DFLASH_")}
    env |= {"CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, *argv], env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def wait_for(process: subprocess.Popen[bytes], event: str, **fields: Any) -> list[dict]:
    """Stdout events up to the first `event` one with these fields (the process keeps running)."""
    assert process.stdout is not None
    fd, deadline, buffer, events = (
        process.stdout.fileno(),
        time.monotonic() + START_DEADLINE_S,
        b"",
        [],
    )
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        chunk = os.read(fd, 1 << 16) if ready else b""
        if ready and not chunk:
            break  # the process exited
        *lines, buffer = (buffer + chunk).split(b"\n")
        for line in lines:
            events.append(json.loads(line))
            if events[-1]["event"] == event and fields.items() <= events[-1].items():
                return events
    process.kill()
    pytest.fail(f"no {event} {fields} event; exit {process.wait()}: {events[-3:]}")


def stop(process: subprocess.Popen[bytes], signum: int) -> tuple[int, float, list[dict], str]:
    """(exit code, seconds from the signal to the exit, the later stdout events, stderr)."""
    sent = time.monotonic()
    process.send_signal(signum)
    code, out, err = finish(process)
    return code, time.monotonic() - sent, [json.loads(line) for line in out.splitlines()], err


def assert_interrupted(command: str, signum: int, result: tuple[int, float, list, str]) -> None:
    code, elapsed, events, err = result
    assert (code, "Traceback" in err) == (EXIT_CODES[signum], False), err
    assert err == ""
    assert elapsed < STOP_WITHIN_S
    (interrupted,) = [e for e in events if e["event"] == f"{command}_interrupted"]
    assert interrupted["reason"] == signal.Signals(signum).name
    assert events[-1] == interrupted  # the last word, and nothing was completed after it


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny target, a drafter export for it, and 30 conversations to regenerate (each ~1 s
    on the CPU: regenerate keeps torch's threads, which contend on busy cores)."""
    from transformers import Qwen3Config

    from dflash_async.checkpoint.export import export_drafter
    from dflash_async.model.drafter import DFlashDrafter
    from dflash_async.model.drafter_config import drafter_config_from_target
    from dflash_async.targets.tiny import tiny_tokenizer

    root = tmp_path_factory.mktemp("cli_signals")
    target = ensure_tiny_target(root / "cache")
    config = drafter_config_from_target(
        Qwen3Config.from_pretrained(target),
        num_hidden_layers=1,
        num_features=2,
        block_size=4,
        mask_token_id=tiny_tokenizer().mask_token_id,
    )
    drafter = export_drafter(DFlashDrafter(config), config, root / "drafter")
    conversations = root / "conversations.jsonl"
    lines = [{"messages": [{"role": "user", "content": f"Count to {i}."}]} for i in range(30)]
    conversations.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return {"target": target, "drafter": drafter, "conversations": conversations}


def eval_argv(tiny: dict[str, Path], out: Path, num_prompts: int = 64) -> list[str]:
    """Prompts one at a time, 256 new tokens each: per prompt ~0.4 s of baseline (64: ~25 s), then
    ~0.7 s of speculation."""
    return [
        "-m",
        "dflash_async",
        "eval",
        "--target",
        str(tiny["target"]),
        "--drafter",
        str(tiny["drafter"]),
        "--device",
        "cpu",
        "--num-prompts",
        str(num_prompts),
        "--batch-size",
        "1",
        "--max-new-tokens",
        "256",
        "--baseline-dir",
        str(out / "base"),
        "--results",
        str(out / "results.jsonl"),
    ]


@SIGNALS
def test_eval_stopped_mid_baseline_exits_130_or_143_without_traceback(
    tiny: dict[str, Path], tmp_path: Path, signum: int
) -> None:
    process = start(eval_argv(tiny, tmp_path), tmp_path)
    wait_for(process, "progress_reported", task="eval baseline (batches)")
    assert_interrupted("eval", signum, stop(process, signum))
    assert sorted(os.listdir(tmp_path)) == ["base"]  # no results, no temporary left behind
    assert os.listdir(tmp_path / "base") == []  # the baseline was not complete: not kept


def test_eval_sigterm_mid_speculation_keeps_the_completed_baseline(
    tiny: dict[str, Path], tmp_path: Path
) -> None:
    process = start(eval_argv(tiny, tmp_path, num_prompts=30), tmp_path)
    wait_for(process, "progress_reported", task="eval speculative (batches)")  # 3 done of 30
    assert_interrupted("eval", signal.SIGTERM, stop(process, signal.SIGTERM))
    (baseline,) = (tmp_path / "base").iterdir()  # written when the baseline ended: whole
    assert len(baseline.read_text().splitlines()) == 1 + 30  # its header line, then the samples
    assert sorted(os.listdir(tmp_path)) == ["base"]


@SIGNALS
def test_regenerate_stopped_mid_generation_exits_130_or_143_keeping_the_finished_shards(
    tiny: dict[str, Path], tmp_path: Path, signum: int
) -> None:
    output = tmp_path / "regenerated"
    argv = [
        "-m",
        "dflash_async",
        "regenerate",
        "--input",
        str(tiny["conversations"]),
        "--output",
        str(output),
        "--target",
        str(tiny["target"]),
        "--batch-size",
        "1",
        "--max-new-tokens",
        "64",
        "--records-per-shard",
        "3",
    ]
    process = start(argv, tmp_path)
    wait_for(process, "regenerate_shard_written")  # 3 done of 30
    assert_interrupted("regenerate", signum, stop(process, signum))
    manifest = json.loads((output / "regenerate.manifest").read_text())
    finished = [shard["file"] for shard in manifest["progress"]["shards"]]
    assert finished and not manifest["progress"]["complete"]
    for name in finished:  # every recorded shard is whole
        assert len((output / name).read_text().splitlines()) == 3
    assert all(stale_siblings(output / name) == [] for name in [*finished, "regenerate.manifest"])


@SIGNALS
@pytest.mark.parametrize(
    ("command", "work"),
    [
        (["report", "runs/a"], "dflash_async.runlog.command:report"),
        (["bench", "packing"], "dflash_async.bench.packing_bench:main"),
    ],
    ids=["report", "bench"],
)
def test_report_and_bench_exit_130_or_143_without_traceback(
    tmp_path: Path, command: list[str], work: str, signum: int
) -> None:
    process = start(["-c", WAITING, work, *command], tmp_path)
    wait_for(process, "waiting")
    assert_interrupted(command[0], signum, stop(process, signum))
