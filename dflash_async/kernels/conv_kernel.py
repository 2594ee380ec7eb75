"""DFlash2's block-causal grouped dynamic convolution as Triton kernels (GPU only, imported lazily).

The same contract as DFlash2's block_causal_conv (model/kinds/; the reference, what the CPU runs):
    out[a, t, c] = sum_{o<K} (base[o, c] + dyn[a, t, o, c // S]) * h[a, t-o, c],  zero for t < o,
on the block layout h [A, B, d], S = d / G channels per dynamic kernel. Each program owns one
block (forward) or a few blocks (backward) and a tile of channels, so no tap reads another
block. The backward is one kernel too: it reads the output gradient, h and the dynamic taps
(the shifted rows a second time, from cache) and writes the input gradient, the taps' gradient
(the sum over each group's S channels) and each program's partial sums of the static taps'
gradient (added up after in a fixed order, no atomics: the same result every run).

Why a kernel of our own: inductor compiles the reference into about five kernels per
convolution (its backward splits the group sums, the static taps' sums over the rows and the
input gradient). Measured on an H200 at the Qwen3-8B drafter's shape (BENCHMARKS.md):
one convolution forward and backward takes 0.36 ms here against the compiled reference's 0.45
(benchmarks/conv_launch_sweep.py), and the DFlash2 step 283.5 ms against 285.1 (-0.6%, 20
convolutions a step, alternating runs). tests/kernels/test_conv_kernel_gpu.py compares both passes with
the reference on a GPU, and the comparison with mutants.

The kernels are torch.library.triton_op's, so that a torch.compile'd layer (fullgraph) calls
them in its graph and a CUDA graph captures them; `triton_block_conv()` registers them once per
process (at its first call, not at import) and returns the function to use, which calls them as
torch.ops.dflash.* (dynamo traces those; it refuses to trace the registration itself).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_TAPS = 4  # the backward keeps one accumulator per static tap (releases use 2)


@dataclass(frozen=True)
class ConvLaunch:
    """How the kernels are launched: `channels` per program (a power of two, a multiple of the
    group size; smaller where d needs it), `num_warps` each, `blocks` the backward programs
    walk (adding their static-tap products before one sum over rows at the end)."""

    channels: int = 64
    num_warps: int = 4
    blocks: int = 4


# benchmarks/conv_launch_sweep.py on an H200 (1024 x 16 x 4096 bf16, 2 taps, groups of 16, CUDA
# graphs; BENCHMARKS.md): 64 channels, 4 warps, 4 blocks: forward 0.102 ms (2.8 TB/s if each
# tensor moved once), backward 0.258 ms; the 27 launches of 64-256 channels, 2-8 warps, 4-16
# blocks 0.36-0.49 ms both ways; torch's compiled convolution 0.171 + 0.276 ms
CONV_LAUNCH = ConvLaunch()


def conv_kernel_problem(*, hidden_size: int, group_size: int, taps: int) -> str | None:
    """None when the kernels run this drafter shape, else why not (the reference runs then):
    the group size a power of two dividing d, at most MAX_TAPS taps. Any block size runs."""
    if group_size < 1 or group_size & (group_size - 1) or hidden_size % group_size:
        return (
            f"conv_group_size={group_size} is not a power of two dividing hidden_size={hidden_size}"
        )
    if not 1 <= taps <= MAX_TAPS:
        return f"conv_kernel_size={taps} is above the kernels' {MAX_TAPS} taps"
    return None


def channel_tile(*, hidden_size: int, group_size: int, widest: int) -> int:
    """The largest power of two <= max(widest, group size) dividing d, for a group size that is
    a power of two dividing d (conv_kernel_problem): the group size itself at the least."""
    tile = max(widest, group_size)  # a tile holds whole groups
    while hidden_size % tile:
        tile //= 2
    return tile


@triton.jit
def _channel_offsets(c0, GT: tl.constexpr, S: tl.constexpr):
    """[1, GT, S]: channels c0 .. c0 + GT*S of a row, as groups x channels-in-group, so that a
    group's broadcast and its sum are plain operations along the last axis (with a [BT, C]
    tile, each reshape to [BT, C/S, S] and back moved the data through shared memory)."""
    return c0 + tl.arange(0, GT)[None, :, None] * S + tl.arange(0, S)[None, None, :]


@triton.jit
def _conv_forward_kernel(
    h_ptr,
    dyn_ptr,
    base_ptr,
    out_ptr,
    d,
    stride_dyn_a,
    stride_dyn_t,
    stride_dyn_o,
    B: tl.constexpr,
    BT: tl.constexpr,
    K: tl.constexpr,
    S: tl.constexpr,
    GT: tl.constexpr,
):
    a = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * GT * S  # the tile's first channel; GT groups of S channels
    t = tl.arange(0, BT)[:, None, None]  # positions in the block (BT: B up to a power of 2)
    row = a * B  # the block's first row of [A*B, d]
    channels = _channel_offsets(c0, GT, S)  # [1, GT, S]
    # [BT, GT, 1]: one dynamic tap per position and group, broadcast over the group's channels
    taps = dyn_ptr + a * stride_dyn_a + t * stride_dyn_t + c0 // S + tl.arange(0, GT)[None, :, None]
    acc = tl.zeros([BT, GT, S], tl.float32)
    for o in tl.static_range(K):
        src = t - o  # h[a, t-o]: zero before the block's start, never the previous block
        x = tl.load(h_ptr + (row + src) * d + channels, mask=(src >= 0) & (t < B), other=0.0)
        tap = tl.load(taps + o * stride_dyn_o, mask=t < B, other=0.0).to(tl.float32)
        base = tl.load(base_ptr + o * d + channels).to(tl.float32)
        acc += (base + tap) * x.to(tl.float32)
    tl.store(out_ptr + (row + t) * d + channels, acc.to(out_ptr.dtype.element_ty), mask=t < B)


@triton.jit
def _conv_backward_kernel(
    grad_ptr,
    h_ptr,
    dyn_ptr,
    base_ptr,
    grad_h_ptr,
    grad_dyn_ptr,
    grad_base_ptr,
    num_blocks,
    d,
    groups,
    stride_dyn_a,
    stride_dyn_t,
    stride_dyn_o,
    B: tl.constexpr,
    BT: tl.constexpr,
    K: tl.constexpr,
    S: tl.constexpr,
    GT: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    c0 = tl.program_id(1) * GT * S
    t = tl.arange(0, BT)[:, None, None]  # [BT, 1, 1]
    channels = _channel_offsets(c0, GT, S)
    group = c0 // S + tl.arange(0, GT)[None, :, None]  # [1, GT, 1] the tile's groups
    # the static taps' products, added over this program's blocks and summed over rows once at
    # the end; one accumulator per tap, up to MAX_TAPS, those past K never used
    acc0 = tl.zeros([BT, GT, S], tl.float32)
    acc1 = tl.zeros([BT, GT, S], tl.float32)
    acc2 = tl.zeros([BT, GT, S], tl.float32)
    acc3 = tl.zeros([BT, GT, S], tl.float32)
    for i in range(BLOCKS):
        a = (tl.program_id(0) * BLOCKS + i).to(tl.int64)
        here = (t < B) & (a < num_blocks)
        row = a * B
        taps = dyn_ptr + a * stride_dyn_a + group  # [1, GT, 1], + position * stride_dyn_t
        g = tl.load(grad_ptr + (row + t) * d + channels, mask=here, other=0.0).to(tl.float32)
        grad_h = tl.zeros([BT, GT, S], tl.float32)
        for o in tl.static_range(K):
            # d out[t+o] / d h[t] = base[o] + dyn[t+o, o], for t+o inside the block
            later = t + o
            valid = (later < B) & (a < num_blocks)
            if o == 0:
                g_later = g
            else:
                g_later = tl.load(
                    grad_ptr + (row + later) * d + channels, mask=valid, other=0.0
                ).to(tl.float32)
            tap = tl.load(taps + later * stride_dyn_t + o * stride_dyn_o, mask=valid, other=0.0)
            base = tl.load(base_ptr + o * d + channels).to(tl.float32)
            grad_h += g_later * (base + tap.to(tl.float32))
            # d out[t] / d tap o at t = h[t-o]: summed over a group's S channels for dyn, over
            # all positions for the static taps
            src = t - o
            x = tl.load(h_ptr + (row + src) * d + channels, mask=here & (src >= 0), other=0.0)
            product = g * x.to(tl.float32)  # [BT, GT, S], 0 on masked rows
            out = grad_dyn_ptr + ((row + t) * K + o) * groups + group  # [BT, GT, 1]
            group_sums = tl.sum(product, axis=2, keep_dims=True)
            tl.store(out, group_sums.to(grad_dyn_ptr.dtype.element_ty), mask=here)
            if o == 0:
                acc0 += product
            elif o == 1:
                acc1 += product
            elif o == 2:
                acc2 += product
            else:
                acc3 += product
        tl.store(
            grad_h_ptr + (row + t) * d + channels, grad_h.to(grad_h_ptr.dtype.element_ty), mask=here
        )
    out = grad_base_ptr + tl.program_id(0) * K * d + channels  # [1, GT, S], tap 0's row
    tl.store(out, tl.sum(acc0, axis=0, keep_dims=True))
    if K > 1:
        tl.store(out + d, tl.sum(acc1, axis=0, keep_dims=True))
    if K > 2:
        tl.store(out + 2 * d, tl.sum(acc2, axis=0, keep_dims=True))
    if K > 3:
        tl.store(out + 3 * d, tl.sum(acc3, axis=0, keep_dims=True))


def _shape(h: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor, channels: int):
    """(A, B, d, K, G, the channel tile) after checking that the inputs fit the kernels."""
    num_blocks, block, d = h.shape
    taps, groups = dyn.shape[-2:]
    if dyn.shape[:2] != h.shape[:2] or base.shape != (taps, d) or dyn.stride(-1) != 1:
        raise ValueError(
            f"h {tuple(h.shape)}, dyn {tuple(dyn.shape)} (last dim contiguous) "
            f"and base {tuple(base.shape)} do not match"
        )
    problem = (
        f"{groups} groups do not divide d = {d}"
        if d % groups
        else conv_kernel_problem(hidden_size=d, group_size=d // groups, taps=taps)
    )
    if problem:
        raise ValueError(problem)
    tile = channel_tile(hidden_size=d, group_size=d // groups, widest=channels)
    return num_blocks, block, d, taps, groups, tile


@functools.cache
def _register_ops() -> None:
    """The two custom ops, torch.ops.dflash.block_conv(h, dyn, base, channels, num_warps,
    blocks) and its backward, registered once per process, differentiable."""
    from torch.library import triton_op, wrap_triton

    @triton_op("dflash::block_conv", mutates_args=())
    def block_conv(
        h: torch.Tensor,
        dyn: torch.Tensor,
        base: torch.Tensor,
        channels: int,
        num_warps: int,
        blocks: int,
    ) -> torch.Tensor:
        num_blocks, block, d, taps, groups, tile = _shape(h, dyn, base, channels)
        h, base = h.contiguous(), base.contiguous()
        out = torch.empty_like(h)
        wrap_triton(_conv_forward_kernel)[(num_blocks, d // tile)](
            h,
            dyn,
            base,
            out,
            d,
            dyn.stride(0),
            dyn.stride(1),
            dyn.stride(2),
            B=block,
            BT=triton.next_power_of_2(block),
            K=taps,
            S=d // groups,
            GT=tile // (d // groups),
            num_warps=num_warps,
        )
        return out

    @triton_op("dflash::block_conv_backward", mutates_args=())
    def block_conv_backward(
        grad: torch.Tensor,
        h: torch.Tensor,
        dyn: torch.Tensor,
        base: torch.Tensor,
        channels: int,
        num_warps: int,
        blocks: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_blocks, block, d, taps, groups, tile = _shape(h, dyn, base, channels)
        grad, h, base = grad.contiguous(), h.contiguous(), base.contiguous()
        programs = triton.cdiv(num_blocks, blocks)
        grad_h = torch.empty_like(h)
        grad_dyn = torch.empty(
            (num_blocks, block, taps, groups), dtype=dyn.dtype, device=dyn.device
        )
        partial = torch.empty((programs, taps, d), dtype=torch.float32, device=h.device)
        wrap_triton(_conv_backward_kernel)[(programs, d // tile)](
            grad,
            h,
            dyn,
            base,
            grad_h,
            grad_dyn,
            partial,
            num_blocks,
            d,
            groups,
            dyn.stride(0),
            dyn.stride(1),
            dyn.stride(2),
            B=block,
            BT=triton.next_power_of_2(block),
            K=taps,
            S=d // groups,
            GT=tile // (d // groups),
            BLOCKS=blocks,
            num_warps=num_warps,
        )
        # the programs' partial sums of the static taps' gradient, added in a fixed order
        return grad_h, grad_dyn, partial.sum(0).to(base.dtype)

    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs[:3])
        ctx.launch = inputs[3:]

    def backward(ctx, grad):
        grads = torch.ops.dflash.block_conv_backward(grad, *ctx.saved_tensors, *ctx.launch)
        return *grads, None, None, None

    block_conv.register_autograd(backward, setup_context=setup_context)


def triton_block_conv(launch: ConvLaunch = CONV_LAUNCH) -> Callable:
    """`conv(h, dyn, base)` with DFlash2's block_causal_conv's signature and contract through the
    kernels, differentiable. Registers the ops at the first call: call it outside
    torch.compile'd code (the objective does, when it is built)."""
    _register_ops()
    options = (launch.channels, launch.num_warps, launch.blocks)

    def conv(
        h: torch.Tensor,  # [A, B, d]
        dyn: torch.Tensor,  # [A, B, K, G]
        base: torch.Tensor,  # [K, d]
    ) -> torch.Tensor:
        return torch.ops.dflash.block_conv(h, dyn, base.to(h.dtype), *options)

    return conv
