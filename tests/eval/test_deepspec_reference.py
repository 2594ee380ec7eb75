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

import os
from pathlib import Path

import pytest
from external_check_kit import check_exit_code, tiny_export

from dflash_async.targets.tiny import ensure_tiny_target

DEEPSPEC = os.environ.get("DFLASH_DEEPSPEC", "")
pytestmark = [
    pytest.mark.skipif(not DEEPSPEC, reason="DFLASH_DEEPSPEC names no DeepSpec checkout"),
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
    return ensure_tiny_target(tmp_path_factory.mktemp("deepspec") / "cache")


def sharpen_markov(drafter) -> None:
    """A Markov head's bias scaled up so that it changes the chain's drafts."""
    if drafter.markov_head is not None:
        drafter.markov_head.markov_w2.weight.mul_(30.0)


@pytest.mark.parametrize("name", EXPORTS)
def test_deepspec_loads_our_export_and_decodes_it_as_eval_does(
    name, target_folder, tmp_path, capsys
):
    fields = dict(kind="dspark", **EXPORTS[name])
    export = tiny_export(
        target_folder, tmp_path / name, block_size=5, fields=fields, sharpen=sharpen_markov
    )
    code = check_exit_code("deepspec_check", ("--deepspec", DEEPSPEC), export, target_folder)
    assert code == 0, capsys.readouterr().out
