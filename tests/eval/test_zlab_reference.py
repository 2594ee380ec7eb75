"""Our exports decoded by z-lab's own code (benchmarks/zlab_check.py), when a checkout is named.

    DFLASH_ZLAB_DFLASH=/path/to/z-lab/dflash python -m pytest -q tests/eval/test_zlab_reference.py

Skipped without that variable: z-lab's code is never copied into this project. Checked against
commit 07ebd93db9f472af339b644bb70221ad8428328a (the first with DFlash2DraftModel). Tiny random
exports of the demo target: z-lab's `DFlash2DraftModel` / `DFlashDraftModel` load each with no
missing, unexpected or mismatched keys, and its `dflash_generate` gives our reference decoder's
tokens, acceptance lengths and drafts, greedy. Sliding layers whose window binds included: z-lab
windows each block slot from its own position ((anchor + k) - p < W, and |k - s| < W inside the
block), as we train and decode (docs/DFLASH.md s.10), with W above and below the block size.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from external_check_kit import check_exit_code, tiny_export

from dflash_async.targets.tiny import ensure_tiny_target

ZLAB = os.environ.get("DFLASH_ZLAB_DFLASH", "")
pytestmark = [
    pytest.mark.skipif(not ZLAB, reason="DFLASH_ZLAB_DFLASH names no z-lab/dflash checkout"),
    pytest.mark.usefixtures("one_intra_op_thread"),
]
SLIDING = ("sliding_attention", "full_attention")
EXPORTS = {
    "dflash2": dict(kind="dflash2", selector_top_k=4, selector_rank=16),
    "dflash2_sliding_wide": dict(
        kind="dflash2", selector_top_k=4, selector_rank=16, layer_types=SLIDING, sliding_window=4096
    ),
    "dflash2_softcapped": dict(
        kind="dflash2",
        selector_top_k=4,
        selector_rank=16,
        output_multiplier=3.0,
        final_logit_softcapping=0.5,
    ),
    "dflash_sliding_wide": dict(layer_types=SLIDING, sliding_window=4096),
    "dflash_causal": dict(is_causal=True),
    "dflash_sliding_binding": dict(layer_types=SLIDING, sliding_window=8),
    "dflash_sliding_below_block": dict(layer_types=SLIDING, sliding_window=3, is_causal=False),
}


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory) -> Path:
    return ensure_tiny_target(tmp_path_factory.mktemp("zlab") / "cache")


def sharpen_selector(drafter) -> None:
    """A selector that overrules the unary order: the walk matters."""
    drafter.candidate_selector.successor_codebook.mul_(40.0)


@pytest.mark.parametrize("name", EXPORTS)
def test_zlab_loads_our_export_and_decodes_it_as_eval_does(name, target_folder, tmp_path, capsys):
    fields = EXPORTS[name]
    sharpen = sharpen_selector if fields.get("kind") == "dflash2" else None
    export = tiny_export(
        target_folder, tmp_path / name, block_size=6, fields=fields, sharpen=sharpen
    )
    code = check_exit_code("zlab_check", ("--zlab", ZLAB), export, target_folder)
    assert code == 0, capsys.readouterr().out
