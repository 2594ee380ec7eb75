"""targets/grouped_experts.py: `CompiledExperts` computes what the HF experts module it replaces
computes (its parts compiled on CUDA; on the CPU the same functions run eagerly), and the swap
takes only the experts it computes exactly."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, GptOssConfig, Qwen3MoeConfig

from dflash_async.targets import grouped_experts
from dflash_async.targets.grouped_experts import CompiledExperts, swap_compiled_experts
from dflash_async.targets.loading import random_target, text_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _qwen3_moe() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
    )


def _deepseek_v3() -> DeepseekV3Config:
    return DeepseekV3Config(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
        vocab_size=300,
    )


def _routing(tokens: int, experts: int, k: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, 64, generator=g)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    return hidden, index, torch.rand(tokens, k, generator=g)


# fp32 on the CPU: the same products and the same k-sum; only the matmuls' blocking can differ
# (K <= 64 terms: ~64 * 2^-24 ~ 4e-6 relative per element), hence rtol 1e-5
@pytest.mark.parametrize("config", [_qwen3_moe, _deepseek_v3], ids=["qwen3_moe", "deepseek_v3"])
def test_compiled_experts_equal_the_hf_experts_they_replace(config) -> None:
    experts = text_model(random_target(config(), seed=0)).layers[1].mlp.experts
    hidden, index, weights = _routing(37, experts.num_experts, 2)
    expected = experts(hidden, index, weights)
    got = CompiledExperts(experts, compile=False)(hidden, index, weights)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_combine_that_forgets_the_permutation_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    experts = text_model(random_target(_qwen3_moe(), seed=0)).layers[0].mlp.experts
    hidden, index, weights = _routing(37, 8, 2)
    expected = experts(hidden, index, weights)

    def unpermuted(out, top_k_weights, perm, dtype, residual=None):  # rows left in expert order
        tokens, k = top_k_weights.shape
        out = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
        return out.view(tokens, k, -1).sum(dim=1).to(dtype)

    monkeypatch.setattr(grouped_experts, "combine", unpermuted)
    got = CompiledExperts(experts, compile=False)(hidden, index, weights)
    assert not torch.allclose(got, expected, rtol=1e-3, atol=1e-4)


def _experts_with_residual(experts, hidden, index, weights):
    residual = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(7))
    residual = residual.to(hidden.dtype)
    return experts(hidden, index, weights, residual=residual), residual + experts(
        hidden, index, weights
    )


def test_the_residual_is_added_after_the_experts_output_is_rounded() -> None:
    """`residual` gives exactly what the decoder layer's own add gives: the experts' bf16 output
    (one rounding of the fp32 sum), then the bf16 add (a second rounding), bit for bit."""
    hf = text_model(random_target(_qwen3_moe(), seed=0)).layers[0].mlp.experts
    experts = CompiledExperts(hf.to(torch.bfloat16), compile=False)
    hidden, index, weights = _routing(37, 8, 2)
    got, want = _experts_with_residual(experts, hidden.bfloat16(), index, weights.bfloat16())
    assert torch.equal(got, want)


def test_the_residual_comparison_catches_an_add_before_the_rounding(monkeypatch) -> None:
    combine = grouped_experts.combine

    def unrounded(out, top_k_weights, perm, dtype, residual=None):  # the mutant: one rounding
        total = combine(out.float(), top_k_weights, perm, torch.float32)  # the fp32 sum
        return (total + residual.float()).to(dtype)

    hf = text_model(random_target(_qwen3_moe(), seed=0)).layers[0].mlp.experts
    monkeypatch.setattr(grouped_experts, "combine", unrounded)
    experts = CompiledExperts(hf.to(torch.bfloat16), compile=False)
    hidden, index, weights = _routing(37, 8, 2)
    monkeypatch.setattr(grouped_experts, "combine", combine)  # the reference's own call
    reference = CompiledExperts(hf.to(torch.bfloat16), compile=False)
    residual = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(7)).bfloat16()
    hidden, weights = hidden.bfloat16(), weights.bfloat16()
    got = experts(hidden, index, weights, residual=residual)
    # one rounding instead of two: they differ where the first rounding moved the sum across a
    # midpoint of the second, a few percent of bf16 values here
    assert not torch.equal(got, residual + reference(hidden, index, weights))


def test_the_swap_keeps_the_model_output_and_leaves_biased_experts_alone() -> None:
    model = random_target(_qwen3_moe(), seed=0)
    ids = torch.randint(0, 300, (2, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(ids).logits
        counts = swap_compiled_experts(text_model(model).layers, compile=False)
        after = model(ids).logits
    assert counts == {"swapped": 2, "kept": 0}
    assert isinstance(text_model(model).layers[0].mlp.experts, CompiledExperts)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)  # as the test above
    oss = GptOssConfig(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=300,
    )
    layers = text_model(random_target(oss, seed=0)).layers
    assert swap_compiled_experts(layers, compile=False) == {"swapped": 0, "kept": 2}  # biases


@pytest.mark.gpu
@cuda
def test_compiled_experts_on_the_gpu_equal_hf_in_bf16() -> None:
    """bf16 on the GPU, parts compiled: the same ops in the same order as HF's
    grouped_mm_experts_forward, so only fusion's rounding differs: within 2 bf16 ulps (2^-7)."""
    model = random_target(_qwen3_moe(), seed=0).to("cuda", torch.bfloat16)
    experts = text_model(model).layers[0].mlp.experts
    hidden, index, weights = (t.cuda() for t in _routing(512, 8, 2))
    hidden, weights = hidden.bfloat16(), weights.bfloat16()
    expected = experts(hidden, index, weights).float()
    got = CompiledExperts(experts)(hidden, index, weights).float()
    assert float((got - expected).norm() / expected.norm()) < 2**-7


def test_the_swap_leaves_fp8_experts_alone() -> None:
    """Fp8Experts keep e4m3 weights under HF's names (gate_up_proj, down_proj), so only the
    type tells them apart; a CompiledExperts around them would run bf16 products on e4m3 bits."""
    from dflash_async.targets.fp8.fp8_experts import Fp8Experts
    from dflash_async.targets.fp8.fp8_linear import swap_fp8_matmuls

    layers = text_model(random_target(_qwen3_moe(), seed=0)).layers
    swap_fp8_matmuls(layers, device=torch.device("cpu"), out_dtype=torch.float32)
    assert swap_compiled_experts(layers) == {"swapped": 0, "kept": 2}
    assert all(isinstance(layer.mlp.experts, Fp8Experts) for layer in layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_only_bf16_compiled_experts_are_replayed_from_a_cuda_graph(dtype: torch.dtype) -> None:
    """torch._grouped_mm's kernel takes its offsets on the device for bf16 alone; other dtypes
    take its fallback, which copies them to the host, a sync no CUDA graph can capture. So the
    graph is refused, saying why, for any other experts dtype (checked on the CPU: the choice
    reads the dtype only)."""
    from dflash_async.targets.forward import _grouped_experts_sync
    from dflash_async.targets.packed.dense import PackedDenseForward

    model = random_target(_qwen3_moe(), seed=0).to(dtype)
    swap_compiled_experts(text_model(model).layers, compile=False)
    packed = PackedDenseForward(text_model(model), (0, 1), attention="sdpa", compile=False)
    why = _grouped_experts_sync(packed)
    assert why is None if dtype == torch.bfloat16 else "float32 experts" in why
