"""Calibration of a DSpark drafter's confidence head: temperature scaling on held-out sequences.

The head predicts slot k's acceptance as sigmoid(c_k), c_k = Linear(...) (docs/DFLASH.md s.11).
Calibration fits one temperature T > 0 minimising the BCE of sigmoid(c_k / T) against the
acceptance a_k of every slot of every anchor of held-out sequences, and writes it into the export
by dividing the head's weight and bias by T: for a linear head followed by a sigmoid this is
exact (Linear(x) / T = (W / T) x + b / T), so the export format, and every engine that reads the
head, stay unchanged. T = 1 leaves the tensors, and so the export, bit-identical.

One temperature for every slot, not one per slot: the head is one Linear shared by all slots,
and the `Qwen3DSparkModel` config has no field for a temperature, so a per-slot temperature could
not be carried by the export. (Slots still differ in what they see: the head reads h_k and,
with the Markov input, the previous token.)

What the fit is against: the teacher-forced acceptance a_k = clamp(1 - ||p_k - q_k||_1 / 2, 0, 1)
at every anchor p of a held-out sequence (the prompt and the target's own greedy continuation),
p_k the draft's distribution at slot k (lm_head(h_k) plus the Markov bias from the sequence's
token before the slot), q_k the target's next-token distribution after the same prefix. It is
exact: a_k is the probability that slot k's draft is accepted at T = 1 given the tokens before it
(the rejection test's acceptance, 1 - TV), the quantity the head is trained on; measured 0/1
outcomes in decoding estimate the same probability with sampling noise and only at the anchors a
decoding walk visits. It is cheap: one target forward per sequence and one drafter pass per
chunk of anchors, no verify loop.

The fit: the BCE of sigmoid(s c) against a is convex in s = 1/T, its derivative
sum (sigmoid(s c) - a) c increasing in s, so its root is found by bisection in float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from dflash_async.checkpoint.export import export_drafter, load_drafter_export
from dflash_async.eval.teacher_forced import anchor_blocks
from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.model.kinds import kind_of

HEAD_WEIGHT, HEAD_BIAS = "confidence_head.proj.weight", "confidence_head.proj.bias"
_BISECTION_STEPS = 200  # halvings of the bracket: far below float64's resolution of s


@dataclass(frozen=True)
class SlotPairs:
    """Confidence logits and teacher-forced acceptances of held-out slots, flat, float64."""

    logits: torch.Tensor  # [N] c
    acceptance: torch.Tensor  # [N] a in [0, 1]
    slots: torch.Tensor  # [N] the slot index k (0 = the anchor's own slot)


def check_calibratable(config: DrafterConfig, *, where: str) -> None:
    """ValueError unless `config`'s drafter carries a confidence head: HEAD_WEIGHT among the
    tensors its kind declares for it (DSpark's, with the head on)."""
    if HEAD_WEIGHT not in kind_of(config.kind).weight_shapes(config):
        raise ValueError(f"{where}: a {config.kind} drafter has no confidence head to calibrate")


@torch.no_grad()
def slot_pairs(
    target: PreTrainedModel,
    drafter,
    embed_weight: torch.Tensor,  # [V, d] the target's
    lm_head_weight: torch.Tensor,  # [V, d] the target's
    sequence: Sequence[int],
    first_anchor: int,
    *,
    anchors_per_pass: int = 64,
) -> SlotPairs:
    """(c_k, a_k, k) for every slot k of the block at every anchor p >= first_anchor whose label
    x[p+k+1] lies inside the sequence; each block sees the target's features of x_{<p} only (the
    training layout, as decoding sees it at p)."""
    B, L = drafter.config.block_size, len(sequence)
    ids = torch.as_tensor(list(sequence), dtype=torch.long, device=embed_weight.device)  # [L]
    slot = torch.arange(B, device=ids.device)
    target_logits, passes = anchor_blocks(
        target,
        drafter,
        embed_weight,
        sequence,
        first_anchor,
        anchors_per_pass=anchors_per_pass,
        target_logits=True,
    )
    found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for block in passes:
        rows = block.anchors[:, None] + slot  # [A, B]: slot k's prefix ends at p + k
        inside = (rows < L - 1).flatten()  # the label x[p + k + 1] exists
        h, row = block.hidden.flatten(0, 1)[inside], rows.flatten()[inside]
        previous = ids[row]  # the token before slot k's label: x[p + k]
        draft = drafter.draft_logits(h, previous, lm_head_weight).double().softmax(-1)
        wanted = target_logits[row].double().softmax(-1)
        a = (1.0 - 0.5 * (draft - wanted).abs().sum(-1)).clamp(0.0, 1.0)
        c = drafter.confidence_logits(h, previous).double()
        found.append((c, a, slot.expand_as(rows).flatten()[inside]))
    if not found:
        empty = torch.zeros(0, dtype=torch.float64)
        return SlotPairs(empty, empty, torch.zeros(0, dtype=torch.long))
    c, a, k = (torch.cat(parts).cpu() for parts in zip(*found, strict=True))
    return SlotPairs(c, a, k)


def heldout_pairs(
    target: PreTrainedModel,
    drafter,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    sequences: Sequence[tuple[Sequence[int], int]],  # (prompt + greedy continuation, prompt len)
) -> SlotPairs:
    """slot_pairs over every held-out sequence, anchors from the end of its prompt on."""
    parts = [
        slot_pairs(target, drafter, embed_weight, lm_head_weight, seq, first)
        for seq, first in sequences
    ]
    return SlotPairs(
        logits=torch.cat([p.logits for p in parts] + [torch.zeros(0, dtype=torch.float64)]),
        acceptance=torch.cat([p.acceptance for p in parts] + [torch.zeros(0, dtype=torch.float64)]),
        slots=torch.cat([p.slots for p in parts] + [torch.zeros(0, dtype=torch.long)]),
    )


def bce(logits: torch.Tensor, acceptance: torch.Tensor, temperature: float = 1.0) -> float:
    """Mean BCE of sigmoid(logits / temperature) against `acceptance` (float64)."""
    z = logits.double() / temperature
    return float(F.binary_cross_entropy_with_logits(z, acceptance.double()))


def bce_by_slot(pairs: SlotPairs, temperature: float = 1.0) -> list[dict[str, float | int]]:
    """Per slot k (1-based, as confidence_by_slot): pairs, mean predicted and teacher-forced
    acceptance, and the BCE at `temperature`."""
    rows = []
    for k in range(int(pairs.slots.max()) + 1 if pairs.slots.numel() else 0):
        mask = pairs.slots == k
        c, a = pairs.logits[mask], pairs.acceptance[mask]
        rows.append(
            {
                "slot": k + 1,
                "pairs": int(mask.sum()),
                "predicted": float(torch.sigmoid(c / temperature).mean()),
                "acceptance": float(a.mean()),
                "bce": bce(c, a, temperature),
            }
        )
    return rows


def fit_temperature(logits: torch.Tensor, acceptance: torch.Tensor) -> float:
    """T minimising bce(logits, acceptance, T); ValueError when no T > 0 improves on predicting
    1/2 everywhere (the head's logits do not point the way acceptance goes)."""
    c, a = logits.double(), acceptance.double()
    if c.numel() == 0:
        raise ValueError("no held-out slots to calibrate on")

    def slope(s: float) -> float:  # d/ds of the summed BCE at scale s = 1/T
        return float(((torch.sigmoid(s * c) - a) * c).sum())

    if slope(0.0) >= 0.0:
        raise ValueError(
            "the confidence head's logits do not predict the held-out acceptance (the best "
            "temperature is not positive)"
        )
    high = 1.0
    while slope(high) < 0.0:  # the root lies above: double the bracket
        high *= 2.0
        if high > 2.0**60:
            raise ValueError("the confidence head's best temperature is 0 (acceptance is 0 or 1)")
    low = 0.0
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (low + high)
        if slope(mid) < 0.0:
            low = mid
        else:
            high = mid
        if high - low <= 1e-15 * high:  # float64's resolution of s
            break
    return 1.0 / (0.5 * (low + high))


def fold_temperature(
    tensors: dict[str, torch.Tensor], temperature: float
) -> dict[str, torch.Tensor]:
    """The export's tensors with the confidence head divided by `temperature` (computed in
    float32, stored in each tensor's dtype); exactly 1 returns `tensors` itself."""
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if temperature == 1.0:
        return tensors
    out = dict(tensors)
    for name in (HEAD_WEIGHT, HEAD_BIAS):
        out[name] = (tensors[name].float() / temperature).to(tensors[name].dtype)
    return out


def write_calibrated_export(drafter_dir: Path, out_dir: Path, temperature: float) -> Path:
    """The export at `drafter_dir` with `temperature` folded into its confidence head, written
    to `out_dir` (may be `drafter_dir`: replaced atomically) in our export format."""
    config, tensors = load_drafter_export(Path(drafter_dir))
    check_calibratable(config, where=str(drafter_dir))
    return export_drafter(fold_temperature(tensors, temperature), config, Path(out_dir))
