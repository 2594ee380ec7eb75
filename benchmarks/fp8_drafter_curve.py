"""The 500-step convergence check of DFLASH_TRAIN__FP8_MATMULS against bf16, on the README demo.

    python benchmarks/fp8_drafter_curve.py                     # a CUDA GPU with FP8 (H200)
    python benchmarks/fp8_drafter_curve.py --device cpu --steps 20 --window 5 \\
        --runs bf16:42,bf16:43 --no-eval --out /tmp/fp8_curve_check   # the parsing, on the CPU

Runs `python -m dflash_async run` (the demo preset: the built-in tiny random Qwen3 target, its
own regenerated answers as the corpus, a 2-layer drafter, packs of 1024 rows with 64 anchors of
block 8) once per entry of --runs, each in its own OUTPUT_DIR under --out, and then reads every
run's `step` events from OUTPUT_DIR/log.jsonl. The default runs: bf16 seed A, bf16 seed B (the
run-to-run spread of bf16: another drafter init, pack order and anchor stream, from
DFLASH_TRAIN__SEED), FP8 seed A and FP8 seed B. It prints

- the loss at steps 50, 100, ..., of each run (the raw step loss),
- over the last half of the steps, in windows of --window (25) steps (each window's mean loss): the
  largest |fp8_A - bf16_A| and |fp8_B - bf16_B| beside the largest |bf16_B - bf16_A|, and their
  ratio (<= 1: FP8 moved the curve by no more than another seed does);
- each run's wall time, final loss and, with the in-run evaluation (default: at the end only),
  its tau.

Also written to OUT/curve.json. No figure is claimed until it has run on a GPU.

On a GPU every run is the product's GPU step: target and drafter co-located on --device, the
target in bf16, flex attention, compiled layers, CUDA graphs (the demo preset's CPU lines,
TARGET__DTYPE=float32, ATTENTION=sdpa, CUDA_GRAPH=false, are overridden). The demo's shapes
already suit FP8: hidden 128, q 4 x 32 = 128, k/v 2 x 32 = 64, MLP 384, fc 3 x 128 = 384 -> 128
are all multiples of 16, so every drafter linear runs in FP8 (`drafter_kernels_chosen` says so:
fp8_linears 15, fp8_kept []). On the CPU, FP8 runs are refused (exit 2: the setting needs an
FP8 GPU), so the CPU only checks this script with bf16 runs.

A run folder that already holds a finished run of the asked steps is read, not run again;
one holding anything else stops the script (remove it, or pick another --out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def parse_runs(text: str) -> list[tuple[str, str, int]]:
    """`bf16:42,fp8:42` -> [(name, precision, seed)], names bf16_A, fp8_A, bf16_B, ... by the
    order each precision's seeds come in."""
    runs, seen = [], {}
    for item in text.split(","):
        precision, _, seed = item.strip().partition(":")
        if precision not in ("bf16", "fp8") or not seed.lstrip("-").isdigit():
            raise SystemExit(f"--runs: {item!r} is not bf16:SEED or fp8:SEED")
        letter = "ABCDEFGH"[seen.setdefault(precision, 0)]
        seen[precision] += 1
        runs.append((f"{precision}_{letter}", precision, int(seed)))
    return runs


def run_env(
    *, output_dir: Path, steps: int, seed: int, fp8: bool, device: str, evaluate: bool
) -> dict:
    """The demo preset (DFLASH_ENV_FILE unset) with this run's overrides; every other DFLASH_*
    variable of the caller's environment is dropped, so the runs differ only as asked."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env |= {
        "DFLASH_OUTPUT_DIR": str(output_dir),
        "DFLASH_TRAIN__MAX_STEPS": str(steps),
        "DFLASH_TRAIN__SEED": str(seed),
        "DFLASH_TRAIN__SAVE_EVERY": "0",  # one checkpoint, at the end
        "DFLASH_TRAIN__RESUME": "never",
        "DFLASH_TRAIN__FP8_MATMULS": "true" if fp8 else "false",
        "DFLASH_LOG__FORMAT": "json",
        "DFLASH_EVAL__AT_START": "false",
        "DFLASH_EVAL__AT_END": "true" if evaluate else "false",
    }
    if device != "cpu":
        env |= {
            "DFLASH_PIPELINE__TARGET_DEVICES": device,
            "DFLASH_PIPELINE__DRAFTER_DEVICES": device,
            "DFLASH_TARGET__DTYPE": "auto",
            "DFLASH_TRAIN__ATTENTION": "auto",
            "DFLASH_TRAIN__CUDA_GRAPH": "true",
        }
    return env


def read_log(output_dir: Path) -> dict:
    """{"loss": {step: loss}, "tau": the last eval's tau or None, "kernels": the
    drafter_kernels_chosen line or None} from OUTPUT_DIR/log.jsonl."""
    loss, tau, kernels = {}, None, None
    path = output_dir / "log.jsonl"
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.startswith("{"):
                continue
            event = json.loads(line)
            if event.get("event") == "step":
                loss[int(event["step"])] = float(event["loss"])
            elif event.get("event") == "eval":
                tau = event.get("tau")
            elif event.get("event") == "drafter_kernels_chosen" and kernels is None:
                kernels = event
    return {"loss": loss, "tau": tau, "kernels": kernels}


def run_one(name: str, fp8: bool, seed: int, args) -> dict:
    output_dir = args.out / name
    if output_dir.exists():
        log = read_log(output_dir)
        if len(log["loss"]) == args.steps:
            print(f"{name}: reading the finished run in {output_dir}", file=sys.stderr)
            return log | {"wall_s": None}
        raise SystemExit(
            f"{output_dir} holds something other than a finished {args.steps}-step "
            "run: remove it or choose another --out"
        )
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    env = run_env(
        output_dir=output_dir,
        steps=args.steps,
        seed=seed,
        fp8=fp8,
        device=args.device,
        evaluate=args.eval,
    )
    print(f"{name}: python -m dflash_async run -> {output_dir}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    with (args.out / f"{name}.stdout").open("w") as out:
        code = subprocess.call(
            [sys.executable, "-m", "dflash_async", "run"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    wall = time.perf_counter() - started
    if code != 0:
        tail = (args.out / f"{name}.stdout").read_text(errors="replace").splitlines()[-20:]
        raise SystemExit(f"{name} exited {code}:\n" + "\n".join(tail))
    return read_log(output_dir) | {"wall_s": round(wall, 1)}


def windows(loss: dict[int, float], first: int, last: int, width: int) -> list[float]:
    """The mean loss of each `width`-step window of steps first..last (whole windows only)."""
    return [
        sum(loss[s] for s in range(start, start + width)) / width
        for start in range(first, last - width + 2, width)
    ]


def max_gap(a: dict[int, float], b: dict[int, float], first: int, last: int, width: int) -> float:
    """The largest |a - b| of their `width`-step window means over steps first..last."""
    pairs = zip(windows(a, first, last, width), windows(b, first, last, width), strict=True)
    return max(abs(x - y) for x, y in pairs)


def summary(logs: dict[str, dict], steps: int, width: int) -> dict:
    """The comparison over the last half of the steps (module doc)."""
    first = steps // 2 + 1
    out: dict = {"windows": f"steps {first}-{steps}, {width}-step means"}
    loss = {name: log["loss"] for name, log in logs.items()}
    if "bf16_A" in loss and "bf16_B" in loss:
        out["bf16_B_vs_bf16_A"] = max_gap(loss["bf16_B"], loss["bf16_A"], first, steps, width)
    for letter in "AB":
        fp8, bf16 = f"fp8_{letter}", f"bf16_{letter}"
        if fp8 in loss and bf16 in loss:
            gap = max_gap(loss[fp8], loss[bf16], first, steps, width)
            out[f"{fp8}_vs_{bf16}"] = gap
            if out.get("bf16_B_vs_bf16_A"):
                out[f"{fp8}_vs_{bf16}_over_spread"] = gap / out["bf16_B_vs_bf16_A"]
    return out


def table(logs: dict[str, dict], steps: int, every: int = 50) -> str:
    names = list(logs)
    lines = ["| step | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for s in range(every, steps + 1, every):
        cells = [f"{logs[n]['loss'][s]:.4f}" if s in logs[n]["loss"] else "—" for n in names]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    for label, key in (("wall s", "wall_s"), ("tau", "tau")):
        cells = ["—" if logs[n][key] is None else str(logs[n][key]) for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument(
        "--runs", default="bf16:42,bf16:43,fp8:42,fp8:43", help="precision:seed, comma-separated"
    )
    parser.add_argument("--device", default="cuda:0", help="cuda:N, or cpu (bf16 runs only)")
    parser.add_argument("--out", type=Path, default=Path("runs/fp8_curve"))
    parser.add_argument("--window", type=int, default=25, help="steps per smoothing window")
    parser.add_argument(
        "--no-eval",
        dest="eval",
        action="store_false",
        help="skip the in-run evaluation at the end (tau)",
    )
    args = parser.parse_args(argv)
    if args.window < 1 or args.steps // 2 < args.window:
        parser.error(f"--window {args.window} must be 1 to half of --steps ({args.steps})")
    logs = {}
    for name, precision, seed in parse_runs(args.runs):
        logs[name] = run_one(name, precision == "fp8", seed, args)
        kernels = logs[name]["kernels"] or {}
        print(
            f"{name}: seed {seed}, fp8_matmuls={kernels.get('fp8_matmuls', 'not logged')}, "
            f"fp8_linears={kernels.get('fp8_linears', '-')}",
            file=sys.stderr,
        )
    every = 50 if args.steps >= 100 else max(1, args.steps // 10)
    print(f"### Demo loss by step ({args.device}, {args.steps} steps)\n")
    print(table(logs, args.steps, every))
    result = summary(logs, args.steps, args.window)
    print(f"\n### Largest gap of mean losses over {result['windows']}\n")
    for key, value in result.items():
        if key != "windows":
            print(f"- {key}: {value:.4f}")
    record = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "summary": result,
        "runs": {n: {k: v for k, v in log.items() if k != "kernels"} for n, log in logs.items()},
    }
    (args.out / "curve.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
