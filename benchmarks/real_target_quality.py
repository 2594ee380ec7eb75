"""Drafter quality on a real trained target: decoded tau beside the teacher-forced estimates.

    python benchmarks/real_target_quality.py --target PATH [--corpus FILE] [--steps N] \\
        [--device cpu|cuda:0] [--out DIR] [--kinds dflash,dflash2] [--matmuls default,fp8]

1. Corpus (skipped with --corpus, a pre-tokenized jsonl of `input_ids` + `loss_mask`): the target
   writes its own stories. Each opens with BOS and --opening tokens sampled at T = 1, then the
   target's greedy continuation up to --length tokens; the loss covers the continuation. The first
   --stories are the training set, --heldout more (other seeds) the held-out set. Kept in
   OUT/corpus/ and read from there by a later call.
2. Training: every drafter kind of the kinds table (or --kinds), `python -m dflash_async run` on
   the same corpus with the same settings and steps, each in OUT/<kind>/ (a finished run is read,
   not run again). `--matmuls default,fp8` trains each kind twice, the second time with the
   drafter's linears in FP8 (DFLASH_TRAIN__FP8_MATMULS, a GPU with FP8 tensor cores), in
   OUT/<kind>+fp8/: the same data, seed and steps, so the rows differ by the matmuls alone;
   `fp8-emulate` (OUT/<kind>+fp8-emulate/) is the same quantization on any device, the CPU too.
3. Measures, per kind, on the held-out sequences (opening + greedy continuation): decoded tau at
   T = 0 and T = 1 (the reference speculative decoder, from the opening, --length minus the
   opening new tokens), and the teacher-forced figures of
   dflash_async/eval/teacher_forced.py: tau_teacher_forced (the decoding walk, which greedy decoded
   tau should equal) and tau_hat (uniform anchors, the step lines' definition), beside the last
   step lines' tau_hat (training blocks, the mean of the last 20 steps). The same, at T = 0 only,
   on the first --train-sequences training sequences (does training data decode as estimated?).

Prints a markdown table and writes OUT/quality.json. Takes any target folder the trainer takes;
settings the target needs (its layer ids, a mask token id) are arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

from dflash_async.eval.harness import load_drafter
from dflash_async.eval.sampling import Sampler, SamplingOptions
from dflash_async.eval.speculative import speculative_generate
from dflash_async.eval.teacher_forced import teacher_forced_tau
from dflash_async.model.kinds import KINDS
from dflash_async.targets.loading import frozen_embeddings, load_target

LAST_STEPS = 20  # step lines averaged for the training tau_hat (one step's 128 blocks are noisy)


@torch.no_grad()
def self_distil(target, *, count: int, opening: int, length: int, seed: int, batch: int):
    """`count` sequences [BOS, opening tokens ~ p at T = 1, greedy continuation] of `length`."""
    device = frozen_embeddings(target)[0].device
    bos = target.config.bos_token_id
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = []
    for lo in range(0, count, batch):
        ids = torch.full((min(batch, count - lo), 1), bos, device=device)
        for _ in range(opening):
            probs = target(input_ids=ids).logits[:, -1].float().softmax(-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
        out = target.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_length=length,
            min_length=length,
            eos_token_id=None,
            pad_token_id=0,
        )
        rows += out.tolist()
    return rows


def corpus(args, target) -> tuple[Path, list[list[int]]]:
    """(training jsonl, held-out sequences): --corpus, or the self-distilled one in OUT/corpus/."""
    folder = args.out / "corpus"
    train, heldout = folder / "train.jsonl", folder / "heldout.jsonl"
    if args.corpus:
        records = [json.loads(x) for x in args.corpus.read_text().splitlines() if x.strip()]
        rows = [r["input_ids"] for r in records[-args.heldout :]]
        return args.corpus, rows  # the last records: the training set holds them too
    if not heldout.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        common = dict(opening=args.opening, length=args.length, batch=args.gen_batch)
        stories = self_distil(target, count=args.stories, seed=args.seed, **common)
        held = self_distil(target, count=args.heldout, seed=args.seed + 1, **common)
        n = 1 + args.opening  # BOS and the opening: context, not supervised
        lines = [
            json.dumps({"input_ids": s, "loss_mask": [0] * n + [1] * (len(s) - n)}) for s in stories
        ]
        train.write_text("\n".join(lines) + "\n")
        heldout.write_text("\n".join(json.dumps({"input_ids": s}) for s in held) + "\n")
        print(
            f"corpus: {len(stories)}+{len(held)} sequences in {time.perf_counter() - started:.0f} s",
            file=sys.stderr,
        )
    rows = [json.loads(x)["input_ids"] for x in heldout.read_text().splitlines() if x.strip()]
    return train, rows


# --matmuls -> settings: fp8 needs a GPU with FP8 tensor cores; fp8-emulate runs the same
# quantization anywhere (the CPU too), summed in the compute dtype
MATMULS = {
    "default": {},
    "fp8": {"DFLASH_TRAIN__FP8_MATMULS": "true"},
    "fp8-emulate": {"DFLASH_TRAIN__FP8_MATMULS": "emulate"},
}


def run_name(kind: str, matmuls: str) -> str:
    """A run's folder and row name: the kind, with "+fp8" where its linears run in FP8."""
    return kind if matmuls == "default" else f"{kind}+{matmuls}"


def run_env(args, kind: str, matmuls: str, data: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cpu = args.device == "cpu"
    env |= {
        "DFLASH_OUTPUT_DIR": str(args.out / run_name(kind, matmuls)),
        "DFLASH_TARGET__PATH": str(args.target),
        "DFLASH_TARGET__DTYPE": "float32",
        "DFLASH_TARGET__TARGET_LAYER_IDS": args.layer_ids,
        "DFLASH_TARGET__NUM_FEATURES": str(len(args.layer_ids.split(","))),
        "DFLASH_DRAFTER__KIND": kind,
        "DFLASH_DRAFTER__NUM_LAYERS": str(args.num_layers),
        "DFLASH_DATA__PATH": str(data),
        "DFLASH_DATA__MAX_LEN": str(max(args.length, 512)),
        "DFLASH_TRAIN__TOKEN_BUDGET": str(args.token_budget),
        "DFLASH_TRAIN__NUM_ANCHORS": str(args.num_anchors),
        "DFLASH_TRAIN__BLOCK_SIZE": str(args.block_size),
        "DFLASH_TRAIN__MAX_STEPS": str(args.steps),
        "DFLASH_TRAIN__LR": str(args.lr),
        "DFLASH_TRAIN__SEED": str(args.seed),
        "DFLASH_TRAIN__SAVE_EVERY": "0",
        "DFLASH_TRAIN__RESUME": "never",
        "DFLASH_TRAIN__CUDA_GRAPH": "false" if cpu else "true",
        "DFLASH_TRAIN__ATTENTION": "sdpa" if cpu else "auto",
        "DFLASH_PIPELINE__TARGET_DEVICES": args.device,
        "DFLASH_PIPELINE__DRAFTER_DEVICES": args.device,
        "DFLASH_PIPELINE__TARGET_BATCH_TOKENS": str(args.token_budget),
        "DFLASH_EVAL__AT_START": "false",
        "DFLASH_EVAL__AT_END": "false",
        "DFLASH_EVAL__EVERY": "0",
        "DFLASH_LOG__FORMAT": "json",
    }
    if args.mask_token_id is not None:
        env["DFLASH_DRAFTER__MASK_TOKEN_ID"] = str(args.mask_token_id)
    return env | MATMULS[matmuls]


def steps_of(folder: Path) -> list[dict]:
    path = folder / "log.jsonl"
    if not path.is_file():
        return []
    events = (json.loads(x) for x in path.read_text().splitlines() if x.startswith("{"))
    return [e for e in events if e.get("event") == "step"]


def train(args, kind: str, matmuls: str, data: Path) -> tuple[list[dict], float | None]:
    """The run's step events and wall seconds (None: read from an earlier call)."""
    name = run_name(kind, matmuls)
    folder = args.out / name
    steps = steps_of(folder)
    if steps and steps[-1]["step"] == args.steps and (folder / "drafter").is_dir():
        return steps, None
    if folder.exists():
        raise SystemExit(f"{folder} holds something other than a finished {args.steps}-step run")
    print(f"{name}: python -m dflash_async run -> {folder}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with (args.out / f"{name}.stdout").open("w") as out:
        code = subprocess.call(
            [sys.executable, "-m", "dflash_async", "run"],
            env=run_env(args, kind, matmuls, data),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    if code != 0:
        raise SystemExit(f"{name}: the run exited {code}; see {args.out / f'{name}.stdout'}")
    return steps_of(folder), time.perf_counter() - started


def decoded_tau(target, drafter, config, sequences, prefix: int, temperature: float) -> float:
    """Mean per-sequence tau of decoding each sequence's first `prefix` tokens to its length."""
    embed, lm_head = frozen_embeddings(target)
    taus = []
    for i, sequence in enumerate(sequences):
        options = SamplingOptions(temperature=temperature, seed=0)
        sampler = Sampler.for_prompt(options, i, embed.device) if temperature > 0 else None
        result = speculative_generate(
            target,
            drafter,
            config,
            embed,
            lm_head,
            sequence[:prefix],
            max_new_tokens=len(sequence) - prefix,
            eos_token_id=None,
            sampler=sampler,
        )
        taus.append(sum(result.accepted_lengths) / len(result.accepted_lengths))
    return sum(taus) / len(taus)


def measure(args, target, name: str, heldout: list[list[int]], training: list[list[int]]) -> dict:
    dtype = frozen_embeddings(target)[0].dtype
    device = frozen_embeddings(target)[0].device
    drafter, config = load_drafter(args.out / name / "drafter", device=device, dtype=dtype)
    embed, lm_head = frozen_embeddings(target)
    prefix = 1 + args.opening
    row = {}
    for name, sequences, temperatures in (
        ("heldout", heldout, (0.0, 1.0)),
        ("train", training, (0.0,)),
    ):
        tf = teacher_forced_tau(target, drafter, embed, lm_head, [(s, prefix) for s in sequences])
        row[f"{name}_tau_teacher_forced"] = tf.walk
        row[f"{name}_tau_hat"] = tf.uniform
        for temperature in temperatures:
            key = f"{name}_decoded_tau_T{temperature:g}"
            row[key] = decoded_tau(target, drafter, config, sequences, prefix, temperature)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--corpus", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("runs/real_target_quality"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument(
        "--matmuls", default="default", help="comma list of default, fp8, fp8-emulate"
    )
    parser.add_argument("--stories", type=int, default=3000)
    parser.add_argument("--heldout", type=int, default=32)
    parser.add_argument("--train-sequences", type=int, default=16)
    parser.add_argument("--opening", type=int, default=12)
    parser.add_argument("--length", type=int, default=257)
    parser.add_argument("--gen-batch", type=int, default=500)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--num-anchors", type=int, default=128)
    parser.add_argument("--layer-ids", default="0,2,4")
    parser.add_argument("--mask-token-id", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise SystemExit(f"--kinds: unknown {unknown}; the kinds table has {list(KINDS)}")
    matmuls = [m for m in args.matmuls.split(",") if m]
    if not matmuls or set(matmuls) - set(MATMULS):
        raise SystemExit(f"--matmuls: {args.matmuls!r}; give some of {list(MATMULS)}")
    target = load_target(args.target, device=args.device, dtype=torch.float32)
    data, heldout = corpus(args, target)
    lines = data.read_text().splitlines()[: args.train_sequences]
    training = [json.loads(x)["input_ids"] for x in lines]
    rows = {}
    for kind, matmul in [(k, m) for k in kinds for m in matmuls]:
        name = run_name(kind, matmul)
        steps, wall = train(args, kind, matmul, data)
        last = steps[-LAST_STEPS:]
        row = {
            "steps": steps[-1]["step"],
            "train_wall_s": wall,
            "step_tau_hat": sum(s["tau_hat"] for s in last) / len(last),
            "step_acc": sum(s["acc"] for s in last) / len(last),
        }
        rows[name] = row | measure(args, target, name, heldout, training)
        print(json.dumps({name: rows[name]}), file=sys.stderr, flush=True)
    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": args.device,
        "cpu": platform.processor() or platform.machine(),
    }
    report = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "versions": versions,
        "rows": rows,
    }
    (args.out / "quality.json").write_text(json.dumps(report, indent=1))
    print(table(rows))


def table(rows: dict) -> str:
    head = (
        "| kind | steps | step tau_hat (train, last 20) | held-out tau_hat (uniform) "
        "| held-out teacher-forced tau (walk) | decoded tau T=0 | decoded tau T=1 "
        "| train seqs: teacher-forced / decoded T=0 |"
    )
    lines = [head, "|" + "---|" * 8]
    for kind, r in rows.items():
        lines.append(
            f"| {kind} | {r['steps']} | {r['step_tau_hat']:.2f} | {r['heldout_tau_hat']:.2f} "
            f"| {r['heldout_tau_teacher_forced']:.2f} | {r['heldout_decoded_tau_T0']:.2f} "
            f"| {r['heldout_decoded_tau_T1']:.2f} "
            f"| {r['train_tau_teacher_forced']:.2f} / {r['train_decoded_tau_T0']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
