"""The packed Qwen3.5 forward equals each document run alone through HF, row for row.

On the CPU (no triton, so no fla) the packed forward runs with plain torch kernels that take the
same segment boundaries (`REFERENCE`: a per-segment depthwise causal conv, and the gated delta rule
as its token-by-token recurrence): that checks everything the packed forward adds (segments from
the pack, per-segment state, document-causal gated attention, partial rotary, capture). On CUDA
the same comparison runs with fla's kernels.

CPU tolerance 2e-5 in fp32: HF runs the chunked form of the delta rule (chunks of 64, a
triangular solve inside), the reference the recurrence; both are fp32 computations of the same
function that differ by a few ulps per step and stay below 1e-5 here (features of order 1), while
a state leaking across a boundary or a missing gate moves them by O(0.1).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from target_kit import capture_features
from transformers import Qwen3_5TextConfig

from dflash_async.data.packing import layout_pack, pack_row_offsets
from dflash_async.targets.forward import select_target_forward
from dflash_async.targets.loading import random_target, text_model
from dflash_async.targets.packed.hybrid import (
    HybridKernels,
    PackedHybridForward,
    Segments,
    chunk_table,
)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

LENGTHS = (7, 12, 5, 9)
TOKEN_BUDGET = 40
LAYER_IDS = (1, 3, 4)  # a linear layer, the full-attention layer, the linear layer after it
ATOL = 2e-5  # see the module docstring


def _segments(segments: Segments) -> list[tuple[int, int]]:
    return list(itertools.pairwise(segments.cu_cpu.tolist()))


def _conv(x, weight, segments: Segments):
    """silu(depthwise causal conv) per segment, zero history at each segment start."""
    out = torch.empty_like(x)
    for lo, hi in _segments(segments):
        seg = x[0, lo:hi].T[None]  # [1, C, n]
        y = F.conv1d(seg, weight[:, None], padding=weight.shape[1] - 1, groups=weight.shape[0])
        out[0, lo:hi] = F.silu(y[0, :, : hi - lo].T)
    return out


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """fla's (and HF's) L2 norm: eps 1e-6 inside the root, which matters for small q and k."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def _delta(q, k, v, g, beta, segments: Segments):
    """The gated delta rule, token by token, zero state at each segment start."""
    heads, dk = v.shape[2], q.shape[-1]
    q = _l2norm(q.float()).repeat_interleave(heads // q.shape[2], dim=2) * dk**-0.5
    k = _l2norm(k.float()).repeat_interleave(heads // k.shape[2], dim=2)
    out = torch.empty_like(v, dtype=torch.float32)
    for lo, hi in _segments(segments):
        state = v.new_zeros(heads, dk, v.shape[-1], dtype=torch.float32)  # [HV, K, V]
        for t in range(lo, hi):
            state = state * g[0, t].exp()[:, None, None]
            remembered = torch.einsum("hk,hkv->hv", k[0, t], state)
            update = (v[0, t].float() - remembered) * beta[0, t].float()[:, None]
            state = state + torch.einsum("hk,hv->hkv", k[0, t], update)
            out[0, t] = torch.einsum("hk,hkv->hv", q[0, t], state)
    return out.to(v.dtype)


REFERENCE = HybridKernels(_conv, _delta, "torch reference")


def tiny_qwen35(**overrides) -> Qwen3_5TextConfig:
    """4 Gated DeltaNet + 1 gated attention layers, GVA (4 value heads per 2 key heads); heads of
    32 (fla's triton kernels tile head dims by 32 or 64: 16 would only test their masking)."""
    shape = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        vocab_size=300,
        layer_types=["linear_attention"] * 3 + ["full_attention", "linear_attention"],
    )
    return Qwen3_5TextConfig(**{**shape, **overrides})


def _documents(lengths, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 300, n), np.ones(n, dtype=bool)) for n in lengths]


def _packed(forward, docs, token_budget: int, width: int, device: str = "cpu") -> torch.Tensor:
    layout = layout_pack(docs, token_budget).to(device)
    out = torch.full((token_budget, width), float("nan"), device=device)
    lengths = np.array([len(d[0]) for d in docs])
    return forward(layout.input_ids, layout.position_ids, layout.doc_ids, out, lengths)


def _per_document_errors(model, docs, packed) -> list[float]:
    """Max abs difference of each document's packed rows from the document run alone."""
    offsets = pack_row_offsets(np.array([len(d[0]) for d in docs]))
    errors = []
    for j, (ids, _) in enumerate(docs):
        ids = torch.as_tensor(ids, device=packed.device)[None]
        alone = capture_features(model, ids, torch.ones_like(ids), LAYER_IDS)[0]
        errors.append(float((packed[offsets[j] : offsets[j + 1]] - alone).abs().max()))
    assert not packed[offsets[-1] :].any(), "padding rows must be zero"
    return errors


def test_packed_rows_equal_each_document_alone_with_reference_kernels() -> None:
    model = random_target(tiny_qwen35(), seed=0)
    forward = PackedHybridForward(
        text_model(model), LAYER_IDS, kernels=REFERENCE, mrope=True, attention="sdpa", compile=False
    )
    docs = _documents(LENGTHS)
    errors = _per_document_errors(model, docs, _packed(forward, docs, TOKEN_BUDGET, 3 * 64))
    assert max(errors) < ATOL, errors


def test_chunk_table_lists_every_64_token_chunk_of_every_segment() -> None:
    cuts = np.array([0, 70, 170, 173, 236, 256])  # 70 rows = 2 chunks, 100 = 2, 3 = 1, 63 = 1
    expected = [
        (s, c)
        for s, (lo, hi) in enumerate(itertools.pairwise(cuts))
        for c in range(-(-(hi - lo) // 64))
    ]
    assert chunk_table(cuts).tolist() == [list(r) for r in expected]
    assert len(expected) == 7


def test_cpu_hybrid_keeps_the_hf_path_and_says_why() -> None:
    model = random_target(tiny_qwen35(), seed=0)
    path = select_target_forward(model, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=64)
    assert path.name == "hf" and "CUDA" in path.reason


@pytest.mark.gpu
def test_gpu_fla_packed_rows_equal_each_document_alone() -> None:
    """fp32, fla kernels, documents across fla's 64-token chunks, flex attention (compiled).

    The reference, each document alone through HF on the GPU: with fla installed HF's Gated
    DeltaNet calls the same `chunk_gated_delta_rule` (not varlen: one sequence, the same chunk
    boundaries relative to the document start), its short convolution is torch's F.conv1d (no
    causal-conv1d package), its attention SDPA. Bound: relative max difference 5e-3 per document.
    fla's triton dots on fp32 inputs run TF32 (10-bit mantissa: rounding 2^-11 = 4.9e-4 relative
    per operand; solve_tril asks for tf32 explicitly), so operands that differ by an fp32 ulp (the
    triton vs torch conv, flex vs SDPA, fused compiled norms) may round to neighbouring TF32 values;
    ~2 such dot stages per layer over 5 layers stay within 10 x 4.9e-4. A state leaked across a
    boundary or a missing gate changes the affected rows by O(1) relative."""
    model = random_target(tiny_qwen35(), seed=0).cuda()
    path = select_target_forward(
        model, LAYER_IDS, token_budget=256, max_batch_tokens=256, packed_hybrid=True
    )
    assert path.name == "packed_hybrid", path.reason
    docs = _documents((70, 100, 3, 50), seed=1)
    packed = _packed(path.forward, docs, 256, 3 * 64, "cuda")
    offsets = pack_row_offsets(np.array([len(d[0]) for d in docs]))
    errors = _per_document_errors(model, docs, packed)
    scales = [float(packed[lo:hi].abs().max()) for lo, hi in itertools.pairwise(offsets)]
    relative = [e / s for e, s in zip(errors, scales, strict=True)]
    print(f"fp32 fla packed vs alone, relative max diff per document: {relative}")  # pytest -s
    assert max(relative) < 5e-3, (relative, errors)


@pytest.mark.gpu
def test_gpu_bf16_packed_rows_at_the_qwen35_9b_width_are_as_close_to_fp32_as_hf_is() -> None:
    """Qwen3.5-9B's layer shapes, 5 layers (3 linear, 1 full, 1 linear), bf16, 4 documents.

    Tolerance from the reference's own bf16 noise: HF in bf16 (fla's chunk_gated_delta_rule, torch
    conv, SDPA) is some relative distance from the same model in fp32; the packed path does the
    same ops in the same precision on the same rows (kernel choices and summation order differ:
    fla's varlen and triton conv, flex attention, fused compiled norms), so its distance may be
    at most 1.5x HF's, per document (the dense test's margin, tests/targets/test_target_gpu.py)."""
    import copy

    config = Qwen3_5TextConfig(
        num_hidden_layers=5, layer_types=tiny_qwen35().layer_types, tie_word_embeddings=False
    )
    with torch.device("cuda"):
        model = random_target(config, seed=0, dtype=torch.bfloat16)
    reference = copy.deepcopy(model).float()
    docs = [(ids, mask) for ids, mask in _documents((300, 1000, 57, 640), seed=2)]
    path = select_target_forward(
        model, LAYER_IDS, token_budget=2048, max_batch_tokens=2048, packed_hybrid=True
    )
    assert path.name == "packed_hybrid", path.reason
    layout = layout_pack(docs, 2048).to("cuda")
    out = torch.empty(2048, 3 * 4096, dtype=torch.bfloat16, device="cuda")
    lengths = np.array([len(d[0]) for d in docs])
    path.forward(layout.input_ids, layout.position_ids, layout.doc_ids, out, lengths)
    offsets = pack_row_offsets(lengths)
    for j, (ids, _) in enumerate(docs):
        ids = torch.as_tensor(ids, device="cuda")[None]
        ones = torch.ones_like(ids)
        exact = capture_features(reference, ids, ones, LAYER_IDS)[0]
        hf = capture_features(model, ids, ones, LAYER_IDS)[0].float()
        packed = out[offsets[j] : offsets[j + 1]].float()
        hf_error, packed_error = (float((x - exact).norm() / exact.norm()) for x in (hf, packed))
        print(f"bf16 document {j}: packed {packed_error:.3g}, HF {hf_error:.3g} from fp32")
        assert packed_error <= 1.5 * hf_error, (j, packed_error, hf_error)
    assert not out[offsets[-1] :].any(), "padding rows must be zero"


def test_packed_hybrid_can_be_turned_off() -> None:
    model = random_target(tiny_qwen35(), seed=0)
    path = select_target_forward(
        model, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=64, packed_hybrid=False
    )
    assert path.name == "hf" and "PACKED_HYBRID" in path.reason
