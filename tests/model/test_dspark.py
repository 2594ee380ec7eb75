"""DSpark's objective equals the DSpark paper's loss (as DeepSpec's compute_dspark_loss defines
it, and SpecForge's OnlineDSparkModel, whose token-pooled loss has the same labels, mask, weights
and single normaliser) written here from scratch, on the same drafter states; loss and gradients.

The reference works per block on unpacked tensors, the way DeepSpec's forward and loss do: slot
k of the block at anchor a predicts x[a+k+1]; a slot counts while every slot up to it has its
label in the document and supervised (DeepSpec's eval_mask cumprod); weights exp(-k/gamma) from
k = 0; draft logits = lm_head(h) + W2 W1[x[a+k]]; the target's logits = lm_head(final_norm(last
layer at a+k)); loss = (0.1 sum w CE + 0.9 sum w ||p - q||_1 + 1.0 sum w BCE(c, 1 - L1/2
detached)) / sum w. The drafter's backbone is the DFlash one (tested in test_objective_reference),
so the states h come from it; everything after them is computed independently here.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    TinySpec,
    make_anchors,
    randomize_,
    tiny_batch,
    tiny_config,
    tiny_target_weights,
)

from dflash_async.checkpoint.export import expected_weight_shapes, export_config_json
from dflash_async.model.kinds.dspark import objective as dspark_objective
from dflash_async.model.kinds.dspark.drafter import DSparkDrafter
from dflash_async.model.kinds.dspark.objective import DSparkObjective
from dflash_async.model.objective import ObjectiveConfig

SPEC = TinySpec(block_size=5)
GAMMA = 4.0
ALPHAS = (0.1, 0.9, 1.0)
# anchors: mid-document, one whose block runs into the unsupervised hole, one at a document's
# end (its later slots leave the document), one into the padding; 2 invalid slots
ANCHOR_ROWS = (5, 9, 17, 22, 30, 40, 48, 53)
NUM_ANCHORS = len(ANCHOR_ROWS) + 2


def dspark_setup(head_type: str = "vanilla", with_markov: bool = True, chunk: int = 7):
    config = dataclasses.replace(
        tiny_config(SPEC),
        kind="dspark",
        markov_rank=8,
        markov_head_type=head_type,
        confidence_head_with_markov=with_markov,
    )
    drafter = DSparkDrafter(config).to(torch.float64)
    randomize_(drafter, seed=3)
    embed, lm_head = tiny_target_weights(config, seed=4)
    norm = 1 + 0.2 * torch.randn(config.hidden_size, generator=torch.Generator().manual_seed(5))
    objective = DSparkObjective(
        ObjectiveConfig(
            block_size=SPEC.block_size,
            num_anchors=NUM_ANCHORS,
            mask_token_id=config.mask_token_id,
            gamma=GAMMA,
            ce_chunk_size=chunk,
        ),
        drafter,
        embed,
        lm_head,
        target_norm=norm.double(),
        alphas=ALPHAS,
    )
    return config, drafter, objective, tiny_batch(SPEC, config), lm_head, norm.double()


def reference_loss(config, drafter, objective, batch, lm_head, norm, anchors):
    """The paper's loss, per block, from the drafter's states (see the module doc)."""
    B, T, d, k = config.block_size, batch.num_tokens, config.hidden_size, config.num_features
    ids = batch.input_ids
    slot = torch.arange(B)
    a = anchors.positions
    tokens = torch.where(slot == 0, ids[a][:, None], config.mask_token_id)
    positions = batch.position_ids[a][:, None] + slot
    hidden = objective._hidden(batch, anchors, tokens, positions)  # [A, B, d]
    num = {"ce": 0.0, "l1": 0.0, "bce": 0.0}
    den = 0.0
    for j in range(a.shape[0]):
        if not anchors.valid[j]:
            continue
        anchor = int(a[j])
        for s in range(B):
            label = anchor + s + 1
            if label >= T or batch.doc_ids[label] != batch.doc_ids[anchor]:
                break
            if not batch.loss_mask[label]:
                break  # the supervised prefix ends here
            w = math.exp(-s / GAMMA)
            h = hidden[j, s]
            prev = ids[anchor + s]
            e = drafter.markov_head.markov_w1.weight[prev]
            u = e
            if config.markov_head_type == "gated":
                gate_proj = drafter.markov_head.gate_proj
                u = torch.sigmoid(gate_proj.weight @ torch.cat([h, e]) + gate_proj.bias) * e
            z = lm_head @ h + drafter.markov_head.markov_w2.weight @ u
            x = batch.features[anchor + s, k * d : (k + 1) * d]
            x = norm * x / torch.sqrt(x.pow(2).mean() + config.rms_norm_eps)
            q = torch.softmax(lm_head @ x, -1)
            p = torch.softmax(z, -1)
            l1 = (p - q).abs().sum()
            accept = (1 - 0.5 * l1).clamp(0, 1).detach()
            features = torch.cat([h, e]) if config.confidence_head_with_markov else h
            c = (
                drafter.confidence_head.proj.weight[0] @ features
                + drafter.confidence_head.proj.bias[0]
            )
            num["ce"] = num["ce"] + w * (torch.logsumexp(z, -1) - z[ids[label]])
            num["l1"] = num["l1"] + w * l1
            num["bce"] = num["bce"] + w * F.binary_cross_entropy_with_logits(c, accept)
            den += w
    # DeepSpec adds 1e-6 to each denominator; with den >= 1 that moves the loss by <= 1e-6
    # relative, so the reference leaves it out and the comparison below is at fp64 rounding
    return sum(
        alpha * num[t] for alpha, t in zip(ALPHAS, ("ce", "l1", "bce"), strict=True)
    ) / den, den


def product_and_reference(**setup):
    config, drafter, objective, batch, lm_head, norm = dspark_setup(**setup)
    anchors = make_anchors(ANCHOR_ROWS, NUM_ANCHORS)
    params = [p for p in drafter.parameters()]
    sums = objective(batch, anchors)
    ours = sums.ce_sum / sums.weight_sum
    ours_grads = torch.autograd.grad(ours, params, allow_unused=True)
    ref, den = reference_loss(config, drafter, objective, batch, lm_head, norm, anchors)
    ref_grads = torch.autograd.grad(ref, params, allow_unused=True)
    return ours, ref, ours_grads, ref_grads, float(sums.weight_sum), den


def assert_same(ours, ref, ours_grads, ref_grads) -> None:
    # fp64 throughout: sums of ~50 terms of O(1) agree to ~1e-13; 1e-9 leaves room and still
    # sits far below any mutant's change (>= 1e-3 relative, measured)
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-12)
    for g_ours, g_ref in zip(ours_grads, ref_grads, strict=True):
        g_ours = torch.zeros_like(g_ref) if g_ours is None else g_ours
        g_ref = torch.zeros_like(g_ours) if g_ref is None else g_ref
        torch.testing.assert_close(g_ours, g_ref, rtol=1e-8, atol=1e-11)


@pytest.mark.parametrize(
    "setup",
    [{}, {"head_type": "gated"}, {"with_markov": False}, {"chunk": 64}],
    ids=["vanilla", "gated", "confidence_on_h", "one_chunk"],
)
def test_dspark_loss_and_gradients_equal_the_papers_loss(setup) -> None:
    ours, ref, ours_grads, ref_grads, weight_sum, den = product_and_reference(**setup)
    assert weight_sum == pytest.approx(den, rel=1e-12)
    assert den > 3  # the anchors supervise slots (a vacuous comparison would pass anything)
    assert_same(ours, ref, ours_grads, ref_grads)


def _shifted_slot(anchors, block_size):
    return anchors[:, None] + torch.arange(block_size, device=anchors.device) + 1


def _markov_from_label(input_ids, rows):
    return input_ids[(rows + 1).clamp(max=input_ids.shape[0] - 1)]


def _l1_on_logits(z, q):
    return (z - q.clamp_min(1e-30).log()).abs().sum(-1)


def _decay_from_slot_one(block_size, gamma, *, device):
    decay = [0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, block_size)]
    return torch.tensor(decay, dtype=torch.float64, device=device)


def _sign_of_q_minus_p(p, q):
    s = torch.sign(q - p)
    return p * (s - (s * p).sum(-1, keepdim=True))


@pytest.mark.parametrize(
    ("name", "mutant"),
    [
        ("slot_rows", _shifted_slot),
        ("markov_previous", _markov_from_label),
        ("distribution_l1", _l1_on_logits),
        ("position_decay", _decay_from_slot_one),
        ("l1_logit_grad", _sign_of_q_minus_p),
    ],
)
def test_each_wrong_variant_is_caught(monkeypatch, name, mutant) -> None:
    monkeypatch.setattr(dspark_objective, name, mutant)
    ours, ref, ours_grads, ref_grads, *_ = product_and_reference()
    with pytest.raises(AssertionError):
        assert_same(ours, ref, ours_grads, ref_grads)


def test_a_dspark_export_names_deepspecs_fields_and_tensors() -> None:
    config, drafter, *_ = dspark_setup(head_type="gated")
    exported = export_config_json(config)
    assert exported["architectures"] == ["Qwen3DSparkModel"]
    assert exported["block_size"] == SPEC.block_size
    for field, value in {
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        "markov_rank": 8,
        "markov_head_type": "gated",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
    }.items():
        assert exported[field] == value, field
    names = set(expected_weight_shapes(config))
    assert {
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "markov_head.gate_proj.weight",
        "confidence_head.proj.weight",
        "confidence_head.proj.bias",
    } <= names
    assert names == {n for n, _ in drafter.named_parameters()}


@pytest.mark.parametrize("path_name", ["packed_dense", "hf"])
def test_the_captured_last_layer_gives_the_targets_own_next_token_distribution(path_name) -> None:
    """A dspark drafter's captured layers end with the target's last one; through the target's
    final norm (the objective's rms_norm) and lm_head, those columns give the target's own
    logits at every row of a packed layout, on the packed path and the HF fallback."""
    import numpy as np
    from tiny_decoding import tiny_qwen3_target

    from dflash_async.data.packing import layout_pack
    from dflash_async.model.drafter_config import drafter_config_from_target
    from dflash_async.targets.forward import HFPaddedForward, select_target_forward

    target = tiny_qwen3_target()
    config = drafter_config_from_target(
        target.config,
        num_hidden_layers=1,
        num_features=2,
        block_size=4,
        mask_token_id=0,
        kind="dspark",
    )
    layers = config.captured_layer_ids
    assert layers == (*config.target_layer_ids, target.config.num_hidden_layers - 1)
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, 90, (n,), generator=gen).tolist() for n in (9, 14)]
    budget = 32
    layout = layout_pack([(np.array(doc), np.ones(len(doc), dtype=bool)) for doc in docs], budget)
    if path_name == "hf":
        forward = HFPaddedForward(target, layers, max_batch_tokens=32)
    else:
        path = select_target_forward(target, layers, token_budget=budget, max_batch_tokens=32)
        assert path.name == path_name
        forward = path.forward
    out = torch.zeros(budget, config.feature_width)
    forward(layout.input_ids, layout.position_ids, layout.doc_ids, out, np.array([9, 14]))
    d, k = config.hidden_size, config.num_features
    norm = target.model.norm
    logits = dspark_objective.rms_norm(out[:, k * d :], norm.weight, norm.variance_epsilon)
    logits = logits @ target.lm_head.weight.T
    start = 0
    for doc in docs:
        with torch.no_grad():
            expected = target(input_ids=torch.tensor([doc])).logits[0]
        # fp32 target, same ops in another order (packed attention): 1e-4 absolute is fp32
        # rounding of logits of size ~10
        torch.testing.assert_close(logits[start : start + len(doc)], expected, rtol=1e-4, atol=1e-4)
        start += len(doc)


def test_a_dspark_run_takes_the_papers_block_and_decay_unless_they_are_set() -> None:
    from dflash_async.settings.env import load_settings

    none = {"DFLASH_ENV_FILE": "none"}
    dspark = load_settings(none | {"DFLASH_DRAFTER__KIND": "dspark"}).train
    assert (dspark.block_size, dspark.gamma) == (7, 4.0)
    assert (dspark.ce_alpha, dspark.l1_alpha, dspark.confidence_alpha) == (0.1, 0.9, 1.0)
    chosen = load_settings(
        none
        | {
            "DFLASH_DRAFTER__KIND": "dspark",
            "DFLASH_TRAIN__BLOCK_SIZE": "16",
            "DFLASH_TRAIN__GAMMA": "5",
        }
    ).train
    assert (chosen.block_size, chosen.gamma) == (16, 5.0)
    dflash = load_settings(none).train
    assert (dflash.block_size, dflash.gamma) == (16, 7.0)  # the other kinds' defaults unchanged


def test_dspark_flops_count_every_slot_the_target_lm_head_and_the_markov_head() -> None:
    from dflash_async.model.flops import drafter_step_flops_by_part

    config, *_ = dspark_setup()
    A, B, d, V, r = 8, SPEC.block_size, config.hidden_size, config.vocab_size, 8
    parts = drafter_step_flops_by_part(config, token_budget=64, num_anchors=A, visible_pairs=0)
    assert parts["lm_head_ce"] == 2 * 2 * A * B * d * V  # anchor-first: B slots, not B-1
    assert parts["target_lm_head"] == 2 * A * B * d * V  # the L1 term's distribution, forward
    assert parts["markov"] == 3 * 2 * A * B * r * V
    dflash = dataclasses.replace(config, kind="dflash")
    base = drafter_step_flops_by_part(dflash, token_budget=64, num_anchors=A, visible_pairs=0)
    assert base["lm_head_ce"] == 2 * 2 * A * (B - 1) * d * V and "markov" not in base


def test_the_dspark_step_reads_no_device_data_on_the_host() -> None:
    """Anchors, the objective's forward (blocks, heads, the chunked loss and its in-forward
    gradients) and backward: no op that reads device data on the host (capturable)."""
    from test_no_host_sync import ForbidHostSync

    from dflash_async.model.objective import sample_anchors

    config, drafter, objective, batch, *_ = dspark_setup(head_type="gated")
    drafter.float()
    objective = DSparkObjective(
        dataclasses.replace(objective.config),
        drafter,
        objective.embed_weight.float(),
        objective.lm_head_weight.float(),
        target_norm=objective.target_norm.float(),
    )
    batch = tiny_batch(SPEC, config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)

    def step() -> None:
        anchors = sample_anchors(batch.loss_mask, batch.doc_ids, NUM_ANCHORS, generator=gen)
        objective(batch, anchors).ce_sum.backward()

    step()  # warm-up outside the guard, like the warm-up steps before a graph capture
    with ForbidHostSync():
        step()
