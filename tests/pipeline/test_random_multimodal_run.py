"""A random-weight Qwen3-VL target (DFLASH_TARGET__WEIGHTS=random) from a config-only folder
written by benchmarks/make_random_target.py (--shape qwen3-vl-tiny: config, tokenizer with the
vision tokens, chat template, image and video processor configs; no weights):

- `run` on generated image+text records draws the whole wrapper, vision tower included, runs it
  packed (`packed_image_text`: the tower once per pack), trains with finite losses and decodes the data's image
  prompts losslessly at the end; on text-only data the same folder trains too (the language
  model alone, no tower);
- the wrapper drawn for image data holds the language model that text data draws, and the
  drafters' redrawn embeddings are the target's (every unit seeded by its text CausalLM name);
  its buffers are those of a normally built wrapper, its tower drawn (nothing left on meta);
- with torchvision installed, AutoProcessor builds Qwen3-VL's own processor from the folder and
  reads an image as the image-only processor does (here the processor is that of the folder's
  files without the video processor, which needs torchvision).
"""

from __future__ import annotations

import math
from pathlib import Path

import anyio
import pytest
import torch
from image_text_kit import MULTIMODAL, folder_qwen3_vl_processor, image, write_image_data
from structlog.testing import capture_logs
from tiny_run import write_pretokenized

from dflash_async.log import get_logger
from dflash_async.pipeline import run as pipeline
from dflash_async.pipeline import startup
from dflash_async.settings.env import load_settings
from dflash_async.targets import multimodal
from dflash_async.targets.loading import text_model
from dflash_async.targets.random_weights import is_meta, load_random_target, random_embeddings

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("single_thread")]
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
RUN_DEADLINE_S = 90
STEPS = 6
CPU = torch.device("cpu")


@pytest.fixture
def folder(tmp_path, monkeypatch) -> Path:
    """The tiny random Qwen3-VL folder, as the benchmark tool writes it."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from make_random_target import write_vl_target

    return write_vl_target(tmp_path, "qwen3-vl-tiny")


def _settings(target: Path, data: Path, out: Path, **env: str):
    tokenizer = folder_qwen3_vl_processor(target).tokenizer
    return load_settings(
        {
            "DFLASH_ENV_FILE": "none",
            "DFLASH_OUTPUT_DIR": str(out),
            "DFLASH_TARGET__PATH": str(target),
            "DFLASH_TARGET__WEIGHTS": "random",
            "DFLASH_TARGET__NUM_FEATURES": "2",
            "DFLASH_TARGET__TARGET_LAYER_IDS": "1,2",
            "DFLASH_DATA__PATH": str(data),
            "DFLASH_DATA__MAX_LEN": "128",
            "DFLASH_DRAFTER__NUM_LAYERS": "1",
            "DFLASH_DRAFTER__MASK_TOKEN_ID": str(tokenizer.mask_token_id),
            "DFLASH_TRAIN__TOKEN_BUDGET": "160",
            "DFLASH_TRAIN__NUM_ANCHORS": "8",
            "DFLASH_TRAIN__BLOCK_SIZE": "8",
            "DFLASH_TRAIN__CE_CHUNK_SIZE": "64",
            "DFLASH_TRAIN__MAX_STEPS": str(STEPS),
            "DFLASH_TRAIN__SAVE_EVERY": "0",
            "DFLASH_PIPELINE__NUM_SLOTS": "2",
            "DFLASH_PIPELINE__TARGET_BATCH_TOKENS": "160",
            "DFLASH_EVAL__EVERY": "0",
            "DFLASH_EVAL__AT_END": "false",
        }
        | env
    )


async def _run(settings) -> list[dict]:
    with capture_logs() as events, anyio.fail_after(RUN_DEADLINE_S):
        assert await pipeline.run(settings, get_logger("test")) == 0
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    assert all(math.isfinite(e["loss"]) and e["loss"] > 0 for e in steps)
    (loaded,) = [e for e in events if e["event"] == "target_weights_loaded"]
    assert loaded["weight_format"] == "random"
    return events


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("evaluate", [False, True])
async def test_run_trains_on_image_text_records_with_a_random_qwen3_vl(
    folder, tmp_path, monkeypatch, evaluate
):
    """Without an evaluation too: the wrapper is drawn whole all the same (its per-document
    forward probes every layer and the lm_head at load)."""
    processor = folder_qwen3_vl_processor(folder)
    for module in (startup, multimodal):  # the read stage's and the evaluation's
        monkeypatch.setattr(module, "load_target_processor", lambda path: processor)
    data = write_image_data(tmp_path / "data", records=12)
    evaluation = {  # at the end, on the data's own image prompts
        "DFLASH_EVAL__AT_END": "true",
        "DFLASH_EVAL__PROMPTS_PATH": str(data),
        "DFLASH_EVAL__NUM_PROMPTS": "2",
        "DFLASH_EVAL__MAX_NEW_TOKENS": "8",
    }
    events = await _run(
        _settings(folder, data, tmp_path / "out", **(evaluation if evaluate else {}))
    )
    (loaded,) = [e for e in events if e["event"] == "data_loaded"]
    assert loaded["images"] == 12
    (drawn,) = [e for e in events if e["event"] == "target_weights_loaded"]
    assert drawn["layers_on_meta"] == 0 and not drawn["lm_head_on_meta"]
    chosen = [e for e in events if e["event"] == "target_path_chosen"]
    assert chosen and all(e["target_path"] == "packed_image_text" for e in chosen)
    assert not [e for e in events if e["event"] == "eval_failed"]  # every sample lossless
    evaluated = [e for e in events if e["event"] == "eval"]
    assert len(evaluated) == evaluate
    assert all(e["num_samples"] == 2 and e["lossless_checked"] for e in evaluated)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_run_trains_on_text_data_with_the_same_random_qwen3_vl(folder, tmp_path):
    vocab = folder_qwen3_vl_processor(folder).tokenizer.mask_token_id  # ids below the specials
    data = write_pretokenized(tmp_path / "text.jsonl", records=12, vocab=vocab)
    events = await _run(_settings(folder, data, tmp_path / "out"))
    chosen = [e for e in events if e["event"] == "target_path_chosen"]
    assert chosen and all(e["target_path"] == "packed_dense" for e in chosen)


def _language_model(model) -> dict[str, torch.Tensor]:
    decoder = text_model(model)
    return {k: v for k, v in decoder.state_dict().items() if not v.is_meta}


@pytest.mark.parametrize("model_type", ["qwen3_vl", "qwen3_5"])
def test_the_wrapper_drawn_for_images_holds_the_language_model_text_data_draws(
    model_type, tmp_path
):
    """Qwen3.5 has a text CausalLM class (text data draws that class, image data the wrapper:
    equal only because units are seeded by their text names); Qwen3-VL draws its wrapper both
    ways, without the tower for text. The drafters' redrawn embeddings are the target's."""
    entry = MULTIMODAL[model_type]
    entry.config(entry.processor()).save_pretrained(tmp_path)
    options = dict(device=CPU, dtype=torch.float32, seed=3, decode=True)
    whole, _, _ = load_random_target(tmp_path, images=True, **options)
    text, _, _ = load_random_target(tmp_path, **options)
    from transformers import AutoModelForImageTextToText

    built = dict(AutoModelForImageTextToText.from_config(whole.config).named_buffers())
    for name, buffer in whole.named_buffers():  # rotary inv_freq, the tower's included
        assert torch.equal(buffer, built[name]), name
    tower = whole.model.visual
    assert not is_meta(tower) and all(p.float().std() > 0 for p in tower.parameters() if p.ndim > 1)
    assert getattr(getattr(text, "model", text), "visual", None) is None
    drawn, expected = _language_model(whole), _language_model(text)
    assert drawn.keys() == expected.keys() and drawn
    for name, tensor in expected.items():
        torch.testing.assert_close(drawn[name], tensor, rtol=0, atol=0, msg=name)
    embed, head = random_embeddings(tmp_path, seed=3, device=CPU, dtype=torch.float32)
    assert torch.equal(embed, whole.get_input_embeddings().weight)
    assert torch.equal(head, whole.get_output_embeddings().weight)


def test_auto_processor_builds_qwen3_vl_processor_from_the_folder(folder):
    pytest.importorskip("torchvision")  # Qwen3-VL's video processor needs it
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    assert type(processor).__name__ == "Qwen3VLProcessor"
    picture = image(0, (64, 64))  # within the folder's bounds, sides of 32: never resized
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    text = processor.apply_chat_template(messages, tokenize=False)
    got = processor(text=[text], images=[picture], return_tensors="pt")
    want = folder_qwen3_vl_processor(folder)(text=[text], images=[picture], return_tensors="pt")
    assert torch.equal(got["input_ids"], want["input_ids"])
    assert torch.equal(got["image_grid_thw"], want["image_grid_thw"])
    # no resize on either side: the same 8-bit values rescaled and normalised to [-1, 1] in
    # fp32, maybe in another order: a few fp32 roundings of values <= 1 (~1e-7 each) apart
    torch.testing.assert_close(got["pixel_values"], want["pixel_values"], rtol=0, atol=1e-5)
