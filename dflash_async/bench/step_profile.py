"""Where one drafter step's time goes: profiler kernels attributed to the step's parts.

Each kernel (GPU) or operator's own time (CPU) is attributed to one part by, in order:
- the `dflash::` ranges enclosing the operator that launched it (model/step_ranges.py). Backward
  operators run in the autograd engine, outside those ranges: each is traced back to the forward
  operator that made its autograd node (same sequence number and forward thread) and takes that
  operator's ranges, so `attention` splits into attn_fwd / attn_bwd;
- inside a decoder layer's compiled pieces: a matmul by its operand shapes (a dimension equal to
  the MLP width: mlp, else attn_proj), an elementwise kernel by its name (rsqrt or pow: norms;
  silu or sigmoid: mlp; anything else, RoPE, residuals, casts: layer_other).
Fused elementwise kernels are named after the ops they fuse, so norms/mlp/layer_other are
approximate where the compiler fused across them; the matmuls and the ranges are exact.

A CUDA graph replay is one launch to the profiler (its kernels are not tied to the operators that
captured them), so the breakdown profiles EAGER steps of the same (compiled) code; the bench prints
the graph-replayed whole-step time beside it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise

from dflash_async.model.flops import H200_BF16_PEAK_FLOPS
from dflash_async.model.step_ranges import PREFIX

PARTS = (
    "features",  # embedding lookup, fc over the target features, hidden_norm, their casts
    "attn_proj",  # q/k/v/o projections (forward and backward)
    "attn_fwd",  # the attention kernel, forward
    "attn_bwd",  # the attention kernel, backward
    "mlp",  # gate/up/down matmuls and SwiGLU
    "norms",  # RMSNorms inside the layers and the final norm
    "layer_other",  # RoPE, residual adds, casts, K/V concatenation inside the layers
    "lm_head_ce",  # the frozen lm_head and the chunked weighted CE (gradient made in forward)
    "optimizer",  # grad normalisation, clipping, AdamW, lr schedule, grad zeroing
    "other",  # anchors, block mask, gradient accumulation, stats, copies
)
GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"})
BACKWARD_ROOT = "autograd::engine::evaluate_function"
RANGE_PART = {  # a range that decides the part by itself
    "features": "features",
    "block_mask": "other",
    "final_norm": "norms",
    "lm_head_ce": "lm_head_ce",
    "optimizer": "optimizer",
}


@dataclass(frozen=True)
class KernelRecord:
    """One kernel (GPU) or one operator's self time (CPU), with what attributes it."""

    name: str  # kernel name (GPU) or operator name (CPU)
    op: str  # the innermost operator that launched it
    shapes: tuple  # that operator's input shapes
    ranges: tuple[str, ...]  # enclosing dflash ranges, outermost first (without the prefix)
    backward: bool  # launched by the autograd engine
    us: float  # device (GPU) or self CPU time, microseconds


def classify(record: KernelRecord, *, intermediate_size: int) -> str:
    """The part a kernel's time belongs to (one of PARTS)."""
    if not record.ranges:
        return "other"
    name = record.name.lower()
    if "flex_attention" in name or "flashattention" in name:  # also inside a compiled layer
        return "attn_bwd" if record.backward or "backward" in name else "attn_fwd"
    innermost = record.ranges[-1]
    if innermost in RANGE_PART:
        return RANGE_PART[innermost]
    if innermost == "attention":
        return "attn_bwd" if record.backward else "attn_fwd"
    if innermost != "layer":
        return "other"
    if record.op in GEMM_OPS:
        dims = {d for shape in record.shapes if isinstance(shape, list | tuple) for d in shape}
        return "mlp" if intermediate_size in dims else "attn_proj"
    if "rsqrt" in name or "pow" in name:
        return "norms"
    if "silu" in name or "sigmoid" in name:
        return "mlp"
    return "layer_other"


def _ancestors(event) -> list:
    """The event and its CPU parents, innermost first."""
    chain = []
    while event is not None:
        chain.append(event)
        event = event.cpu_parent
    return chain


def _ranges(chain: list) -> tuple[str, ...]:
    names = [e.name[len(PREFIX) :] for e in reversed(chain) if e.name.startswith(PREFIX)]
    return tuple(names)


def kernel_records(events: Iterable, *, device: bool) -> list[KernelRecord]:
    """KernelRecords from a profiler's `events()`: each CPU operator's kernels (device=True), or
    each operator's self CPU time (device=False, for CPU steps and tests)."""
    events = [e for e in events if e.device_type.name == "CPU" and not e.is_async]
    chains = {id(e): _ancestors(e) for e in events}
    roots = {}  # id(event) -> its backward root (evaluate_function), if any
    forward_ranges = {}  # (sequence_nr, thread) -> ranges of the latest forward op holding it
    for e in sorted(events, key=lambda e: e.time_range.start):
        root = next((a for a in chains[id(e)] if a.name.startswith(BACKWARD_ROOT)), None)
        roots[id(e)] = root
        if root is None and e.sequence_nr >= 0:
            forward_ranges[(e.sequence_nr, e.thread)] = _ranges(chains[id(e)])
    records = []
    for e in events:
        root = roots[id(e)]
        ranges = _ranges(chains[id(e)])
        if root is not None:  # backward: the forward op's ranges, then any opened inside
            ranges = forward_ranges.get((root.sequence_nr, root.fwd_thread), ()) + ranges
        base = dict(op=e.name, shapes=tuple(e.input_shapes or ()), ranges=ranges)
        if device:
            records += [
                KernelRecord(name=k.name, backward=root is not None, us=k.duration, **base)
                for k in e.kernels
            ]
        elif e.self_cpu_time_total > 0:
            records.append(
                KernelRecord(
                    name=e.name, backward=root is not None, us=e.self_cpu_time_total, **base
                )
            )
    return records


@dataclass(frozen=True)
class PartRow:
    part: str
    ms: float  # per step
    share: float  # of the summed kernel time
    tflop: float  # analytic FLOPs per step (model/flops.py), in TFLOP
    mfu: float  # tflop / ms against the peak; 0 where the part does no counted matmul work


def part_rows(
    records: Iterable[KernelRecord],
    *,
    steps: int,
    intermediate_size: int,
    flops_by_part: dict[str, float],
    peak_flops: float = H200_BF16_PEAK_FLOPS,
) -> list[PartRow]:
    """Per-step time, share, FLOPs and own MFU of every part (PARTS order), then a total row."""
    us = dict.fromkeys(PARTS, 0.0)
    for record in records:
        us[classify(record, intermediate_size=intermediate_size)] += record.us
    total_us = sum(us.values())
    rows = []
    for part in (*PARTS, "total"):
        part_us = total_us if part == "total" else us[part]
        flops = sum(flops_by_part.values()) if part == "total" else flops_by_part.get(part, 0.0)
        seconds = part_us / 1e6 / steps
        rows.append(
            PartRow(
                part=part,
                ms=seconds * 1e3,
                share=part_us / total_us if total_us else 0.0,
                tflop=flops / 1e12,
                mfu=flops / seconds / peak_flops if seconds > 0 else 0.0,
            )
        )
    return rows


def format_rows(rows: list[PartRow], *, title: str) -> str:
    """A markdown table (MFU against the measured H200 bf16 peak, 780 TFLOP/s)."""
    lines = [
        f"{title}",
        "| part | ms/step | share | TFLOP/step | MFU (vs 780 TFLOP/s) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        mfu = f"{r.mfu:.3f}" if r.tflop else "—"
        lines.append(f"| {r.part} | {r.ms:.2f} | {r.share:.1%} | {r.tflop:.2f} | {mfu} |")
    return "\n".join(lines)


def profile_parts(step, *, steps: int = 2) -> list[KernelRecord]:
    """Profile `steps` eager steps (phase A + B) of a DrafterStep; its graphs, if captured, are
    set aside meanwhile (a replay hides which operator launched which kernel)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    on_gpu = step.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    graphs, step.graphs = step.graphs, None
    try:
        with profile(activities=activities, record_shapes=True) as prof:
            for _ in range(steps):
                step.phase_a()
                step.phase_b()
            if on_gpu:
                torch.cuda.synchronize(step.device)  # sync point: profiling only
    finally:
        step.graphs = graphs
    return kernel_records(prof.events(), device=on_gpu)


@dataclass(frozen=True)
class KernelTotal:
    name: str
    launches: int  # per step
    ms: float  # device time per step


@dataclass(frozen=True)
class Gap:
    """A stretch inside the profiled replays where nothing ran on the GPU."""

    us: float
    before: str  # the activity that ended last before it
    after: str  # the activity that started it again


@dataclass(frozen=True)
class GraphProfile:
    totals: list[KernelTotal]  # the `top` longest names, kernels and copies, per step
    summed_ms: float  # per step, every activity's time added (overlaps counted twice)
    busy_ms: float  # per step, the union of the activities' intervals
    gaps: list[Gap]  # the longest idle stretches, longest first
    gap_sizes: list[tuple[str, int, float]]  # per step: (size range, count, idle ms)


# Idle stretches by size: launch latency between graph nodes is ~1-2 us each, so thousands of
# short gaps and a few long waits are different problems.
GAP_SIZES_US = (2.0, 5.0, 20.0, 100.0)


def gap_histogram(gaps: list[Gap], *, steps: int = 1) -> list[tuple[str, int, float]]:
    """(size range in us, gaps per step, idle ms per step) of all the gaps (idle_gaps's)."""
    edges = (0.0, *GAP_SIZES_US, float("inf"))
    rows = []
    for lo, hi in pairwise(edges):
        inside = [g.us for g in gaps if lo <= g.us < hi]
        label = f"{lo:g}-{hi:g}" if hi != float("inf") else f">={lo:g}"
        rows.append((label, len(inside) // steps, sum(inside) / 1e3 / steps))
    return rows


def idle_gaps(
    spans: Iterable[tuple[float, float, str]], *, top: int | None = 10
) -> tuple[float, list[Gap]]:
    """(busy time, the `top` longest gaps, or all with None) of GPU activity spans (start, end,
    name) in one timeline: busy is the length of their union (kernels on two streams at once
    count once)."""
    busy, gaps = 0.0, []
    reach, last = None, ""  # the end of the merged activity so far, and what ended there
    for start, end, name in sorted(spans):
        if reach is None or start > reach:
            if reach is not None:
                gaps.append(Gap(start - reach, last, name))
            busy, reach, last = busy + end - start, end, name
        elif end > reach:
            busy, reach, last = busy + end - reach, end, name
    return busy, sorted(gaps, key=lambda g: -g.us)[:top]


def graph_kernels(step, *, steps: int = 2, top: int = 25, trace: str | None = None) -> GraphProfile:
    """The GPU activity (kernels, copies, memsets) of `steps` graph-replayed steps, grouped by
    name, with how long the GPU was busy and where it sat idle. Set against the replayed step's
    wall time, the busy time says how long the GPU waited inside the step; the gaps say between
    which activities (a copy node, a launch dependency, the eager anchor noise between the
    graphs). `trace`: a path to write the replays' Chrome trace to (gzipped if it ends in .gz),
    for a look at the timeline elsewhere. The parts table above profiles eager steps, whose
    kernels can differ in time from the replayed ones (allocator state, profiler overhead per
    launch)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if step.graphs is None:
        raise ValueError("graph_kernels needs a captured step")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step.phase_a()
            step.phase_b()
        torch.cuda.synchronize(step.device)  # sync point: profiling only
    if trace:
        prof.export_chrome_trace(trace)
    spans = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type.name == "CUDA"
    ]
    us: dict[str, float] = {}
    count: dict[str, int] = {}
    for start, end, name in spans:
        us[name] = us.get(name, 0.0) + end - start
        count[name] = count.get(name, 0) + 1
    totals = sorted(
        (KernelTotal(n, count[n] // steps, t / 1e3 / steps) for n, t in us.items()),
        key=lambda k: -k.ms,
    )
    busy_us, gaps = idle_gaps(spans, top=None)  # every gap, longest first
    return GraphProfile(
        totals[:top],
        sum(k.ms for k in totals),
        busy_us / 1e3 / steps,
        gaps[:10],
        gap_histogram(gaps, steps=steps),
    )


def format_kernels(profile: GraphProfile, *, title: str) -> str:
    lines = [title, "| kernel | launches/step | ms/step |", "|---|---|---|"]
    lines += [f"| `{k.name[:90]}` | {k.launches} | {k.ms:.2f} |" for k in profile.totals]
    lines.append(f"| all, added | | {profile.summed_ms:.2f} |")
    lines.append(f"| GPU busy (their union) | | {profile.busy_ms:.2f} |")
    lines += [
        "",
        "| idle gap us (all replays) | the GPU had just run | then ran |",
        "|---|---|---|",
    ]
    lines += [f"| {g.us:.0f} | `{g.before[:60]}` | `{g.after[:60]}` |" for g in profile.gaps]
    lines += ["", "| idle gap us | gaps/step | idle ms/step |", "|---|---|---|"]
    lines += [f"| {label} | {n} | {ms:.2f} |" for label, n, ms in profile.gap_sizes]
    return "\n".join(lines)
