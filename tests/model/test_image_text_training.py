"""A drafter trains on image+text data: generated images and answers read through the tiny
multimodal target's processor (data/images.py), packed, their features taken by the multimodal
target forward (targets/multimodal.py), and 10 steps of the built drafter step (as the pipeline
builds it) on CPU. The loss never covers an image token: the pack's loss mask is False at every
one, and the step's losses are finite and fall.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from image_text_kit import MULTIMODAL, tiny_multimodal, write_image_data

from dflash_async.data.images import read_image_samples
from dflash_async.data.packing import layout_pack
from dflash_async.model.build import StepSpec, build_drafter_step
from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.targets.multimodal import MultimodalForward

pytestmark = pytest.mark.usefixtures("single_thread")

LAYERS = (1, 2)
BLOCK = 4
STEPS = 10
CPU = torch.device("cpu")


def _drafter_config(model, mask_token_id: int) -> DrafterConfig:
    text = model.config.get_text_config()
    return DrafterConfig(
        hidden_size=text.hidden_size,
        num_hidden_layers=1,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        head_dim=text.head_dim,
        intermediate_size=text.intermediate_size,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        vocab_size=text.vocab_size,
        num_target_layers=text.num_hidden_layers,
        target_layer_ids=LAYERS,
        mask_token_id=mask_token_id,
        block_size=BLOCK,
    )


def _spec(token_budget: int) -> StepSpec:
    return StepSpec(
        token_budget=token_budget,
        num_anchors=8,
        gamma=4.0,
        lr=1e-2,
        warmup_frac=0.2,
        weight_decay=0.0,
        grad_clip=1.0,
        seed=0,
        attention="sdpa",
        compile=False,
        compiled_update=False,
        cuda_graph=False,
        ce_chunk_size=64,
        ce_kernel="compiled",
        flex_backend="auto",
        working_weights=False,
    )


@pytest.mark.parametrize("model_type", sorted(MULTIMODAL))
def test_a_drafter_trains_ten_steps_on_image_text_packs(model_type, tmp_path):
    processor, model = tiny_multimodal(model_type)
    sizes = ((48, 64), (64, 32), (32, 32))
    path = write_image_data(tmp_path, records=4, sizes=sizes)
    samples, counts = read_image_samples(str(path), processor, max_len=256, block_size=BLOCK)
    assert len(samples) == 4 and counts["images"] == 4
    lengths = [len(s) for s in samples]
    budget = sum(lengths) + 5
    pack = layout_pack([(s.input_ids, s.loss_mask) for s in samples], budget)
    is_image = torch.zeros(budget, dtype=torch.bool)
    is_image[: sum(lengths)] = torch.from_numpy(np.concatenate([s.image_tokens() for s in samples]))
    expected = sum(MULTIMODAL[model_type].image_tokens(sizes[i % 3]) for i in range(4))
    assert int(is_image.sum()) == expected
    assert not pack.loss_mask[is_image].any()  # the loss never covers an image token

    unused = np.setdiff1d(np.arange(len(processor.tokenizer)), pack.input_ids.numpy())
    config = _drafter_config(model, int(unused[-1]))  # a mask token never in the data
    features = torch.zeros(budget, config.feature_width)
    forward = MultimodalForward(model, config.captured_layer_ids)
    try:
        vision = [s.model_inputs(CPU, torch.float32) for s in samples]
        forward(pack.input_ids, pack.position_ids, pack.doc_ids, features, lengths, vision)
    finally:
        forward.close()
    pack.features = features

    embed = model.get_input_embeddings().weight.detach()
    lm_head = model.get_output_embeddings().weight.detach()
    step = build_drafter_step(
        _spec(budget),
        config,
        embed=embed,
        lm_head=lm_head,
        device=CPU,
        rank=0,
        total_steps=STEPS,
    )
    step.batch.copy_(pack)
    losses = []
    for _ in range(STEPS):
        step.phase_a()
        step.phase_b()
        losses.append(float(step.stats[0] / step.stats[1]))
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses
