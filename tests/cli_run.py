"""Waiting for a CLI process that a test started: its deadline, and its exit code and output.

One place for them, so that the CLI tests (test_cli, test_cli_contract) fail the same way, within
the same time, when a command hangs.
"""

from __future__ import annotations

import subprocess

import pytest

PROCESS_DEADLINE_S = 90  # a process here ends in ~2-15 s (imports included); past this it hangs


def finish(process: subprocess.Popen[bytes]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr); a process that does not end in time fails the test."""
    try:
        out, err = process.communicate(timeout=PROCESS_DEADLINE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail(f"{process.args} did not end within {PROCESS_DEADLINE_S} s")
    return process.returncode, out.decode(), err.decode()
