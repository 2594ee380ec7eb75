"""The entry of every research script here (`python benchmarks/research/<name>.py [options]`):
runs its `main` under the product CLI's contract for bad input (usage.py): one line `error: ...`
on stderr and exit 2, no traceback.

The research scripts build the drafter step's pieces a second way to measure candidates; they may
import any `dflash_async` module (and `dflash_async.bench.drafter_bench`'s SHAPES, synthetic_pack,
build_step) but the product never imports them. They import each other as top-level modules: run
as a script, Python puts this folder first on sys.path; `dflash_async` comes from the installed
package or PYTHONPATH=<repo root> (as benchmarks/*.sh export it).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn

from dflash_async.errors import SettingsError
from dflash_async.usage import UsageError


def run(main: Callable[[list[str]], object]) -> NoReturn:
    """Exit 0 after `main(sys.argv[1:])`, or 2 with one line naming a bad argument or device."""
    try:
        main(sys.argv[1:])
    except (UsageError, SettingsError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    sys.exit(0)
