"""A target whose unembedding produces fewer tokens than its embedding holds (transformers'
`unpadded_vocab_size`: Inkling 2 stores it padded to `vocab_size`, drops the padded rows at
load) shares one lm_head with the drafter in training and in decoding: the real rows, then zero
rows up to the embedding's; decoding with it stays lossless.

Tiny random targets of transformers' own classes (tests/causal_lm_zoo.py's tiny configs: 640
embedding rows, 512 output rows, hidden 32).
"""

from __future__ import annotations

import pytest
import torch
from causal_lm_zoo import save_tiny
from tap_kit import (
    assert_a_random_drafter_decodes_greedily,
)

from dflash_async.targets.embeddings import load_frozen_embeddings
from dflash_async.targets.loading import frozen_embeddings, load_target

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

KINDS = ("inkling2_text", "inkling2_loop_text")
MAX_NEW = 12


@pytest.fixture(scope="module", params=KINDS)
def saved(request, tmp_path_factory):
    folder, config = save_tiny(tmp_path_factory.mktemp(request.param), request.param)
    assert config.unpadded_vocab_size < config.vocab_size  # what makes it special
    return folder, load_target(folder, device=torch.device("cpu"), dtype=torch.float32)


def test_training_and_decoding_share_one_lm_head_with_zero_padded_rows(saved):
    folder, target = saved
    cpu = torch.device("cpu")
    embed, lm_head = load_frozen_embeddings(str(folder), device=cpu, dtype=torch.float32)
    d_embed, d_head = frozen_embeddings(target)
    rows = target.config.unpadded_vocab_size
    assert lm_head.shape == embed.shape == d_head.shape == d_embed.shape
    assert torch.equal(lm_head, d_head)  # the same tensor: loading is exact, no arithmetic
    assert torch.equal(d_head[:rows], target.get_output_embeddings().weight)
    assert not d_head[rows:].any()


def test_a_checkpoints_nonzero_padded_rows_are_not_read(saved, tmp_path):
    """transformers stores the padded rows as zeros; another writer's may hold anything."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder, target = saved
    copy = shutil.copytree(folder, tmp_path / "copy")
    rows = target.config.unpadded_vocab_size
    for file in copy.glob("*.safetensors"):
        tensors = load_file(file)
        if "lm_head.weight" in tensors:
            tensors["lm_head.weight"][rows:] = 1.0
            save_file(tensors, file, metadata={"format": "pt"})
    cpu = torch.device("cpu")
    _, lm_head = load_frozen_embeddings(str(copy), device=cpu, dtype=torch.float32)
    assert torch.equal(lm_head, frozen_embeddings(target)[1])


def test_speculative_decoding_with_a_random_drafter_is_greedy(saved):
    """A random drafter may draft a padded token (score 0): the target rejects it; decoding by
    recomputation must give greedy's tokens."""
    _, target = saved
    assert_a_random_drafter_decodes_greedily(target, (0, 1), max_new=MAX_NEW)
