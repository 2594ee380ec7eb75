"""The drafter's CPU attention over long documents (model/attention_rule.chunked_rule_attend):
chunks of blocks, each against only the context keys its rows may see, give the dense rule
mask's outputs, loss and gradients; no tensor of a 98304-token pack is quadratic in its length.

Both sides run in float64 and differ only in which masked keys enter SDPA (they add exact zeros)
and in summation order: ~1e-15 relative, measured below 1e-13; bound 1e-10. The mutants (a chunk
whose context ends at its first row's anchor; a chunk's first key one row late, the sliding
window's edge) move the loss by 1e-4 relative or more, measured.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import (
    TinySpec,
    make_objective,
    tiny_batch,
    tiny_config,
    tiny_drafter,
    tiny_target_weights,
)
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import MistralConfig

from dflash_async.model import attention_rule as attention
from dflash_async.model import objective
from dflash_async.model.layer_rules import AttentionRule
from dflash_async.model.objective import sample_anchors
from dflash_async.targets.forward import select_target_forward
from dflash_async.targets.loading import random_target

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = 1e-10  # see the module docstring
MUTANT_GAP = 1e-6  # relative loss change; ten thousand times TOL, a hundred below the mutants'
RULES = [AttentionRule(w, c) for w in (None, 3, 40) for c in (False, True)]
# one 1500-row document (crossing many chunks), two short ones, padding; B = 4, 8 rows per chunk
LONG = TinySpec(doc_lengths=(1500, 30, 21), num_pad=9)
# elements per pack row of the largest tensor allowed: measured 32 (the [T, k*d] features); one
# dense drafter mask over the pack would be 64 x (T + 64) here, a [T, T] one T x T
LINEAR = 48
VARIANTS = dict(layer_types=("sliding_attention", "full_attention"), sliding_window=40)


def _setup(spec: TinySpec = LONG, num_anchors: int = 96, **config_overrides):
    config = replace(tiny_config(spec), **config_overrides)
    batch = tiny_batch(spec, config)
    anchors = sample_anchors(
        batch.loss_mask, batch.doc_ids, num_anchors, torch.Generator().manual_seed(0)
    )
    return config, batch, anchors


@pytest.mark.parametrize("rule", RULES, ids=[f"w{r.window}_causal{r.causal}" for r in RULES])
def test_chunked_attention_equals_the_dense_rule_mask_outputs_and_gradients(rule) -> None:
    config, batch, anchors = _setup()
    args = (batch.doc_ids, anchors.positions, anchors.valid, config.block_size)
    T, Q, H, Hkv, hd = batch.num_tokens, anchors.positions.shape[0] * 4, 4, 2, 16
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, H, Q, hd, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, Hkv, T + Q, hd, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, Hkv, T + Q, hd, generator=gen, dtype=torch.float64, requires_grad=True)
    out_grad = torch.randn(1, H, Q, hd, generator=gen, dtype=torch.float64)

    def run(attend):
        out = attend(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), out_grad)
        return out, *grads

    dense = run(attention.sdpa_attend(attention.dense_rule_mask(*args, rule=rule)))
    chunked = run(attention.chunked_rule_attend(*args, rule=rule, query_rows=8))
    for got, want in zip(chunked, dense, strict=True):
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)


def _objective_sums(config, batch, anchors, *, query_rows: int):
    drafter = tiny_drafter(config, seed=3)
    embed, lm_head = tiny_target_weights(config, seed=3)
    obj = make_objective(config, drafter, embed, lm_head, num_anchors=len(anchors.valid))
    obj.config = replace(obj.config, sdpa_query_rows=query_rows)
    sums = obj(batch, anchors)
    grads = torch.autograd.grad(sums.ce_sum, list(drafter.parameters()))
    return sums, grads


def _dense_objective_sums(config, batch, anchors, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(
            objective,
            "chunked_rule_attend",
            lambda *args, rule, query_rows: attention.sdpa_attend(
                attention.dense_rule_mask(*args, rule=rule)
            ),
        )
        return _objective_sums(config, batch, anchors, query_rows=0)


def test_a_long_document_pack_gives_the_dense_mask_loss_and_gradients(monkeypatch) -> None:
    """A sliding-window layer (W 40) and a full one over a 1500-row document, 8 block rows per
    attention call (12 chunks): the same sums and drafter gradients as one dense mask."""
    config, batch, anchors = _setup(**VARIANTS)
    sums, grads = _objective_sums(config, batch, anchors, query_rows=8)
    ref, ref_grads = _dense_objective_sums(config, batch, anchors, monkeypatch)
    for name in ("ce_sum", "weight_sum", "correct", "supervised", "accepted", "blocks"):
        torch.testing.assert_close(getattr(sums, name), getattr(ref, name), atol=0, rtol=TOL)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)


_RANGES = attention.chunk_key_ranges


def _context_ends_at_the_first_row(lo, hi, *, rows, num_context):
    """Mutant: a chunk's context keys end at its first row's anchor (later blocks lose theirs)."""
    return [
        (s, e, f, min(h, int(hi[s])))
        for s, e, f, h in _RANGES(lo, hi, rows=rows, num_context=num_context)
    ]


def _first_key_one_late(lo, hi, *, rows, num_context):
    """Mutant: a chunk's first key one row late (the window's edge lost at the boundary)."""
    return [
        (s, e, min(f + 1, h), h)
        for s, e, f, h in _RANGES(lo, hi, rows=rows, num_context=num_context)
    ]


MUTANTS = {
    "context_ends_at_the_chunks_first_row": _context_ends_at_the_first_row,
    "first_key_one_row_late": _first_key_one_late,
}


@pytest.mark.parametrize("mutant", MUTANTS, ids=MUTANTS)
def test_parity_catches_the_chunk_mutant(mutant, monkeypatch) -> None:
    config, batch, anchors = _setup(**VARIANTS)
    ref, _ = _dense_objective_sums(config, batch, anchors, monkeypatch)
    monkeypatch.setattr(attention, "chunk_key_ranges", MUTANTS[mutant])
    sums, _ = _objective_sums(config, batch, anchors, query_rows=8)
    expected = float(ref.ce_sum.detach())
    assert abs(float(sums.ce_sum.detach()) - expected) > MUTANT_GAP * abs(expected)


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an aten op returns (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), func
        return out


def test_a_98304_token_document_trains_with_no_tensor_quadratic_in_its_length() -> None:
    """One training step on a pack of one 98304-token document: the packed target forward (a
    tiny Mistral, window 128: its CPU path attends in chunks of query rows) writes the features,
    then a drafter with a sliding-window layer (W 2048) and a full-attention one runs forward and
    backward on all 98304 context rows, 16 block rows per attention call. The largest tensor any
    op makes, forward or backward, is at most LINEAR x T elements (measured: the features
    [T, 32]; a target chunk's mask is 1024 query rows x 1151 keys); a [T, T] mask would be 9.7e9. (A full-attention target is the same code with lo at
    the document's start: tests/targets/test_target_long_documents.py; its T^2 FLOPs take
    minutes on a CPU.)"""
    T, A = 98304, 16
    spec = TinySpec(doc_lengths=(T,), num_pad=0, hidden_size=16, head_dim=8, intermediate_size=32)
    config = replace(tiny_config(spec), layer_types=VARIANTS["layer_types"], sliding_window=2048)
    batch = tiny_batch(spec, config, dtype=torch.float32)
    target = random_target(
        MistralConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            vocab_size=config.vocab_size,
            sliding_window=128,
        ),
        seed=0,
    )
    path = select_target_forward(target, (0, 1), token_budget=T, max_batch_tokens=T)
    assert path.name == "packed_window", path.reason
    anchors = sample_anchors(batch.loss_mask, batch.doc_ids, A, torch.Generator().manual_seed(0))
    drafter = tiny_drafter(config, seed=3, dtype=torch.float32)
    embed, lm_head = tiny_target_weights(config, seed=3, dtype=torch.float32)
    obj = make_objective(config, drafter, embed, lm_head, num_anchors=A)
    obj.config = replace(obj.config, sdpa_query_rows=16)  # 4 chunks of 4 blocks
    with LargestTensor() as largest:
        lengths = np.array([T])
        path.forward(batch.input_ids, batch.position_ids, batch.doc_ids, batch.features, lengths)
        sums = obj(batch, anchors)
        sums.ce_sum.backward()
    assert sums.blocks == A and torch.isfinite(sums.ce_sum)
    assert largest.numel <= LINEAR * T, (largest.numel, largest.op)
