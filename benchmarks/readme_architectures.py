"""Rewrite README.md's table of supported targets from the code's own table.

    python benchmarks/readme_architectures.py      # from the repository root

The table is target/forward.architecture_table() (model/architectures.SUPPORTED with the forward
each family takes); tests/targets/test_readme_architectures.py fails when the README's copy differs.
"""

from __future__ import annotations

import re
from pathlib import Path

from dflash_async.targets.forward import architecture_table

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(
    r"(<!-- architectures:begin[^\n]*-->\n)(.*?)(\n<!-- architectures:end -->)", re.S
)


def main() -> None:
    text = README.read_text(encoding="utf-8")
    if not BLOCK.search(text):
        raise SystemExit("README.md has no architectures block")
    README.write_text(BLOCK.sub(lambda m: m[1] + architecture_table() + m[3], text), "utf-8")


if __name__ == "__main__":
    main()
