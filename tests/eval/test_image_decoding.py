"""Decoding image prompts losslessly (eval/recompute.py with the prompt's vision inputs): greedy
decoding of an image prompt equals HF's own `generate` (its cached path, the independent
reference), and speculative decoding equals that greedy output, for oracle drafters right on
0, 1 or 3 slots of each block and for a random DFlash drafter. The mutant: verify passes that
drop the image (the vision inputs not carried past the prompt) must break it; the image must
matter (the greedy output with it differs from the output without it).

A generated token is text whatever its id, as in HF's `generate`: targets whose greedy choice is
the image placeholder (forced by their lm_head row, `placeholder_target`) decode exactly as
`generate` does, speculative decoding through accepted and rejected placeholder drafts equals
their greedy output, and the evaluation checks it end to end. The mutant: generated
placeholders read as the image's (no multimodal ids known) must fail, as decoding once did.
"""

from __future__ import annotations

import json

import pytest
import torch
from image_text_kit import MULTIMODAL, image, image_record, tiny_multimodal

from dflash_async.data.images import encode_image_prompt
from dflash_async.eval import recompute
from dflash_async.eval.harness import evaluate, read_prompts
from dflash_async.eval.lossless import check_lossless, tie_tolerance_for
from dflash_async.eval.speculative import greedy_generate, speculative_decode, speculative_generate
from dflash_async.model.drafter import DFlashDrafter
from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.targets import multimodal
from dflash_async.targets.loading import frozen_embeddings
from dflash_async.targets.multimodal import multimodal_token_ids

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

MAX_NEW = 16
CPU = torch.device("cpu")
LAYERS = (1, 2)


@pytest.fixture(scope="module", params=sorted(MULTIMODAL))
def target(request):
    return tiny_multimodal(request.param)


def _prompts(processor):
    """Image prompts: one image of each of three sizes, then a question."""
    out = []
    for seed, size in enumerate(((64, 64), (32, 64), (32, 32))):
        messages = [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "What is two plus two?"}],
            }
        ]
        out.append(
            encode_image_prompt(processor, messages, [image(seed, size)], enable_thinking=True)
        )
    return out


class OracleDrafter:
    """Knows the target's greedy continuation; slots past `correct` get a wrong token."""

    def __init__(self, sequence: list[int], block_size: int, correct: int, vocab: int) -> None:
        self.sequence, self.block_size, self.correct, self.vocab = (
            sequence,
            block_size,
            correct,
            vocab,
        )

    def extend_context(self, features: torch.Tensor, positions: torch.Tensor) -> None:
        pass

    def draft(self, anchor_token: int, anchor_position: int) -> torch.Tensor:
        truth = self.sequence[anchor_position + 1 : anchor_position + self.block_size]
        truth += [0] * (self.block_size - 1 - len(truth))
        return torch.tensor([t if k < self.correct else self.wrong(t) for k, t in enumerate(truth)])

    def wrong(self, token: int) -> int:
        """The draft of a slot past `correct` whose right token is `token`."""
        return (token + 1) % self.vocab


def test_greedy_of_an_image_prompt_equals_hf_generate(target):
    processor, model = target
    for prompt in _prompts(processor):
        vision = prompt.model_inputs(CPU, torch.float32)
        ids = torch.as_tensor(prompt.input_ids, dtype=torch.long)[None]
        hf = model.generate(
            input_ids=ids, **vision, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False
        )
        plain = greedy_generate(model, prompt.input_ids.tolist(), MAX_NEW, None, vision=vision)
        assert plain.tokens == hf[0, ids.shape[1] :].tolist()
        text_only = greedy_generate(model, prompt.input_ids.tolist(), MAX_NEW, None)
        assert text_only.tokens != plain.tokens  # the image matters


@pytest.mark.parametrize("correct", [0, 1, 3])
def test_speculative_decoding_of_image_prompts_equals_greedy(target, correct):
    processor, model = target
    vocab = model.config.get_text_config().vocab_size
    for prompt in _prompts(processor):
        ids, vision = prompt.input_ids.tolist(), prompt.model_inputs(CPU, torch.float32)
        plain = greedy_generate(model, ids, MAX_NEW, None, vision=vision)
        oracle = OracleDrafter(ids + plain.tokens, block_size=5, correct=correct, vocab=vocab)
        spec = speculative_decode(
            model,
            oracle,
            ids,
            layer_ids=LAYERS,
            max_new_tokens=MAX_NEW,
            eos_token_id=None,
            vision=vision,
        )
        assert spec.tokens == plain.tokens
        assert spec.accepted_lengths[:-1] == [correct + 1] * (len(spec.accepted_lengths) - 1)


def _random_drafter(model) -> tuple[DFlashDrafter, DrafterConfig]:
    text = model.config.get_text_config()
    config = DrafterConfig(
        hidden_size=text.hidden_size,
        num_hidden_layers=1,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        head_dim=text.head_dim,
        intermediate_size=text.intermediate_size,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        vocab_size=text.vocab_size,
        num_target_layers=text.num_hidden_layers,
        target_layer_ids=LAYERS,
        mask_token_id=text.vocab_size - 1,
        block_size=4,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        drafter = DFlashDrafter(config).eval().requires_grad_(False)
    return drafter, config


def test_a_dflash_drafter_decodes_image_prompts_losslessly(target):
    processor, model = target
    drafter, config = _random_drafter(model)
    embed, lm_head = frozen_embeddings(model)
    for index, prompt in enumerate(_prompts(processor)):
        ids, vision = prompt.input_ids.tolist(), prompt.model_inputs(CPU, torch.float32)
        plain = greedy_generate(model, ids, MAX_NEW, None, vision=vision)
        spec = speculative_generate(
            model,
            drafter,
            config,
            embed.detach(),
            lm_head.detach(),
            ids,
            max_new_tokens=MAX_NEW,
            eos_token_id=None,
            vision=vision,
        )
        assert check_lossless(index, plain, spec, tie_tolerance_for(torch.float32)) is None


def test_verify_passes_without_the_image_are_caught(target, monkeypatch):
    """The mutant: the verify forwards run the sequence without the prompt's vision inputs."""
    processor, model = target
    vocab = model.config.get_text_config().vocab_size
    prompt = _prompts(processor)[0]
    ids, vision = prompt.input_ids.tolist(), prompt.model_inputs(CPU, torch.float32)
    plain = greedy_generate(model, ids, MAX_NEW, None, vision=vision)
    monkeypatch.setattr(recompute, "extended_inputs", lambda inputs, length: {})
    oracle = OracleDrafter(ids + plain.tokens, block_size=5, correct=1, vocab=vocab)
    spec = speculative_decode(
        model,
        oracle,
        ids,
        layer_ids=LAYERS,
        max_new_tokens=MAX_NEW,
        eos_token_id=None,
        vision=vision,
    )
    assert spec.tokens != plain.tokens


def test_evaluate_decodes_image_prompts_losslessly(target, tmp_path):
    """harness.evaluate on a prompts file of image records (and a text one): every prompt is
    checked lossless against its greedy baseline (LosslessError otherwise), the baseline kept
    under a key that covers the images: another image of the same size decodes afresh."""
    processor, model = target
    drafter, config = _random_drafter(model)
    for seed in range(2):
        image(seed, (32, 32)).save(tmp_path / f"{seed}.png")
    lines = [image_record(0, "0.png"), image_record(1, "1.png"), {"prompt": "Hello there!"}]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    records = read_prompts(tmp_path / "prompts.jsonl")

    def run():
        return evaluate(
            model,
            processor.tokenizer,
            drafter,
            config,
            records,
            max_new_tokens=8,
            processor=processor,
            baseline_dir=tmp_path / "baseline",
            target_id="tiny",
            warmup=False,
        )

    first = run()
    assert len(first["samples"]) == 3 and not first["baseline_cached"]
    assert "tau_teacher_forced" not in first  # text-only estimate, left out
    assert run()["baseline_cached"]
    image(7, (32, 32)).save(tmp_path / "0.png")  # same size, same tokens, other pixels
    assert not run()["baseline_cached"]


def test_run_eval_loads_the_wrapper_whole_for_image_prompts(tmp_path, monkeypatch):
    """`eval` (run_eval) on a prompts file with image records: the target folder's wrapper
    loads with its vision tower, prompts go through its processor (here the in-memory one:
    AutoProcessor of Qwen3-VL needs torchvision), and every sample is checked lossless."""
    from dflash_async.checkpoint.export import export_drafter
    from dflash_async.eval.harness import run_eval
    from dflash_async.targets import multimodal

    processor, model = tiny_multimodal("qwen3_vl")
    model.save_pretrained(tmp_path / "target")
    processor.tokenizer.save_pretrained(tmp_path / "target")
    drafter, config = _random_drafter(model)
    export_drafter(drafter, config, tmp_path / "export")
    image(0, (32, 32)).save(tmp_path / "0.png")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(image_record(0, "0.png")) + "\n")
    monkeypatch.setattr(multimodal, "load_target_processor", lambda path: processor)
    report = run_eval(
        tmp_path / "target",
        tmp_path / "export",
        prompts,
        device="cpu",
        dtype=torch.float32,
        max_new_tokens=8,
    )
    assert len(report["samples"]) == 1 and report["lossless_checked"]


class RecordingOracle(OracleDrafter):
    """The oracle, keeping the context features and positions decoding gives it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.features: list[torch.Tensor] = []
        self.positions: list[int] = []

    def extend_context(self, features: torch.Tensor, positions: torch.Tensor) -> None:
        self.features.append(features.clone())
        self.positions += positions.tolist()


def test_decoding_gives_the_drafter_the_training_features_of_image_prompts():
    """What the drafter is given while decoding an image prompt equals the multimodal target
    forward's features (what it trains on) of the final sequence, row by row, deepstack visual
    features of Qwen3-VL's first layer included (tapped layers 0 and 2)."""
    from dflash_async.data.images import extended_inputs
    from dflash_async.targets.multimodal import MultimodalForward

    processor, model = tiny_multimodal("qwen3_vl")
    layers, vocab = (0, 2), model.config.get_text_config().vocab_size
    prompt = _prompts(processor)[0]
    ids, vision = prompt.input_ids.tolist(), prompt.model_inputs(CPU, torch.float32)
    plain = greedy_generate(model, ids, MAX_NEW, None, vision=vision)
    oracle = RecordingOracle(ids + plain.tokens, block_size=5, correct=2, vocab=vocab)
    speculative_decode(
        model,
        oracle,
        ids,
        layer_ids=layers,
        max_new_tokens=MAX_NEW,
        eos_token_id=None,
        vision=vision,
    )
    n = len(oracle.positions)
    assert oracle.positions == list(range(n)) and n >= len(ids) + MAX_NEW - 5
    sequence = torch.tensor(ids + plain.tokens)[:n]
    width = len(layers) * model.config.get_text_config().hidden_size
    expected = torch.zeros(n, width)
    forward = MultimodalForward(model, layers)
    try:
        whole = extended_inputs(vision, n)
        forward(sequence, torch.arange(n), torch.zeros(n, dtype=torch.long), expected, [n], [whole])
    finally:
        forward.close()
    # the same modules on other row counts (a prefill, verify blocks, the whole sequence):
    # fp32 rounding of features of magnitude ~0.1 over 3 layers
    torch.testing.assert_close(torch.cat(oracle.features), expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=sorted(MULTIMODAL))
def placeholder_target(request, one_intra_op_thread):
    """(processor, model, placeholder id) of a family whose greedy continuation of the first
    prompt starts with its image placeholder: the placeholder's lm_head row is twice the row of
    the unforced first token t, so its logit is twice t's, the largest and positive (asserted),
    there and wherever t would lead; elsewhere the target picks text."""
    processor, model = tiny_multimodal(request.param)
    placeholder = model.config.image_token_id
    prompt = _prompts(processor)[0]
    ids = torch.as_tensor(prompt.input_ids, dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(input_ids=ids, **prompt.model_inputs(CPU, torch.float32)).logits[0, -1]
        first = int(logits.argmax())
        assert logits[first] > 0 and first != placeholder
        weight = model.get_output_embeddings().weight
        weight[placeholder] = 2 * weight[first]
    return processor, model, placeholder


class PlaceholderOracle(OracleDrafter):
    """The oracle whose wrong slots draft the image placeholder (the truth + 1 where the truth
    is the placeholder): rejected placeholder drafts go through verify passes too."""

    def __init__(self, *args, placeholder: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.placeholder = placeholder

    def wrong(self, token: int) -> int:
        return (token + 1) % self.vocab if token == self.placeholder else self.placeholder


def test_a_generated_image_placeholder_is_a_text_token_as_in_hf_generate(placeholder_target):
    """Greedy decoding of an image prompt through generated placeholders equals HF's
    `generate`, whose steps after the prompt embed them as text (no vision inputs)."""
    processor, model, placeholder = placeholder_target
    generated = []
    for prompt in _prompts(processor):
        vision = prompt.model_inputs(CPU, torch.float32)
        ids = torch.as_tensor(prompt.input_ids, dtype=torch.long)[None]
        hf = model.generate(
            input_ids=ids, **vision, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False
        )
        plain = greedy_generate(model, prompt.input_ids.tolist(), MAX_NEW, None, vision=vision)
        assert plain.tokens == hf[0, ids.shape[1] :].tolist()
        generated += plain.tokens
    assert generated[0] == placeholder and set(generated) - {placeholder}  # both kinds decoded


@pytest.mark.parametrize("correct", [0, 2])
def test_speculative_decoding_through_generated_placeholders_equals_greedy(
    placeholder_target, correct
):
    """Accepted placeholder drafts (the greedy output's) and rejected ones (the oracle's wrong
    slots) leave the output the greedy one."""
    processor, model, placeholder = placeholder_target
    vocab = model.config.get_text_config().vocab_size
    for prompt in _prompts(processor):
        ids, vision = prompt.input_ids.tolist(), prompt.model_inputs(CPU, torch.float32)
        plain = greedy_generate(model, ids, MAX_NEW, None, vision=vision)
        oracle = PlaceholderOracle(
            ids + plain.tokens, block_size=5, correct=correct, vocab=vocab, placeholder=placeholder
        )
        spec = speculative_decode(
            model,
            oracle,
            ids,
            layer_ids=LAYERS,
            max_new_tokens=MAX_NEW,
            eos_token_id=None,
            vision=vision,
        )
        assert spec.tokens == plain.tokens
        assert spec.accepted_lengths[:-1] == [correct + 1] * (len(spec.accepted_lengths) - 1)


def test_evaluate_is_lossless_through_generated_placeholders(placeholder_target, tmp_path):
    """harness.evaluate of image records and a text one on the forced target: a DFlash drafter's
    output is checked against the baseline (LosslessError otherwise), placeholders in it."""
    processor, model, placeholder = placeholder_target
    drafter, config = _random_drafter(model)
    image(0, (64, 64)).save(tmp_path / "0.png")
    lines = [image_record(0, "0.png"), {"prompt": "Hello there!"}]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    report = evaluate(
        model,
        processor.tokenizer,
        drafter,
        config,
        read_prompts(tmp_path / "prompts.jsonl"),
        max_new_tokens=MAX_NEW,
        processor=processor,
        warmup=False,
    )
    assert report["lossless_checked"] and report["numerical_ties"] == 0
    assert placeholder in report["samples"][0]["tokens"]


def test_generated_placeholders_read_as_the_images_are_caught(placeholder_target, monkeypatch):
    """The mutant: no multimodal ids known, so a generated placeholder stays one in the whole
    sequence's forward, and the wrapper finds more placeholders than image features."""
    processor, model, placeholder = placeholder_target
    assert placeholder in multimodal_token_ids(model.config)
    monkeypatch.setattr(multimodal, "multimodal_token_ids", lambda config: frozenset())
    prompt = _prompts(processor)[0]
    vision = prompt.model_inputs(CPU, torch.float32)
    with pytest.raises(ValueError, match="do not match"):
        greedy_generate(model, prompt.input_ids.tolist(), MAX_NEW, None, vision=vision)


def test_a_wrapper_that_embeds_its_ids_elsewhere_is_refused(placeholder_target, monkeypatch):
    """Generated placeholders are text only if the wrapper embeds the ids it is given through
    its input embedding module: one that does not would read the stand-in's embedding, so
    decoding refuses it."""
    processor, model, _ = placeholder_target
    unused = torch.nn.Embedding(*model.get_input_embeddings().weight.shape)
    monkeypatch.setattr(model, "get_input_embeddings", lambda: unused)
    prompt = _prompts(processor)[0]
    vision = prompt.model_inputs(CPU, torch.float32)
    with pytest.raises(RuntimeError, match="did not embed"):
        greedy_generate(model, prompt.input_ids.tolist(), MAX_NEW, None, vision=vision)
