"""A short real run through the CLI: its folder is the record (log.jsonl = stdout, settings.json,
run_summary), its report's numbers equal the log lines', and TensorBoard holds the step scalars.

One run of the tiny target (12 steps, a save every 5, an evaluation every 6 and at the end, 2
prompts of 8 tokens) is shared by the tests of this module: ~10 s on 2 cores.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import statistics
import warnings
from pathlib import Path
from typing import Any

import pytest
import structlog
from tiny_run import tiny_run_settings

from dflash_async.__main__ import main
from dflash_async.eval.regenerate import write_jsonl
from dflash_async.log import close_log_file
from dflash_async.runlog.page import write_report
from dflash_async.runlog.parse import read_runs
from dflash_async.runlog.plots import FIGURES
from dflash_async.targets.tiny import demo_prompts

pytestmark = pytest.mark.timeout(180)
STEPS = 12


def _settings(root: Path) -> dict[str, str]:
    settings = tiny_run_settings(root, root / "cache")
    write_jsonl(demo_prompts(2, split="heldout", multi_turn=False), root / "prompts.jsonl")
    return settings | {
        "DFLASH_LOG__TENSORBOARD_DIR": str(root / "out" / "tb"),
        "DFLASH_TRAIN__MAX_STEPS": str(STEPS),
        "DFLASH_TRAIN__SAVE_EVERY": "5",
        "DFLASH_EVAL__EVERY": "6",
        "DFLASH_EVAL__NUM_PROMPTS": "2",
        "DFLASH_EVAL__MAX_NEW_TOKENS": "8",
        "DFLASH_EVAL__PROMPTS_PATH": str(root / "prompts.jsonl"),
    }


def _run_cli(root: Path, **overrides: str) -> dict[str, Any]:
    """`python -m dflash_async run` in this process (stdout captured); logging put back after."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("DFLASH_")}
    saved_env, handlers = dict(os.environ), list(logging.getLogger().handlers)
    showwarning = warnings.showwarning
    os.environ.clear()
    os.environ.update(env | _settings(root) | overrides)
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            code = main(["run"])
    finally:
        close_log_file()
        os.environ.clear()
        os.environ.update(saved_env)
        logging.getLogger().handlers = handlers
        warnings.showwarning = showwarning
        structlog.reset_defaults()
    return {"code": code, "stdout": stdout.getvalue(), "out": root / "out"}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run_cli(tmp_path_factory.mktemp("report_run"))


def _lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_the_run_folder_is_the_record(run: dict[str, Any]) -> None:
    assert run["code"] == 0
    out: Path = run["out"]
    assert (out / "log.jsonl").read_text() == run["stdout"]  # the same lines as stdout
    record = json.loads((out / "settings.json").read_text())
    assert record["settings"]["train"]["max_steps"] == STEPS
    assert set(record["versions"]) >= {"python", "torch", "transformers", "dflash_async"}
    events = _lines(run["stdout"])
    assert events[-1]["event"] == "run_summary" and events[-1]["exit_reason"] == "completed"
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    assert all(e["total_steps"] == STEPS for e in steps)
    assert steps[-1]["eta_s"] == 0.0 and all(e["eta_s"] is None or e["eta_s"] >= 0 for e in steps)
    assert set(steps[-1]["worker_busy"]) == {"target0", "drafter0"}


def test_report_of_the_run_has_every_plot_and_numbers_equal_to_the_lines(
    run: dict[str, Any], tmp_path: Path
) -> None:
    page = write_report(read_runs([run["out"]]), tmp_path).read_text()
    for name in FIGURES:
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000  # a drawn figure, not a stub
        assert f'id="{name}"' in page
    assert '<table id="summary">' in page
    (summary,) = json.loads((tmp_path / "summary.json").read_text()).values()
    events = _lines((run["out"] / "log.jsonl").read_text())
    steps = [e for e in events if e["event"] == "step"]
    steady = steps[max(1, len(steps) // 10) :]
    assert summary["median_tokens_per_s"] == statistics.median(e["tokens_per_s"] for e in steady)
    assert summary["median_mfu"] is None and not any("mfu" in e for e in steps)  # a CPU run
    assert summary["gpu"] is False and summary["world_size"] == 1  # the tiny run: one CPU node
    assert "<td>– (CPU run)</td>" in page  # its MFU is against a GPU's peak: not shown
    assert summary["median_padding_frac"] == statistics.median(e["padding_frac"] for e in steady)
    assert summary["steady_mem_gib"] == statistics.median(e["mem_gib"] for e in steady)
    assert summary["final_loss"] == steps[-1]["loss"]
    assert summary["last_eval_tau"] == [e for e in events if e["event"] == "eval"][-1]["tau"]
    assert summary["eval_lost_s"] > 0 and summary["save_lost_s"] > 0  # 2 evals, 3 saves ran
    (run_summary,) = [e for e in events if e["event"] == "run_summary"]
    for key in ("median_tokens_per_s", "median_mfu", "eval_lost_s", "save_lost_s", "steps"):
        assert run_summary[key] == summary[key], key  # the run's own summary: the same code


def test_tensorboard_event_file_holds_the_step_scalars(run: dict[str, Any]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run["out"] / "tb"))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    assert {
        "train/loss",
        "train/acc",
        "train/tau_hat",
        "throughput/tokens_per_s",
        "pipeline/slot_queue",
        "worker_busy/drafter0",
    } <= tags
    steps = [e for e in _lines(run["stdout"]) if e["event"] == "step"]
    loss = accumulator.Scalars("train/loss")
    assert [s.step for s in loss] == list(range(1, STEPS + 1))
    # TensorBoard stores float32: relative error below 2**-24 of a float32 round trip
    assert [s.value for s in loss] == pytest.approx([e["loss"] for e in steps], rel=2**-23)


def test_a_failed_run_ends_its_log_with_the_reason_and_the_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dflash_async.stages.produce as produce

    real, calls = produce.fill_slot, []

    def failing_fill_slot(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("target failed on pack 4")
        return real(*args)

    monkeypatch.setattr(produce, "fill_slot", failing_fill_slot)
    result = _run_cli(tmp_path, DFLASH_EVAL__EVERY="0", DFLASH_EVAL__AT_END="false")
    assert result["code"] == 1
    events = _lines((result["out"] / "log.jsonl").read_text())
    summary, failed = events[-2:]
    assert summary["event"] == "run_summary"
    assert summary["exit_reason"] == "error: RuntimeError: target failed on pack 4"
    assert failed["event"] == "run_failed" and "target failed on pack 4" in str(failed)
