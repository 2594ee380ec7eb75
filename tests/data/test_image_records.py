"""Image+text records (data/images.py): every image reference form reads the same sample; image
placeholders expand to the processor's image tokens; the loss covers the assistant's text alone,
never an image token; a missing or unreadable image names its file and line. Images are
generated (tiny random PNGs), the processor built in memory (image_text_kit.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from image_text_kit import (
    ANSWERS,
    MULTIMODAL,
    data_url,
    image,
    image_record,
    png_bytes,
    write_image_data,
)

from dflash_async.data import images as image_data
from dflash_async.data.formats import DataError
from dflash_async.data.images import ImageTextSamples, has_images, read_image_samples

BLOCK = 2
ANSWER_TURN = {"role": "assistant", "content": ANSWERS[0]}


@pytest.fixture(scope="module", params=sorted(MULTIMODAL))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def processor(family):
    return MULTIMODAL[family].processor()


def _read(path: Path, processor, **kw):
    return read_image_samples(str(path), processor, max_len=512, block_size=BLOCK, **kw)


def check_sample(sample, processor, answer: str) -> None:
    """What every image+text sample guarantees: no image token is supervised; the supervised
    tokens are the assistant's answer and its end of turn, nothing else."""
    ids, mask = sample.input_ids, sample.loss_mask
    assert len(ids) == len(mask)
    image_tokens = sample.image_tokens()
    assert image_tokens.sum() > 0 or sample.num_images == 0
    assert not mask[image_tokens].any(), "an image token is supervised"
    supervised = processor.tokenizer.decode(ids[mask])
    assert supervised == answer + processor.tokenizer.eos_token, supervised


def test_image_placeholders_expand_and_only_the_answer_is_supervised(family, processor, tmp_path):
    sizes = ((48, 64), (64, 32), (32, 32))
    path = write_image_data(tmp_path, records=3, sizes=sizes)
    samples, counts = _read(path, processor)
    assert counts["records"] == 3 and counts["images"] == 3 and len(samples) == 3
    for i, sample in enumerate(samples):
        check_sample(sample, processor, ANSWERS[i])
        # the image's tokens: as many as the family makes of its size, contiguous, each the
        # processor's image token
        rows = np.flatnonzero(sample.image_tokens())
        assert len(rows) == MULTIMODAL[family].image_tokens(sizes[i])
        assert np.array_equal(rows, np.arange(rows[0], rows[0] + len(rows)))
        [image_token] = processor.image_token_ids
        assert (sample.input_ids[rows] == image_token).all()
        assert (sample.input_ids == image_token).sum() == len(rows)
        if MULTIMODAL[family].mrope:  # the merged patch grid: t * h * w / merge^2 tokens
            grid = sample.vision["image_grid_thw"]
            merge = processor.image_processor.merge_size
            assert grid.shape == (1, 3) and len(rows) == int(grid.prod()) // merge**2
            assert sample.vision["pixel_values"].shape[0] == int(grid.prod())


def test_every_image_reference_form_reads_the_same_sample(processor, tmp_path):
    picture = image(7, (64, 48))
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(png_bytes(picture))
    absolute = str(tmp_path / "pics" / "a.png")
    forms = {
        "relative": image_record(0, "pics/a.png"),
        "absolute": image_record(0, absolute),
        "file_url": image_record(0, "file://" + absolute),
        "data_url": image_record(0, data_url(picture)),
        "image_part": {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": "pics/a.png"},
                        {"type": "text", "text": "What is two plus two?"},
                    ],
                },
                {"role": "assistant", "content": ANSWERS[0]},
            ]
        },
        "sharegpt": {
            "conversations": [
                {"from": "human", "value": "<image>" + "What is two plus two?"},
                {"from": "gpt", "value": ANSWERS[0]},
            ],
            "image": "pics/a.png",
        },
    }
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in forms.values()) + "\n")
    samples, _ = _read(tmp_path / "data.jsonl", processor)
    assert len(samples) == len(forms)
    first = samples[0]
    check_sample(first, processor, ANSWERS[0])
    for name, sample in zip(forms, samples, strict=True):
        assert np.array_equal(sample.input_ids, first.input_ids), name
        assert np.array_equal(sample.loss_mask, first.loss_mask), name
        assert sample.vision.keys() == first.vision.keys(), name
        for key, value in first.vision.items():
            assert torch.equal(sample.vision[key], value), (name, key)
    assert all(has_images(r) for r in forms.values())
    assert not has_images({"messages": [{"role": "user", "content": "hi"}]})


def test_two_images_in_one_turn_keep_their_order(processor, tmp_path):
    """The pixel inputs of a two-image sample are those of each image alone, in order."""
    record = image_record(1, "a.png", images=2)
    record["messages"][0]["content"][1]["image_url"]["url"] = "b.png"
    image(1, (32, 32)).save(tmp_path / "a.png")
    image(2, (64, 32)).save(tmp_path / "b.png")
    lines = [record, image_record(1, "a.png"), image_record(1, "b.png")]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    (both, first, second), _ = _read(tmp_path / "d.jsonl", processor)
    check_sample(both, processor, ANSWERS[1])
    assert both.num_images == 2
    assert both.image_tokens().sum() == first.image_tokens().sum() + second.image_tokens().sum()
    for name, value in both.vision.items():
        if name != "mm_token_type_ids" and not name.endswith("token_type_ids"):
            assert torch.equal(value, torch.cat([first.vision[name], second.vision[name]])), name


@pytest.mark.parametrize(
    ("damage", "why"),
    [("missing", "does not exist"), ("unreadable", "not a readable image")],
)
def test_a_bad_image_is_a_data_error_naming_file_and_line(processor, tmp_path, damage, why):
    path = write_image_data(tmp_path, records=3)
    if damage == "missing":
        (tmp_path / "images" / "1.png").unlink()
    else:
        (tmp_path / "images" / "1.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match=rf"data\.jsonl:2: .*{why}"):
        _read(path, processor)
    samples, counts = _read(path, processor, on_bad_record="skip")
    assert len(samples) == 2 and counts["bad_record"] == 1


def test_a_sharegpt_record_with_too_few_images_is_bad(processor, tmp_path):
    record = {
        "conversations": [
            {"from": "human", "value": "<image><image>What is two plus two?"},
            {"from": "gpt", "value": ANSWERS[0]},
        ],
        "images": ["a.png"],
    }
    image(0).save(tmp_path / "a.png")
    (tmp_path / "d.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl:1: 2 <image> placeholders but 1 images"):
        _read(tmp_path / "d.jsonl", processor)


def test_a_long_sample_is_dropped_whole(processor, tmp_path):
    path = write_image_data(tmp_path, records=3)
    lengths = [len(s) for s in _read(path, processor)[0]]
    limit = sorted(lengths)[1]
    samples, counts = read_image_samples(str(path), processor, max_len=limit, block_size=BLOCK)
    kept = [n for n in lengths if n <= limit]
    assert counts["too_long_dropped"] == 3 - len(kept) > 0
    assert [len(s) for s in samples] == kept


def test_loss_on_image_tokens_is_caught(processor, tmp_path, monkeypatch):
    """The mutant: image expansions supervised (the mask of the expanded text marks them)."""

    def supervised_expansions(char_mask, replacements):
        pieces, at = [], 0
        for item in replacements:
            (start, end), (lo, hi) = item["span"], item["new_span"]
            pieces += [char_mask[at:start], np.ones(hi - lo, dtype=bool)]
            at = end
        return np.concatenate([*pieces, char_mask[at:]])

    path = write_image_data(tmp_path, records=1)
    monkeypatch.setattr(image_data, "_expanded_mask", supervised_expansions)
    [sample], _ = _read(path, processor)
    with pytest.raises(AssertionError, match="an image token is supervised"):
        check_sample(sample, processor, ANSWERS[0])


def test_image_data_is_told_from_text_data_by_the_first_records_of_its_files(tmp_path):
    """data_has_images: a file whose first records hold images makes image data; a text file
    whose image record comes after the scanned ones stays text, and the text reader names the
    image (DataError, file and line)."""
    from fixtures.chat_tokenizer import qwen3_like_tokenizer
    from structlog import get_logger

    from dflash_async.data.images import SCANNED_RECORDS, data_has_images
    from dflash_async.data.samples import DataOptions, load_samples

    images = write_image_data(tmp_path / "images", records=2)
    assert data_has_images(str(images))
    text = {"messages": [{"role": "user", "content": "an image?"}, ANSWER_TURN]}
    lines = [json.dumps(text)] * SCANNED_RECORDS + [json.dumps(image_record(0, "x.png"))]
    late = tmp_path / "late.jsonl"
    late.write_text("\n".join(lines) + "\n")
    assert not data_has_images(str(late))
    assert data_has_images(str(tmp_path))  # a folder: one file of images is enough
    with pytest.raises(DataError, match=rf"late\.jsonl:{SCANNED_RECORDS + 1}: .*holds an image"):
        load_samples(
            str(late),
            qwen3_like_tokenizer(),
            options=DataOptions(max_len=512),
            block_size=BLOCK,
            log=get_logger("test"),
        )


def test_vision_inputs_computed_again_equal_the_read_ones(family, processor, tmp_path):
    """ImageTextSamples with a processor keeps renderings and image sources, not pixels: its
    vision inputs, computed again, equal those read; an image that changed size on disk since,
    where that changes its tokens (not for Gemma 3, which resizes every image alike), is
    refused."""
    path = write_image_data(tmp_path, records=3)
    listed, _ = _read(path, processor)
    samples = ImageTextSamples.of(listed, processor=processor)
    assert samples.vision == () and len(samples.texts) == 3
    for i, sample in enumerate(listed):
        again = samples.model_inputs(i, torch.device("cpu"), torch.float32)
        held = sample.model_inputs(torch.device("cpu"), torch.float32)
        assert again.keys() == held.keys()
        for key, value in held.items():
            assert torch.equal(again[key], value), key
    image(0, (32, 32)).save(tmp_path / "images" / "0.png")
    tokens = MULTIMODAL[family].image_tokens
    if tokens((32, 32)) != tokens((48, 64)):  # write_image_data's first size
        with pytest.raises(ValueError, match="no longer give the tokens"):
            samples.model_inputs(0, torch.device("cpu"), torch.float32)
