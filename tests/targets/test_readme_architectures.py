"""README's list of supported targets is the code's own table, not a hand-written copy."""

from __future__ import annotations

import re
from pathlib import Path

from dflash_async.targets.families import FAMILIES
from dflash_async.targets.forward import architecture_table

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_lists_exactly_the_supported_architectures_with_their_paths() -> None:
    """Regenerate with `python benchmarks/readme_architectures.py` when this fails."""
    block = re.search(
        r"<!-- architectures:begin[^\n]*-->\n(.*?)\n<!-- architectures:end -->",
        README.read_text(encoding="utf-8"),
        re.S,
    )
    assert block is not None, "README.md lost its architectures block"
    assert block[1] == architecture_table()
    assert all(f"| `{kind}` |" in block[1] for kind in FAMILIES)
