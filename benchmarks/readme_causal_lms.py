"""Rewrite README.md's account of the causal-LM zoo (how many model_types train, which are refused
and excluded, with reasons) from the zoo's own table.

    python benchmarks/readme_causal_lms.py      # from the repository root

The text is tests/causal_lm_zoo.readme_section() (its FIXUPS table and start-up's refusals);
tests/targets/test_every_causal_lm.py fails when the README's copy differs.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCK = re.compile(r"(<!-- causal-lms:begin[^\n]*-->\n)(.*?)(\n<!-- causal-lms:end -->)", re.S)


def main() -> None:
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
    from causal_lm_zoo import readme_section

    text = README.read_text(encoding="utf-8")
    if not BLOCK.search(text):
        raise SystemExit("README.md has no causal-lms block")
    README.write_text(BLOCK.sub(lambda m: m[1] + readme_section() + m[3], text), "utf-8")


if __name__ == "__main__":
    main()
