"""The packed Kimi-Linear forward (targets/packed/kda.py) equals each document run alone through HF,
row for row: KDA convolutions and delta-rule states per document, NoPE MLA document-causal, the
grouped-router MoE.

Tolerance 1e-5 in fp32, as tests/targets/test_target_packed.py derives it: on the CPU both sides
run HF's own chunked KDA on the same rows of each document, so they differ only in the summation
order of the projections over a pack's rows against a document's, of the convolution's taps
(document_conv adds them in another order than F.conv1d) and of the attention (masked keys add
exact zeros): a few fp32 ulps per layer over 5 layers, of features up to 4.5 in size (ulp 4.8e-7
between 4 and 8): measured at most 7.3e-6 over the variants. The router is discrete, but a flip between two experts
needs their scores within those ulps: with these seeds none does (a flip would show as an O(0.1)
row error, never as a silent pass). The weights are drawn with initializer_range 0.1 (not HF's
0.02) and the score-correction bias at random (HF zeroes it), so that every term moves features by
far more than the tolerance: the mutant tests below check that (measured, the largest error over
the documents a mutant breaks: KDA state carried across documents 5.1, convolution across a
boundary 4.9, output gate dropped 4.8, MLA attending across documents 3.8). Two documents (70, 90 rows) are longer than the KDA's
64-row chunks, so their states pass between chunks; the last (3 rows) is shorter than the
convolution.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys

import numpy as np
import pytest
import torch
from target_kit import capture_features
from transformers import KimiLinearConfig, PretrainedConfig

from dflash_async.data.packing import layout_pack, pack_row_offsets
from dflash_async.targets.families import family_of, planned_path
from dflash_async.targets.forward import select_target_forward
from dflash_async.targets.loading import random_target, text_model
from dflash_async.targets.packed import kda as packed_kda

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

ATOL = 1e-5  # see the module docstring
LENGTHS = (70, 12, 90, 3)  # two documents across the 64-row KDA chunks, one below the conv width
TOKEN_BUDGET = 200  # 175 real rows + 25 padding rows
LAYER_IDS = (0, 2, 4)  # KDA (dense MLP), KDA after an MLA layer (MoE), the last MLA layer
VOCAB = 300
# MLA second, so that every later layer sees every document's attention
LAYER_TYPES = [
    "linear_attention",
    "full_attention",
    "linear_attention",
    "linear_attention",
    "full_attention",
]

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=5,
    layer_types=LAYER_TYPES,
    num_attention_heads=4,
    num_key_value_heads=4,  # MLA: every head its own keys (HF's expand_kv)
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_token=2,
    num_shared_experts=1,
    num_expert_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    linear_head_dim=16,
    linear_num_heads=2,
    linear_conv_kernel_dim=4,
    initializer_range=0.1,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)

VARIANTS = {
    "kimi_linear": lambda: KimiLinearConfig(**_COMMON, q_lora_rank=None),  # the published q
    "kimi_linear_q_lora": lambda: KimiLinearConfig(**_COMMON, q_lora_rank=32),
}


def _model(config: PretrainedConfig, seed: int = 1):
    """A random target whose routers' score-correction biases are random too (HF zeroes them)."""
    model = random_target(config, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    for layer in text_model(model).layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            bias = gate.e_score_correction_bias
            bias.copy_(0.2 * torch.randn(bias.shape, generator=generator))
    return model


def _documents(lengths=LENGTHS, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, VOCAB, n), np.ones(n, dtype=bool)) for n in lengths]


def _nan_features(rows: int = TOKEN_BUDGET, device: str = "cpu") -> torch.Tensor:
    """The slot's buffer, poisoned: every row must be written."""
    return torch.full((rows, len(LAYER_IDS) * 64), float("nan"), device=device)


def _packed(forward, docs, budget: int = TOKEN_BUDGET, positions=None) -> torch.Tensor:
    layout = layout_pack(docs, budget)
    lengths = np.array([len(d[0]) for d in docs])
    position_ids = layout.position_ids if positions is None else positions
    out = _nan_features(budget)
    return forward(layout.input_ids, position_ids, layout.doc_ids, out, lengths)


def _alone(model, docs) -> list[torch.Tensor]:
    """Each document's features through HF alone [n, k*d]."""
    out = []
    for ids, _ in docs:
        ids = torch.as_tensor(ids)[None]
        out.append(capture_features(model, ids, torch.ones_like(ids), LAYER_IDS)[0])
    return out


def _assert_rows_equal_each_document_alone(packed: torch.Tensor, alone, lengths) -> None:
    offsets = pack_row_offsets(np.array(lengths))
    for j, reference in enumerate(alone):
        rows = packed[offsets[j] : offsets[j + 1]].to(reference.device)
        torch.testing.assert_close(rows, reference, atol=ATOL, rtol=0, msg=f"document {j}")
    assert torch.equal(packed[offsets[-1] :], torch.zeros_like(packed[offsets[-1] :]))


def _forward(model, module=packed_kda, attention: str = "sdpa"):
    return module.PackedKDAForward(
        text_model(model), LAYER_IDS, kernel=module.torch_kda(), attention=attention, compile=False
    )


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple]:
    """variant -> (model, documents, each document's HF features alone), built once."""
    out = {}
    for variant, config in VARIANTS.items():
        model, docs = _model(config()), _documents()
        out[variant] = (model, docs, _alone(model, docs))
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_packed_row_equals_its_document_run_alone_through_hf(reference, variant) -> None:
    model, docs, alone = reference[variant]
    _assert_rows_equal_each_document_alone(_packed(_forward(model), docs), alone, LENGTHS)


def test_selected_cpu_path_is_the_packed_kda_forward_and_exact(reference) -> None:
    model, docs, alone = reference["kimi_linear"]
    path = select_target_forward(model, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=64)
    assert path.name == "packed_kda" and "torch" in path.reason, path.reason
    assert "packed" in planned_path("kimi_linear")
    assert family_of(model.config).decoding.linear_state
    _assert_rows_equal_each_document_alone(_packed(path.forward, docs), alone, LENGTHS)


def test_the_packed_hybrid_switch_turns_it_off() -> None:
    model = _model(VARIANTS["kimi_linear"]())
    path = select_target_forward(
        model, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=64, packed_hybrid=False
    )
    assert path.name == "hf" and "PACKED_HYBRID=false" in path.reason


def test_two_chained_stages_write_the_same_features_as_the_whole_forward(reference) -> None:
    """A split target (targets/split.py): layers [0, 3) then [3, 5), hidden handed over."""
    model, docs, _ = reference["kimi_linear"]
    layout = layout_pack(docs, TOKEN_BUDGET)
    args = (layout.input_ids, layout.position_ids, layout.doc_ids)
    out, hidden = _nan_features(), None
    for layers in (range(0, 3), range(3, 5)):
        stage = select_target_forward(
            model, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=64, layers=layers
        )
        hidden = stage.stage(hidden, *args, out, np.array(LENGTHS))
    assert torch.equal(out, _packed(_forward(model), docs))


def test_flex_attention_path_writes_the_sdpa_features_on_the_cpu(reference) -> None:
    """The GPU path's attention (flex, its BlockMask over tiles of 128) run eagerly on the CPU,
    T = 256 with documents across tile edges; same 1e-5 bound (summation order only)."""
    model = reference["kimi_linear"][0]
    docs = _documents((70, 100, 3, 50), seed=5)
    outs = [_packed(_forward(model, attention=a), docs, 256) for a in ("sdpa", "flex")]
    torch.testing.assert_close(outs[1], outs[0], atol=ATOL, rtol=0)


def test_features_do_not_depend_on_the_positions_no_layer_reads_them(reference) -> None:
    """Kimi-Linear's MLA is NoPE (no rotary module): positions running on across the pack
    instead of restarting per document give the very same features."""
    model, docs, _ = reference["kimi_linear"]
    forward = _forward(model)
    across = torch.arange(TOKEN_BUDGET)
    assert torch.equal(_packed(forward, docs, positions=across), _packed(forward, docs))


def _mutant(old: str, new: str):
    """packed_kda with the one occurrence of `old` in its source replaced by `new`."""
    source = inspect.getsource(packed_kda)
    assert source.count(old) == 1, old
    spec = importlib.util.spec_from_loader("packed_kda_mutant", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    try:
        exec(compile(source.replace(old, new), "packed_kda_mutant", "exec"), module.__dict__)
    finally:
        del sys.modules[spec.name]
    return module


# name -> (old, new, the first document it breaks)
MUTANTS = {
    # one delta-rule state through the whole pack
    "kda_state_carried_across_documents": (
        "bounds = s.cu_cpu.tolist()",
        "bounds = [0, s.cu_cpu.tolist()[-1]]",
        1,  # the first document has no document before it
    ),
    "conv_history_crosses_documents": (
        "document_conv(mixed, kda.conv1d, doc_ids)",
        "document_conv(mixed, kda.conv1d, torch.zeros_like(doc_ids))",
        1,
    ),
    # sigmoid(0) * 2 = 1: the gated RMSNorm's gate gone
    "output_gate_dropped": (
        "kda.o_norm(core, gate)",
        "(kda.o_norm(core, torch.zeros_like(gate)) * 2)",
        0,
    ),
    "mla_attends_across_documents": (
        "mask = self.mask(doc_ids)",
        "mask = self.mask(torch.zeros_like(doc_ids))",
        1,
    ),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_the_parity_check_catches_a_mutant_forward(reference, mutant: str) -> None:
    old, new, document = MUTANTS[mutant]
    model, docs, alone = reference["kimi_linear"]
    broken = _packed(_forward(model, _mutant(old, new)), docs)
    with pytest.raises(AssertionError, match=f"document {document}"):
        _assert_rows_equal_each_document_alone(broken, alone, LENGTHS)


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_gpu_fla_packed_rows_equal_each_document_alone(compile: bool) -> None:
    """fp32 on CUDA, the product's path (select_target_forward: fla's varlen chunk_kda, flex over
    T = 256, tiles of 128, documents across tile edges and KDA chunks; the experts as
    CompiledExperts), compiled or not. The reference is a copy of the model, run by HF on the GPU
    each document alone before the experts are swapped (its KDA: fla's chunk_kda where HF's hub
    fallback finds fla, else its torch chunks).

    Bound: relative max difference 5e-3 per document, as the Qwen3.5 hybrid's GPU test derives
    it (tests/targets/test_target_hybrid.py): fla's triton dots on fp32 inputs run TF32 (10-bit
    mantissa, 4.9e-4 relative per operand), operands an fp32 ulp apart may round to neighbouring
    TF32 values, ~2 such dot stages per KDA layer over 5 layers stay within 10 x 4.9e-4. A state
    leaked across a boundary or a missing gate moves the rows by O(1) relative."""
    import copy

    model = _model(VARIANTS["kimi_linear"]()).cuda()
    reference = copy.deepcopy(model)
    path = select_target_forward(
        model, LAYER_IDS, token_budget=256, max_batch_tokens=256, compile=compile
    )
    assert path.name == "packed_kda" and "fla chunk_kda" in path.reason, path.reason
    assert "flex" in path.reason, path.reason
    docs = _documents((70, 100, 3, 50), seed=5)
    layout = layout_pack(docs, 256).to("cuda")
    out = _nan_features(256, "cuda")
    lengths = np.array([len(d[0]) for d in docs])
    path.forward(layout.input_ids, layout.position_ids, layout.doc_ids, out, lengths)
    offsets = pack_row_offsets(lengths)
    relative = []
    for j, (ids, _) in enumerate(docs):
        ids = torch.as_tensor(ids, device="cuda")[None]
        alone = capture_features(reference, ids, torch.ones_like(ids), LAYER_IDS)[0]
        rows = out[offsets[j] : offsets[j + 1]]
        relative.append(float((rows - alone).abs().max() / rows.abs().max()))
    print(f"fp32 fla packed vs alone, relative max diff per document: {relative}")  # pytest -s
    assert max(relative) < 5e-3, relative
    assert torch.equal(out[offsets[-1] :], torch.zeros_like(out[offsets[-1] :]))
