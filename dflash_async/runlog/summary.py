"""The numbers of a run, from its log lines alone: the summary table and the `run_summary` event.

Steady state: the medians skip the first 10% of the step lines (at least one), where the rate
window is still filling and the first steps compile or warm caches.

Time lost to evaluation and saves is measured from the timestamps, so it is what training
actually lost whether those stages block the loop or overlap it:
- between two step lines that have eval (or save) events between them: the gap minus the median
  gap of step lines with nothing between them;
- before the first step line and after the last one (evaluation at start and end, the final save):
  from the previous of (startup_completed, step line, eval, save) to the event's own timestamp.
A gap holding both kinds counts as evaluation. A gap across a restart (a resumed run appends to
the same log: a new `settings_loaded`, `run_started` or `startup_completed` lies in it) is no
step's: the saves and evaluations before the restart count as before a run's end, each since
the previous event, and the restart itself (the process down, then starting) counts as neither.

Several nodes: a step line's `tokens_per_s` is its node's, and log.jsonl holds rank 0's lines
alone (no other rank's counts), so the all-node rate is rank 0's times the world size: exact up
to the ranks' padding, since data-parallel steps are synchronous (every step all-reduces the
gradients: one step time for all) and every rank trains the same token budget per step.

MFU is against the measured H200 bf16 peak (model/flops.py), so it is shown for GPU runs only.
"""

from __future__ import annotations

import itertools
import statistics
from typing import Any

from dflash_async.model.flops import H200_BF16_PEAK_FLOPS
from dflash_async.runlog.parse import RunLog, timestamp_s

MFU_PEAK = f"{H200_BF16_PEAK_FLOPS / 1e12:.0f} TFLOP/s H200 bf16 peak"

EVAL_EVENTS = frozenset({"eval"})
SAVE_EVENTS = frozenset({"checkpoint_written", "export_written"})  # stages/save.py
STEADY_SKIP_FRAC = 0.1
# a run (re)starting: in a resumed run's log, what separates its stretches
RESTART_EVENTS = ("settings_loaded", "run_started", "startup_completed")


def steady_steps(run: RunLog) -> list[dict[str, Any]]:
    """Step lines after the first 10% (at least one skipped when there are two or more)."""
    skip = max(1, int(len(run.steps) * STEADY_SKIP_FRAC)) if len(run.steps) > 1 else 0
    return run.steps[skip:]


def steady_median(run: RunLog, key: str) -> float | None:
    values = [e[key] for e in steady_steps(run) if isinstance(e.get(key), int | float)]
    return statistics.median(values) if values else None


def devices(run: RunLog) -> set[str]:
    """The devices the log names: each drafter's (`drafter_ready`) and each the step lines
    measure (`gpu_busy` keys: "cuda:0", "cpu")."""
    named = {str(e["device"]) for e in run.named("drafter_ready") if "device" in e}
    return named | {
        str(k) for e in run.steps if isinstance(e.get("gpu_busy"), dict) for k in e["gpu_busy"]
    }


def is_gpu_run(run: RunLog) -> bool:
    """A CUDA device among the log's devices. Device names, not `mfu` or `mem_gib`: every run
    logs an MFU (a CPU run's against the H200 peak too), and memory reads 0 on a GPU that
    reserved none yet; `mem_gib` > 0 decides only for a log that names no device."""
    named = devices(run)
    if named:
        return any(d.startswith("cuda") for d in named)
    return (steady_median(run, "mem_gib") or 0.0) > 0


def _kind(event: dict[str, Any]) -> str | None:
    name = event["event"]
    return "eval" if name in EVAL_EVENTS else "save" if name in SAVE_EVENTS else None


def lost_seconds(run: RunLog) -> dict[str, float]:
    """{"eval": s, "save": s} of wall time training lost to them (see the module docstring)."""
    lost = {"eval": 0.0, "save": 0.0}
    timeline = [
        (t, e)
        for e in run.events
        if (e["event"] in ("step", *RESTART_EVENTS) or _kind(e))
        and (t := timestamp_s(e)) is not None
    ]
    step_idx = [i for i, (_, e) in enumerate(timeline) if e["event"] == "step"]
    if not step_idx:
        _add_outside(timeline, lost)
        return lost
    first, last = step_idx[0], step_idx[-1]
    _add_outside(timeline[: first + 1], lost)
    _add_outside(timeline[last:], lost)
    gaps = []  # (gap seconds, kind of the events between, or None)
    for a, b in itertools.pairwise(step_idx):
        restart = next(
            (i for i in range(a + 1, b) if timeline[i][1]["event"] in RESTART_EVENTS), None
        )
        if restart is not None:  # the end of one run, then the next one's start
            _add_outside(timeline[a:restart], lost)
            _add_outside(timeline[restart:b], lost)
            continue
        kinds = {_kind(e) for _, e in timeline[a + 1 : b]} - {None}
        kind = "eval" if "eval" in kinds else ("save" if kinds else None)
        gaps.append((timeline[b][0] - timeline[a][0], kind))
    plain = [g for g, kind in gaps if kind is None]
    typical = statistics.median(plain) if plain else 0.0
    for gap, kind in gaps:
        if kind is not None:
            lost[kind] += max(0.0, gap - typical)
    return lost


def _add_outside(timeline: list[tuple[float, dict[str, Any]]], lost: dict[str, float]) -> None:
    """Eval/save events outside the steps: each lasted since the previous timeline event."""
    for (t0, _), (t1, event) in itertools.pairwise(timeline):
        kind = _kind(event)
        if kind is not None:
            lost[kind] += max(0.0, t1 - t0)


def startup_segments(run: RunLog) -> list[tuple[str, float]]:
    """(phase, seconds) from the first event to `startup_completed`, in order.

    Each gap between two start-up events is named after the event that closes it (what just
    finished). A `drafter_ready` gap is split by its own fields: the time before the drafter build
    started (loading the target workers, for the first drafter), the build, warm-up (compile and
    autotune on GPU) and graph capture.
    """
    end = next((i for i, e in enumerate(run.events) if e["event"] == "startup_completed"), None)
    if end is None:
        return []
    timed = [(t, e) for e in run.events[: end + 1] if (t := timestamp_s(e)) is not None]
    segments: list[tuple[str, float]] = []
    for (t0, _), (t1, event) in itertools.pairwise(timed):
        gap = max(0.0, t1 - t0)
        if event["event"] == "drafter_ready":
            segments += _drafter_segments(event, gap)
        elif gap > 0:
            segments.append((_phase_name(event), gap))
    merged: list[tuple[str, float]] = []  # progress events split one phase into many gaps
    for name, seconds in segments:
        if merged and merged[-1][0] == name:
            merged[-1] = (name, merged[-1][1] + seconds)
        else:
            merged.append((name, seconds))
    return merged


_PHASE_NAMES = {
    "demo_corpus_ready": "demo corpus",
    "regenerate_completed": "regenerate",
    "data_loaded": "data (read, tokenize)",
    "run_started": "plan packs",
    "startup_completed": "other",
}


def _phase_name(event: dict[str, Any]) -> str:
    """The phase a start-up event closes; a progress event belongs to its task's phase."""
    if event["event"] == "progress_reported":
        return str(event.get("task", "progress")).split(" (")[0]
    return _PHASE_NAMES.get(event["event"], event["event"])


def _drafter_segments(event: dict[str, Any], gap: float) -> list[tuple[str, float]]:
    device = event.get("device", "")
    total = float(event.get("startup_s", gap))
    warmup, capture = float(event.get("warmup_s", 0.0)), float(event.get("capture_s", 0.0))
    parts = [
        ("target load", gap - total),
        (f"drafter build {device}", total - warmup - capture),
        (f"warm-up + compile {device}", warmup),
        (f"graph capture {device}", capture),
    ]
    return [(name, s) for name, s in parts if s > 0]


def exit_reason(run: RunLog) -> str:
    """From the run's own `run_summary` event; else inferred from the last events."""
    summaries = run.named("run_summary")
    if summaries and isinstance(summaries[-1].get("exit_reason"), str):
        return summaries[-1]["exit_reason"]
    if run.named("train_completed"):
        return "completed (no run_summary)"
    last = run.steps[-1]["step"] if run.steps else 0
    return f"unknown: the log ends at step {last}"


def _wall_s(run: RunLog) -> float | None:
    stamps = [t for e in run.events if (t := timestamp_s(e)) is not None]
    return stamps[-1] - stamps[0] if stamps else None


def summarize(run: RunLog) -> dict[str, Any]:
    """The summary row of a run (field names carry units; None where the log has no data)."""
    last = run.steps[-1] if run.steps else {}
    evals = [e for e in run.named("eval") if isinstance(e.get("tau"), int | float)]
    lost = lost_seconds(run)
    startup = run.named("startup_completed")
    per_node = steady_median(run, "tokens_per_s")
    return {
        "steps": len(run.steps),
        "last_step": last.get("step"),
        "total_steps": last.get("total_steps"),
        "wall_s": _wall_s(run),
        "startup_s": startup[-1].get("startup_s") if startup else None,
        "world_size": run.world_size,
        "gpu": is_gpu_run(run),
        "median_tokens_per_s": per_node,  # rank 0's node
        # rank 0's times the world size (the module docstring says why that is right)
        "median_all_node_tokens_per_s": None if per_node is None else per_node * run.world_size,
        "median_mfu": steady_median(run, "mfu"),
        "median_padding_frac": steady_median(run, "padding_frac"),
        "median_step_ms": steady_median(run, "step_ms"),
        "steady_mem_gib": steady_median(run, "mem_gib"),
        "eval_lost_s": lost["eval"],
        "save_lost_s": lost["save"],
        "final_loss": last.get("loss"),
        "final_acc": last.get("acc"),
        "final_tau_hat": last.get("tau_hat"),
        "last_eval_tau": evals[-1]["tau"] if evals else None,
        "bad_lines": run.bad_lines,
        "exit_reason": exit_reason(run),
    }
