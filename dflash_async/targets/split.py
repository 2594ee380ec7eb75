"""A target replica split by layers: which contiguous range of decoder layers each stage holds.

`split_layers` cuts the layers a target worker runs (0 .. the last captured layer: the final norm
and the lm_head never run) into `stages` contiguous ranges whose bytes are as even as they can be
(the largest stage as small as possible; a layer's bytes are all its parameters, experts
included; the embedding counts on the first stage, which embeds the tokens). `layer_sizes` reads
those bytes from a model (loaded, or built on the meta device for the placement's check before
loading). The stage forwards themselves are the packed forwards restricted to a range
(`targets/forward.py: select_target_forward(layers=...)`); the chain of stage workers that runs
them is `stages/chain.py`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from dflash_async.errors import SettingsError


@dataclass(frozen=True)
class LayerSizes:
    """Parameter bytes of the layers a target worker runs and of its input embedding."""

    layers: tuple[int, ...]  # bytes of layer 0 .. the last captured layer
    embedding: int


@dataclass(frozen=True)
class Split:
    """The stage ranges of one replica and the weight bytes each stage holds."""

    ranges: tuple[range, ...]
    stage_bytes: tuple[int, ...]


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (works on the meta device: no memory)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def layer_sizes(text_model: nn.Module, *, last_layer: int) -> LayerSizes:
    """The bytes of layers 0..last_layer of a decoder stack (`target/loading.text_model`)."""
    layers = tuple(module_bytes(layer) for layer in text_model.layers[: last_layer + 1])
    return LayerSizes(layers, module_bytes(text_model.embed_tokens))


def split_layers(sizes: LayerSizes, *, stages: int) -> Split:
    """Contiguous ranges, one per stage, minimising the largest stage's bytes (ties: the earlier
    cut); SettingsError (exit 2) when there are more stages than layers to run."""
    n = len(sizes.layers)
    if stages > n:
        raise SettingsError(
            f"DFLASH_TARGET__STAGES={stages}: the target runs only {n} decoder layers (up to the "
            f"last captured one); use at most {n} stages"
        )
    prefix = [0]
    for b in sizes.layers:
        prefix.append(prefix[-1] + b)

    def cost(lo: int, hi: int) -> int:  # bytes of a stage holding layers [lo, hi)
        return prefix[hi] - prefix[lo] + (sizes.embedding if lo == 0 else 0)

    cuts = _best_cuts(n, stages, cost)
    ranges = tuple(range(lo, hi) for lo, hi in itertools.pairwise(cuts))
    return Split(ranges, tuple(cost(r.start, r.stop) for r in ranges))


def _best_cuts(n: int, stages: int, cost) -> list[int]:
    """[0, c1, ..., n]: the min-max partition of n items into `stages` non-empty runs (dynamic
    programming over (stages used, items covered); n and stages are small)."""
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[s][i]: s stages cover [0, i)
    back = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], cost(j, i))
                if value < best[s][i]:
                    best[s][i], back[s][i] = value, j
    cuts, i = [n], n
    for s in range(stages, 0, -1):
        i = back[s][i]
        cuts.append(i)
    return cuts[::-1]


def replica_devices(devices: Sequence, *, stages: int) -> list[tuple]:
    """Consecutive groups of `stages` devices, one group per replica; SettingsError (exit 2)
    unless the devices divide evenly."""
    if len(devices) % stages:
        raise SettingsError(
            f"DFLASH_TARGET__STAGES={stages} with {len(devices)} devices "
            f"({','.join(map(str, devices))}): each target replica takes {stages} devices, so "
            "list a multiple of it"
        )
    return [tuple(devices[i : i + stages]) for i in range(0, len(devices), stages)]
