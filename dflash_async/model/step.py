"""The drafter train step over static input buffers: eager, or replayed as two CUDA graphs.

One optimizer step of M drafters (data parallel, each with its own pack):
  phase A (per drafter): sample anchors, forward, backward of sum(w*CE) into one flat grad
          buffer (fp32, or bf16 with working weights); the step's sums (StepSums) land in a
          static vector next to it;
  reduce  (across drafters): sum the grad buffers and the sums vectors (no-op for M = 1);
  phase B (per drafter): grads /= global sum(w), clip, AdamW, lr schedule advance (the next
          backward overwrites the grads: no zeroing);
          either torch's clip_grad_norm_ and fused AdamW (the reference), or update.py's one
          norm and compiled AdamW (the GPU default: 30 instead of 52 bytes per parameter).
Dividing by the GLOBAL weight sum is what makes M drafters' update equal to one drafter seeing all
M packs' blocks (docs/DFLASH.md s.4), and keeps all drafters' weights identical.

Working weights (GPU default, `working_weights`): the forward uses a bf16 copy of each matmul
weight instead of autocast's cast of the fp32 master at every use; phase B's AdamW writes the copy
with the master. The copies are the values autocast would make, so the forward does not change;
their gradients are bf16 GEMM outputs, which backward no longer casts to fp32, and the gradient
buffer is bf16 (the RMSNorm weights' fp32 gradients are rounded into it). Memory: the copies take
the bytes the buffer gives up. Time: 4.1 ms of a 264.7 ms Qwen3-8B step on an H200, and 1.8 GiB
less peak memory (BENCHMARKS.md).

Both phases have fixed shapes and no host syncs, so each is captured once as a CUDA graph
(docs/GPU.md: in the replaying thread, after warm-up, one capture at a time) and replayed; eager
mode runs the very same functions. Static buffers are never reallocated after construction.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch
from torch import nn

from dflash_async.data.packing import PackedBatch, document_starts
from dflash_async.model.attention_rule import FULL_RULE
from dflash_async.model.layer_rules import AttentionRule
from dflash_async.model.objective import (
    Anchors,
    DFlashObjective,
    StepSums,
    pad_anchors,
    sample_anchors,
)
from dflash_async.model.optim import LrSchedule, build_optimizer, flat_buffer, flat_grad_buffer
from dflash_async.model.step_ranges import step_range
from dflash_async.model.update import WEIGHT_SUM_FLOOR, folded_adamw, folded_clip_coefficient
from dflash_async.runtime.devices import CAPTURE_LOCK

# Indices of the per-step statistics vector (fp32, on the drafter device).
# (StepSums' fields, then visible_pairs: pipeline/distributed.py sums those before it over nodes)
STATS = (
    "ce_sum",
    "weight_sum",
    "correct",
    "supervised",
    "accepted",
    "blocks",
    "topk_hits",
    "selector_correct",
    "visible_pairs",
)
NUM_STATS = len(STATS)


def working_copies(params: list[nn.Parameter], *, dtype: torch.dtype) -> list[torch.Tensor | None]:
    """A working copy of each matmul weight (2-D) in `dtype`, an autograd leaf the forward
    reads instead of the fp32 weight; None for the rest (the norms)."""
    return [
        p.detach().to(dtype, copy=True).requires_grad_() if p.ndim == 2 else None for p in params
    ]


def visible_pairs(
    doc_ids: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    rules: Sequence[AttentionRule] = (FULL_RULE,),
) -> torch.Tensor:
    """Attended (query, key) pairs of the step per layer, averaged over the layers' `rules`, for
    FLOP accounting (0-d, on the device): slot k of a block sees its document's c context rows
    before the anchor (a sliding layer: rows p >= anchor + k - (W - 1), so min(c, W - 1 - k) of
    them, none once k >= W - 1: model/attention_rule.py's per-slot rule) and its own block's slots s
    (a causal layer: s <= k; a sliding one: |k - s| < W). The mean times the layer count is the
    step's sum."""
    context = torch.where(valid, anchors - document_starts(doc_ids)[anchors], 0)  # [A]
    blocks = valid.sum()
    B = block_size
    total = torch.zeros((), device=anchors.device, dtype=torch.int64)
    for rule, layers in collections.Counter(rules).items():  # at most two distinct rules
        W = rule.window
        if W is None:
            seen = B * context.sum()
        else:  # sum over k of min(c, max(0, W - 1 - k)): fixed [A, B], no host read
            reach = (W - 1 - torch.arange(B, device=anchors.device)).clamp(min=0)  # [B]
            seen = torch.minimum(context[:, None], reach[None, :]).sum()
        own = sum(  # block slots s each slot k sees: host integers of B, W and causal
            min(k + 1 if rule.causal else B, k + (W or B)) - max(0, k - (W or B) + 1)
            for k in range(B)
        )
        total = total + layers * (seen + own * blocks)
    return total.double() / len(rules)  # exact below 2^53 pairs


class DrafterStep:
    """One drafter's step: static inputs, phase A / phase B, optional CUDA graphs.

    Call from the drafter's own DeviceWorker thread only (graphs and streams are per thread).
    """

    def __init__(
        self,
        objective: DFlashObjective,
        optimizer: torch.optim.Optimizer,
        schedule: LrSchedule,
        *,
        batch: PackedBatch,
        num_anchors: int,
        grad_clip: float,
        generator: torch.Generator | None = None,
        anchor_sampler: Callable[[PackedBatch], Anchors] | None = None,
        working_weights: bool = False,
    ) -> None:
        self.objective = objective
        self.optimizer = optimizer
        self.schedule = schedule
        self.batch = batch  # static inputs
        self.num_anchors = num_anchors
        self.block_size = objective.config.block_size
        self.grad_clip = grad_clip
        # Anchor noise is drawn eagerly into a static buffer before each phase A, outside any
        # graph: eager and replayed steps then see the same anchors for the same seed, and the
        # graphs hold no RNG state (docs/GPU.md: graph RNG failures poison the process).
        self.generator = generator
        # None: sample from the noise buffer. Tests inject fixed anchors (M drafters' update must
        # equal one drafter's on the same blocks); a sampler must be sync-free to be captured.
        self.anchor_sampler = anchor_sampler
        # None: the reference phase B (clip_grad_norm_, optimizer.step()); else (build() on a
        # GPU, tests) update.folded_adamw(optimizer, params): AdamW of the grads times a folded
        # coefficient.
        self.adamw: Callable[[torch.Tensor], None] | None = None
        self.noise = torch.zeros(
            batch.num_tokens + 1, dtype=torch.float64, device=batch.input_ids.device
        )
        named = [(n, p) for n, p in objective.drafter.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        # Working copies of the matmul weights in the dtype the matmuls run in (bf16 under the
        # step's autocast on a GPU, fp32 on the CPU) and a gradient buffer in that dtype, or none
        # and an fp32 buffer.
        device = self.params[0].device
        self.working: list[torch.Tensor | None] = [None] * len(self.params)
        if working_weights:
            self.grad_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            self.working = working_copies(self.params, dtype=self.grad_dtype)
            shapes = [p.shape for p in self.params]
            self.flat_grad, self.grad_views = flat_buffer(
                shapes, dtype=self.grad_dtype, device=device
            )
        else:
            self.grad_dtype = torch.float32
            self.flat_grad, self.grad_views = flat_grad_buffer(self.params)
        # keyed by the objective's parameter names, for functional_call
        self._working_by_name = {
            f"drafter.{n}": w
            for (n, _), w in zip(named, self.working, strict=True)
            if w is not None
        }
        # The tensors backward makes gradients for: the working copy where there is one.
        leaves = zip(self.params, self.working, strict=True)
        self._grad_leaves = [p if w is None else w for p, w in leaves]
        self._written: set[int] = set()  # the views the gradient writers filled this backward
        for i, (leaf, view) in enumerate(zip(self._grad_leaves, self.grad_views, strict=True)):
            leaf.register_post_accumulate_grad_hook(self._gradient_writer(i, view))
        self.stats = torch.zeros(NUM_STATS, dtype=torch.float32, device=device)
        self.grad_norm = torch.zeros((), dtype=torch.float32, device=device)
        self.graphs: tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph] | None = None

    @classmethod
    def build(
        cls,
        objective: DFlashObjective,
        *,
        token_budget: int,
        peak_lr: float,
        warmup_steps: int,
        total_steps: int,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        generator: torch.Generator | None = None,
        compiled_update: bool | None = None,
        working_weights: bool | None = None,
    ) -> DrafterStep:
        """The step around an objective: lr schedule in a device tensor, AdamW reading it, and
        all-padding static inputs on the objective's device in the target's dtype.
        compiled_update: phase B through update.py's compiled AdamW; None: where the objective
        compiles (GPU), else the reference path. working_weights: the matmul weights' working
        copies (see the module docstring); None: with the compiled update. They need update.py's
        AdamW (compiled or not), never the reference path."""
        weight = objective.lm_head_weight
        schedule = LrSchedule(
            peak_lr=peak_lr,
            warmup_steps=warmup_steps,
            total_steps=total_steps,
            device=weight.device,
        )
        drafter = objective.drafter
        optimizer = build_optimizer(
            drafter.parameters(), lr_tensor=schedule.lr, weight_decay=weight_decay
        )
        feature_dim = drafter.config.feature_width
        batch = PackedBatch.empty(
            token_budget, feature_dim, device=weight.device, feature_dtype=weight.dtype
        )
        if compiled_update is None:
            compiled_update = objective.config.compile and weight.device.type == "cuda"
        if working_weights is None:
            working_weights = compiled_update
        step = cls(
            objective,
            optimizer,
            schedule,
            batch=batch,
            grad_clip=grad_clip,
            generator=generator,
            num_anchors=objective.config.num_anchors,
            working_weights=working_weights,
        )
        if compiled_update or working_weights:
            step.use_folded_update(compile=compiled_update)
        return step

    def use_folded_update(self, *, compile: bool) -> None:
        """Phase B through update.py's folded AdamW over this step's gradient views, writing the
        working copies (compile: torch.compile'd at its first call; GPU)."""
        self.adamw = folded_adamw(
            self.optimizer,
            self.params,
            compile=compile,
            grads=self.grad_views,
            working=self.working,
        )

    @property
    def device(self) -> torch.device:
        return self.flat_grad.device

    def _autocast(self):
        if self.device.type == "cuda":
            # no autocast weight cache: it does not survive graph capture/replay
            return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)
        return nullcontext()

    def _anchors(self) -> Anchors:
        """This step's anchors: the injected sampler's, else drawn from the noise buffer; padded
        with invalid slots to the count the attention takes (flex: whole tiles of A * B rows)."""
        if self.anchor_sampler is not None:
            anchors = self.anchor_sampler(self.batch)
        else:
            anchors = sample_anchors(
                self.batch.loss_mask, self.batch.doc_ids, self.num_anchors, noise=self.noise
            )
        return pad_anchors(anchors, self.objective.anchor_multiple)

    def _gradient_writer(self, index: int, view: torch.Tensor) -> Callable[[torch.Tensor], None]:
        """The hook that writes a leaf's new gradient into its view. Backward writes each
        gradient instead of adding it (_forward_backward sets .grad to None first, so autograd
        hands the new gradient over): no zeroing of the buffer and a copy instead of an add, 8
        instead of 16 bytes per fp32 parameter: 3.0 instead of 5.8 ms of kernels in a Qwen3-8B
        step on an H200 (BENCHMARKS.md). A parameter no hook ran for would keep the last step's
        values: _forward_backward checks `_written`."""

        def write(leaf: torch.Tensor) -> None:
            if leaf.grad.data_ptr() != view.data_ptr():  # host metadata: no sync
                view.copy_(leaf.grad)  # an fp32 norm gradient into a bf16 buffer: rounded
                leaf.grad = view if leaf.dtype == view.dtype else None
            self._written.add(index)

        return write

    @torch.no_grad()
    def sync_working_weights(self) -> None:
        """Set each working copy to its master weight (after anything but AdamW wrote the
        masters: construction, undoing the warm-up, resume). No-op without copies."""
        for p, w in zip(self.params, self.working, strict=True):
            if w is not None:
                w.copy_(p)

    def _objective_sums(self, anchors: Anchors) -> StepSums:
        if not self._working_by_name:
            return self.objective(self.batch, anchors)
        # The forward reads the working copies in place of the masters (a swap of module
        # attributes for the call; the compiled layers see bf16 weights, autocast casts nothing).
        return torch.func.functional_call(
            self.objective, self._working_by_name, (self.batch, anchors)
        )

    def _forward_backward(self) -> None:
        batch = self.batch
        anchors = self._anchors()
        with self._autocast():
            sums = self._objective_sums(anchors)
        for leaf in self._grad_leaves:
            leaf.grad = None  # AccumulateGrad then hands the new gradient to the writer hook
        self._written.clear()
        sums.ce_sum.backward()
        if len(self._written) != len(self.params):
            missing = sorted(set(range(len(self.params))) - self._written)
            raise RuntimeError(f"drafter parameters {missing} got no gradient in this step")
        pairs = visible_pairs(
            batch.doc_ids,
            anchors.positions,
            anchors.valid,
            self.block_size,
            self.objective.drafter.config.attention_rules(),
        )
        self.stats.copy_(torch.stack([*(s.detach().float() for s in sums), pairs.float()]))

    def _update(self) -> None:
        # grads hold d(sum w*CE)/dθ summed over drafters; stats[1] the global sum(w)
        with step_range("optimizer"):
            if self.adamw is None:
                self.flat_grad.div_(self.stats[1].clamp_min(WEIGHT_SUM_FLOOR))
                # foreach over the flat buffer's views; error_if_nonfinite=True would sync
                norm = nn.utils.clip_grad_norm_(self.params, self.grad_clip, foreach=True)
                self.grad_norm.copy_(norm)
                self.optimizer.step()
            else:
                coef = folded_clip_coefficient(
                    self.flat_grad,
                    self.stats[1],
                    grad_clip=self.grad_clip,
                    norm_out=self.grad_norm,
                )
                self.adamw(coef)
            self.schedule.advance_()

    def seed_anchors(self, seed: int) -> None:
        """Draw the next phase A's anchor noise from `seed` (a pack's, PackCursor.anchor_seed):
        with several drafters a pack may reach any of them (rings balance), and its anchors
        must not depend on which. Host-side only (no sync, nothing captured)."""
        if self.generator is None:
            raise ValueError("seed_anchors needs the step's own generator")
        self.generator.manual_seed(seed)

    def phase_a(self) -> None:
        """Forward + backward into flat_grad and stats (replay when captured)."""
        self.noise.uniform_(generator=self.generator)  # eager, before the graph: see __init__
        if self.graphs is not None:
            self.graphs[0].replay()
        else:
            self._forward_backward()

    def _check_update(self) -> None:
        if self.adamw is None and self._working_by_name:  # the masters hold no .grad to read
            raise RuntimeError("working weights need the folded update (use_folded_update)")

    def phase_b(self) -> None:
        """Normalise, clip, AdamW, advance the lr (replay when captured)."""
        self._check_update()
        if self.graphs is not None:
            self.graphs[1].replay()
        else:
            self._update()

    def capture(self, warmup_steps: int = 2, error_mode: str = "thread_local") -> dict[str, float]:
        """Warm up eagerly on the current static inputs, capture both phases, undo the warm-up.

        Warm-up steps are real optimizer steps (AdamW's state must exist before capture, and the
        first calls compile and autotune); afterwards the weights, AdamW's state and the lr
        schedule are put back as they were, so a captured run starts exactly where an eager one
        does. Runs under the process-wide capture lock; any failure is fatal (docs/GPU.md).
        Returns the seconds spent warming up (compiling, autotuning) and capturing.
        """
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        self._check_update()
        weights = [p.detach().clone() for p in self.params]
        start_step = int(self.schedule.step.item())  # sync point: start-up only
        started = time.perf_counter()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(warmup_steps):
                self._forward_backward()
                self._update()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph_a, graph_b = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with CAPTURE_LOCK:
            torch.cuda.synchronize(self.device)  # sync point: start-up only
            warmed = time.perf_counter()
            with torch.cuda.graph(graph_a, capture_error_mode=error_mode):
                self._forward_backward()
            with torch.cuda.graph(graph_b, pool=graph_a.pool(), capture_error_mode=error_mode):
                self._update()
            torch.cuda.synchronize(self.device)  # sync point: start-up only
        self.graphs = (graph_a, graph_b)
        self._restore(weights, start_step)
        return {"warmup_s": warmed - started, "capture_s": time.perf_counter() - warmed}

    @torch.no_grad()
    def _restore(self, weights: list[torch.Tensor], step: int) -> None:
        """Undo warm-up steps in place (graphs keep pointing at the same tensors)."""
        for p, w in zip(self.params, weights, strict=True):
            p.copy_(w)
        self.sync_working_weights()
        for state in self.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    value.zero_()
        self.schedule.set_step_(step)
        self.flat_grad.zero_()
