"""What every check of our export against an external decoder shares (benchmarks/*_check.py).

Such a check decodes the demo's held-out prompts twice on the same fp32 CPU target, by the
external project's own code and by our reference decoder (speculative.py), and compares tokens,
drafts and acceptance lengths. This module owns the common half: the arguments (the external
checkout, the export, the target), the setup (the target folder or the tiny demo target, its
tokenizer and stop tokens, our drafter of the export, the frozen embeddings, the chat-templated
prompts), our decoding of one prompt with every round's drafts recorded, and the JSON line a
check prints (the checkout's commit, the loading info, the rounds counted, their tau, the prompts
that differ). The external side (loading their model, their decoding loop, their counting rules)
stays in each script.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from dflash_async.eval.harness import load_drafter, prompts_of, stop_rules
from dflash_async.eval.lossless import SpecResult
from dflash_async.eval.speculative import DFlashBlockDrafter, speculative_decode
from dflash_async.model.drafter import DFlashDrafter
from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.targets.loading import frozen_embeddings, load_target, load_target_tokenizer
from dflash_async.targets.tiny import demo_prompts, ensure_tiny_target

# context slots beyond prompt + new tokens: the last round's drafts may run past the token limit
SPARE_CONTEXT = 64


class RecordingDrafter(DFlashBlockDrafter):
    """Our one-sequence block drafter, logging each round's drafts in `log`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[list[int]] = []

    def draft(self, anchor_token: int, anchor_position: int) -> torch.Tensor:
        drafts = super().draft(anchor_token, anchor_position)
        self.log.append(drafts.tolist())
        return drafts


@dataclass(frozen=True)
class CheckSetup:
    """The fp32 CPU target, our drafter of the export and the prompts both sides decode."""

    target: PreTrainedModel
    eos: list[int]  # the target's stop tokens, sorted
    drafter: DFlashDrafter
    config: DrafterConfig
    embed: torch.Tensor  # the target's frozen embed_tokens weight [V, d]
    lm_head: torch.Tensor  # and lm_head weight [V, d]
    prompts: list[list[int]]  # the demo's held-out prompts, chat-templated, no thinking


def check_parser(description: str, *, project: str) -> argparse.ArgumentParser:
    """A check's arguments: --`project` (the external checkout, as `checkout`), --drafter (our
    export), --target (empty: the tiny demo target, built under --cache-dir), --num-prompts and
    --max-new-tokens."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        f"--{project}", dest="checkout", metavar=project.upper(), type=Path, required=True
    )
    parser.add_argument("--drafter", type=Path, required=True)
    parser.add_argument("--target", default="", help="empty: the tiny demo target")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--cache-dir", type=Path, default=Path(".cache/dflash_async"))
    parser.set_defaults(project=project)
    return parser


def check_setup(args: argparse.Namespace) -> CheckSetup:
    """The setup check_parser's arguments name (the tiny target built on demand)."""
    folder = Path(args.target) if args.target else ensure_tiny_target(args.cache_dir)
    target = load_target(folder, device="cpu", dtype=torch.float32)
    tokenizer = load_target_tokenizer(folder)
    eos, _ = stop_rules(target, tokenizer)
    drafter, config = load_drafter(args.drafter, device=torch.device("cpu"), dtype=torch.float32)
    embed, lm_head = frozen_embeddings(target)
    records = demo_prompts(args.num_prompts, split="heldout", multi_turn=False)
    return CheckSetup(
        target=target,
        eos=sorted(eos),
        drafter=drafter,
        config=config,
        embed=embed,
        lm_head=lm_head,
        prompts=prompts_of(tokenizer, records, enable_thinking=False),
    )


def recorded_decoding(
    setup: CheckSetup, prompt: list[int], *, max_new_tokens: int
) -> tuple[SpecResult, list[list[int]]]:
    """(our greedy speculative decoding of `prompt`, the drafts of each of its rounds)."""
    drafter = RecordingDrafter(
        setup.drafter,
        setup.config,
        setup.embed,
        setup.lm_head,
        max_context=len(prompt) + max_new_tokens + SPARE_CONTEXT,
    )
    spec = speculative_decode(
        setup.target,
        drafter,
        prompt,
        layer_ids=setup.config.target_layer_ids,
        max_new_tokens=max_new_tokens,
        eos_token_id=setup.eos,
    )
    return spec, drafter.log


def checkout_commit(root: Path) -> str | None:
    """The HEAD commit of the git checkout at `root`; None where git or the checkout is not."""
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True)
    except OSError:
        return None
    return out.stdout.decode().strip() or None


@dataclass
class Tally:
    """The prompts' comparisons as a check runs: their tau per prompt, the rounds counted (by
    the check's names, summed over prompts) and the prompts on which the two sides differ."""

    taus: list[float] = field(default_factory=list)
    rounds: dict[str, int] = field(default_factory=dict)
    differences: list[dict[str, Any]] = field(default_factory=list)

    def add(
        self, prompt: int, same: dict[str, bool], acceptance: Sequence[int], **rounds: int
    ) -> None:
        """Prompt `prompt`'s outcome: what agreed (`same`), their acceptance lengths, its rounds."""
        self.taus.append(sum(acceptance) / max(1, len(acceptance)))
        for name, count in rounds.items():
            self.rounds[name] = self.rounds.get(name, 0) + count
        if not all(same.values()):
            self.differences.append({"prompt": prompt, **same})


def reported(
    args: argparse.Namespace,
    *,
    theirs: Any,
    info: dict[str, list[str]],
    keys_ok: bool,
    tally: Tally,
) -> int:
    """Print the check's JSON line (the checkout's commit, the export and the architecture
    `theirs` loaded it as, its loading `info`, the prompts, the rounds counted, their mean tau and
    the prompts on which the two sides differ); the exit code: 1 unless `keys_ok` and no prompt
    differs."""
    result = {
        f"{args.project}_commit": checkout_commit(args.checkout),
        "drafter": str(args.drafter),
        "architecture": type(theirs).__name__,
        "loading_info": info,
        "prompts": len(tally.taus),
        **tally.rounds,
        f"{args.project}_tau": sum(tally.taus) / len(tally.taus),
        "differences": tally.differences,
    }
    print(json.dumps(result))
    return 0 if keys_ok and not tally.differences else 1
