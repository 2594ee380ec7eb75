"""GPU checks of the drafter step: the flex path agrees with the SDPA reference in bf16, and the
whole step captures as CUDA graphs with no host sync. Skipped without CUDA; run on an H200."""

import json

import pytest
import torch

from dflash_async.bench.drafter_bench import SHAPES, build_step, synthetic_pack
from dflash_async.model.objective import sample_anchors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _small_config(variant: str = "dflash"):
    """The small bench shape as DFlash, DFlash2, DSpark, or a variant with sliding layers (W 512
    in 4096-token packs of 4 documents, so the window cuts every document) and soft-capping."""
    import dataclasses

    config = SHAPES["small"]()
    if variant == "dspark":  # its recipe's block 7: 7 predicted slots from the anchor on
        return dataclasses.replace(config, kind="dspark", block_size=7)
    if variant in ("dflash2", "dflash2_sliding"):
        config = dataclasses.replace(config, kind="dflash2")
    if variant in ("sliding", "dflash2_sliding"):
        config = dataclasses.replace(
            config,
            layer_types=("sliding_attention", "full_attention"),
            sliding_window=512,
            final_logit_softcapping=30.0,
        )
    return config


VARIANTS = ["dflash", "dflash2", "sliding", "dflash2_sliding", "dspark"]


def _loss_and_grads(step, anchors):
    drafter = step.objective.drafter
    drafter.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        sums = step.objective(step.batch, anchors)
    (sums.ce_sum / sums.weight_sum).backward()
    grads = torch.cat([p.grad.flatten().float() for p in drafter.parameters()])
    return (sums.ce_sum / sums.weight_sum).item(), grads


@pytest.mark.parametrize("variant", VARIANTS)
def test_flex_path_matches_sdpa_reference_in_bf16(variant: str):
    """Also for DFlash2 (its convolutions and selector term in the loss), DSpark (its Markov and
    confidence heads, the L1 term against the captured last layer) and sliding layers (the flex
    mask's window against the dense SDPA mask): the same derivation holds, as the attention
    rounding is the only difference between the paths."""
    device = torch.device("cuda", 0)
    config = _small_config(variant)
    flex_fn = torch.compile(torch.nn.attention.flex_attention.flex_attention, dynamic=False)
    kwargs = dict(token_budget=4096, num_anchors=256, device=device)
    sdpa = build_step(config, attention="sdpa", seed=0, **kwargs)
    flex = build_step(config, attention="flex", flex_fn=flex_fn, seed=0, **kwargs)
    flex.objective.drafter.load_state_dict(sdpa.objective.drafter.state_dict())
    pack = synthetic_pack(config, token_budget=4096, num_docs=4, device=device)
    pack.loss_mask[100:300] = False  # some unsupervised spans, so candidates are not everything
    for step in (sdpa, flex):
        step.batch.copy_(pack)
    anchors = sample_anchors(
        pack.loss_mask, pack.doc_ids, 256, torch.Generator(device).manual_seed(0)
    )
    loss_s, grad_s = _loss_and_grads(sdpa, anchors)
    loss_f, grad_f = _loss_and_grads(flex, anchors)
    cosine = torch.nn.functional.cosine_similarity(grad_s, grad_f, dim=0).item()
    rel = abs(loss_f - loss_s) / abs(loss_s)
    print(json.dumps({"check": "flex_vs_sdpa_bf16", "loss_rel_diff": rel, "grad_cosine": cosine}))
    # Tolerances. Both paths run the same bf16 ops except attention, whose output (forward) and
    # dq/dk/dv (backward) are each rounded once to bf16 in a different order: unit roundoff
    # u = 2^-8 per element, from each of the 2 paths, in each of the 2 layers -> per-element
    # relative gradient difference r <= 2 * 2 * 2u = 8u. Two vectors that differ by a relative
    # r have cosine >= 1 - r^2 / 2 = 1 - 2^-11 (0.99951). The loss is a weighted mean over 256
    # anchors x 15 predicted positions of CE terms whose rounding errors have independent signs:
    # it moves by ~r / sqrt(N_eff) relative, N_eff = (sum w)^2 / sum w^2 = 11 terms per anchor
    # for w = exp(-(k-1)/7), so <= 8u / sqrt(256 * 11) = 5.9e-4. Measured on H200: loss 6.6e-7,
    # cosine 1 - 7e-6 (BENCHMARKS.md); a mask off by one row moves both by far more.
    # DSpark: 7 slots weighted exp(-k/4), k = 0..6: N_eff = 3.74^2 / 2.47 = 5.7, so 5 per anchor
    u, n_terms = 2.0**-8, 256 * (5 if variant == "dspark" else 11)
    assert rel < 8 * u / n_terms**0.5, rel
    assert cosine > 1 - (8 * u) ** 2 / 2, cosine


@pytest.mark.parametrize(
    "compiled_update, variant",
    [(False, "dflash")] + [(True, v) for v in VARIANTS],  # the variants with the default update
    ids=["reference_update"] + [f"compiled-{v}" for v in VARIANTS],
)
def test_whole_step_captures_with_strict_capture_mode_and_replays_finite(
    compiled_update: bool, variant: str
):
    """Phase B either way: torch's clip + fused AdamW, or update.py's compiled AdamW; DFlash2's
    selector top-k and convolutions and the sliding masks inside the one captured graph."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    config = _small_config(variant)
    flex_fn = torch.compile(torch.nn.attention.flex_attention.flex_attention, dynamic=False)
    step = build_step(
        config,
        token_budget=4096,
        num_anchors=256,
        device=device,
        attention="flex",
        flex_fn=flex_fn,
        compiled_update=compiled_update,
    )
    step.batch.copy_(synthetic_pack(config, token_budget=4096, num_docs=4, device=device))
    step.capture(warmup_steps=2, error_mode="global")  # strictest: any sync or unsafe call fails
    for _ in range(3):
        step.phase_a()
        step.phase_b()
    torch.cuda.synchronize()
    assert torch.isfinite(step.stats).all()
    assert step.schedule.step.item() == 3  # capture undoes its warm-up steps


def test_an_anchor_count_off_the_flex_tile_trains_in_the_captured_step():
    """250 anchors of 16 (Q = 4000 rows, not whole 128-row tiles): the step pads them to 256
    with invalid slots inside the graph and trains; the blocks counted are the 250 drawn."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    config = _small_config()
    flex_fn = torch.compile(torch.nn.attention.flex_attention.flex_attention, dynamic=False)
    step = build_step(
        config, token_budget=4096, num_anchors=250, device=device, attention="flex", flex_fn=flex_fn
    )
    step.batch.copy_(synthetic_pack(config, token_budget=4096, num_docs=4, device=device))
    step.capture(warmup_steps=2, error_mode="global")
    step.phase_a()
    step.phase_b()
    torch.cuda.synchronize()
    assert torch.isfinite(step.stats).all()
    assert step._anchors().positions.shape == (256,)
