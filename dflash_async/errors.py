"""The package's one exception for bad user input, below every part that raises it.

`SettingsError`: a setting or an input that cannot work; `str(error)` is one line for the user
(the CLI prints it and exits 2, no traceback). It lives here, not beside the settings, so the
parts that raise it (runtime, targets, checkpoint) do not import the settings tree to do so.
"""

from __future__ import annotations


class SettingsError(ValueError):
    """Bad settings; `str(error)` is one line for the user (the CLI prints it and exits 2)."""
