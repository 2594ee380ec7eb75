"""The recipe for a target's size: the drafter depth and step shape a real run gets by default.

Used when a target is named and no preset file is (settings/env.py): the target's parameter
count, estimated from its config.json alone (plain JSON: no torch, no transformers, no weights),
picks a row of `RECIPES`. Depths follow docs/DFLASH.md s.1: 5 drafter layers for 4B/8B targets,
8 for Qwen3.5-35B-A3B. The step shape is the one-GPU presets' (settings/qwen3_8b_1xh200.env):
T = 16384 rows, 1024 anchors of 16 and rings of 2 slots, whose co-located Qwen3-8B run peaked at
70.3 GiB (BENCHMARKS.md), so that one 80 GB card holds target and drafter; several GPUs take the
same shape per drafter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The step shape every size gets, and the one-GPU presets' two slots a ring (see the module doc).
STEP_SHAPE = {
    "DFLASH_TRAIN__TOKEN_BUDGET": "16384",
    "DFLASH_TRAIN__NUM_ANCHORS": "1024",
    "DFLASH_TRAIN__BLOCK_SIZE": "16",
    "DFLASH_PIPELINE__NUM_SLOTS": "2",
}
# (largest parameter count, drafter layers): 4B/8B targets 5 layers, a 35B target 8; the border
# at 16 B lies between the sizes the depths were chosen for.
RECIPES = ((16e9, 5), (float("inf"), 8))


@dataclass(frozen=True)
class Recipe:
    """The values a real run takes when nothing else sets them, and why."""

    values: dict[str, str]  # DFLASH_* name -> value
    parameters: float  # the target's estimated parameter count

    @property
    def origin(self) -> str:
        return f"auto: the recipe for a target of {self.parameters / 1e9:.1f} B parameters"


def recipe_for(target_folder: str | Path) -> Recipe | None:
    """The recipe for the target in `target_folder`, or None when its config.json cannot be read
    (start-up then names the problem)."""
    parameters = estimated_parameters(target_folder)
    if parameters is None:
        return None
    layers = next(depth for limit, depth in RECIPES if parameters <= limit)
    return Recipe({"DFLASH_DRAFTER__NUM_LAYERS": str(layers), **STEP_SHAPE}, parameters)


def estimated_parameters(target_folder: str | Path) -> float | None:
    """Parameters of the language model described by config.json (a wrapper's `text_config`):
    embeddings, attention and MLP or experts per layer. Within a few percent of the real count
    for dense and MoE decoders (Qwen3-8B: 8.2 B against 8.19 B); norms and routers are left out
    (under 0.1%). None when there is no readable config.json."""
    try:
        config = json.loads((Path(target_folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    text = config.get("text_config") or config
    try:
        return _decoder_parameters(text)
    except (TypeError, ValueError):
        return None


def _decoder_parameters(c: dict[str, Any]) -> float:
    d, layers, vocab = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["vocab_size"])
    heads = int(c.get("num_attention_heads") or 1)
    head_dim = int(c.get("head_dim") or d // heads)
    kv_heads = int(c.get("num_key_value_heads") or heads)
    attention = 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim  # q, o and k, v
    experts = int(c.get("num_experts") or c.get("n_routed_experts") or 0)
    experts = experts or int(c.get("num_local_experts") or 0)
    if experts:
        width = int(c.get("moe_intermediate_size") or c.get("intermediate_size"))
        shared = int(c.get("n_shared_experts") or 0) + (
            1 if c.get("shared_expert_intermediate_size") else 0
        )
        mlp = 3 * d * width * (experts + shared)
    else:
        mlp = 3 * d * int(c["intermediate_size"])
    embeddings = vocab * d * (1 if c.get("tie_word_embeddings") else 2)
    return float(layers * (attention + mlp) + embeddings)
