"""The FP8 matmul path (targets/fp8/fp8_linear.py) on the CPU: torch._scaled_mm row-wise runs on e4m3
there (torch 2.13), so the linear, the experts and the swap at load are checked against pure-torch
references built from other code (targets/quantized.py's block quantizer, targets/fp8/fp8_reference.py's
per-token activation quantizer), with mutants.

Tolerance of one FP8 linear against the reference (both from the same e4m3 values and scales):
the reference sums dequant(x) @ dequant(W)^T in float64; the kernel accumulates the same products
in fp32 (error <= K * 2^-24 * (|x| @ |W|^T), the usual gamma_K bound, doubled for margin) and
rounds once to bf16 (<= 2^-8 |y|, half an ulp of bf16's 8-bit significand).
"""

from __future__ import annotations

import pytest
import torch
from arch_targets import save_tiny_target
from quant_kit import block_skewed, fp8_blocks, fp8_checkpoint
from target_kit import capture_features
from transformers import Qwen3MoeConfig

from dflash_async.kernels.fp8_format import FP8_DTYPE, FP8_MAX, quantize_rows
from dflash_async.targets.fp8 import fp8_experts, fp8_linear
from dflash_async.targets.fp8.fp8_experts import Fp8Experts
from dflash_async.targets.fp8.fp8_linear import (
    Fp8Linear,
    requantize_blocks_to_rows,
    set_fast_accum,
    swap_fp8_matmuls,
)
from dflash_async.targets.fp8.fp8_reference import dequantize_activations, quantize_activations
from dflash_async.targets.loading import load_served_target, random_target, text_model
from dflash_async.targets.quantized import quantize_fp8

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
T, K, N = 24, 160, 96  # K, N multiples of 16 (no padding) but not of 128
SMOKE = 0.25  # model-level FP8 vs unquantized features, relative: see the tests using it


def _skewed_tokens(x: torch.Tensor) -> torch.Tensor:
    """Token t scaled by 2^(t % 5 - 2): a scale from another token is off by >= 2x."""
    return x * 2.0 ** (torch.arange(x.shape[0])[:, None] % 5 - 2)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = _skewed_tokens(torch.randn(T, K, generator=g))
    w = block_skewed(torch.randn(N, K, generator=g) * 0.05, (1, K))  # rows differ by >= 2x
    return x, w


def _reference(x: torch.Tensor, module: Fp8Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [T, N] float64, the accumulation bound's |x| @ |W|^T) from the module's own e4m3
    weight and row scales, x quantized per token by fp8_reference (one group = the whole row)."""
    x_q, scale = quantize_activations(x, group=x.shape[1])
    xd = dequantize_activations(x_q, scale, group=x.shape[1]).double()
    wd = (module.weight.double() * module.weight_scale.double()[:, None])[: module.out_features]
    wd = wd[:, : x.shape[1]]
    return xd @ wd.T, xd.abs() @ wd.abs().T


def _within_bound(y, ref, magnitude, *, rounded=None) -> bool:
    """|y - ref| <= 2^-8 |rounded| + 2 K 2^-24 magnitude; `rounded`: what bf16 rounds (ref)."""
    rounded = ref.abs() if rounded is None else rounded
    bound = 2.0**-8 * rounded + 2 * K * 2.0**-24 * magnitude + 1e-30
    return bool(((y.double() - ref).abs() <= bound).all())


def test_row_scales_are_the_block_quantizer_with_one_row_blocks_and_tokens_never_share() -> None:
    x, w = _inputs()
    weight_q, scale = quantize_rows(w)
    block_q, block_scale = quantize_fp8(w, block=(1, K))  # targets/quantized.py, other code
    assert torch.equal(weight_q.view(torch.uint8), block_q.view(torch.uint8))
    torch.testing.assert_close(scale, block_scale[:, 0], rtol=0, atol=0)
    x_q, x_scale = fp8_linear.quantize_tokens(x)
    ref_q, ref_scale = quantize_activations(x, group=K)  # targets/fp8/fp8_reference.py
    assert torch.equal(x_q.view(torch.uint8), ref_q.view(torch.uint8))
    torch.testing.assert_close(x_scale, ref_scale, rtol=0, atol=0)
    # a token's scale is its own amax alone: changing another token leaves it as it was
    bumped = x.clone()
    bumped[1] *= 1000
    torch.testing.assert_close(fp8_linear.quantize_tokens(bumped)[1][[0, 2]], x_scale[[0, 2]])


def test_a_block_weight_requantized_per_row_stays_within_the_documented_bound() -> None:
    """|W_row - W| <= 2^-4 |W| + 2^-10 s_row per element (fp8_linear's module doc), and the
    requantization really rounds (it is not exact for skewed blocks)."""
    w = block_skewed(torch.randn(N, K) * 0.05, (32, 32))
    fp8, scale_inv, deq = fp8_blocks(w, (32, 32))  # tests/quant_kit.py: a served-style weight
    weight_q, row_scale = requantize_blocks_to_rows(fp8, scale_inv, block=(32, 32))
    again = weight_q.float() * row_scale[:, None]
    error = (again - deq).abs()
    assert (error <= 2.0**-4 * deq.abs() + 2.0**-10 * row_scale[:, None]).all()
    assert error.max() > 0
    print(f"block -> row requantization: relative Frobenius error {error.norm() / deq.norm():.4f}")


@pytest.mark.parametrize("kind", ["transposed", "shifted"])
def test_a_transposed_or_shifted_block_scale_breaks_the_requantization_bound(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dflash_async.targets import quantized

    original = quantized.expand_block_scales

    def mutant(scale, shape, block):
        moved = scale.transpose(-1, -2).reshape(scale.shape) if kind == "transposed" else None
        return original(scale.roll(1, dims=-1) if moved is None else moved, shape, block)

    monkeypatch.setattr(quantized, "expand_block_scales", mutant)
    w = block_skewed(torch.randn(N, K) * 0.05, (32, 32))
    fp8, scale_inv, deq = fp8_blocks(w, (32, 32))
    weight_q, row_scale = requantize_blocks_to_rows(fp8, scale_inv, block=(32, 32))
    error = (weight_q.float() * row_scale[:, None] - deq).abs()
    assert not (error <= 2.0**-4 * deq.abs() + 2.0**-10 * row_scale[:, None]).all()


def test_block_scales_a_power_of_two_apart_requantize_exactly() -> None:
    """The doc's exact case: every row of every block reaches 448 and the blocks' scales in a
    row differ by powers of two, no value falling below e4m3's normal range after the shift."""
    g = torch.Generator().manual_seed(0)
    values = (torch.rand(32, K, generator=g) * 400 + 16) * torch.randn(32, K, generator=g).sign()
    values[:, ::32] = 448.0  # each 1x32 block's amax
    fp8 = values.to(torch.float8_e4m3fn)
    scale_inv = 0.01 * 2.0 ** -(torch.arange(K // 32)[None] % 3).float().expand(32, -1)
    weight_q, row_scale = requantize_blocks_to_rows(fp8, scale_inv, block=(1, 32))
    deq = fp8.float() * scale_inv.repeat_interleave(32, dim=1)
    assert torch.equal(weight_q.float() * row_scale[:, None], deq)


@pytest.mark.parametrize("bias", [False, True])
def test_the_fp8_linear_equals_the_reference_within_the_derived_bound(bias: bool) -> None:
    x, w = _inputs()
    linear = torch.nn.Linear(K, N, bias=bias)
    linear.weight.data.copy_(w)
    module = Fp8Linear.from_linear(linear, out_dtype=torch.bfloat16)
    ref, magnitude = _reference(x, module)
    rounded = ref.abs()
    if bias:  # three bf16 roundings: x @ W^T, the bias itself, their sum (each <= 2^-8)
        b = linear.bias.double()
        rounded = rounded + b.abs() + (ref + b).abs()
        ref = ref + b
    y = module(x[None])[0]
    assert y.dtype == torch.bfloat16 and y.shape == (T, N)
    assert _within_bound(y, ref, magnitude, rounded=rounded)


def test_shapes_that_are_not_multiples_of_16_are_padded_and_cut() -> None:
    torch.manual_seed(0)  # unseeded, the loose bound below failed once after another test file
    linear = torch.nn.Linear(40, 24)
    module = Fp8Linear.from_linear(linear, out_dtype=torch.float32)
    assert module.weight.shape == (32, 48)
    x = torch.randn(3, 5, 40)
    assert module(x).shape == (3, 5, 24)
    torch.testing.assert_close(module(x), linear(x), rtol=0.15, atol=0.05)  # e4m3: loose


def _mutant(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    mm, tokens = fp8_linear.rowwise_mm, fp8_linear.quantize_tokens
    if kind == "weight scale of the next row":
        monkeypatch.setattr(
            fp8_linear,
            "rowwise_mm",
            lambda x_q, xs, w_q, ws, **kw: mm(x_q, xs, w_q, ws.roll(1, dims=-1), **kw),
        )
    elif kind == "weight scale transposed onto the tokens":
        # the [1, N] row scales read as token scales (their first T), tokens' as ones
        monkeypatch.setattr(
            fp8_linear,
            "rowwise_mm",
            lambda x_q, xs, w_q, ws, **kw: mm(
                x_q,
                ws[0, : x_q.shape[0], None].contiguous() * xs / xs,
                w_q,
                torch.ones_like(ws),
                **kw,
            ),
        )
    elif kind == "activation scale of the next token":

        def shifted(x):
            x_q, scale = tokens(x)
            return x_q, scale.roll(1, dims=0)

        monkeypatch.setattr(fp8_linear, "quantize_tokens", shifted)
    elif kind == "one activation scale for the whole pack":

        def shared(x):
            scale = x.float().abs().amax().clamp(min=1e-30) / FP8_MAX
            scale = scale.expand(x.shape[0], 1).contiguous()
            return (x.float() / scale).to(FP8_DTYPE), scale

        monkeypatch.setattr(fp8_linear, "quantize_tokens", shared)


@pytest.mark.parametrize(
    "kind",
    [
        "weight scale of the next row",
        "weight scale transposed onto the tokens",
        "activation scale of the next token",
        "one activation scale for the whole pack",
    ],
)
def test_a_misapplied_scale_fails_the_bound(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    x, w = _inputs()
    linear = torch.nn.Linear(K, N, bias=False)
    linear.weight.data.copy_(w)
    module = Fp8Linear.from_linear(linear, out_dtype=torch.bfloat16)
    ref, magnitude = _reference(x, module)
    _mutant(kind, monkeypatch)
    assert not _within_bound(module(x), ref, magnitude)


def _moe_config() -> Qwen3MoeConfig:
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


def test_fp8_experts_equal_a_token_by_token_reference() -> None:
    """Each (token, expert) pair by hand: x quantized per token, [gate; up] and down from the
    module's e4m3 rows and scales, h quantized per row; fp32 out, so only the summation order
    differs (the 1e-5 relative bound), unless an e4m3 rounding of h flips on it (seeded: none)."""
    experts = random_target(_moe_config(), seed=0).model.layers[0].mlp.experts
    module = Fp8Experts(experts, out_dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    hidden = _skewed_tokens(torch.randn(10, 64, generator=g))
    index = torch.randint(0, 8, (10, 2), generator=g)
    weights = torch.rand(10, 2, generator=g)
    gate_up = module.gate_up_proj.float() * module.gate_up_scale[..., None]
    down = module.down_proj.float() * module.down_scale[..., None]

    def per_token(v):
        q, s = quantize_activations(v[None], group=v.shape[-1])
        return dequantize_activations(q, s, group=v.shape[-1])[0]

    expected = torch.zeros(10, 64)
    for t in range(10):
        for j in range(2):
            e = int(index[t, j])
            gate, up = (gate_up[e] @ per_token(hidden[t])).chunk(2)
            h = experts.act_fn(gate) * up
            expected[t] += weights[t, j] * (down[e] @ per_token(h))
    torch.testing.assert_close(module(hidden, index, weights), expected, rtol=1e-5, atol=1e-6)


def test_the_gate_kernel_is_chosen_for_silu_experts_only_and_never_on_the_cpu() -> None:
    """The Triton gate (a GPU kernel) computes SiLU gates: ACT2FN["silu"] is one; another
    activation asked to run it is refused; on a CPU (compile off) the torch gate runs."""
    from transformers.activations import ACT2FN

    assert fp8_experts.is_silu(ACT2FN["silu"]) and fp8_experts.is_silu(torch.nn.SiLU())
    assert not fp8_experts.is_silu(ACT2FN["gelu"])
    experts = random_target(_moe_config(), seed=0).model.layers[0].mlp.experts
    assert fp8_experts.is_silu(experts.act_fn)
    cpu = Fp8Experts(experts, out_dtype=torch.float32)
    assert cpu._gated_rows.keywords == {"act_fn": experts.act_fn}  # the torch gate
    experts.act_fn = ACT2FN["gelu"]
    with pytest.raises(ValueError, match="SiLU"):
        Fp8Experts(experts, out_dtype=torch.float32, gate_kernel=True)


def test_the_swap_replaces_decoder_linears_and_experts_and_keeps_routers_in_bf16() -> None:
    model = random_target(_moe_config(), seed=0)
    layers = text_model(model).layers
    counts = swap_fp8_matmuls(layers, device=torch.device("cpu"), out_dtype=torch.float32)
    assert counts == {"linear": 8, "experts": 2, "kept": 0}  # q, k, v, o per layer
    assert isinstance(layers[0].mlp.experts, Fp8Experts)
    assert type(layers[0].mlp.gate).__name__ != "Fp8Linear"
    assert isinstance(model.lm_head, torch.nn.Linear)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory):
    return save_tiny_target(tmp_path_factory.mktemp("fp8_linear") / "qwen3", "qwen3")


def test_an_fp8_checkpoint_loads_into_fp8_matmuls_requantized_from_its_own_blocks(
    tiny_qwen3, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wiring, on a CPU told it has the kernel: every decoder linear is an Fp8Linear whose
    e4m3 rows are requantize_blocks_to_rows of the checkpoint's own e4m3 blocks (not of the
    dequantized weight), and the features stay near the dequantized model's. That distance is
    the format's, not a bug's: 0.10 relative here (0.07 from the weights' row requantization
    alone: the kit skews neighbouring blocks 2-16x, the worst case for one scale per row; the
    rest from the activations), measured, and amplified by a tiny random model; the bound
    SMOKE is loose on purpose (a broken swap gives O(1)); the GPU test bounds a real width
    against bf16's own noise."""
    from safetensors.torch import load_file

    folder, reference = fp8_checkpoint(tiny_qwen3, tmp_path, method="fp8", block=(32, 32))
    monkeypatch.setattr(fp8_linear, "kernel_problem", lambda device: None)
    model, weights = load_served_target(folder, device="cpu")
    assert (weights.kernel, weights.dequantized) == (fp8_linear.KERNEL, False)
    q_proj = text_model(model).layers[0].self_attn.q_proj
    assert isinstance(q_proj, Fp8Linear)
    files = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    expected, _ = requantize_blocks_to_rows(files[name], files[name + "_scale_inv"], block=(32, 32))
    n, k = expected.shape
    assert torch.equal(q_proj.weight[:n, :k].view(torch.uint8), expected.view(torch.uint8))
    ids = torch.arange(24).reshape(2, 12) * 37 % 500 + 10
    mask = torch.ones_like(ids)
    fp8 = capture_features(model, ids, mask, [0, 1])
    plain = capture_features(load_served_target(reference, device="cpu")[0], ids, mask, [0, 1])
    relative = float((fp8 - plain).norm() / plain.norm())
    print(f"fp8 checkpoint, FP8 matmuls vs dequantized: relative feature error {relative:.4f}")
    assert relative < SMOKE


def test_quantize_fp8_on_a_moe_target_runs_its_experts_and_linears_in_fp8_in_the_packed_forward(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QUANTIZE=fp8 with the kernel (a CPU told it has it): the packed MoE forward runs the
    swapped modules (Fp8Linear in the attention, Fp8Experts in the MoE block) and its features
    stay near the unquantized fp32 model's (SMOKE, as in the test above)."""
    import numpy as np

    from dflash_async.data.packing import layout_pack
    from dflash_async.targets.forward import select_target_forward

    folder = save_tiny_target(tmp_path / "qwen3_moe", "qwen3_moe")
    monkeypatch.setattr(fp8_linear, "kernel_problem", lambda device: None)
    model, weights = load_served_target(folder, device="cpu", quantize="fp8")
    plain = load_served_target(folder, device="cpu")[0]
    assert weights.kernel == fp8_linear.KERNEL
    layers = text_model(model).layers
    assert isinstance(layers[0].mlp.experts, Fp8Experts)
    assert isinstance(layers[0].self_attn.o_proj, Fp8Linear)
    rng = np.random.default_rng(0)
    docs = [(rng.integers(10, 400, n), np.ones(n, dtype=bool)) for n in (20, 9, 30)]
    layout = layout_pack(docs, 64)
    out = []
    for m in (model, plain):
        path = select_target_forward(m, [0, 1], token_budget=64, max_batch_tokens=64)
        assert path.name == "packed_moe", path.reason
        features = torch.zeros(64, 2 * m.config.hidden_size)
        path.forward(layout.input_ids, layout.position_ids, layout.doc_ids, features, None)
        out.append(features)
    relative = float((out[0] - out[1]).norm() / out[1].norm())
    print(f"QUANTIZE=fp8 MoE, FP8 matmuls vs fp32: relative feature error {relative:.4f}")
    assert relative < SMOKE  # measured 0.04 (no skewed blocks here)
    assert not out[0][59:].any()  # padding rows stay zero


def test_fast_accumulation_is_on_after_the_swap_and_set_off_on_every_fp8_module() -> None:
    layers = text_model(random_target(_moe_config(), seed=0)).layers
    swap_fp8_matmuls(layers, device=torch.device("cpu"), out_dtype=torch.float32)
    fp8 = [m for m in layers.modules() if isinstance(m, Fp8Linear | Fp8Experts)]
    assert len(fp8) == 10 and all(m.fast_accum for m in fp8)  # 8 linears, 2 experts
    assert set_fast_accum(layers, False) == 10 and not any(m.fast_accum for m in fp8)


def test_projections_of_one_input_quantize_it_once_and_give_what_each_linear_gives() -> None:
    """fp8_linear.project (the attention's q, k and v): x quantized once, the same e4m3 rows and
    scales each linear computes, so the same outputs bit for bit; a plain linear among them
    makes every one run on its own."""
    x, _ = _inputs()
    g = torch.Generator().manual_seed(4)
    linears = [torch.nn.Linear(K, n, bias=n == N) for n in (N, 16, 16)]
    for linear in linears:
        linear.weight.data = torch.randn(linear.weight.shape, generator=g) * 0.05
    fp8 = [Fp8Linear.from_linear(linear, out_dtype=torch.float32) for linear in linears]
    for got, want in zip(fp8_linear.project(fp8, x), [m(x) for m in fp8], strict=True):
        assert torch.equal(got, want)
    mixed = [fp8[0], linears[1], fp8[2]]
    for got, want in zip(fp8_linear.project(mixed, x), [m(x) for m in mixed], strict=True):
        assert torch.equal(got, want)


def test_the_projections_comparison_catches_scales_shared_by_all_tokens(monkeypatch) -> None:
    x, _ = _inputs()
    fp8 = [Fp8Linear.from_linear(torch.nn.Linear(K, 16), out_dtype=torch.float32) for _ in "qk"]
    want = [m(x) for m in fp8]
    quantize = fp8_linear.quantize_tokens

    def one_scale(flat):  # the mutant: every token quantized with the largest token's scale
        _, scale = quantize(flat)
        top = scale.max()
        return (flat / top).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), top.expand_as(scale).clone()

    monkeypatch.setattr(fp8_linear, "quantize_tokens", one_scale)
    got = fp8_linear.project(fp8, x)
    assert not torch.allclose(got[0], want[0], rtol=1e-2, atol=1e-3)
