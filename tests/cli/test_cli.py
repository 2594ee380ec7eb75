"""The command line as a user meets it: exit codes, one-line errors, settings JSON, --help, SIGINT.

Most cases run `python -m dflash_async` in a subprocess with a clean DFLASH_* environment and no
visible GPU. Each such process spends ~4 s importing torch and transformers, so the cases that
need no interaction are started together by one module fixture and overlap on the cores.
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
from cli_run import PROCESS_DEADLINE_S, finish
from dotenv import dotenv_values
from tiny_run import tiny_run_settings

from dflash_async.__main__ import build_parser, main
from dflash_async.model.objective import DEFAULT_GAMMA
from dflash_async.settings.env import repo_root
from dflash_async.settings.recipe import TrainSettings

pytestmark = pytest.mark.timeout(120)
COMMANDS = ("run", "settings", "bench", "regenerate", "eval", "calibrate", "export")

# The CLI's own main() with the 4th pack's target forward failing: an internal error mid-run.
FAILING_RUN = """
import sys
import dflash_async.stages.produce as stage
real, calls = stage.fill_slot, []
def fill_slot(*args):
    calls.append(1)
    if len(calls) == 4:
        raise RuntimeError("target failed on pack 4")
    return real(*args)
stage.fill_slot = fill_slot
from dflash_async.__main__ import main
sys.exit(main(["run"]))
"""


def cli_env(**settings: str) -> dict[str, str]:
    """This process's environment without any DFLASH_* variable, plus `settings`, and no GPU
    (CUDA_VISIBLE_DEVICES empty: the "machine without CUDA" of these tests, on any host)."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("DFLASH_")}
    return env | {"CUDA_VISIBLE_DEVICES": ""} | settings


def start(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, *argv], env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def json_events(stdout: str) -> list[dict[str, Any]]:
    """Every stdout line is one JSON event (DFLASH_LOG__FORMAT=json)."""
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


# case -> (settings, the text the one error line must contain)
BAD_SETTINGS = {
    "misspelled_variable": ({"DFLASH_TRAIN__TOKEN_BUGDET": "1024"}, "DFLASH_TRAIN__TOKEN_BUGDET"),
    "not_a_number": ({"DFLASH_TRAIN__TOKEN_BUDGET": "lots"}, "DFLASH_TRAIN__TOKEN_BUDGET='lots'"),
    "missing_target_folder": (
        {"DFLASH_TARGET__PATH": "{root}/no_such_model"},
        "{root}/no_such_model",
    ),
    "gpu_index_without_cuda": (
        {"DFLASH_PIPELINE__DRAFTER_DEVICES": "3"},
        "DFLASH_PIPELINE__DRAFTER_DEVICES",
    ),
}


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def launched(tiny_root: Path) -> Any:
    """Every non-interactive CLI case, started at once; each test finishes its own."""
    root = tiny_root
    processes: dict[str, subprocess.Popen[bytes]] = {}
    for case, (settings, _) in BAD_SETTINGS.items():
        env = cli_env(**{k: v.format(root=root) for k, v in settings.items()})
        processes[case] = start(["-m", "dflash_async", "run"], env, root)
    run_root = root / "failing"
    run_root.mkdir()
    env = cli_env(**tiny_run_settings(run_root, root / "cache"))
    processes["failing_run"] = start(["-c", FAILING_RUN], env, run_root)
    yield processes
    for process in processes.values():  # a test that failed early may have left one running
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.mark.parametrize("case", list(BAD_SETTINGS))
def test_bad_settings_exit_2_with_one_line_naming_the_variable_or_path(
    case: str, launched: dict[str, subprocess.Popen[bytes]], tiny_root: Path
) -> None:
    code, out, err = finish(launched[case])
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert BAD_SETTINGS[case][1].format(root=tiny_root) in lines[0]
    assert "Traceback" not in out + err


def test_an_internal_error_mid_run_exits_1_with_the_traceback_in_the_json_log(
    launched: dict[str, subprocess.Popen[bytes]],
) -> None:
    code, out, err = finish(launched["failing_run"])
    assert code == 1, err
    events = json_events(out)
    assert any(e["event"] == "step" for e in events)  # it failed mid-run
    (failed,) = [e for e in events if "exception" in e]
    assert failed["level"] == "error"
    # __main__ logs it through stdlib logging, so the name lands in `message` (see report)
    assert "run_failed" in (failed["event"], failed.get("message"))
    assert "target failed on pack 4" in json.dumps(failed["exception"])
    assert "fill_slot" in json.dumps(failed["exception"])  # the frames, not just the message
    assert "Traceback" not in err


def test_sigint_mid_run_saves_a_checkpoint_and_exits_130(tiny_root: Path) -> None:
    root = tiny_root / "sigint"
    root.mkdir()
    settings = tiny_run_settings(root, tiny_root / "cache")
    process = start(["-m", "dflash_async", "run"], cli_env(**settings), root)
    try:
        head, rest = read_until_event(process, "step", PROCESS_DEADLINE_S)
        process.send_signal(signal.SIGINT)
        code, out, err = finish(process)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert code == 130, err
    events = head + json_events(rest + out)
    (saved,) = [e for e in events if e["event"] == "checkpoint_written"]
    (exported,) = [e for e in events if e["event"] == "export_written"]
    (interrupted,) = [e for e in events if e["event"] == "train_interrupted"]
    assert "train_completed" not in [e["event"] for e in events]
    assert 1 <= saved["step"] == interrupted["step"] < int(settings["DFLASH_TRAIN__MAX_STEPS"])
    assert min(saved["copy_s"], saved["waited_s"], saved["write_s"]) >= 0
    export = root / "out" / "drafter"
    assert (exported["path"], exported["step"]) == (str(export), saved["step"])
    assert sorted(p.name for p in export.iterdir()) == ["config.json", "model.safetensors"]


def read_until_event(
    process: subprocess.Popen[bytes], event: str, timeout_s: float
) -> tuple[list[dict[str, Any]], str]:
    """Stdout events up to and including the first `event` one, and the rest read so far."""
    assert process.stdout is not None
    deadline, buffer, events = time.monotonic() + timeout_s, b"", []
    fd = process.stdout.fileno()
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        chunk = os.read(fd, 1 << 16) if ready else b""
        if ready and not chunk:
            break  # end of output: the process exited
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for i, line in enumerate(lines):
            events.append(json.loads(line))
            if events[-1]["event"] == event:
                rest = b"\n".join([*lines[i + 1 :], buffer])
                return events, rest.decode()
    pytest.fail(f"no {event!r} event within {timeout_s} s; got {[e['event'] for e in events]}")


# ---- in this process: the settings command and --help (no run, no subprocess needed) --------


def test_settings_command_prints_the_effective_values_as_json(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [k for k in os.environ if k.upper().startswith("DFLASH_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("DFLASH_TRAIN__TOKEN_BUDGET", "2048")
    assert main(["settings"]) == 0
    settings = json.loads(capsys.readouterr().out)
    preset = dotenv_values(repo_root() / "settings" / "demo.env")  # the default preset
    train = settings["train"]
    assert train["token_budget"] == 2048  # from the environment, over the preset
    assert train["num_anchors"] == int(preset["DFLASH_TRAIN__NUM_ANCHORS"])  # from the preset
    assert train["gamma"] == DEFAULT_GAMMA[train["block_size"]]  # derived
    assert "DFLASH_TRAIN__GRAD_CLIP" not in preset
    assert train["grad_clip"] == TrainSettings.model_fields["grad_clip"].default  # a default
    assert settings["env_file"] == str(repo_root() / "settings" / "demo.env")


@pytest.fixture
def no_logging_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Commands configure logging process-wide (root handler on the sys.stdout that log.py saw
    at import, which may be a closed capture stream by now); --help output is argparse's."""
    monkeypatch.setattr("dflash_async.log.configure_logging", lambda *args, **kwargs: None)


@pytest.mark.usefixtures("no_logging_setup")
def test_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert all(command in out for command in COMMANDS)


@pytest.mark.usefixtures("no_logging_setup")
@pytest.mark.parametrize("command", COMMANDS)
def test_help_of_every_command_prints_its_usage_and_exits_0(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m dflash_async {command}")


def test_eval_passes_every_option_to_the_eval_parser() -> None:
    args = build_parser().parse_args(["eval", "--drafter", "runs/demo/drafter"])
    assert args.rest == ["--drafter", "runs/demo/drafter"]


@pytest.mark.usefixtures("no_logging_setup")
def test_eval_help_lists_the_options_of_eval(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["eval", "--help"])
    assert exited.value.code == 0
    assert "--drafter" in capsys.readouterr().out
