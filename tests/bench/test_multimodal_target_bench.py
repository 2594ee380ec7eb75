"""benchmarks/multimodal_target.py runs (tiny shape, CPU): for each path (packed, per document) an
image+text row and a text-only row over the same tokens, the image row counting one image of 4
tokens per document that fits one."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "multimodal_target.py"

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def test_the_multimodal_target_benchmark_prints_both_cases_of_both_paths():
    main = runpy.run_path(str(SCRIPT))["main"]
    args = ["--shape", "tiny", "--device", "cpu", "--token-budget", "2048"]
    rows = main([*args, "--image-side", "64", "--repeats", "1"])
    assert [(r["path"], r["case"]) for r in rows] == [
        ("packed_image_text", "image+text"),
        ("packed_image_text", "text-only"),
        ("hf_multimodal", "image+text"),
        ("hf_multimodal", "text-only"),
    ]
    for images, text in (rows[:2], rows[2:]):
        assert images["tokens"] == text["tokens"] == 2048
        assert images["images"] == images["documents"] and text["images"] == 0
        assert images["image_tokens"] == 4 * images["images"]  # 64 px: 4x4 patches, merged 2x2
        assert images["tokens_per_s"] > 0 and text["tokens_per_s"] > 0
        assert images["pixel_inputs_s"] > 0 and "pixel_inputs_s" not in text
