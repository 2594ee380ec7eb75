"""The drafter kinds: the one table of them, `KINDS`, and its lookup `kind_of`.

A kind is a `DrafterKind` record (interface.py) that its own module makes: model/kinds/dflash.py,
model/kinds/dflash2/. Every other module asks the kind of a config (`kind_of(config.kind)`) for
its fields, model, objective, export, identity, FLOPs and drafts; none compares kind names. A new
kind is its module and one line here.
"""

from __future__ import annotations

from types import MappingProxyType

from dflash_async.model.kinds import dflash, dflash2, dspark
from dflash_async.model.kinds.interface import DrafterKind

KINDS = MappingProxyType({kind.name: kind for kind in (dflash.KIND, dflash2.KIND, dspark.KIND)})
# DFLASH_DRAFTER__KIND's default, and the kind of an export that names no known architecture
DEFAULT_KIND = dflash.KIND.name


def kind_of(name: str) -> DrafterKind:
    """The kind named `name`; ValueError naming the known kinds otherwise."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(
            f"unknown drafter kind {name!r}; the known kinds are {', '.join(KINDS)}"
        ) from None
