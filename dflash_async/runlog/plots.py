"""The report's figures: one matplotlib Figure per question, every run drawn on the same axes.

Runs keep one colour across all figures. Figures are built with `matplotlib.figure.Figure` (no
pyplot: no global figure state, no GUI backend; PNGs are rendered by Agg).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, MaxNLocator, PercentFormatter

from dflash_async.runlog.parse import RunLog, timestamp_s
from dflash_async.runlog.summary import MFU_PEAK, is_gpu_run, startup_segments

COLORS = [f"C{i}" for i in range(10)]
WIDTH = 11.0  # inches; at 100 dpi a 1100-pixel-wide image


def _figure(
    rows: int, cols: int, title: str, *, height: float, **kwargs
) -> tuple[Figure, np.ndarray]:
    fig = Figure(figsize=(WIDTH, height), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, **kwargs)
    fig.suptitle(title, fontsize=14, fontweight="bold")
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
    return fig, axes


def _smoothed(values: list[float]) -> np.ndarray | None:
    """A centred moving average over ~2% of the points (None when too few points to matter),
    taken within each stretch between NaN gaps (a gap stays a gap)."""
    window = len(values) // 50
    if window < 2:
        return None
    raw = np.asarray(values, dtype=float)
    smooth = np.full_like(raw, np.nan)
    for stretch in np.ma.clump_unmasked(np.ma.masked_invalid(raw)):
        padded = np.pad(raw[stretch], (window // 2, window - 1 - window // 2), "edge")
        smooth[stretch] = np.convolve(padded, np.ones(window) / window, mode="valid")
    return smooth


def _curve(ax: Axes, x, y, color: str, label: str, **kwargs) -> None:
    """Raw points thin, their moving average thick (raw alone when there are few)."""
    smooth = _smoothed(y)
    if smooth is None:
        ax.plot(x, y, color=color, label=label, lw=1.5, **kwargs)
        return
    ax.plot(x, y, color=color, lw=0.6, alpha=0.35, **kwargs)
    ax.plot(x, smooth, color=color, label=label, lw=1.8, **kwargs)


def _labelled_legend(ax: Axes, **kwargs) -> None:
    """A legend when something on `ax` has a label (a log without steps draws nothing)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def _legend(fig: Figure, runs: list[RunLog]) -> None:
    if len(runs) > 1:
        handles = [
            fig.axes[0].plot([], [], color=COLORS[i % 10], lw=2)[0] for i in range(len(runs))
        ]
        fig.legend(handles, [r.name for r in runs], loc="outside lower center", ncols=len(runs))


def learning_figure(runs: list[RunLog]) -> Figure:
    fig, axes = _figure(2, 2, "Learning: loss, accuracy and acceptance", height=7.5, sharex=True)
    panels = [
        ("loss", "loss (weighted CE, nats)"),
        ("acc", "accuracy (top-1 in block)"),
        ("tau_hat", r"$\hat{\tau}$ (accepted length, training blocks)"),
    ]
    for i, run in enumerate(runs):
        color = COLORS[i % 10]
        for ax, (key, label) in zip(axes.flat, panels, strict=False):
            _curve(ax, *run.series(key), color, run.name)
            ax.set_ylabel(label)
        evals = [e for e in run.named("eval") if isinstance(e.get("tau"), int | float)]
        axes[1, 1].plot(
            [e.get("step", 0) for e in evals],
            [e["tau"] for e in evals],
            "o-",
            color=color,
            label=run.name,
        )
    axes[1, 1].set_ylabel("τ by decoding (eval)")
    if not any(run.named("eval") for run in runs):  # say so rather than draw an empty axis
        axes[1, 1].text(
            0.5,
            0.5,
            "no evaluation in this run",
            ha="center",
            va="center",
            transform=axes[1, 1].transAxes,
            color="gray",
        )
    for ax in axes[1]:
        ax.set_xlabel("optimizer step")
    _legend(fig, runs)
    return fig


def _elapsed(run: RunLog) -> tuple[list[float], list[dict]]:
    """Seconds since the run's first event, per step line that has a timestamp."""
    stamps = [t for e in run.events if (t := timestamp_s(e)) is not None]
    start = stamps[0] if stamps else 0.0
    pairs = [(t, e) for e in run.steps if (t := timestamp_s(e)) is not None]
    return [t - start for t, _ in pairs], [e for _, e in pairs]


def _time_unit(longest_s: float) -> tuple[str, float]:
    """A readable unit for a time axis that spans `longest_s` seconds."""
    if longest_s < 180:
        return "seconds", 1.0
    return ("minutes", 60.0) if longest_s < 3 * 3600 else ("hours", 3600.0)


def _mfu_fields(run: RunLog) -> list[str]:
    """Every MFU the step lines carry (`mfu`, and e.g. a whole-node or per-stage one)."""
    keys = {k for e in run.steps for k, v in e.items() if k.endswith("mfu") and _number(v)}
    return sorted(keys, key=lambda k: (k != "mfu", k))


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _over_time(
    run: RunLog, seconds: list[float], steps: list[dict], key: str
) -> tuple[list[float], list[float]]:
    """(seconds, values) of a step field, with a NaN pair where a new stretch of steps starts (a
    restart or a resume: RunLog.segments), so the line breaks across the stop instead of
    joining the last step before it to the first after. A stretch's first tokens/s of 0 is
    dropped: the rate window then holds one step and reads 0 (runtime/meters.py)."""
    xs, ys, last = [], [], None
    for t, e in zip(seconds, steps, strict=True):
        segment = run.segments.get(int(e["step"]))
        starts = segment != last
        if starts and last is not None:
            xs.append(np.nan)
            ys.append(np.nan)
        last, value = segment, e.get(key)
        if _number(value) and not (starts and key == "tokens_per_s" and value == 0):
            xs.append(t)
            ys.append(float(value))
    return xs, ys


def _tokens_panel(ax: Axes, run: RunLog, xy: tuple[list[float], list[float]], color: str) -> None:
    """Rank 0's node solid; with several nodes the whole run dashed, as rank 0's x world size
    (log.jsonl has rank 0's step lines alone: summary.py says why that is right)."""
    nodes = run.world_size
    if nodes == 1:
        _curve(ax, *xy, color, run.name)
        return
    _curve(ax, *xy, color, f"{run.name}: rank 0's node")
    _curve(
        ax,
        xy[0],
        [y * nodes for y in xy[1]],
        color,
        f"{run.name}: all {nodes} nodes (rank 0's × {nodes})",
        ls="--",
    )


def throughput_figure(runs: list[RunLog]) -> Figure:
    fig, axes = _figure(2, 1, "Throughput and utilisation over time", height=7.0, sharex=True)
    top, bottom = axes[0, 0], axes[1, 0]
    elapsed = [_elapsed(run) for run in runs]
    unit, per = _time_unit(max((s[-1] for s, _ in elapsed if s), default=0.0))
    styles = ["-", "--", ":", "-."]
    gpu = [is_gpu_run(run) for run in runs]
    for i, (run, (seconds, steps)) in enumerate(zip(runs, elapsed, strict=True)):
        color, times = COLORS[i % 10], [s / per for s in seconds]
        _tokens_panel(top, run, _over_time(run, times, steps, "tokens_per_s"), color)
        for j, key in enumerate(_mfu_fields(run) if gpu[i] else []):  # CPU: no peak of its own
            x, y = _over_time(run, times, steps, key)
            _curve(bottom, x, [v * 100 for v in y], color, f"{run.name}: {key}", ls=styles[j % 4])
    several = any(run.world_size > 1 for run in runs)
    top.set_ylabel(
        "training tokens/s (all drafters" + (", per node and all nodes)" if several else ")")
    )
    top.yaxis.set_major_formatter(EngFormatter())
    if several:
        _labelled_legend(top, fontsize=9)
    bottom.set_ylabel(f"MFU (% of the {MFU_PEAK})" if any(gpu) else "MFU (GPU runs only)")
    bottom.yaxis.set_major_formatter(PercentFormatter(decimals=None))
    if not all(gpu):
        cpu = ", ".join(run.name for run, on_gpu in zip(runs, gpu, strict=True) if not on_gpu)
        bottom.text(
            0.5,
            0.5,
            f"no MFU for CPU runs ({cpu}): it is against a GPU's peak",
            ha="center",
            va="center",
            transform=bottom.transAxes,
            color="gray",
        )
    _labelled_legend(bottom, fontsize=9)
    bottom.set_xlabel(f"{unit} since the run started")
    _legend(fig, runs)
    return fig


def _busy_series(run: RunLog) -> dict[str, tuple[list[int], list[float]]]:
    """Per worker or GPU from the step lines' `*busy` dict fields (`worker_busy`, ...), else
    the per-role means `target_busy` and `drafter_busy`; in percent."""
    dict_fields = sorted(
        {k for e in run.steps for k, v in e.items() if k.endswith("busy") and isinstance(v, dict)}
    )
    series: dict[str, tuple[list[int], list[float]]] = {}
    for e in run.steps:
        if dict_fields:
            values = {
                (name if len(dict_fields) == 1 else f"{field}: {name}"): value
                for field in dict_fields
                for name, value in (e.get(field) or {}).items()
                # a CPU "device" is the workers' summed host time capped at 100%: not a device's
                # busy time (the workers' own lines show it)
                if not (field == "gpu_busy" and not str(name).startswith("cuda"))
            }
        else:
            values = {k: e[k] for k in ("target_busy", "drafter_busy") if k in e}
        for name, value in values.items():
            if _number(value):
                steps, percents = series.setdefault(str(name), ([], []))
                steps.append(e["step"])
                percents.append(float(value) * 100)
    return series


def busy_figure(runs: list[RunLog]) -> Figure:
    fig, axes = _figure(
        1,
        len(runs),
        "Device busy per worker (share of wall time)",
        height=4.5,
        sharex=True,
        sharey=True,
    )
    for ax, run in zip(axes[0], runs, strict=True):
        for j, (name, (steps, values)) in enumerate(sorted(_busy_series(run).items())):
            style = "-" if "target" in name else "--"
            _curve(ax, steps, values, COLORS[j % 10], name, ls=style)
        ax.set_title(run.name, fontsize=11)
        ax.set_xlabel("optimizer step")
        ax.set_ylim(0, 105)
        ax.yaxis.set_major_formatter(PercentFormatter())
        _labelled_legend(ax, loc="lower right", fontsize=9)
    axes[0, 0].set_ylabel("busy (% of wall time)")
    return fig


def pipeline_figure(runs: list[RunLog]) -> Figure:
    fig, axes = _figure(2, 1, "Slot ring: queue depth, supply vs demand", height=7.0, sharex=True)
    top, bottom = axes[0, 0], axes[1, 0]
    for i, run in enumerate(runs):
        color = COLORS[i % 10]
        steps, depth = run.series("slot_queue")
        top.step(steps, depth, where="post", color=color, lw=max(0.8, 2.4 - 0.6 * i), alpha=0.8)
        _curve(bottom, *run.series("supply_tokens_per_s"), color, f"{run.name}: supply (targets)")
        _curve(
            bottom,
            *run.series("demand_tokens_per_s"),
            color,
            f"{run.name}: demand (drafters)",
            ls="--",
        )
    top.set_ylabel("full slots waiting (packs)")
    top.yaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_ylabel("tokens/s")
    bottom.yaxis.set_major_formatter(EngFormatter())
    bottom.set_xlabel("optimizer step")
    _labelled_legend(bottom, fontsize=9, title="solid: supply, dashed: demand", title_fontsize=9)
    _legend(fig, runs)
    return fig


def step_time_figure(runs: list[RunLog]) -> Figure:
    fig, axes = _figure(1, 1, "Step time (wall time between step lines)", height=4.5)
    ax = axes[0, 0]
    all_ms = [v for run in runs for v in run.series("step_ms")[1]]
    if all_ms:
        high = float(np.percentile(all_ms, 99.5))  # rare eval/save stalls would flatten the bins
        bins = np.linspace(min(all_ms), max(high, min(all_ms) + 1e-3), 60)
        for i, run in enumerate(runs):
            ms = np.clip(run.series("step_ms")[1], None, bins[-1])
            color = COLORS[i % 10]
            ax.hist(ms, bins=bins, color=color, alpha=0.55, label=run.name)
            ax.axvline(float(np.median(ms)), color=color, ls="--", lw=1.5)
    ax.set_xlabel("step time (ms; dashed: median; the last bin holds the slowest 0.5%)")
    ax.set_ylabel("steps")
    if len(runs) > 1:
        ax.legend()
    return fig


STARTUP_LEGEND_COLUMNS = 4


def _phase_base(phase: str) -> str:
    return phase.split(" cuda")[0].split(" cpu")[0]


def startup_figure(runs: list[RunLog]) -> Figure:
    """One bar per run; one colour and one legend entry per phase (devices merged), the colours
    distinct up to 20 phases (tab20), the legend in columns below the bars with rows of its
    own in the figure's height, so that no entry is cut off."""
    segments = [startup_segments(run) for run in runs]
    phases = list(dict.fromkeys(_phase_base(p) for segs in segments for p, _ in segs))
    legend_rows = -(-len(phases) // STARTUP_LEGEND_COLUMNS)
    fig, axes = _figure(
        1,
        1,
        "Start-up breakdown (until startup_completed)",
        height=1.6 + 1.2 * len(runs) + 0.3 * legend_rows,
    )
    ax = axes[0, 0]
    palette = colormaps["tab20"].colors
    longest = max((sum(s for _, s in segs) for segs in segments), default=0.0)
    labelled: set[str] = set()
    for row, run_segments in enumerate(segments):
        left = 0.0
        for phase, seconds in run_segments:
            base = _phase_base(phase)
            label = None if base in labelled else base
            labelled.add(base)
            color = palette[phases.index(base) % len(palette)]
            ax.barh(row, seconds, left=left, color=color, edgecolor="white", label=label)
            if seconds > 0.06 * longest:  # wide enough to hold its duration
                ax.text(
                    left + seconds / 2,
                    row,
                    f"{seconds:.3g} s",
                    ha="center",
                    va="center",
                    color="black" if sum(color[:3]) > 2.0 else "white",  # light tab20 shades
                    fontsize=10,
                    fontweight="bold",
                )
            left += seconds
    ax.set_yticks(range(len(runs)), [r.name for r in runs])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first log line")
    if phases:
        fig.legend(loc="outside lower center", fontsize=9, ncols=STARTUP_LEGEND_COLUMNS)
    return fig


FIGURES: dict[str, Callable[[list[RunLog]], Figure]] = {
    "learning": learning_figure,
    "throughput": throughput_figure,
    "busy": busy_figure,
    "pipeline": pipeline_figure,
    "step_time": step_time_figure,
    "startup": startup_figure,
}
