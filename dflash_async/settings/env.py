"""Settings from the environment: `DFLASH_*` variables, an optional preset file, and path checks.

Owns `load_settings` and the name table (`setting_names`, `setting_descriptions`); the sections and
their value checks are settings/sections.py's. `DFLASH_ENV_FILE=settings/x.env` loads a preset; real
environment variables override it. Unset, a run that names a target (`DFLASH_TARGET__PATH`) is a
real run: no preset, the recipe for the target's size (settings/sizing.py) under the environment,
every visible GPU, placement auto; a run that names none is the demo, whose preset is
`settings/demo.env` of this repository. `DFLASH_ENV_FILE=none` loads no file and leaves the field
defaults. `DFLASH_PIPELINE__DEVICES` in the environment replaces a preset's roles
(`TARGET_DEVICES`/`DRAFTER_DEVICES`) unless the environment gives roles too. Where each value came
from is `load_with_sources`'s second result (settings/resolved.py reports it).

Names are case-sensitive and upper case, as printed by `--help` and `settings`: a variable whose
name is a `DFLASH_*` name in another case (`dflash_train__max_steps`) is an error naming the
upper-case spelling, never silently read or ignored (on POSIX both spellings can coexist, and which
one wins must not depend on the order of the environment).

pydantic-settings' own sources are not used: they read `os.environ` (so `load_settings` could not
be pure) and silently ignore unknown names, while a misspelled `DFLASH_*` name must be an error.
The mapping follows the same prefix and `__` rule.
"""

from __future__ import annotations

import difflib
import glob
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dotenv import dotenv_values  # a dependency of pydantic-settings
from pydantic import BaseModel, ValidationError

from dflash_async.settings import (
    ENV_FILE_VAR,
    NESTING,
    NO_ENV_FILE,
    PREFIX,
    DataSettings,
    EvalSettings,
    Settings,
    SettingsError,
    TargetSettings,
)
from dflash_async.settings.recipe import DrafterSettings
from dflash_async.settings.sizing import Recipe, recipe_for

TARGET_PATH_VAR = f"{PREFIX}TARGET{NESTING}PATH"


def repo_root() -> Path:
    """The repository holding this package: where `settings/` presets live."""
    return Path(__file__).resolve().parents[2]


def setting_names() -> dict[str, tuple[str, ...]]:
    """Every valid variable name -> its field path, e.g. DFLASH_TRAIN__LR -> ("train", "lr")."""
    names: dict[str, tuple[str, ...]] = {}
    for name, field in Settings.model_fields.items():
        section = field.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            for sub in section.model_fields:
                names[f"{PREFIX}{name}{NESTING}{sub}".upper()] = (name, sub)
        else:
            names[f"{PREFIX}{name}".upper()] = (name,)
    return names


def setting_descriptions() -> dict[str, str]:
    """Every valid variable name -> its one-line description (for `--help`)."""
    descriptions = {}
    for env_name, path in setting_names().items():
        model: type[BaseModel] = Settings
        for part in path[:-1]:
            model = model.model_fields[part].annotation  # type: ignore[assignment]
        descriptions[env_name] = model.model_fields[path[-1]].description or ""
    return descriptions


ENVIRONMENT = "environment"
ROLE_VARS = (
    f"{PREFIX}PIPELINE{NESTING}TARGET_DEVICES",
    f"{PREFIX}PIPELINE{NESTING}DRAFTER_DEVICES",
)
DEVICES_VAR = f"{PREFIX}PIPELINE{NESTING}DEVICES"


@dataclass(frozen=True)
class Sources:
    """Where the set values came from: variable name -> its preset file, `environment` or
    `auto: ...` (the recipe for the target's size); `notes`: what was set aside and why."""

    by_name: dict[str, str]
    notes: tuple[str, ...] = ()


def load_settings(
    environ: Mapping[str, str] | None = None, *, check_paths: bool = True
) -> Settings:
    """The settings of `load_with_sources`."""
    return load_with_sources(environ, check_paths=check_paths)[0]


def load_with_sources(
    environ: Mapping[str, str] | None = None, *, check_paths: bool = True
) -> tuple[Settings, Sources]:
    """Settings from `environ` (default: os.environ) and the preset it names, and where each
    value came from. Pure given `environ` and the file system.

    Raises SettingsError (one line naming the variable, value or file) for an unknown `DFLASH_*`
    name, a value that does not parse or validate, or a missing env file. With `check_paths`, also
    for a target, data, prompts or warm-start path that does not exist here (`missing_paths`). A target
    given as a cached model id comes back as its snapshot folder (also without `check_paths`,
    when it resolves).
    """
    if environ is None:
        environ = os.environ
    env_vars = {key: value for key, value in environ.items() if _is_ours(key, environ)}
    real_run = ENV_FILE_VAR not in env_vars and bool(env_vars.get(TARGET_PATH_VAR, "").strip())
    env_file = None if real_run else _resolve_env_file(env_vars.get(ENV_FILE_VAR))
    file_vars = _read_env_file(env_file) if env_file else {}
    notes = []
    if DEVICES_VAR in env_vars and not any(name in env_vars for name in ROLE_VARS):
        dropped = [name for name in ROLE_VARS if name in file_vars]
        for name in dropped:  # the environment's devices win over the preset's roles
            del file_vars[name]
        if dropped:
            notes.append(
                f"{' and '.join(dropped)} of {env_file} set aside: {DEVICES_VAR} is set in "
                "the environment"
            )
    recipe = _recipe(env_vars[TARGET_PATH_VAR]) if real_run else None
    recipe_vars = recipe.values if recipe else {}
    origins = (  # where a bad value came from, for its error line
        {name: recipe.origin.removeprefix("auto: ") for name in recipe_vars}  # type: ignore[union-attr]
        | {name: str(env_file) for name in file_vars}
        | {name: "" for name in env_vars}
    )
    sources = (
        {name: recipe.origin for name in recipe_vars}  # type: ignore[union-attr]
        | {name: str(env_file) for name in file_vars}
        | {name: ENVIRONMENT for name in env_vars if name != ENV_FILE_VAR}
    )
    merged = recipe_vars | file_vars | env_vars
    _reject_unknown_names(merged, origins)
    merged[ENV_FILE_VAR] = str(env_file) if env_file else NO_ENV_FILE
    settings = _validated(merged, origins)
    missing = missing_paths(settings.target, settings.data, settings.eval, drafter=settings.drafter)
    if check_paths and missing:
        name, problem = next(iter(missing.items()))
        where = f" (in {origins[name]})" if origins.get(name) else ""
        raise SettingsError(f"{name}={merged[name]!r}: {problem}{where}")
    if settings.target.path and TARGET_PATH_VAR not in missing:
        from dflash_async.targets.resolve import resolve_target

        folder = str(resolve_target(settings.target.path))  # a cached model id: its snapshot
        if folder != settings.target.path:
            settings = _validated(merged | {TARGET_PATH_VAR: folder}, origins)
    return settings, Sources(sources, tuple(notes))


def _recipe(target: str) -> Recipe | None:
    """The recipe for the named target's size; None when it is not found here (the path check
    names it) or its config cannot be read (start-up names that)."""
    from dflash_async.targets.resolve import TargetError, resolve_target

    try:
        return recipe_for(resolve_target(target))
    except TargetError:
        return None


def _validated(merged: Mapping[str, str], origins: Mapping[str, str]) -> Settings:
    try:
        return Settings(**_nest(merged))
    except ValidationError as error:
        raise SettingsError(_describe(error, merged, origins)) from None


def missing_paths(
    target: TargetSettings,
    data: DataSettings,
    evaluation: EvalSettings,
    *,
    drafter: DrafterSettings | None = None,
) -> dict[str, str]:
    """Variable name -> what is wrong, for each target, data, prompts or warm-start path absent
    here (the Settings sections `target`, `data`, `eval` and `drafter`; the warm start's by its
    file names only, checkpoint/warm.py)."""
    from dflash_async.targets.resolve import TargetError, resolve_target

    problems = {}
    if target.path:
        try:
            resolve_target(target.path)
        except TargetError as error:
            problems[TARGET_PATH_VAR] = str(error)
    if data.path and not Path(data.path).exists() and not glob.glob(data.path):
        problems[f"{PREFIX}DATA{NESTING}PATH"] = f"no file, folder or glob match for {data.path}"
    prompts = evaluation.prompts_path
    if prompts and not Path(prompts).is_file():
        problems[f"{PREFIX}EVAL{NESTING}PROMPTS_PATH"] = (
            f"the prompts file {prompts} does not exist"
        )
    if drafter is not None and drafter.init:
        from dflash_async.checkpoint.warm import init_problem  # torch: only when one is set

        problem = init_problem(drafter.init)
        if problem is not None:
            problems[f"{PREFIX}DRAFTER{NESTING}INIT"] = problem
    return problems


def _is_ours(name: str, environ: Mapping[str, str]) -> bool:
    """A DFLASH_* name; one in another case is an error (see the module doc)."""
    if name.startswith(PREFIX):
        return True
    if name.upper().startswith(PREFIX):
        raise SettingsError(
            f"{name} is not a setting: names are upper case ({name.upper()})"
            + (f", and {name.upper()} is set too" if name.upper() in environ else "")
        )
    return False


def _resolve_env_file(value: str | None) -> Path | None:
    """None (unset, no target named) -> the demo preset; "none"/"" -> no file; a relative path:
    cwd, then the repo."""
    if value is None:
        demo = repo_root() / "settings" / "demo.env"
        if not demo.is_file():
            raise SettingsError(
                f"the default preset {demo} is missing: set {ENV_FILE_VAR} to a preset or to none"
            )
        return demo
    if value.strip().lower() in (NO_ENV_FILE, ""):
        return None
    path = Path(value).expanduser()
    for candidate in (path, repo_root() / path) if not path.is_absolute() else (path,):
        if candidate.is_file():
            return candidate
    raise SettingsError(f"{ENV_FILE_VAR}={value}: no such file")


def _read_env_file(path: Path) -> dict[str, str]:
    values = dotenv_values(path)
    foreign = [key for key in values if not key.upper().startswith(PREFIX)]
    if foreign:
        raise SettingsError(f"{path}: {foreign[0]} is not a {PREFIX}* variable")
    lower = [key for key in values if key != key.upper()]
    if lower:
        raise SettingsError(
            f"{path}: {lower[0]} is not a setting: names are upper case ({lower[0].upper()})"
        )
    if ENV_FILE_VAR in values:
        raise SettingsError(f"{path}: {ENV_FILE_VAR} cannot be set inside an env file")
    return {key: value or "" for key, value in values.items()}


def _reject_unknown_names(merged: Mapping[str, str], origins: Mapping[str, str]) -> None:
    known = [*setting_names(), ENV_FILE_VAR]
    for name in merged:
        if name not in known:
            where = f" (in {origins[name]})" if origins.get(name) else ""
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
            hint = f"did you mean {close[0]}?" if close else f"valid: {_name_summary(name, known)}"
            raise SettingsError(f"{name} is not a setting{where}; {hint}")


def _name_summary(name: str, known: list[str]) -> str:
    """The names of the group `name` starts with, else the top-level names and groups."""
    group = name.split(NESTING)[0] + NESTING
    in_group = [k for k in known if k.startswith(group)]
    if NESTING in name and in_group:
        return ", ".join(in_group)
    groups = dict.fromkeys(
        k.split(NESTING)[0] + (NESTING + "*" if NESTING in k else "") for k in known
    )
    return ", ".join(groups)


def _nest(merged: Mapping[str, str]) -> dict[str, Any]:
    names = setting_names() | {ENV_FILE_VAR: ("env_file",)}
    nested: dict[str, Any] = {}
    for name, value in merged.items():
        *sections, leaf = names[name]
        target = nested
        for section in sections:
            target = target.setdefault(section, {})
        target[leaf] = value
    return nested


def _describe(error: ValidationError, merged: Mapping[str, str], origins: Mapping[str, str]) -> str:
    """One line: `DFLASH_X__Y='value': what is wrong (in file)`, errors joined by '; '. A setting
    of several types (`bool | Literal["emulate"]`) fails once per type, each error's location
    ending in the type: its messages join under the one name, with "or"."""
    env_names = {path: name for name, path in setting_names().items()}
    found: dict[str | None, list[str]] = {}
    for item in error.errors(include_url=False):
        message = item["msg"].removeprefix("Value error, ")
        loc = tuple(str(part) for part in item["loc"])
        names = (env_names.get(loc[:n]) for n in range(len(loc), 0, -1))
        name = next((n for n in names if n is not None), None)
        found.setdefault(name, []).append(message)
    parts = list(found.pop(None, []))  # checks across fields: their messages name the variables
    for name, messages in found.items():
        message = " or ".join(messages)
        if name not in merged:  # a derived default failed (e.g. gamma for an odd block size)
            parts.append(f"{name}: {message}")
        else:
            where = f" (in {origins[name]})" if origins.get(name) else ""
            parts.append(f"{name}={merged[name]!r}: {message}{where}")
    return "; ".join(parts)
