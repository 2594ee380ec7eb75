"""The run report from JSON logs: numbers equal to the lines', garbage counted, runs side by side.

Logs here are written by the tests with known timestamps, so every summary number has a value
derived by hand (or by `statistics` straight from the lines) to compare with.
"""

from __future__ import annotations

import json
import statistics
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dflash_async.__main__ import main
from dflash_async.runlog.page import ROWS, cell, write_report
from dflash_async.runlog.parse import read_run, read_runs
from dflash_async.runlog.plots import (
    FIGURES,
    busy_figure,
    learning_figure,
    step_time_figure,
    throughput_figure,
)
from dflash_async.runlog.summary import lost_seconds, startup_segments, summarize

pytestmark = pytest.mark.timeout(60)
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _at(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")


def _event(name: str, at: float, **fields: Any) -> dict[str, Any]:
    return {**fields, "event": name, "level": "info", "timestamp": _at(at)}


def synthetic_log(steps: int = 40, step_s: float = 0.5, first_step: int = 1) -> list[dict]:
    """Start-up (2 s data, 3 s target, drafter 4 s = 1 build + 2 warm-up + 1 capture), an eval
    of 6 s before training, steps every `step_s` with a 2 s save after step 10 and a 5 s eval
    after step 20, a final save of 1 s and eval of 3 s."""
    events = [_event("settings_loaded", 0.0), _event("data_loaded", 2.0, load_s=2.0)]
    events.append(_event("run_started", 2.0, total_steps=steps))
    events.append(
        _event("drafter_ready", 9.0, device="cuda:0", startup_s=4.0, warmup_s=2.0, capture_s=1.0)
    )
    events += [
        _event("startup_completed", 9.0, startup_s=9.0),
        _event("eval", 15.0, step=0, tau=1.0),
    ]
    t = 15.0
    for i in range(steps):
        step = first_step + i
        t += step_s
        workers = {"target0": 0.5 + 0.01 * (i % 7), "drafter0": 0.9 - 0.01 * (i % 5)}
        events.append(
            _event(
                "step",
                t,
                step=step,
                total_steps=first_step + steps - 1,
                loss=8.0 - 0.1 * i,
                acc=0.01 * i,
                tau_hat=1 + 0.05 * i,
                tokens_per_s=1000.0 + 37 * (i % 11),
                mfu=0.2 + 0.003 * (i % 13),
                padding_frac=0.01 * (i % 4),
                step_ms=step_s * 1e3 + i % 3,
                mem_gib=10.0 + min(i, 5),
                slot_queue=i % 3,
                target_busy=0.5,
                drafter_busy=0.9,
                worker_busy=workers,
                supply_tokens_per_s=1100.0,
                demand_tokens_per_s=1000.0 + i,
            )
        )
        if step == first_step + 9:
            t += 2.0
            events.append(_event("checkpoint_written", t, step=step))
        if step == first_step + 19:
            t += 5.0
            events.append(_event("eval", t, step=step, tau=1.5))
    events += [
        _event("checkpoint_written", t + 1.0, step=step),
        _event("eval", t + 4.0, step=step, tau=2.0),
    ]
    events.append(_event("train_completed", t + 4.0, steps=steps))
    return events


def write_log(path: Path, events: list[dict], garbage: list[str] = ()) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(e) for e in events]
    for i, bad in enumerate(garbage):
        lines.insert(3 + 7 * i, bad)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_summary_numbers_equal_those_computed_from_the_lines(tmp_path: Path) -> None:
    events = synthetic_log()
    run = read_run(write_log(tmp_path / "a" / "log.jsonl", events))
    summary = summarize(run)
    steps = [e for e in events if e["event"] == "step"]
    steady = steps[4:]  # the first 10% of 40 step lines skipped
    for key, field in [
        ("median_tokens_per_s", "tokens_per_s"),
        ("median_mfu", "mfu"),
        ("median_padding_frac", "padding_frac"),
        ("median_step_ms", "step_ms"),
        ("steady_mem_gib", "mem_gib"),
    ]:
        assert summary[key] == statistics.median(e[field] for e in steady), key
    # eval: 6 s before the first step, a step gap of 0.5 + 5 s (0.5 typical), 3 s after the
    # final save; saves: the 2.5 s gap less 0.5, and 1 s after the last step. Float tolerance:
    # timestamps carry microseconds, so sums of a few of them agree to ~1e-5 s.
    assert summary["eval_lost_s"] == pytest.approx(6.0 + 5.0 + 3.0, abs=1e-5)
    assert summary["save_lost_s"] == pytest.approx(2.0 + 1.0, abs=1e-5)
    assert (summary["steps"], summary["last_step"], summary["total_steps"]) == (40, 40, 40)
    assert summary["final_loss"] == steps[-1]["loss"] and summary["last_eval_tau"] == 2.0
    assert summary["wall_s"] == pytest.approx(15 + 40 * 0.5 + 7 + 4, abs=1e-5)
    assert summary["exit_reason"] == "completed (no run_summary)" and summary["bad_lines"] == 0


def test_run_summary_event_names_the_exit_reason(tmp_path: Path) -> None:
    events = [*synthetic_log(10), _event("run_summary", 60.0, exit_reason="interrupted (SIGINT)")]
    assert summarize(read_run(write_log(tmp_path / "log.jsonl", events)))["exit_reason"] == (
        "interrupted (SIGINT)"
    )


def test_startup_breakdown_splits_drafter_ready_into_load_build_warmup_capture(
    tmp_path: Path,
) -> None:
    run = read_run(write_log(tmp_path / "log.jsonl", synthetic_log(5)))
    assert startup_segments(run) == [
        ("data (read, tokenize)", 2.0),
        ("target load", 3.0),
        ("drafter build cuda:0", 1.0),
        ("warm-up + compile cuda:0", 2.0),
        ("graph capture cuda:0", 1.0),
    ]


GARBAGE = [
    "Traceback (most recent call last):",
    '{"step": 3, "loss": 4.',
    "[1, 2]",
    '{"no_event": true}',
    "\x00\x01 binary \ufffd",
]


@pytest.fixture(scope="module")
def garbage_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(run folder, report folder) of the synthetic log with GARBAGE lines and a cut-off end."""
    root = tmp_path_factory.mktemp("garbage")
    folder = root / "run"
    write_log(folder / "log.jsonl", synthetic_log(), GARBAGE)
    with (folder / "log.jsonl").open("a") as f:
        f.write('{"event": "step", "step": 41, "lo')  # cut off by a kill, no newline
    write_report(read_runs([folder]), root / "report")
    return folder, root / "report"


def test_garbage_lines_are_counted_and_skipped(garbage_report: tuple[Path, Path]) -> None:
    _, out = garbage_report
    summary = json.loads((out / "summary.json").read_text())["run"]
    assert summary["bad_lines"] == len(GARBAGE) + 1
    assert summary["steps"] == 40
    page = (out / "report.html").read_text()
    assert f"<td>bad log lines skipped</td><td>{len(GARBAGE) + 1}</td>" in page


def test_report_has_every_figure_inline_and_the_summary_table(
    garbage_report: tuple[Path, Path],
) -> None:
    folder, out = garbage_report
    page = (out / "report.html").read_text()
    for name in FIGURES:
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f'id="{name}" alt="{name}" src="data:image/png;base64,' in page
    summary = summarize(read_run(folder))
    for key, (label, _) in ROWS.items():
        assert f"<td>{label}</td><td>{cell(key, summary)}</td>" in page


def test_two_runs_side_by_side_share_axes(tmp_path: Path) -> None:
    short = write_log(tmp_path / "short" / "log.jsonl", synthetic_log(20, step_s=0.5))
    long = write_log(tmp_path / "long" / "log.jsonl", synthetic_log(60, step_s=0.25))
    runs = read_runs([short.parent, long.parent])
    learning = learning_figure(runs)
    loss_axes = learning.axes[0]
    assert len([line for line in loss_axes.lines if line.get_label() in ("short", "long")]) == 2
    low, high = loss_axes.get_xlim()
    assert low <= 1 and high >= 60  # one axis spans both runs' steps
    assert all(ax.get_shared_x_axes().joined(loss_axes, ax) for ax in learning.axes[:4])
    busy = busy_figure(runs)
    first, second = busy.axes[:2]
    assert first.get_shared_x_axes().joined(first, second)
    assert first.get_shared_y_axes().joined(first, second)
    assert [ax.get_title() for ax in busy.axes[:2]] == ["short", "long"]
    hist = step_time_figure(runs).axes[0]  # one set of bins for both runs
    edges = [tuple(round(p.get_x(), 9) for p in c.patches) for c in hist.containers]
    assert len(edges) == 2 and edges[0] == edges[1]


def test_same_named_runs_get_distinct_names(tmp_path: Path) -> None:
    a = write_log(tmp_path / "x" / "run" / "log.jsonl", synthetic_log(3))
    b = write_log(tmp_path / "y" / "run" / "log.jsonl", synthetic_log(3))
    assert [r.name for r in read_runs([a.parent, b.parent])] == ["x/run", "y/run"]


def test_a_resumed_log_keeps_the_last_line_of_a_repeated_step(tmp_path: Path) -> None:
    first = synthetic_log(12)
    second = [e for e in synthetic_log(10, first_step=8) if e["event"] == "step"]
    for e in second:
        e["loss"] = -1.0  # the resumed run's values
    run = read_run(write_log(tmp_path / "run" / "log.jsonl", first + second))
    steps, losses = run.series("loss")
    assert steps == list(range(1, 18))
    assert losses[7:] == [-1.0] * 10


def test_lost_time_is_zero_without_eval_or_save(tmp_path: Path) -> None:
    events = [e for e in synthetic_log(8) if e["event"] not in ("eval", "checkpoint_written")]
    assert lost_seconds(read_run(write_log(tmp_path / "log.jsonl", events))) == {
        "eval": 0.0,
        "save": 0.0,
    }


@pytest.mark.filterwarnings("error")  # no "no artists with labels" from empty figures
def test_report_command_reports_a_run_that_failed_before_its_first_step_and_exits_2_on_a_missing_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "run"
    events = [e for e in synthetic_log(5) if e["event"] in ("settings_loaded", "data_loaded")]
    write_log(folder / "log.jsonl", [*events, _event("run_summary", 3.0, exit_reason="error: X")])
    assert main(["report", str(folder)]) == 0
    assert (
        "<td>exit reason</td><td>error: X</td>" in (folder / "report" / "report.html").read_text()
    )
    assert json.loads(capsys.readouterr().out)["event"] == "report_written"
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path / "nowhere") in err


def test_progress_events_in_start_up_merge_into_their_task_phase(tmp_path: Path) -> None:
    events = [_event("settings_loaded", 0.0)]
    events += [_event("progress_reported", 1.0 + i, task="regenerate (batches)") for i in range(4)]
    events += [_event("regenerate_completed", 4.5), _event("startup_completed", 5.0)]
    run = read_run(write_log(tmp_path / "log.jsonl", events))
    assert startup_segments(run) == [("regenerate", 4.5), ("other", 0.5)]


def _ranked(events: list[dict], rank: int, **changes: Any) -> list[dict]:
    """The events as one rank of a process group logs them (`rank` bound on each)."""
    return [{**e, "rank": rank, **(changes if e["event"] == "step" else {})} for e in events]


def _line(ax, label: str):
    (line,) = [line for line in ax.lines if line.get_label() == label]
    return line


def test_report_of_two_ranks_shows_all_node_throughput(tmp_path: Path) -> None:
    # log.jsonl of a 2-rank run: rank 0's lines alone, the world size in process_group_joined
    events = synthetic_log(20)
    events.insert(1, _event("process_group_joined", 0.5, world_size=2))
    run = read_run(write_log(tmp_path / "run" / "log.jsonl", _ranked(events, 0)))
    summary = summarize(run)
    per_node = statistics.median(e["tokens_per_s"] for e in run.steps[2:])
    assert summary["world_size"] == 2 and summary["median_tokens_per_s"] == per_node
    assert summary["median_all_node_tokens_per_s"] == 2 * per_node
    top = throughput_figure([run]).axes[0]
    node = _line(top, "run: rank 0's node").get_ydata()
    assert list(node) == [e["tokens_per_s"] for e in run.steps]
    whole = _line(top, "run: all 2 nodes (rank 0's × 2)").get_ydata()
    assert list(whole) == [2 * e["tokens_per_s"] for e in run.steps]
    assert "all nodes" in top.get_ylabel()


def test_a_log_of_every_rank_keeps_rank_0s_step_lines_and_counts_the_ranks(
    tmp_path: Path,
) -> None:
    # torchrun's stdout of both ranks: every step twice, rank 1's after rank 0's
    rank0, rank1 = _ranked(synthetic_log(10), 0), _ranked(synthetic_log(10), 1, loss=-1.0)
    merged = [e for pair in zip(rank0, rank1, strict=True) for e in pair]
    run = read_run(write_log(tmp_path / "log.jsonl", merged))
    assert run.series("loss")[1] == [e["loss"] for e in rank0 if e["event"] == "step"]
    assert run.world_size == 2


def _cpu(events: list[dict]) -> list[dict]:
    """The synthetic run on CPU: the drafter's device and the step lines' busy device."""
    return [
        {**e, "device": "cpu"}
        if e["event"] == "drafter_ready"
        else {**e, "gpu_busy": {"cpu": 0.9}, "mem_gib": 0.0}
        if e["event"] == "step"
        else e
        for e in events
    ]


def test_a_cpu_run_has_no_mfu_against_the_h200_peak_and_a_gpu_run_names_the_peak(
    tmp_path: Path,
) -> None:
    cpu = read_run(write_log(tmp_path / "cpu" / "log.jsonl", _cpu(synthetic_log(10))))
    gpu = read_run(write_log(tmp_path / "gpu" / "log.jsonl", synthetic_log(10)))
    mfu_axes = throughput_figure([cpu]).axes[1]
    assert len(mfu_axes.lines) == 0 and "H200" not in mfu_axes.get_ylabel()
    assert cell("median_mfu", summarize(cpu)) == "– (CPU run)"
    assert summarize(cpu)["gpu"] is False and summarize(gpu)["gpu"] is True
    mfu_axes = throughput_figure([gpu]).axes[1]
    assert "780 TFLOP/s H200 bf16 peak" in mfu_axes.get_ylabel()
    assert len(_line(mfu_axes, "gpu: mfu").get_ydata()) == 10
    assert "780 TFLOP/s H200 bf16 peak" in ROWS["median_mfu"][0]


def test_a_resumed_runs_throughput_line_breaks_at_the_gap_and_skips_the_empty_rate(
    tmp_path: Path,
) -> None:
    # stopped after step 12 (t 21.5 s), resumed from the step-8 checkpoint at t 300 s
    first = [e for e in synthetic_log(12) if e["event"] != "train_completed"]
    second = [
        _event("settings_loaded", 300.0),
        _event("run_started", 301.0),
        _event("resumed", 302.0, step=8),
    ]
    second += [
        _event("step", 303.0 + i, step=9 + i, tokens_per_s=0.0 if i == 0 else 2000.0 + i)
        for i in range(10)
    ]
    run = read_run(write_log(tmp_path / "run" / "log.jsonl", first + second))
    line = _line(throughput_figure([run]).axes[0], "run")
    y, x = np.asarray(line.get_ydata()), np.asarray(line.get_xdata())
    (gap,) = np.flatnonzero(np.isnan(y))
    assert np.isnan(x[gap])
    before = [e["tokens_per_s"] for e in first if e["event"] == "step"][:8]
    assert list(y[:gap]) == before  # steps 1-8 of the first run (9-12 were redone)
    assert list(y[gap + 1 :]) == [2000.0 + i for i in range(1, 10)]  # the rate's empty 0 left out
    assert x[gap - 1] < 22 / 60 < 300 / 60 < x[gap + 1]  # minutes: the run spans > 3 minutes


@pytest.mark.parametrize(
    "text", ["", "\n\n", "\n".join(GARBAGE), '{"event": "something_else", "level": "info"}\n']
)
def test_report_of_a_file_holding_no_run_log_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    path = tmp_path / "captured.log"
    path.write_text(text)
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and str(path) in err
    assert not (tmp_path / "report").exists()


def test_a_resumes_restart_gap_is_not_time_lost_to_saves(tmp_path: Path) -> None:
    """Steps every 1 s; SIGINT after step 3 saves in 0.1 s; the resumed run starts 8.8 s later
    and trains on: 0.1 s lost to saving, not the restart (the gap of 8.8 s + start-up)."""
    events = [_event("startup_completed", 0.0)]
    events += [_event("step", float(i), step=i, loss=1.0) for i in (1, 2, 3)]
    events += [_event("checkpoint_written", 3.1, step=3)]
    events += [_event("settings_loaded", 11.9), _event("run_started", 12.0)]
    events += [_event("resumed", 14.0, step=3), _event("startup_completed", 15.0)]
    events += [_event("step", 15.0 + i, step=3 + i, loss=1.0) for i in (1, 2, 3)]
    lost = lost_seconds(read_run(write_log(tmp_path / "log.jsonl", events)))
    assert lost["eval"] == 0.0
    assert abs(lost["save"] - 0.1) < 1e-3  # microsecond timestamps: sums agree to ~1e-5 s


def test_busy_figure_draws_no_cpu_device_line(tmp_path: Path) -> None:
    """A CPU run's `gpu_busy` {"cpu": ...} is its workers' host time capped at 100%, not a
    device's: the figure shows the workers, not a flat 100% "gpu_busy: cpu"."""
    events = [_event("startup_completed", 0.0)]
    events += [
        _event(
            "step",
            float(i),
            step=i,
            gpu_busy={"cpu": 1.0},
            worker_busy={"target0": 0.4, "drafter0": 0.9},
        )
        for i in range(1, 6)
    ]
    run = read_run(write_log(tmp_path / "log.jsonl", events))
    labels = {line.get_label() for line in busy_figure([run]).axes[0].lines}
    assert {"worker_busy: target0", "worker_busy: drafter0"} <= labels
    assert not any("cpu" in label for label in labels)


def test_startup_legend_has_a_colour_per_phase_and_fits_the_figure(tmp_path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from dflash_async.runlog.plots import startup_figure

    events = [_event("settings_loaded", 0.0)]
    events += [_event(f"phase_{i:02d}_of_a_long_start_up", 1.0 + i) for i in range(14)]
    events += [_event("startup_completed", 20.0)]
    run = read_run(write_log(tmp_path / "log.jsonl", events))
    fig = startup_figure([run])
    FigureCanvasAgg(fig).draw()
    (legend,) = fig.legends
    colours = [tuple(h.get_facecolor()) for h in legend.legend_handles]
    assert len(colours) == 15 and len(set(colours)) == 15  # 14 phases + startup_completed's
    inside = fig.bbox
    box = legend.get_window_extent()
    assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 <= box.y1
