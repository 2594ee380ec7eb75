"""One behaviour test per bug of docs/DFLASH.md s.6 that destroyed acceptance in other trainers (1-4, 6).

Each test perturbs one input and checks which block logits move. "Unchanged" means equal to float
precision (an invisible key must get exactly zero attention weight); "changed" means moved by far
more than that, so a test cannot pass by accident. Bug 5 (the checkpoint format) is tested with the
checkpoint code.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from conftest import (
    TinySpec,
    make_anchors,
    make_objective,
    tiny_batch,
    tiny_config,
    tiny_drafter,
    tiny_target_weights,
)

from dflash_async.data.packing import PackedBatch
from dflash_async.model.drafter_config import DrafterConfig

pytestmark = pytest.mark.usefixtures("single_thread")

# Documents: 0 = rows 0..23, 1 = rows 24..63 (prompt 24..33, hole at 49..50), 2 = rows 64..93
# (supervised from its first row); padding 94..127. T and A*B are multiples of 128 for flex.
SPEC = TinySpec(block_size=8, doc_lengths=(24, 40, 30), num_pad=34, seed=7)  # T = 128
DOC1 = 24
GAMMA = 4.0
NUM_ANCHORS = 16


EAGER_FLEX = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@dataclass(frozen=True)
class Backend:
    device: str
    dtype: torch.dtype
    attention: str
    same_atol: float  # "unchanged" tolerance
    moved_min: float = 1e-3  # "changed" means max |diff| above this


BACKENDS = [
    pytest.param(Backend("cpu", torch.float64, "sdpa", 1e-12), id="cpu-sdpa-f64"),
    # eager flex_attention: forward only on CPU (no backward), but it checks the BlockMask rule
    pytest.param(Backend("cpu", torch.float64, "flex", 1e-12), id="cpu-flex-f64", marks=EAGER_FLEX),
    pytest.param(
        Backend("cuda", torch.float32, "sdpa", 1e-4), id="cuda-sdpa-f32", marks=pytest.mark.gpu
    ),
    pytest.param(
        Backend("cuda", torch.float32, "flex", 1e-4), id="cuda-flex-f32", marks=pytest.mark.gpu
    ),
]


@dataclass
class World:
    backend: Backend
    config: DrafterConfig
    drafter: torch.nn.Module
    embed: torch.Tensor
    lm_head: torch.Tensor
    batch: PackedBatch

    def logits(
        self, anchors: list[int], batch: PackedBatch | None = None, embed=None
    ) -> torch.Tensor:
        """block_logits [len(anchors), B, V] in float64 on the CPU (invalid slots dropped)."""
        obj = make_objective(
            self.config,
            self.drafter,
            self.embed if embed is None else embed,
            self.lm_head,
            num_anchors=NUM_ANCHORS,
            gamma=GAMMA,
            attention=self.backend.attention,
        )
        with torch.no_grad():
            out = obj.block_logits(
                self.batch if batch is None else batch,
                make_anchors(anchors, NUM_ANCHORS, self.backend.device),
            )
        return out[: len(anchors)].double().cpu()

    def sums(self, anchors: list[int], batch: PackedBatch):
        obj = make_objective(
            self.config,
            self.drafter,
            self.embed,
            self.lm_head,
            num_anchors=NUM_ANCHORS,
            gamma=GAMMA,
            attention=self.backend.attention,
        )
        with torch.no_grad():
            return obj(batch, make_anchors(anchors, NUM_ANCHORS, self.backend.device))

    def assert_same(self, a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        diff = (a - b).abs().max().item()
        assert diff <= self.backend.same_atol, f"{what}: moved by {diff:.3e} (should not move)"

    def assert_moved(self, a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        diff = (a - b).abs().max().item()
        assert diff > self.backend.moved_min, f"{what}: moved only {diff:.3e} (should move)"


@pytest.fixture(params=BACKENDS)
def world(request: pytest.FixtureRequest) -> World:
    backend: Backend = request.param
    config = tiny_config(SPEC)
    drafter = tiny_drafter(config, SPEC.seed, backend.dtype, backend.device)
    embed, lm_head = tiny_target_weights(config, SPEC.seed, backend.dtype, backend.device)
    batch = tiny_batch(SPEC, config, backend.dtype, backend.device)
    return World(backend, config, drafter, embed, lm_head, batch)


def with_features(batch: PackedBatch, rows: list[int], seed: int) -> PackedBatch:
    """A copy of the batch whose features at `rows` are replaced by fresh random values."""
    gen = torch.Generator().manual_seed(seed)
    features = batch.features.clone()
    new = torch.randn(len(rows), features.shape[1], generator=gen, dtype=torch.float64)
    features[rows] = new.to(features.device, features.dtype)
    return replace(batch, features=features)


def with_tokens(batch: PackedBatch, rows: list[int], seed: int, vocab: int) -> PackedBatch:
    """A copy whose input_ids at `rows` are replaced by different (non-mask) tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = batch.input_ids.clone()
    shift = torch.randint(1, vocab - 2, (len(rows),), generator=gen).to(ids.device)
    ids[rows] = (ids[rows] + shift) % (vocab - 1)
    return replace(batch, input_ids=ids)


def test_context_at_and_after_the_anchor_is_invisible(world: World) -> None:
    """Bug 2: the anchor's own target features (and later ones) must not reach its block."""
    a = DOC1 + 14
    base = world.logits([a])
    at_anchor = with_features(world.batch, [a], seed=1)
    world.assert_same(world.logits([a], at_anchor), base, "features at the anchor row")
    after = with_features(world.batch, list(range(a, world.batch.num_tokens)), seed=2)
    world.assert_same(world.logits([a], after), base, "features at and after the anchor")
    before = with_features(world.batch, [a - 1], seed=3)
    world.assert_moved(world.logits([a], before), base, "features just before the anchor")


def test_overlapping_blocks_do_not_see_each_other(world: World) -> None:
    """Bug 3: blocks at a and a+2 overlap; neither sees the other's slots."""
    a1, a2 = DOC1 + 11, DOC1 + 13
    both = world.logits([a1, a2])
    world.assert_same(both[0], world.logits([a1])[0], "block a1 with vs without block a2")
    world.assert_same(both[1], world.logits([a2])[0], "block a2 with vs without block a1")
    # x[a2] is block a2's input but only a label of block a1.
    changed = world.logits([a1, a2], with_tokens(world.batch, [a2], seed=4, vocab=SPEC.vocab_size))
    world.assert_same(changed[0], both[0], "block a1 after changing block a2's anchor token")
    world.assert_moved(changed[1], both[1], "block a2 after changing its own anchor token")


def test_other_documents_are_invisible(world: World) -> None:
    """Context is per document: rows of documents 0 and 2 never reach a block of document 1."""
    anchors = [DOC1 + 12, DOC1 + 30, 70]
    base = world.logits(anchors)
    others = [p for p in range(world.batch.num_tokens) if not DOC1 <= p < DOC1 + 40]
    batch = with_features(world.batch, others, seed=5)
    batch = with_tokens(batch, others, seed=6, vocab=SPEC.vocab_size)
    moved = world.logits(anchors, batch)
    world.assert_same(moved[:2], base[:2], "document-1 blocks after changing documents 0 and 2")
    world.assert_moved(moved[2], base[2], "the document-2 block after changing document 2")


def test_slot_k_is_trained_on_the_token_at_anchor_plus_k(world: World) -> None:
    """Bug 1: with x[a+k] set to slot k's argmax, acc = 1 and tau_hat = B; the CE uses x[a+k]."""
    a, block = DOC1 + 12, SPEC.block_size  # a+1 .. a+B-1 are supervised and inside document 1
    logits = world.logits([a])[0]  # [B, V]; does not depend on x[a+1..]
    ids = world.batch.input_ids.clone()
    for k in range(1, block):
        ids[a + k] = int(logits[k].argmax())
    batch = replace(world.batch, input_ids=ids)
    sums = world.sums([a], batch)
    assert float(sums.correct) == float(sums.supervised) == block - 1
    assert float(sums.accepted) == block - 1 and float(sums.blocks) == 1

    weights = torch.exp(-torch.arange(block - 1, dtype=torch.float64) / GAMMA)
    logp = torch.log_softmax(logits[1:], dim=-1)  # slots 1..B-1

    def weighted_ce(labels: torch.Tensor) -> float:
        return float(-(weights * logp.gather(1, labels[:, None].cpu())[:, 0]).sum())

    same = weighted_ce(ids[a + 1 : a + block])
    shifted = weighted_ce(ids[a + 2 : a + block + 1])
    assert abs(same - shifted) > 1e-3 * abs(same), (
        "test precondition: labels must be distinguishable"
    )
    rtol = 1e-9 if world.backend.dtype == torch.float64 else 1e-4
    assert abs(float(sums.ce_sum) - same) <= rtol * abs(same), (float(sums.ce_sum), same, shifted)
    assert abs(float(sums.weight_sum) - float(weights.sum())) <= rtol * float(weights.sum())


def test_attention_inside_the_block_is_bidirectional(world: World) -> None:
    """Bug 4: slot 0 (the anchor) must see the later MASK slots, so changing their input moves it."""
    anchors = [DOC1 + 12, DOC1 + 20]
    base = world.logits(anchors)
    embed = world.embed.clone()
    embed[world.config.mask_token_id] = -embed[world.config.mask_token_id]
    moved = world.logits(anchors, embed=embed)
    world.assert_moved(moved[:, 0], base[:, 0], "slot 0 after changing the MASK slots' input")


def test_every_invisible_key_has_exactly_zero_influence(world: World) -> None:
    """Bug 6: a boolean mask ADDED to scores masks nothing; here all invisible inputs change at once."""
    a = DOC1 + 20
    base = world.logits([a, DOC1 + 22])
    visible = set(range(DOC1, a))
    invisible = [p for p in range(world.batch.num_tokens) if p not in visible]
    batch = with_features(world.batch, invisible, seed=8)
    batch = with_tokens(batch, [p for p in invisible if p != a], seed=9, vocab=SPEC.vocab_size)
    world.assert_same(world.logits([a, DOC1 + 22], batch)[0], base[0], "block a, invisible inputs")


def test_fully_masked_slots_leave_loss_and_gradients_finite(world: World) -> None:
    """s.2: invalid slots' queries see nothing; their output must be finite and excluded."""
    if world.backend.device == "cpu" and world.backend.attention == "flex":
        pytest.skip("flex_attention has no backward on CPU")
    obj = make_objective(
        world.config,
        world.drafter,
        world.embed,
        world.lm_head,
        num_anchors=NUM_ANCHORS,
        gamma=GAMMA,
        attention=world.backend.attention,
    )
    world.drafter.zero_grad(set_to_none=True)
    sums = obj(world.batch, make_anchors([DOC1 + 12], NUM_ANCHORS, world.backend.device))
    sums.ce_sum.backward()
    assert torch.isfinite(sums.ce_sum) and float(sums.blocks) == 1
    for name, param in world.drafter.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
