"""model/kinds/'s table is the one place a drafter kind is named.

Every entry provides the whole kind interface (a set DrafterKind field each, its fields composed
into the settings, DrafterConfig and StepSpec without a clash), an unknown kind is refused with
the known names at every border (the lookup, DrafterConfig, the settings), each kind's drafter
exports exactly the tensors its kind declares, and no module outside model/kinds/ spells a kind's
name (the check that keeps a new kind to its module and one table line).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from conftest import TinySpec, tiny_config
from pydantic import BaseModel

from dflash_async.checkpoint.export import expected_weight_shapes, export_config_json
from dflash_async.errors import SettingsError
from dflash_async.model.build import StepSpec
from dflash_async.model.drafter_config import DrafterConfig, DrafterSpec
from dflash_async.model.kinds import DEFAULT_KIND, KINDS, kind_of
from dflash_async.model.kinds.interface import DrafterKind
from dflash_async.settings.env import load_settings
from dflash_async.settings.recipe import DrafterSettings, TrainSettings

PACKAGE = Path(__file__).resolve().parents[2] / "dflash_async"
KINDS_DIR = PACKAGE / "model" / "kinds"
NO_FILE = {"DFLASH_ENV_FILE": "none"}


@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_provides_every_part_of_the_interface(name: str) -> None:
    kind = KINDS[name]
    assert isinstance(kind, DrafterKind) and kind.name == name and kind_of(name) is kind
    for field in dataclasses.fields(DrafterKind):
        value = getattr(kind, field.name)
        assert value is not None and value != "", field.name  # {} and 0 are values
        if field.name in ("drafter_fields", "train_fields"):
            assert issubclass(value, BaseModel), field.name
        elif field.type == "str":  # name, architecture, model_type, summary
            assert isinstance(value, str), field.name
        elif field.type == "int":  # first_draft_slot
            assert value in (0, 1), field.name
        elif field.type == "bool":  # captures_final_hidden
            assert isinstance(value, bool), field.name
        elif field.name == "train_defaults":
            assert set(value) <= set(TrainSettings.model_fields), field.name
        elif field.name == "speculators_model":  # (model type, architecture) or ()
            assert len(value) in (0, 2) and all(isinstance(v, str) for v in value), field.name
        else:
            assert callable(value), field.name
    assert len({k.architecture for k in KINDS.values()}) == len(KINDS)  # export tells them apart
    assert DEFAULT_KIND in KINDS


def test_the_kinds_fields_are_composed_everywhere_without_a_clash() -> None:
    drafter = [n for k in KINDS.values() for n in k.drafter_fields.model_fields]
    train = [n for k in KINDS.values() for n in k.train_fields.model_fields]
    assert len(set(drafter)) == len(drafter) and len(set(train)) == len(train)
    config_fields = {f.name for f in dataclasses.fields(DrafterConfig)}
    spec_fields = {f.name for f in dataclasses.fields(DrafterSpec)}
    step_fields = {f.name for f in dataclasses.fields(StepSpec)}
    assert set(drafter) <= config_fields & spec_fields & set(DrafterSettings.model_fields)
    assert set(train) <= step_fields & set(TrainSettings.model_fields)
    for kind in KINDS.values():  # the dataclasses' defaults are the settings'
        for field_name, info in kind.drafter_fields.model_fields.items():
            assert DrafterSettings.model_fields[field_name].default == info.default
            assert getattr(DrafterSpec(1, 1, 2, None, None), field_name) == info.default


def test_an_unknown_kind_is_refused_naming_the_known_ones() -> None:
    known = ", ".join(KINDS)
    with pytest.raises(
        ValueError, match=f"unknown drafter kind 'eagle3'; the known kinds are {known}"
    ):
        kind_of("eagle3")
    with pytest.raises(ValueError, match="the known kinds are"):
        dataclasses.replace(tiny_config(TinySpec()), kind="eagle3")
    with pytest.raises(SettingsError, match="DFLASH_DRAFTER__KIND") as error:
        load_settings(NO_FILE | {"DFLASH_DRAFTER__KIND": "eagle3"})
    assert all(repr(name) in str(error.value) for name in KINDS), str(error.value)


@pytest.mark.parametrize("name", list(KINDS))
def test_each_kinds_drafter_has_exactly_the_tensors_its_export_declares(name: str) -> None:
    config = dataclasses.replace(tiny_config(TinySpec()), kind=name)
    kind = kind_of(name)
    drafter = kind.make_drafter(config)
    shapes = {n: tuple(p.shape) for n, p in drafter.named_parameters()}
    assert shapes == expected_weight_shapes(config)
    assert set(kind.weight_shapes(config)) <= set(shapes)
    exported = export_config_json(config)
    assert exported["architectures"] == [kind.architecture]
    assert kind.export_fields(config).items() <= exported["dflash_config"].items()


def test_no_module_outside_the_kinds_names_a_kind() -> None:
    """Outside model/kinds/ a kind is asked for (`kind_of(config.kind)`), never named."""
    spelled = re.compile(r'dflash2|"dflash"|dspark')
    found = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if KINDS_DIR not in path.parents and spelled.search(path.read_text(encoding="utf-8"))
    ]
    assert not found, found
