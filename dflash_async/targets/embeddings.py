"""The target's frozen embedding and lm_head, read straight from its safetensors.

A drafter reuses the target's `embed_tokens` and `lm_head` as frozen tensors. Its worker reads
just those two tensors from the checkpoint files (a sharded checkpoint's index names the file of
each), so a drafter on a GPU without a target worker never holds a second copy of the target.
A generic target's tensor names are its model's own (targets/generic.py).

A target whose unembedding produces fewer tokens than its embedding holds (transformers'
`unpadded_vocab_size`: Inkling 2 stores its unembedding padded to `vocab_size` and drops the
padded rows at load) shares an lm_head of the embedding's rows whose padded rows are zero
(`padded_unembedding`), read so from the checkpoint for training and padded so from the loaded
model for decoding (targets/loading.py `frozen_embeddings`): the same tensor in both. A padded
token scores 0 and is never the target's; a draft of one is rejected.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from dflash_async.targets.resolve import TargetError
from dflash_async.targets.tensor_files import tensor_files

# Text models (`model.*`), multimodal wrappers as transformers 5 lays them out
# (`model.language_model.*`: Qwen3.5, Qwen3-VL) and as Gemma 3's checkpoints do
# (`language_model.model.*`, its lm_head `language_model.lm_head`).
EMBED_NAMES = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
)
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
FINAL_NORM_NAMES = (
    "model.norm.weight",
    "model.language_model.norm.weight",
    "language_model.model.norm.weight",
)


def load_frozen_embeddings(
    folder: str, *, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embed_tokens and lm_head weights [V, d] (the same tensor when tied)."""
    files = tensor_files(Path(folder))

    def read(names: tuple[str, ...]) -> torch.Tensor | None:
        name = next((n for n in names if n in files), None)
        if name is None:
            return None
        with safe_open(files[name], framework="pt") as f:
            return f.get_tensor(name).to(device=device, dtype=dtype)

    if not any(n in files for n in EMBED_NAMES):  # a generic target's own names
        from dflash_async.targets.generic import embedding_weights

        embed, lm_head = embedding_weights(folder, files, device=device, dtype=dtype)
    else:
        embed = read(EMBED_NAMES)
        if embed is None:
            raise TargetError(
                f"target {folder!r} has no embedding tensor ({' or '.join(EMBED_NAMES)})"
            )
        lm_head = read(LM_HEAD_NAMES)
        lm_head = embed if lm_head is None else lm_head  # tied embeddings: one tensor
    rows = _output_rows(Path(folder))
    if lm_head is not embed and rows is not None and rows < embed.shape[0]:
        lm_head = padded_unembedding(lm_head, output_rows=rows, vocab=embed.shape[0])
    return embed, lm_head


def _output_rows(folder: Path) -> int | None:
    """The `unpadded_vocab_size` of the target's (text) config.json, None where it has none."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") or config
    rows = text.get("unpadded_vocab_size", config.get("unpadded_vocab_size"))
    return int(rows) if rows is not None else None


def padded_unembedding(lm_head: torch.Tensor, *, output_rows: int, vocab: int) -> torch.Tensor:
    """The lm_head [vocab, d] a drafter shares from a target whose unembedding produces only its
    first `output_rows` tokens (see the module doc): those rows of `lm_head` (stored padded or
    not), then zero rows."""
    padded = lm_head.new_zeros(vocab, lm_head.shape[-1])
    padded[:output_rows] = lm_head[:output_rows]
    return padded


def load_final_norm(folder: str, *, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The weight [d] of the target's final norm (the one before its lm_head): what a drafter
    kind that reads the target's own next-token distribution puts its last layer through."""
    files = tensor_files(Path(folder))
    name = next((n for n in FINAL_NORM_NAMES if n in files), None)
    if name is None:
        raise TargetError(
            f"target {folder!r} has no final norm tensor ({' or '.join(FINAL_NORM_NAMES)})"
        )
    with safe_open(files[name], framework="pt") as f:
        return f.get_tensor(name).to(device=device, dtype=dtype)
