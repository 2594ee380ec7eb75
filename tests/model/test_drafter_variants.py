"""The drafter variants of released drafters (docs/DFLASH.md s.10) for both kinds, against the
independent block-by-block references (tests/reference_dflash.py, tests/reference_dflash2.py).

A drafter mixing a sliding-window layer and a full one, with the per-layer in-block rule (and
both overrides), an output multiplier, a softcap and an embedding scale: sums, logits and
gradients equal the references; the flex BlockMask (tiles + mask_mod, evaluated on index tensors)
spells the dense mask of every rule; the mutants are caught, among them the window taken from the
anchor for every slot (anchor - p < W, the rule before z-lab's per-slot one); the defaults are
the old drafter bit for bit; the export's config.json round-trips the fields; bad settings exit 2
naming the field.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import test_dflash2 as d2
import torch
from conftest import make_anchors, tiny_batch, tiny_drafter
from test_objective_reference import (
    CASES,
    Setup,
    align_labels,
    assert_grads_match,
    assert_sums_match,
    build,
    make_objective,
    reference_for,
    reference_plain,
    run_objective,
)

from dflash_async.checkpoint.export import export_drafter, load_drafter_export
from dflash_async.errors import SettingsError
from dflash_async.model import attention_rule as attention
from dflash_async.model import objective
from dflash_async.model.kinds.dflash2.drafter import DFlash2Drafter
from dflash_async.model.layer_rules import AttentionRule
from dflash_async.model.logit_transforms import LogitTransform
from dflash_async.settings.env import load_settings

pytestmark = pytest.mark.usefixtures("single_thread")

# float64 on both sides, only summation order differs (~1e-13 relative, tanh included: its
# derivative is bounded by 1); the references' tolerances (1e-9 / 1e-11) leave room. Every mutant
# below moves the loss by more than 1e-6 relative (asserted), 1000x that tolerance (the softcap
# compresses the loss differences: the swapped in-block rule moves it by ~2e-4 relative).
MUTANT_GAP = 1e-6
# Sliding layer first (window 5 cuts most contexts of the 20- and 25-row documents), then a full
# one; logits * 1.7 then capped at 1.5 (the tiny logits are O(1): the tanh bends them), embeddings
# * 0.6.
VARIANTS = dict(
    layer_types=("sliding_attention", "full_attention"),
    sliding_window=5,
    output_multiplier=1.7,
    final_logit_softcapping=1.5,
    input_embedding_scale=0.6,
)
CAUSAL = {"per_layer_default": None, "all_causal": True, "all_bidirectional": False}


def variant_setup(case_name: str = "d32_hd16_B4_invalid_slots", **overrides) -> Setup:
    s = build(CASES[case_name], align=False)
    config = replace(s.config, **(VARIANTS | overrides))
    s = replace(s, config=config, drafter=tiny_drafter(config, CASES[case_name].spec.seed))
    align_labels(s, CASES[case_name].spec.seed)
    return s


@pytest.mark.parametrize("is_causal", CAUSAL.values(), ids=CAUSAL.keys())
def test_sliding_and_full_layers_with_softcap_and_multiplier_equal_the_reference(is_causal):
    s = variant_setup(is_causal=is_causal)
    ref, ref_grads = reference_for(s)
    assert 0 < ref.correct < ref.supervised and ref.accepted > 0, (ref.correct, ref.accepted)
    sums, grads = run_objective(s, ce_chunk_size=7)  # ragged chunks: the transform per chunk
    assert_sums_match(sums, ref)
    assert_grads_match(grads, ref_grads)
    obj = make_objective(s.config, s.drafter, s.embed, s.lm_head, num_anchors=s.num_anchors)
    logits = obj.block_logits(s.batch, make_anchors(s.anchors, s.num_anchors))
    n = len(s.anchors)
    torch.testing.assert_close(logits[:n].double(), torch.stack(ref.block_logits))
    assert torch.isfinite(logits[n:]).all()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_eager_flex_with_a_sliding_and_a_full_layer_equals_the_reference_on_cpu() -> None:
    s = variant_setup("d64_B8_k3_all_slots_valid", sliding_window=7)  # T = A*B = 128: one tile
    ref = reference_plain(s)
    obj = make_objective(
        s.config, s.drafter, s.embed, s.lm_head, num_anchors=s.num_anchors, attention="flex"
    )
    with torch.no_grad():
        logits = obj.block_logits(s.batch, make_anchors(s.anchors, s.num_anchors))
    torch.testing.assert_close(logits[: len(s.anchors)].double(), torch.stack(ref.block_logits))


def flex_visible(mask, queries: int, keys: int, tile: int) -> torch.Tensor:
    """[Q, S] bool: what a BlockMask lets through: its full tiles, and mask_mod in its partial
    tiles (mask_mod evaluated on index tensors, as the kernels call it)."""
    tiles = []
    for num, idx in (
        (mask.full_kv_num_blocks, mask.full_kv_indices),
        (mask.kv_num_blocks, mask.kv_indices),
    ):
        grid = torch.zeros(queries // tile, keys // tile, dtype=torch.bool)
        for row in range(grid.shape[0]):
            grid[row, idx[0, 0, row, : num[0, 0, row]].long()] = True
        tiles.append(grid.repeat_interleave(tile, 0).repeat_interleave(tile, 1))
    q, kv = torch.arange(queries)[:, None], torch.arange(keys)[None, :]
    zero = torch.zeros((), dtype=torch.int32)
    element = mask.mask_mod(zero, zero, q.int(), kv.int())
    return tiles[0] | (tiles[1] & element)


RULES = [AttentionRule(w, c) for w in (None, 1, 3, 6) for c in (False, True)]


def mask_case():
    s = build(CASES["d32_hd16_B4_invalid_slots"], align=False)  # T = 64, A*B = 24*4 = 96
    anchors = make_anchors(s.anchors, s.num_anchors)
    return s.batch.doc_ids, anchors, s.config.block_size


@pytest.mark.parametrize("rule", RULES, ids=[f"w{r.window}_causal{r.causal}" for r in RULES])
def test_flex_block_mask_and_mask_mod_spell_the_dense_mask_of_each_rule(rule) -> None:
    doc_ids, anchors, B = mask_case()
    args = (doc_ids, anchors.positions, anchors.valid, B)
    dense = attention.dense_rule_mask(*args, rule=rule)
    flex = attention.flex_block_mask(*args, 8, rule=rule)
    assert torch.equal(flex_visible(flex, *dense.shape, 8), dense)


@pytest.mark.parametrize("window", [3, 6])  # below and above B = 4
def test_the_rule_masks_narrow_the_full_one_as_the_contract_says(window) -> None:
    """Window W, z-lab's per-slot rule: slot k (position anchor + k) sees exactly the context
    rows with (anchor + k) - p < W and the block slots s with |k - s| < W; causal: the block's
    lower triangle; both leave everything else of the full rule."""
    doc_ids, anchors, B = mask_case()
    T, args = doc_ids.shape[0], (doc_ids, anchors.positions, anchors.valid, B)
    full = attention.dense_rule_mask(*args)
    sliding = attention.dense_rule_mask(*args, rule=AttentionRule(window=window))
    slot = torch.arange(full.shape[0]) % B
    position = (anchors.positions.repeat_interleave(B) + slot)[:, None]
    assert torch.equal(sliding[:, :T], full[:, :T] & (position - torch.arange(T) < window))
    near = (slot[:, None] - torch.arange(B).repeat(len(anchors.valid))[None, :]).abs() < window
    assert torch.equal(sliding[:, T:], full[:, T:] & near)
    assert window < B or torch.equal(sliding[:, T:], full[:, T:])
    old = full[:, :T] & (position - slot[:, None] - torch.arange(T) < window)  # anchor - p < W
    assert not torch.equal(sliding[:, :T], old)  # the window binds inside the block here
    causal = attention.dense_rule_mask(*args, rule=AttentionRule(causal=True))
    assert torch.equal(causal[:, T:], full[:, T:].tril()) and torch.equal(
        causal[:, :T], full[:, :T]
    )


def _window_plus_one(*args, rule=attention.FULL_RULE):
    window = None if rule.window is None else rule.window + 1  # (anchor + k) - p <= W
    return ORIGINAL_DENSE(*args, rule=replace(rule, window=window))


def _window_from_the_anchor(doc_ids, anchors, valid, B, *, rule=attention.FULL_RULE):
    """The rule before z-lab's: every slot of a block windowed from the anchor (anchor - p < W),
    the block's own slots never windowed."""
    mask = ORIGINAL_DENSE(doc_ids, anchors, valid, B, rule=replace(rule, window=None))
    if rule.window is not None:
        anchor = anchors.repeat_interleave(B)[:, None]
        mask[:, : doc_ids.shape[0]] &= anchor - torch.arange(doc_ids.shape[0]) < rule.window
    return mask


def _causal_swapped(*args, rule=attention.FULL_RULE):
    return ORIGINAL_DENSE(*args, rule=replace(rule, causal=not rule.causal))


def _attend_with(dense_mask):
    """The objective's SDPA attend built from a (mutated) dense mask instead of its chunks."""

    def chunked_rule_attend(*args, rule=attention.FULL_RULE, query_rows=0):
        return attention.sdpa_attend(dense_mask(*args, rule=rule))

    return chunked_rule_attend


ORIGINAL_DENSE = attention.dense_rule_mask
MUTANTS = {
    "sliding_window_off_by_one": (
        objective,
        "chunked_rule_attend",
        _attend_with(_window_plus_one),
    ),
    "window_from_the_anchor": (
        objective,
        "chunked_rule_attend",
        _attend_with(_window_from_the_anchor),
    ),
    "causal_and_bidirectional_swapped": (
        objective,
        "chunked_rule_attend",
        _attend_with(_causal_swapped),
    ),
    "softcap_only_at_export": (
        objective,
        "logit_transform_of",
        lambda c: LogitTransform(c.output_multiplier, None),
    ),
}


@pytest.mark.parametrize("mutant", MUTANTS, ids=MUTANTS)
def test_each_variant_mutant_breaks_the_agreement_with_the_reference(mutant, monkeypatch):
    s = variant_setup()
    ref, _ = reference_for(s)
    monkeypatch.setattr(*MUTANTS[mutant])
    mutated, _ = run_objective(s)
    expected = float(ref.ce_sum)
    assert abs(float(mutated.ce_sum.detach()) - expected) > MUTANT_GAP * abs(expected), mutant


def test_flex_intervals_that_ignore_the_window_or_the_causal_rule_disagree_with_the_dense_mask(
    monkeypatch,
) -> None:
    doc_ids, anchors, B = mask_case()
    args = (doc_ids, anchors.positions, anchors.valid, B)
    original = attention._visible_intervals
    monkeypatch.setattr(
        attention, "_visible_intervals", lambda *a: original(*a[:4], attention.FULL_RULE)
    )
    for rule in (AttentionRule(window=3), AttentionRule(causal=True)):
        flex = attention.flex_block_mask(*args, 8, rule=rule)
        dense = attention.dense_rule_mask(*args, rule=rule)
        assert not torch.equal(flex_visible(flex, *dense.shape, 8), dense), rule


@pytest.mark.parametrize("window", [3, 6])  # below and above B = 4
def test_flex_intervals_windowed_from_the_anchor_disagree_with_the_dense_mask(
    window, monkeypatch
) -> None:
    """The old rule in the flex path (context lo = anchor - (W - 1) for every slot, the block
    never windowed) is caught by the flex/dense comparison, with W >= B as well."""
    doc_ids, anchors, B = mask_case()
    args = (doc_ids, anchors.positions, anchors.valid, B)
    original = attention._visible_intervals

    def from_the_anchor(doc_ids, anchors, valid, block_size, rule):
        lo, hi, block_lo, block_hi = original(
            doc_ids, anchors, valid, block_size, replace(rule, window=None)
        )
        lo = torch.maximum(lo, anchors.repeat_interleave(block_size) - (rule.window - 1))
        return lo, torch.maximum(hi, lo), block_lo, block_hi

    rule = AttentionRule(window=window)
    dense = attention.dense_rule_mask(*args, rule=rule)
    assert torch.equal(
        flex_visible(attention.flex_block_mask(*args, 8, rule=rule), *dense.shape, 8), dense
    )
    monkeypatch.setattr(attention, "_visible_intervals", from_the_anchor)
    flex = attention.flex_block_mask(*args, 8, rule=rule)
    old = _window_from_the_anchor(*args, rule=rule)
    assert torch.equal(flex_visible(flex, *dense.shape, 8), old)  # the mutant is the old rule
    assert not torch.equal(old, dense)


def test_explicit_defaults_are_the_default_drafter_bit_for_bit() -> None:
    s = build(CASES["d32_hd16_B4_invalid_slots"])
    sums, grads = run_objective(s)
    explicit = replace(
        s.config,
        layer_types=("full_attention",) * s.config.num_hidden_layers,
        is_causal=False,
        sliding_window=9,
        output_multiplier=1.0,
        final_logit_softcapping=None,
        input_embedding_scale=1.0,
    )
    same = replace(
        s,
        config=explicit,
        drafter=tiny_drafter(explicit, CASES["d32_hd16_B4_invalid_slots"].spec.seed),
    )
    sums2, grads2 = run_objective(same)
    for a, b in zip(sums, sums2, strict=True):
        assert torch.equal(a, b)
    for name, grad in grads.items():
        assert torch.equal(grad, grads2[name]), name
    assert explicit.identity().keys() == s.config.identity().keys() | {
        "layer_types",
        "is_causal",
        "sliding_window",
    }
    assert "layer_types" not in s.config.identity()  # old checkpoints' identity unchanged


@pytest.mark.parametrize("is_causal", CAUSAL.values(), ids=CAUSAL.keys())
def test_dflash2_with_variants_equals_its_reference(is_causal) -> None:
    case = d2.CASES["d32_B4_K2_G4_top4"]
    config = replace(d2.dflash2_config(case), **(VARIANTS | {"is_causal": is_causal}))
    drafter = DFlash2Drafter(config).double()
    d2.randomize_(drafter, case.spec.seed)
    embed, lm_head = d2.tiny_target_weights(config, case.spec.seed)
    batch = d2.tiny_batch(case.spec, config)
    s = d2.Setup(case, config, drafter, embed, lm_head, batch, d2.pick_anchors(batch, case))
    d2.align_labels(s)
    ref, ref_grads = d2.reference(s)
    sums, grads = d2.run(s)
    assert d2.close(sums.ce_sum, ref.ce_sum), (float(sums.ce_sum), float(ref.ce_sum))
    assert int(sums.topk_hits) == ref.topk_hits
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=d2.RTOL, atol=d2.ATOL)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_export_config_json_places_and_round_trips_the_variant_fields(kind, tmp_path) -> None:
    s = variant_setup(is_causal=True)
    config = (
        s.config
        if kind == "dflash"
        else replace(d2.dflash2_config(d2.CASES["d32_B4_K2_G4_top4"]), **VARIANTS, is_causal=True)
    )
    drafter = tiny_drafter(config, 0) if kind == "dflash" else DFlash2Drafter(config)
    export_drafter(drafter, config, tmp_path / "export")
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert written["layer_types"] == ["sliding_attention", "full_attention"]
    assert written["sliding_window"] == 5 and written["use_sliding_window"] is True
    assert written["is_causal"] is True
    dflash = written["dflash_config"]
    assert (dflash["output_multiplier"], dflash["final_logit_softcapping"]) == (1.7, 1.5)
    assert dflash["input_embedding_scale"] == 0.6
    loaded, _ = load_drafter_export(tmp_path / "export")
    assert loaded == config


def test_a_default_export_config_keeps_its_old_fields(tmp_path) -> None:
    s = build(CASES["d32_hd16_B4_invalid_slots"], align=False)
    export_drafter(s.drafter, s.config, tmp_path / "export")
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert written["layer_types"] == ["full_attention"] * 2 and "is_causal" not in written
    assert written["use_sliding_window"] is False and written["sliding_window"] is None
    assert set(written["dflash_config"]) == {"mask_token_id", "target_layer_ids", "block_size"}
    loaded, _ = load_drafter_export(tmp_path / "export")
    assert loaded == s.config


NO_FILE = {"DFLASH_ENV_FILE": "none"}
BAD = {
    "DFLASH_DRAFTER__LAYER_TYPES": {
        "DFLASH_DRAFTER__LAYER_TYPES": "full_attention,sliding_attention"
    },
    "DFLASH_DRAFTER__SLIDING_WINDOW": {
        "DFLASH_DRAFTER__NUM_LAYERS": "2",
        "DFLASH_DRAFTER__SLIDING_WINDOW": "0",
        "DFLASH_DRAFTER__LAYER_TYPES": "full_attention,sliding_attention",
    },
    "DFLASH_DRAFTER__FINAL_LOGIT_SOFTCAPPING": {"DFLASH_DRAFTER__FINAL_LOGIT_SOFTCAPPING": "0"},
}


@pytest.mark.parametrize("field", BAD, ids=BAD)
def test_bad_variant_settings_exit_2_naming_the_field(field) -> None:
    with pytest.raises(SettingsError, match=field):
        load_settings(NO_FILE | BAD[field])


def test_variant_settings_reach_the_drafter_spec() -> None:
    from dflash_async.pipeline.specs import run_spec

    settings = load_settings(
        NO_FILE
        | {
            "DFLASH_DRAFTER__NUM_LAYERS": "2",
            "DFLASH_DRAFTER__SLIDING_WINDOW": "64",
            "DFLASH_DRAFTER__LAYER_TYPES": "sliding_attention,full_attention",
            "DFLASH_DRAFTER__IS_CAUSAL": "false",
            "DFLASH_DRAFTER__OUTPUT_MULTIPLIER": "2",
            "DFLASH_DRAFTER__FINAL_LOGIT_SOFTCAPPING": "30",
            "DFLASH_DRAFTER__INPUT_EMBEDDING_SCALE": "0.5",
            "DFLASH_PIPELINE__DEVICES": "cpu",
        }
    )
    spec = run_spec(settings).drafter
    fields = spec.variant_fields()
    assert fields["layer_types"] == ("sliding_attention", "full_attention")
    assert (fields["sliding_window"], fields["is_causal"]) == (64, False)
    assert (fields["output_multiplier"], fields["final_logit_softcapping"]) == (2.0, 30.0)
    assert fields["input_embedding_scale"] == 0.5


@pytest.mark.parametrize("taps", [6, 8, 9])
def test_any_number_of_taps_trains_and_equals_the_reference(taps: int) -> None:
    from dflash_async.model.drafter_config import default_target_layer_ids

    base = build(CASES["d32_hd16_B4_invalid_slots"], align=False)
    config = replace(
        base.config, num_target_layers=12, target_layer_ids=default_target_layer_ids(12, taps)
    )
    spec = replace(CASES["d32_hd16_B4_invalid_slots"].spec, num_features=taps)
    s = replace(
        base,
        config=config,
        drafter=tiny_drafter(config, spec.seed),
        batch=tiny_batch(spec, config),
    )
    assert s.drafter.fc.weight.shape == (config.hidden_size, taps * config.hidden_size)
    ref, ref_grads = reference_for(s)
    sums, grads = run_objective(s)
    assert_sums_match(sums, ref)
    assert_grads_match(grads, ref_grads)
