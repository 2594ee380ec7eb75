"""The vectorised DFlash objective equals the loop reference (tests/reference_dflash.py) in float64.

Each case is a tiny random drafter and a pack of several documents with padding at the end (a
prompt and a loss-mask hole in most long documents, every third document supervised from its first
row), overlapping blocks, blocks that run past their document's end into supervised rows of the
next one, and (in most cases) more anchor slots than anchors so invalid slots exist. Before
comparing, about 3/4 of the labels under each block are set to the reference's argmax there (labels
are never inputs of their own block, so the logits do not move): acc and tau_hat are then far from
0 and the "w = 0 ends the run" rule is exercised.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
import torch
from conftest import (
    TinySpec,
    compiled_sdpa_float64_problem,
    make_anchors,
    make_objective,
    randomize_,
    tiny_batch,
    tiny_config,
    tiny_drafter,
    tiny_target_weights,
)
from reference_dflash import (
    ReferenceResult,
    candidate_anchors,
    reference_objective,
    reference_with_gradients,
)

from dflash_async.data.packing import PackedBatch
from dflash_async.model.drafter_config import DrafterConfig

pytestmark = pytest.mark.usefixtures("single_thread")

# float64 on both sides: only summation order differs, so agreement is ~1e-13; 1e-9 leaves room.
RTOL, ATOL = 1e-9, 1e-11


@dataclass(frozen=True)
class Case:
    spec: TinySpec
    num_anchors: int | None  # None: every candidate is an anchor, plus 5 invalid slots
    invalid_slots: int
    gamma: float


CASES = {
    "d32_hd16_B4_invalid_slots": Case(TinySpec(), num_anchors=24, invalid_slots=6, gamma=3.0),
    "d64_B8_k3_all_slots_valid": Case(
        TinySpec(
            hidden_size=64,
            head_dim=16,
            intermediate_size=96,
            vocab_size=101,
            block_size=8,
            num_features=3,
            doc_lengths=(40, 30, 35),
            num_pad=23,
            seed=1,
        ),
        num_anchors=16,  # T = A*B = 128: flex's tile on GPU
        invalid_slots=0,
        gamma=4.0,
    ),
    "d48_hd12_B8_more_slots_than_candidates": Case(
        TinySpec(
            hidden_size=48,
            head_dim=12,
            intermediate_size=80,
            vocab_size=89,
            block_size=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            doc_lengths=(10, 50, 20),
            num_pad=16,
            seed=2,
            rope_theta=500.0,
        ),
        num_anchors=None,
        invalid_slots=5,
        gamma=4.0,
    ),
    "d40_hd10_kv1_B4_short_docs": Case(
        TinySpec(
            hidden_size=40,
            head_dim=10,
            num_attention_heads=4,
            num_key_value_heads=1,
            block_size=4,
            doc_lengths=(6, 13, 9, 30, 7),
            num_pad=15,
            seed=3,
        ),
        num_anchors=30,
        invalid_slots=4,
        gamma=2.0,
    ),
}


@dataclass
class Setup:
    config: DrafterConfig
    drafter: torch.nn.Module
    embed: torch.Tensor
    lm_head: torch.Tensor
    batch: PackedBatch
    anchors: list[int]  # the valid anchor positions
    num_anchors: int
    gamma: float


def choose_anchors(batch: PackedBatch, case: Case, seed: int) -> tuple[list[int], int]:
    """Every document's first, last and second-to-last candidate, the rest drawn at random."""
    cands = candidate_anchors(batch.loss_mask, batch.doc_ids)
    if case.num_anchors is None:
        return cands, len(cands) + case.invalid_slots
    docs = batch.doc_ids.tolist()
    fixed = set()
    for doc in sorted({docs[p] for p in cands}):
        mine = [p for p in cands if docs[p] == doc]
        fixed |= {mine[0], mine[-1], mine[-2 if len(mine) > 1 else -1]}
    fill = case.num_anchors - case.invalid_slots - len(fixed)
    rest = sorted(set(cands) - fixed)
    assert 0 <= fill <= len(rest), f"case does not fit: fill={fill}, rest={len(rest)}"
    picked = fixed | set(random.Random(seed).sample(rest, fill))
    return sorted(picked), case.num_anchors


def reference_plain(s: Setup) -> ReferenceResult:
    params = {n: p.detach().double() for n, p in s.drafter.named_parameters()}
    with torch.no_grad():
        return reference_objective(
            params,
            s.config,
            s.embed,
            s.lm_head,
            s.batch,
            s.anchors,
            block_size=s.config.block_size,
            mask_token_id=s.config.mask_token_id,
            gamma=s.gamma,
        )


def align_labels(s: Setup, seed: int) -> None:
    """Set ~3/4 of the non-anchor tokens under blocks to the reference argmax there (clear margin only)."""
    ref = reference_plain(s)
    rng, anchor_set = random.Random(seed), set(s.anchors)
    ids, assigned = s.batch.input_ids.clone(), set()
    for a, logits in zip(s.anchors, ref.block_logits, strict=True):
        for k in range(1, s.config.block_size):
            p = a + k
            if p >= len(ids) or p in anchor_set or p in assigned or rng.random() > 0.75:
                continue
            top2 = logits[k].topk(2).values
            if top2[0] - top2[1] > 1e-6:
                ids[p] = int(logits[k].argmax())
                assigned.add(p)
    s.batch = replace(s.batch, input_ids=ids)


def build(case: Case, *, align: bool = True) -> Setup:
    config = tiny_config(case.spec)
    drafter = tiny_drafter(config, case.spec.seed)
    embed, lm_head = tiny_target_weights(config, case.spec.seed)
    batch = tiny_batch(case.spec, config)
    anchors, num_anchors = choose_anchors(batch, case, case.spec.seed)
    s = Setup(config, drafter, embed, lm_head, batch, anchors, num_anchors, case.gamma)
    if align:
        align_labels(s, case.spec.seed)
    return s


def run_objective(s: Setup, anchors=None, **objective_kwargs):
    """Forward + backward of the implementation; returns (StepSums, {param name: grad})."""
    obj = make_objective(
        s.config,
        s.drafter,
        s.embed,
        s.lm_head,
        num_anchors=s.num_anchors,
        gamma=s.gamma,
        **objective_kwargs,
    )
    s.drafter.zero_grad(set_to_none=True)
    sums = obj(s.batch, anchors if anchors is not None else make_anchors(s.anchors, s.num_anchors))
    sums.ce_sum.backward()
    grads = {n: p.grad.detach().clone() for n, p in s.drafter.named_parameters()}
    return sums, grads


def assert_scalar(actual, expected: float, what: str, rtol: float = RTOL, atol: float = ATOL):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64).detach().cpu(),
        torch.tensor(float(expected), dtype=torch.float64),
        rtol=rtol,
        atol=atol,
        msg=lambda m: f"{what}: {m}",
    )


def assert_sums_match(sums, ref: ReferenceResult, rtol: float = RTOL, atol: float = ATOL) -> None:
    from dflash_async.stages.report import learning_fields

    for name in ("ce_sum", "weight_sum"):
        assert_scalar(getattr(sums, name), float(getattr(ref, name)), name, rtol, atol)
    for name in ("correct", "supervised", "accepted", "blocks"):
        assert float(getattr(sums, name)) == getattr(ref, name), (
            f"{name}: implementation {float(getattr(sums, name))} != reference {getattr(ref, name)}"
        )
    # the step lines' formulas, on the sums in the order the step reports them (STATS), then
    # visible_pairs, lr and grad_norm, which these three do not read
    metrics = learning_fields([float(value.detach()) for value in sums] + [0.0, 0.0, 0.0])
    for name in ("loss", "acc", "tau_hat"):
        assert_scalar(metrics[name], getattr(ref, name), name, rtol, atol)


def assert_grads_match(grads, ref_grads, rtol: float = RTOL, atol: float = ATOL) -> None:
    assert set(grads) == set(ref_grads), f"parameter names differ: {set(grads) ^ set(ref_grads)}"
    for name, grad in grads.items():
        torch.testing.assert_close(
            grad.detach().cpu().double(),
            ref_grads[name],
            rtol=rtol,
            atol=atol,
            msg=lambda m, name=name: f"grad of {name}: {m}",
        )


def reference_for(s: Setup, anchors: list[int] | None = None):
    return reference_with_gradients(
        dict(s.drafter.named_parameters()),
        s.config,
        s.embed,
        s.lm_head,
        s.batch,
        s.anchors if anchors is None else anchors,
        block_size=s.config.block_size,
        mask_token_id=s.config.mask_token_id,
        gamma=s.gamma,
    )


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_sums_metrics_and_gradients_equal_the_reference(case: Case) -> None:
    s = build(case)
    ref, ref_grads = reference_for(s)
    # The case must exercise the metrics: some hits, some misses, some accepted runs.
    assert 0 < ref.correct < ref.supervised and ref.accepted > 0, (ref.correct, ref.accepted)
    sums, grads = run_objective(s)
    assert_sums_match(sums, ref)
    assert_grads_match(grads, ref_grads)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_block_logits_equal_the_reference_and_invalid_slots_are_finite(case: Case) -> None:
    s = build(case, align=False)
    ref = reference_plain(s)
    obj = make_objective(
        s.config, s.drafter, s.embed, s.lm_head, num_anchors=s.num_anchors, gamma=s.gamma
    )
    with torch.no_grad():
        logits = obj.block_logits(s.batch, make_anchors(s.anchors, s.num_anchors))
    n, block, vocab = len(s.anchors), s.config.block_size, s.config.vocab_size
    assert logits.shape == (s.num_anchors, block, vocab), logits.shape
    torch.testing.assert_close(
        logits[:n].double(), torch.stack(ref.block_logits), rtol=RTOL, atol=ATOL
    )
    assert torch.isfinite(logits[n:]).all(), "an invalid (fully masked) slot gave non-finite logits"


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_eager_flex_block_logits_equal_the_reference_on_cpu() -> None:
    """The flex BlockMask rule, checked on CPU: eager flex_attention runs forward (not backward)."""
    s = build(CASES["d64_B8_k3_all_slots_valid"], align=False)  # T = A*B = 128: one flex tile
    ref = reference_plain(s)
    obj = make_objective(
        s.config,
        s.drafter,
        s.embed,
        s.lm_head,
        num_anchors=s.num_anchors,
        gamma=s.gamma,
        attention="flex",
    )
    with torch.no_grad():
        logits = obj.block_logits(s.batch, make_anchors(s.anchors, s.num_anchors))
    torch.testing.assert_close(
        logits[: len(s.anchors)].double(), torch.stack(ref.block_logits), rtol=RTOL, atol=ATOL
    )


@pytest.mark.parametrize("case", list(CASES.values())[:2], ids=list(CASES.keys())[:2])
def test_objective_on_sampled_anchors_equals_the_reference(case: Case) -> None:
    from dflash_async.model.objective import sample_anchors

    s = build(case, align=False)
    gen = torch.Generator().manual_seed(123)
    anchors = sample_anchors(s.batch.loss_mask, s.batch.doc_ids, s.num_anchors, generator=gen)
    valid = anchors.positions[anchors.valid].tolist()
    ref, ref_grads = reference_for(s, valid)
    sums, grads = run_objective(s, anchors)
    assert_sums_match(sums, ref)
    assert_grads_match(grads, ref_grads)


def test_chunked_ce_equals_unchunked_in_value_and_gradients() -> None:
    s = build(CASES["d64_B8_k3_all_slots_valid"])
    queries = s.num_anchors * s.config.block_size
    whole, whole_grads = run_objective(s, ce_chunk_size=queries)
    for chunk in (5, 7, queries - 1):  # chunks that do not divide Q leave a ragged last chunk
        sums, grads = run_objective(s, ce_chunk_size=chunk)
        for name in ("ce_sum", "weight_sum", "correct", "supervised", "accepted", "blocks"):
            assert_scalar(
                getattr(sums, name), float(getattr(whole, name).detach()), f"{name} @ chunk {chunk}"
            )
        for name, grad in grads.items():
            torch.testing.assert_close(grad, whole_grads[name], rtol=RTOL, atol=ATOL)


def test_invalid_slots_change_nothing() -> None:
    """The same valid anchors with 0 or 9 extra invalid slots: identical sums and gradients."""
    s = build(CASES["d32_hd16_B4_invalid_slots"])
    tight = replace(s, num_anchors=len(s.anchors))
    loose = replace(s, num_anchors=len(s.anchors) + 9)
    sums_a, grads_a = run_objective(tight)
    sums_b, grads_b = run_objective(loose)
    for name in ("ce_sum", "weight_sum", "correct", "supervised", "accepted", "blocks"):
        assert_scalar(getattr(sums_b, name), float(getattr(sums_a, name).detach()), name)
    for name, grad in grads_b.items():
        assert torch.isfinite(grad).all(), f"non-finite gradient in {name}"
        torch.testing.assert_close(grad, grads_a[name], rtol=RTOL, atol=ATOL)


def test_only_drafter_parameters_get_gradients() -> None:
    s = build(CASES["d32_hd16_B4_invalid_slots"], align=False)
    assert not (s.embed.requires_grad or s.lm_head.requires_grad or s.batch.features.requires_grad)
    sums, grads = run_objective(s)
    assert sums.ce_sum.requires_grad
    for name in ("weight_sum", "correct", "supervised", "accepted", "blocks"):
        assert not getattr(sums, name).requires_grad, f"{name} should carry no graph"
    for name, grad in grads.items():
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, f"{name} got no gradient"
    assert s.embed.grad is None and s.lm_head.grad is None and s.batch.features.grad is None
    assert not s.embed.requires_grad and not s.lm_head.requires_grad


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_gpu_float32_objective_matches_the_reference(attention: str) -> None:
    """On CUDA in float32 (flex compiled on first call): within float32 tolerances of the reference."""
    case = CASES["d64_B8_k3_all_slots_valid"]
    s = build(case)
    ref, ref_grads = reference_for(s)
    gpu = Setup(
        s.config,
        s.drafter.float().cuda(),
        s.embed.float().cuda(),
        s.lm_head.float().cuda(),
        s.batch.to("cuda"),
        s.anchors,
        s.num_anchors,
        s.gamma,
    )
    gpu.batch.features = gpu.batch.features.float()
    sums, grads = run_objective(
        gpu, make_anchors(s.anchors, s.num_anchors, "cuda"), attention=attention
    )
    for name in ("ce_sum", "weight_sum"):
        assert_scalar(getattr(sums, name), float(getattr(ref, name)), name, rtol=1e-4, atol=1e-4)
    assert float(sums.blocks) == ref.blocks and float(sums.supervised) == ref.supervised
    assert abs(float(sums.correct) - ref.correct) <= 2  # near-ties may flip in float32
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().item()
        torch.testing.assert_close(
            grad.double().cpu(),
            ref_grads[name],
            rtol=1e-3,
            atol=1e-4 * max(scale, 1.0),
            msg=lambda m, name=name: f"grad of {name}: {m}",
        )


@pytest.mark.parametrize("with_context", [False, True])
def test_reference_layer_equals_a_hf_qwen3_layer(with_context: bool) -> None:
    """Self-check of the reference's Qwen3 conventions (norms, RoPE, GQA, MLP) against transformers.

    The block alone is a HF layer with no mask (eager: bidirectional). With context: HF sees the
    sequence [C; block] under a mask where block rows see everything; with input_layernorm = 1 and
    unit-RMS context rows, HF's input_layernorm leaves C unchanged, which is the KV injection.
    """
    from reference_dflash import decoder_layer, rms_norm
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    spec = TinySpec(hidden_size=32, head_dim=16, num_attention_heads=4, num_key_value_heads=2)
    config = tiny_config(spec)
    hf_config = Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        vocab_size=config.vocab_size,
        num_hidden_layers=1,
        attn_implementation="eager",
    )
    layer = Qwen3DecoderLayer(hf_config, layer_idx=0).double()
    randomize_(layer, seed=5)
    gen = torch.Generator().manual_seed(6)
    n_ctx = 5 if with_context else 0
    if with_context:
        torch.nn.init.ones_(layer.input_layernorm.weight)
    ctx = rms_norm(torch.randn(n_ctx, 32, generator=gen, dtype=torch.float64), torch.ones(32), 0.0)
    block = torch.randn(4, 32, generator=gen, dtype=torch.float64)
    ctx_pos, block_pos = list(range(n_ctx)), [n_ctx + k for k in range(4)]
    params = {f"layers.0.{n}": p.detach() for n, p in layer.named_parameters()}
    ours = decoder_layer(params, 0, config, block, block_pos, ctx, ctx_pos)

    seq = torch.cat([ctx, block])[None]  # [1, n+4, d]
    mask = torch.full((n_ctx + 4, n_ctx + 4), float("-inf"), dtype=torch.float64)
    mask[n_ctx:, :] = 0.0  # block rows see all
    mask.fill_diagonal_(0.0)  # context rows (output ignored) see themselves
    rotary = Qwen3RotaryEmbedding(hf_config)
    cos_sin = rotary(seq, torch.tensor([ctx_pos + block_pos]))
    with torch.no_grad():
        theirs = layer(seq, attention_mask=mask[None, None], position_embeddings=cos_sin)
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    # HF's RMSNorm rounds through float32 and its eps perturbs the unit-RMS context: ~1e-6.
    torch.testing.assert_close(ours, theirs[0, n_ctx:].double(), rtol=1e-5, atol=1e-5)


def test_compiled_drafter_equals_the_reference_and_compiles_once() -> None:
    """compile_layers() (each layer one graph, attention included; the context and final norms)
    on the CPU with the dense-mask attention: the reference's sums and gradients, and a second
    step with other anchors (a new attention closure and mask) reuses the graphs."""
    from torch._dynamo.utils import counters

    if problem := compiled_sdpa_float64_problem():
        pytest.skip(problem)
    case = CASES["d32_hd16_B4_invalid_slots"]
    s = build(case)
    ref, ref_grads = reference_for(s)
    torch._dynamo.reset()
    s.drafter.compile_layers()
    sums, grads = run_objective(s)
    assert_sums_match(sums, ref)
    assert_grads_match(grads, ref_grads)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 3  # the layer, the context, the final norm
    other = make_anchors(sorted({max(a - 1, 0) for a in s.anchors}), s.num_anchors)
    run_objective(s, other)
    assert counters["stats"]["unique_graphs"] == graphs
