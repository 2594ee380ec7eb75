"""The DFlash2 drafter: the DFlash drafter plus per-layer dynamic convolutions and a selector.

This module owns the model half of DFlash2 (docs/DFLASH.md s.9); its objective is
`model/kinds/dflash2/objective.py`. Two additions to every DFlash layer:
- `attention_conv` around attention and `mlp_conv` around the MLP: grouped dynamic causal
  convolutions along the block positions. Each has `base_kernel` [2, K, d] (side 0 before the
  sublayer, side 1 after it) and `kernel_projection` Linear(d -> 2*K*G), G = d / group size, which
  makes per-position kernels shared by the channels of a group (contiguous channels
  [g*size, (g+1)*size)). The convolution runs on the block layout [A, B, d], so that it never
  reaches across a block's first position into the previous block.
- `candidate_selector`: a low-rank bilinear score of (previous token, slot hidden state, candidate)
  added to the unary logits of the slot's top-k candidates.

Initialisation makes a fresh DFlash2 drafter a DFlash drafter: base tap 0 = 1, other taps 0,
kernel projections 0 (the convolutions are the identity), successor codebook 0 (the selector adds
nothing). Parameter names are the servable checkpoint's, codebooks plain tensors without `.weight`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from dflash_async.model.drafter import (
    Attend,
    DFlashDrafter,
    DraftLayer,
)
from dflash_async.model.kinds.dflash2 import NAME, conv_groups
from dflash_async.model.step_ranges import step_range

if TYPE_CHECKING:  # the config is built from every kind's fields (model/kinds/)
    from dflash_async.model.drafter_config import DrafterConfig


def block_causal_conv(
    h: torch.Tensor,  # [A, B, d]
    dyn: torch.Tensor,  # [A, B, K, G] per-position dynamic taps
    base: torch.Tensor,  # [K, d] static taps
) -> torch.Tensor:
    """out[:, t] = sum_{o<K} (base[o] + dyn[:, t, o] over its group) * h[:, t-o], zero before t=0.

    The shift runs along dim 1 of [A, B, d] only, so no tap ever reads another block. The group
    broadcast is a view of h as [A, B, G, d/G]: the [A, B, K, d] expanded kernel never exists.
    """
    num_blocks, block, d = h.shape
    groups = dyn.shape[-1]
    base = base.to(h.dtype)
    out = torch.zeros_like(h)
    for o in range(base.shape[0]):  # K is static (2 in every release)
        shifted = F.pad(h, (0, 0, o, 0))[:, :block]  # [A, B, d]: h[:, t-o], zero before the start
        grouped = shifted.view(num_blocks, block, groups, d // groups)  # [A, B, G, d/G]
        dynamic = (grouped * dyn[:, :, o, :, None].to(h.dtype)).view(num_blocks, block, d)
        out = out + shifted * base[o] + dynamic
    return out


# conv(h [A, B, d], dyn [A, B, K, G], base [K, d]) -> [A, B, d]: block_causal_conv's contract
# (kernels/conv_kernel.triton_block_conv() on a GPU)
BlockConv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class GroupedDynamicConv(nn.Module):
    """One of a layer's two convolutions (`attention_conv` or `mlp_conv`)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        d, k, g = config.hidden_size, config.conv_kernel_size, conv_groups(config)
        self.kernel_size, self.groups = k, g
        self.base_kernel = nn.Parameter(torch.zeros(2, k, d))
        self.kernel_projection = nn.Linear(d, 2 * k * g, bias=False)

    def dynamic_kernels(self, h: torch.Tensor) -> torch.Tensor:
        """[A, B, d] (the normed sublayer input) -> [A, B, 2, K, G]; both sides from the input."""
        return self.kernel_projection(h).unflatten(-1, (2, self.kernel_size, self.groups))

    def convolve(self, h: torch.Tensor, dyn: torch.Tensor, *, side: int, conv: BlockConv):
        """Side 0 (before the sublayer) or 1 (after it) of the convolution on [A, B, d]."""
        return conv(h, dyn[:, :, side], self.base_kernel[side])

    @torch.no_grad()
    def reset_identity(self) -> None:
        """Identity convolution: tap 0 = 1, later taps 0, no dynamic part."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()


class DFlash2Layer(DraftLayer):
    """A DFlash layer with a convolution around its attention and one around its MLP."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__(config)
        self.attention_conv = GroupedDynamicConv(config)
        self.mlp_conv = GroupedDynamicConv(config)


def dflash2_layer_forward(
    layer: DFlash2Layer,
    x: torch.Tensor,  # [Q, d] block stream, Q = A*B
    context: torch.Tensor,  # [T, d]
    block_rope: tuple[torch.Tensor, torch.Tensor],
    context_rope: tuple[torch.Tensor, torch.Tensor],
    attend: Attend,
    *,
    block_size: int,
    conv: BlockConv,
) -> torch.Tensor:
    """One DFlash2 layer: conv -> attention (KV injection) -> conv -> residual, the same for MLP.
    `conv` computes every convolution (block_causal_conv or a kernel of the same contract)."""

    def blocks(t: torch.Tensor) -> torch.Tensor:  # [Q, d] -> [A, B, d]
        return t.view(-1, block_size, t.shape[-1])

    h = blocks(layer.input_layernorm(x))  # [A, B, d]
    dyn = layer.attention_conv.dynamic_kernels(h)  # [A, B, 2, K, G]
    h = layer.attention_conv.convolve(h, dyn, side=0, conv=conv).flatten(0, 1)  # [Q, d]
    q, k, v = layer.self_attn.project(h, context, block_rope, context_rope)
    out = blocks(layer.self_attn.output(attend(q, k, v)))  # [A, B, d]
    x = x + layer.attention_conv.convolve(out, dyn, side=1, conv=conv).flatten(0, 1)
    h = blocks(layer.post_attention_layernorm(x))
    dyn = layer.mlp_conv.dynamic_kernels(h)
    out = layer.mlp(layer.mlp_conv.convolve(h, dyn, side=0, conv=conv))
    return x + layer.mlp_conv.convolve(out, dyn, side=1, conv=conv).flatten(0, 1)


class CandidateSelector(nn.Module):
    """score(c) = unary(c) + <pred[prev] * hidden_projection(h), succ[c]> over the top-k set."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        d, v, r = config.hidden_size, config.vocab_size, config.selector_rank
        self.hidden_projection = nn.Linear(d, r, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(v, r))
        self.successor_codebook = nn.Parameter(torch.zeros(v, r))

    def pair_scores(
        self,
        hidden: torch.Tensor,  # [N, d] the slots' norm(x)
        previous: torch.Tensor,  # [N] int64 predecessor tokens
        candidates: torch.Tensor,  # [N, k] int64 candidate tokens
    ) -> torch.Tensor:
        """The selector's addition to the unary logits, [N, k]."""
        z = self.hidden_projection(hidden)  # [N, r]
        # F.embedding, not codebook[index]: the same rows, but its backward sums each token's
        # rows in parallel segments, where index_put's (the indexing's backward) walks all rows
        # of one token in one thread block: frequent tokens are in most slots' top-k sets, and
        # that walk took 10.2 ms of a Qwen3-8B-shaped DFlash2 step on an H200 (BENCHMARKS.md)
        pred = F.embedding(previous, self.predecessor_codebook).to(z.dtype)  # [N, r]
        succ = F.embedding(candidates, self.successor_codebook).to(z.dtype)  # [N, k, r]
        return torch.einsum("nr,nkr->nk", pred * z, succ)

    @torch.no_grad()
    def reset_no_op(self, std: float) -> None:
        """A no-op selector that can learn: the successor codebook 0, the rest random."""
        self.predecessor_codebook.normal_(0.0, std)
        self.successor_codebook.zero_()


class DFlash2Drafter(DFlashDrafter):
    """The trainable DFlash2 drafter; forward() returns norm(x) [Q, d] like DFlashDrafter's."""

    def __init__(self, config: DrafterConfig) -> None:
        if config.kind != NAME:
            raise ValueError(f"DFlash2Drafter needs kind={NAME!r}, not {config.kind!r}")
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)
        self._dflash2_layer = dflash2_layer_forward  # compile_layers() swaps in a compiled one
        # every convolution's function; None: block_causal_conv (the reference, looked up at
        # each call); the objective sets a GPU kernel's (kernels/conv_kernel.py)
        self.conv: BlockConv | None = None
        self.reset_parameters()

    def make_layer(self, config: DrafterConfig) -> nn.Module:
        return DFlash2Layer(config)

    def compile_layers(self) -> None:
        """As DFlashDrafter's, with the DFlash2 layer compiled as one graph (GPU)."""
        super().compile_layers()
        compiled = functools.partial(torch.compile, dynamic=False, fullgraph=True)
        self._dflash2_layer = compiled(dflash2_layer_forward)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Qwen3's init for the backbone; identity convolutions; a no-op selector. (Also called
        by DFlashDrafter.__init__, before the selector exists.)"""
        super().reset_parameters(std)
        for module in self.modules():
            if isinstance(module, GroupedDynamicConv):
                module.reset_identity()
            elif isinstance(module, CandidateSelector):
                module.reset_no_op(std)

    def run_layer(self, layer, x, context, block_rope, context_rope, attend) -> torch.Tensor:
        """The DFlash2 layer: convolutions around attention and MLP (dflash2_layer_forward)."""
        with step_range("layer"):
            return self._dflash2_layer(
                layer,
                x,
                context,
                block_rope,
                context_rope,
                attend,
                block_size=self.config.block_size,
                conv=self.conv or block_causal_conv,
            )
