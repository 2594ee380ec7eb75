"""The drafter's kernel settings: flex_attention options parse from the environment, unknown ones
fail at load with one line naming the setting, and the objective carries them unchanged."""

from __future__ import annotations

import pytest

from dflash_async.settings import SettingsError
from dflash_async.settings_env import load_settings

NO_FILE = {"DFLASH_ENV_FILE": "none"}


def test_flex_kernel_options_parse_from_json_and_default_to_torchs() -> None:
    assert load_settings(NO_FILE).train.flex_kernel_options == {}
    assert load_settings(NO_FILE).train.flex_autotune is False
    train = load_settings(
        NO_FILE
        | {
            "DFLASH_TRAIN__FLEX_KERNEL_OPTIONS": '{"USE_TMA": true, "bwd_BLOCK_M1": 64}',
            "DFLASH_TRAIN__FLEX_AUTOTUNE": "true",
        }
    ).train
    assert train.flex_kernel_options == {"USE_TMA": True, "bwd_BLOCK_M1": 64}
    assert train.flex_autotune is True


def test_an_unknown_flex_option_is_one_line_naming_the_setting() -> None:
    with pytest.raises(SettingsError) as error:
        load_settings(NO_FILE | {"DFLASH_TRAIN__FLEX_KERNEL_OPTIONS": '{"USE_TMAX": true}'})
    message = str(error.value)
    assert "DFLASH_TRAIN__FLEX_KERNEL_OPTIONS" in message and "USE_TMAX" in message
    assert "\n" not in message
