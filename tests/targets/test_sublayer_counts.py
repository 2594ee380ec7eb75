"""A target whose `num_hidden_layers` counts sublayers (LongCat-Flash: each listed layer holds two
attention + MLP sublayers, num_hidden_layers = 2 x num_layers) is tapped at its listed layers: the
families table's LAYER_COUNTS entry gives the drafter's num_target_layers and default taps, the
training and decoding hooks take the same tensors, and decoding stays lossless.

A tiny random target of transformers' own class (tests/causal_lm_zoo.py's tiny config: 2 layers
of 2 sublayers, hidden 32). The reference is read inside transformers' forward: the input of
layer 1 (layer 0's output) and the input of the final norm (layer 1's output).
"""

from __future__ import annotations

from types import MappingProxyType

import pytest
import torch
from causal_lm_zoo import VOCAB, tiny_config
from tap_kit import (
    assert_a_random_drafter_decodes_greedily,
    close,
    generic_features,
    inputs_read,
)

from dflash_async.eval.speculative import captured_layers
from dflash_async.model.drafter_config import drafter_config_from_target
from dflash_async.targets import families
from dflash_async.targets.generic import GenericForward
from dflash_async.targets.loading import decoder_layers, random_target
from dflash_async.targets.resolve import TargetError

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

LAYERS = (0, 1)  # both listed layers; the config's num_hidden_layers is 4
TOKENS = 12
MAX_NEW = 16
# The hooks copy the very tensor the model passes on (fp32, CPU): equal bit for bit; 1e-6
# relative only absorbs a copy through another dtype path, never a wrong layer (O(1) apart).
RTOL = 1e-6


@pytest.fixture(scope="module")
def target():
    return random_target(tiny_config("longcat_flash"), seed=0)


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB - 1, (1, TOKENS), generator=torch.Generator().manual_seed(3))


def _reference(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's and layer 1's outputs as the model reads them next (layer 1, the final norm)."""
    readers = (target.model.layers[1], target.model.norm)
    after_0, after_1 = inputs_read(target, ids, readers)
    return after_0, after_1


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return close(got, want, rtol=RTOL)


def test_the_drafter_counts_and_taps_the_layers_the_model_lists(target):
    config = target.config
    assert config.num_hidden_layers == 2 * len(target.model.layers)  # what makes it special
    assert decoder_layers(target) is target.model.layers
    drafter = drafter_config_from_target(config, num_features=1, mask_token_id=VOCAB - 1)
    assert drafter.num_target_layers == len(target.model.layers)
    assert drafter.target_layer_ids == (1,)  # of 2 listed layers (2 of num_hidden_layers' 4)


def test_without_its_layer_count_entry_the_target_is_refused_at_load(target, monkeypatch):
    monkeypatch.setattr(families, "LAYER_COUNTS", MappingProxyType({}))
    with pytest.raises(TargetError, match="no list of 4 decoder layers"):
        GenericForward(target, LAYERS, max_batch_tokens=64)


def test_the_training_tap_is_each_listed_layers_output(target):
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


def test_speculative_decoding_with_a_random_drafter_is_greedy(target):
    """A random drafter reads the tapped features at every step; decoding by recomputation
    (the generic family's) must give greedy's tokens."""
    assert_a_random_drafter_decodes_greedily(target, LAYERS, max_new=MAX_NEW)
