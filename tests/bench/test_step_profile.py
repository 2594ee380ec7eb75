"""The drafter step's profile breakdown: kernels land in the right part, on synthetic records and
on a real CPU profile of a tiny step (the same attribution code the GPU bench runs)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from conftest import TinySpec, tiny_config

from dflash_async.bench.drafter_bench import bench_drafter, build_step, synthetic_pack
from dflash_async.bench.step_profile import (
    PARTS,
    Gap,
    GraphProfile,
    KernelRecord,
    KernelTotal,
    classify,
    format_kernels,
    format_rows,
    gap_histogram,
    idle_gaps,
    part_rows,
    profile_parts,
)
from dflash_async.model.flops import drafter_step_flops, drafter_step_flops_by_part
from dflash_async.model.step_ranges import step_range

F = 64  # the MLP width of the synthetic records


def rec(name="k", op="aten::mm", shapes=(), ranges=(), backward=False, us=1.0) -> KernelRecord:
    return KernelRecord(name=name, op=op, shapes=shapes, ranges=ranges, backward=backward, us=us)


@pytest.mark.parametrize(
    ("record", "part"),
    [
        (rec(ranges=("features",)), "features"),
        (rec(ranges=("block_mask",)), "other"),
        (rec(name="nvjet_gemm", ranges=("lm_head_ce",), backward=True), "lm_head_ce"),
        (
            rec(name="multi_tensor_apply_kernel", op="aten::_foreach_mul_", ranges=("optimizer",)),
            "optimizer",
        ),
        (rec(name="triton_tem_fused_0", op="CompiledFunction", ranges=("attention",)), "attn_fwd"),
        (rec(name="triton_tem_fused_1", ranges=("attention",), backward=True), "attn_bwd"),
        # attention compiled inside the layer's graph: known by its kernel's name
        (rec(name="triton_tem_fused_flex_attention_0", op="X", ranges=("layer",)), "attn_fwd"),
        (
            rec(name="triton_tem_fused_flex_attention_backward_1", op="X", ranges=("layer",)),
            "attn_bwd",
        ),
        (rec(name="flash_fwd_sm90FlashAttentionForwardSm90_o", ranges=("layer",)), "attn_fwd"),
        (
            rec(
                name="flash_bwd_postprocessFlashAttentionBackwardPostprocess_o",
                ranges=("layer",),
                backward=True,
            ),
            "attn_bwd",
        ),
        (rec(shapes=([128, 32], [32, F]), ranges=("layer",)), "mlp"),
        (rec(shapes=([F, 128], [128, 32]), ranges=("layer",), backward=True), "mlp"),
        (rec(shapes=([128, 32], [32, 16]), ranges=("layer",)), "attn_proj"),
        (
            rec(name="triton_red_fused__to_copy_mean_mul_pow_rsqrt_0", op="X", ranges=("layer",)),
            "norms",
        ),
        (rec(name="triton_poi_fused_mul_silu_1", op="X", ranges=("layer",)), "mlp"),
        (rec(name="triton_poi_fused_add_cat_mul_neg_2", op="X", ranges=("layer",)), "layer_other"),
        (rec(ranges=("final_norm",)), "norms"),
        (rec(name="elementwise", op="aten::add_"), "other"),
    ],
)
def test_each_kernel_lands_in_its_part(record: KernelRecord, part: str) -> None:
    assert classify(record, intermediate_size=F) == part


def test_part_rows_sum_to_the_total_and_give_each_part_its_own_mfu() -> None:
    records = [rec(ranges=("features",), us=2000.0), rec(ranges=("optimizer",), us=6000.0)]
    rows = part_rows(
        records, steps=2, intermediate_size=F, flops_by_part={"features": 4e12}, peak_flops=1e15
    )
    by_part = {r.part: r for r in rows}
    assert [r.part for r in rows] == [*PARTS, "total"]
    assert by_part["features"].ms == pytest.approx(1.0)  # 2000 us over 2 steps
    assert by_part["total"].ms == pytest.approx(4.0)
    assert by_part["features"].share == pytest.approx(0.25)
    assert by_part["features"].mfu == pytest.approx(4e12 / 1e-3 / 1e15)
    assert by_part["optimizer"].mfu == 0.0
    assert "| features | 1.00 | 25.0% |" in format_rows(rows, title="t")


def test_flops_by_part_add_up_to_the_step_flops() -> None:
    config = tiny_config(TinySpec())
    kwargs = dict(token_budget=64, num_anchors=8, visible_pairs=1234.0)
    parts = drafter_step_flops_by_part(config, **kwargs)
    assert set(parts) <= set(PARTS)
    assert sum(parts.values()) == drafter_step_flops(config, **kwargs)
    assert parts["attn_bwd"] == 2 * parts["attn_fwd"]  # backward: dq, dk, dv = 2x forward


def test_step_ranges_are_no_ops_outside_the_profiler() -> None:
    assert isinstance(step_range("layer"), nullcontext)
    with pytest.raises(ValueError, match="unknown step range"):
        step_range("lyaer")


def test_a_profiled_cpu_step_fills_every_part_and_backward_follows_its_forward(
    single_thread,
) -> None:
    # block 8: it has a default gamma; MLP width 96: unlike every attention width (32, 64)
    config = tiny_config(TinySpec(block_size=8, intermediate_size=96))
    step = build_step(
        config,
        token_budget=64,
        num_anchors=8,
        device=torch.device("cpu"),
        attention="sdpa",
        ce_chunk_size=16,
    )
    step.batch.copy_(synthetic_pack(config, token_budget=64, num_docs=2, device="cpu"))
    records = profile_parts(step, steps=1)
    parts = {p: 0.0 for p in PARTS}
    backward_parts = set()
    for r in records:
        part = classify(r, intermediate_size=config.intermediate_size)
        parts[part] += r.us
        if r.backward:
            backward_parts.add(part)
    empty = [p for p in PARTS if p not in ("layer_other", "other") and parts[p] <= 0]
    assert not empty, empty
    # backward operators were traced back to their forward ranges, not left in "other"
    assert {"attn_bwd", "attn_proj", "mlp", "lm_head_ce"} <= backward_parts
    assert "attn_fwd" not in backward_parts and "attn_bwd" in backward_parts


def test_bench_drafter_profile_prints_the_table_and_parts_add_up(single_thread, capsys) -> None:
    config = tiny_config(TinySpec(block_size=8, intermediate_size=96))
    result = bench_drafter(
        config,
        token_budget=64,
        num_anchors=8,
        num_docs=2,
        device=torch.device("cpu"),
        attention="sdpa",
        cuda_graph=False,
        steps=1,
        warmup=1,
        profile=True,
    )
    parts = result.parts_ms
    assert set(parts) == {*PARTS, "total"}
    assert sum(parts[p] for p in PARTS) == pytest.approx(parts["total"], abs=0.01)
    table = capsys.readouterr().err
    assert "| attn_bwd |" in table and "MFU" in table and "780" in table


def test_idle_gaps_count_overlaps_once_and_name_both_sides_of_each_gap() -> None:
    """GPU busy time is the union of activity intervals (two streams at once count once, a
    kernel inside another's span adds nothing), and each idle stretch is named by what ended
    last before it and what started after it, longest first."""
    spans = [
        (0.0, 10.0, "gemm"),
        (2.0, 4.0, "nested"),  # inside gemm: adds nothing, and does not end the merged run
        (8.0, 12.0, "overlap"),  # extends the run to 12
        (15.0, 16.0, "memcpy"),  # gap 3 after "overlap"
        (26.0, 30.0, "attn_bwd"),  # gap 10 after "memcpy"
        (30.0, 31.0, "touching"),  # starts where the run ends: no gap
    ]
    busy, gaps = idle_gaps(reversed(spans))  # any order
    assert busy == 12.0 + 1.0 + 5.0
    assert [(g.us, g.before, g.after) for g in gaps] == [
        (10.0, "memcpy", "attn_bwd"),
        (3.0, "overlap", "memcpy"),
    ]
    assert idle_gaps(spans, top=1)[1] == gaps[:1]
    assert idle_gaps([]) == (0.0, [])


def test_gap_histogram_sorts_every_idle_stretch_by_size_per_step() -> None:
    """Each gap of the union lands in exactly one size range, counted and summed per step."""
    # gaps: 1 us (3 -> 4), 3 us (5 -> 8), 150 us (9 -> 159), over 2 steps
    spans = [(0.0, 3.0, "a"), (4.0, 5.0, "b"), (8.0, 9.0, "c"), (159.0, 160.0, "d")]
    gaps = idle_gaps(spans, top=None)[1]
    rows = {label: (n, ms) for label, n, ms in gap_histogram(gaps, steps=1)}
    assert list(rows) == ["0-2", "2-5", "5-20", "20-100", ">=100"]
    assert rows["0-2"] == (1, pytest.approx(0.001))
    assert rows["2-5"] == (1, pytest.approx(0.003))
    assert rows["5-20"] == rows["20-100"] == (0, 0.0)
    assert rows[">=100"] == (1, pytest.approx(0.150))
    assert gap_histogram(gaps, steps=2)[-1] == (">=100", 0, pytest.approx(0.075))


def test_the_graph_kernels_table_shows_busy_time_and_the_gaps() -> None:
    gap = Gap(us=1234.0, before="Memcpy DtoD (Device -> Device)", after="flash_bwd")
    text = format_kernels(
        GraphProfile([KernelTotal("nvjet", 3, 12.5)], 20.0, 18.5, [gap], [("0-2", 900, 1.25)]),
        title="### t",
    )
    assert "| `nvjet` | 3 | 12.50 |" in text
    assert "| GPU busy (their union) | | 18.50 |" in text
    assert "| 1234 | `Memcpy DtoD (Device -> Device)` | `flash_bwd` |" in text
    assert "| 0-2 | 900 | 1.25 |" in text
