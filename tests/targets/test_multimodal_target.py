"""The multimodal target forward (targets/multimodal.py) on image+text packs: the features of a
pack of several documents (one, two or no images each) equal HF's forward of each document
alone, image positions included, and padding rows are zero. Mutants that must fail: the image
features dropped (the pixel inputs never reach the model), a document given another document's
multimodal RoPE positions, and 1-D text positions in place of the 3-D ones.

The reference is HF's `output_hidden_states`: hidden_states[i + 1] is decoder layer i's output
(not final-norm'd for i below the last layer, which is why the tapped layers are 1 and 2 of 4).
Both sides run the same modules in the same order on the same [1, n] inputs in fp32, so they
agree to the last bit (measured: equal) up to BLAS's choice of kernel for another call: TOL =
1e-6 absolute on features of magnitude ~0.1, about a hundred fp32 roundings of it. The mutants
move the features by 0.13 (image features dropped), 5e-3 (another document's positions: two
image tokens' h and w swapped) and 2e-2 (text-stream positions), measured: MUTANT_GAP = 1e-3,
a thousand times TOL.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from image_text_kit import BIDIRECTIONAL, MROPE, MULTIMODAL, image, image_record, tiny_multimodal

from dflash_async.data.images import ImageTextSamples, read_image_samples
from dflash_async.data.packing import PackCursor, PackedBatch, layout_pack
from dflash_async.stages.produce import TargetRunner, fill_slot, stage_inputs
from dflash_async.stages.read import PlannedPack
from dflash_async.targets.multimodal import (
    MultimodalForward,
    generated_as_text,
    multimodal_path,
    multimodal_token_ids,
)
from dflash_async.targets.resolve import TargetError

LAYERS = (1, 2)
TOL = 1e-6
PACKED_TOL = 1e-5
MUTANT_GAP = 1e-3
PAD = 7
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=sorted(MULTIMODAL))
def target(request):
    return tiny_multimodal(request.param)


@pytest.fixture(scope="module", params=MROPE)
def mrope_target(request):
    return tiny_multimodal(request.param)


@pytest.fixture(scope="module", params=BIDIRECTIONAL)
def bidirectional_target(request):
    return tiny_multimodal(request.param)


def _samples(folder: Path, processor):
    """Four documents: one image 96 high and 32 wide; two images; no image; the first's
    question with an image 32 high and 96 wide (the same tokens, other 3-D positions)."""
    for i, size in enumerate(((96, 32), (32, 32), (48, 64), (32, 96))):
        image(i, size).save(folder / f"{i}.png")
    two = image_record(1, "1.png", images=2)
    two["messages"][0]["content"][1]["image_url"]["url"] = "2.png"
    text_only = {
        "messages": [
            {"role": "user", "content": "Hello there!"},
            {"role": "assistant", "content": "I am fine, thank you. The sum of the numbers is 42."},
        ]
    }
    records = [image_record(0, "0.png"), two, text_only, image_record(0, "3.png")]
    (folder / "d.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    samples, _ = read_image_samples(str(folder / "d.jsonl"), processor, max_len=512, block_size=2)
    assert [s.num_images for s in samples] == [1, 2, 0, 1]
    assert (samples[0].input_ids == samples[3].input_ids).all()
    return samples


def _reference(model, sample) -> torch.Tensor:
    """HF's hidden states of the tapped layers for the document alone, [n, k*d]."""
    ids = torch.as_tensor(sample.input_ids, dtype=torch.long)[None]
    with torch.no_grad():
        out = model(
            input_ids=ids,
            **sample.model_inputs(CPU, torch.float32),
            output_hidden_states=True,
            use_cache=False,
        )
    return torch.cat([out.hidden_states[i + 1][0] for i in LAYERS], dim=-1)


def _packed(model, samples, vision=None) -> tuple[torch.Tensor, list[int]]:
    lengths = [len(s) for s in samples]
    pack = layout_pack([(s.input_ids, s.loss_mask) for s in samples], sum(lengths) + PAD)
    hidden = model.config.get_text_config().hidden_size
    features = torch.full((pack.num_tokens, len(LAYERS) * hidden), float("nan"))
    forward = MultimodalForward(model, LAYERS)
    try:
        vision = vision or [s.model_inputs(CPU, torch.float32) for s in samples]
        forward(pack.input_ids, pack.position_ids, pack.doc_ids, features, lengths, vision)
    finally:
        forward.close()
    return features, lengths


def test_packed_features_equal_hf_per_document(target, tmp_path):
    processor, model = target
    samples = _samples(tmp_path, processor)
    features, lengths = _packed(model, samples)
    at = 0
    for sample, n in zip(samples, lengths, strict=True):
        reference = _reference(model, sample)
        torch.testing.assert_close(features[at : at + n], reference, atol=TOL, rtol=TOL)
        at += n
    assert torch.equal(features[at:], torch.zeros_like(features[at:]))  # padding rows


def _gap(model, samples, vision) -> float:
    """The largest feature change at image documents' rows that a mutant's vision inputs make."""
    right, _ = _packed(model, samples)
    wrong, _ = _packed(model, samples, vision)
    return float((right - wrong).abs().max())


def test_dropped_image_features_are_caught(target, tmp_path):
    processor, model = target
    samples = _samples(tmp_path, processor)
    vision = [
        {k: v for k, v in s.model_inputs(CPU, torch.float32).items() if k != "pixel_values"}
        for s in samples
    ]
    assert _gap(model, samples, vision) > MUTANT_GAP


def _own_positions(model, sample, vision) -> torch.Tensor:
    """The document's 3-D rope positions [3, 1, n], as the wrapper computes them alone."""
    ids = torch.as_tensor(sample.input_ids, dtype=torch.long)[None]
    grid = vision.get("image_grid_thw")
    return model.model.get_rope_index(
        ids, mm_token_type_ids=vision["mm_token_type_ids"], image_grid_thw=grid
    )[0]


def test_positions_of_another_document_are_caught(mrope_target, tmp_path):
    """Documents 0 and 3 have the same tokens, their images other heights and widths: each
    given the other's 3-D positions."""
    processor, model = mrope_target
    samples = _samples(tmp_path, processor)
    vision = [s.model_inputs(CPU, torch.float32) for s in samples]
    first, last = (_own_positions(model, samples[i], vision[i]) for i in (0, 3))
    assert not torch.equal(first, last)
    vision[0]["position_ids"], vision[3]["position_ids"] = last, first
    assert _gap(model, samples, vision) > MUTANT_GAP


def test_text_stream_positions_are_caught(mrope_target, tmp_path):
    """Every document given 1-D positions on all three axes (the drafter's stream), not its
    3-D ones. (Shifting a document's positions by a constant is no mutant: RoPE is relative,
    so a pack's positions need not restart per document for the features to be right; what
    matters is each document's own 3-D layout.)"""
    processor, model = mrope_target
    samples = _samples(tmp_path, processor)
    vision = [s.model_inputs(CPU, torch.float32) for s in samples]
    for v, s in zip(vision, samples, strict=True):
        v["position_ids"] = torch.arange(len(s)).expand(3, 1, len(s))
    assert _gap(model, samples, vision) > MUTANT_GAP


def test_causal_attention_inside_images_is_caught(bidirectional_target, tmp_path):
    """The mutant: the per-token types dropped, so image tokens attend causally (Gemma 3's
    image tokens see each other both ways)."""
    processor, model = bidirectional_target
    samples = _samples(tmp_path, processor)
    vision = [
        {k: v for k, v in s.model_inputs(CPU, torch.float32).items() if k != "token_type_ids"}
        for s in samples
    ]
    assert _gap(model, samples, vision) > MUTANT_GAP


@pytest.mark.parametrize("packed", [False, True], ids=["per_document", "packed_if_any"])
@pytest.mark.parametrize("recomputed", [False, True], ids=["held", "recomputed"])
def test_the_target_stage_fills_a_slot_with_each_documents_features(
    target, tmp_path, recomputed, packed
):
    """The target stage (stages/produce.py) on image+text samples: a pack of documents out of
    file order is staged with each document's own vision inputs (held, or computed again from
    the samples' renderings and image files, as `run` keeps them), and the slot holds the
    layout and, at each document's rows, HF's features of that document alone; by the path
    `run` chooses too (the packed one for the Qwen3-VL wrappers: within PACKED_TOL, the
    packed paths' fp32 tolerance, test_target_packed_image_text.py)."""
    processor, model = target
    listed = _samples(tmp_path, processor)
    samples = ImageTextSamples.of(listed, processor=processor if recomputed else None)
    order = np.array([2, 0, 3, 1])
    budget = int(samples.lengths.sum()) + PAD
    width = len(LAYERS) * model.config.get_text_config().hidden_size
    runner = TargetRunner(
        model,
        multimodal_path(model, LAYERS, token_budget=budget, packed=packed),
        PackedBatch.empty(budget, width, device=CPU, feature_dtype=torch.float32),
    )
    slot = PackedBatch.empty(budget, width, device=CPU, feature_dtype=torch.float32)
    slot.features.fill_(float("nan"))
    try:
        staged = stage_inputs(runner, samples, PlannedPack(PackCursor(), order))
        fill_slot(runner, staged, slot)
    finally:
        runner.path.forward.close()
    at = 0
    for i in order.tolist():
        n = len(listed[i])
        assert np.array_equal(slot.input_ids[at : at + n].numpy(), listed[i].input_ids)
        assert np.array_equal(slot.loss_mask[at : at + n].numpy(), listed[i].loss_mask)
        reference = _reference(model, listed[i])
        tol = PACKED_TOL if runner.path.name == "packed_image_text" else TOL
        torch.testing.assert_close(slot.features[at : at + n], reference, atol=tol, rtol=tol)
        at += n
    assert torch.equal(slot.features[at:], torch.zeros_like(slot.features[at:]))


def test_a_target_without_a_vision_tower_is_refused():
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
    with pytest.raises(TargetError, match="no vision tower"):
        MultimodalForward(Qwen3ForCausalLM(config), LAYERS)


def test_deepstack_visual_features_are_in_the_first_layers_features(tmp_path):
    """Qwen3-VL adds its deepstack visual features to the output of its first decoder layer(s)
    at image positions: tapped layer 0's features are its output plus them (the hidden state
    entering layer 1, which SGLang's DFlash capture reads), HF's hidden_states[1] (the output
    alone) plus the deepstack features of the images, scattered at their tokens. The output
    alone (the mutant) misses them by more than MUTANT_GAP."""
    processor, model = tiny_multimodal("qwen3_vl")
    samples = _samples(tmp_path, processor)
    layers, d = (0, 2), model.config.get_text_config().hidden_size
    lengths = [len(s) for s in samples]
    pack = layout_pack([(s.input_ids, s.loss_mask) for s in samples], sum(lengths) + PAD)
    features = torch.zeros(pack.num_tokens, len(layers) * d)
    forward = MultimodalForward(model, layers)
    try:
        vision = [s.model_inputs(CPU, torch.float32) for s in samples]
        forward(pack.input_ids, pack.position_ids, pack.doc_ids, features, lengths, vision)
    finally:
        forward.close()
    at, checked = 0, 0
    for sample, inputs in zip(samples, vision, strict=True):
        n, rows = len(sample), torch.from_numpy(sample.image_tokens())
        ids = torch.as_tensor(sample.input_ids, dtype=torch.long)[None]
        with torch.no_grad():
            output = model(input_ids=ids, **inputs, output_hidden_states=True).hidden_states[1][0]
            expected = output.clone()
            if sample.num_images:
                images = model.model.get_image_features(
                    inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True
                )
                expected[rows] += torch.cat(images.deepstack_features[0], dim=0)
                checked += 1
                gap = (features[at : at + n, :d][rows] - output[rows]).abs().max()
                assert gap > MUTANT_GAP
        torch.testing.assert_close(features[at : at + n, :d], expected, atol=TOL, rtol=TOL)
        at += n
    assert checked == 3


def test_multimodal_token_ids_are_the_wrappers_placeholders_and_markers(target):
    """Read from the wrapper's own config (Gemma 3's image_token_index answers to
    image_token_id): the image placeholder and, where the family has them, the video
    placeholder and the image markers; a text config names none."""
    processor, model = target
    config, tokenizer = model.config, processor.tokenizer
    ids = multimodal_token_ids(config)
    assert config.image_token_id in ids
    named = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    named += ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
    in_vocabulary = {tokenizer.convert_tokens_to_ids(t) for t in named} - {tokenizer.unk_token_id}
    assert ids == in_vocabulary & set(range(len(tokenizer)))
    assert multimodal_token_ids(config.get_text_config()) == frozenset()


def test_generated_as_text_hides_generated_multimodal_ids_but_embeds_them(target):
    """Inside the context the ids shown to the wrapper keep the prompt and every generated text
    token, generated multimodal ids become one text id, and the input embedding of the shown
    ids is the embedding of the real ones."""
    _, model = target
    special = sorted(multimodal_token_ids(model.config))
    prompt = [5, special[0], 6]
    generated = [7, *special, 8]
    ids = torch.tensor([prompt + generated])
    embedding = model.get_input_embeddings()
    with generated_as_text(model, ids, len(prompt)) as shown:
        embedded = embedding(shown)
    assert shown[0, : len(prompt)].tolist() == prompt
    hidden = shown[0, len(prompt) :].tolist()
    assert hidden[0] == 7 and hidden[-1] == 8 and len(set(hidden[1:-1])) == 1
    assert not set(hidden) & set(special)
    assert torch.equal(embedded, embedding(ids))
    assert not torch.equal(embedding(shown), embedding(ids))  # outside it: the stand-in's
