"""Decoding with a DFlash2 drafter: its drafts are the candidate selector's greedy walk.

The walk (model/kinds/dflash2/decoding.py, both decoders) is compared with an independent loop written here from
the contract alone: for slots 1..B-1 left to right, candidates = the unary top-k, score(c) =
unary(c) + sum_r pred[prev, r] * (W_h h)[r] * succ[c, r], prev = the previous slot's choice (the
anchor for slot 1), draft = the best scored candidate. Three mutants of the walk must break that
agreement. The drafters are tiny and random with a successor codebook scaled up, so the selector
really changes drafts (asserted). Then the batched decoder equals the reference decoder on a
DFlash2 drafter, and `eval --block-size` serves the export below its trained block size. At T > 0
the walk samples each slot from the selector's softmax over its candidates (the slot's q), and
`eval --temperature 0,1.0` reports tau at each temperature.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import TinySpec, randomize_, tiny_config, tiny_target_weights
from structlog.testing import capture_logs
from tiny_decoding import VOCAB, tiny_qwen3_target
from transformers import Qwen3Config

from dflash_async.checkpoint.export import export_drafter
from dflash_async.eval.batched_decoding import BatchedDecode, RowsBlockDrafter
from dflash_async.eval.harness import main
from dflash_async.eval.lossless import check_lossless
from dflash_async.eval.sampling import Sampler, SamplingOptions
from dflash_async.eval.speculative import DFlashBlockDrafter, greedy_generate, speculative_decode
from dflash_async.model.drafter_config import drafter_config_from_target
from dflash_async.model.kinds.dflash2 import decoding as selector
from dflash_async.model.kinds.dflash2.drafter import CandidateSelector, DFlash2Drafter
from dflash_async.targets.loading import frozen_embeddings
from dflash_async.targets.tiny import ensure_tiny_target, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

TOP_K, SELECTOR_GAIN, MAX_NEW = 4, 40.0, 40


def strong_selector_(drafter: DFlash2Drafter, seed: int) -> DFlash2Drafter:
    """Every tensor random, the successor codebook scaled so the selector overrules the unary
    order inside the top-k (a trained selector's job), eval mode."""
    randomize_(drafter, seed)
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook.mul_(SELECTOR_GAIN)
    return drafter.eval().requires_grad_(False)


def contract_unary(drafter: DFlash2Drafter, lm_head, h) -> torch.Tensor:
    """A slot's unary logits [V] in fp64 as trained: z = m * lm_head(h), then c * tanh(z / c)."""
    cfg = drafter.config
    z = cfg.output_multiplier * (lm_head.double() @ h.double())
    cap = cfg.final_logit_softcapping
    return z if cap is None else cap * torch.tanh(z / cap)


def contract_walk(drafter: DFlash2Drafter, hidden, lm_head, anchor: int, top_k: int) -> list[int]:
    """The contract's walk for one block, in plain Python over the parameters (no selector code)."""
    p = {n: t.double() for n, t in drafter.candidate_selector.named_parameters()}
    prev, path = anchor, []
    for h in hidden.double():  # [d] per slot, left to right
        unary = contract_unary(drafter, lm_head, h).tolist()
        candidates = sorted(range(len(unary)), key=lambda c: -unary[c])[:top_k]
        z = p["hidden_projection.weight"] @ h  # [r]
        score = {
            c: unary[c]
            + float((p["predecessor_codebook"][prev] * z * p["successor_codebook"][c]).sum())
            for c in candidates
        }
        prev = max(candidates, key=lambda c: score[c])
        path.append(prev)
    return path


def tiny_block_drafters(seed: int = 3, **variant):
    """A fp64 DFlash2 drafter (B = 6, top-4 of 97, DrafterConfig fields `variant`) with 9
    context tokens, as both decoders' drafters: (drafter, one-sequence BlockDrafter, rows
    drafter of 3 rows, lm_head)."""
    config = replace(
        tiny_config(TinySpec(block_size=6)),
        kind="dflash2",
        conv_group_size=8,
        selector_rank=8,
        selector_top_k=TOP_K,
        **variant,
    )
    drafter = strong_selector_(DFlash2Drafter(config).double(), seed)
    embed, lm_head = tiny_target_weights(config, seed)
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(9, config.num_features * config.hidden_size, generator=gen).double()
    one = DFlashBlockDrafter(drafter, config, embed, lm_head, max_context=32)
    one.extend_context(features, torch.arange(9))
    rows = RowsBlockDrafter(drafter, config, embed, lm_head, batch=3, capacity=32)
    rows.extend_context(features.expand(3, -1, -1), torch.arange(9).expand(3, -1))
    return drafter, one, rows, lm_head


ANCHORS = (5, 17, 60)  # one block per row, all at position 9


def decoder_drafts(one: DFlashBlockDrafter, rows: RowsBlockDrafter) -> list[list[int]]:
    """Drafts of both decoders' drafters for ANCHORS; asserts they agree."""
    single = [one.draft(a, 9).tolist() for a in ANCHORS]
    batched = rows.draft(torch.tensor(ANCHORS), torch.full((3,), 9)).tolist()
    assert single == batched
    return single


def contract_drafts(drafter, one: DFlashBlockDrafter, lm_head) -> list[list[int]]:
    return [contract_walk(drafter, one.block_hidden(a, 9), lm_head, a, TOP_K) for a in ANCHORS]


def test_the_decoders_selector_walk_equals_the_contract_loop_and_differs_from_the_argmax():
    drafter, one, rows, lm_head = tiny_block_drafters()
    expected = contract_drafts(drafter, one, lm_head)
    assert decoder_drafts(one, rows) == expected
    argmax = [one.block_logits(a, 9).argmax(-1).tolist() for a in ANCHORS]
    assert argmax != expected  # the selector changes drafts: the walk is what is compared


def _shifted_predecessor(path: list[torch.Tensor]) -> torch.Tensor:
    return path[-2] if len(path) > 1 else path[-1]


def _full_vocabulary(unary: torch.Tensor, *, top_k: int):
    return ORIGINAL_CANDIDATES(unary, top_k=unary.shape[-1])


def _swapped_codebooks(self, hidden, previous, candidates):
    z = self.hidden_projection(hidden)
    pred, succ = self.successor_codebook[previous], self.predecessor_codebook[candidates]
    return torch.einsum("nr,nkr->nk", pred * z, succ)


ORIGINAL_CANDIDATES = selector.slot_candidates
WALK_MUTANTS = {
    "predecessor_shifted_by_one": (selector, "predecessor", _shifted_predecessor),
    "top_k_not_applied": (selector, "slot_candidates", _full_vocabulary),
    "codebooks_swapped": (CandidateSelector, "pair_scores", _swapped_codebooks),
}


def test_the_walk_scores_the_transformed_unary_logits_of_a_softcapped_multiplied_drafter():
    """With output_multiplier m and final_logit_softcapping c the selector adds its pair scores
    to z = c * tanh(m * lm_head(h) / c), as the objective trains it (DFLASH.md s.10), at T = 0 and
    in the sampled walk's q; the raw lm_head logits give other drafts here (asserted)."""
    drafter, one, rows, lm_head = tiny_block_drafters(
        output_multiplier=3.0, final_logit_softcapping=0.5
    )
    expected = contract_drafts(drafter, one, lm_head)
    assert decoder_drafts(one, rows) == expected
    raw = replace(drafter.config, output_multiplier=1.0, final_logit_softcapping=None)
    raw_walk = [
        contract_walk(replace_config(drafter, raw), one.block_hidden(a, 9), lm_head, a, TOP_K)
        for a in ANCHORS
    ]
    assert raw_walk != expected  # the transform changes the walk: what is compared
    sampler = Sampler.for_prompt(SamplingOptions(0.7), 0, torch.device("cpu"))
    _, q = one.draft_sampled(ANCHORS[1], 9, sampler)
    h = one.block_hidden(ANCHORS[1], 9)[0]
    unary = contract_unary(drafter, lm_head, h)
    p = {n: t.double() for n, t in drafter.candidate_selector.named_parameters()}
    z = p["hidden_projection.weight"] @ h.double()
    candidates = unary.topk(TOP_K).indices
    pair = (p["predecessor_codebook"][ANCHORS[1]] * z * p["successor_codebook"][candidates]).sum(-1)
    expected_q = torch.zeros_like(unary)
    expected_q[candidates] = ((unary[candidates] + pair) / 0.7).softmax(-1)
    torch.testing.assert_close(q[0].double(), expected_q, rtol=1e-4, atol=1e-5)


def replace_config(drafter: DFlash2Drafter, config) -> DFlash2Drafter:
    """The same module seen with another config (contract_walk reads only its transform)."""

    class Viewed:
        candidate_selector = drafter.candidate_selector

    Viewed.config = config
    return Viewed()


@pytest.mark.parametrize("mutant", WALK_MUTANTS, ids=WALK_MUTANTS)
def test_each_walk_mutant_breaks_the_agreement_with_the_contract_loop(mutant, monkeypatch):
    drafter, one, rows, lm_head = tiny_block_drafters()
    expected = contract_drafts(drafter, one, lm_head)
    assert decoder_drafts(one, rows) == expected  # unmutated: they agree
    monkeypatch.setattr(*WALK_MUTANTS[mutant])
    assert decoder_drafts(one, rows) != expected, mutant


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3_target()


def recording(draft_fn, log: list):
    """draft_fn, also logging (its drafts, the unary argmax drafts) of every call."""

    def draft(self, anchors, positions):
        drafts = draft_fn(self, anchors, positions)
        log.append((drafts.tolist(), self.block_logits(anchors, positions).argmax(-1).tolist()))
        return drafts

    return draft


def test_batched_dflash2_decoding_equals_the_reference_and_its_drafts_are_the_selectors(
    target, monkeypatch
):
    """Same tokens, accepted lengths and per-step drafts for 4 prompts of different lengths,
    both lossless; some step's drafts are not the unary argmax (the selector decoded)."""
    config = drafter_config_from_target(
        target.config,
        num_hidden_layers=2,
        num_features=2,
        block_size=5,
        mask_token_id=VOCAB - 1,
        kind="dflash2",
        conv_group_size=16,
        selector_rank=8,
        selector_top_k=TOP_K,
    )
    drafter = strong_selector_(DFlash2Drafter(config), seed=1)
    embed, lm_head = frozen_embeddings(target)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=gen).tolist() for n in (3, 11, 24, 7)]
    one_log, rows_log = [], []
    monkeypatch.setattr(DFlashBlockDrafter, "draft", recording(DFlashBlockDrafter.draft, one_log))
    monkeypatch.setattr(RowsBlockDrafter, "draft", recording(RowsBlockDrafter.draft, rows_log))
    reference, reference_drafts = [], []
    for p in prompts:
        one = DFlashBlockDrafter(drafter, config, embed, lm_head, max_context=len(p) + 64)
        reference.append(
            speculative_decode(
                target,
                one,
                p,
                layer_ids=config.target_layer_ids,
                max_new_tokens=MAX_NEW,
                eos_token_id=None,
            )
        )
        reference_drafts.append([drafts for drafts, _ in one_log])
        one_log.clear()
    rows = RowsBlockDrafter(drafter, config, embed, lm_head, batch=4, capacity=128)
    decode = BatchedDecode(
        target,
        prompts,
        draft=rows,
        layer_ids=config.target_layer_ids,
        max_new_tokens=MAX_NEW,
        eos=frozenset(),
        suppress=(),
    )
    while not decode.advance():
        pass
    batched = decode.results()
    assert [r.tokens for r in batched] == [r.tokens for r in reference]
    assert [r.accepted_lengths for r in batched] == [r.accepted_lengths for r in reference]
    for i, steps in enumerate(reference_drafts):
        assert [rows_log[s][0][i] for s in range(len(steps))] == steps, i
    assert any(drafts != argmax for drafts, argmax in rows_log)
    for i, (p, spec) in enumerate(zip(prompts, reference, strict=True)):
        assert check_lossless(i, greedy_generate(target, p, MAX_NEW, None), spec, 0.0) is None
    assert all(r.tau >= 1.0 for r in batched)


@pytest.fixture(scope="module")
def dflash2_export(tmp_path_factory) -> tuple[Path, Path]:
    """(tiny target folder, the export of a random 1-layer B=6 DFlash2 drafter)."""
    root = tmp_path_factory.mktemp("dflash2_export")
    folder = ensure_tiny_target(root / "cache")
    config = drafter_config_from_target(
        Qwen3Config.from_pretrained(folder),
        num_hidden_layers=1,
        num_features=2,
        block_size=6,
        mask_token_id=tiny_tokenizer().mask_token_id,
        kind="dflash2",
        selector_top_k=TOP_K,
        selector_rank=16,
    )
    export_drafter(strong_selector_(DFlash2Drafter(config), seed=2), config, root / "export")
    return folder, root / "export"


def test_eval_block_size_below_the_trained_decodes_losslessly_and_above_it_exits_2(
    dflash2_export, capsys
):
    """--block-size 3 of a B=6 DFlash2 export: exit 0 (every sample lossless), blocks of 3 in the
    summary; --block-size 7: one line on stderr, exit 2, nothing decoded."""
    from dflash_async.__main__ import main as cli

    folder, export = dflash2_export
    argv = ["--target", str(folder), "--drafter", str(export), "--device", "cpu"]
    argv += ["--max-new-tokens", "12", "--num-prompts", "2"]
    with capture_logs():
        assert main([*argv, "--block-size", "3"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["block_size"] == 3 and summary["numerical_ties"] == 0
    assert list(summary["accepted_length_histogram"]) == ["1", "2", "3"]
    assert summary["tau"] >= 1.0
    with capture_logs():
        assert cli(["eval", *argv, "--block-size", "7"]) == 2
    err = capsys.readouterr().err
    assert "--block-size 7" in err and "trained block size is 6" in err and err.count("\n") == 1


def test_the_in_run_copy_of_a_dflash2_drafter_is_a_dflash2_drafter_at_the_eval_block_size():
    """copy_weights keeps the kind (selector and convolutions, bf16-rounded) and serves it at
    DFLASH_EVAL__BLOCK_SIZE."""
    from dflash_async.stages.evaluate import copy_weights

    config = replace(
        tiny_config(TinySpec(block_size=6)),
        kind="dflash2",
        conv_group_size=8,
        selector_rank=8,
        selector_top_k=TOP_K,
    )
    source = strong_selector_(DFlash2Drafter(config), seed=0)
    copy = copy_weights(source, None, device=torch.device("cpu"), dtype=torch.float32, block_size=4)
    assert isinstance(copy, DFlash2Drafter) and copy.config == replace(config, block_size=4)
    for name, value in source.state_dict().items():
        assert torch.equal(copy.state_dict()[name], value.bfloat16().float()), name


def test_the_sampled_walk_draws_each_slot_from_the_selectors_softmax_over_its_candidates():
    """T > 0: slot i's q is softmax(score / T) over the unary top-k (zero elsewhere), scored from
    the previous slot's drawn token, and the draft is one of those candidates."""
    drafter, one, _, lm_head = tiny_block_drafters()
    temperature, anchor = 0.7, ANCHORS[1]
    sampler = Sampler.for_prompt(SamplingOptions(temperature), 0, torch.device("cpu"))
    drafts, q = one.draft_sampled(anchor, 9, sampler)
    p = {n: t.double() for n, t in drafter.candidate_selector.named_parameters()}
    prev = anchor
    for i, h in enumerate(one.block_hidden(anchor, 9).double()):
        unary = lm_head.double() @ h
        candidates = unary.topk(TOP_K).indices
        z = p["hidden_projection.weight"] @ h
        pair = (p["predecessor_codebook"][prev] * z * p["successor_codebook"][candidates]).sum(-1)
        expected = torch.zeros_like(unary)
        expected[candidates] = ((unary[candidates] + pair) / temperature).softmax(-1)
        torch.testing.assert_close(q[i].double(), expected, rtol=1e-4, atol=1e-5)
        assert int(drafts[i]) in candidates.tolist()
        prev = int(drafts[i])


def test_eval_temperature_list_reports_tau_at_each_temperature(dflash2_export, capsys):
    """eval --temperature 0,1.0 --top-k 3: the summary is T = 0's (lossless-checked), with
    by_temperature holding both (greedy reports no filter); a bad --top-p exits 2 in one line."""
    from dflash_async.__main__ import main as cli

    folder, export = dflash2_export
    argv = ["--target", str(folder), "--drafter", str(export), "--device", "cpu"]
    argv += ["--max-new-tokens", "12", "--num-prompts", "2"]
    with capture_logs():
        assert main([*argv, "--temperature", "0,1.0", "--top-k", "3"]) == 0
    summary = json.loads(capsys.readouterr().out)
    by_t = summary["by_temperature"]
    assert summary["temperature"] == 0.0 and summary["lossless_checked"]
    assert [(r["temperature"], r["top_k"]) for r in by_t] == [
        (0.0, 0),
        (1.0, 3),
    ]  # T = 0 filters nothing
    assert by_t[0]["tau"] == summary["tau"] and by_t[1]["tau"] >= 1.0
    with capture_logs():
        assert cli(["eval", *argv, "--temperature", "0.7", "--top-p", "1.5"]) == 2
    assert "--top-p" in capsys.readouterr().err
