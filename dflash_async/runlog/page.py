"""The report as files: one PNG per figure, summary.json, and report.html with the PNGs inline."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from dflash_async.runlog.parse import RunLog
from dflash_async.runlog.plots import FIGURES
from dflash_async.runlog.summary import MFU_PEAK, summarize

DPI = 100

# summary field -> (row label, format of the value)
ROWS: dict[str, tuple[str, str]] = {
    "steps": ("step lines", "{:d}"),
    "last_step": ("last step / total", "{}"),
    "wall_s": ("wall time (s)", "{:.1f}"),
    "startup_s": ("start-up (s)", "{:.2f}"),
    "world_size": ("nodes (ranks)", "{:d}"),
    "median_tokens_per_s": ("median tokens/s, node of rank 0", "{:,.0f}"),
    "median_all_node_tokens_per_s": ("median tokens/s, all nodes (rank 0 × nodes)", "{:,.0f}"),
    "median_mfu": (f"median MFU (% of the {MFU_PEAK})", "{:.3g}"),
    "median_padding_frac": ("median padding (%)", "{:.3g}"),
    "median_step_ms": ("median step time (ms)", "{:.1f}"),
    "steady_mem_gib": ("steady-state memory (GiB, peak reserved)", "{:.2f}"),
    "eval_lost_s": ("time lost to evaluation (s)", "{:.1f}"),
    "save_lost_s": ("time lost to saves (s)", "{:.1f}"),
    "final_loss": ("final loss", "{:.4f}"),
    "final_acc": ("final accuracy", "{:.4f}"),
    "final_tau_hat": ("final τ̂", "{:.3f}"),
    "last_eval_tau": ("last eval τ (decoding)", "{:.3f}"),
    "bad_lines": ("bad log lines skipped", "{:d}"),
    "exit_reason": ("exit reason", "{}"),
}
PERCENT = ("median_mfu", "median_padding_frac")  # fractions shown as percentages


def cell(key: str, summary: dict[str, Any]) -> str:
    value = summary.get(key)
    if key == "last_step" and value is not None:
        total = summary.get("total_steps")
        return f"{value} / {total}" if total is not None else str(value)
    if key == "median_mfu" and summary.get("gpu") is False:
        return "– (CPU run)"  # an MFU against a GPU's peak says nothing about a CPU
    if value is None:
        return "–"
    return ROWS[key][1].format(value * 100 if key in PERCENT else value)


def run_line(run: RunLog) -> str:
    """Versions and the step shape, from the run's settings.json (empty without one)."""
    record = run.settings or {}
    versions = record.get("versions", {})
    settings = record.get("settings", {})
    train, pipe = settings.get("train", {}), settings.get("pipeline", {})
    parts = [f"{k} {v}" for k, v in versions.items()]
    if train:
        parts.append(
            f"T={train.get('token_budget')} A={train.get('num_anchors')} "
            f"B={train.get('block_size')}"
        )
    if pipe:
        parts.append(
            f"targets {','.join(pipe.get('target_devices', []))}, "
            f"drafters {','.join(pipe.get('drafter_devices', []))}"
        )
    target = settings.get("target", {}).get("path")
    if target is not None:
        parts.append(f"target {target or 'built-in tiny'}")
    return f"<b>{html.escape(run.name)}</b>: " + html.escape("; ".join(parts)) if parts else ""


def png_bytes(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def _table(runs: list[RunLog], summaries: list[dict[str, Any]]) -> str:
    head = "".join(f"<th>{html.escape(r.name)}</th>" for r in runs)
    body = "".join(
        f"<tr><td>{html.escape(label)}</td>"
        + "".join(f"<td>{html.escape(cell(key, s))}</td>" for s in summaries)
        + "</tr>"
        for key, (label, _) in ROWS.items()
    )
    return f'<table id="summary"><tr><th></th>{head}</tr>{body}</table>'


_STYLE = """body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 10px}
td:not(:first-child){text-align:right;font-variant-numeric:tabular-nums}
img{max-width:100%;display:block;margin:1.5em 0}p.note{color:#555;font-size:90%}"""


def write_report(runs: list[RunLog], out: Path) -> Path:
    """PNG per figure, summary.json and a self-contained report.html under `out`; returns the page."""
    out.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(r) for r in runs]
    images = []
    for name, build in FIGURES.items():
        data = png_bytes(build(runs))
        (out / f"{name}.png").write_bytes(data)
        encoded = base64.b64encode(data).decode("ascii")
        images.append(f'<img id="{name}" alt="{name}" src="data:image/png;base64,{encoded}">')
    record = {r.name: {"path": str(r.path), **s} for r, s in zip(runs, summaries, strict=True)}
    (out / "summary.json").write_text(json.dumps(record, indent=2) + "\n")
    title = "dflash_async run report: " + ", ".join(r.name for r in runs)
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
        + "".join(f"<p class='note'>{line}</p>" for r in runs if (line := run_line(r)))
        + f"{_table(runs, summaries)}<p class='note'>Medians over the step lines after the first "
        "10%. Time lost: step gaps around evaluation and saves beyond the median gap, plus their "
        "time before the first and after the last step.</p>" + "".join(images) + "</body></html>"
    )
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return path
