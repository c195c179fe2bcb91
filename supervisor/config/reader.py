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


# An alias is the node it names once more: PyYAML shares it, but everything that walks the
# loaded value (the sections, their error messages, a reload's comparison) walks every copy, and
# ten aliases of ten aliases of ... ("billion laughs") make a 1 KB file a billion values. What a
# value expands to is measured on the node graph (each node weighed once, memoised: linear in
# the file) before anything is constructed: a scalar weighs its length + 1, a collection 1 + its
# items. A real config weighs a few thousand; anchors shared between profiles, tens of thousands.
MAX_ALIAS_WEIGHT = 64 << 10  # one alias's expansion
MAX_EXPANDED_WEIGHT = 1 << 20  # the whole file's, beyond its own length


def _alias_issues(root: yaml.Node | None, text_len: int) -> list[ConfigIssue]:
    """One issue for each alias that expands past MAX_ALIAS_WEIGHT (at most three, the first in
    the file), for an alias of a node that holds it, and for a file that expands past its
    length + MAX_EXPANDED_WEIGHT; named by the key path and line where it is used."""
    if root is None:
        return []
    weight: dict[int, int] = {}
    active: set[int] = set()

    def weigh(node: yaml.Node) -> int:
        # Iterative (a deep file must not hit the recursion limit here): post-order on a stack.
        stack: list[tuple[yaml.Node, bool]] = [(node, False)]
        while stack:
            n, done = stack.pop()
            key = id(n)
            if key in weight:
                continue
            if isinstance(n, yaml.ScalarNode):
                weight[key] = len(str(n.value)) + 1
                continue
            kids = _children(n)
            if done:
                active.discard(key)
                weight[key] = 1 + sum(weight.get(id(k), _CYCLE) for k in kids)
                continue
            if key in active:
                continue  # a cycle: its weight stays unknown, read as _CYCLE
            active.add(key)
            stack.append((n, True))
            stack.extend((k, False) for k in kids if id(k) not in weight)
        return weight[id(node)]

    total = weigh(root)
    issues: list[ConfigIssue] = []
    seen: set[int] = set()
    lines: set[int] = set()
    # Document order, each node's first appearance walked: a later one is an alias.
    walk: list[tuple[yaml.Node, str, int]] = [(root, "", root.start_mark.line + 1)]
    while walk and len(issues) < 3:
        node, path, line = walk.pop()
        if id(node) in seen:
            w = weight.get(id(node), _CYCLE)
            if w >= MAX_ALIAS_WEIGHT and line not in lines:
                lines.add(line)
                what = (
                    "refers to a node that holds it"
                    if w >= _CYCLE
                    else f"expands to {w} (values + characters), more than {MAX_ALIAS_WEIGHT}"
                )
                issues.append(ConfigIssue(path, line, f"an alias here {what}"))
            continue
        seen.add(id(node))
        kids: list[tuple[yaml.Node, str, int]] = []
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = str(key_node.value)
                sub = f"{path}.{key}" if path else key
                kids.append((value_node, sub, key_node.start_mark.line + 1))
        elif isinstance(node, yaml.SequenceNode):
            kids = [(item, f"{path}[{i}]", line) for i, item in enumerate(node.value)]
        walk.extend(reversed(kids))
    if not issues and total > text_len + MAX_EXPANDED_WEIGHT:
        issues.append(
            ConfigIssue(
                "", None, f"its aliases expand it to {total}, more than {MAX_EXPANDED_WEIGHT}"
            )
        )
    return issues


_CYCLE = 1 << 62


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


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
