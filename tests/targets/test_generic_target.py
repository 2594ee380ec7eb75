"""The generic target path (targets/generic.py): any decoder LM transformers builds, outside the
families table, gives the features of its own HF forward run on each document alone, padding
rows zero; start-up refuses only what cannot work; eval decodes it losslessly by recomputation.

Targets: tiny random GPT-2 (attention, `transformer.h`), Mamba (a state-space model whose HF
`hidden_states` tuple starts after the first layer, not at the embeddings) and Bloom (ALiBi).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from causal_lm_zoo import VOCAB, tiny_config
from test_evaluate_batched import OneOracle
from transformers import AutoModelForCausalLM, BertConfig

from dflash_async.eval.batched_decoding import batched_unsupported_reason
from dflash_async.eval.evaluation import evaluation_unsupported_reason
from dflash_async.eval.speculative import greedy_generate, speculative_decode
from dflash_async.targets import generic
from dflash_async.targets.families import GENERIC, family_of, unsupported_reason
from dflash_async.targets.forward import select_target_forward
from dflash_async.targets.generic import GenericForward, find_decoder_layers
from dflash_async.targets.generic_config import unknown_model_type
from dflash_async.targets.resolve import TargetError

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

TYPES = ("gpt2", "mamba", "bloom")
LAYER_IDS = (0, 2)  # of 4 layers: not the last, and a layer after an untapped one
LENGTHS = np.array([10, 7, 10, 5])  # two of equal length share one forward
BUDGET = 48


def _model(model_type: str, layers: int = 4):
    config = tiny_config(model_type)
    config.num_hidden_layers = layers
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).eval()


def _reference(model, ids: torch.Tensor, layer_ids) -> torch.Tensor:
    """The tapped layers' outputs [n, k*d] of one document, its whole forward run alone."""
    layers, outputs = find_decoder_layers(model), {}

    def keep(i):
        def hook(module, args, output):
            outputs[i] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [layers[i].register_forward_hook(keep(i)) for i in layer_ids]
    try:
        with torch.no_grad():
            model(input_ids=ids[None], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat([outputs[i][0] for i in layer_ids], dim=-1)


def _pack_features(forward, lengths=LENGTHS, width=None):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 500, (BUDGET,), generator=generator)
    features = torch.full((BUDGET, width), float("nan"))  # garbage the forward must overwrite
    forward(ids, None, None, features, lengths)
    return ids, features


@pytest.mark.parametrize("model_type", TYPES)
def test_generic_features_are_each_documents_own_forward_and_padding_is_zero(model_type) -> None:
    model = _model(model_type)
    assert family_of(model.config) is GENERIC
    path = select_target_forward(model, LAYER_IDS, token_budget=BUDGET, max_batch_tokens=BUDGET)
    assert path.name == "hf" and "generic" in path.reason
    assert path.forward.early_exit  # every layer runs once: the forward stops at layer 2
    d = model.config.hidden_size
    ids, features = _pack_features(path.forward, width=len(LAYER_IDS) * d)
    offsets = np.concatenate([[0], np.cumsum(LENGTHS)])
    for lo, hi in itertools.pairwise(offsets):
        want = _reference(model, ids[lo:hi], LAYER_IDS)
        # fp32, the same document's forward batched 1 or 2 wide: rounding only (~1e-7 of |x|~3)
        torch.testing.assert_close(features[lo:hi], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(features[offsets[-1] :], torch.zeros_like(features[offsets[-1] :]))


def test_generic_features_of_an_attention_model_are_hfs_hidden_states() -> None:
    """For GPT-2, HF's hidden_states[i+1] is layer i's output (not for the last layer: ln_f)."""
    model = _model("gpt2")
    forward = GenericForward(model, LAYER_IDS, max_batch_tokens=BUDGET)
    d = model.config.hidden_size
    ids, features = _pack_features(forward, width=len(LAYER_IDS) * d)
    with torch.no_grad():
        states = model(input_ids=ids[None, :10], output_hidden_states=True).hidden_states
    want = torch.cat([states[i + 1][0] for i in LAYER_IDS], dim=-1)
    torch.testing.assert_close(features[:10], want, rtol=1e-5, atol=1e-5)


def test_documents_never_see_each_other() -> None:
    """Mutant check: the pack as one sequence (documents crossing) differs from the path's."""
    model = _model("mamba")
    forward = GenericForward(model, LAYER_IDS, max_batch_tokens=BUDGET)
    d = model.config.hidden_size
    ids, features = _pack_features(forward, width=len(LAYER_IDS) * d)
    crossing = _reference(model, ids[: LENGTHS.sum()], LAYER_IDS)
    assert not torch.allclose(features[10:17], crossing[10:17], atol=1e-3)


def test_equal_length_documents_share_a_forward_within_the_token_limit() -> None:
    groups = generic._equal_length_groups(np.array([4, 3, 4, 4, 0, 3]), max_batch_tokens=8)
    assert groups == [[0, 2], [3], [1, 5]]


def test_a_shared_layer_is_taken_at_its_last_call_and_the_forward_runs_whole() -> None:
    """A block shared by two positions (Zamba's shared attention): no early exit, so a tap
    holds the block's output after its last call, not its first."""
    model = _model("gpt2", layers=2)
    model.transformer.h[1] = model.transformer.h[0]
    forward = GenericForward(model, (0,), max_batch_tokens=BUDGET)
    assert not forward.early_exit
    ids = torch.arange(3, 13)
    features = forward.features(ids[None])[0]
    twice = _reference(model, ids, (1,))  # the second call's output
    torch.testing.assert_close(features, twice, rtol=1e-5, atol=1e-5)


def test_a_bidirectional_model_is_refused_by_the_probe() -> None:
    """BERT's LM head without is_decoder attends to later tokens: not a drafter target."""
    shape = dict(vocab_size=512, hidden_size=32, num_hidden_layers=2, intermediate_size=64)
    config = BertConfig(num_attention_heads=4, is_decoder=False, **shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(TargetError, match="not causal"):
        GenericForward(model, (0,), max_batch_tokens=BUDGET)
    config.is_decoder = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        GenericForward(AutoModelForCausalLM.from_config(config).eval(), (0,), BUDGET)


def test_start_up_refuses_encoder_decoders_and_unknown_model_types(tmp_path: Path) -> None:
    from transformers import T5Config, ViTConfig

    assert unsupported_reason(tiny_config("gpt2")) is None
    assert "encoder-decoder" in unsupported_reason(T5Config())
    assert "no causal-LM class" in unsupported_reason(ViTConfig())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "brand_new_lm"}))
    line = unknown_model_type(tmp_path)
    assert "'brand_new_lm' is not known to the installed transformers" in line
    assert "\n" not in line


@pytest.mark.parametrize("model_type", TYPES)
def test_generic_targets_decode_losslessly_by_recomputation(model_type: str) -> None:
    model = _model(model_type)
    assert batched_unsupported_reason(model) is not None
    assert evaluation_unsupported_reason(model) is None
    new, block = 12, 4
    prompts = [[(37 * i + 11 * j) % 400 + 10 for i in range(n)] for j, n in enumerate((14, 9))]
    for i, prompt in enumerate(prompts):
        greedy = greedy_generate(model, prompt, new, None).tokens
        with torch.no_grad():  # the same tokens from HF's own cached decoding
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=new, do_sample=False, min_new_tokens=new
            )
        assert out[0, len(prompt) :].tolist() == greedy
        oracle = OneOracle(i, prompt + greedy, block)
        spec = speculative_decode(
            model, oracle, prompt, layer_ids=LAYER_IDS, max_new_tokens=new, eos_token_id=None
        )
        assert spec.tokens == greedy


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_generic_state_space_target_trains_and_its_run_evaluates_losslessly(
    tmp_path: Path,
) -> None:
    """Mamba through the whole run: ARCH_STEPS steps, then the in-run evaluation (reference decoder,
    recomputation), lossless-checked against greedy decoding; no eval_failed."""
    from target_kit import save_random_target
    from test_architectures import ARCH_STEPS, arch_env, run_logged
    from tiny_run import write_pretokenized

    from dflash_async.targets.tiny import tiny_tokenizer

    config = tiny_config("mamba")
    config.vocab_size = len(tiny_tokenizer())  # the prompts' chat template uses all of it
    target = save_random_target(tmp_path / "mamba", config, 0)
    tiny_tokenizer().save_pretrained(target)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "What is 2 plus 3?"}\n{"prompt": "Name a color."}\n')
    data = write_pretokenized(tmp_path / "data.jsonl", records=12, vocab=VOCAB)
    env = arch_env({"data": str(data), "prompts": str(prompts)}, target, tmp_path / "out")
    code, events = await run_logged(env | {"DFLASH_DRAFTER__MASK_TOKEN_ID": "5"})
    failed = [e for e in events if e["event"] in ("eval_failed", "eval_skipped")]
    assert code == 0 and not failed, failed
    assert len([e for e in events if e["event"] == "step"]) == ARCH_STEPS
    (final,) = [e for e in events if e["event"] == "eval"]
    assert final["num_samples"] == 2 and final["tau"] >= 1


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_text_model_registered_only_as_image_text_to_text_trains(tmp_path: Path) -> None:
    """Mistral 4's text model (Mistral4ForCausalLM) is in transformers' image-text-to-text
    mapping only: start-up accepts it and loading builds it through that auto class."""
    from test_architectures import ARCH_STEPS, arch_env, run_logged
    from tiny_run import write_pretokenized
    from transformers import CONFIG_MAPPING, AutoModelForImageTextToText

    from dflash_async.targets.tiny import tiny_tokenizer

    config = CONFIG_MAPPING["mistral4"](**_mistral4_shape())
    assert unsupported_reason(config) is None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(config)
    model.save_pretrained(tmp_path / "mistral4")
    tiny_tokenizer().save_pretrained(tmp_path / "mistral4")
    data = write_pretokenized(tmp_path / "data.jsonl", records=12, vocab=VOCAB)
    env = arch_env({"data": str(data), "prompts": ""}, tmp_path / "mistral4", tmp_path / "out")
    env |= {"DFLASH_DRAFTER__MASK_TOKEN_ID": "5", "DFLASH_EVAL__AT_END": "false"}
    code, events = await run_logged(env)
    assert code == 0 and len([e for e in events if e["event"] == "step"]) == ARCH_STEPS


def _mistral4_shape() -> dict:
    """tiny_config's shape for a type outside the causal-LM mapping (the zoo covers that one)."""
    from causal_lm_zoo import COMMON, _shaped
    from transformers import CONFIG_MAPPING

    return _shaped(CONFIG_MAPPING["mistral4"], COMMON, {"num_key_value_heads": 4})
