"""Puts benchmarks/research/ on sys.path, so the tests here import the research scripts as their
own `python benchmarks/research/<name>.py` run sees them: as top-level modules (optimizer_bench,
optimizer_updates, ...). The simplest way that needs no install and no package of benchmarks/: the
scripts stay plain files, never importable as `dflash_async.*`, so the product cannot import them.
"""

from __future__ import annotations

import sys
from pathlib import Path

RESEARCH = str(Path(__file__).resolve().parents[1])
if RESEARCH not in sys.path:
    sys.path.insert(0, RESEARCH)
