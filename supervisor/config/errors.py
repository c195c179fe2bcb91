"""Configuration, the errors: one problem (`ConfigIssue`: key path, line, message) and the error
a config read raises, carrying every problem found (`ConfigError`; `check` prints `render()`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConfigIssue:
    path: str
    line: int | None
    message: str


class ConfigError(Exception):
    """A config that cannot be used; carries every issue found."""

    def __init__(self, file: str, issues: list[ConfigIssue]) -> None:
        self.file = file
        self.issues = issues
        super().__init__(self.render())

    def render(self) -> str:
        lines = []
        for issue in self.issues:
            where = f"{self.file}:{issue.line}" if issue.line else self.file
            key = f" {issue.path}:" if issue.path else ""
            lines.append(f"{where}:{key} {issue.message}")
        return "\n".join(lines)
