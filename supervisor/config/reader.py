"""Configuration, the YAML reader: the line of every key path, YAML errors, and `_Reader`, which
walks the raw YAML with the key path and line of every value at hand and collects every problem.

The section parsers (`sections`) are written in these terms; nothing here knows a section.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any, TypeVar

import yaml

from supervisor.config.convert import _kind
from supervisor.config.errors import ConfigIssue

# --------------------------------------------------------------------------------------------
# The line of every key; YAML errors
# --------------------------------------------------------------------------------------------


def _marks(root: yaml.Node | None) -> tuple[dict[str, int], list[ConfigIssue]]:
    """The line of every key path, and the keys written twice in one mapping (PyYAML keeps
    the last silently, so a second `port:` further down would quietly win)."""
    marks: dict[str, int] = {}
    twice: list[ConfigIssue] = []
    seen: set[int] = set()

    def walk(node: yaml.Node, path: str) -> None:
        # An alias is the same node again: walk it once (a recursive or exponential
        # alias would otherwise never finish).
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            for key_node, value_node in node.value:
                key = str(key_node.value)
                sub = f"{path}.{key}" if path else key
                line = key_node.start_mark.line + 1
                ident = (key_node.tag, key)
                if ident in first and key_node.tag != "tag:yaml.org,2002:merge":
                    twice.append(
                        ConfigIssue(sub, line, f"is set twice (first on line {first[ident]})")
                    )
                first.setdefault(ident, line)
                marks[sub] = line
                walk(value_node, sub)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                sub = f"{path}[{i}]"
                marks[sub] = item.start_mark.line + 1
                walk(item, sub)

    if root is not None:
        marks[""] = root.start_mark.line + 1
        walk(root, "")
    return marks, twice


def _yaml_issue(exc: yaml.YAMLError, text: str) -> ConfigIssue:
    mark = getattr(exc, "problem_mark", None)
    line = mark.line + 1 if mark is not None else None
    if isinstance(exc, yaml.reader.ReaderError):  # a control character: it has a position only
        line = text.count("\n", 0, exc.position) + 1
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    # An unclosed quote or bracket is found only at the end of the file; where it was opened
    # is the line to fix.
    context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and start is not None and start.line + 1 != line:
        problem = f"{context} (line {start.line + 1}): {problem}"
    return ConfigIssue("", line, f"invalid YAML: {problem}")


# --------------------------------------------------------------------------------------------
# The reader: walks the raw YAML with the key path and line of every value at hand
# --------------------------------------------------------------------------------------------


T = TypeVar("T")
_MISSING = object()


class _Reader:
    def __init__(self, file: str, marks: dict[str, int]) -> None:
        self.file = file
        self.marks = marks
        self.issues: list[ConfigIssue] = []

    def line(self, path: str) -> int | None:
        # The value's own line, else the closest enclosing key's.
        while path not in self.marks:
            path = path.rpartition(".")[0]
            if not path:
                return None  # a missing top-level key: no line to point at
        return self.marks[path]

    def error(self, path: str, message: str) -> None:
        self.issues.append(ConfigIssue(path, self.line(path), message))

    def section(self, raw: object, path: str, known: tuple[str, ...]) -> dict[str, Any]:
        """A mapping whose keys must all be known; unknown keys get a did-you-mean hint."""
        if raw is None:
            return {}
        if not isinstance(raw, dict):
            what = "" if path else "the top level: "
            self.error(path, f"{what}expected a mapping of {', '.join(known)}; got {_kind(raw)}")
            return {}
        for key in raw:
            if not isinstance(key, str):
                self.error(path, f"key {key!r} is not a string")
            elif key not in known:
                sub = f"{path}.{key}" if path else key
                close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                self.error(sub, f"unknown key {key!r}{hint} (known: {', '.join(known)})")
        return raw

    def get(
        self,
        raw: dict[str, Any],
        path: str,
        key: str,
        conv: Callable[[object], T],
        default: object = _MISSING,
    ) -> T:
        sub = f"{path}.{key}" if path else key
        if key not in raw:
            if default is _MISSING:
                self.error(sub, "is required but missing")
                return None  # type: ignore[return-value]
            return default  # type: ignore[return-value]
        try:
            return conv(raw[key])
        except (TypeError, ValueError) as exc:
            self.error(sub, str(exc))
            return None  # type: ignore[return-value]
