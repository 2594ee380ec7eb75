"""Our DSpark exports decoded by DeepSpec's own code (benchmarks/deepspec_check.py), when a
checkout is named.

    DFLASH_DEEPSPEC=/path/to/DeepSpec python -m pytest -q tests/eval/test_deepspec_reference.py

Skipped without that variable: DeepSpec's code is never copied into this project. Checked against
deepseek-ai/DeepSpec afdfa7c9. Tiny random DSpark exports of the demo target (vanilla and gated
Markov heads, the confidence head with and without the Markov input, a Markov head scaled up so
that it changes the drafts): DeepSpec's `Qwen3DSparkModel` loads each with no unexpected or
mismatched keys (missing only the frozen embed_tokens and lm_head, set from the target), and its
decoding loop gives our reference decoder's tokens, drafts and acceptance lengths, greedy.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from conftest import randomize_
from transformers import Qwen3Config

from dflash_async.checkpoint.export import export_drafter
from dflash_async.model.drafter_config import drafter_config_from_target
from dflash_async.model.kinds import kind_of
from dflash_async.targets.tiny import ensure_tiny_target, tiny_tokenizer

DEEPSPEC = os.environ.get("DFLASH_DEEPSPEC", "")
pytestmark = [
    pytest.mark.skipif(not DEEPSPEC, reason="DFLASH_DEEPSPEC names no DeepSpec checkout"),
    pytest.mark.usefixtures("one_intra_op_thread"),
]
CHECK = Path(__file__).resolve().parents[2] / "benchmarks" / "deepspec_check.py"
EXPORTS = {
    "vanilla": dict(markov_rank=16),
    "gated": dict(markov_rank=16, markov_head_type="gated"),
    "confidence_on_h": dict(markov_rank=16, confidence_head_with_markov=False),
    "no_markov": dict(markov_rank=0, confidence_head_with_markov=False),
}


def deepspec_check():
    spec = importlib.util.spec_from_file_location("deepspec_check", CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory) -> Path:
    return ensure_tiny_target(tmp_path_factory.mktemp("deepspec") / "cache")


def tiny_export(folder: Path, out: Path, fields: dict) -> Path:
    config = drafter_config_from_target(
        Qwen3Config.from_pretrained(folder),
        num_hidden_layers=2,
        num_features=2,
        block_size=5,
        mask_token_id=tiny_tokenizer().mask_token_id,
        kind="dspark",
        **fields,
    )
    drafter = kind_of(config.kind).make_drafter(config)
    randomize_(drafter, 2)
    if drafter.markov_head is not None:  # a bias that changes the chain's drafts
        with torch.no_grad():
            drafter.markov_head.markov_w2.weight.mul_(30.0)
    export_drafter(drafter, config, out)
    return out


@pytest.mark.parametrize("name", EXPORTS)
def test_deepspec_loads_our_export_and_decodes_it_as_eval_does(
    name, target_folder, tmp_path, capsys
):
    export = tiny_export(target_folder, tmp_path / name, EXPORTS[name])
    argv = ["--deepspec", DEEPSPEC, "--drafter", str(export), "--target", str(target_folder)]
    assert deepspec_check().main([*argv, "--num-prompts", "2", "--max-new-tokens", "40"]) == 0, (
        capsys.readouterr().out
    )
