"""bench target's weight accounting (counted from the model's tensors, not the allocator), its
FLOP count and its reference forwards."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_async.bench.target_bench import REFERENCES, weight_bytes
from dflash_async.data.packing import layout_pack


def _model(*, tied: bool) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


def _nbytes(module: torch.nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def test_weight_bytes_counts_every_tensor_once_and_the_held_part_is_embedding_plus_layers():
    for tied in (False, True):
        model = _model(tied=tied)
        decoder = model.model
        whole, held = weight_bytes(model, [0, 2])
        # parameters() already yields a tied tensor once, so the plain sum is the reference
        assert whole == _nbytes(model)
        assert held == _nbytes(decoder.embed_tokens) + sum(
            _nbytes(decoder.layers[i]) for i in range(3)
        )


def test_weight_bytes_ignores_activations_alive_at_the_time():
    model = _model(tied=False)
    before = weight_bytes(model, [1])
    features = torch.empty(1024, 1024)  # an earlier row's output, alive while weights are counted
    assert weight_bytes(model, [1]) == before and features.numel() > 0


def test_the_longcat_flash_shape_fits_a_140_gb_gpu_or_is_skipped_with_a_reason():
    """Its 3 listed layers (6 sublayers) plus embedding and lm_head: 61.5B parameters, 123 GB
    in bf16, and a fourth layer (20.0B) would not fit; the taps are listed layers."""
    import transformers

    from dflash_async.bench.target_shapes import shape_configs, unavailable_shapes
    from dflash_async.targets.families import decoder_layer_count

    if "longcat-flash-3l" in unavailable_shapes():
        assert "LongcatFlashConfig" in unavailable_shapes()["longcat-flash-3l"]
        assert "longcat-flash-3l" not in shape_configs()
        return
    config, taps = shape_configs()["longcat-flash-3l"]
    assert decoder_layer_count(config) == 3 and max(taps) < 3
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert 2 * total < 130e9 < 140e9 < 2 * (total + layer)


def test_forward_flops_count_every_attention_sublayer_of_a_layer():
    """A LongCat-Flash layer holds two attention sublayers: twice one MLA layer's pairs."""
    import numpy as np
    import transformers

    from dflash_async.bench.target_bench import _attention_flops, forward_flops

    if not hasattr(transformers, "LongcatFlashConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no LongcatFlashConfig")
    config = transformers.LongcatFlashConfig(
        vocab_size=96,
        hidden_size=32,
        num_layers=1,
        num_attention_heads=2,
        ffn_hidden_size=64,
        expert_ffn_hidden_size=16,
        n_routed_experts=4,
        zero_expert_num=2,
        moe_topk=2,
        q_lora_rank=16,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        head_dim=4,
        v_head_dim=8,
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    lengths = np.array([5, 9])
    weights = forward_flops(model, [0], lengths) - 2 * _attention_flops(config, 0, lengths)
    layer = model.model.layers[0]
    share = {".experts.": 2 / 4}  # top 2 of the 4 routed experts' rows
    want = sum(
        2 * 14 * p.numel() * next((v for k, v in share.items() if k in f".{n}."), 1.0)
        for n, p in layer.named_parameters()
        if p.ndim >= 2
    )
    assert weights == want


def test_both_references_write_the_same_features_for_a_pack() -> None:
    """`--reference hf` (padded batches) and `generic` (documents alone) are both exact: on one
    pack of documents of unequal lengths they agree to fp32 rounding (1e-5: the same matmuls on
    the same rows, padded keys masked to exact zeros; features of order 1), padding rows zero."""
    import numpy as np

    model = _model(tied=False).eval()
    rng = np.random.default_rng(0)
    lengths = np.array([7, 12, 5])
    docs = [(rng.integers(0, 96, n), np.ones(n, dtype=bool)) for n in lengths]
    layout = layout_pack(docs, 32)
    args = (layout.input_ids, layout.position_ids, layout.doc_ids)
    outs = {}
    for name, make in sorted(REFERENCES.items()):
        outs[name] = torch.full((32, 2 * 32), float("nan"))
        make(model, (1, 3), 32)(*args, outs[name], lengths)
    assert torch.equal(outs["hf"][24:], torch.zeros(8, 64))  # 24 real rows
    torch.testing.assert_close(outs["generic"], outs["hf"], rtol=0, atol=1e-5)


def test_deepseek_v4_attention_flops_count_its_window_its_compressed_entries_and_its_indexer():
    """DeepSeek-V4's layers, counted query by query: a sliding layer sees min(i, W) keys; a
    heavily compressed one adds floor(i / rate) entries; the sparse one's indexer scores all
    floor(i / rate) entries and the query attends min(that, top-k) of them. Both sides are sums
    of small integers times exact products, so they are equal, not close."""
    import numpy as np
    import transformers

    from dflash_async.bench.target_bench import _attention_flops

    if not hasattr(transformers, "DeepseekV4Config"):
        pytest.skip(f"transformers {transformers.__version__} has no DeepseekV4Config")
    kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    config = transformers.DeepseekV4Config(
        num_hidden_layers=3,
        layer_types=kinds,
        num_attention_heads=2,
        head_dim=16,
        sliding_window=4,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 8},
        index_topk=3,
        index_n_heads=2,
        index_head_dim=8,
    )
    lengths = np.array([5, 20])
    queries = [i for m in lengths for i in range(1, m + 1)]  # 1-based position in its document
    per_pair, per_score = 2 * 2 * 2 * 16, 2 * 2 * 8
    window = sum(min(i, 4) for i in queries)
    want = {
        "sliding_attention": per_pair * window,
        "compressed_sparse_attention": per_pair * (window + sum(min(i // 2, 3) for i in queries))
        + per_score * sum(i // 2 for i in queries),
        "heavily_compressed_attention": per_pair * (window + sum(i // 8 for i in queries)),
    }
    got = {kind: _attention_flops(config, index, lengths, 16) for index, kind in enumerate(kinds)}
    assert got == want


def test_indexed_attention_flops_count_the_indexer_where_a_layer_has_one_and_the_top_k_keys():
    """DeepSeek-V3.2's and GLM-5's sparse layers, counted query by query: the indexer scores the
    i keys query i sees (2 * index heads * index width each) and the MLA attends min(i, top-k)
    of them; GLM-5's "shared" layers reuse the previous layer's top-k and score nothing. Sums of
    small integers times exact products: equal, not close."""
    import numpy as np
    import transformers

    from dflash_async.bench.target_bench import _attention_flops

    if not hasattr(transformers, "GlmMoeDsaConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no GlmMoeDsaConfig")
    config = transformers.GlmMoeDsaConfig(
        num_hidden_layers=2,
        num_attention_heads=2,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        index_topk=3,
        index_n_heads=2,
        index_head_dim=8,
        indexer_types=["full", "shared"],
    )
    lengths = np.array([5, 20])
    queries = [i for m in lengths for i in range(1, m + 1)]  # 1-based position in its document
    attended = 2 * 2 * (8 + 4 + 8) * sum(min(i, 3) for i in queries)  # QK^T width 12, PV 8
    scored = 2 * 2 * 8 * sum(queries)
    assert _attention_flops(config, 0, lengths) == attended + scored
    assert _attention_flops(config, 1, lengths) == attended
