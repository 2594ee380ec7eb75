"""Every supported target architecture trains and decodes losslessly on the CPU.

One tiny random target per model_type (tests/arch_targets.py: 2 layers, hidden 64, the built-in
tiny tokenizer), each run in-process for 10 steps with the tiny settings of tiny_run.py and
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

from dflash_async.eval.batched_decoding import BatchedDecode, batched_unsupported_reason
from dflash_async.eval.speculative import greedy_generate, speculative_decode
from dflash_async.log import get_logger
from dflash_async.pipeline import run as pipeline
from dflash_async.settings.env import load_settings
from dflash_async.targets.loading import load_target
from dflash_async.targets.tiny import tiny_tokenizer

# slow: 50 cases, about 50 s in all on two CPU cores (each a few seconds or less)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
    pytest.mark.usefixtures("single_thread"),
]
RUN_DEADLINE_S = 60
ARCH_STEPS = 10  # the training steps of arch_env's run


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
    """tiny_env's run for `target` (mask token unset), ARCH_STEPS steps, one evaluation at the
    end."""
    env = tiny_env({"target": str(target), "data": shared["data"], "mask": ""}, output_dir)
    del env["DFLASH_DRAFTER__MASK_TOKEN_ID"]
    return env | {
        "DFLASH_TARGET__NUM_FEATURES": "2",
        "DFLASH_TARGET__TARGET_LAYER_IDS": "0,1",
        "DFLASH_TRAIN__MAX_STEPS": str(ARCH_STEPS),
        "DFLASH_TRAIN__SAVE_EVERY": "0",
        "DFLASH_EVAL__PROMPTS_PATH": shared["prompts"],
        "DFLASH_EVAL__NUM_PROMPTS": "2",
        "DFLASH_EVAL__MAX_NEW_TOKENS": "12",
        "DFLASH_EVAL__AT_END": "true",
        # On the CPU also where CUDA exists: with `auto` devices a GPU machine ran these on its
        # GPU (compile, CUDA graphs), which this test does not claim to check; the GPU paths of
        # the families have their own GPU tests (test_target_packed_*.py, test_target_hybrid*).
        "DFLASH_PIPELINE__DEVICES": "cpu",
    }


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
    assert len([e for e in events if e["event"] == "step"]) == ARCH_STEPS
    (final,) = [e for e in events if e["event"] == "eval"]
    assert final["num_samples"] == 2 and final["tau"] >= 1


def _batched(target, prompts: list[list[int]], draft, *, new: int) -> list[list[int]]:
    decode = BatchedDecode(
        target,
        prompts,
        draft=draft,
        layer_ids=(0, 1),
        max_new_tokens=new,
        eos=frozenset(),
        suppress=(),
    )
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


def _tokenizer_with(*, mask: bool, specials: tuple[str, ...] = ()):
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    from dflash_async.targets.tiny import build_tiny_tokenizer

    backend = build_tiny_tokenizer()
    backend.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        mask_token="<|mask|>" if mask else None,
    )
    tokenizer.chat_template = "{{ '<|im_start|>' }}{{ messages[0]['content'] }}{{ '<|im_end|>' }}"
    return tokenizer


def test_the_mask_token_comes_from_the_targets_tokenizer() -> None:
    """The tokenizer's mask_token; else the first embedding row past the tokenizer (Qwen3's
    151669); else the last added special token the chat template never writes."""
    from dflash_async.targets.mask_token import mask_token

    with_mask = _tokenizer_with(mask=True)
    assert mask_token(with_mask, vocab_size=len(with_mask)).token == "<|mask|>"
    plain = _tokenizer_with(mask=False, specials=("<|reserved_0|>", "<|reserved_1|>"))
    assert mask_token(plain, vocab_size=len(plain) + 64).id == len(plain)
    found = mask_token(plain, vocab_size=len(plain))
    assert found is not None and found.token == "<|reserved_1|>"
    assert found.id == plain.convert_tokens_to_ids("<|reserved_1|>")


def test_a_mask_token_outside_the_vocabulary_or_a_target_that_cannot_work_is_exit_2(
    tmp_path: Path,
) -> None:
    """Both refused at start-up with SettingsError (exit 2), naming what to change."""
    from dflash_async.errors import SettingsError
    from dflash_async.model.drafter_config import DrafterSpec
    from dflash_async.pipeline.startup import drafter_config_for

    folder = save_tiny_target(tmp_path / "llama", "llama")
    spec = DrafterSpec(
        num_layers=1, num_features=2, block_size=8, target_layer_ids=(0, 1), mask_token_id=None
    )
    assert (
        drafter_config_for(spec, str(folder), False).mask_token_id == tiny_tokenizer().mask_token_id
    )
    with pytest.raises(SettingsError, match="MASK_TOKEN_ID"):
        drafter_config_for(
            spec.__class__(**{**spec.__dict__, "mask_token_id": 151669}), str(folder), False
        )
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "t5"}))
    with pytest.raises(SettingsError, match=r"'t5' is an encoder-decoder"):
        drafter_config_for(spec, str(folder), False)
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "brand_new_lm"}))
    with pytest.raises(SettingsError, match=r"'brand_new_lm' is not known to the installed"):
        drafter_config_for(spec, str(folder), False)
