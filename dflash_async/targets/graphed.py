"""A packed target forward replayed from one CUDA graph (DFLASH_TARGET__CUDA_GRAPH, default off).

Owns `GraphedForward`, a wrapper with the FeatureForward call shape: its first call runs the
forward eagerly (that call compiles and autotunes, and its features are the ones returned),
then captures the whole forward once, on fixed input and feature buffers of its own; every later
call copies the pack's layout in, replays the graph and copies the features out. Why: the packed
Qwen3-30B-A3B forward launches ~40 kernels a layer from Python, and the GPU waited between
them: 214-215 -> 207.6-209.2 ms in bf16, 154.0-154.3 -> 146.0-148.9 ms with FP8 matmuls, the
features equal bit for bit (H200, 2026-12-05, `bench target --cuda-graph`, BENCHMARKS.md). The
dense Qwen3-8B forward gains nothing (its GEMMs hide the launches), so it is a setting.

What it relies on: the packed forwards have one shape per token budget, read no host value and
never sync (the mask, the rotary tables and the experts' routing are built on the device), and
never read `lengths`; only they are wrapped (targets/forward.py: PackedDenseForward's paths,
whole, unsplit). The capture follows the drafter step's rules (docs/GPU.md, "Mechanics"): in the
thread that replays, after a warm-up on a side stream, under the process-wide capture lock with
thread-local error mode; a failed capture raises (fatal: CUDA's capture state is then unusable
for the rest of the process). The graph keeps the forward's transient activations in its own
memory pool for the whole run: 2.3-2.9 GB at Qwen3-30B-A3B, T = 16384 (`bench target
--cuda-graph`'s held_gb).

CPU-GPU syncs: two at start-up (around the capture), none per call.
"""

from __future__ import annotations

import torch

from dflash_async.runtime.devices import CAPTURE_LOCK


class GraphedForward:
    """`forward` (a packed FeatureForward on one CUDA device) replayed from one CUDA graph after
    its first call; see the module doc. `device`: the forward's device."""

    def __init__(self, forward, *, device: torch.device) -> None:
        self.forward, self.device = forward, device
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: tuple[torch.Tensor, ...] = ()
        self.features: torch.Tensor | None = None

    def __call__(self, input_ids, position_ids, doc_ids, features, lengths) -> torch.Tensor:
        if self.graph is None:
            out = self.forward(input_ids, position_ids, doc_ids, features, lengths)
            self._capture((input_ids, position_ids, doc_ids), features)
            return out
        for buffer, given in zip(self.inputs, (input_ids, position_ids, doc_ids), strict=True):
            buffer.copy_(given)
        self.graph.replay()
        return features.copy_(self.features)

    def _capture(self, inputs: tuple[torch.Tensor, ...], features: torch.Tensor) -> None:
        """One warm-up call on the graph's own buffers on a side stream, then the capture."""
        self.inputs = tuple(t.clone() for t in inputs)  # a real layout: what a pack looks like
        self.features = torch.empty_like(features)
        args = (*self.inputs, self.features, None)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self.forward(*args)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with CAPTURE_LOCK:
            torch.cuda.synchronize(self.device)  # sync point: start-up only
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.forward(*args)
            torch.cuda.synchronize(self.device)  # sync point: start-up only
        self.graph = graph
