"""A random-weight target drawn from its config alone (DFLASH_TARGET__WEIGHTS=random), layer by
layer (dflash_async/targets/random_weights.py), on the CPU with tiny configs of the dense, MoE and
hybrid families (tests/arch_targets.py, 4 decoder layers here so that layers past the last
captured one exist).

- a run on a config-only folder (config.json and the tokenizer, no weights) trains and exits 0,
  unsplit and split over two stages with the same step lines (every unit is seeded by its name,
  so the split target is the same target, and the drafters redraw the same embeddings);
- the drawn model: no meta tensor among what runs, the buffers (rotary inv_freq, ...) equal a
  normally built model's, the weight std is the config's initializer_range within a tolerance
  derived from the sample size, the same seed draws the same weights;
- memory: with the FP8 swap after each layer the live tensor bytes never exceed the final size
  plus one unquantized layer;
- bad input: no config.json is exit 2 naming the folder; weight files are ignored, logged.
"""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path

import anyio
import pytest
import torch
from arch_targets import ARCHITECTURES, config_class, save_tiny_target, tiny_config
from structlog.testing import capture_logs
from tiny_run import tiny_env, write_pretokenized

from dflash_async.log import get_logger
from dflash_async.pipeline import run as pipeline
from dflash_async.pipeline.specs import run_spec
from dflash_async.settings.env import load_settings
from dflash_async.targets.config_readers import text_config_of
from dflash_async.targets.fp8.fp8_linear import swap_fp8_matmuls
from dflash_async.targets.generic_config import causal_lm_auto_class
from dflash_async.targets.loading import text_model
from dflash_async.targets.random_weights import (
    held_bytes,
    load_random_target,
    materialize_target,
    meta_target,
    random_embeddings,
)
from dflash_async.targets.resolve import TargetError
from dflash_async.targets.split import module_bytes
from dflash_async.targets.tiny import tiny_tokenizer

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("single_thread")]
CPU = torch.device("cpu")
FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5_moe_text")  # dense, MoE, hybrid MoE
LAYERS = 4


def _config(model_type: str):
    config = text_config_of(tiny_config(model_type))
    config.num_hidden_layers = LAYERS
    types = list(getattr(config, "layer_types", None) or ())
    config.layer_types = types[:2] * (LAYERS // 2) if types else None
    return config


def config_only_target(folder: Path, model_type: str) -> Path:
    """config.json and the tiny tokenizer, no weights."""
    _config(model_type).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    assert not list(folder.glob("*.safetensors"))
    return folder


def _env(target: Path, root: Path, **extra: str) -> dict[str, str]:
    root.mkdir(parents=True, exist_ok=True)
    data = root / "data.jsonl"
    if not data.exists():
        write_pretokenized(data, records=24, vocab=len(tiny_tokenizer()))
    env = tiny_env({"target": str(target), "data": str(data), "mask": ""}, root / "out")
    del env["DFLASH_DRAFTER__MASK_TOKEN_ID"]
    return (
        env
        | {
            "DFLASH_TARGET__WEIGHTS": "random",
            "DFLASH_TARGET__NUM_FEATURES": "2",
            "DFLASH_TARGET__TARGET_LAYER_IDS": "0,1",
            "DFLASH_TRAIN__MAX_STEPS": "3",
            "DFLASH_TRAIN__SAVE_EVERY": "0",
            "DFLASH_EVAL__EVERY": "0",
            "DFLASH_EVAL__AT_END": "false",
            "DFLASH_PIPELINE__DEVICES": "cpu",
        }
        | extra
    )


async def _run(env: dict[str, str]) -> tuple[int, list[dict]]:
    with capture_logs() as events, anyio.fail_after(90):
        code = await pipeline.run(load_settings(env), get_logger("test"))
    return code, events


def _steps(events: list[dict]) -> list[dict]:
    keys = ("step", "loss", "acc", "grad_norm", "tokens")
    return [{k: e[k] for k in keys} for e in events if e["event"] == "step"]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("model_type", FAMILIES)
async def test_a_random_target_from_a_config_only_folder_trains(
    model_type: str, tmp_path: Path
) -> None:
    target = config_only_target(tmp_path / "target", model_type)
    code, events = await _run(_env(target, tmp_path))
    assert code == 0 and len(_steps(events)) == 3
    (loaded,) = [e for e in events if e["event"] == "target_weights_loaded"]
    assert loaded["weight_format"] == "random" and loaded["seed"] == 42  # DFLASH_TRAIN__SEED
    assert (loaded["layers_drawn"], loaded["layers_on_meta"]) == (2, 2)  # ids 0,1 of 4 layers
    assert any(e["event"] == "target_weights_random" for e in events)
    assert all(math.isfinite(s["loss"]) for s in _steps(events))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_split_random_target_is_the_same_target(tmp_path: Path) -> None:
    target = config_only_target(tmp_path / "target", "qwen3")
    split = {"DFLASH_PIPELINE__DEVICES": "cpu,cpu", "DFLASH_TARGET__STAGES": "2"}
    unsplit = {
        "DFLASH_PIPELINE__TARGET_DEVICES": "cpu",
        "DFLASH_PIPELINE__DRAFTER_DEVICES": "cpu,cpu",
    }
    code, one = await _run(_env(target, tmp_path / "a", **unsplit))
    code2, two = await _run(_env(target, tmp_path / "b", **split))
    assert code == code2 == 0
    assert len(_steps(one)) == 3 and _steps(one) == _steps(two)
    (chained,) = [e for e in two if e["event"] == "target_split"]
    assert chained["stages"] == 2


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_run_that_decodes_draws_every_layer_and_evaluates(tmp_path: Path) -> None:
    target = config_only_target(tmp_path / "target", "qwen3")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2 plus 3?"}) + "\n")
    code, events = await _run(
        _env(
            target,
            tmp_path,
            DFLASH_EVAL__AT_END="true",
            DFLASH_EVAL__PROMPTS_PATH=str(prompts),
            DFLASH_EVAL__NUM_PROMPTS="1",
            DFLASH_EVAL__MAX_NEW_TOKENS="8",
        )
    )
    assert code == 0
    (loaded,) = [e for e in events if e["event"] == "target_weights_loaded"]
    assert (loaded["layers_drawn"], loaded["layers_on_meta"], loaded["lm_head_on_meta"]) == (
        LAYERS,
        0,
        False,
    )
    (final,) = [e for e in events if e["event"] == "eval"]
    assert final["tau"] >= 1


def test_the_evaluation_decides_whether_every_layer_is_drawn(tmp_path: Path) -> None:
    base = {
        "DFLASH_ENV_FILE": "none",
        "DFLASH_TARGET__PATH": str(tmp_path),
        "DFLASH_TARGET__WEIGHTS": "random",
        "DFLASH_PIPELINE__DEVICES": "cpu",
    }
    decodes = lambda **e: run_spec(load_settings(base | e)).target.decode  # noqa: E731
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    p = str(prompts)
    assert not decodes()  # at_end, but no prompts for a target of one's own: skipped
    assert decodes(DFLASH_EVAL__PROMPTS_PATH=p)
    assert not decodes(DFLASH_EVAL__PROMPTS_PATH=p, DFLASH_EVAL__AT_END="false")
    assert decodes(DFLASH_EVAL__PROMPTS_PATH=p, DFLASH_EVAL__AT_END="false", DFLASH_EVAL__EVERY="5")
    spec = run_spec(load_settings(base | {"DFLASH_TRAIN__SEED": "7"})).target
    assert (spec.weights, spec.random_seed) == ("random", 7)
    assert (
        run_spec(load_settings(base | {"DFLASH_TARGET__WEIGHTS": "checkpoint"})).target.random_seed
        is None
    )
    with pytest.raises(ValueError, match=r"WEIGHTS|weights"):
        load_settings(base | {"DFLASH_TARGET__WEIGHTS": "zeros"})


def _drawn(model_type: str, *, seed: int = 0, decode: bool = True, last: int | None = None):
    config = (
        _config(model_type) if model_type in FAMILIES else text_config_of(tiny_config(model_type))
    )
    model = meta_target(config, dtype=torch.float32)
    inner = text_model(model)
    n = len(inner.layers) if last is None else last + 1
    materialize_target(model, device=CPU, seed=seed, layers=range(n), decoder=inner, decode=decode)
    return model, config


# no text CausalLM class: exit 2 (see the bad-input test)
WRAPPERS_WITHOUT_TEXT_LM = {"qwen3_vl", "qwen3_vl_moe"}


@pytest.mark.parametrize(
    "model_type", [m for m in ARCHITECTURES if m not in WRAPPERS_WITHOUT_TEXT_LM]
)
def test_the_drawn_buffers_equal_a_normally_built_models(model_type: str) -> None:
    if config_class(model_type) is None:
        pytest.skip(f"transformers has no {ARCHITECTURES[model_type][0]}")
    model, config = _drawn(model_type)
    reference = causal_lm_auto_class(config).from_config(config, dtype=torch.float32)
    buffers = dict(reference.named_buffers())
    drawn = dict(model.named_buffers())
    assert drawn.keys() == buffers.keys() and drawn  # every model here has a rotary inv_freq
    for name, buffer in drawn.items():
        assert buffer.dtype == buffers[name].dtype and torch.equal(buffer, buffers[name]), name
    assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_only_the_layers_the_run_needs_are_drawn_and_none_of_them_is_meta(model_type) -> None:
    model, _ = _drawn(model_type, decode=False, last=1)
    inner = text_model(model)
    runs = [inner.embed_tokens, inner.rotary_emb, *inner.layers[:2]]
    assert not any(t.is_meta for m in runs for t in [*m.parameters(), *m.buffers()])
    assert all(t.is_meta for layer in inner.layers[2:] for t in layer.parameters())
    assert model.lm_head.weight.is_meta  # untied and no decoding: never drawn
    full, _ = _drawn(model_type)
    ref = dict(full.named_parameters())  # each unit's draw depends on its seed and name alone
    for name, p in model.named_parameters():
        if not p.is_meta:
            assert torch.equal(p, ref[name]), name


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_weights_have_the_configs_std_and_the_seed_decides_them(model_type: str) -> None:
    model, config = _drawn(model_type)
    # HF draws every matrix (linears, fused experts, conv1d, embeddings) from N(0, std)
    values = torch.cat([p.flatten() for p in model.parameters() if p.ndim >= 2])
    std, n = config.initializer_range, values.numel()
    # the sample std of n normal draws has a standard error std / sqrt(2n): 6 of them
    assert abs(values.std().item() - std) <= 6 * std / math.sqrt(2 * n)
    assert abs(values.mean().item()) <= 6 * std / math.sqrt(n)
    again, _ = _drawn(model_type)
    other, _ = _drawn(model_type, seed=1)
    for (name, p), q in zip(model.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)


def test_the_drafters_embeddings_are_the_targets(tmp_path: Path) -> None:
    target = config_only_target(tmp_path / "t", "qwen3")
    model, weights, facts = load_random_target(target, device=CPU, dtype=torch.float32, seed=3)
    embed, head = random_embeddings(target, seed=3, device=CPU, dtype=torch.bfloat16)
    assert torch.equal(embed, model.get_input_embeddings().weight.bfloat16())
    assert torch.equal(head, model.lm_head.weight.bfloat16())
    assert weights.name == "random" and not model.lm_head.weight.requires_grad
    assert facts["ignored_weight_files"] == []


def _live_bytes() -> int:
    """Bytes of every live CPU tensor's storage (gc: parameters, buffers and temporaries)."""
    storages = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and not obj.is_meta:
            try:  # a fake tensor left by an earlier compile has no data
                s = obj.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
            except RuntimeError:
                continue
    return sum(storages.values())


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_drawing_with_the_fp8_swap_peaks_one_layer_above_the_final_size(model_type) -> None:
    """The bound: when layer i is drawn (before its swap) memory holds the final embedding and
    rotary, layers < i quantized, and layer i unquantized: at most final + one unquantized
    layer. The whole unquantized target is far above that bound (4 layers, e4m3 is 1/4 of fp32)."""
    config = _config(model_type)
    config.hidden_size, config.intermediate_size, config.head_dim = 256, 512, 64
    config.moe_intermediate_size = 256
    gc.collect()
    before = _live_bytes()
    model = meta_target(config, dtype=torch.float32)
    inner = text_model(model)
    assert held_bytes(model) == 0  # meta: nothing held yet
    layer_bytes = max(module_bytes(layer) for layer in inner.layers)  # unquantized, fp32
    unquantized = module_bytes(model)
    seen = []

    def swap(layer, device):
        gc.collect()
        seen.append(_live_bytes() - before)
        swap_fp8_matmuls(layer, device=device, out_dtype=torch.float32)

    materialize_target(
        model, device=CPU, seed=0, layers=range(LAYERS), decoder=inner, decode=True, per_layer=swap
    )
    gc.collect()
    final = _live_bytes() - before
    assert final >= held_bytes(model) > 0
    assert max(seen) <= final + layer_bytes
    assert final + layer_bytes < unquantized  # the bound would catch a whole unquantized copy


def test_no_config_json_is_exit_2_naming_the_folder_and_weight_files_are_ignored(
    tmp_path: Path,
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    tiny_tokenizer().save_pretrained(empty)  # a tokenizer but no config.json
    # TargetError is exit 2 in the CLI (dflash_async/__main__.py)
    with pytest.raises(TargetError, match=f"{empty}.*has no config.json"):
        anyio.run(_run, _env(empty, tmp_path / "a"))
    with pytest.raises(TargetError, match=f"{empty}.*has no config.json"):
        load_random_target(empty, device=CPU, seed=0)
    with_weights = save_tiny_target(tmp_path / "w", "qwen3")
    code, events = anyio.run(
        _run, _env(with_weights, tmp_path / "b", DFLASH_TARGET__TARGET_LAYER_IDS="0,1")
    )
    assert code == 0
    (ignored,) = [e for e in events if e["event"] == "target_weight_files_ignored"]
    assert any(f.endswith(".safetensors") for f in ignored["files"])
