"""The training step (sample_anchors, objective forward, backward) never makes the host read device data.

A host sync stalls the CPU until the GPU catches up and cannot be captured in a CUDA graph. On the
CPU nothing actually waits, so we watch the ops instead: a TorchDispatchMode sees every aten op
(forward and backward) and raises on the ones that read device data on the host. On CUDA the GPU
test also turns on torch.cuda.set_sync_debug_mode("error"), which catches real synchronizations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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

pytestmark = pytest.mark.usefixtures("single_thread")

aten = torch.ops.aten

# THE list of forbidden ops. Each one either returns a Python value read from device memory
# (`.item()`, `bool(t)`, `int(t)`, `torch.equal`) or has an output shape that depends on tensor
# values, so the host must read the data before it can allocate the result (nonzero, unique,
# masked_select, bincount, histc with an automatic range). Conditional cases are in
# `needs_host_read` below: indexing with a BOOL mask (an implicit nonzero), repeat_interleave with
# tensor repeats and no output_size, and any copy from a device to the CPU.
HOST_SYNC_OPS = frozenset(
    {
        aten._local_scalar_dense.default,  # .item(), int(t), float(t), bool(t) all end here
        aten.item.default,
        aten.is_nonzero.default,
        aten.equal.default,
        aten.allclose.default,
        aten.nonzero.default,
        aten.argwhere.default,
        aten.where.default,  # torch.where(cond) with one argument = nonzero
        aten.masked_select.default,
        aten._unique.default,
        aten._unique2.default,
        aten.unique_consecutive.default,
        aten.unique_dim.default,
        aten.bincount.default,
        aten.histc.default,
    }
)
INDEX_OPS = frozenset(
    {
        aten.index.Tensor,
        aten.index_put.default,
        aten.index_put_.default,
        aten._index_put_impl_.default,
    }
)
REPEAT_INTERLEAVE_OPS = frozenset(
    {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
)


def _is_bool_index(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _leaves_device(src: Any, dst_device: Any) -> bool:
    """A copy from a non-CPU tensor to a CPU one (the host waits for the data)."""
    if not isinstance(src, torch.Tensor) or src.device.type == "cpu" or dst_device is None:
        return False
    return torch.device(dst_device).type == "cpu"


def needs_host_read(func: Any, args: tuple, kwargs: dict) -> bool:
    """True when this aten call makes the host read device data."""
    if func in HOST_SYNC_OPS:
        return True
    if func in INDEX_OPS:
        return any(_is_bool_index(i) for i in args[1])
    if func in REPEAT_INTERLEAVE_OPS:
        return kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
    if func is aten._to_copy.default:
        return _leaves_device(args[0], kwargs.get("device"))
    if func is aten.copy_.default:
        return _leaves_device(args[1], args[0].device)
    return False


class HostSyncError(AssertionError):
    pass


class ForbidHostSync(TorchDispatchMode):
    """Raises HostSyncError on any op for which `needs_host_read` is true."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if needs_host_read(func, args, kwargs):
            raise HostSyncError(f"host sync: {func}")
        return func(*args, **kwargs)


@pytest.mark.parametrize(
    "offender",
    [
        lambda t: t.sum().item(),
        lambda t: bool(t.sum() > 0),
        lambda t: int(t.argmax()),
        lambda t: torch.equal(t, t),
        lambda t: t.nonzero(),
        lambda t: torch.where(t > 0),
        lambda t: t[t > 0],
        lambda t: t.masked_select(t > 0),
        lambda t: t.clone().index_put_((t > 0,), torch.tensor(0.0)),
        lambda t: torch.unique(t),
        lambda t: torch.repeat_interleave(torch.arange(3), torch.tensor([1, 2, 3])),
        lambda t: torch.bincount(torch.tensor([1, 2])),
    ],
)
def test_guard_catches_each_kind_of_host_read(offender: Callable[[torch.Tensor], Any]) -> None:
    t = torch.randn(8)
    with pytest.raises(HostSyncError), ForbidHostSync():
        offender(t)


def test_guard_allows_the_sync_free_equivalents() -> None:
    t = torch.randn(8)
    with ForbidHostSync():
        torch.topk(torch.where(t > 0, t, -1.0), 3)
        t[torch.tensor([0, 2])]  # integer index: fine
        torch.repeat_interleave(torch.arange(3), torch.tensor([1, 2, 3]), output_size=6)
        torch.nonzero_static(t > 0, size=8)


NUM_ANCHORS = 16  # flex needs T and A*B to be multiples of its 128 tile
SPEC = TinySpec(block_size=8, doc_lengths=(24, 40, 30), num_pad=34, seed=11)  # T = 128 = A*B


def _step(spec: TinySpec, device: str, dtype: torch.dtype, attention: str) -> Callable[[], None]:
    from dflash_async.model.objective import sample_anchors

    config = tiny_config(spec)
    drafter = tiny_drafter(config, spec.seed, dtype, device)
    embed, lm_head = tiny_target_weights(config, spec.seed, dtype, device)
    batch = tiny_batch(spec, config, dtype, device)
    objective = make_objective(
        config,
        drafter,
        embed,
        lm_head,
        num_anchors=NUM_ANCHORS,
        gamma=4.0,
        ce_chunk_size=16,
        attention=attention,
    )
    gen = torch.Generator(device=device).manual_seed(0)

    def step() -> None:
        anchors = sample_anchors(batch.loss_mask, batch.doc_ids, NUM_ANCHORS, generator=gen)
        sums = objective(batch, anchors)
        sums.ce_sum.backward()

    return step


def test_sample_anchors_forward_and_backward_read_no_device_data() -> None:
    step = _step(SPEC, "cpu", torch.float32, "sdpa")
    step()  # warm-up outside the guard, like the warm-up steps before a graph capture
    with ForbidHostSync():
        step()


def test_flex_block_mask_is_built_without_reading_device_data() -> None:
    """The BlockMask is rebuilt every step inside the captured graph, so it must be sync-free too."""
    from dflash_async.model.attention_rule import flex_block_mask
    from dflash_async.model.objective import sample_anchors

    config = tiny_config(SPEC)
    batch = tiny_batch(SPEC, config)
    gen = torch.Generator().manual_seed(0)
    with ForbidHostSync():
        anchors = sample_anchors(batch.loss_mask, batch.doc_ids, NUM_ANCHORS, generator=gen)
        flex_block_mask(batch.doc_ids, anchors.positions, anchors.valid, SPEC.block_size, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_gpu_step_does_not_synchronize(attention: str) -> None:
    step = _step(SPEC, "cuda", torch.float32, attention)
    step()
    step()  # warm-up: lazy CUDA init, kernel selection
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        if attention == "sdpa":  # dynamo does not trace under a Python dispatch mode
            with ForbidHostSync():
                step()
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


# ---- the target step (stage_inputs + fill_slot on the packed path) ------------------------------

TARGET_BUDGET = 256  # flex tiles of 128 on the GPU
TARGET_LAYERS = (1, 3, 4)


def _target_step(device: str, tmp_path) -> Callable[[], None]:
    """One steady-state target step of the real stage functions over the tiny target."""
    import numpy as np

    from dflash_async.data.packing import PackCursor, PackedBatch
    from dflash_async.data.samples import TokenizedSamples
    from dflash_async.stages.produce import TargetSpec, fill_slot, load_runner, stage_inputs
    from dflash_async.stages.read import PlannedPack
    from dflash_async.targets.tiny import ensure_tiny_target

    runner = load_runner(
        str(ensure_tiny_target(tmp_path)),
        spec=TargetSpec(
            cuda_dtype=torch.bfloat16,
            cpu_dtype=torch.float32,
            token_budget=TARGET_BUDGET,
            max_batch_tokens=TARGET_BUDGET,
            packed_hybrid=True,
        ),
        device=torch.device(device),
        layer_ids=TARGET_LAYERS,
    )
    assert runner.path.name == "packed_dense", runner.path.reason
    lengths = np.array([70, 100, 3, 50])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.random.default_rng(0).integers(0, 1000, offsets[-1]).astype(np.int32)
    samples = TokenizedSamples(tokens, np.ones(len(tokens), dtype=bool), offsets)
    pack = PlannedPack(PackCursor(), np.arange(len(lengths)))
    slot = PackedBatch.empty(
        TARGET_BUDGET, 3 * 128, device=torch.device(device), feature_dtype=torch.float32
    )

    def step() -> None:
        fill_slot(runner, stage_inputs(runner, samples, pack), slot)

    return step


def test_target_step_reads_no_device_data(tmp_path) -> None:
    step = _target_step("cpu", tmp_path)
    step()
    with ForbidHostSync():
        step()


@pytest.mark.gpu
def test_gpu_target_step_does_not_synchronize(tmp_path) -> None:
    """Compiled flex path: caught by the CUDA sync debug mode (pinned, non-blocking copies)."""
    step = _target_step("cuda", tmp_path)
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
def test_gpu_hybrid_target_forward_does_not_synchronize() -> None:
    """Packed Qwen3.5 forward on fla's varlen kernels: the segment boundaries and fla's chunk table
    go to fla from pinned host memory without blocking (fla alone would copy its chunk table from
    pageable memory: a stream synchronisation), so nothing waits on the device."""
    import numpy as np
    from test_target_hybrid import tiny_qwen35

    from dflash_async.data.packing import layout_pack
    from dflash_async.targets.forward import select_target_forward
    from dflash_async.targets.loading import random_target

    model = random_target(tiny_qwen35(), seed=0).cuda()
    path = select_target_forward(
        model, (1, 3, 4), token_budget=256, max_batch_tokens=256, packed_hybrid=True
    )
    assert path.name == "packed_hybrid", path.reason
    lengths = np.array([70, 100, 3, 50])
    rng = np.random.default_rng(0)
    docs = [(rng.integers(0, 300, n), np.ones(n, dtype=bool)) for n in lengths]
    layout = layout_pack(docs, 256).to("cuda")
    out = torch.empty(256, 3 * 64, device="cuda")
    args = (layout.input_ids, layout.position_ids, layout.doc_ids, out, lengths)
    path.forward(*args)
    path.forward(*args)  # warm-up: compile, triton autotuning
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        path.forward(*args)
    finally:
        torch.cuda.set_sync_debug_mode(0)
