"""The packed Nemotron-H forward (targets/packed/mamba.py) equals each document run alone through
HF, row for row: Mamba-2 mixers with their convolution and state-space state reset in every
document, attention without positions document-causal, MLP and MoE blocks row-wise.

The reference is HF's own torch path on the CPU (its chunked scan over each document alone, no
Mamba kernels installed). Tolerance 1e-5 in fp32: both sides run the same projections on the same
rows and differ only in summation order (the SSD's in-chunk sums, chunk states and their passing
are grouped otherwise than HF's einsums; the convolution's taps are added in another order than
F.conv1d's; masked keys add exact zeros), a few fp32 ulps per layer over 6 layers, of features up
to 6.4 in size (ulp 4.8e-7 between 4 and 8): measured at most 3.6e-6 over the variants. The MoE
router is discrete, but a flip between two experts needs their scores within those ulps: with
these seeds none does (a flip would show as an O(0.1) row error, never as a silent pass).

The weights are drawn with initializer_range 0.1 (not HF's 0.02), and each mixer's A_log, dt_bias,
D and gated-norm weight at random (HF starts them at fixed values: D 1, norm 1, A 1..H, dt in
[0.001, 0.1]): dt then lies mostly in 0.25-1.5 (5th-95th percentile), so the state decays and
carries within a few rows, and the limits variant clamps 43% of its dt values. Every term then
moves features by far more than the tolerance; the mutant tests below check that (measured, the
largest error over the documents a mutant breaks: the state carried across a document start
0.067, the convolution across one 4.6, the state not passed from chunk to chunk 0.12, D skip
dropped 6.4, the gated norm over the whole width 2.1, dt's bias dropped 0.026, its softplus
dropped 0.092, its limits dropped 0.23: each over 2,000 times the tolerance). Chunks are 8 rows:
the 12- and 19-row documents span chunk edges both alone and in the pack (where their edges fall
elsewhere); the third document (2 rows) is shorter than the convolution.
"""

from __future__ import annotations

from functools import partial

import packed_kit as kit
import pytest
import torch
from transformers import NemotronHConfig

from dflash_async.targets.families import planned_path
from dflash_async.targets.forward import select_target_forward
from dflash_async.targets.loading import random_target, text_model
from dflash_async.targets.packed import mamba as packed_mamba

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

ATOL = 1e-5  # see the module docstring
LENGTHS = (7, 12, 2, 19)  # four documents, the first not the longest, one shorter than the conv
TOKEN_BUDGET = 48  # 40 real rows + 8 padding rows
CHUNK = 8
LAYER_IDS = (0, 2, 5)  # a Mamba mixer, an attention (or MoE) block and the last Mamba mixer
VOCAB = 300
WIDTH = len(LAYER_IDS) * 64  # the features' width: hidden 64 per listed layer
M, ATTN, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    mamba_num_heads=8,
    mamba_head_dim=8,
    n_groups=2,  # two groups of 4 heads; the gated norm over groups of 32 channels
    ssm_state_size=16,
    conv_kernel=4,
    chunk_size=CHUNK,
    initializer_range=0.1,
)
_MOE = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=32,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
)

VARIANTS = {
    # Nemotron-H / Nemotron Nano 2's blocks: Mamba-2, MLP, attention
    "nemotron_h": lambda: NemotronHConfig(**_COMMON, layers_block_type=[M, MLP, ATTN, M, MLP, M]),
    # Nemotron 3 Nano's: Mamba-2, MoE (grouped sigmoid router, shared expert), attention
    "nemotron_h_moe": lambda: NemotronHConfig(
        **_COMMON, **_MOE, layers_block_type=[M, MOE, ATTN, M, MOE, M]
    ),
    # dt's limits binding (HF clamps after the softplus), no convolution bias
    "nemotron_h_dt_limits": lambda: NemotronHConfig(
        **_COMMON,
        layers_block_type=[M, MLP, ATTN, M, MLP, M],
        time_step_limit=(0.4, 0.9),
        use_conv_bias=False,
    ),
}


def _model(config: NemotronHConfig, seed: int = 1):
    """A random target whose Mamba parameters are random too (see the module docstring)."""
    model = random_target(config, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    rand = lambda p, lo, hi: p.copy_(lo + (hi - lo) * torch.rand(p.shape, generator=generator))  # noqa: E731
    for layer in text_model(model).layers:
        if layer.block_type == M:
            mixer = layer.mixer
            rand(mixer.A_log, -1.0, 1.0)  # A in -[0.37, 2.7]
            rand(mixer.dt_bias, -1.0, 1.0)
            rand(mixer.D, -2.0, 2.0)
            rand(mixer.norm.weight, 0.5, 1.5)
    return model


_documents = partial(kit.documents, vocab=VOCAB, lengths=LENGTHS)
_packed = partial(kit.run_packed, budget=TOKEN_BUDGET, width=WIDTH)
_assert_rows_equal_each_document_alone = partial(
    kit.assert_rows_equal_each_document_alone, layer_ids=LAYER_IDS, atol=ATOL
)


def _forward(model, module=packed_mamba, attention: str = "sdpa"):
    return module.PackedMambaForward(
        text_model(model), LAYER_IDS, attention=attention, compile=False
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_packed_row_equals_its_document_run_alone_through_hf(variant: str) -> None:
    model, docs = _model(VARIANTS[variant]()), _documents()
    _assert_rows_equal_each_document_alone(model, docs, _packed(_forward(model), docs))


def test_selected_cpu_path_is_packed_and_exact() -> None:
    model, docs = _model(VARIANTS["nemotron_h_moe"](), seed=2), _documents(seed=3)
    packed = kit.selected_path_features(
        model, docs, name="packed_mamba", layer_ids=LAYER_IDS, budget=TOKEN_BUDGET, width=WIDTH
    )
    assert "packed" in planned_path("nemotron_h")
    _assert_rows_equal_each_document_alone(model, docs, packed)


def test_two_chained_stages_write_the_same_features_as_the_whole_forward() -> None:
    """A split target (targets/split.py): layers [0, 3) then [3, 6), hidden handed over."""
    model, docs = _model(VARIANTS["nemotron_h_moe"]()), _documents()
    splits = (range(0, 3), range(3, 6))
    out = kit.staged_features(
        model, docs, splits=splits, layer_ids=LAYER_IDS, budget=TOKEN_BUDGET, width=WIDTH
    )
    assert torch.equal(out, _packed(_forward(model), docs))


def test_flex_attention_path_writes_the_sdpa_features_on_the_cpu() -> None:
    """The GPU path's attention (flex, its BlockMask over tiles of 128) run eagerly on the CPU,
    T = 256 with documents across tile edges; same 1e-5 bound (summation order only)."""
    model = _model(VARIANTS["nemotron_h"]())
    docs = _documents(lengths=(70, 100, 3, 50), seed=5)
    kit.assert_flex_writes_the_sdpa_features(
        lambda attention: _forward(model, attention=attention), docs, width=WIDTH, atol=ATOL
    )


def _sequential_ssd(x, dt, A, B, C, starts) -> torch.Tensor:
    """The recurrence one row at a time, in float64: the reference of document_ssd."""
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    T, H, P = x.shape
    r = H // B.shape[1]
    B, C = B.repeat_interleave(r, dim=1), C.repeat_interleave(r, dim=1)  # [T, H, N]
    state = x.new_zeros(H, P, B.shape[-1])
    out = []
    for t in range(T):
        if starts[t]:
            state = torch.zeros_like(state)
        decay = torch.exp(dt[t] * A)[:, None, None]
        state = decay * state + (dt[t, :, None] * x[t])[..., None] * B[t, :, None, :]
        out.append(torch.einsum("hpn,hn->hp", state, C[t]))
    return torch.stack(out)


@pytest.mark.parametrize(("chunk", "rows"), [(8, 4096), (8, 8), (5, 10), (64, 4096)])
def test_document_ssd_equals_the_recurrence_run_row_by_row(
    chunk: int, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of 8 rows in one piece or one chunk per piece (the state handed between pieces),
    a chunk size that does not divide T, and one chunk longer than T. 1e-5: fp32 against fp64,
    outputs of size ~10."""
    monkeypatch.setattr(packed_mamba, "SSD_ROWS", rows)
    g = torch.Generator().manual_seed(0)
    T, H, P, G, N = 43, 4, 3, 2, 5
    x, B, C = (torch.randn(shape, generator=g) for shape in ((T, H, P), (T, G, N), (T, G, N)))
    dt = 0.1 + torch.rand(T, H, generator=g)
    A = -(0.2 + torch.rand(H, generator=g))
    doc_ids = torch.tensor([0] * 9 + [1] * 17 + [2] * 2 + [3] * 15)
    starts = torch.ones(T, dtype=torch.bool)
    starts[1:] = doc_ids[1:] != doc_ids[:-1]
    got = packed_mamba.document_ssd(x, dt, A, B, C, starts, chunk=chunk)
    want = _sequential_ssd(x, dt, A, B, C, starts)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


def _mutant(old: str, new: str):
    """packed_mamba with the one occurrence of `old` in its source replaced by `new`."""
    return kit.mutant_module(packed_mamba, (old, new))


# name -> (old, new, the variant it runs on, the first document it breaks)
MUTANTS = {
    "state_carried_across_a_document_start": (
        'torch.where(starts[s:e, None], float("-inf"), dt[s:e] * A)',
        "dt[s:e] * A",
        "nemotron_h",
        1,  # the first document has no document before it
    ),
    "conv_history_crosses_documents": (
        "document_conv(xbc, mixer.conv1d, doc_ids)",
        "document_conv(xbc, mixer.conv1d, torch.zeros_like(doc_ids))",
        "nemotron_h",
        1,
    ),
    "state_not_passed_from_chunk_to_chunk": (
        "entering[:n].view(n, G, r, P, N)",
        "torch.zeros_like(entering[:n]).view(n, G, r, P, N)",
        "nemotron_h",
        1,  # the first document lies within the first chunk
    ),
    "d_skip_dropped": ("y + mixer.D[:, None] * x", "y", "nemotron_h", 0),
    "gated_norm_over_the_whole_width": (
        "norm.weight, norm.group_size,",
        "norm.weight, y.shape[-1],",
        "nemotron_h",
        0,
    ),
    "dt_bias_dropped": (
        "F.softplus(dt + mixer.dt_bias.to(dt.dtype))",
        "F.softplus(dt)",
        "nemotron_h",
        0,
    ),
    "dt_softplus_dropped": (
        "F.softplus(dt + mixer.dt_bias.to(dt.dtype))",
        "dt + mixer.dt_bias.to(dt.dtype)",
        "nemotron_h",
        0,
    ),
    "dt_limits_dropped": (
        "torch.clamp(dt, min=mixer.time_step_limit[0], max=mixer.time_step_limit[1])",
        "dt",
        "nemotron_h_dt_limits",
        0,
    ),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_the_parity_check_catches_a_mutant_forward(mutant: str) -> None:
    old, new, variant, document = MUTANTS[mutant]
    model, docs = _model(VARIANTS[variant]()), _documents()
    broken = _forward(model, _mutant(old, new))
    with pytest.raises(AssertionError, match=f"document {document}"):
        _assert_rows_equal_each_document_alone(model, docs, _packed(broken, docs))


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("kind", ["nemotron_h", "nemotron_h_moe"])
def test_gpu_flex_packed_rows_equal_each_document_alone(
    kind: str, compile: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 on CUDA, the product's path (select_target_forward: flex over T = 256, tiles of 128,
    with documents across tile edges and many SSD chunks), compiled or not, against HF's forward
    on CUDA per document (its torch path where the Mamba kernels are not installed). No TF32:
    torch's default for matmuls and flex, and turned off here for cuDNN, which runs HF's
    convolution. Same 1e-5 bound as the CPU."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = _model(VARIANTS[kind]()).cuda()
    path = select_target_forward(
        model, LAYER_IDS, token_budget=256, max_batch_tokens=256, compile=compile
    )
    assert path.name == "packed_mamba" and "flex" in path.reason, path.reason
    docs = _documents(lengths=(70, 100, 3, 50), seed=5)
    out = kit.run_path(path.forward, docs, budget=256, width=WIDTH, device="cuda")
    _assert_rows_equal_each_document_alone(model, docs, out)
