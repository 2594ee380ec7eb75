"""Calibration of a DSpark confidence head (eval/calibration.py, the `calibrate` command).

On a tiny random target and a constructed DSpark drafter (random weights, the head's bias set so
that its logits point the way acceptance goes): the teacher-forced acceptance of a slot is
1 - TV of the drafter's and the target's distributions, checked against a loop written from that
definition; the fitted temperature minimises the held-out BCE; a purpose-made mis-scaled head
(weight and bias times 3) is brought back to the original's calibrated head; folding T = 1 leaves
the export bit-identical and T != 1 divides the head only; the command refuses a DFlash export.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import randomize_
from tiny_decoding import VOCAB, tiny_qwen3_target

from dflash_async.checkpoint.export import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    export_drafter,
    load_drafter_export,
)
from dflash_async.eval import calibration
from dflash_async.eval.calibration import HEAD_BIAS, HEAD_WEIGHT
from dflash_async.model.attention_rule import dense_rule_mask, sdpa_attend
from dflash_async.model.drafter_config import drafter_config_from_target
from dflash_async.model.kinds import kind_of
from dflash_async.targets.loading import frozen_embeddings

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

B, LAYER_IDS, FIRST = 4, (1, 3), 5
SCALE = 3.0  # the mutant's factor on the head's logits


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3_target().eval()


def dspark_config(target, kind: str = "dspark"):
    config = drafter_config_from_target(
        target.config,
        num_hidden_layers=1,
        num_features=len(LAYER_IDS),
        block_size=B,
        mask_token_id=VOCAB - 1,
        target_layer_ids=LAYER_IDS,
    )
    if kind != "dspark":
        return replace(config, kind=kind)
    return replace(config, kind="dspark", markov_rank=8)


def constructed_drafter(target, *, scale: float = 1.0):
    drafter = kind_of("dspark").make_drafter(dspark_config(target))
    randomize_(drafter, seed=5)
    with torch.no_grad():
        drafter.confidence_head.proj.bias.fill_(1.0)  # this drafter's acceptance is above 1/2
        drafter.confidence_head.proj.weight.mul_(scale)
        drafter.confidence_head.proj.bias.mul_(scale)
    return drafter.float().eval().requires_grad_(False)


def sequences(seed: int, n: int = 3, length: int = 16):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(1, VOCAB - 1, (length,), generator=gen).tolist(), FIRST) for _ in range(n)
    ]


def pairs_of(target, drafter, seqs):
    embed, lm_head = frozen_embeddings(target)
    return calibration.heldout_pairs(target, drafter, embed, lm_head, seqs)


def test_acceptance_is_one_minus_tv_of_each_slot_written_as_a_loop(target):
    """One anchor's block through the training layout, slot by slot from the definition."""
    drafter = constructed_drafter(target)
    seq, first = sequences(0, n=1)[0]
    pairs = pairs_of(target, drafter, [(seq, first)])
    embed, lm_head = frozen_embeddings(target)
    ids = torch.tensor(seq)
    with torch.no_grad():
        from dflash_async.eval.speculative import captured_layers

        with captured_layers(target, LAYER_IDS) as outputs:
            q_logits = target(input_ids=ids[None]).logits[0]
            features = torch.cat([outputs[i][0] for i in LAYER_IDS], dim=-1)
        a = first  # the first anchor: its pairs come first, slots 0..B-1
        mask = dense_rule_mask(
            torch.zeros(len(seq), dtype=torch.long), torch.tensor([a]), torch.tensor([True]), B
        )
        tokens = torch.tensor([seq[a]] + [drafter.config.mask_token_id] * (B - 1))
        hidden = drafter(
            embed[tokens],
            torch.arange(a, a + B),
            features,
            torch.arange(len(seq)),
            [sdpa_attend(mask)],
        )
        for k in range(B):
            prev = torch.tensor([seq[a + k]])
            p = drafter.draft_logits(hidden[k : k + 1], prev, lm_head)[0].double().softmax(-1)
            q = q_logits[a + k].double().softmax(-1)
            expected = 1.0 - 0.5 * float((p - q).abs().sum())
            # float32 drafter passes over 1 and over every anchor differ by float32 rounding of
            # h (~1e-7 relative per op, a few ops); logits of size O(10) move p by < 1e-5
            assert float(pairs.acceptance[k]) == pytest.approx(expected, abs=1e-5)
            wrong = drafter.draft_logits(hidden[k : k + 1], prev + 1, lm_head)[0]
            wrong_tv = 0.5 * float((wrong.double().softmax(-1) - q).abs().sum())
            assert abs(1.0 - wrong_tv - expected) > 1e-3  # the Markov bias from another token
            c = float(drafter.confidence_logits(hidden[k : k + 1], prev)[0])
            assert float(pairs.logits[k]) == pytest.approx(c, abs=1e-5)  # the same rounding
            assert int(pairs.slots[k]) == k


def test_the_fitted_temperature_minimises_the_bce(target):
    pairs = pairs_of(target, constructed_drafter(target), sequences(1))
    t = calibration.fit_temperature(pairs.logits, pairs.acceptance)
    best = calibration.bce(pairs.logits, pairs.acceptance, t)
    assert best <= calibration.bce(pairs.logits, pairs.acceptance)  # never worse than T = 1
    for nearby in (t * 0.99, t * 1.01):  # a minimum: 1% either way is no better
        assert calibration.bce(pairs.logits, pairs.acceptance, nearby) >= best


def test_a_head_scaled_by_three_is_brought_back_to_the_calibrated_original(target):
    seqs = sequences(2)
    original = pairs_of(target, constructed_drafter(target), seqs)
    mutant = pairs_of(target, constructed_drafter(target, scale=SCALE), seqs)
    t, t_mutant = (calibration.fit_temperature(p.logits, p.acceptance) for p in (original, mutant))
    # the mutant's float32 logits are 3x the original's up to float32 rounding (~1e-7 relative);
    # the bisection resolves s = 1/T to float64's resolution
    assert t_mutant == pytest.approx(SCALE * t, rel=1e-5)
    assert calibration.bce(mutant.logits, mutant.acceptance) > calibration.bce(
        original.logits, original.acceptance, t
    )  # mis-scaled: worse before calibration
    assert calibration.bce(mutant.logits, mutant.acceptance, t_mutant) == pytest.approx(
        calibration.bce(original.logits, original.acceptance, t), rel=1e-6
    )
    torch.testing.assert_close(mutant.logits / t_mutant, original.logits / t, rtol=1e-5, atol=1e-6)
    # on sequences the fit never saw, the calibrated mutant beats the mis-scaled one
    unseen = pairs_of(target, constructed_drafter(target, scale=SCALE), sequences(4))
    assert calibration.bce(unseen.logits, unseen.acceptance, t_mutant) < calibration.bce(
        unseen.logits, unseen.acceptance
    )


def test_a_head_that_points_the_wrong_way_is_refused():
    logits = torch.tensor([2.0, -2.0, 1.0])
    acceptance = torch.tensor([0.1, 0.9, 0.2])  # high logit, low acceptance
    with pytest.raises(ValueError, match="do not predict"):
        calibration.fit_temperature(logits, acceptance)


def test_temperature_one_leaves_the_export_bit_identical_and_others_divide_the_head(
    target, tmp_path
):
    drafter = constructed_drafter(target)
    original = export_drafter(drafter, drafter.config, tmp_path / "drafter")
    same = calibration.write_calibrated_export(original, tmp_path / "same", 1.0)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        assert (same / name).read_bytes() == (original / name).read_bytes()
    folded = calibration.write_calibrated_export(original, tmp_path / "folded", 2.0)
    _, before = load_drafter_export(original)
    _, after = load_drafter_export(folded)
    for name, tensor in before.items():
        if name in (HEAD_WEIGHT, HEAD_BIAS):  # bf16 / 2 is exact (a power of two)
            assert torch.equal(after[name], tensor / 2)
        else:
            assert torch.equal(after[name], tensor)


def test_calibrate_refuses_a_drafter_without_a_confidence_head(target, tmp_path, capsys):
    from dflash_async.__main__ import main

    config = dspark_config(target, kind="dflash")
    drafter = kind_of("dflash").make_drafter(config)
    folder = export_drafter(drafter, config, tmp_path / "dflash")
    assert main(["calibrate", "--drafter", str(folder), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "dflash drafter has no confidence head" in err
    assert str(folder) in err
