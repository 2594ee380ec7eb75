"""DFlash2 (docs/DFLASH.md s.9-10): the drafter and objective equal the block-by-block reference
(tests/reference_dflash2.py) in float64, alpha = 0 is the DFlash loss bit for bit, a fresh DFlash2
drafter is its DFlash backbone, three mutants of the rules are caught, the export is the contract.

Packs come from conftest (documents, padding, loss-mask holes, blocks running past their document).
Before comparing, about half of the labels under the blocks are set to the reference's unary
argmax there (labels are never inputs of their own block: the unary logits do not move), so that
some gold tokens fall inside the small top-k set and some outside it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace

import pytest
import torch
from conftest import (
    TinySpec,
    compiled_sdpa_float64_problem,
    make_anchors,
    randomize_,
    tiny_batch,
    tiny_config,
    tiny_target_weights,
)
from reference_dflash import candidate_anchors
from reference_dflash2 import reference2, reference2_with_gradients
from safetensors import safe_open

from dflash_async.checkpoint.export import (
    drafter_config_from_json,
    expected_weight_shapes,
    export_drafter,
)
from dflash_async.data.packing import PackedBatch
from dflash_async.model.drafter import DFlashDrafter
from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.model.kinds.dflash2 import drafter as dflash2
from dflash_async.model.kinds.dflash2 import objective as dflash2_objective
from dflash_async.model.kinds.dflash2.drafter import DFlash2Drafter
from dflash_async.model.kinds.dflash2.objective import DFlash2Objective
from dflash_async.model.objective import DFlashObjective, ObjectiveConfig

pytestmark = pytest.mark.usefixtures("single_thread")

# float64 on both sides, the same operations in another order (sums over d, r, k and the blocks):
# agreement is ~1e-13 relative; 1e-9 leaves four orders of magnitude and still catches any mutant
# (each moves the loss by > 1e-3, asserted below).
RTOL, ATOL = 1e-9, 1e-11


@dataclass(frozen=True)
class Case:
    spec: TinySpec
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    num_anchors: int
    alpha: float
    gamma: float


CASES = {
    "d32_B4_K2_G4_top4": Case(TinySpec(), 2, 8, 8, 4, num_anchors=16, alpha=1.0, gamma=3.0),
    "d48_B8_K3_G3_top5_alpha_half": Case(
        TinySpec(
            hidden_size=48,
            head_dim=12,
            intermediate_size=80,
            vocab_size=89,
            block_size=8,
            doc_lengths=(10, 50, 20),
            num_pad=16,
            seed=2,
            rope_theta=500.0,
        ),
        3,
        16,
        6,
        5,
        num_anchors=14,
        alpha=0.5,
        gamma=4.0,
    ),
    # V = 256 and k = 4 have a group width (16 groups of 16): the unary top-k takes its group
    # maxima from the CE chunk's pass (dflash2_objective.ce_grad_and_group_max); the cases
    # above (V = 97, 89) take grouped_topk's single-top-k fallback
    "d32_B4_V256_top4_grouped": Case(
        TinySpec(vocab_size=256, seed=3), 2, 8, 8, 4, num_anchors=16, alpha=1.0, gamma=3.0
    ),
}


@dataclass
class Setup:
    case: Case
    config: DrafterConfig
    drafter: DFlash2Drafter
    embed: torch.Tensor
    lm_head: torch.Tensor
    batch: PackedBatch
    anchors: list[int]


def dflash2_config(case: Case) -> DrafterConfig:
    return replace(
        tiny_config(case.spec),
        kind="dflash2",
        conv_kernel_size=case.conv_kernel_size,
        conv_group_size=case.conv_group_size,
        selector_rank=case.selector_rank,
        selector_top_k=case.selector_top_k,
    )


def pick_anchors(batch: PackedBatch, case: Case) -> list[int]:
    """Random candidates, two invalid slots left over; blocks overlap and cross documents."""
    cands = candidate_anchors(batch.loss_mask, batch.doc_ids)
    return sorted(random.Random(case.spec.seed).sample(cands, case.num_anchors - 2))


def params_of(drafter: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in drafter.named_parameters()}


def align_labels(s: Setup) -> None:
    ref = reference2(
        params_of(s.drafter),
        s.config,
        s.embed,
        s.lm_head,
        s.batch,
        s.anchors,
        gamma=s.case.gamma,
        alpha=s.case.alpha,
    )
    rng, anchor_set, ids = random.Random(7), set(s.anchors), s.batch.input_ids.clone()
    for a, logits in zip(s.anchors, ref.block_logits, strict=True):
        for k in range(1, s.config.block_size):
            p = a + k
            if p < len(ids) and p not in anchor_set and rng.random() < 0.5:
                ids[p] = int(logits[k].argmax())
    s.batch = replace(s.batch, input_ids=ids)


def build(case: Case) -> Setup:
    config = dflash2_config(case)
    drafter = DFlash2Drafter(config).double()
    randomize_(drafter, case.spec.seed)  # every tensor random: convolutions and selector act
    embed, lm_head = tiny_target_weights(config, case.spec.seed)
    batch = tiny_batch(case.spec, config)
    s = Setup(case, config, drafter, embed, lm_head, batch, pick_anchors(batch, case))
    align_labels(s)
    return s


def objective_config(s: Setup) -> ObjectiveConfig:
    return ObjectiveConfig(
        block_size=s.config.block_size,
        num_anchors=s.case.num_anchors,
        mask_token_id=s.config.mask_token_id,
        gamma=s.case.gamma,
        ce_chunk_size=7,
    )


def run(s: Setup, *, alpha: float | None = None):
    """Forward + backward of the implementation: (StepSums, {name: grad})."""
    alpha = s.case.alpha if alpha is None else alpha
    obj = DFlash2Objective(objective_config(s), s.drafter, s.embed, s.lm_head, selector_alpha=alpha)
    s.drafter.zero_grad(set_to_none=True)
    sums = obj(s.batch, make_anchors(s.anchors, s.case.num_anchors))
    sums.ce_sum.backward()
    return sums, {n: p.grad.detach().clone() for n, p in s.drafter.named_parameters()}


def reference(s: Setup):
    return reference2_with_gradients(
        dict(s.drafter.named_parameters()),
        s.config,
        s.embed,
        s.lm_head,
        s.batch,
        s.anchors,
        gamma=s.case.gamma,
        alpha=s.case.alpha,
    )


def close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return torch.allclose(
        actual.detach().double(), expected.detach().double(), rtol=RTOL, atol=ATOL
    )


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_dflash2_sums_logits_and_gradients_equal_the_block_by_block_reference(case: Case) -> None:
    s = build(case)
    ref, ref_grads = reference(s)
    # the case exercises the selector: golds both inside and outside the top-k, hits and misses
    assert 0 < ref.topk_hits < ref.supervised and ref.selector_correct > 0, ref
    sums, grads = run(s)
    assert close(sums.ce_sum, ref.ce_sum), (float(sums.ce_sum), float(ref.ce_sum))
    assert close(sums.weight_sum, torch.tensor(ref.weight_sum, dtype=torch.float64))
    assert int(sums.supervised) == ref.supervised and int(sums.topk_hits) == ref.topk_hits
    assert int(sums.selector_correct) == ref.selector_correct
    for name, grad in grads.items():
        torch.testing.assert_close(
            grad,
            ref_grads[name],
            rtol=RTOL,
            atol=ATOL,
            msg=lambda m, name=name: f"grad of {name}: {m}",
        )
    obj = DFlash2Objective(objective_config(s), s.drafter, s.embed, s.lm_head)
    logits = obj.block_logits(s.batch, make_anchors(s.anchors, case.num_anchors))
    n = len(s.anchors)
    torch.testing.assert_close(logits[:n], torch.stack(ref.block_logits), rtol=RTOL, atol=ATOL)
    assert torch.isfinite(logits[n:]).all()  # invalid slots see nothing and stay finite


def test_alpha_zero_is_the_dflash_loss_bit_for_bit_and_trains_no_selector() -> None:
    s = build(CASES["d32_B4_K2_G4_top4"])
    anchors = make_anchors(s.anchors, s.case.num_anchors)
    plain = DFlashObjective(objective_config(s), s.drafter, s.embed, s.lm_head)
    s.drafter.zero_grad(set_to_none=True)
    expected = plain(s.batch, anchors)
    expected.ce_sum.backward()
    expected_grads = {
        n: p.grad.clone() for n, p in s.drafter.named_parameters() if p.grad is not None
    }
    sums, grads = run(s, alpha=0.0)
    assert torch.equal(sums.ce_sum, expected.ce_sum)
    for name, grad in grads.items():
        if name.startswith("candidate_selector."):
            assert not grad.any(), f"{name} learns at alpha = 0"
        else:
            assert torch.equal(grad, expected_grads[name]), name


def test_a_fresh_dflash2_drafter_computes_exactly_its_dflash_backbone() -> None:
    """Identity convolutions and a zero successor codebook: the DFlash drafter's logits, bit for
    bit, and a selector that adds nothing to any candidate."""
    s = build(CASES["d32_B4_K2_G4_top4"])
    base = DFlashDrafter(replace(s.config, kind="dflash")).double()
    randomize_(base, 11)
    fresh = DFlash2Drafter(s.config).double()
    missing, unexpected = fresh.load_state_dict(base.state_dict(), strict=False)
    assert unexpected == [] and all("conv" in n or "selector" in n for n in missing)
    anchors = make_anchors(s.anchors, s.case.num_anchors)
    cfg = objective_config(s)
    theirs = DFlashObjective(cfg, base, s.embed, s.lm_head).block_logits(s.batch, anchors)
    ours = DFlash2Objective(cfg, fresh, s.embed, s.lm_head).block_logits(s.batch, anchors)
    assert torch.equal(ours, theirs)
    hidden = torch.randn(5, s.config.hidden_size, dtype=torch.float64)
    pair = fresh.candidate_selector.pair_scores(hidden, torch.arange(5), torch.ones(5, 3).long())
    assert not pair.any()


def crossing_conv(h, dyn, base):
    """Mutant: the convolution over the flattened [1, A*B] layout, reaching into the previous block."""
    num_blocks, block, d = h.shape
    flat = ORIGINAL_CONV(
        h.reshape(1, -1, d), dyn.reshape(1, num_blocks * block, *dyn.shape[2:]), base
    )
    return flat.view(num_blocks, block, d)


ORIGINAL_CONV = dflash2.block_causal_conv
MUTANTS = {
    "conv_crosses_block_boundary": (dflash2, "block_causal_conv", crossing_conv),
    "predecessor_shifted_by_one": (
        dflash2_objective,
        "selector_predecessors",
        lambda labels: labels[:, 1:],
    ),
    "gold_outside_top_k_counted": (
        dflash2_objective,
        "selector_targets",
        lambda cand, gold: (cand == gold[:, None], torch.ones_like(gold, dtype=torch.bool)),
    ),
}


@pytest.mark.parametrize("mutant", MUTANTS, ids=MUTANTS)
def test_each_mutant_breaks_the_agreement_with_the_reference(mutant: str, monkeypatch) -> None:
    s = build(CASES["d32_B4_K2_G4_top4"])
    ref, _ = reference(s)
    sums, _ = run(s)
    assert close(sums.ce_sum, ref.ce_sum)  # the unmutated implementation agrees
    monkeypatch.setattr(*MUTANTS[mutant])
    mutated, _ = run(s)
    expected = float(ref.ce_sum.detach())
    assert abs(float(mutated.ce_sum.detach()) - expected) > 1e-3 * abs(expected), mutant


# z-lab's DFlash2 fixture (tests/fixtures/dflash2-config.json, -safetensors-header.json): its
# shapes, per layer and global, for d 6656, 32/8 heads of 128, MLP 19968, vocab 202048, 5 taps.
FIXTURE_LAYER = {
    "attention_conv.base_kernel": (2, 2, 6656),
    "attention_conv.kernel_projection.weight": (1664, 6656),
    "mlp_conv.base_kernel": (2, 2, 6656),
    "mlp_conv.kernel_projection.weight": (1664, 6656),
    "input_layernorm.weight": (6656,),
    "post_attention_layernorm.weight": (6656,),
    "self_attn.q_proj.weight": (4096, 6656),
    "self_attn.k_proj.weight": (1024, 6656),
    "self_attn.v_proj.weight": (1024, 6656),
    "self_attn.o_proj.weight": (6656, 4096),
    "self_attn.q_norm.weight": (128,),
    "self_attn.k_norm.weight": (128,),
    "mlp.gate_proj.weight": (19968, 6656),
    "mlp.up_proj.weight": (19968, 6656),
    "mlp.down_proj.weight": (6656, 19968),
}
FIXTURE_GLOBAL = {
    "candidate_selector.hidden_projection.weight": (256, 6656),
    "candidate_selector.predecessor_codebook": (202048, 256),
    "candidate_selector.successor_codebook": (202048, 256),
    "fc.weight": (6656, 33280),
    "hidden_norm.weight": (6656,),
    "norm.weight": (6656,),
}


def test_expected_weight_shapes_are_the_fixtures_for_its_config() -> None:
    config = DrafterConfig(
        hidden_size=6656,
        num_hidden_layers=5,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=19968,
        rms_norm_eps=1e-5,
        rope_theta=5e5,
        vocab_size=202048,
        num_target_layers=52,
        target_layer_ids=(1, 13, 25, 37, 49),
        mask_token_id=201818,
        kind="dflash2",
    )
    fixture = {f"layers.{i}.{n}": s for i in range(5) for n, s in FIXTURE_LAYER.items()}
    assert expected_weight_shapes(config) == fixture | FIXTURE_GLOBAL


def test_tiny_dflash2_export_has_exactly_the_contract_names_shapes_and_config(tmp_path) -> None:
    config = dflash2_config(CASES["d32_B4_K2_G4_top4"])
    drafter = DFlash2Drafter(config)
    folder = export_drafter(drafter, config, tmp_path / "drafter")
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
        stored = {name: tuple(f.get_slice(name).get_shape()) for name in names}
        dtypes = {f.get_slice(name).get_dtype() for name in names}
    params = {n: tuple(p.shape) for n, p in drafter.named_parameters()}
    assert stored == expected_weight_shapes(config) == params and dtypes == {"BF16"}
    assert "candidate_selector.successor_codebook" in stored  # plain tensors, no `.weight`
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dtype"] == "bfloat16"
    assert {
        k: cfg["dflash_config"][k]
        for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    } == {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4}
    assert cfg["dflash_config"]["mask_token_id"] == config.mask_token_id
    assert drafter_config_from_json(cfg) == config


@pytest.mark.anyio
@pytest.mark.timeout(180)
async def test_a_dflash2_run_trains_evaluates_and_its_export_decodes_to_the_in_run_tau(tmp_path):
    """KIND=dflash2 on the CPU pipeline: selector metrics per step, a falling loss, in-run evals
    (tau >= 1, none failed) and a DFlash2DraftModel export whose `eval` gives the final tau."""
    import anyio
    from structlog.testing import capture_logs
    from test_evaluate_inrun import write_prompts
    from tiny_run import tiny_env, tiny_inputs

    from dflash_async.eval.harness import run_eval
    from dflash_async.log import get_logger
    from dflash_async.pipeline import run as pipeline
    from dflash_async.settings.env import load_settings

    inputs = tiny_inputs(tmp_path / "inputs")
    prompts = write_prompts(tmp_path / "prompts.jsonl")  # 3 prompts
    env = tiny_env(inputs, tmp_path / "out") | {
        "DFLASH_DRAFTER__KIND": "dflash2",
        "DFLASH_DRAFTER__SELECTOR_TOP_K": "4",
        "DFLASH_DRAFTER__SELECTOR_RANK": "16",
        "DFLASH_TRAIN__MAX_STEPS": "16",
        "DFLASH_TRAIN__SAVE_EVERY": "0",
        "DFLASH_TRAIN__LR": "3e-3",
        "DFLASH_TRAIN__WARMUP_FRAC": "0",
        "DFLASH_EVAL__AT_START": "true",
        "DFLASH_EVAL__NUM_PROMPTS": "3",
        "DFLASH_EVAL__MAX_NEW_TOKENS": "8",
        "DFLASH_EVAL__PROMPTS_PATH": str(prompts),
    }
    with capture_logs() as events, anyio.fail_after(120):
        assert await pipeline.run(load_settings(env), get_logger("test")) == 0
    losses = [e["loss"] for e in events if e["event"] == "step"]
    assert len(losses) == 16 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4, losses
    assert any("topk_recall" in e and "selector_acc" in e for e in events if e["event"] == "step")
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 16] and all(e["tau"] >= 1.0 for e in evals), evals
    assert not [e for e in events if e["event"] in ("eval_failed", "eval_skipped")]
    cfg = json.loads((tmp_path / "out" / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    with capture_logs():  # the same prompts and decode settings as the run's evaluations
        report = run_eval(
            inputs["target"],
            tmp_path / "out" / "drafter",
            prompts,
            device="cpu",
            max_new_tokens=8,
            num_prompts=3,
        )
    for name in ("tau", "accepted_length_histogram"):
        assert report[name] == evals[-1][name], (name, report[name], evals)


def _dflash2_step(seed: int):
    """A float32 CPU DrafterStep around a DFlash2 drafter and objective (every tensor random)."""
    from dflash_async.model.step import DrafterStep

    case = CASES["d32_B4_K2_G4_top4"]
    config = dflash2_config(case)
    drafter = DFlash2Drafter(config)
    randomize_(drafter, seed)
    embed, lm_head = tiny_target_weights(config, 0, dtype=torch.float32)
    objective = DFlash2Objective(
        replace(
            objective_config(Setup(case, config, drafter, embed, lm_head, None, [])), num_anchors=8
        ),
        drafter,
        embed,
        lm_head,
    )
    step = DrafterStep.build(
        objective,
        token_budget=case.spec.num_tokens,
        peak_lr=1e-2,
        warmup_steps=2,
        total_steps=10,
        generator=torch.Generator().manual_seed(seed),
    )
    step.batch.copy_(tiny_batch(case.spec, config, dtype=torch.float32))
    return step


def test_a_restored_dflash2_step_continues_exactly(tmp_path) -> None:
    """checkpoint/state.py saves every parameter by name: the convolutions and the selector
    resume with the backbone, and three more steps are bit for bit the uninterrupted ones."""
    from dflash_async.checkpoint.state import load_checkpoint, restore, snapshot, write_checkpoint
    from dflash_async.data.packing import PackCursor

    def train(step, n: int) -> list[float]:
        values = []
        for _ in range(n):
            step.phase_a()
            values.append(step.stats[0].item())  # sync point: test only
            step.phase_b()
        return values

    original = _dflash2_step(seed=0)
    train(original, 2)
    state = snapshot([original], step=2, cursor=PackCursor(0, 2), seed=0, run={})
    folder, _ = write_checkpoint(tmp_path, state, keep=2)
    resumed = _dflash2_step(seed=1)
    restore(resumed, load_checkpoint(folder), rank=0)
    assert train(resumed, 3) == train(original, 3)
    names = [n for n, _ in original.objective.drafter.named_parameters()]
    assert any("selector" in n for n in names) and any("conv" in n for n in names)
    for p, q in zip(original.params, resumed.params, strict=True):
        assert torch.equal(p, q)


def test_the_compiled_dflash2_objective_equals_the_block_by_block_reference() -> None:
    """ObjectiveConfig(compile=True) on the CPU: the layers, the CE pass with its group maxima,
    the selector's term (dflash2_objective.selector_loss) and the candidates' gradient
    (candidate_rows_grad) each compiled (CPU inductor, float64) give the reference's sums and
    gradients within the float64 tolerances above (the compiled
    kernels only reorder float64 sums: ~n * 2^-53 relative for n <= 10^3 terms)."""
    if problem := compiled_sdpa_float64_problem():
        pytest.skip(problem)
    s = build(CASES["d32_B4_V256_top4_grouped"])
    ref, ref_grads = reference(s)
    torch._dynamo.reset()
    config = replace(objective_config(s), compile=True)
    obj = DFlash2Objective(config, s.drafter, s.embed, s.lm_head, selector_alpha=s.case.alpha)
    s.drafter.zero_grad(set_to_none=True)
    sums = obj(s.batch, make_anchors(s.anchors, s.case.num_anchors))
    sums.ce_sum.backward()
    assert close(sums.ce_sum, ref.ce_sum), (float(sums.ce_sum), float(ref.ce_sum))
    assert int(sums.topk_hits) == ref.topk_hits
    assert int(sums.selector_correct) == ref.selector_correct
    for name, p in s.drafter.named_parameters():
        torch.testing.assert_close(
            p.grad,
            ref_grads[name],
            rtol=RTOL,
            atol=ATOL,
            msg=lambda m, name=name: f"grad of {name}: {m}",
        )
