"""Hyper-connection targets (DeepSeek-V4, HY-V4, Qwen4-Exp): a tap is the collapse the model
itself feeds forward, the same tensor in training and in decoding, and decoding stays lossless.

Tiny random targets of transformers' own classes (tests/causal_lm_zoo.py's tiny configs: 2
layers, hidden 32, 4 residual streams). The reference is read inside transformers' forward: what
layer 1's attention reads (collapsed from layer 0's output streams by layer 1's `attn_hc`, or
Qwen4-Exp's `attn_hyper_connection`) and what follows the last layer reads (the final norm's
input, collapsed by `hc_head`; Qwen4-Exp: the lm_head's, by `hyper_connection_mixer`). Mutants
(one stream, the mean of the streams) must miss it.
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

# model_type -> (the module of layer 1 whose input is what it reads from layer 0's streams, the
# module after the last layer whose input is what the model reads from its streams)
READERS = {
    "deepseek_v4": (lambda layer: layer.input_layernorm, lambda model: model.model.norm),
    "hy_v4": (lambda layer: layer.input_layernorm, lambda model: model.model.norm),
    "qwen4_exp_text": (
        lambda layer: getattr(layer, "linear_attn", None) or layer.self_attn,
        lambda model: model.lm_head,
    ),
}
KINDS = tuple(READERS)
HIDDEN = 32
STREAMS = 4
LAYERS = (0, 1)  # layer 0: the next layer's attn_hc collapse; layer 1 (the last): hc_head's
TOKENS = 12
MAX_NEW = 16
# The tap runs the model's own modules on the very tensor the model passes them (fp32, CPU,
# same shapes): equal up to fp32 reassociation, ~1e-7 relative; 1e-5 leaves room. A wrong
# collapse moves features by their own size (the mutants below: > 100x this).
RTOL = 1e-5


@pytest.fixture(scope="module", params=KINDS)
def target(request):
    """transformers' initialisation weighs every stream alike and keeps the streams equal (a
    collapse is then any average); O(1) random hyper-connection weights, as a trained model
    has, make the streams and their weights differ per token."""
    model = random_target(tiny_config(request.param), seed=0)
    for seed, (name, module) in enumerate(model.named_modules()):
        if name.rsplit(".", 1)[-1] in (
            "attn_hc",
            "ffn_hc",
            "hc_head",
            "attn_hyper_connection",
            "mlp_hyper_connection",
            "hyper_connection_mixer",
        ):
            randomize_(module, seed)
    return model


def _split(streams: torch.Tensor) -> torch.Tensor:
    """Streams [.., STREAMS, D] as they come, or Qwen4-Exp's flattened [.., STREAMS * D] split."""
    return streams if streams.shape[-1] == HIDDEN else streams.unflatten(-1, (STREAMS, HIDDEN))


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB - 1, (1, TOKENS), generator=torch.Generator().manual_seed(3))


def _reference(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the model reads from layer 0's and layer 1's output streams, from inside its forward."""
    layer_reader, final_reader = READERS[target.config.model_type]
    readers = (layer_reader(decoder_layers(target)[1]), final_reader(target))
    after_0, after_1 = inputs_read(target, ids, readers)
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
    [lambda streams: _split(streams)[..., 0, :], lambda streams: _split(streams).mean(dim=-2)],
    ids=["stream 0", "mean of streams"],
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
