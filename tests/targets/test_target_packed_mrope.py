"""Qwen3-VL's language model on text packs: the packed dense forward, its M-RoPE fed three equal
position rows, equals each document run alone through the HF wrapper, row for row.

Why the dense path is exact for it: its decoder layers are Qwen3's (q/k norms, rotate-half
RoPE, SwiGLU MLP), its deepstack inputs apply at image positions only, and its rotary
(Qwen3VLTextRotaryEmbedding) turns frequency slot i by position[axis(i)] * inv_freq[i], the
axis of each slot given by the interleaved mrope_section. Text tokens have t = h = w (HF expands
[B, T] positions to three equal rows), so every slot turns by position * inv_freq[i] whatever
the sections: the angles are 1-D RoPE's (`test_text_positions_make_the_mrope_plain_1d_rope`).

Tolerance 1e-5 in fp32, as in test_target_packed.py: both sides run the same matmuls on the same
rows and differ only in summation order inside SDPA/matmul kernels (a few ulps of values of
order 1; measured 4.5e-8 here); a real mistake (a key from another document, unequal position
rows) moves features by far more (unequal rows: 0.027 with these small random weights).
"""

from __future__ import annotations

from functools import partial

import packed_kit as kit
import pytest
import torch
from transformers import AutoModelForImageTextToText, Qwen3VLConfig, Qwen3VLTextConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

from dflash_async.data.packing import layout_pack
from dflash_async.targets.families import FAMILIES
from dflash_async.targets.forward import select_target_forward
from dflash_async.targets.loading import text_model
from dflash_async.targets.packed.dense import PackedDenseForward

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

ATOL = 1e-5  # see the module docstring
LENGTHS = (7, 12, 5, 9)  # four documents, the first not the longest
TOKEN_BUDGET = 40  # 33 real rows + 7 padding rows
LAYER_IDS = (0, 2, 3)
VOCAB = 300
WIDTH = len(LAYER_IDS) * 64  # the features' width: hidden 64 per listed layer
HEAD_DIM = 16  # 8 rotary frequencies, split t/h/w by the sections below
SECTIONS = [4, 2, 2]  # Qwen3-VL-8B's [24, 20, 20] of 64 frequencies, scaled to 8


def _text_config(sections=SECTIONS, head_dim: int = HEAD_DIM) -> Qwen3VLTextConfig:
    rope = dict(rope_type="default", rope_theta=10000.0, mrope_section=sections)
    return Qwen3VLTextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        vocab_size=VOCAB,
        rope_parameters=rope | {"mrope_interleaved": True},
    )


def _wrapper():
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        deepstack_visual_indexes=[],
    )
    config = Qwen3VLConfig(text_config=_text_config().to_dict(), vision_config=vision)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def wrapper():
    """A random Qwen3-VL wrapper (one-block vision tower, never run on text), fp32 on the CPU."""
    return _wrapper()


_documents = partial(kit.documents, vocab=VOCAB, lengths=LENGTHS)
_run = partial(kit.run_path, budget=TOKEN_BUDGET, width=WIDTH)  # a path's forward on the pack
_distance_to_hf = partial(kit.distance_to_hf, layer_ids=LAYER_IDS)


@pytest.mark.parametrize(
    ("head_dim", "sections"), [(HEAD_DIM, SECTIONS), (HEAD_DIM, [2, 3, 3]), (128, [24, 20, 20])]
)
def test_text_positions_make_the_mrope_plain_1d_rope(head_dim: int, sections) -> None:
    """Three equal position rows (HF's expansion of [B, T], or ours) give exactly the cos/sin of
    1-D RoPE at those positions, whatever the sections (Qwen3-VL-8B's included); unequal rows
    (an image's) do not."""
    rotary = Qwen3VLTextRotaryEmbedding(_text_config(sections, head_dim))
    positions = torch.tensor([0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4, 5, 700, 4095])
    x = torch.zeros(1, positions.shape[0], 8)
    angles = positions[:, None].float() * rotary.inv_freq  # [T, hd/2]: 1-D RoPE's angles
    plain = torch.cat((angles, angles), dim=-1)[None]  # rotate-half layout, [1, T, hd]
    for given in (positions[None], positions[None, None].expand(3, 1, -1)):
        cos, sin = rotary(x, given)
        assert torch.equal(cos, plain.cos()) and torch.equal(sin, plain.sin())
    image_like = torch.stack([positions, positions // 2, positions % 2])[:, None]  # t != h != w
    cos, _ = rotary(x, image_like)
    assert not torch.equal(cos, plain.cos())


def test_both_qwen3_vl_model_types_plan_the_packed_dense_path_with_mrope() -> None:
    for kind in ("qwen3_vl", "qwen3_vl_text"):
        assert FAMILIES[kind].forward.name == "packed_dense"
        assert FAMILIES[kind].forward.mrope


def test_every_packed_row_of_a_qwen3_vl_target_equals_its_document_alone_through_hf(
    wrapper,
) -> None:
    path = select_target_forward(wrapper, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=64)
    assert path.name == "packed_dense" and path.reason.startswith("qwen3_vl_text:")
    docs = _documents(seed=1)
    assert _distance_to_hf(wrapper, docs, _run(path.forward, docs)) < ATOL


def test_unequal_position_rows_are_caught_by_the_comparison(wrapper, monkeypatch) -> None:
    """Mutant: the t row right, h and w left at 0 (as if every token sat at the grid origin)."""
    monkeypatch.setattr(
        PackedDenseForward,
        "rope_positions",
        lambda self, p: torch.stack([p, torch.zeros_like(p), torch.zeros_like(p)])[:, None],
    )
    path = select_target_forward(wrapper, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=64)
    docs = _documents(seed=1)
    # measured 0.027 (small random weights keep attention near uniform): 2700x the tolerance
    assert _distance_to_hf(wrapper, docs, _run(path.forward, docs)) > 100 * ATOL


def test_the_mrope_gets_three_equal_rows_restarting_in_every_document(wrapper) -> None:
    """RoPE depends on q - k only, so positions that do not restart per document (each shifted
    by its offset) match HF in exact arithmetic and differ only by angle rounding, which grows
    with the position; that mutant, and one-row positions, are caught at the rotary's input."""
    inner = text_model(wrapper)
    seen: list[torch.Tensor] = []
    hook = inner.rotary_emb.register_forward_hook(lambda m, args, out: seen.append(args[1]))
    try:
        path = select_target_forward(
            wrapper, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=64
        )
        docs = _documents()
        _run(path.forward, docs)
    finally:
        hook.remove()
    restarting = layout_pack(docs, TOKEN_BUDGET).position_ids
    assert seen[0].shape == (3, 1, TOKEN_BUDGET)
    assert all(torch.equal(row[0], restarting) for row in seen[0])


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_gpu_flex_compiled_qwen3_vl_rows_equal_each_document_alone(cuda_graph: bool) -> None:
    """fp32 on CUDA (no TF32), flex attention and compiled layers as a run takes them: the same
    1e-5 bound. T = 256 (flex tiles of 128) with documents crossing tile edges."""
    model = _wrapper().cuda()
    path = select_target_forward(
        model, LAYER_IDS, token_budget=256, max_batch_tokens=256, cuda_graph=cuda_graph
    )
    assert path.name == "packed_dense" and "flex" in path.reason
    docs = _documents(lengths=(70, 100, 3, 50), seed=5)
    for _ in range(2):  # a CUDA graph is captured on the first call and replayed on the second
        assert (
            _distance_to_hf(model, docs, _run(path.forward, docs, budget=256, device="cuda")) < ATOL
        )
