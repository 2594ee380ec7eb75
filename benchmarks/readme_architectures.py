"""Rewrite README.md's table of supported targets from the code's own table.

    python benchmarks/readme_architectures.py      # from the repository root

The table is targets/forward.architecture_table() (targets/families.FAMILIES: each family's label
and the forward it takes); tests/targets/test_readme_architectures.py fails when the README's
copy differs.
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
