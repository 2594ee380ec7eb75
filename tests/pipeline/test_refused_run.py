"""A run refused before it starts (here: a resume folder without a checkpoint, found only after
the data is tokenized) leaves nothing in OUTPUT_DIR, not even the tokenized-data cache."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from tiny_run import tiny_env, tiny_inputs

from dflash_async.errors import SettingsError
from dflash_async.log import get_logger
from dflash_async.pipeline.run import run
from dflash_async.settings.env import load_settings

pytestmark = pytest.mark.timeout(120)


def test_a_refused_run_writes_nothing_into_its_output_folder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    not_a_checkpoint = tmp_path / "elsewhere"
    not_a_checkpoint.mkdir()
    env = tiny_env(tiny_inputs(tmp_path), out) | {"DFLASH_TRAIN__RESUME": str(not_a_checkpoint)}
    settings = load_settings(env)

    async def main() -> int:
        return await run(settings, get_logger("test"))

    with pytest.raises(SettingsError, match=r"no .* in that folder"):
        anyio.run(main)
    assert list(out.rglob("*")) == []  # the folder itself may exist: check_writable_folder


def test_a_cache_folder_that_existed_is_kept(tmp_path: Path) -> None:
    """Only what the refused run created goes: an earlier run's cache stays."""
    out = tmp_path / "out"
    (out / "cache").mkdir(parents=True)
    (out / "cache" / "keep").write_text("earlier")
    env = tiny_env(tiny_inputs(tmp_path), out) | {"DFLASH_TRAIN__RESUME": str(tmp_path)}

    async def main() -> int:
        return await run(load_settings(env), get_logger("test"))

    with pytest.raises(SettingsError):
        anyio.run(main)
    assert (out / "cache" / "keep").read_text() == "earlier"
