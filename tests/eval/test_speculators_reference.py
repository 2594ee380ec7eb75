"""Our speculators-convention DSpark exports read by vLLM speculators' own classes
(benchmarks/speculators_check.py), where the `speculators` package is importable.

    python -m pytest -q tests/eval/test_speculators_reference.py   # in an environment with it

Skipped otherwise: speculators is no dependency of this project. Checked against speculators
0.9.0. Tiny random DSpark drafters of the demo target (vanilla and gated Markov heads, the
confidence head on [h, W1[prev]] and on h alone, no Markov head), written by the `speculators`
format: `DSparkSpeculatorConfig` validates the config, `DSparkDraftModel` takes exactly the stored
tensors (less the four it takes from the verifier), and its forward gives our drafter's logits
and confidence logits of one block within the check's tolerance. Three purpose-made mutants of
what speculators reads each fail the check: the older B+1 slot convention (the anchor's slot
unused), the Markov head's W1 and W2 exchanged, the confidence head's tensors missing.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from external_check_kit import check_script, rewrite_export, tiny_export

from dflash_async.checkpoint.export import load_drafter_export
from dflash_async.checkpoint.formats import write_export
from dflash_async.targets.loading import load_target
from dflash_async.targets.tiny import ensure_tiny_target

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("speculators") is None, reason="speculators is not installed"
    ),
    pytest.mark.usefixtures("one_intra_op_thread"),
]
EXPORTS = {
    "vanilla": dict(markov_rank=16),
    "gated": dict(markov_rank=16, markov_head_type="gated"),
    "confidence_on_h": dict(markov_rank=16, confidence_head_with_markov=False),
    "no_markov": dict(markov_rank=0, confidence_head_with_markov=False),
}


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory) -> Path:
    return ensure_tiny_target(tmp_path_factory.mktemp("speculators") / "cache")


@pytest.fixture(scope="module")
def target(target_folder):
    return load_target(target_folder, device="cpu", dtype=torch.float32)


def speculators_export(target_folder: Path, out: Path, fields: dict) -> Path:
    """A tiny random DSpark drafter's run export at out/drafter, rewritten as the `export`
    command does into out/speculators; returns the latter."""
    default = tiny_export(target_folder, out / "drafter", block_size=5, fields=fields)
    config, tensors = load_drafter_export(default)
    path = out / "speculators"
    return write_export(tensors, config, path, format="speculators", verifier=str(target_folder))


@pytest.mark.parametrize("name", EXPORTS)
def test_speculators_loads_our_export_and_gives_our_block_logits(
    name, target_folder, target, tmp_path
) -> None:
    export = speculators_export(target_folder, tmp_path, dict(kind="dspark", **EXPORTS[name]))
    result = check_script("speculators_check").compare(export, export, target)
    assert result["ok"], result
    assert result["speculators_config"] == "DSparkSpeculatorConfig"


MUTANTS = {
    "slots_shifted_by_one": dict(config={"sample_from_anchor": False, "block_size": 6}),
    "markov_w1_w2_swapped": dict(
        swap=("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")
    ),
    "confidence_head_missing": dict(drop="confidence_head."),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_the_check_fails_on_each_mutant(mutant, target_folder, target, tmp_path) -> None:
    export = speculators_export(target_folder, tmp_path, dict(kind="dspark", markov_rank=16))
    theirs = rewrite_export(shutil.copytree(export, tmp_path / "mutant"), **MUTANTS[mutant])
    result = check_script("speculators_check").compare(export, theirs, target)
    assert not result["ok"], result
