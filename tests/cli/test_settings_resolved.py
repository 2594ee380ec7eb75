"""A real run's defaults are a real run's; the demo keeps its preset; `settings_resolved` says
where each value came from and warns about contradictions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_async.pipeline.specs import run_spec
from dflash_async.settings.env import load_settings, load_with_sources, repo_root
from dflash_async.settings.resolved import resolve

pytestmark = pytest.mark.timeout(60)
DEMO = repo_root() / "settings" / "demo.env"
# config.json of the Qwen3-8B shape (8.19 B parameters) and of a Qwen3.5-35B-A3B-like MoE
# (256 experts of width 512 over 40 layers: 32 B in the experts alone)
QWEN3_8B = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}
MOE_35B = QWEN3_8B | {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_experts": 256,
    "moe_intermediate_size": 512,
    "vocab_size": 248320,
}


def user_environment(tmp_path: Path, config: dict) -> dict[str, str]:
    """What README's "What you usually set" sets: target, data and output folder, nothing else."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(config))
    data = tmp_path / "chats.jsonl"
    data.write_text("{}\n")
    return {
        "DFLASH_TARGET__PATH": str(target),
        "DFLASH_DATA__PATH": str(data),
        "DFLASH_OUTPUT_DIR": str(tmp_path / "out"),
    }


def test_target_data_and_output_alone_train_on_every_visible_gpu_with_the_recipe(
    tmp_path: Path,
) -> None:
    settings, sources = load_with_sources(user_environment(tmp_path, QWEN3_8B))
    assert settings.env_file == "none"  # not the demo preset
    assert settings.pipeline.layout == "auto"
    assert settings.pipeline.devices == settings.pipeline.target_devices == ()
    assert settings.pipeline.drafter_devices == ()
    train = settings.train
    assert (train.token_budget, train.num_anchors, train.block_size) == (16384, 1024, 16)
    assert (settings.drafter.num_layers, settings.data.max_len, train.max_steps) == (5, 3072, 0)
    spec = run_spec(settings, visible_gpus=8)
    assert [str(d) for d in spec.placement.devices] == [f"cuda:{i}" for i in range(8)]
    assert spec.placement.given is None
    assert (spec.step.attention, spec.step.cuda_graph, spec.step.compile) == ("flex", True, True)
    resolution = resolve(settings, sources, visible_gpus=8)
    assert resolution.devices == "cuda:0..cuda:7 (every visible GPU), placement auto"
    assert resolution.warnings == ()
    auto = [origin for origin in resolution.sources if origin.startswith("auto")]
    assert auto == ["auto: the recipe for a target of 8.2 B parameters"]
    assert resolution.sources[auto[0]] == [
        "DFLASH_TRAIN__TOKEN_BUDGET",
        "DFLASH_TRAIN__NUM_ANCHORS",
        "DFLASH_PIPELINE__NUM_SLOTS",
    ]
    assert spec.placement.num_slots == 2
    assert "DFLASH_TARGET__PATH" in resolution.sources["environment"]


def test_a_large_target_gets_the_deeper_drafter_and_the_environment_overrides_the_recipe(
    tmp_path: Path,
) -> None:
    environ = user_environment(tmp_path, MOE_35B) | {"DFLASH_TRAIN__NUM_ANCHORS": "512"}
    settings, sources = load_with_sources(environ)
    assert (settings.drafter.num_layers, settings.train.num_anchors) == (8, 512)
    assert sources.by_name["DFLASH_TRAIN__NUM_ANCHORS"] == "environment"
    assert sources.by_name["DFLASH_DRAFTER__NUM_LAYERS"].startswith("auto: the recipe for a target")


def test_a_real_target_on_a_machine_without_gpus_is_warned_about(tmp_path: Path) -> None:
    settings, sources = load_with_sources(user_environment(tmp_path, QWEN3_8B))
    resolution = resolve(settings, sources, visible_gpus=0)
    assert resolution.devices == "cpu (no GPU visible), placement auto"
    assert any("no GPU is visible here" in w for w in resolution.warnings)


def test_the_demo_still_gets_the_demo_preset_value_for_value() -> None:
    explicit = load_settings({"DFLASH_ENV_FILE": str(DEMO)}).public_dict()
    assert load_settings({}).public_dict() == explicit
    settings, sources = load_with_sources({})
    assert set(sources.by_name.values()) == {str(DEMO)}
    assert resolve(settings, sources, visible_gpus=8).warnings == ()


def test_a_data_path_without_a_target_keeps_the_demo_preset_and_says_so(tmp_path: Path) -> None:
    data = tmp_path / "chats.jsonl"
    data.write_text("{}\n")
    settings, sources = load_with_sources({"DFLASH_DATA__PATH": str(data)})
    assert Path(settings.env_file) == DEMO
    warnings = resolve(settings, sources, visible_gpus=0).warnings
    assert any("without DFLASH_TARGET__PATH" in w for w in warnings)


def test_devices_in_the_environment_replace_the_presets_roles() -> None:
    settings, sources = load_with_sources({"DFLASH_PIPELINE__DEVICES": "cpu,cpu"})
    pipe = settings.pipeline
    assert (pipe.devices, pipe.target_devices, pipe.drafter_devices) == (("cpu", "cpu"), (), ())
    assert "set aside" in sources.notes[0] and "TARGET_DEVICES" in sources.notes[0]
    spec = run_spec(settings, visible_gpus=0)
    assert spec.placement.given is None and len(spec.placement.devices) == 2


def test_roles_and_devices_both_given_and_gpus_on_a_machine_without_them_are_warned() -> None:
    settings, sources = load_with_sources(
        {
            "DFLASH_PIPELINE__DEVICES": "0,1",
            "DFLASH_PIPELINE__TARGET_DEVICES": "0",
            "DFLASH_PIPELINE__DRAFTER_DEVICES": "1",
            "DFLASH_PIPELINE__LAYOUT": "split",
        }
    )
    warnings = resolve(settings, sources, visible_gpus=1).warnings
    assert any(
        "DFLASH_PIPELINE__DEVICES=cuda:0,cuda:1 (environment) is not used" in w for w in warnings
    )
    assert any("DFLASH_PIPELINE__LAYOUT=split (environment) is not used" in w for w in warnings)
    assert any("name cuda:1 but this machine has 1 visible" in w for w in warnings)
