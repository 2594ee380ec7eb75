"""`python benchmarks/research/graph_bench.py`: the CUDA-graph checks and contention benchmark
(GPU).

- parity: N eager steps and N replayed steps from the same seeds: per-step loss, final weights,
  and the learning rate read back after every replay against the schedule function;
- memory: after warm-up, memory_reserved and num_alloc_retries over N replayed steps;
- threads: K drafter threads in one process (sharing one GPU), eager vs graph aggregate steps/s.
Prints one JSON line per check. Timing syncs are benchmark-only.
"""

from __future__ import annotations

import json
import threading
import time

import research_entry
import torch
from torch.nn.attention.flex_attention import flex_attention

from dflash_async.bench.drafter_bench import SHAPES, build_step, synthetic_pack
from dflash_async.model.optim import lr_at
from dflash_async.model.step import STATS, DrafterStep
from dflash_async.runtime.devices import parse_device
from dflash_async.usage import ArgumentParser, require_cuda


def _step(
    shape: str,
    device,
    token_budget: int,
    num_anchors: int,
    flex_fn,
    seed: int = 0,
    compile: bool = False,
) -> DrafterStep:
    config = SHAPES[shape]()
    step = build_step(
        config,
        token_budget=token_budget,
        num_anchors=num_anchors,
        device=device,
        attention="flex",
        flex_fn=flex_fn,
        seed=seed,
        compile=compile,
    )
    pack = synthetic_pack(config, token_budget=token_budget, num_docs=4, device=device, seed=seed)
    step.batch.copy_(pack)
    step.generator = torch.Generator(device).manual_seed(1234)
    return step


def _losses(step: DrafterStep, n: int) -> list[float]:
    out = []
    for _ in range(n):
        step.phase_a()
        step.phase_b()
        stats = dict(zip(STATS, step.stats.tolist(), strict=True))  # sync point: check only
        out.append(stats["ce_sum"] / stats["weight_sum"])
    return out


def parity(shape, device, token_budget, num_anchors, steps, flex_fn) -> dict:
    eager = _step(shape, device, token_budget, num_anchors, flex_fn)
    graph = _step(shape, device, token_budget, num_anchors, flex_fn)
    graph.capture(warmup_steps=2)  # restores weights, optimizer state and schedule
    loss_e, loss_g = (
        _losses(eager, steps),
        [],
    )
    lr_err = 0.0
    sched = graph.schedule
    for i in range(steps):
        loss_g += _losses(graph, 1)
        expected = lr_at(
            i + 1,
            peak_lr=sched.peak_lr,
            warmup_steps=sched.warmup_steps,
            total_steps=sched.total_steps,
        )
        lr_err = max(lr_err, abs(sched.lr.item() - expected) / expected)
    rel = [abs(a - b) / abs(a) for a, b in zip(loss_e, loss_g, strict=True)]
    params = [
        ((pe - pg).norm() / pe.norm()).item()
        for pe, pg in zip(eager.params, graph.params, strict=True)
    ]
    return {
        "check": "parity",
        "steps": steps,
        "max_loss_rel_diff": max(rel),
        "max_param_rel_diff": max(params),
        "max_lr_rel_err": lr_err,
        "loss_first": loss_e[0],
        "loss_last": loss_e[-1],
    }


def memory(shape, device, token_budget, num_anchors, steps, flex_fn) -> dict:
    step = _step(shape, device, token_budget, num_anchors, flex_fn, compile=True)  # as in `run`
    step.capture(warmup_steps=2)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_reserved(device)
    retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    started = time.perf_counter()
    for _ in range(steps):
        step.phase_a()
        step.phase_b()
    torch.cuda.synchronize(device)
    return {
        "check": "memory",
        "steps": steps,
        "token_budget": token_budget,
        "num_anchors": num_anchors,
        "reserved_gib_before": before / 2**30,
        "reserved_gib_after": torch.cuda.memory_reserved(device) / 2**30,
        "alloc_retries_delta": torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
        - retries,
        "step_ms": (time.perf_counter() - started) / steps * 1e3,
    }


def threads(shape, device, token_budget, num_anchors, n_threads, steps, graph, flex_fn) -> dict:
    """n_threads drafter threads on one GPU; builds/captures one at a time, then all run."""
    turn, ready, errors = threading.Condition(), threading.Barrier(n_threads + 1), []
    state = {"next": 0}

    def worker(i: int) -> None:
        try:
            torch.cuda.set_device(device)
            with torch.cuda.stream(torch.cuda.Stream(device)):
                with turn:
                    turn.wait_for(lambda: state["next"] == i)
                    step = _step(shape, device, token_budget, num_anchors, flex_fn, seed=i)
                    if graph:
                        step.capture(warmup_steps=2)
                    else:
                        _losses(step, 2)  # warm-up
                    torch.cuda.synchronize(device)
                    state["next"] += 1
                    turn.notify_all()
                ready.wait()
                for _ in range(steps):
                    step.phase_a()
                    step.phase_b()
                torch.cuda.synchronize(device)
        except BaseException as e:  # surfaced below; the barrier is broken so nobody hangs
            errors.append(e)
            ready.abort()

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in pool:
        t.start()
    ready.wait()
    started = time.perf_counter()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    return {
        "check": "threads",
        "threads": n_threads,
        "mode": "graph" if graph else "eager",
        "steps_per_thread": steps,
        "aggregate_steps_per_s": n_threads * steps / elapsed,
    }


def main(argv: list[str] | None = None) -> None:
    """graph_bench.py [--checks parity,memory,threads] ...: one JSON line per check; GPU only
    (without CUDA a UsageError at once, exit 2)."""
    parser = ArgumentParser(prog="python benchmarks/research/graph_bench.py")
    parser.add_argument("--checks", default="parity,memory,threads")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--num-anchors", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args(argv)
    require_cuda("graph_bench.py", args.device)
    device = parse_device(args.device, setting="--device")
    torch.cuda.set_device(device)
    flex_fn = torch.compile(flex_attention, dynamic=False)
    common = (args.shape, device, args.token_budget, args.num_anchors)
    for check in args.checks.split(","):
        if check == "parity":
            row = parity(*common, args.steps, flex_fn)
        elif check == "memory":
            row = memory(*common, args.steps, flex_fn)
        else:
            for graph in (False, True):
                row = threads(*common, args.threads, args.steps, graph, flex_fn)
                print(json.dumps({"shape": args.shape, **row}), flush=True)
            continue
        print(json.dumps({"shape": args.shape, **row}), flush=True)


if __name__ == "__main__":
    research_entry.run(main)
