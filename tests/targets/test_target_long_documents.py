"""The CPU packed target forward over long documents: query chunks under key spans give the
features of one dense-mask forward over the whole pack, and no [T, T] tensor is ever made.

A pack of one 700-token document and two short ones runs with 64 query rows per SDPA call (the
long document crosses 11 chunk boundaries) and with the dense [T, T] document-causal mask. Both
do the same matmuls on the same rows; the chunked call leaves out keys the mask hides (exact
zeros in the softmax) and sums in another order: features of order 1 (fp32 ulp 1.2e-7) differ
by 7.5e-9 at most, measured; bound 1e-6. The mutants (the context before a chunk lost; a window
one key too wide) move features by 5.4e-2 and 1.5e-3, measured: over a thousand times the bound.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import MistralConfig, Qwen3Config

from dflash_async.data.packing import layout_pack
from dflash_async.targets.families import family_of
from dflash_async.targets.loading import random_target, text_model
from dflash_async.targets.packed import dense as packed_dense
from dflash_async.targets.packed import window as packed_window
from dflash_async.targets.packed.dense import (
    KeySpans,
    PackedDenseForward,
    document_causal_mask,
)
from dflash_async.targets.packed.window import PackedWindowForward, window_causal_mask

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

ATOL = 1e-6  # see the module docstring
MUTANT_GAP = 1e-4  # a hundred times ATOL, fifteen times below the mutants' smallest effect
LENGTHS = (700, 40, 25)
TOKEN_BUDGET = 800  # 765 real rows, 35 padding rows
QUERY_ROWS = 64
WINDOW = 48  # Mistral's: below a chunk, so a chunk's first keys come from the previous chunk
LAYER_IDS = (0, 2)
_SMALL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=97,
)


@pytest.fixture(scope="module")
def dense_model():
    return random_target(Qwen3Config(**_SMALL), seed=0)


@pytest.fixture(scope="module")
def window_model():
    return random_target(MistralConfig(**_SMALL, sliding_window=WINDOW), seed=0)


def _run(forward, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    docs = [(rng.integers(0, 97, n), np.ones(n, dtype=bool)) for n in LENGTHS]
    layout = layout_pack(docs, TOKEN_BUDGET)
    out = torch.full((TOKEN_BUDGET, len(LAYER_IDS) * 32), float("nan"))  # every row written
    return forward(layout.input_ids, layout.position_ids, layout.doc_ids, out)


def _dense(model) -> PackedDenseForward:
    forward = PackedDenseForward(text_model(model), LAYER_IDS, attention="sdpa", compile=False)
    forward.query_rows = QUERY_ROWS
    return forward


def _window(model) -> PackedWindowForward:
    family = family_of(model.config).forward.layers
    forward = PackedWindowForward(
        text_model(model), LAYER_IDS, attention="sdpa", compile=False, family=family
    )
    forward.query_rows = QUERY_ROWS
    return forward


def _unchunked(forward, mask_of):
    """`forward` with the dense [T, T] mask instead of key spans (the reference)."""
    forward.mask = mask_of
    return forward


def test_chunked_document_causal_features_equal_the_dense_mask_features(dense_model) -> None:
    chunked = _run(_dense(dense_model))
    reference = _run(_unchunked(_dense(dense_model), document_causal_mask))
    torch.testing.assert_close(chunked, reference, atol=ATOL, rtol=0)


def test_chunked_sliding_window_features_equal_the_dense_window_features(window_model) -> None:
    chunked = _run(_window(window_model))
    reference = _window(window_model)
    reference.masks = lambda doc_ids, last_key=None: {
        "sliding_attention": window_causal_mask(doc_ids, WINDOW)
    }
    torch.testing.assert_close(chunked, _run(reference), atol=ATOL, rtol=0)


def _keys_from_the_chunk_start(self):
    """Mutant: a chunk attends only to keys from its own first row on (context lost)."""
    for s, e, first, part in _PIECES(self):
        yield s, e, s, part[:, s - first :]


_PIECES = KeySpans.pieces


def test_parity_catches_a_chunk_boundary_losing_context(dense_model, monkeypatch) -> None:
    reference = _run(_unchunked(_dense(dense_model), document_causal_mask))
    monkeypatch.setattr(KeySpans, "pieces", _keys_from_the_chunk_start)
    assert (_run(_dense(dense_model)) - reference).abs().max() > MUTANT_GAP


def test_parity_catches_a_window_one_key_too_wide(window_model, monkeypatch) -> None:
    reference = _window(window_model)
    reference.masks = lambda doc_ids, last_key=None: {
        "sliding_attention": window_causal_mask(doc_ids, WINDOW)
    }
    expected = _run(reference)

    def wide(doc_ids, window, rows, last_key=None):
        return packed_dense.document_causal_spans(doc_ids, window + 1, rows)

    monkeypatch.setattr(packed_window, "sdpa_mask", wide)
    assert (_run(_window(window_model)) - expected).abs().max() > MUTANT_GAP


def test_every_chunk_mask_is_linear_in_the_pack_length() -> None:
    """One document: every SDPA call's mask is 1024 query rows x (keys they see), at most
    1024 x T (T = 16384 here), never T x T; with a window of 2048, 1024 x (1024 + 2047) at most
    whatever T (98304 here)."""
    full = packed_dense.document_causal_spans(torch.zeros(16384, dtype=torch.long), rows=1024)
    shapes = [tuple(part.shape) for _, _, _, part in full.pieces()]
    assert max(shapes) == (1024, 16384) and len(shapes) == 16
    doc_ids = torch.zeros(98304, dtype=torch.long)
    window = packed_dense.document_causal_spans(doc_ids, 2048, rows=1024)
    assert max(part.shape[1] for _, _, _, part in window.pieces()) == 1024 + 2047


def test_the_mlp_over_row_chunks_gives_the_features_of_one_call(dense_model, monkeypatch) -> None:
    """A pack longer than MLP_ROWS runs its MLPs in row chunks (row-wise: the same values)."""
    whole = _run(_dense(dense_model))
    monkeypatch.setattr(packed_dense, "MLP_ROWS", 100)  # 8 chunks of the 800-row pack
    torch.testing.assert_close(_run(_dense(dense_model)), whole, atol=ATOL, rtol=0)
