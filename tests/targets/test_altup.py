"""AltUp targets (Gemma 3n): a tap is the tensor the model itself reads from a layer's
predictions next, the same tensor in training and in decoding, and decoding stays lossless.

A tiny random target of transformers' own class (tests/causal_lm_zoo.py's tiny config: 2 layers,
hidden 32, 4 AltUp predictions). The reference is read inside transformers' forward: the input of
layer 1's `input_layernorm` (layer 1's active prediction, mixed from layer 0's output predictions
by layer 1's `altup.predict`) and the input of the final norm (the last layer's predictions
un-projected and averaged). Mutants (the active prediction unmixed, the mean of the predictions)
must miss it.
"""

from __future__ import annotations

from types import MappingProxyType

import pytest
import torch
from causal_lm_zoo import VOCAB, tiny_config
from conftest import randomize_
from tap_kit import (
    assert_a_random_drafter_decodes_greedily,
    assert_partly_right_drafts_stay_greedy,
    close,
    generic_features,
    inputs_read,
)

from dflash_async.eval.speculative import (
    captured_layers,
)
from dflash_async.targets import stream_taps
from dflash_async.targets.loading import decoder_layers, random_target

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

KINDS = ("gemma3n_text",)
LAYERS = (0, 1)  # layer 0: the next layer's active prediction; layer 1 (the last): the average
TOKENS = 12
MAX_NEW = 16
# The tap runs the model's own modules (or, after the last layer, its very operations) on the very
# tensor the model passes them (fp32, CPU, same shapes): equal up to fp32 reassociation, ~1e-7
# relative; 1e-5 leaves room. A wrong collapse moves features by a sizeable part of their own
# size (the mutants below: > 100x this).
RTOL = 1e-5


@pytest.fixture(scope="module", params=KINDS)
def target(request):
    """transformers' initialisation zeroes AltUp's mixing (predict then returns its input, and the
    active prediction is the active stream itself); O(1) random AltUp weights and projections,
    as a trained model has, make the predictions mix and differ per token."""
    model = random_target(tiny_config(request.param), seed=0)
    for seed, (name, module) in enumerate(model.named_modules()):
        if name.rsplit(".", 1)[-1] in ("altup", "altup_projections", "altup_unembed_projections"):
            randomize_(module, seed)
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB - 1, (1, TOKENS), generator=torch.Generator().manual_seed(3))


def _reference(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the model reads from layer 0's and layer 1's output predictions, from inside its
    forward."""
    layers = decoder_layers(target)
    after_0, after_1 = inputs_read(target, ids, (layers[1].input_layernorm, target.model.norm))
    return after_0, after_1


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return close(got, want, rtol=RTOL)


def test_the_training_tap_is_what_the_model_feeds_forward_from_each_layer(target):
    ids = _ids()
    want = torch.cat(_reference(target, ids), dim=-1)
    got = generic_features(target, LAYERS, ids)
    assert got.shape == (1, TOKENS, 2 * target.config.hidden_size)
    assert _close(got, want)


def test_the_decoding_tap_is_the_training_tap(target):
    ids = _ids()
    after_0, after_1 = _reference(target, ids)
    with captured_layers(target, LAYERS) as outputs, torch.no_grad():
        target(input_ids=ids, use_cache=False)
    assert _close(outputs[0], after_0) and _close(outputs[1], after_1)


@pytest.mark.parametrize(
    "mutant",
    [lambda predictions: predictions[0], lambda predictions: predictions.mean(dim=0)],
    ids=["active prediction unmixed", "mean of predictions"],
)
def test_a_tap_that_does_not_collapse_as_the_model_does_is_caught(target, mutant, monkeypatch):
    kind = target.config.model_type
    wrong = MappingProxyType({kind: lambda model, layers, index: mutant})
    monkeypatch.setattr(stream_taps, "STREAM_TAPS", wrong)
    ids = _ids()
    want = torch.cat(_reference(target, ids), dim=-1)
    got = generic_features(target, LAYERS, ids)
    assert (got - want).abs().max() > 100 * RTOL * want.abs().max()


def test_speculative_decoding_with_a_random_drafter_is_greedy(target):
    """A random drafter reads the tapped features (k * hidden wide) at every step; decoding by
    recomputation must give greedy's tokens."""
    assert_a_random_drafter_decodes_greedily(target, LAYERS, max_new=MAX_NEW)


@pytest.mark.parametrize("correct", [0, 2])
def test_partly_right_drafts_commit_their_prefix_and_stay_greedy(target, correct):
    """fp32 on CPU, one kernel path (recomputation): exact; 1e-4 is check_lossless's tie margin."""
    assert_partly_right_drafts_stay_greedy(target, LAYERS, correct, max_new=MAX_NEW)
