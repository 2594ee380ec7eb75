"""Every causal-LM model_type of the installed transformers trains on the CPU, through the product.

The list is transformers' own mapping (tests/causal_lm_zoo.py `causal_lm_types`), never written
here. Each type's tiny config (hidden 32, 2 layers, a 512-token vocabulary, the type's fix-ups)
is saved as a random target folder with the built-in tiny tokenizer and trained 3 steps by
`pipeline.run` in process: the family's packed path where it has one, else the generic path
(targets/generic.py). A type start-up refuses (an encoder-decoder) must be refused with one
line; a type in the zoo's exclusion table is skipped with its reason. README's count and lists
are generated from the same table (benchmarks/readme_causal_lms.py) and checked here.

slow: 176 runs of 1-10 s (a wrapper or a state-space model the longest): 156 s in all on two CPU
cores, 362 s while other jobs shared them (2026-12-06).
"""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import pytest
import torch
from causal_lm_zoo import FIXUPS, Excluded, causal_lm_types, readme_section, save_tiny, zoo_table
from structlog.testing import capture_logs
from tiny_run import tiny_env, write_pretokenized

from dflash_async.log import get_logger
from dflash_async.pipeline import run as pipeline
from dflash_async.settings.env import load_settings
from dflash_async.targets.families import unsupported_reason

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_intra_op_thread")]
README = Path(__file__).resolve().parents[2] / "README.md"
RUN_DEADLINE_S = 60


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_pretokenized(tmp_path_factory.mktemp("zoo") / "data.jsonl", records=12, vocab=512)


def _env(target: Path, data: Path, out: Path) -> dict[str, str]:
    env = tiny_env({"target": str(target), "data": str(data), "mask": "5"}, out)
    return env | {
        "DFLASH_TARGET__NUM_FEATURES": "2",
        "DFLASH_TARGET__TARGET_LAYER_IDS": "0,1",
        "DFLASH_TRAIN__MAX_STEPS": "3",
        "DFLASH_TRAIN__SAVE_EVERY": "0",
        "DFLASH_EVAL__EVERY": "0",
        "DFLASH_EVAL__AT_END": "false",
        "DFLASH_PIPELINE__DEVICES": "cpu",
    }


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("model_type", causal_lm_types())
async def test_every_causal_lm_type_trains_three_steps_or_is_refused_in_one_line(
    model_type: str, data: Path, tmp_path: Path
) -> None:
    fix = FIXUPS.get(model_type)
    if isinstance(fix, Excluded):
        pytest.skip(fix.reason)
    target, config = save_tiny(tmp_path / "target", model_type)
    refusal = unsupported_reason(config)
    if refusal is not None:
        assert zoo_table()[model_type][0] == "refused" and "\n" not in refusal
        return
    with capture_logs() as events, anyio.fail_after(RUN_DEADLINE_S):
        code = await pipeline.run(
            load_settings(_env(target, data, tmp_path / "out")), get_logger("t")
        )
    steps = [e for e in events if e["event"] == "step"]
    assert code == 0 and len(steps) == 3
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in steps)


def test_the_readme_lists_the_zoos_count_and_exclusions() -> None:
    """Regenerate with `python benchmarks/readme_causal_lms.py` when this fails."""
    block = re.search(
        r"<!-- causal-lms:begin[^\n]*-->\n(.*?)\n<!-- causal-lms:end -->",
        README.read_text(encoding="utf-8"),
        re.S,
    )
    assert block is not None, "README.md lost its causal-lms block"
    assert block[1] == readme_section()
