"""What the tests of a generic-path target's taps share: the generic forward's features of one
document, and two decoding checks by recomputation on a tiny fp32 target (tests/targets/
test_altup.py, test_hyper_connections.py, test_sublayer_counts.py, test_padded_unembedding.py),
and the reference those taps are held to: what the model itself reads next (`inputs_read`).

- a random drafter reads the tapped features at every step: speculative decoding must give
  greedy's tokens;
- an oracle drafter right for the first `correct` slots of every block commits exactly that
  prefix (plus the target's token) and stays lossless (check_lossless, 1e-4 tie margin: fp32 on
  CPU, one kernel path, so exact).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from causal_lm_zoo import VOCAB

from dflash_async.eval.lossless import GreedyResult, check_lossless
from dflash_async.eval.speculative import greedy_generate, speculative_decode, speculative_generate
from dflash_async.model.drafter import DFlashDrafter
from dflash_async.model.drafter_config import drafter_config_from_target
from dflash_async.targets.generic import GenericForward
from dflash_async.targets.loading import frozen_embeddings, text_config

BLOCK_SIZE = 4


def generic_features(target, layer_ids: Sequence[int], ids: torch.Tensor) -> torch.Tensor:
    """GenericForward's features [1, n, k*d] of the document `ids` [1, n]."""
    forward = GenericForward(target, layer_ids, max_batch_tokens=64)
    try:
        return forward.features(ids)
    finally:
        forward.close()


def inputs_read(
    target, ids: torch.Tensor, readers: Sequence[torch.nn.Module]
) -> list[torch.Tensor]:
    """The first input each module of `readers` receives in the target's forward on `ids`
    [1, n] (forward pre-hooks): what the model feeds forward into them, from inside its forward."""
    seen: dict[int, torch.Tensor] = {}

    def keep(i):
        return lambda module, args: seen.__setitem__(i, args[0].detach().clone())

    handles = [m.register_forward_pre_hook(keep(i)) for i, m in enumerate(readers)]
    try:
        with torch.no_grad():
            target(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return [seen[i] for i in range(len(readers))]


def close(got: torch.Tensor, want: torch.Tensor, *, rtol: float) -> bool:
    """Largest |got - want| within `rtol` of the largest |want|."""
    return bool((got - want).abs().max() <= rtol * want.abs().max())


def prompts() -> list[list[int]]:
    """Two prompts (3 and 9 tokens) of ids below the mask token (VOCAB - 1)."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB - 1, (n,), generator=gen).tolist() for n in (3, 9)]


def assert_a_random_drafter_decodes_greedily(
    target, layer_ids: Sequence[int], *, max_new: int
) -> None:
    config = drafter_config_from_target(
        target.config,
        num_hidden_layers=1,
        num_features=len(layer_ids),
        block_size=BLOCK_SIZE,
        mask_token_id=VOCAB - 1,
        target_layer_ids=tuple(layer_ids),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        drafter = DFlashDrafter(config).eval().requires_grad_(False)
    embed, lm_head = frozen_embeddings(target)
    for prompt in prompts():
        plain = greedy_generate(target, prompt, max_new, None)
        spec = speculative_generate(
            target,
            drafter,
            config,
            embed,
            lm_head,
            prompt,
            max_new_tokens=max_new,
            eos_token_id=None,
        )
        assert spec.tokens == plain.tokens and len(spec.tokens) == max_new


class Oracle:
    """Knows the greedy continuation; right for the first `correct` slots of every block; checks
    the features it is given are `width` wide."""

    def __init__(self, sequence: list[int], correct: int, width: int) -> None:
        self.sequence, self.correct, self.width = sequence, correct, width

    def extend_context(self, features: torch.Tensor, positions: torch.Tensor) -> None:
        assert features.shape[-1] == self.width

    def draft(self, anchor_token: int, anchor_position: int) -> torch.Tensor:
        truth = self.sequence[anchor_position + 1 : anchor_position + BLOCK_SIZE]
        truth += [0] * (BLOCK_SIZE - 1 - len(truth))
        return torch.tensor(
            [t if k < self.correct else (t + 1) % VOCAB for k, t in enumerate(truth)]
        )


def assert_partly_right_drafts_stay_greedy(
    target, layer_ids: Sequence[int], correct: int, *, max_new: int
) -> None:
    width = len(layer_ids) * text_config(target).hidden_size  # the taps, each collapsed
    for i, prompt in enumerate(prompts()):
        plain = greedy_generate(target, prompt, max_new + BLOCK_SIZE, None)
        oracle = Oracle(prompt + plain.tokens, correct, width)
        spec = speculative_decode(
            target, oracle, prompt, layer_ids=layer_ids, max_new_tokens=max_new, eos_token_id=None
        )
        cut = GreedyResult(
            plain.tokens[:max_new], plain.runner_up[:max_new], plain.margins[:max_new]
        )
        assert check_lossless(i, cut, spec, tolerance=1e-4) is None
        assert spec.accepted_lengths[:-1] == [correct + 1] * (len(spec.accepted_lengths) - 1)
