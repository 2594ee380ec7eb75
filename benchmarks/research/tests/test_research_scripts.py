"""The research scripts keep the CLI's contract for bad input when run as
`python benchmarks/research/<name>.py`: exit 2 with one line `error: ...` naming it, no traceback
(one real subprocess for the script entry and its imports, the rest in this process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import attention_bench
import graph_bench
import linear_bench
import pytest
import research_entry
import torch

from dflash_async.settings.env import repo_root

RESEARCH = Path(__file__).resolve().parents[1]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")


def assert_one_line_error(code: int, err: str, *expected: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for text in expected:
        assert text in lines[0], (text, lines[0])


def run_in_process(main, argv: list[str], capsys, monkeypatch) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["script", *argv])
    with pytest.raises(SystemExit) as exited:
        research_entry.run(main)
    return exited.value.code, capsys.readouterr().err


def test_a_script_run_by_path_exits_2_naming_a_bad_option() -> None:
    env = {**os.environ, "PYTHONPATH": str(repo_root())}
    argv = [sys.executable, str(RESEARCH / "attention_bench.py"), "--configs", "default,huge"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert_one_line_error(done.returncode, done.stderr, "--configs", "huge", "attention_bench.py")


@NO_CUDA
@pytest.mark.parametrize("script", [attention_bench, graph_bench, linear_bench])
def test_without_cuda_a_gpu_script_exits_2_at_once(script, capsys, monkeypatch) -> None:
    code, err = run_in_process(script.main, [], capsys, monkeypatch)
    name = Path(script.__file__).name
    assert_one_line_error(code, err, name, "CUDA")
