"""Settings: every required name parses; bad names, values and files fail with one clear line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from dflash_async.errors import SettingsError
from dflash_async.settings.env import (
    load_settings,
    missing_paths,
    repo_root,
    setting_descriptions,
    setting_names,
)
from dflash_async.settings.values import parse_device_list

pytestmark = pytest.mark.timeout(30)
NO_FILE = {"DFLASH_ENV_FILE": "none"}
PRESETS = sorted((repo_root() / "settings").glob("*.env"))


def test_every_required_name_parses(tmp_path: Path) -> None:
    data = tmp_path / "chats.jsonl"
    data.write_text("{}\n")
    settings = load_settings(
        NO_FILE
        | {
            "DFLASH_OUTPUT_DIR": str(tmp_path / "out"),
            "DFLASH_TARGET__PATH": str(tmp_path),
            "DFLASH_DATA__PATH": str(data),
            "DFLASH_TRAIN__MAX_STEPS": "10",
            "DFLASH_TRAIN__TOKEN_BUDGET": "4096",
            "DFLASH_TRAIN__NUM_ANCHORS": "256",
            "DFLASH_TRAIN__BLOCK_SIZE": "10",
            "DFLASH_TRAIN__SAVE_EVERY": "5",
            "DFLASH_TRAIN__CUDA_GRAPH": "false",
            "DFLASH_PIPELINE__TARGET_DEVICES": "0,1,2,3,4",
            "DFLASH_PIPELINE__DRAFTER_DEVICES": "cpu",
            "DFLASH_LOG__FORMAT": "json",
            "DFLASH_EVAL__EVERY": "50",
            "DFLASH_DATA__ENABLE_THINKING": "true",
            "DFLASH_DATA__ON_BAD_RECORD": "skip",
            "DFLASH_DATA__MAX_LEN": "2048",
        }
    )
    assert settings.output_dir == tmp_path / "out"
    assert (settings.target.path, settings.data.path) == (str(tmp_path), str(data))
    train = settings.train
    assert (train.max_steps, train.token_budget, train.num_anchors) == (10, 4096, 256)
    assert (train.block_size, train.gamma, train.save_every, train.cuda_graph) == (
        10,
        5.0,
        5,
        False,
    )
    assert settings.pipeline.target_devices == tuple(f"cuda:{i}" for i in range(5))
    assert settings.pipeline.drafter_devices == ("cpu",)
    assert (settings.log.format, settings.eval.every) == ("json", 50)
    assert (settings.data.enable_thinking, settings.data.on_bad_record) == (True, "skip")
    assert settings.env_file == "none"


def test_unset_env_file_loads_the_demo_preset() -> None:
    settings = load_settings({})
    assert Path(settings.env_file) == repo_root() / "settings" / "demo.env"
    assert settings.pipeline.target_devices == settings.pipeline.drafter_devices == ("cpu",)
    assert (settings.target.path, settings.data.path) == ("", "")
    assert (settings.train.block_size, settings.train.gamma) == (8, 4.0)


def test_no_env_file_leaves_the_recipe_defaults() -> None:
    train = load_settings(NO_FILE).train
    assert (train.epochs, train.lr, train.warmup_frac, train.grad_clip, train.seed) == (
        6,
        6e-4,
        0.04,
        1.0,
        42,
    )
    assert (train.block_size, train.gamma) == (16, 7.0)


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [
        ("DFLASH_TRAIN__TOKEN_BUDGT", "DFLASH_TRAIN__TOKEN_BUDGET"),
        ("DFLASH_OUTPUTDIR", "DFLASH_OUTPUT_DIR"),
        ("DFLASH_PIPELINE__DRAFTER_DEVICE", "DFLASH_PIPELINE__DRAFTER_DEVICES"),
    ],
)
def test_misspelled_variable_is_an_error_naming_it_and_the_closest_name(
    name: str, suggestion: str
) -> None:
    with pytest.raises(SettingsError) as error:
        load_settings(NO_FILE | {name: "1"})
    assert f"{name} is not a setting" in str(error.value)
    assert f"did you mean {suggestion}?" in str(error.value)


def test_misspelled_variable_in_the_env_file_names_the_file(tmp_path: Path) -> None:
    preset = tmp_path / "x.env"
    preset.write_text("# comment\nDFLASH_TRAIN__NUM_ANCHOR=64\n")
    with pytest.raises(SettingsError, match=r"DFLASH_TRAIN__NUM_ANCHOR is not a setting \(in "):
        load_settings({"DFLASH_ENV_FILE": str(preset)})


def test_non_number_names_the_variable_and_the_value() -> None:
    with pytest.raises(SettingsError) as error:
        load_settings(NO_FILE | {"DFLASH_TRAIN__TOKEN_BUDGET": "abc"})
    message = str(error.value)
    assert message.startswith("DFLASH_TRAIN__TOKEN_BUDGET='abc': ")
    assert "\n" not in message
    assert error.value.__cause__ is None and error.value.__suppress_context__


def test_env_file_is_loaded_and_the_environment_overrides_it(tmp_path: Path) -> None:
    preset = tmp_path / "small.env"
    preset.write_text(
        "DFLASH_TRAIN__TOKEN_BUDGET=2048\nDFLASH_TRAIN__NUM_ANCHORS=128\nDFLASH_DATA__MAX_LEN=2048\n"
    )
    settings = load_settings({"DFLASH_ENV_FILE": str(preset), "DFLASH_TRAIN__NUM_ANCHORS": "32"})
    assert (settings.train.token_budget, settings.train.num_anchors) == (2048, 32)
    assert settings.env_file == str(preset)


def test_missing_env_file_is_an_error_naming_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.env"
    with pytest.raises(SettingsError, match=f"DFLASH_ENV_FILE={missing}: no such file"):
        load_settings({"DFLASH_ENV_FILE": str(missing)})


def test_env_file_may_only_set_dflash_variables(tmp_path: Path) -> None:
    preset = tmp_path / "x.env"
    preset.write_text("CUDA_VISIBLE_DEVICES=0\n")
    with pytest.raises(SettingsError, match="CUDA_VISIBLE_DEVICES is not a DFLASH_"):
        load_settings({"DFLASH_ENV_FILE": str(preset)})


def test_missing_target_folder_is_an_error_naming_the_path() -> None:
    with pytest.raises(SettingsError, match=r"DFLASH_TARGET__PATH='/no/such/model'"):
        load_settings(NO_FILE | {"DFLASH_TARGET__PATH": "/no/such/model"})


@pytest.mark.parametrize(
    ("value", "devices"),
    [
        ("0,1,2,3,4", ("cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:4")),
        ("5,6,7", ("cuda:5", "cuda:6", "cuda:7")),
        ("cpu", ("cpu",)),
        ("cuda, cuda:3", ("cuda:0", "cuda:3")),
    ],
)
def test_device_lists_parse_into_device_strings(value: str, devices: tuple[str, ...]) -> None:
    assert parse_device_list(value) == devices


@pytest.mark.parametrize("value", ["gpu0", "0,0", "cuda:x"])
def test_bad_device_list_names_the_variable(value: str) -> None:
    with pytest.raises(SettingsError, match=f"DFLASH_PIPELINE__DRAFTER_DEVICES={value!r}: "):
        load_settings(NO_FILE | {"DFLASH_PIPELINE__DRAFTER_DEVICES": value})


def test_same_device_may_serve_targets_and_drafters() -> None:
    pipeline = load_settings(
        NO_FILE | {"DFLASH_PIPELINE__TARGET_DEVICES": "0", "DFLASH_PIPELINE__DRAFTER_DEVICES": "0"}
    ).pipeline
    assert pipeline.target_devices == pipeline.drafter_devices == ("cuda:0",)


def test_gamma_without_a_default_for_the_block_size_asks_for_it() -> None:
    with pytest.raises(SettingsError, match="set DFLASH_TRAIN__GAMMA"):
        load_settings(NO_FILE | {"DFLASH_TRAIN__BLOCK_SIZE": "12"})
    train = load_settings(NO_FILE | {"DFLASH_TRAIN__BLOCK_SIZE": "12", "DFLASH_TRAIN__GAMMA": "6"})
    assert train.train.gamma == 6.0


def test_cross_field_errors_name_both_variables() -> None:
    with pytest.raises(SettingsError, match="DFLASH_DATA__MAX_LEN=8192 exceeds DFLASH_TRAIN__"):
        load_settings(
            NO_FILE | {"DFLASH_DATA__MAX_LEN": "8192", "DFLASH_TRAIN__TOKEN_BUDGET": "4096"}
        )
    with pytest.raises(SettingsError, match="DFLASH_TRAIN__NUM_ANCHORS=99 exceeds"):
        load_settings(
            NO_FILE
            | {
                "DFLASH_TRAIN__NUM_ANCHORS": "99",
                "DFLASH_TRAIN__TOKEN_BUDGET": "64",
                "DFLASH_DATA__MAX_LEN": "64",
            }
        )


def test_empty_value_unsets_an_optional_field() -> None:
    settings = load_settings(
        NO_FILE | {"DFLASH_DRAFTER__MASK_TOKEN_ID": "", "DFLASH_TRAIN__GAMMA": ""}
    )
    assert settings.drafter.mask_token_id is None and settings.train.gamma == 7.0


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_every_preset_parses_given_existing_paths(preset: Path, tmp_path: Path) -> None:
    settings = load_settings(
        {
            "DFLASH_ENV_FILE": str(preset),
            "DFLASH_TARGET__PATH": str(tmp_path),
            "DFLASH_DATA__PATH": str(tmp_path),
        }
    )
    assert settings.env_file == str(preset)


def test_8xh200_preset_places_workers_automatically_on_eight_gpus(tmp_path: Path) -> None:
    paths = {"DFLASH_TARGET__PATH": str(tmp_path), "DFLASH_DATA__PATH": str(tmp_path)}
    settings = load_settings({"DFLASH_ENV_FILE": "settings/qwen3_8b_8xh200.env"} | paths)
    assert settings.pipeline.layout == "auto"
    assert settings.pipeline.devices == tuple(f"cuda:{i}" for i in range(8))
    assert settings.pipeline.target_devices == settings.pipeline.drafter_devices == ()
    train = settings.train
    assert (train.token_budget, train.num_anchors, train.block_size) == (49152, 2048, 16)


def test_settings_are_immutable_and_public_dict_is_json() -> None:
    settings = load_settings(NO_FILE)
    with pytest.raises(ValidationError):
        settings.train.lr = 1.0  # type: ignore[misc]
    public = json.loads(json.dumps(settings.public_dict()))
    assert public["pipeline"]["target_devices"] == []  # empty: placed by the layout
    assert public["train"]["token_budget"] == 49152


def test_every_setting_has_a_description() -> None:
    descriptions = setting_descriptions()
    assert set(descriptions) == set(setting_names())
    assert all(descriptions.values()), [k for k, v in descriptions.items() if not v]


def test_load_settings_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_ENV_FILE", "none")
    monkeypatch.setenv("DFLASH_TRAIN__SEED", "7")
    assert load_settings().train.seed == 7


def test_names_are_case_sensitive_a_lowercase_name_is_an_error_naming_the_upper_case_one() -> None:
    # Both spellings set: neither may win silently (the order of os.environ would decide).
    environ = NO_FILE | {"DFLASH_TRAIN__MAX_STEPS": "5", "dflash_train__max_steps": "2"}
    with pytest.raises(
        SettingsError,
        match=r"^dflash_train__max_steps is not a setting: names "
        r"are upper case \(DFLASH_TRAIN__MAX_STEPS\), and DFLASH_TRAIN__MAX_STEPS "
        r"is set too$",
    ):
        load_settings(environ)
    with pytest.raises(SettingsError, match=r"^Dflash_Train__Seed is not a setting"):
        load_settings(NO_FILE | {"Dflash_Train__Seed": "1"})


def test_a_lowercase_name_in_an_env_file_is_an_error_naming_the_file(tmp_path: Path) -> None:
    preset = tmp_path / "x.env"
    preset.write_text("DFLASH_TRAIN__SEED=1\ndflash_train__max_steps=2\n")
    with pytest.raises(SettingsError, match=r"x\.env: dflash_train__max_steps is not a setting"):
        load_settings({"DFLASH_ENV_FILE": str(preset)})


def test_paths_are_checked_apart_from_values(tmp_path: Path) -> None:
    environ = NO_FILE | {
        "DFLASH_TARGET__PATH": "/no/such/model",
        "DFLASH_DATA__PATH": str(tmp_path / "none.jsonl"),
        "DFLASH_EVAL__PROMPTS_PATH": str(tmp_path),  # a folder, not a prompts file
    }
    settings = load_settings(environ, check_paths=False)
    assert settings.target.path == "/no/such/model"
    assert list(missing_paths(settings.target, settings.data, settings.eval)) == [
        "DFLASH_TARGET__PATH",
        "DFLASH_DATA__PATH",
        "DFLASH_EVAL__PROMPTS_PATH",
    ]
    with pytest.raises(SettingsError, match=r"^DFLASH_TARGET__PATH='/no/such/model': target "):
        load_settings(environ)
    present = NO_FILE | {"DFLASH_DATA__PATH": str(tmp_path), "DFLASH_TARGET__PATH": str(tmp_path)}
    loaded = load_settings(present)
    assert missing_paths(loaded.target, loaded.data, loaded.eval) == {}
