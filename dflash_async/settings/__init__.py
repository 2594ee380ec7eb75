"""Every knob of a run, read from `DFLASH_*` variables and preset files (pydantic-settings).

- `sections.py`: the root `Settings` and its sections (target, data, pipeline, eval, log).
- `recipe.py`: the drafter and its training recipe (`drafter`, `train`).
- `values.py`: the section base class and the parsers of single values.
- `env.py`: the environment and preset file mapped to fields, and the checks of named paths.
"""

from dflash_async.errors import SettingsError
from dflash_async.settings.sections import (
    ENV_FILE_VAR,
    NESTING,
    NO_ENV_FILE,
    PREFIX,
    DataSettings,
    EvalSettings,
    LogSettings,
    Settings,
    TargetSettings,
)

__all__ = [
    "ENV_FILE_VAR",
    "NESTING",
    "NO_ENV_FILE",
    "PREFIX",
    "DataSettings",
    "EvalSettings",
    "LogSettings",
    "Settings",
    "SettingsError",
    "TargetSettings",
]
