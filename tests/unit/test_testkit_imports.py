"""Test support lives in testkit/: no module of tests/, testkit/ or bench/ imports a module of
tests/ (a test module, a conftest or a helper beside them), relative imports included."""

from __future__ import annotations

import ast
from pathlib import Path

from testkit.paths import REPO_ROOT

ROOTS = ("tests", "testkit", "bench")


def module_of(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, source: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, at any depth."""
    package = module_of(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if node.module:
                found.append((node.lineno, module))
            # `from tests.x import y` may name a module y as well as an attribute.
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def test_module_imports() -> None:
    """The names `imported` resolves, relative ones against the file's package."""
    path = REPO_ROOT / "tests" / "router" / "test_x.py"
    src = (
        "import os\nfrom .test_link import until\nfrom .. import probe\nfrom testkit import wait\n"
    )
    assert imported(path, src) == [
        (1, "os"),
        (2, "tests.router.test_link"),
        (2, "tests.router.test_link.until"),
        (3, "tests.probe"),
        (4, "testkit"),
        (4, "testkit.wait"),
    ]


def of_tests(module: str) -> bool:
    return module == "tests" or module.startswith("tests.")


def problems(path: Path, source: str) -> list[str]:
    return [
        f"{path.relative_to(REPO_ROOT)}:{line}: imports {module}"
        for line, module in imported(path, source)
        if of_tests(module)
    ]


def test_a_test_module_imported_as_a_library_is_found() -> None:
    path = REPO_ROOT / "tests" / "router" / "test_x.py"
    assert problems(path, "from .conftest import Launcher\n") == [
        "tests/router/test_x.py:1: imports tests.router.conftest",
        "tests/router/test_x.py:1: imports tests.router.conftest.Launcher",
    ]
    inside = "def f():\n    from tests.unit.test_machine import Drive\n"
    assert problems(path, inside)[0] == "tests/router/test_x.py:2: imports tests.unit.test_machine"
    assert problems(path, "import tests.gpu.gpu_helpers\n")
    assert problems(path, "from testkit.machine import Drive\nimport testsuite\n") == []


def test_nothing_imports_a_module_of_tests() -> None:
    files = sorted(p for root in ROOTS for p in (REPO_ROOT / root).rglob("*.py"))
    assert len(files) > 100, files  # the walk found the tree
    found = [msg for path in files for msg in problems(path, path.read_text())]
    assert not found, "test support belongs in testkit/:\n" + "\n".join(found)
