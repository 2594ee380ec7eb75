"""Placement: which GPU runs which stage, from memory fit and measured stage rates (pure functions).

Two layouts over N GPUs of one node:
- colocated: every GPU runs a target worker and a drafter worker sharing that GPU's slot ring;
- split: n_t GPUs run only targets, n_d = N - n_t only drafters; packs cross GPUs (NVLink peer
  copy, pinned host as the fallback).

The cost model, per GPU, from each stage's tokens/s ALONE on one GPU (t: target, d: drafter):
- A step of M drafters adds one gradient all-reduce: a ring all-reduce of the fp32 gradients moves
  2(M-1)/M of their bytes per GPU, at `allreduce_bytes_per_s` (docs/GPU.md: 1.05 B fp32 grads over
  2 H200s in 12.1 ms, so ~347 GB/s). The drafter's effective rate: T / (T/d + combine seconds).
- split: min(n_t * t, n_d * d_eff(n_d), pack transport) / N, with the best n_t (derived) or a
  given one. Transport: a drafter GPU receives k*d*2 bytes per token (NVLink or pinned host).
- colocated: the two stages share the GPU and neither alone fills it, so the shorter stage's time
  partly hides under the longer's: seconds per token = long + (1 - overlap) * short. `overlap`
  0.85 is fitted to one H200 (target 21.0k tok/s alone, drafter 56.9k alone, both 19.9k), or
  measured at start-up. Bounded by the FLOPs both need at `mfu_ceiling` of the peak (the
  overlap cannot make the GPU do more arithmetic than it has): 0.72, an assumption above the best
  measured co-located whole-GPU MFU (0.66) and the compiled target's MFU alone (0.70).
Memory decides first: colocated needs target weights + target activations + drafter training
state + drafter activations + one ring on one GPU, within `headroom` of its memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dflash_async.errors import SettingsError

Layout = Literal["colocated", "split"]
GIB = 2**30
DEFAULT_OVERLAP = 0.85  # fitted: 1/19.9k = 1/21.0k + (1 - o)/56.9k (docs/GPU.md, one H200)
MFU_CEILING = 0.72
PEAK_FLOPS = 780e12  # H200 dense bf16 (docs/GPU.md)
ALLREDUCE_BYTES_PER_S = 347e9  # 4.2 GB of fp32 grads in 12.1 ms over 2 H200s (NVLink)
PEER_BYTES_PER_S = 394e9  # device-to-device copy over NVLink (docs/GPU.md)
HOST_BYTES_PER_S = 55e9  # pinned host <-> device, each way (docs/GPU.md)
HEADROOM = 0.90  # of device memory: CUDA context, NCCL buffers, graph pools, fragmentation


@dataclass(frozen=True)
class StageRates:
    """Each stage alone on one device, in real tokens per second, and how they share one."""

    target_tokens_per_s: float
    drafter_tokens_per_s: float  # token_budget / (one drafter step's seconds), no combine
    overlap: float = DEFAULT_OVERLAP
    source: str = "given"  # where the numbers come from: given | measured | flop_estimate
    target_flops_per_token: float = 0.0  # for the FLOP bound of colocated (0: no bound)
    drafter_flops_per_token: float = 0.0


@dataclass(frozen=True)
class Links:
    """What moves between GPUs: the gradient all-reduce and the packs of the split layout."""

    grad_bytes: float  # one drafter's fp32 gradient buffer
    feature_bytes_per_token: float  # k*d*2 (bf16 hidden states)
    peer_access: bool = True  # NVLink/PCIe peer copies; False: through pinned host memory
    allreduce_bytes_per_s: float = ALLREDUCE_BYTES_PER_S


@dataclass(frozen=True)
class MemoryNeeds:
    """Bytes each part needs on its GPU; device_bytes None means unbounded (CPU)."""

    target_weights: float
    target_activations: float
    drafter_state: float  # fp32 params, grads, AdamW moments, frozen embed/lm_head
    drafter_activations: float
    ring: float  # one ring of slots at the token budget
    device_bytes: float | None
    token_budget: int = 0  # T, the pack length the needs were made for (0: not said)
    length_bytes: float = 0.0  # of the needs, the bytes that grow with T (rows x bytes per row)
    # of target_activations, the target's own pack of features: a target on the drafter's
    # device writes into the ring's slot in place (stages/chain.py), so co-located it is none
    target_staging: float = 0.0

    @property
    def colocated(self) -> float:
        return self.target_side + self.drafter_side - self.target_staging

    @property
    def target_side(self) -> float:
        return self.target_weights + self.target_activations

    @property
    def drafter_side(self) -> float:
        return self.drafter_state + self.drafter_activations + self.ring

    def times(self, pairs: int) -> MemoryNeeds:
        """The needs of `pairs` target+drafter pairs sharing each device (a repeated device)."""
        scale = lambda b: b * pairs  # noqa: E731
        return MemoryNeeds(
            scale(self.target_weights),
            scale(self.target_activations),
            scale(self.drafter_state),
            scale(self.drafter_activations),
            scale(self.ring),
            self.device_bytes,
            self.token_budget,
            scale(self.length_bytes),
            scale(self.target_staging),
        )

    def fits(self, need: float, headroom: float = HEADROOM) -> bool:
        return self.device_bytes is None or need <= headroom * self.device_bytes

    def length_advice(self) -> str:
        """What the pack length costs and the setting that sets it ('' when not known)."""
        if not self.token_budget:
            return ""
        return (
            f"; DFLASH_TRAIN__TOKEN_BUDGET={self.token_budget} accounts for "
            f"{self.length_bytes / GIB:.1f} GiB of it (the ring's slots, the drafter's context, "
            "the target's activations grow with the pack length): lower it (with "
            "DFLASH_DATA__MAX_LEN) or DFLASH_PIPELINE__NUM_SLOTS, or use more GPUs"
        )


def combine_seconds(num_drafters: int, links: Links) -> float:
    """Ring all-reduce time of the fp32 gradients over `num_drafters` GPUs (0 for one)."""
    if num_drafters <= 1:
        return 0.0
    return 2 * (num_drafters - 1) / num_drafters * links.grad_bytes / links.allreduce_bytes_per_s


def drafter_rate(rates: StageRates, *, num_drafters: int, token_budget: int, links: Links) -> float:
    """One drafter's tokens/s with the step's gradient combine added."""
    step_s = token_budget / rates.drafter_tokens_per_s + combine_seconds(num_drafters, links)
    return token_budget / step_s


def colocated_pair_rate(target: float, drafter: float, rates: StageRates) -> float:
    """Tokens/s of one GPU running both stages (see the module doc)."""
    long_s, short_s = max(1 / target, 1 / drafter), min(1 / target, 1 / drafter)
    rate = 1 / (long_s + (1 - rates.overlap) * short_s)
    flops = rates.target_flops_per_token + rates.drafter_flops_per_token
    if flops > 0:
        rate = min(rate, MFU_CEILING * PEAK_FLOPS / flops)
    return rate


def colocated_per_gpu(rates: StageRates, *, gpus: int, token_budget: int, links: Links) -> float:
    d = drafter_rate(rates, num_drafters=gpus, token_budget=token_budget, links=links)
    return colocated_pair_rate(rates.target_tokens_per_s, d, rates)


def split_rate(
    rates: StageRates, *, targets: int, drafters: int, token_budget: int, links: Links
) -> float:
    """Whole-node tokens/s of `targets` target GPUs feeding `drafters` drafter GPUs."""
    d = drafter_rate(rates, num_drafters=drafters, token_budget=token_budget, links=links)
    link = PEER_BYTES_PER_S if links.peer_access else HOST_BYTES_PER_S
    transport = drafters * link / links.feature_bytes_per_token
    return min(targets * rates.target_tokens_per_s, drafters * d, transport)


def best_split(
    rates: StageRates, *, gpus: int, token_budget: int, links: Links
) -> tuple[int, float] | None:
    """(target GPUs, whole-node tokens/s) of the best split, or None below 2 GPUs."""
    if gpus < 2:
        return None
    options = [
        (n, split_rate(rates, targets=n, drafters=gpus - n, token_budget=token_budget, links=links))
        for n in range(1, gpus)
    ]
    return max(options, key=lambda o: (o[1], -o[0]))  # ties: fewer target GPUs


@dataclass(frozen=True)
class Placement:
    """The decision and the numbers behind it (logged as the `placement` event)."""

    layout: Layout
    num_targets: int
    num_drafters: int
    reason: str
    gpus: int
    predicted: dict[str, float | None] = field(default_factory=dict)  # tokens/s per GPU

    def event_fields(self, rates: StageRates, memory: MemoryNeeds) -> dict:
        gib = lambda b: round(b / GIB, 2)  # noqa: E731
        return {
            "layout": self.layout,
            "reason": self.reason,
            "gpus": self.gpus,
            "num_targets": self.num_targets,
            "num_drafters": self.num_drafters,
            "rates_source": rates.source,
            "target_tokens_per_s": round(rates.target_tokens_per_s, 1),
            "drafter_tokens_per_s": round(rates.drafter_tokens_per_s, 1),
            "overlap": round(rates.overlap, 3),
            **{f"{k}_tokens_per_s_per_gpu": v and round(v, 1) for k, v in self.predicted.items()},
            "colocated_gib": gib(memory.colocated),
            "target_gib": gib(memory.target_side),
            "drafter_gib": gib(memory.drafter_side),
            "device_gib": memory.device_bytes and gib(memory.device_bytes),
        }


def predict(
    rates: StageRates, *, gpus: int, token_budget: int, links: Links, num_targets: int = 0
) -> dict[str, float | None]:
    """Tokens/s per GPU of each layout (split: `num_targets` target GPUs, 0 = the best)."""
    colocated = colocated_per_gpu(rates, gpus=gpus, token_budget=token_budget, links=links)
    if num_targets:
        split = split_rate(
            rates,
            targets=num_targets,
            drafters=gpus - num_targets,
            token_budget=token_budget,
            links=links,
        )
    else:
        best = best_split(rates, gpus=gpus, token_budget=token_budget, links=links)
        split = best and best[1]
    return {"colocated": colocated, "split": split and split / gpus}


def decide(
    requested: Literal["auto", "colocated", "split"],
    *,
    gpus: int,
    rates: StageRates,
    memory: MemoryNeeds,
    token_budget: int,
    links: Links,
    num_targets: int = 0,
) -> Placement:
    """The layout to run. `num_targets` > 0 fixes the split's target count (given roles).

    Raises PlacementError when nothing fits (the message names the numbers)."""
    predicted = predict(
        rates, gpus=gpus, token_budget=token_budget, links=links, num_targets=num_targets
    )
    best = best_split(rates, gpus=gpus, token_budget=token_budget, links=links)
    split_targets = num_targets or (best[0] if best else 0)
    fits_together = memory.fits(memory.colocated)
    fits_apart = memory.fits(memory.target_side) and memory.fits(memory.drafter_side)
    room = (
        "no limit"
        if memory.device_bytes is None
        else (f"{HEADROOM:.0%} of {memory.device_bytes / GIB:.1f} GiB")
    )
    need = (
        f"target {memory.target_side / GIB:.1f} GiB + drafter {memory.drafter_side / GIB:.1f} GiB"
        f" vs {room}"
    )
    advice = memory.length_advice()

    def split(reason: str) -> Placement:
        if gpus < 2:
            why = "" if fits_together else advice
            raise PlacementError(f"{reason}; split needs at least 2 devices, {gpus} given{why}")
        if not fits_apart:
            raise PlacementError(f"neither layout fits: {need}{advice}")
        return Placement("split", split_targets, gpus - split_targets, reason, gpus, predicted)

    def colocated(reason: str) -> Placement:
        if not fits_together:
            raise PlacementError(f"colocated does not fit: {need}{advice}")
        return Placement("colocated", gpus, gpus, reason, gpus, predicted)

    if requested == "colocated":
        return colocated("requested")
    if requested == "split":
        return split("requested")
    if not fits_together:
        return split(f"the target does not fit beside the drafter: {need}")
    if predicted["split"] is not None and predicted["split"] > predicted["colocated"]:
        return split(
            f"split predicts {predicted['split']:.0f} tokens/s per GPU, colocated "
            f"{predicted['colocated']:.0f}"
        )
    other = "" if predicted["split"] is None else f", split {predicted['split']:.0f}"
    return colocated(
        f"fits ({need}); colocated predicts {predicted['colocated']:.0f} tokens/s per GPU{other}"
    )


class PlacementError(SettingsError):
    """No layout fits the devices; one line naming the numbers (exit 2)."""


def overlap_from(colocated: float, target: float, drafter: float) -> float:
    """The overlap that makes the model reproduce a measured colocated rate, within [-1, 1]
    (below 0 the two stages slow each other more than running one after the other would)."""
    long_s, short_s = max(1 / target, 1 / drafter), min(1 / target, 1 / drafter)
    return min(1.0, max(-1.0, (long_s + short_s - 1 / colocated) / short_s))


# ---- memory estimates ------------------------------------------------------------------------
# Calibrated on the Qwen3-8B shape (d 4096, ffn 12288, 5 drafter layers, vocab 151936, T 16384,
# 1024 anchors x 16): the estimate is 33.4 GiB for the drafter, measured peak 34.0 GiB (compiled
# step, BENCHMARKS.md). Activations saved for backward per block row and layer: about 10 d-wide
# and 3 ffn-wide bf16 tensors (projections, norms, RoPE, SwiGLU); the features and the fc output
# per context row; one fp32 CE chunk [chunk, V] and its gradient.


def drafter_bytes(
    *,
    params: float,
    frozen_params: float,
    hidden: int,
    ffn: int,
    layers: int,
    vocab: int,
    num_features: int,
    token_budget: int,
    num_anchors: int,
    block_size: int,
    ce_chunk: int,
    kv_width: int = 0,
) -> tuple[float, float]:
    """(training state, activations) of one drafter step in bytes. kv_width: the key (and
    value) width of a layer, num_key_value_heads * head_dim, for its context keys and values."""
    state = 16 * params + 2 * frozen_params  # fp32 param, grad, AdamW m and v; bf16 frozen
    rows = num_anchors * block_size
    saved = layers * rows * (10 * hidden + 3 * ffn) * 2
    context = token_budget * (num_features + 1) * hidden * 2 * 2  # static features + fc out
    # per layer and context row, bf16: k before its norm (the norm's backward reads it) and the
    # [context; block] copies of k and v that attention saves
    context += layers * token_budget * 3 * kv_width * 2
    ce = 2 * min(ce_chunk, rows) * vocab * 4
    return state, saved + context + ce


def target_bytes(
    *,
    weight_bytes: float,
    hidden: int,
    ffn: int,
    feature_width: int,
    token_budget: int,
    batch_tokens: int,
    mlp_rows: int = 16384,
) -> tuple[float, float]:
    """(weights, activations) of the frozen target's forward in bytes: one layer's transient
    tensors at `batch_tokens` (no backward, no lm_head: early exit) and the staging pack. A
    packed forward runs the whole pack at once: its batch_tokens is the token budget; its MLP
    runs `mlp_rows` rows at a time (targets/packed/dense.py: MLP_ROWS)."""
    transient = batch_tokens * 4 * hidden * 2 + min(batch_tokens, mlp_rows) * 3 * ffn * 2
    staging = token_budget * feature_width * 2  # bf16 features, a captured last layer included
    return weight_bytes, transient + staging
