"""benchmarks/multimodal_pipeline.py's data: image+text records and text-only records of exactly
the token lengths and supervised counts the image records take once the target's processor
expands their images (the tiny random Qwen3-VL folder: 64-pixel images, 4 tokens each)."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

from image_text_kit import folder_qwen3_vl_processor

from dflash_async.data.images import read_image_samples

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_text_records_take_the_lengths_of_the_image_records(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from make_random_target import write_vl_target

    target = write_vl_target(tmp_path, "qwen3-vl-tiny")
    script = runpy.run_path(str(BENCHMARKS / "multimodal_pipeline.py"))
    made = script["write_data"](tmp_path / "data", target=target, records=6, side=64)
    processor = folder_qwen3_vl_processor(target)
    samples, counts = read_image_samples(
        made["images"], processor, keep_vision=False, max_len=4096, block_size=8
    )
    assert counts["images"] == len(samples) == 6
    text = [json.loads(line) for line in Path(made["text"]).read_text().splitlines()]
    assert [len(s) for s in samples] == [len(t["input_ids"]) for t in text]
    assert [int(s.loss_mask.sum()) for s in samples] == [sum(t["loss_mask"]) for t in text]
    assert made["tokens"] == sum(len(s) for s in samples) and made["image_tokens"] == 4
    vocab = len(processor.tokenizer)
    assert all(0 <= i < vocab for t in text for i in t["input_ids"])
