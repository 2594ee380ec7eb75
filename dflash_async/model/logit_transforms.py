"""The drafter's logit transforms after the target's lm_head (docs/DFLASH.md s.10).

z = m * logits, then, with a softcap c, z = c * tanh(z / c): exactly what a released drafter's
inference code computes, so training (the chunked CE of objective.py, the DFlash2 top-k) and
every logit a test or an evaluation reads go through this one module. The derivative is written
from z alone (dz/dlogits = m * (1 - (z/c)^2)), so the CE chunk keeps nothing else alive.
The defaults (m = 1, no cap) are the identity and callers skip the transform entirely, which
keeps a default drafter's step bit for bit what it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the config is built from every kind's fields (model/kinds/)
    from dflash_async.model.drafter_config import DrafterConfig


@dataclass(frozen=True)
class LogitTransform:
    multiplier: float = 1.0  # m: output_multiplier
    softcap: float | None = None  # c: final_logit_softcapping; None = no cap

    @property
    def is_identity(self) -> bool:
        return self.multiplier == 1.0 and self.softcap is None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] raw logits -> transformed, in at least fp32 (tanh in bf16 loses the tail)."""
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if self.multiplier != 1.0:
            z = z * self.multiplier
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def chain(self, grad_z: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """d/dlogits from d/dz and the transformed z: grad_z * m * (1 - (z/c)^2)."""
        grad = grad_z * self.multiplier
        if self.softcap is None:
            return grad
        return grad * (1.0 - (z.to(grad.dtype) / self.softcap).square())


def logit_transform_of(config: DrafterConfig) -> LogitTransform:
    """The transform of a drafter's config (output_multiplier, final_logit_softcapping)."""
    return LogitTransform(config.output_multiplier, config.final_logit_softcapping)


def transformed_ce_and_grad(
    transform: LogitTransform,
    elementwise: Callable,  # objective.ce_and_grad_from_logits or ce_kernel's Triton pass
    logits: torch.Tensor,  # [c, V] raw lm_head logits of one CE chunk
    labels: torch.Tensor,  # [c]
    weights: torch.Tensor,  # [c]
) -> tuple[torch.Tensor, ...]:
    """The CE chunk's elementwise pass on z = transform(logits): (sum(w*CE), argmax==label [c],
    d sum(w*CE) / d logits [c, V] in the logits' dtype, z [c, V]), then whatever `elementwise`
    returns after its gradient (DFlash2's group maxima of z). The identity passes the raw
    logits straight through (z is then `logits` itself)."""
    if transform.is_identity:
        ce_sum, hit, grad, *extra = elementwise(logits, labels, weights)
        return ce_sum, hit, grad, logits, *extra
    z = transform(logits)  # [c, V], at least fp32
    ce_sum, hit, grad_z, *extra = elementwise(z, labels, weights)
    return ce_sum, hit, transform.chain(grad_z, z).to(logits.dtype), z, *extra
