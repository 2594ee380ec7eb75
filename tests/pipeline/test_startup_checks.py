"""Every check of the target that needs no model runs before any work: an unsupported family is
refused before the demo corpus is regenerated with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_async.errors import SettingsError
from dflash_async.log import get_logger
from dflash_async.pipeline.specs import run_spec
from dflash_async.pipeline.startup import check_target_config, resolve_inputs
from dflash_async.settings.env import load_settings
from dflash_async.targets.resolve import TargetError

pytestmark = pytest.mark.timeout(60)
# a family transformers may not know either: the refusal must name it from config.json alone
# Configs no path can run, each refused from config.json alone: a model_type transformers does not
# know, and an encoder-decoder (the generic path takes every decoder LM transformers builds).
REFUSED = {
    "unknown_model_type": (
        {"model_type": "not_a_model_type", "hidden_size": 64, "num_hidden_layers": 2},
        "model_type 'not_a_model_type' is not known to the installed transformers",
    ),
    "encoder_decoder": (
        {"model_type": "t5", "is_encoder_decoder": True, "d_model": 64, "num_layers": 2},
        "encoder-decoder",
    ),
}


def spec_for(target: Path, tmp_path: Path):
    settings = load_settings(
        {
            "DFLASH_ENV_FILE": "none",
            "DFLASH_TARGET__PATH": str(target),
            "DFLASH_OUTPUT_DIR": str(tmp_path / "out"),
        }
    )
    return run_spec(settings, visible_gpus=0)


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_unsupported_target_is_refused_before_the_demo_corpus_is_regenerated(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, message = REFUSED[case]
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(config))
    regenerated = []
    monkeypatch.setattr(
        "dflash_async.eval.regenerate.demo_corpus", lambda *a, **k: regenerated.append(a)
    )
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(SettingsError, match=message):
        resolve_inputs(spec_for(target, tmp_path), get_logger("test"))
    assert regenerated == []
    assert not (tmp_path / "cache").exists()  # nothing built


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "has no config.json"), ("{not json", "cannot read"), ("[1]", "not a JSON object")],
)
def test_a_missing_or_unreadable_config_is_named(
    tmp_path: Path, content: str | None, message: str
) -> None:
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(TargetError, match=message):
        check_target_config(str(tmp_path))


def test_a_supported_family_passes_the_check(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    check_target_config(str(tmp_path))  # no error
