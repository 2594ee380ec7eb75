"""The package's shape as a contract: its parts import each other without a circle.

A part is a subpackage (`pipeline`, `stages`, `model`, ...) or a top-level module (`settings`,
`log`, ...). Every import counts, the lazy ones inside functions too: a circle of parts means
there is no order in which to read (or test) them bottom-up, which is what docs/DESIGN.md's
layout promises (runtime below stages below pipeline, checkpoint below stages, ...).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dflash_async"


def _part(module: str) -> str | None:
    """`dflash_async.pipeline.run` -> "pipeline"; `dflash_async.settings.sections` -> "settings"."""
    names = module.split(".")
    if names[0] != "dflash_async" or len(names) < 2:
        return None
    return names[1]


def _imports(path: Path) -> set[str]:
    """Every dflash_async module this file imports (top-level or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m.startswith("dflash_async.")}


def _part_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        own = _part(".".join(rel.parts))
        if own is None:
            continue
        for module in _imports(path):
            other = _part(module)
            if other is not None and other != own:
                graph[own].add(other)
    return graph


def _a_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of parts, or None (depth-first search with the path on a stack)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (circle := visit(nxt, [*path, nxt])):
                return circle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (circle := visit(start, [start])):
            return circle
    return None


def test_the_parts_of_the_package_import_each_other_without_a_circle() -> None:
    graph = _part_graph()
    assert "pipeline" in graph and "runtime" in graph["stages"]  # the graph was read
    assert _a_circle(graph) is None, " -> ".join(_a_circle(graph) or [])


def test_the_circle_finder_finds_a_planted_circle() -> None:
    """The check above would pass vacuously if the finder never found anything."""
    graph = {"stages": {"runtime"}, "runtime": {"data"}, "data": {"stages"}}
    circle = _a_circle(graph)
    assert circle is not None and circle[0] == circle[-1]
    assert set(circle) == {"stages", "runtime", "data"}
    assert _a_circle({"stages": {"runtime"}, "runtime": {"data"}}) is None
