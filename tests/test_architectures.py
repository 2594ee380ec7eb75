"""Every supported target architecture trains and decodes losslessly on the CPU (issue 29, A).

One tiny random target per model_type (tests/arch_targets.py: 2 layers, hidden 64, the built-in
tiny tokenizer), each run in-process for a few steps with the tiny settings of tiny_run.py and
an evaluation at the end: the run exits 0 and logs its `eval` (lossless-checked), no
`eval_failed`. The mask token is left unset, so start-up finds it in the target's tokenizer. A
model_type the installed transformers lacks is skipped with a reason.

The in-run check compares speculative with greedy decoding by the same (batched) decoder, so a
second test pins both decoders to HF's own greedy decoding (its DynamicCache, sliding-window
layers included), with an oracle drafter that accepts a varying number of drafts per step: a
prompt longer than the sliding window, so rollbacks after rejected drafts cross it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from arch_targets import ARCHITECTURES, config_class, save_tiny_target
from structlog.testing import capture_logs
from test_evaluate_batched import OneOracle, RowsOracle
from tiny_run import tiny_env, write_pretokenized

from dflash_async.eval.batched import BatchedDecode, batched_unsupported_reason
from dflash_async.eval.speculative import greedy_generate, speculative_decode
from dflash_async.log import get_logger
from dflash_async.pipeline import run as pipeline
from dflash_async.settings_env import load_settings
from dflash_async.target.loading import load_target
from dflash_async.target.tiny import tiny_tokenizer

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("single_thread")]
RUN_DEADLINE_S = 60


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The data and evaluation prompts every architecture's run reads."""
    root = tmp_path_factory.mktemp("arch")
    data = write_pretokenized(root / "data.jsonl", records=24, vocab=len(tiny_tokenizer()))
    prompts = root / "prompts.jsonl"
    records = [{"prompt": "What is 2 plus 3?"}, {"prompt": "List 3 colors, one per line."}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    return {"data": str(data), "prompts": str(prompts)}


def arch_env(shared: dict[str, str], target: Path, output_dir: Path) -> dict[str, str]:
    """tiny_env's run for `target` (mask token unset), 3 steps, one evaluation at the end."""
    env = tiny_env({"target": str(target), "data": shared["data"], "mask": ""}, output_dir)
    del env["DFLASH_DRAFTER__MASK_TOKEN_ID"]
    return env | {
        "DFLASH_TARGET__NUM_FEATURES": "2", "DFLASH_TARGET__TARGET_LAYER_IDS": "0,1",
        "DFLASH_TRAIN__MAX_STEPS": "3", "DFLASH_TRAIN__SAVE_EVERY": "0",
        "DFLASH_EVAL__PROMPTS_PATH": shared["prompts"], "DFLASH_EVAL__NUM_PROMPTS": "2",
        "DFLASH_EVAL__MAX_NEW_TOKENS": "12", "DFLASH_EVAL__AT_END": "true",
    }  # fmt: skip


async def run_logged(env: dict[str, str]) -> tuple[int, list[dict[str, Any]]]:
    with capture_logs() as events, anyio.fail_after(RUN_DEADLINE_S):
        code = await pipeline.run(load_settings(env), get_logger("test"))
    return code, events


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
async def test_every_architecture_trains_and_decodes_losslessly(
    model_type: str, shared: dict[str, str], tmp_path: Path
) -> None:
    if config_class(model_type) is None:
        pytest.skip(f"transformers has no {ARCHITECTURES[model_type][0]} ({model_type})")
    target = save_tiny_target(tmp_path / model_type, model_type)
    code, events = await run_logged(arch_env(shared, target, tmp_path / "out"))
    failed = [e for e in events if e["event"] in ("eval_failed", "eval_skipped")]
    assert code == 0 and not failed, failed
    assert len([e for e in events if e["event"] == "step"]) == 3
    (final,) = [e for e in events if e["event"] == "eval"]
    assert final["num_samples"] == 2 and final["tau"] >= 1


def _batched(target, prompts: list[list[int]], draft, *, new: int) -> list[list[int]]:
    decode = BatchedDecode(
        target, prompts, draft=draft, layer_ids=(0, 1), max_new_tokens=new, eos=frozenset(),
        suppress=(),
    )  # fmt: skip
    while not decode.advance():
        pass
    return [r.tokens for r in decode.results()]


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_both_decoders_equal_hf_greedy_decoding(model_type: str, tmp_path: Path) -> None:
    if config_class(model_type) is None:
        pytest.skip(f"transformers has no {ARCHITECTURES[model_type][0]} ({model_type})")
    target = load_target(save_tiny_target(tmp_path / model_type, model_type), device="cpu")
    new, block = 16, 4
    prompts = [[(37 * i + 11 * j) % 900 + 10 for i in range(n)] for j, n in enumerate((14, 9))]
    greedy = [greedy_generate(target, p, new, None).tokens for p in prompts]
    sequences = [p + g for p, g in zip(prompts, greedy, strict=True)]
    oracles = [OneOracle(i, s, block) for i, s in enumerate(sequences)]
    for i, prompt in enumerate(prompts):
        spec = speculative_decode(
            target, oracles[i], prompt, layer_ids=(0, 1), max_new_tokens=new, eos_token_id=None
        )
        assert spec.tokens == greedy[i], f"reference decoder, prompt {i}"
    if batched_unsupported_reason(target) is None:  # hybrids decode with the reference only
        assert _batched(target, prompts, None, new=new) == greedy
        assert _batched(target, prompts, RowsOracle(oracles), new=new) == greedy
