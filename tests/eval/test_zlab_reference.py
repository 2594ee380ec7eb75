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

ZLAB = os.environ.get("DFLASH_ZLAB_DFLASH", "")
pytestmark = [
    pytest.mark.skipif(not ZLAB, reason="DFLASH_ZLAB_DFLASH names no z-lab/dflash checkout"),
    pytest.mark.usefixtures("one_intra_op_thread"),
]
CHECK = Path(__file__).resolve().parents[2] / "benchmarks" / "zlab_check.py"
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


def zlab_check():
    spec = importlib.util.spec_from_file_location("zlab_check", CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory) -> Path:
    return ensure_tiny_target(tmp_path_factory.mktemp("zlab") / "cache")


def tiny_export(folder: Path, out: Path, fields: dict) -> Path:
    config = drafter_config_from_target(
        Qwen3Config.from_pretrained(folder),
        num_hidden_layers=2,
        num_features=2,
        block_size=6,
        mask_token_id=tiny_tokenizer().mask_token_id,
        **fields,
    )
    drafter = kind_of(config.kind).make_drafter(config)
    randomize_(drafter, 2)
    if config.kind == "dflash2":  # a selector that overrules the unary order: the walk matters
        with torch.no_grad():
            drafter.candidate_selector.successor_codebook.mul_(40.0)
    export_drafter(drafter, config, out)
    return out


@pytest.mark.parametrize("name", EXPORTS)
def test_zlab_loads_our_export_and_decodes_it_as_eval_does(name, target_folder, tmp_path, capsys):
    export = tiny_export(target_folder, tmp_path / name, EXPORTS[name])
    argv = ["--zlab", ZLAB, "--drafter", str(export), "--target", str(target_folder)]
    assert zlab_check().main([*argv, "--num-prompts", "2", "--max-new-tokens", "40"]) == 0, (
        capsys.readouterr().out
    )
