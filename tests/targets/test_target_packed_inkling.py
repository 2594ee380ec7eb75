"""The packed Inkling 2 forward (targets/packed/inkling.py) equals each document run alone through
HF, row for row, padding rows zero, in one chunk of query rows or in many; and the parity check
catches a short convolution or a dynamic one reading across a document boundary, the log scale
taken at pack positions instead of the document's, the relative position bias dropped, the L2
clips dropped, and the attention output's gate dropped. The family table sends `inkling2_text` and the `inkling2` wrapper to it,
and a layout it cannot run to the generic forward with its reason.

The tiny model has 4 layers (sliding, full, sliding, full), a block residual every 2 layers, a
window of 6 and a full-attention rel_extent of 5, both shorter than three of the four documents.
HF initialises the block residuals' queries, the dynamic convolutions' static taps, the clips'
scales and the norms to constants and its projections at std 0.02, under which the clips never
bind, the log scale is 1 below position 128000 and the position bias is ~1e-3: here those are
drawn at random, q, k and the relative states projected 10x larger (per-head norms ~6 and ~4
against thresholds 4 and 2, so most clip), the bias bank 50x (biases O(1)), and the log scale
starts at position 1 (floor 2, alpha 1), so every part moves the features.

Tolerance in fp32: both sides run the same modules on the same rows; they differ in the order of
the attention's and the convolutions' sums (masked terms add exact zeros). Measured over three
seeds, one chunk or chunks of 5 query rows: at most 1.7e-7 on features up to 0.16 (about ten
fp32 ulps of the largest). Bound 1e-6, 6x that; the mutants move the features by 1.1e-2 at the
least (measured over the three seeds: static convolution 1.1e-2-2.3e-2, dynamic convolution
6.3e-2-7.9e-2, pack positions 4.4e-2-6.5e-2, clips 9.0e-2-0.10, gate 0.15-0.17, bias dropped
0.14-0.18), 10^4 x the bound.
"""

from __future__ import annotations

import copy
from unittest import mock

import numpy as np
import pytest
import torch
import transformers
from target_kit import capture_features

from dflash_async.data.packing import layout_pack, pack_row_offsets
from dflash_async.errors import SettingsError
from dflash_async.targets.families import FAMILIES, family_of
from dflash_async.targets.forward import select_target_forward
from dflash_async.targets.packed import inkling as packed_inkling

pytestmark = [
    pytest.mark.usefixtures("one_intra_op_thread"),
    pytest.mark.skipif(
        not hasattr(transformers, "Inkling2TextConfig"), reason="transformers has no Inkling 2"
    ),
]

ATOL = 1e-6  # see the module docstring
_MUTANT_GAP = 1e-3  # a mutant's largest deviation must exceed this (1000x ATOL)
LENGTHS = (7, 12, 5, 9)  # three of the four longer than the window (6) and rel_extent (5)
TOKEN_BUDGET = 40  # 33 real rows + 7 padding rows
LAYER_IDS = (0, 1, 2, 3)
HIDDEN = 64
VOCAB = 256


def _config(**changes) -> transformers.Inkling2TextConfig:
    fields = dict(
        vocab_size=VOCAB + 64,
        unpadded_vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=16,
        sliding_window_size=6,
        d_rel=8,
        rel_extent=5,
        log_scaling_n_floor=2,
        log_scaling_alpha=1.0,
        qk_l2_clip_threshold=4.0,
        rel_l2_clip_threshold=2.0,
        n_layers_per_attn_res_block=2,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
        eos_token_id=1,
    )
    return transformers.Inkling2TextConfig(**(fields | changes))


_DRAWN = ("static_weight", ".query", "scale", "norm.weight", "e_score_correction_bias")
_TIMES_10 = ("q_proj.linear.weight", "k_proj.linear.weight", "relative_position_bias.linear.weight")


def _model(seed: int = 1, **changes):
    """The tiny text model, its weights drawn as the module docstring says."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModel.from_config(_config(**changes))
    model = model.eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith(_DRAWN):
            centre = 1.0 if name.endswith(("scale", "norm.weight")) else 0.0
            tensor.copy_(centre + torch.randn(tensor.shape, generator=generator) * 0.3)
        elif name.endswith(_TIMES_10):
            tensor.mul_(10)
        elif name.endswith("relative_position_bias.proj"):
            tensor.mul_(50)
    return model


@pytest.fixture(scope="module")
def inkling():
    return _model()


def _documents(seed: int = 0, lengths=LENGTHS) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, VOCAB, n), np.ones(n, dtype=bool)) for n in lengths]


def _alone(model, docs) -> list[torch.Tensor]:
    device = next(model.parameters()).device
    rows = []
    for ids, _ in docs:
        ids = torch.as_tensor(ids, device=device)[None]
        rows.append(capture_features(model, ids, torch.ones_like(ids), LAYER_IDS)[0].cpu())
    return rows


def _max_deviation(packed: torch.Tensor, alone: list[torch.Tensor]) -> float:
    """Largest |packed row - document-alone row| (padding rows must be exactly zero)."""
    packed = packed.cpu()
    offsets = pack_row_offsets(np.array([len(a) for a in alone]))
    assert torch.equal(packed[offsets[-1] :], torch.zeros_like(packed[offsets[-1] :]))
    return max(
        float((packed[offsets[j] : offsets[j + 1]] - a).abs().max()) for j, a in enumerate(alone)
    )


def _run(path, docs, *, budget: int = TOKEN_BUDGET, device: str = "cpu") -> torch.Tensor:
    layout = layout_pack(docs, budget).to(device)
    out = torch.full((budget, len(LAYER_IDS) * HIDDEN), float("nan"), device=device)
    lengths = np.array([len(ids) for ids, _ in docs])
    return path.forward(layout.input_ids, layout.position_ids, layout.doc_ids, out, lengths)


def _packed(model, docs, *, query_rows: int | None = None, **kw) -> torch.Tensor:
    path = select_target_forward(model, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=64)
    assert path.name == "packed_inkling", path.reason
    if query_rows is not None:
        path.forward.packed.query_rows = query_rows
    return _run(path, docs, **kw)


def test_the_table_sends_inkling2_and_its_wrapper_to_the_packed_forward(inkling) -> None:
    assert family_of(inkling.config) is FAMILIES["inkling2_text"]
    assert FAMILIES["inkling2"].forward is FAMILIES["inkling2_text"].forward
    assert FAMILIES["inkling2"].language_model == "inkling2_text"


@pytest.mark.parametrize("query_rows", [None, 5])  # one chunk; chunks across documents
def test_packed_rows_equal_each_document_alone_through_hf(inkling, query_rows) -> None:
    docs = _documents()
    packed = _packed(inkling, docs, query_rows=query_rows)
    assert _max_deviation(packed, _alone(inkling, docs)) <= ATOL


@pytest.mark.parametrize("seed", [2, 3])
def test_packed_rows_equal_each_document_alone_for_other_weights(seed) -> None:
    model = _model(seed)
    docs = _documents(seed, lengths=(13, 4, 10, 6))
    assert _max_deviation(_packed(model, docs), _alone(model, docs)) <= ATOL


_conv, _dynamic, _norm = (
    packed_inkling.document_conv,
    packed_inkling.dynamic_document_conv,
    packed_inkling.head_norm,
)
MUTANTS = {
    # the static convolutions over the whole pack as one document
    "conv_across_documents": (
        "document_conv",
        lambda x, conv, doc_ids: _conv(x, conv, torch.zeros_like(doc_ids)),
    ),
    "dynamic_conv_across_documents": (
        "dynamic_document_conv",
        lambda x, taps, doc_ids: _dynamic(x, taps, torch.zeros_like(doc_ids)),
    ),
    # the full layers' log scale of q and of the relative states at the pack's row indices
    "log_scale_at_pack_positions": (
        "head_norm",
        lambda norm, x, positions: _norm(norm, x, torch.arange(positions.shape[0])),
    ),
    "position_bias_dropped": (
        "relative_logits",
        lambda bias, x, positions: torch.zeros(
            *x.shape[:-1], bias.num_heads, bias.rel_extent, device=x.device
        ),
    ),
    "l2_clip_dropped": ("l2_clip", lambda x, threshold: x.float()),
    "output_gate_dropped": ("output_gate", lambda o_proj, out, x: o_proj.linear(out)),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_the_parity_check_catches_each_mutant(inkling, mutant) -> None:
    name, replacement = MUTANTS[mutant]
    docs = _documents()
    alone = _alone(inkling, docs)
    with mock.patch.object(packed_inkling, name, replacement):
        packed = _packed(inkling, docs)
    assert _max_deviation(packed, alone) > _MUTANT_GAP


def test_a_layout_it_cannot_run_takes_the_generic_forward_with_the_reason(inkling) -> None:
    model = copy.deepcopy(inkling)
    model.config.layer_types = [*model.config.layer_types[:-1], "linear_attention_like"]
    path = select_target_forward(model, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=64)
    assert path.name == "hf" and "layer_types ['linear_attention_like']" in path.reason


def test_it_is_never_split_into_stages(inkling) -> None:
    """The block states of every earlier block are more than a stage hands on."""
    with pytest.raises(SettingsError, match="packed_inkling"):
        select_target_forward(
            inkling, (0, 1), token_budget=TOKEN_BUDGET, max_batch_tokens=64, layers=range(0, 2)
        )


@pytest.mark.gpu
def test_gpu_packed_rows_equal_each_document_alone() -> None:
    """fp32 on CUDA (TF32 off, torch's default), the product's path (select_target_forward on a CUDA model: the
    same torch code, T = 256, chunks of 128 query rows across documents), against HF on CUDA per
    document. Bound 1e-5: CUDA's matmuls sum in other orders than the CPU's."""
    model = _model().cuda()
    docs = _documents(5, lengths=(70, 100, 3, 50))
    path = select_target_forward(model, LAYER_IDS, token_budget=256, max_batch_tokens=256)
    assert path.name == "packed_inkling", path.reason
    path.forward.packed.query_rows = 128
    out = _run(path, docs, budget=256, device="cuda")
    assert _max_deviation(out, _alone(model, docs)) <= 1e-5
