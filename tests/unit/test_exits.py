"""Every exit status is defined in supervisor/exits.py and nowhere else."""

from __future__ import annotations

import ast
from pathlib import Path

import supervisor
from supervisor import exits

PACKAGE = Path(supervisor.__file__).parent


def _exit_constants(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: list[str] = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for leaf in ast.walk(target):
                if isinstance(leaf, ast.Name) and leaf.id.startswith(("EX_", "EXIT_")):
                    names.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {leaf.id}")
    return names


def test_no_module_but_exits_defines_an_exit_status() -> None:
    found = [
        name
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "exits.py" and "standin" not in path.parts
        for name in _exit_constants(path)
    ]
    assert found == []


def test_the_contracts_exit_statuses() -> None:
    assert (exits.EX_OK, exits.EX_FAIL, exits.EX_NOT_READY, exits.EX_UNREACHABLE) == (0, 1, 3, 4)
    assert exits.EX_NOT_SERVICE == 5
    assert (exits.EX_RESTART_BY_ORCHESTRATOR, exits.EX_NOPERM, exits.EX_CONFIG) == (75, 77, 78)
