"""`run` on image+text data (CPU): a tiny multimodal target saved as a checkpoint folder, records
of generated PNGs and answers; the read stage takes them through the target's processor (here
the in-memory one of image_text_kit.py: AutoProcessor of Qwen3-VL needs torchvision for its
video processor, absent here), the target loads whole and runs packed (`packed_image_text`, the
Qwen3-VL wrappers) or per document (`hf_multimodal`, the others),
ten steps train with finite losses, and the evaluation at the end decodes the data's image
prompts losslessly. Data with images for a target without a vision tower,
or with a setting the image path does not cover, is refused before any model loads.
"""

from __future__ import annotations

import math
from pathlib import Path

import anyio
import pytest
from image_text_kit import MULTIMODAL, tiny_multimodal, write_image_data
from structlog.testing import capture_logs

from dflash_async.errors import SettingsError
from dflash_async.log import get_logger
from dflash_async.pipeline import run as pipeline
from dflash_async.pipeline import startup
from dflash_async.pipeline.specs import run_spec
from dflash_async.settings.env import load_settings
from dflash_async.targets import multimodal
from dflash_async.targets.multimodal import PACKED_WRAPPERS

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("single_thread")]
RUN_DEADLINE_S = 90
STEPS = 10


def _target(folder: Path, model_type: str):
    """(checkpoint folder, processor, a mask token id no record uses)."""
    processor, model = tiny_multimodal(model_type)
    model.save_pretrained(folder)
    processor.tokenizer.save_pretrained(folder)
    mask = len(processor.tokenizer) - 1  # a special token of the kit's that no record renders
    return folder, processor, mask


def _settings(target: Path, data: Path, out: Path, mask: int, **env: str):
    return load_settings(
        {
            "DFLASH_ENV_FILE": "none",
            "DFLASH_OUTPUT_DIR": str(out),
            "DFLASH_TARGET__PATH": str(target),
            "DFLASH_TARGET__NUM_FEATURES": "2",
            "DFLASH_TARGET__TARGET_LAYER_IDS": "1,2",
            "DFLASH_DATA__PATH": str(data),
            "DFLASH_DATA__MAX_LEN": "128",
            "DFLASH_DRAFTER__NUM_LAYERS": "1",
            "DFLASH_DRAFTER__MASK_TOKEN_ID": str(mask),
            "DFLASH_TRAIN__TOKEN_BUDGET": "160",
            "DFLASH_TRAIN__NUM_ANCHORS": "8",
            "DFLASH_TRAIN__BLOCK_SIZE": "8",
            "DFLASH_TRAIN__CE_CHUNK_SIZE": "64",
            "DFLASH_TRAIN__MAX_STEPS": str(STEPS),
            "DFLASH_TRAIN__SAVE_EVERY": "0",
            "DFLASH_PIPELINE__NUM_SLOTS": "2",
            "DFLASH_PIPELINE__TARGET_BATCH_TOKENS": "160",
        }
        | env
    )


@pytest.mark.anyio
@pytest.mark.parametrize("model_type", sorted(MULTIMODAL))
async def test_run_trains_ten_steps_on_image_text_records(model_type, tmp_path, monkeypatch):
    target, processor, mask = _target(tmp_path / "target", model_type)
    data = write_image_data(tmp_path / "data", records=12)
    for module in (startup, multimodal):  # the read stage's and the evaluation's
        monkeypatch.setattr(module, "load_target_processor", lambda path: processor)
    evaluation = {  # at the end, on the data's own image prompts (answers dropped)
        "DFLASH_EVAL__PROMPTS_PATH": str(data),
        "DFLASH_EVAL__NUM_PROMPTS": "3",
        "DFLASH_EVAL__MAX_NEW_TOKENS": "8",
    }
    settings = _settings(target, data, tmp_path / "out", mask, **evaluation)
    with capture_logs() as events, anyio.fail_after(RUN_DEADLINE_S):
        assert await pipeline.run(settings, get_logger("test")) == 0
    (loaded,) = [e for e in events if e["event"] == "data_loaded"]
    assert loaded["images"] == 12 and loaded["samples"] == 12
    chosen = [e for e in events if e["event"] == "target_path_chosen"]
    # Qwen3.5's packed forward runs over its language model's packed hybrid one, which needs
    # CUDA (fla): on the CPU it runs per document
    packed = model_type in PACKED_WRAPPERS and not model_type.startswith("qwen3_5")
    path = "packed_image_text" if packed else "hf_multimodal"
    assert chosen and all(e["target_path"] == path for e in chosen)
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    assert all(math.isfinite(e["loss"]) and e["loss"] > 0 for e in steps)
    assert not [e for e in events if e["event"] == "eval_failed"]  # every sample lossless
    (evaluated,) = [e for e in events if e["event"] == "eval"]
    assert evaluated["num_samples"] == 3 and evaluated["lossless_checked"]
    assert evaluated["decoder"] == "reference" and evaluated["tau"] >= 1


def test_image_records_for_a_text_target_are_refused_before_any_model_loads(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=32,
    )
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "target")
    data = write_image_data(tmp_path / "data", records=2)
    spec = run_spec(_settings(tmp_path / "target", data, tmp_path / "out", 1))
    inputs = startup.RunInputs(str(tmp_path / "target"), str(data), False, None)
    with pytest.raises(SettingsError, match=r"holds image records: .*has no vision tower"):
        startup.read_samples(spec, inputs, get_logger("test"))


@pytest.mark.parametrize(
    ("env", "name"),
    [({"DFLASH_TARGET__QUANTIZE": "fp8"}, "DFLASH_TARGET__QUANTIZE")],
)
def test_settings_the_image_path_does_not_cover_are_refused(tmp_path, env, name):
    target, _, mask = _target(tmp_path / "target", sorted(MULTIMODAL)[0])
    data = write_image_data(tmp_path / "data", records=2)
    spec = run_spec(_settings(target, data, tmp_path / "out", mask, **env))
    inputs = startup.RunInputs(str(target), str(data), False, None)
    with pytest.raises(SettingsError, match=f"{name} is not supported with image data"):
        startup.read_samples(spec, inputs, get_logger("test"))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_image_prompts_in_a_run_on_text_data_are_refused_before_training(tmp_path):
    """A run on text data holds the wrapper's language model alone: image prompts for its
    evaluation are refused at start-up (exit 2, one line), before any step."""
    from tiny_run import write_pretokenized

    target, _, mask = _target(tmp_path / "target", "qwen3_vl")
    text = write_pretokenized(tmp_path / "text.jsonl", records=12, vocab=mask)
    prompts = write_image_data(tmp_path / "prompts", records=2)
    env = {"DFLASH_EVAL__PROMPTS_PATH": str(prompts), "DFLASH_EVAL__AT_START": "true"}
    settings = _settings(target, text, tmp_path / "out", mask, **env)
    with capture_logs() as events, pytest.raises(SettingsError) as refused:
        with anyio.fail_after(RUN_DEADLINE_S):
            await pipeline.run(settings, get_logger("test"))
    assert "holds image prompts" in str(refused.value) and "\n" not in str(refused.value)
    assert "without its vision tower" in str(refused.value)
    assert not [e for e in events if e["event"] == "step"]
