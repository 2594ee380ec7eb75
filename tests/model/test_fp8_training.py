"""The drafter's FP8 training matmuls (model/fp8_training.py, DFLASH_TRAIN__FP8_MATMULS), on the
CPU.

The Function's output and both gradients are checked against a reference written here (each row
quantized by hand, dequantized, multiplied in fp64), within bounds derived from the arithmetic:

- Against the dequantized reference the only differences are the product's own rounding: an fp32
  dot product of n terms is within gamma_n = n * 2^-24 of the exact sum of |terms| (plus one
  rounding of each dequantized operand and of their product: 3 * 2^-24 more), and a bf16 output
  adds half an ulp, 2^-8 relative (bf16 keeps 8 significant bits, unit roundoff u = 2^-8).
- Against the unquantized product: e4m3 keeps 4 significant bits (3 stored), u = 2^-4, so each
  normal operand moves by at most 2^-4 of itself; below 2^-6 (e4m3's smallest normal, in units of
  the row's scale s) the spacing is 2^-9, half of it 2^-10 s. Per operand e = 2^-4 |v| + 2^-10 s,
  and |x^ w^ - x w| <= |x| e_w + e_x |w| + e_x e_w, summed over k.

The operands have rows (and columns) of very different magnitudes (log-normal), so a scale along
the wrong axis is far outside these bounds: the mutants below (each monkeypatched into the
module's own functions, not a test hook in the product) are caught.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import TinySpec, tiny_batch, tiny_config, tiny_target_weights
from torch import nn

from dflash_async.checkpoint.state import FP8_MATMULS_KEY, check_run_identity, run_identity
from dflash_async.errors import SettingsError
from dflash_async.kernels.fp8_format import (
    FP8_DTYPE,
    FP8_MAX,
    quantize_rows,
    rowwise_kernel_problem,
)
from dflash_async.model import fp8_training
from dflash_async.model.build import StepSpec, build_drafter_step
from dflash_async.model.drafter import DraftLayer, layer_forward
from dflash_async.model.fp8_training import Fp8TrainingLinear, fp8_matmul, use_fp8_matmuls
from dflash_async.model.kinds import kind_of
from dflash_async.settings.env import load_settings

pytestmark = pytest.mark.usefixtures("single_thread")

M, K, N = 40, 96, 64  # tokens, in and out features (multiples of 16, as _scaled_mm needs)
U_FP32, U_BF16, U_E4M3 = 2.0**-24, 2.0**-8, 2.0**-4
E4M3_SUBNORMAL_HALF_SPACING = 2.0**-10  # in units of the row's scale
NO_FILE = {"DFLASH_ENV_FILE": "none"}


def _skewed(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Gaussian values times log-normal row and column magnitudes (e^N(0, 1.5), ~0.01-100)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, cols, generator=g)
    row = torch.exp(1.5 * torch.randn(rows, 1, generator=g))
    col = torch.exp(1.5 * torch.randn(1, cols, generator=g))
    return values * row * col


def _by_hand(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row scaled so that its largest |value| is 448, rounded to e4m3, dequantized (fp64);
    and the scales. Written here apart from fp8_format.quantize_rows (the same formula)."""
    v = v.float()
    scales = []
    rows = []
    for row in v:
        amax = row.abs().max()
        s = amax / FP8_MAX if amax > 0 else torch.tensor(1.0)
        rows.append((row / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).double() * s.double())
        scales.append(s)
    return torch.stack(rows), torch.stack(scales).double()


def _dequantized_bound(a_deq, b_deq, n: int, *, out_dtype) -> torch.Tensor:
    """|computed - reference| bound of an fp32 product of the dequantized operands (module doc)."""
    bound = (n + 3) * U_FP32 * (a_deq.abs() @ b_deq.abs().t())
    if out_dtype == torch.bfloat16:  # half an ulp of the fp32 result, which is within `bound`
        bound = bound * (1 + U_BF16) + U_BF16 * (a_deq @ b_deq.t()).abs()
    return bound


def _e4m3_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|dequantized product - exact product| bound, operands quantized per row (module doc)."""
    a, b = a.double(), b.double()
    sa = a.abs().amax(1, keepdim=True) / FP8_MAX
    sb = b.abs().amax(1, keepdim=True) / FP8_MAX
    ea = U_E4M3 * a.abs() + E4M3_SUBNORMAL_HALF_SPACING * sa
    eb = U_E4M3 * b.abs() + E4M3_SUBNORMAL_HALF_SPACING * sb
    return a.abs() @ eb.t() + ea @ b.abs().t() + ea @ eb.t()


def _excess(computed: torch.Tensor, reference: torch.Tensor, bound: torch.Tensor) -> float:
    """max |computed - reference| / bound: <= 1 within the bound (0 where both are exact)."""
    diff = (computed.double() - reference).abs()
    return float(torch.where(diff == 0, 0.0, diff / bound).max())


def _run(x, w, dy, *, kernel: bool):
    """y, grad_x, grad_w of the Function on leaves x [M, K], w [N, K] and upstream gradient dy."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_matmul(x, w, kernel=kernel)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _excesses(x, w, dy, *, kernel: bool = False, dtype=torch.float32) -> dict[str, float]:
    """How far (as a fraction of each bound) the Function's y, grad_x, grad_w are from the
    references: y and grad_x from the dequantized operands, grad_w = dy^T x unquantized."""
    x, w, dy = x.to(dtype), w.to(dtype), dy.to(dtype)
    y, grad_x, grad_w = _run(x, w, dy, kernel=kernel)
    assert (y.dtype, grad_x.dtype, grad_w.dtype) == (dtype,) * 3
    x_deq, _ = _by_hand(x)
    w_deq, _ = _by_hand(w)
    dy_deq, _ = _by_hand(dy)
    wt_deq, _ = _by_hand(w.t())  # W^T [K, N] per row: per input column of W
    x64, dy64 = x.double(), dy.double()
    return {
        "y": _excess(y, x_deq @ w_deq.t(), _dequantized_bound(x_deq, w_deq, K, out_dtype=dtype)),
        "grad_x": _excess(
            grad_x, dy_deq @ wt_deq.t(), _dequantized_bound(dy_deq, wt_deq, N, out_dtype=dtype)
        ),
        "grad_w": _excess(
            grad_w, dy64.t() @ x64, _dequantized_bound(dy64.t(), x64.t(), M, out_dtype=dtype)
        ),
    }


@pytest.fixture(scope="module")
def operands() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, w, dy = _skewed(M, K, 0), _skewed(N, K, 1) * 0.05, _skewed(M, N, 2)
    x[3] = 0.0  # an all-zero token: scale 1, zeros out
    return x, w, dy


def test_the_function_and_its_gradients_are_the_dequantized_reference_in_fp32(operands) -> None:
    """The CPU's path (the reference product; fp32, the CPU's compute dtype)."""
    excess = _excesses(*operands)
    assert max(excess.values()) <= 1.0, excess


def cpu_rowwise_scaled_mm_problem() -> str | None:
    """Why this torch cannot run a row-wise `_scaled_mm` on the CPU, or None (torch 2.11 has
    per-tensor scales only there: "_scaled_mm only supports per-tensor scaling for CPU")."""
    if not hasattr(torch, "_scaled_mm"):
        return "no torch._scaled_mm"
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(
            a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16
        )
    except RuntimeError as error:
        return f"torch {torch.__version__}: no row-wise _scaled_mm on the CPU ({error})"[:200]
    return None


def test_the_scaled_mm_kernel_on_the_cpu_is_the_same_reference_in_bf16(operands) -> None:
    """torch 2.13 runs row-wise `_scaled_mm` on the CPU too: the kernel path's arguments (scale
    shapes, which operand is transposed) checked here; bf16 inputs and outputs as on a GPU."""
    problem = cpu_rowwise_scaled_mm_problem()
    if problem:
        pytest.skip(problem)
    excess = _excesses(*operands, kernel=True, dtype=torch.bfloat16)
    assert max(excess.values()) <= 1.0, excess
    reference = _excesses(*operands, kernel=False, dtype=torch.bfloat16)
    assert max(reference.values()) <= 1.0, reference


def test_the_forward_is_within_the_e4m3_bound_of_the_plain_product(operands) -> None:
    x, w, _ = operands
    y = fp8_matmul(x, w, kernel=False)
    exact = x.double() @ w.double().t()
    bound = _e4m3_bound(x, w) + (K + 3) * U_FP32 * (x.double().abs() @ w.double().abs().t())
    assert _excess(y, exact, bound) <= 1.0
    # and FP8 did run: far from the product of bf16-rounded operands (u = 2^-8, 16x finer)
    bf16 = x.bfloat16().double() @ w.bfloat16().double().t()
    assert (y.double() - exact).norm() > 4 * (bf16 - exact).norm()


def _dequantized(v: torch.Tensor) -> torch.Tensor:
    v_q, scale = quantize_rows(v)
    return v_q.float() * scale[:, None]


def _per_column_forward(x, weight, *, out_dtype, kernel):
    """Mutant: x scaled per column (per input feature, across tokens) instead of per token."""
    return (_dequantized(x.t()).t() @ _dequantized(weight).t()).to(out_dtype)


def _transposed_weight_scale_gradient(grad_out, weight, *, out_dtype, kernel):
    """Mutant: the backward's W quantized per output row (the forward's scales) instead of per
    row of W^T (per input column)."""
    return (_dequantized(grad_out) @ _dequantized(weight)).to(out_dtype)


def _quantized_weight_gradient(grad_out, x, *, dtype):
    """Mutant: grad_W from e4m3 operands (dy^T and x^T per row) instead of unquantized ones."""
    return (_dequantized(grad_out.t()) @ _dequantized(x.t()).t()).to(dtype)


@pytest.mark.parametrize(
    "name, mutant, caught_in",
    [
        ("forward_product", _per_column_forward, "y"),
        ("input_gradient", _transposed_weight_scale_gradient, "grad_x"),
        ("weight_gradient", _quantized_weight_gradient, "grad_w"),
    ],
    ids=["x_scale_per_column", "backward_weight_scale_transposed", "grad_w_quantized"],
)
def test_each_mutant_is_caught(operands, monkeypatch, name, mutant, caught_in) -> None:
    monkeypatch.setattr(fp8_training, name, mutant)
    excess = _excesses(*operands)
    assert excess[caught_in] > 8.0, excess  # far outside, not at the edge of the bound


def _tiny_drafter(kind: str = "dflash") -> nn.Module:
    config = tiny_config(TinySpec())
    if kind == "dflash2":  # kernel_projection 32 -> 2*2*4 = 16 (aligned), hidden_projection 32 -> 8
        config = dataclasses.replace(
            config, kind="dflash2", conv_group_size=8, selector_rank=8, selector_top_k=4
        )
    torch.manual_seed(0)
    return kind_of(config.kind).make_drafter(config)


def test_use_fp8_matmuls_keeps_every_parameter_and_swaps_the_aligned_linears() -> None:
    drafter = _tiny_drafter("dflash2")
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    params = dict(drafter.named_parameters())
    done = use_fp8_matmuls(drafter)
    assert drafter.state_dict().keys() == before.keys()
    assert all(torch.equal(drafter.state_dict()[k], v) for k, v in before.items())
    assert all(p is params[n] for n, p in drafter.named_parameters())  # the same objects
    assert (done.path, done.kept) == (
        "dequantized_reference",
        ("candidate_selector.hidden_projection",),
    )
    assert "CUDA" in done.reason
    assert {
        "fc",
        "layers.0.self_attn.q_proj",
        "layers.1.mlp.down_proj",
        "layers.0.attention_conv.kernel_projection",
    } <= set(done.fp8)
    linears = [m for m in drafter.modules() if isinstance(m, nn.Linear)]
    assert len(done.fp8) + len(done.kept) == len(linears)
    assert sum(type(m) is Fp8TrainingLinear for m in linears) == len(done.fp8)


def test_linears_with_a_bias_or_unaligned_features_stay_plain() -> None:
    model = nn.ModuleDict(
        {
            "ok": nn.Linear(32, 16, bias=False),
            "odd": nn.Linear(20, 16, bias=False),
            "bias": nn.Linear(32, 16),
        }
    )
    done = use_fp8_matmuls(model, kernel=False)
    assert done.fp8 == ("ok",) and set(done.kept) == {"odd", "bias"}
    assert type(model["odd"]) is nn.Linear and type(model["bias"]) is nn.Linear


def test_the_kernel_needs_cuda_with_fp8_tensor_cores(monkeypatch) -> None:
    assert "CUDA" in rowwise_kernel_problem(torch.device("cpu"))
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "8.0 has no FP8 tensor cores" in rowwise_kernel_problem(cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert rowwise_kernel_problem(cuda) is None


def test_a_compiled_fp8_layer_traces_as_one_graph_and_equals_eager() -> None:
    """fullgraph=True through the autograd.Function (dynamo and AOTAutograd; the aot_eager
    backend, so no C++ build here: inductor runs in the GPU test)."""
    config = tiny_config(TinySpec())
    torch.manual_seed(0)
    layer = DraftLayer(config)
    use_fp8_matmuls(layer, kernel=False)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, config.hidden_size, generator=g)
    context = torch.randn(12, config.hidden_size, generator=g)
    rope = (torch.ones(8, config.head_dim), torch.zeros(8, config.head_dim))
    context_rope = (torch.ones(12, config.head_dim), torch.zeros(12, config.head_dim))

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def loss_and_grads(fn):
        layer.zero_grad(set_to_none=True)
        loss = fn(layer, x, context, rope, context_rope, attend).square().sum()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in layer.parameters()]

    torch._dynamo.reset()
    compiled = torch.compile(layer_forward, fullgraph=True, dynamic=False, backend="aot_eager")
    eager_loss, eager_grads = loss_and_grads(layer_forward)
    loss, grads = loss_and_grads(compiled)
    torch.testing.assert_close(loss, eager_loss)
    for a, b in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b)


def _spec(**changes) -> StepSpec:
    s = TinySpec()
    spec = StepSpec(
        token_budget=s.num_tokens,
        num_anchors=8,
        gamma=4.0,
        lr=1e-2,
        warmup_frac=0.2,
        weight_decay=0.0,
        grad_clip=1.0,
        seed=0,
        attention="sdpa",
        compile=False,
        compiled_update=False,
        cuda_graph=False,
        ce_chunk_size=64,
        ce_kernel="compiled",
        flex_backend="auto",
        working_weights=False,
    )
    return dataclasses.replace(spec, **changes)


def _built(spec: StepSpec):
    """The tiny drafter's step on the CPU, as the pipeline builds it."""
    config = tiny_config(TinySpec())
    embed, lm_head = tiny_target_weights(config, seed=0, dtype=torch.float32)
    return build_drafter_step(
        spec,
        config,
        embed=embed,
        lm_head=lm_head,
        device=torch.device("cpu"),
        rank=0,
        total_steps=10,
    )


def _losses(spec: StepSpec, steps: int = 4) -> list[float]:
    step = _built(spec)
    step.batch.copy_(tiny_batch(TinySpec(), tiny_config(TinySpec()), dtype=torch.float32))
    losses = []
    for _ in range(steps):
        step.phase_a()
        step.phase_b()
        losses.append(float(step.stats[0] / step.stats[1]))
    return losses


def test_the_cpu_step_with_fp8_matmuls_trains_close_to_the_plain_one() -> None:
    """The built step (build_drafter_step, as the pipeline builds it) with the setting on: the
    same anchors (the same seed), finite losses a few e4m3 roundings from the fp32 step's, and not
    equal to them (the linears did run in FP8). The bound is not derived, and loose on purpose:
    1% relative against 3e-4 measured (torch 2.13; the e4m3 roundings of the step's matmuls are
    independent and mostly cancel in a mean over blocks), and below the ~4% each of the first
    steps descends by."""
    plain, fp8 = _losses(_spec()), _losses(_spec(fp8_matmuls=True))
    assert all(torch.isfinite(torch.tensor(fp8)))
    assert plain != fp8
    assert max(abs(a - b) / a for a, b in zip(plain, fp8, strict=True)) < 0.01, (plain, fp8)
    assert fp8[-1] < fp8[0]  # it learns


def test_the_working_copies_reach_the_function(monkeypatch) -> None:
    """step.py's functional_call swaps the bf16 working copies (fp32 on the CPU) into the
    modules: the Function must multiply by those, not by the masters, and their gradients are
    what it returns."""
    seen = []
    forward = fp8_training.forward_product

    def spy(x, weight, **kwargs):
        seen.append(weight)
        return forward(x, weight, **kwargs)

    monkeypatch.setattr(fp8_training, "forward_product", spy)
    spec = _spec(fp8_matmuls=True)
    config = tiny_config(TinySpec())
    embed, lm_head = tiny_target_weights(config, seed=0, dtype=torch.float32)
    step = build_drafter_step(
        spec,
        config,
        embed=embed,
        lm_head=lm_head,
        device=torch.device("cpu"),
        rank=0,
        total_steps=10,
    )
    from dflash_async.model.step import DrafterStep

    step = DrafterStep.build(
        step.objective,
        token_budget=TinySpec().num_tokens,
        peak_lr=1e-2,
        warmup_steps=1,
        total_steps=10,
        working_weights=True,
    )
    step.batch.copy_(tiny_batch(TinySpec(), config, dtype=torch.float32))
    step.phase_a()
    working = {id(w) for w in step.working if w is not None}
    masters = {id(p) for p in step.params}
    linears = sum(type(m) is Fp8TrainingLinear for m in step.objective.drafter.modules())
    assert seen and all(id(w) in working for w in seen) and not masters & {id(w) for w in seen}
    assert len({id(w) for w in seen}) == linears  # every FP8 linear read its working copy


def test_the_setting_parses_reaches_the_step_spec_and_is_refused_off_fp8_gpus(tmp_path) -> None:
    from tiny_run import tiny_env, tiny_inputs

    from dflash_async.pipeline import specs

    assert load_settings(NO_FILE).train.fp8_matmuls is False
    train = load_settings(NO_FILE | {"DFLASH_TRAIN__FP8_MATMULS": "true"}).train
    assert train.fp8_matmuls is True
    assert specs._step_spec(train, token_budget=1024, cuda=True).fp8_matmuls is True
    assert (
        specs._step_spec(
            train.model_copy(update={"fp8_matmuls": False}), token_budget=1024, cuda=True
        ).fp8_matmuls
        is False
    )
    inputs = tiny_inputs(tmp_path, records=4)
    settings = load_settings(tiny_env(inputs) | {"DFLASH_TRAIN__FP8_MATMULS": "true"})
    with pytest.raises(
        SettingsError, match=r"^DFLASH_TRAIN__FP8_MATMULS=true needs GPU drafters"
    ) as error:
        specs.run_spec(settings)
    assert "cpu" in str(error.value) and "\n" not in str(error.value)
    assert specs.run_spec(load_settings(tiny_env(inputs))).step.fp8_matmuls is False


def test_emulate_runs_anywhere_as_the_reference_and_trains_as_the_setting_on_does_here(
    tmp_path,
) -> None:
    """FP8_MATMULS=emulate parses, passes where true is refused (the CPU), reaches the step
    spec, and installs the kernel-free reference in every aligned linear: on the CPU the step
    is the one true would build, so the losses are equal to the bit; its run identity differs
    from true's (another summation)."""
    from tiny_run import tiny_env, tiny_inputs

    from dflash_async.pipeline import specs

    emulate = {"DFLASH_TRAIN__FP8_MATMULS": "emulate"}
    assert load_settings(NO_FILE | emulate).train.fp8_matmuls == "emulate"
    inputs = tiny_inputs(tmp_path, records=4)
    assert specs.run_spec(load_settings(tiny_env(inputs) | emulate)).step.fp8_matmuls == "emulate"
    with pytest.raises(
        SettingsError, match=r"^DFLASH_TRAIN__FP8_MATMULS='fast': .* or .*'emulate'"
    ):
        load_settings(NO_FILE | {"DFLASH_TRAIN__FP8_MATMULS": "fast"})
    assert _losses(_spec(fp8_matmuls="emulate")) == _losses(_spec(fp8_matmuls=True))
    drafter = _built(_spec(fp8_matmuls="emulate")).objective.drafter
    linears = [m for m in drafter.modules() if type(m) is Fp8TrainingLinear]
    assert linears and not any(m.fp8_kernel for m in linears)
    config = tiny_config(TinySpec())
    ids = [
        run_identity(_spec(fp8_matmuls=v), config, target_path="/x", data="d")[FP8_MATMULS_KEY]
        for v in ("emulate", True)
    ]
    assert ids == ["emulate", True]


def test_the_run_identity_holds_the_setting_and_resume_must_match_it() -> None:
    """Recorded in every run's identity; a checkpoint from before the setting existed is a bf16
    run's (it resumes with the setting off, is refused with it on); a checkpoint of either value
    refuses the other, naming the setting."""
    config = tiny_config(TinySpec())

    def identity(fp8: bool) -> dict:
        return run_identity(_spec(fp8_matmuls=fp8), config, target_path="/nonexistent", data="d")

    bf16, fp8 = identity(False), identity(True)
    assert (bf16[FP8_MATMULS_KEY], fp8[FP8_MATMULS_KEY]) == (False, True)
    older = {k: v for k, v in bf16.items() if k != FP8_MATMULS_KEY}
    check_run_identity(older, bf16, where="ckpt")
    check_run_identity(fp8, fp8, where="ckpt")
    for saved, current in ((older, fp8), (bf16, fp8), (fp8, bf16)):
        with pytest.raises(SettingsError, match=r"^DFLASH_TRAIN__FP8_MATMULS: this run has"):
            check_run_identity(saved, current, where="ckpt")


def test_the_step_logs_its_fp8_path_and_linears() -> None:
    """drafter_kernels_chosen (the flex step's preflight line; flex forced into the spec, as a
    GPU run would pick it, never run here) names the path, why it is the reference, and the
    linears in FP8 (7 per layer and fc) and kept."""
    from structlog.testing import capture_logs

    config = tiny_config(TinySpec())
    embed, lm_head = tiny_target_weights(config, seed=0, dtype=torch.float32)
    lines = {}
    for fp8 in (False, True):
        with capture_logs() as logs:
            build_drafter_step(
                _spec(attention="flex", fp8_matmuls=fp8),
                config,
                embed=embed,
                lm_head=lm_head,
                device=torch.device("cpu"),
                rank=0,
                total_steps=10,
            )
        (lines[fp8],) = [e for e in logs if e["event"] == "drafter_kernels_chosen"]
    assert (lines[False]["fp8_matmuls"], lines[False]["fp8_linears"]) == ("off", 0)
    on = lines[True]
    assert (
        on["fp8_matmuls"] == "dequantized_reference (FP8 matmuls run on CUDA only (device is cpu))"
    )
    assert (on["fp8_linears"], on["fp8_kept"]) == (7 * config.num_hidden_layers + 1, [])
