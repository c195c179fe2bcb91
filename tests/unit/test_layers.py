"""The import layers docs/architecture.md draws are the imports the package has.

The drawing (between the `layers` markers) lists the rooms of `supervisor/`, top row first: a
subpackage (`core`, `daemon`, ...) or a module at the top level (`cli`, `exits`, ...), with
`supervisor` for the package's own `__init__`. Every import of a supervisor module, wherever it
stands in the file (at the top, in a function, under TYPE_CHECKING), is read with `ast`. A room
may import itself and rooms on lower rows, never a room on its own row or above; the stand-in
(another process, as SGLang is) imports nothing of the supervisor, and the supervisor imports no
test code. Modules import each other without a cycle.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "supervisor"
DOC = ROOT / "docs" / "architecture.md"
OUTSIDE = ("standin",)  # rooms that are other processes: drawn apart, checked apart


def drawn_layers(text: str) -> list[list[str]]:
    """The rooms of each row of the drawing, top row first."""
    match = re.search(r"<!-- layers -->\n```[a-z]*\n(.*?)```\n<!-- /layers -->", text, re.S)
    assert match, "docs/architecture.md has no drawing between <!-- layers --> markers"
    rows = []
    for line in match.group(1).splitlines():
        rooms, sep, _ = line.partition(":")
        if sep and rooms.strip():
            rows.append(rooms.split())
    return rows


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "supervisor"


def imports(path: Path, known: set[str]) -> Iterator[tuple[int, str]]:
    """(line, module) for every supervisor module `path` imports; `from a import b` names the
    module `a.b` where that is one, else `a`."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                yield node.lineno, sub if sub in known else node.module


def test_every_room_is_drawn_once() -> None:
    rows = drawn_layers(DOC.read_text())
    drawn = [r for row in rows for r in row]
    assert len(drawn) == len(set(drawn)), f"a room drawn twice: {sorted(drawn)}"
    rooms = {room(m) for m in modules()}
    assert rooms - set(drawn) - set(OUTSIDE) == set(), "rooms missing from the drawing"
    assert set(drawn) - rooms == set(), "the drawing names rooms the package lacks"


def test_imports_point_down() -> None:
    rows = drawn_layers(DOC.read_text())
    level = {r: len(rows) - i for i, row in enumerate(rows) for r in row}
    known = set(modules())
    wrong = []
    for name, path in modules().items():
        if room(name) in OUTSIDE:
            continue
        for line, target in imports(path, known):
            if not target.startswith("supervisor"):
                continue
            a, b = room(name), room(target)
            if b in OUTSIDE and a != "demo":
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports the stand-in ({target})")
            elif a != b and b not in OUTSIDE and level[b] >= level[a]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} {a} -> {b} ({target}): not down")
    assert wrong == []


def test_the_standin_imports_nothing_of_the_supervisor() -> None:
    known = set(modules())
    wrong = [
        f"{path.relative_to(ROOT)}:{line} {target}"
        for name, path in modules().items()
        if room(name) == "standin"
        for line, target in imports(path, known)
        if target.startswith("supervisor") and room(target) != "standin"
    ]
    assert wrong == []


def test_the_package_imports_no_test_code() -> None:
    known = set(modules())
    wrong = [
        f"{path.relative_to(ROOT)}:{line} {target}"
        for path in modules().values()
        for line, target in imports(path, known)
        if target.split(".")[0] in {"tests", "testkit", "bench"}
    ]
    assert wrong == []


def test_modules_import_each_other_without_a_cycle() -> None:
    known = set(modules())
    graph = {
        name: {t for _, t in imports(path, known) if t in known and t != name}
        for name, path in modules().items()
    }
    # A package's __init__ is imported with any module inside it; that edge is Python's, not ours.
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> None:
        if node in path:
            cycle = [*path[path.index(node) :], node]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if node in done:
            return
        path.append(node)
        for nxt in sorted(graph[node]):
            visit(nxt)
        path.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)


def test_the_drawing_is_read_as_drawn() -> None:
    text = "<!-- layers -->\n```text\ncli demo : top\n\ncore : the machine\n```\n<!-- /layers -->\n"
    assert drawn_layers(text) == [["cli", "demo"], ["core"]]
    with pytest.raises(AssertionError):
        drawn_layers("no drawing")
