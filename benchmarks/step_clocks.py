"""Why a graph-replayed drafter step takes longer on the wall clock than its GPU timeline says.

`bench drafter --profile` found the 1024-anchor step's kernels, replayed under the profiler, end
to end in 260.5 ms with 1.2 ms of gaps, while 10 timed replays took 267.8 ms each. This script
separates the candidates on one H200, for one step variant at a time:
  - per-step wall time of N back-to-back replays (CUDA events around each step): drift over the
    run means clocks fall as the GPU heats or reaches its power limit;
  - the same after a 3 s rest (a cool GPU);
  - SM clock, power and the clock-event reasons, sampled by nvidia-smi every 100 ms, printed per
    phase (run it as: python benchmarks/step_clocks.py --variants today,flex_triton).
Prints one JSON line per phase and variant.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import torch
from torch.profiler import ProfilerActivity, profile

from dflash_async.bench.drafter_bench import SHAPES, VARIANTS, build_step, synthetic_pack

SMI_FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def smi_samples(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        lines = f.read().splitlines()[1:]
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        try:
            ts = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            ts += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
            rows.append(
                dict(
                    t=ts,
                    sm=float(parts[1].split()[0]),
                    w=float(parts[2].split()[0]),
                    temp=float(parts[3]),
                    reasons=parts[4],
                )
            )
        except ValueError:
            continue
    return rows


def per_step_ms(step, steps: int) -> list[float]:
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    torch.cuda.synchronize()  # sync point: timing only
    events[0].record()
    for i in range(steps):
        step.phase_a()
        step.phase_b()
        events[i + 1].record()
    torch.cuda.synchronize()  # sync point: timing only
    return [events[i].elapsed_time(events[i + 1]) for i in range(steps)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="today")
    parser.add_argument("--num-anchors", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--smi", default="/tmp/smi.csv")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    config = SHAPES["qwen3-8b"]()
    with (
        open(args.smi, "w") as log,
        subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv", "-lms", "100"],
            stdout=log,
        ) as smi,
    ):
        try:
            run(args, config, device, smi_path=args.smi)
        finally:
            smi.terminate()  # else the with-block waits on the sampler forever


def run(args, config, device, *, smi_path: str) -> None:
    for variant in args.variants.split(","):
        step = build_step(
            config,
            token_budget=16384,
            num_anchors=args.num_anchors,
            device=device,
            attention="flex",
            compile=True,
            **VARIANTS[variant],
        )
        step.batch.copy_(synthetic_pack(config, token_budget=16384, num_docs=4, device=device))
        step.capture(warmup_steps=3)
        phases = {}
        for phase, rest, n in (
            ("cool_first", 3.0, 3),
            ("run", 0.0, args.steps),
            ("cool_again", 3.0, 3),
        ):
            time.sleep(rest)
            t0 = time.time()
            ms = per_step_ms(step, n)
            phases[phase] = (t0, time.time(), ms)
        with profile(activities=[ProfilerActivity.CUDA]):  # as `bench drafter --profile` does
            t0 = time.time()
            ms = per_step_ms(step, 3)
            phases["profiled"] = (t0, time.time(), ms)
        time.sleep(0.5)  # the sampler's last rows
        samples = smi_samples(smi_path)
        for phase, (t0, t1, ms) in phases.items():
            inside = [s for s in samples if t0 <= s["t"] <= t1]
            row = {
                "variant": variant,
                "phase": phase,
                "steps": len(ms),
                "ms_first": round(ms[0], 2),
                "ms_last": round(ms[-1], 2),
                "ms_mean": round(sum(ms) / len(ms), 2),
                "ms_min": round(min(ms), 2),
                "ms_all": [round(m, 1) for m in ms] if len(ms) > 3 else None,
            }
            if inside:
                row |= {
                    "sm_mhz_min": min(s["sm"] for s in inside),
                    "sm_mhz_mean": round(sum(s["sm"] for s in inside) / len(inside)),
                    "power_w_max": max(s["w"] for s in inside),
                    "temp_max": max(s["temp"] for s in inside),
                    "reasons": sorted({s["reasons"] for s in inside}),
                }
            print(json.dumps(row), flush=True)
        del step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
