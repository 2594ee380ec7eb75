"""The packed image+text forwards (targets/packed/image_text.py, image_text_gemma3.py) equal the
wrapper's HF forward run on each document alone (targets/multimodal.py's MultimodalForward,
itself checked against HF's `output_hidden_states` in test_multimodal_target.py), row for row,
for every wrapper that has one (Qwen3-VL over a dense and over an MoE language model, Qwen3.5
and Qwen3.5-MoE over their hybrids, Gemma 3); `multimodal_path` chooses them and the per-document forward for the
others, saying why. Qwen3.5's hybrid forward takes fla's kernels, which need CUDA: on the CPU it
runs with the plain torch kernels of test_target_hybrid.py (`REFERENCE`), as its text tests do.

The pack: four documents (one image 96 high and 32 wide; two images; no image; the first's
tokens with an image 32 high and 96 wide, so the same ids under other 3-D positions on
Qwen3-VL and Qwen3.5) and padding rows. Taps: layers 0 and 2 of 4; Qwen3-VL's tiny tower's deepstack
feature is added to layer 0's output, so layer 0's columns show whether it is added before the
capture and layer 2's whether it reaches the layers after. Gemma 3's images are 4 tokens each,
inside its window of 8, and its rows of an image see the whole image (`image_block_ends`).

Tolerance 1e-5 in fp32, as for the packed text paths (test_target_packed.py): both sides run
the same modules on the same rows and differ only in summation order (SDPA in query chunks
against HF's attention per document, the tower over all images at once against per image):
measured 4.8e-8 on Qwen3-VL's features of magnitude ~0.1, 3.7e-8 on Qwen3.5's and
Qwen3.5-MoE's (the reference kernels' recurrence against HF's chunked delta rule) and 3.6e-6 on
Gemma 3's of up to 8.2 (fp32's relative rounding, ~1e-7, times that magnitude and a few
layers). The mutants, each a real way to get this wrong, move the features by far more,
MUTANT_GAP = 1e-3 (each measured gap is in its test's comment).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from image_text_kit import MULTIMODAL, image, image_record, tiny_multimodal
from test_target_hybrid import REFERENCE

from dflash_async.data.images import read_image_samples
from dflash_async.data.packing import layout_pack
from dflash_async.targets import multimodal
from dflash_async.targets.loading import text_model
from dflash_async.targets.multimodal import PACKED_WRAPPERS, multimodal_path
from dflash_async.targets.packed import image_text_gemma3
from dflash_async.targets.packed.dense import (
    KeySpans,
    document_causal_block_mask,
    document_mask_up_to,
    first_visible_key,
)
from dflash_async.targets.packed.hybrid import PackedHybridForward
from dflash_async.targets.packed.image_text import PackedImageTextForward
from dflash_async.targets.packed.image_text_gemma3 import (
    PackedGemma3ImageTextForward,
    image_block_ends,
)
from dflash_async.targets.paths import TargetPath

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

LAYERS = (0, 2)
ATOL = 1e-5  # see the module docstring
MUTANT_GAP = 1e-3
PAD = 7
CPU = torch.device("cpu")
MROPE = sorted(k for k, forward in PACKED_WRAPPERS.items() if forward is PackedImageTextForward)
DEEPSTACK = ["qwen3_vl", "qwen3_vl_moe"]  # Qwen3.5's tower has none
HYBRIDS = ["qwen3_5", "qwen3_5_moe"]  # their language model's packed forward needs CUDA (fla)


@pytest.fixture(scope="module", params=sorted(PACKED_WRAPPERS))
def target(request):
    return tiny_multimodal(request.param)


@pytest.fixture(scope="module", params=MROPE)
def mrope_target(request):
    return tiny_multimodal(request.param)


@pytest.fixture(scope="module", params=DEEPSTACK)
def deepstack_target(request):
    return tiny_multimodal(request.param)


@pytest.fixture(scope="module")
def gemma3():
    return tiny_multimodal("gemma3")


def _samples(folder: Path, processor, *, text_only: bool = False):
    """The four documents of the module doc (or the text document alone)."""
    for i, size in enumerate(((96, 32), (32, 32), (48, 64), (32, 96))):
        image(i, size).save(folder / f"{i}.png")
    two = image_record(1, "1.png", images=2)
    two["messages"][0]["content"][1]["image_url"]["url"] = "2.png"
    text = {
        "messages": [
            {"role": "user", "content": "Hello there!"},
            {"role": "assistant", "content": "I am fine, thank you. The sum is 42."},
        ]
    }
    records = (
        [text] if text_only else [image_record(0, "0.png"), two, text, image_record(0, "3.png")]
    )
    (folder / "d.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    samples, _ = read_image_samples(str(folder / "d.jsonl"), processor, max_len=512, block_size=2)
    return samples


def _features(model, samples, *, packed: bool) -> torch.Tensor:
    """The pack's features [T, k*d] by the path `multimodal_path` gives (padding rows included)."""
    lengths = [len(s) for s in samples]
    budget = sum(lengths) + PAD
    pack = layout_pack([(s.input_ids, s.loss_mask) for s in samples], budget)
    width = len(LAYERS) * model.config.get_text_config().hidden_size
    features = torch.full((budget, width), float("nan"))
    path = _path(model, budget, packed=packed)
    assert path.name == ("packed_image_text" if packed else "hf_multimodal")
    vision = [s.model_inputs(CPU, torch.float32) for s in samples]
    try:
        path.forward(pack.input_ids, pack.position_ids, pack.doc_ids, features, lengths, vision)
    finally:
        path.forward.close()
    return features


def _path(model, budget: int, *, packed: bool):
    """`multimodal_path`'s choice; Qwen3.5's packed one built with the CPU reference kernels."""
    if packed and model.config.model_type in HYBRIDS:
        text = PackedHybridForward(
            text_model(model),
            LAYERS,
            kernels=REFERENCE,
            mrope=True,
            attention="sdpa",
            compile=False,
        )
        return TargetPath(PackedImageTextForward(model, text), "packed_image_text", "reference")
    return multimodal_path(model, LAYERS, token_budget=budget, packed=packed)


def _gap(model, samples) -> float:
    """The largest feature difference between the packed path and the per-document one."""
    reference = _features(model, samples, packed=False)
    return float((_features(model, samples, packed=True) - reference).abs().max())


def test_packed_image_text_features_equal_each_document_alone(target, tmp_path):
    processor, model = target
    samples = _samples(tmp_path, processor)
    assert [s.num_images for s in samples] == [1, 2, 0, 1]
    reference = _features(model, samples, packed=False)
    features = _features(model, samples, packed=True)
    torch.testing.assert_close(features, reference, atol=ATOL, rtol=0)
    n = sum(len(s) for s in samples)
    assert torch.equal(features[n:], torch.zeros_like(features[n:]))  # padding rows


def test_a_pack_of_text_documents_runs_the_language_models_packed_forward(target, tmp_path):
    processor, model = target
    samples = _samples(tmp_path, processor, text_only=True)
    assert _gap(model, samples) <= ATOL


def test_dropped_image_features_are_caught(mrope_target, tmp_path, monkeypatch):
    """The placeholders keep their token embeddings (measured gaps 0.089-0.097)."""
    processor, model = mrope_target
    images = PackedImageTextForward._images

    def dropped(self, inputs):
        merged, deepstack = images(self, inputs)
        return torch.zeros_like(merged), deepstack

    monkeypatch.setattr(PackedImageTextForward, "_images", dropped)
    assert _gap(model, _samples(tmp_path, processor)) > MUTANT_GAP


@pytest.mark.parametrize("fault", ["dropped", "one_layer_late"])
def test_deepstack_faults_are_caught(deepstack_target, tmp_path, monkeypatch, fault):
    """The tower's deepstack features left out, or added to the layer after the one that
    takes them (measured gaps 0.093-0.095 and 0.083: layer 0's columns lack them either way)."""
    processor, model = deepstack_target
    images = PackedImageTextForward._images

    def mutant(self, inputs):
        merged, deepstack = images(self, inputs)
        if fault == "dropped":
            return merged, []
        return merged, [torch.zeros_like(deepstack[0]), *deepstack]

    monkeypatch.setattr(PackedImageTextForward, "_images", mutant)
    assert _gap(model, _samples(tmp_path, processor)) > MUTANT_GAP


@pytest.mark.parametrize("fault", ["another_documents", "text_stream"])
def test_position_faults_are_caught(mrope_target, tmp_path, monkeypatch, fault):
    """Documents 0 and 3 (the same tokens, their images transposed) given each other's 3-D
    positions; or every image document given 1-D positions on all three axes, the drafter's
    stream (measured gaps 1.7e-3-5.2e-3 and 4.2e-3-1.7e-2 over the three wrappers)."""
    processor, model = mrope_target
    samples = _samples(tmp_path, processor)
    own = PackedImageTextForward._document_positions
    swapped = [samples[i].model_inputs(CPU, torch.float32) for i in (3, 0)]  # 0 takes 3's, ...
    grids = [v["image_grid_thw"] for v in reversed(swapped)]  # ... found by its own grid
    ids = torch.as_tensor(samples[0].input_ids)
    wrapper = SimpleNamespace(model=model)
    assert not torch.equal(own(wrapper, ids, swapped[0]), own(wrapper, ids, swapped[1]))

    def mutant(self, ids, inputs):
        if fault == "text_stream":
            return torch.arange(len(ids)).expand(3, -1)
        for grid, other in zip(grids, swapped, strict=True):
            if torch.equal(inputs["image_grid_thw"], grid):
                return own(self, ids, other)
        return own(self, ids, inputs)

    monkeypatch.setattr(PackedImageTextForward, "_document_positions", mutant)
    assert _gap(model, samples) > MUTANT_GAP


def _hf_visible(doc_ids, token_type_ids, window=None) -> torch.Tensor:
    """[T, T] bool, Gemma 3's rule as HF writes it for one document, applied per document of a
    pack: same document, and (k <= q, or q and k in one image: HF's
    `get_block_sequence_ids_for_mask` groups), and q - k < window on sliding layers."""
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    groups = get_block_sequence_ids_for_mask(token_type_ids[None])[0]
    index = torch.arange(doc_ids.shape[0])
    same_image = (groups[:, None] == groups[None, :]) & (groups[:, None] >= 0)
    visible = (doc_ids[:, None] == doc_ids[None, :]) & (
        (index[None, :] <= index[:, None]) | same_image
    )
    if window is not None:
        visible &= index[:, None] - index[None, :] < window
    return visible


def _gemma3_layout():
    """Four documents (12, 9, 5, 14 rows) and 8 padding rows; images of 3 and 4 rows, two
    adjacent in the last document, one at a document's end; T = 48."""
    lengths = (12, 9, 5, 14)
    doc_ids = torch.cat(
        [torch.full((n,), j) for j, n in enumerate(lengths)] + [torch.full((8,), -1)]
    )
    token_type_ids = torch.zeros(48, dtype=torch.long)
    for lo, hi in ((2, 5), (7, 11), (16, 21), (26, 28), (28, 31), (37, 40)):
        token_type_ids[lo:hi] = 1
    return doc_ids, token_type_ids


@pytest.mark.parametrize("window", [None, 4, 6])
def test_gemma3_image_rule_is_one_key_interval_per_row_in_all_three_masks(window):
    """KeySpans (the CPU path, chunks of 8 query rows), the CUDA dense mask and the flex block
    mask with `last_key` spell HF's OR(causal, same image) rule exactly; adjacent images are one
    run, as HF's groups count them."""
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    doc_ids, token_type_ids = _gemma3_layout()
    groups = get_block_sequence_ids_for_mask(token_type_ids[None])[0]
    assert groups[26] == groups[30]  # adjacent images: one run for HF too
    expected = _hf_visible(doc_ids, token_type_ids, window)
    last_key = image_block_ends(token_type_ids == 1)
    spans = KeySpans(first_visible_key(doc_ids, window), 8, last_key)
    dense = torch.zeros(48, 48, dtype=torch.bool)
    for s, e, first, part in spans.pieces():
        dense[s:e, first : first + part.shape[1]] = part
    real = doc_ids >= 0  # padding rows see padding keys in the masks: their rows are zeroed
    assert torch.equal(dense[real][:, real], expected[real][:, real])
    assert torch.equal(document_mask_up_to(doc_ids, last_key) & _window(window), expected)
    tile = 8
    block = document_causal_block_mask(doc_ids, tile, window=window, last_key=last_key)
    rows = torch.arange(48)
    element = block.mask_mod(0, 0, rows[:, None], rows[None, :])
    tiles = block.to_dense()[0, 0].bool().repeat_interleave(tile, 0).repeat_interleave(tile, 1)
    assert torch.equal((element & tiles)[real][:, real], expected[real][:, real])


def _window(window) -> torch.Tensor:
    index = torch.arange(48)
    return (
        torch.ones(48, 48, dtype=torch.bool)
        if window is None
        else (index[:, None] - index[None, :] < window)
    )


def test_dropped_gemma3_image_features_are_caught(gemma3, tmp_path, monkeypatch):
    """The placeholders keep their token embeddings (measured gap 8.7)."""
    processor, model = gemma3
    images = PackedGemma3ImageTextForward._images
    monkeypatch.setattr(
        PackedGemma3ImageTextForward, "_images", lambda self, x: torch.zeros_like(images(self, x))
    )
    assert _gap(model, _samples(tmp_path, processor)) > MUTANT_GAP


@pytest.mark.parametrize("fault", ["causal_inside_images", "images_see_the_rest", "one_short"])
def test_gemma3_image_rule_faults_are_caught(gemma3, tmp_path, monkeypatch, fault):
    """An image's rows causal as text rows are (HF's text-only mask), seeing the rest of their
    document, or the image's last row hidden from the rows before it (measured gaps 4.0, 7.8,
    1.9)."""
    processor, model = gemma3

    def mutant(is_image):
        index = torch.arange(is_image.shape[0])
        if fault == "causal_inside_images":
            return index
        if fault == "images_see_the_rest":
            return torch.where(is_image, is_image.shape[0] - 1, index)
        return torch.where(is_image, torch.maximum(image_block_ends(is_image) - 1, index), index)

    monkeypatch.setattr(image_text_gemma3, "image_block_ends", mutant)
    assert _gap(model, _samples(tmp_path, processor)) > MUTANT_GAP


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_a_wrapper_without_a_packed_language_model_here_runs_each_document_alone_and_says_why(
    model_type,
):
    """Qwen3.5's language model runs HF's forward on the CPU (its packed one needs fla), so its
    image packs do too, and the reason says so."""
    _, model = tiny_multimodal(model_type)
    path = multimodal_path(model, LAYERS, token_budget=64)
    try:
        assert path.name == "hf_multimodal"
        assert f"{model_type!r}: its language model's forward here is not a packed M-RoPE one" in (
            path.reason
        )
    finally:
        path.forward.close()


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_qwen3_5_takes_the_packed_path_where_its_language_model_runs_packed_hybrid(
    monkeypatch, model_type
):
    """Where the text path is the hybrid forward (on CUDA: here given with the reference
    kernels), the image packs take the packed path over that very forward."""
    _, model = tiny_multimodal(model_type)
    text = PackedHybridForward(
        text_model(model), LAYERS, kernels=REFERENCE, mrope=True, attention="sdpa", compile=False
    )
    hybrid = TargetPath(text, "packed_hybrid", "reference kernels", text.stage)
    monkeypatch.setattr(multimodal, "select_target_forward", lambda *args, **kwargs: hybrid)
    path = multimodal_path(model, LAYERS, token_budget=64)
    assert path.name == "packed_image_text" and path.forward.text is text
    assert "then packed_hybrid (reference kernels)" in path.reason


def test_a_wrapper_without_a_packed_image_forward_runs_each_document_alone_and_says_why():
    _, model = tiny_multimodal("qwen3_vl")
    model.config.model_type = "qwen3_vl_unlisted"
    path = multimodal_path(model, LAYERS, token_budget=64)
    try:
        assert path.name == "hf_multimodal"
        assert "'qwen3_vl_unlisted' has no packed image+text forward" in path.reason
    finally:
        path.forward.close()


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", sorted(set(PACKED_WRAPPERS) - set(HYBRIDS)))
def test_gpu_flex_compiled_packed_image_text_equals_each_document_alone(model_type, tmp_path):
    """fp32 on CUDA (no TF32), flex attention and compiled layers as a run takes them (T a
    multiple of flex's 128-row tiles), heads of 16 (flex's smallest): the same 1e-5 bound
    against the per-document forward on the same GPU."""
    out, _ = _gpu_features(model_type, tmp_path)
    torch.testing.assert_close(out[True], out[False], atol=ATOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", HYBRIDS)
def test_gpu_fla_packed_qwen3_5_image_text_is_within_flas_tf32_bound(model_type, tmp_path):
    """Qwen3.5 (and -MoE) with fla's varlen kernels (Gated DeltaNet heads of 32, fla's tile) against the
    wrapper per document on the same GPU, which calls fla's chunked kernel too: relative max
    difference 5e-3, the bound test_target_hybrid.py derives for fla's TF32 dots in fp32."""
    heads = dict(linear_key_head_dim=32, linear_value_head_dim=32)
    out, scale = _gpu_features(model_type, tmp_path, **heads)
    assert float((out[True] - out[False]).abs().max()) < 5e-3 * scale


def _gpu_features(model_type: str, tmp_path, **text_fields) -> tuple[dict, float]:
    """{packed: features} of the four documents on CUDA in fp32 (heads of 16, `text_fields` set
    on the text config), and the per-document features' largest magnitude."""
    from transformers import AutoModelForImageTextToText

    torch.backends.cuda.matmul.allow_tf32 = False
    entry = MULTIMODAL[model_type]
    processor = entry.processor()
    config = entry.config(processor)
    config.text_config.head_dim = 16
    for name, value in text_fields.items():
        setattr(config.text_config, name, value)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).cuda().eval()
    samples = _samples(tmp_path, processor)
    lengths = [len(s) for s in samples]
    budget = -(-(sum(lengths) + 1) // 128) * 128
    pack = layout_pack([(s.input_ids, s.loss_mask) for s in samples], budget)
    layout = [t.cuda() for t in (pack.input_ids, pack.position_ids, pack.doc_ids)]
    vision = [s.model_inputs(torch.device("cuda"), torch.float32) for s in samples]
    out = {}
    for packed in (True, False):
        path = multimodal_path(model, LAYERS, token_budget=budget, packed=packed)
        if packed:
            assert path.name == "packed_image_text" and "flex" in path.reason
        features = torch.full((budget, len(LAYERS) * config.text_config.hidden_size), 9.0)
        try:
            out[packed] = path.forward(*layout, features.cuda(), lengths, vision)
        finally:
            path.forward.close()
    return out, float(out[False].abs().max())
