"""The DFlash drafter: a few Qwen3 decoder layers that fill a block of B tokens in one pass.

Inputs are the block stream (the target's embeddings of `[anchor, MASK, ..., MASK]`) and the
target's hidden states of the context (docs/DFLASH.md section 1). In EVERY layer the keys and
values are `[W_k C ; W_k h]`, `[W_v C ; W_v h]`: the fused target context C followed by the block
stream h = input_layernorm(x). Queries come from the block only; C is never updated by the layers.

The drafter owns no embedding and no lm_head: the caller embeds with the target's frozen
`embed_tokens` and decodes with the target's frozen `lm_head`. Parameter names are exactly the
servable checkpoint's (docs/DFLASH.md section 7), so export is a dtype cast and nothing else.

Attention is injected as a callable `attend(q, k, v) -> out` (see attention_rule.py): the SDPA
rule (CPU: in chunks of blocks; the dense mask is the reference) and the flex_attention BlockMask
rule (GPU) share this module. A
drafter whose layers follow different rules (sliding-window layers, docs/DFLASH.md s.10) is given
one callable per layer; `input_embedding_scale` (s.10) scales the block stream on the way in.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from dflash_async.model.step_ranges import step_range

if TYPE_CHECKING:  # the config is built from every kind's fields (model/kinds/)
    from dflash_async.model.drafter_config import DrafterConfig

# attend(q [1, H, Q, hd], k [1, Hkv, S, hd], v [1, Hkv, S, hd]) -> [1, H, Q, hd], S = T + Q.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def layer_attends(attend: Attend | Sequence[Attend], num_layers: int) -> Sequence[Attend]:
    """One attend per layer: a single callable serves every layer (one rule for all)."""
    if callable(attend):
        return (attend,) * num_layers
    if len(attend) != num_layers:
        raise ValueError(f"{len(attend)} attention callables for {num_layers} layers")
    return attend


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls run in: autocast's when it is on (bf16 on GPU), else the tensor's own."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in (at least) fp32, scale, cast back to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(_at_least_fp32(x.dtype))
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-convention rotary tables for `positions` [N] -> cos, sin [N, head_dim] in `dtype`."""
    math_dtype = _at_least_fp32(dtype)
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=math_dtype) / head_dim
    inv_freq = 1.0 / theta**exponent  # [hd/2]
    angles = positions.to(math_dtype)[:, None] * inv_freq[None, :]  # [N, hd/2]
    emb = torch.cat([angles, angles], dim=-1)  # [N, hd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., N, hd] by the tables [N, hd] (rotate_half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DraftAttention(nn.Module):
    """GQA attention whose keys/values are the fused context followed by the block stream."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            hd,
        )
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, proj: nn.Linear, norm: RMSNorm | None) -> torch.Tensor:
        """[N, d] -> [1, n_heads, N, hd], with the per-head norm (q_norm / k_norm) if given."""
        y = proj(x).unflatten(-1, (-1, self.head_dim))  # [N, n, hd]
        if norm is not None:
            y = norm(y)
        return y.transpose(0, 1).unsqueeze(0)

    def project(
        self,
        h: torch.Tensor,  # [Q, d] block stream after input_layernorm
        context: torch.Tensor,  # [T, d] fused target context C
        block_rope: tuple[torch.Tensor, torch.Tensor],  # [Q, hd] each
        context_rope: tuple[torch.Tensor, torch.Tensor],  # [T, hd] each
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [1, H, Q, hd] from the block; k, v [1, Hkv, T+Q, hd] from context then block."""
        # q stays the [Q, H, hd] transpose. Made contiguous, flex_attention's backward ran 4%
        # faster (4.92 vs 5.11 ms per layer, `bench attention --layout`), but the compiled layer
        # then kept a second copy of q for backward: +0.62 GiB at the 8B shape, for ~1 ms a step.
        q = apply_rope(self._heads(h, self.q_proj, self.q_norm), *block_rope)
        k_context = apply_rope(self._heads(context, self.k_proj, self.k_norm), *context_rope)
        k_block = apply_rope(self._heads(h, self.k_proj, self.k_norm), *block_rope)
        k = torch.cat([k_context, k_block], dim=2)
        v = torch.cat(
            [self._heads(context, self.v_proj, None), self._heads(h, self.v_proj, None)], 2
        )
        return q, k, v

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """[1, H, Q, hd] attention output -> [Q, d]."""
        return self.o_proj(out.squeeze(0).transpose(0, 1).flatten(1))


class DraftMLP(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer with KV injection of the target context."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DraftMLP(config)


def layer_attention_inputs(layer: DraftLayer, x, context, block_rope, context_rope):
    """Everything of a layer before attention: norm, projections, q/k norms, RoPE."""
    return layer.self_attn.project(layer.input_layernorm(x), context, block_rope, context_rope)


def layer_attention_output(layer: DraftLayer, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Everything of a layer after attention: o_proj, residuals, MLP."""
    x = x + layer.self_attn.output(out)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def layer_forward(
    layer: DraftLayer, x, context, block_rope, context_rope, attend: Attend
) -> torch.Tensor:
    """One whole layer, attention included: what compile_layers() compiles as one graph."""
    q, k, v = layer_attention_inputs(layer, x, context, block_rope, context_rope)
    return layer_attention_output(layer, x, attend(q, k, v))


def fused_context(drafter: DFlashDrafter, features: torch.Tensor) -> torch.Tensor:
    """The drafter's context C (DFlashDrafter.fuse) as the training step computes it."""
    return drafter.fuse(features)


def final_norm(drafter: DFlashDrafter, x: torch.Tensor) -> torch.Tensor:
    return drafter.norm(x)


class DFlashDrafter(nn.Module):
    """The trainable drafter. forward() returns norm(x) [Q, d]; the caller applies the lm_head."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.layers = nn.ModuleList(
            self.make_layer(config) for _ in range(config.num_hidden_layers)
        )
        self.fc = nn.Linear(config.num_features * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        # The pieces around the layers; compile_layers() swaps in compiled versions.
        self._fused_context = fused_context
        self._final_norm = final_norm
        self._layer: Callable | None = None  # compiled layer_forward, once compile_layers() ran
        self.reset_parameters()

    def make_layer(self, config: DrafterConfig) -> nn.Module:
        """One decoder layer (a drafter kind, e.g. DFlash2 in model/kinds/, makes its own)."""
        return DraftLayer(config)

    def compile_layers(self) -> None:
        """torch.compile each layer, attention included, as one graph: the layer module is an
        input, so one graph serves every layer. One graph rather than one on either side of a
        separately compiled attention: across such a boundary AOTAutograd makes the gradients
        of q and of the attention output contiguous, two [Q, H, hd] copies per layer, ~1.9 ms
        of a Qwen3-8B step on an H200 (BENCHMARKS.md). Also the context's and the output's
        RMSNorms: eager, each is seven fp32 passes over a [T, d] tensor forward and more
        backward. The objective compiles on a GPU only (on the CPU, inductor needs a C++
        toolchain and buys nothing; one CPU test compiles to check the graphs). `fuse` itself
        stays eager: evaluation calls it at other shapes."""
        compiled = functools.partial(torch.compile, dynamic=False, fullgraph=True)
        self._layer = compiled(layer_forward)
        self._fused_context = compiled(fused_context)
        self._final_norm = compiled(final_norm)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Qwen3's initialisation: normal(0, 0.02) linears, unit norms."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def block_stream(self, block_embeds: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The residual stream's input [Q, d]: the block's embeddings in the compute dtype, times
        input_embedding_scale when it is not 1 (skipped at 1: the default step is unchanged)."""
        x = block_embeds.to(dtype)
        scale = self.config.input_embedding_scale
        return x if scale == 1.0 else x * scale

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """C = hidden_norm(fc(concat of k target layers)): [T, k*d] -> [T, d]."""
        features = features.to(compute_dtype(self.fc.weight))
        return self.hidden_norm(self.fc(features))

    def forward(
        self,
        block_embeds: torch.Tensor,  # [Q, d] target embeddings of the block tokens
        block_positions: torch.Tensor,  # [Q] RoPE positions (anchor position + slot)
        features: torch.Tensor,  # [T, k*d] target hidden states of the context rows
        context_positions: torch.Tensor,  # [T] RoPE positions within each document
        attend: Attend | Sequence[Attend],  # one for all layers, or one per layer
    ) -> torch.Tensor:
        cfg = self.config
        dtype = compute_dtype(self.fc.weight)
        with step_range("features"):
            context = self._fused_context(self, features)  # [T, d]
        x = self.block_stream(block_embeds, dtype)  # the residual stream: the compute dtype
        block_rope = rope_cos_sin(block_positions, cfg.head_dim, cfg.rope_theta, dtype)
        context_rope = rope_cos_sin(context_positions, cfg.head_dim, cfg.rope_theta, dtype)
        attends = layer_attends(attend, len(self.layers))
        for layer, attend in zip(self.layers, attends, strict=True):
            x = self.run_layer(layer, x, context, block_rope, context_rope, attend)
        with step_range("final_norm"):
            return self._final_norm(self, x)

    def run_layer(self, layer, x, context, block_rope, context_rope, attend) -> torch.Tensor:
        """One decoder layer on the block stream x [Q, d] (a drafter kind, e.g. DFlash2 in
        model/kinds/, runs its own layer here)."""
        if self._layer is not None:  # compiled: attention inside the layer's range
            with step_range("layer"):
                return self._layer(layer, x, context, block_rope, context_rope, attend)
        with step_range("layer"):
            q, k, v = layer_attention_inputs(layer, x, context, block_rope, context_rope)
        with step_range("attention"):
            out = attend(q, k, v)
        with step_range("layer"):
            return layer_attention_output(layer, x, out)
