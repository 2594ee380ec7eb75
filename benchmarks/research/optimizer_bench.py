"""`python benchmarks/research/optimizer_bench.py`: the drafter step's phase B alone, today's
sequence, its pieces and candidate sequences (optimizer_updates.py), each captured in a CUDA
graph and replayed like the step, at the shapes of a real drafter's parameters.

Per sequence: ms per replay (CUDA events), the GB it must move (bytes per parameter x the flat
buffer's length, analytic), GB/s, and, for full sequences, the largest relative difference of p,
exp_avg, exp_avg_sq (per parameter tensor) and the grad norm from today's after 3 replays from the
same state and gradients, in units of u = 2^-24, against REL_TOL. `--kernels` adds, per full
sequence, the kernels one eager call launches (name, count, device µs) from torch.profiler.
On a CPU device it times eager calls instead (a smoke run; no graphs there).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict

import research_entry
import torch
from optimizer_compiled import sequence
from optimizer_updates import REL_TOL, SEQUENCES, PhaseState, flat_norm
from torch import nn

from dflash_async.bench.drafter_bench import SHAPES as DRAFTER_SHAPES
from dflash_async.model.drafter import DFlashDrafter
from dflash_async.runtime.devices import parse_device
from dflash_async.usage import ArgumentParser, require_cuda

CHECK_STEPS = 3
GRAD_NORM = 3.0  # ||g / W|| of the synthetic gradients: above grad_clip = 1, clipping is on
WEIGHT_SUM = 1000.0  # the step's global sum(w) that grads are divided by
U = 2.0**-24


def drafter_shapes(name: str) -> list[torch.Size]:
    """Shapes of the trainable parameters of a drafter (built on the meta device, as DrafterStep
    takes them: `p for p in drafter.parameters() if p.requires_grad`); `tiny`: a CPU smoke set."""
    if name == "tiny":
        return [torch.Size(s) for s in ((33,), (8, 5), (7,), (16, 16), (3, 4, 5))]
    with torch.device("meta"):
        drafter = DFlashDrafter(DRAFTER_SHAPES[name]())
    return [p.shape for p in drafter.parameters() if p.requires_grad]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # sync point: benchmark timing only


def snapshot(s: PhaseState, *, source: str) -> dict[str, list[torch.Tensor]]:
    """Copies of p, m, v per parameter and the grad norm (a reference for max_rel_diffs)."""
    params, m, v = s.tensors(source)
    return {
        "p": [p.detach().clone() for p in params],
        "m": [t.clone() for t in m],
        "v": [t.clone() for t in v],
        "norm": [s.grad_norm.clone()],
    }


def max_rel_diffs(
    s: PhaseState, reference: dict[str, list[torch.Tensor]], *, source: str
) -> dict[str, float]:
    """Largest |x - ref| / max|ref| over the parameter tensors, per quantity (p, m, v, norm)."""
    params, m, v = s.tensors(source)
    mine = {"p": params, "m": m, "v": v, "norm": [s.grad_norm]}
    out = {}
    for key, tensors in mine.items():
        worst = 0.0
        for a, b in zip(tensors, reference[key], strict=True):
            scale = b.abs().max().clamp_min(torch.finfo(torch.float32).tiny)
            worst = max(worst, ((a.detach() - b).abs().max() / scale).item())  # sync: check only
        out[key] = worst
    return out


@torch.no_grad()
def norm_errors(s: PhaseState) -> dict[str, float]:
    """Relative error (in u) of each fp32 way to take the gradient norm, against fp64: today's
    (per-view _foreach_norm, norm of norms), one flat reduction, one flat _foreach_norm, and
    flat_norm's two levels (the candidates'). On the current gradients."""
    s.reset(seed=0, weight_sum=WEIGHT_SUM)
    s.fill_grads(seed=1, norm=GRAD_NORM)
    exact = torch.linalg.vector_norm(s.flat_grad.double())  # a float64 copy: check only
    ways = {
        "today_views_foreach": nn.utils.get_total_norm(s.grads, foreach=True),
        "flat_one_reduction": torch.linalg.vector_norm(s.flat_grad),
        "flat_foreach": torch._foreach_norm([s.flat_grad])[0],
        "flat_rows": flat_norm(s.flat_grad),
    }
    return {k: round(((v.double() - exact) / exact).item() / U, 1) for k, v in ways.items()}


def capture(fn, s: PhaseState, *, warmup: int = 2):
    """Warm up eagerly on a side stream (AdamW state, compiling), then capture one call."""
    side = torch.cuda.Stream(s.device)
    side.wait_stream(torch.cuda.current_stream(s.device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn(s)
    torch.cuda.current_stream(s.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(s)
    _sync(s.device)
    return graph


def time_calls(call, device: torch.device, replays: int) -> float:
    """Mean ms per call: CUDA events around `replays` calls after one untimed call."""
    call()
    _sync(device)
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(replays):
            call()
        return (time.perf_counter() - start) * 1e3 / replays
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        call()
    end.record()
    _sync(device)
    return begin.elapsed_time(end) / replays


def kernel_table(fn, s: PhaseState) -> list[tuple[str, int, float]]:
    """(kernel name, launches, device µs) of one eager call, largest time first."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if s.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        fn(s)
        _sync(s.device)
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        for k in event.kernels:
            rows[k.name][0] += 1
            rows[k.name][1] += k.duration
    return sorted(((n, int(c), us) for n, (c, us) in rows.items()), key=lambda r: -r[2])


def bench(
    names: list[str], *, shape: str, device: torch.device, replays: int, kernels: bool
) -> list[dict]:
    state = PhaseState(drafter_shapes(shape), device=device)
    errors = {"check": "grad_norm_rel_error_u", "shape": shape, **norm_errors(state)}
    print(json.dumps(errors), flush=True)
    rows, reference = [], None
    for name in ["today", *[n for n in names if n != "today"]]:
        try:
            row = _bench_one(
                name, state, device=device, replays=replays, kernels=kernels, reference=reference
            )
            row["shape"] = shape
        except Exception as error:  # a candidate may not build here (compile): say so, go on
            if name == "today":
                raise
            print(json.dumps({"variant": name, "error": str(error)[:400]}), flush=True)
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the variant's graph pool goes before the next one
        reference = row.pop("reference", reference)
        print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
        print(format_kernels(row), flush=True)  # as it goes: a timeout keeps what ran
        rows.append(row)
    return rows


def _bench_one(name, state: PhaseState, *, device, replays, kernels, reference) -> dict:
    source = SEQUENCES[name][2]
    numel = state.flat_param.numel()
    fn = sequence(name, state, compile=device.type == "cuda")
    state.reset(seed=0, weight_sum=WEIGHT_SUM)
    state.fill_grads(seed=1, norm=GRAD_NORM)
    if device.type == "cuda":
        graph = capture(fn, state)
        call = graph.replay
    else:
        fn(state)  # AdamW state exists before timing, as after capture
        call = lambda fn=fn: fn(state)  # noqa: E731
    ms = time_calls(call, device, replays)
    gbytes = SEQUENCES[name][1] * numel / 1e9
    row = {
        "variant": name,
        "params": numel,
        "ms": round(ms, 3),
        "gb": round(gbytes, 2),
        "gb_per_s": round(gbytes / ms * 1e3, 1),
    }
    if source is not None:  # a full sequence: 3 steps from the same state and grads
        state.reset(seed=0, weight_sum=WEIGHT_SUM)
        for k in range(CHECK_STEPS):
            state.fill_grads(seed=100 + k, norm=GRAD_NORM)
            call()
        if name == "today":
            reference = row["reference"] = snapshot(state, source=source)
        diffs = max_rel_diffs(state, reference, source=source)
        row["rel_diff_u"] = {k: round(v / U, 1) for k, v in diffs.items()}
        row["within_tol"] = max(diffs.values()) <= REL_TOL
        if kernels:
            try:
                row["kernels"] = kernel_table(fn, state)
            except Exception as error:  # the listing is an aid: never lose the row to it
                row["kernels_error"] = str(error)[:300]
    return row


def format_table(rows: list[dict], *, title: str) -> str:
    lines = [
        title,
        "",
        "| variant | ms | GB moved | GB/s | max rel diff p / m / v / norm (u = 2^-24) | ok |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        diff = r.get("rel_diff_u")
        shown = " / ".join(f"{diff[k]:g}" for k in ("p", "m", "v", "norm")) if diff else "—"
        ok = {True: "yes", False: "NO"}.get(r.get("within_tol"), "—")
        lines.append(
            f"| {r['variant']} | {r['ms']:.2f} | {r['gb']:.1f} | {r['gb_per_s']:.0f} | "
            f"{shown} | {ok} |"
        )
    return "\n".join(lines)


def format_kernels(row: dict) -> str:
    """The kernels of one eager call of a full sequence (largest first), or why not listed."""
    if row.get("kernels_error"):
        return f"kernels of `{row['variant']}`: not listed ({row['kernels_error']})"
    if not row.get("kernels"):
        return ""
    lines = [f"kernels of one eager `{row['variant']}` (name, launches, device ms):"]
    lines += [f"  {n[:90]}  x{c}  {us / 1e3:.3f}" for n, c, us in row["kernels"][:14]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """optimizer_bench.py [--shape qwen3-8b] [--variants ...] [--replays 20] [--kernels]: one JSON
    line per sequence, then a markdown table. GPU (graphs); a CPU --device runs a smoke test."""
    parser = ArgumentParser(prog="python benchmarks/research/optimizer_bench.py")
    parser.add_argument("--shape", choices=sorted([*DRAFTER_SHAPES, "tiny"]), default="qwen3-8b")
    parser.add_argument(
        "--variants",
        default=",".join(SEQUENCES),
        help=f"comma-separated, of: {', '.join(SEQUENCES)}",
    )
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--kernels", action="store_true", help="kernels of each full sequence")
    args = parser.parse_args(argv)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in SEQUENCES]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(SEQUENCES)})")
    if args.replays < 1:
        parser.error(f"--replays {args.replays}: must be at least 1")
    if args.device.strip().lower() != "cpu":
        require_cuda("optimizer_bench.py", args.device)
    device = parse_device(args.device, setting="--device")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rows = bench(names, shape=args.shape, device=device, replays=args.replays, kernels=args.kernels)
    numel = rows[0]["params"]
    mode = "graph-replayed" if device.type == "cuda" else "eager (CPU smoke run)"
    title = (
        f"### Phase B alone, {args.shape} drafter parameters ({numel / 1e9:.3f} B fp32 "
        f"incl. alignment padding), {mode}, mean of {args.replays}; rel diff after "
        f"{CHECK_STEPS} steps vs today, tolerance {REL_TOL / U:.0f}u"
    )
    print(format_table(rows, title=title), flush=True)


if __name__ == "__main__":
    research_entry.run(main)
