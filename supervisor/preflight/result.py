"""Preflight's findings: one `Check` per finding, its kind (`config`: a restart cannot fix it;
`host`: it may clear by itself), and what a list of them adds up to (the exit status, the one
line for systemd's STATUS=). supervisor/preflight/__init__.py makes the checks."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from supervisor.exits import EX_CONFIG, EXIT_HOST

CONFIG: Literal["config"] = "config"
HOST: Literal["host"] = "host"
CheckKind = Literal["config", "host"]


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One preflight finding. `ok` with `warning` is a pass worth reading (a deprecated flag);
    `ok` with `skipped` did not apply here (not SGLang, GPUs not managed)."""

    name: str
    ok: bool
    kind: CheckKind
    message: str
    hint: str = ""
    warning: bool = False
    skipped: bool = False
    serving: bool = False  # the port is held by the running daemon's own SGLang (serving.py)

    @property
    def status(self) -> str:
        if not self.ok:
            return "FAIL"
        if self.skipped:
            return "skip"
        return "WARN" if self.warning else "ok"

    def render(self) -> str:
        line = f"{self.status:<5} {self.name:<20} {self.message}"
        if self.hint:
            line += "".join(f"\n{'':27}{part}" for part in self.hint.splitlines())
        return line

    def one_line(self) -> str:
        """Name, message and hint on one line (a log line, STATUS=)."""
        text = f"{self.name}: {self.message}"
        if self.hint:
            text += " | hint: " + " ".join(self.hint.split())
        return text

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "status": self.status}


def failures(checks: Iterable[Check], kind: CheckKind | None = None) -> list[Check]:
    return [c for c in checks if not c.ok and (kind is None or c.kind == kind)]


def exit_code(checks: Sequence[Check]) -> int:
    """0 all passed; 78 any config problem (a restart will not fix it); else 1 (host)."""
    if failures(checks, CONFIG):
        return EX_CONFIG
    return EXIT_HOST if failures(checks) else 0


def summary(checks: Sequence[Check], limit: int = 400) -> str:
    """One line for systemd's STATUS= and the log: the first failure (config ones first)."""
    failed = sorted(failures(checks), key=lambda c: c.kind != CONFIG)
    if not failed:
        warned = [c for c in checks if c.warning]
        extra = f", {len(warned)} warning(s): {warned[0].name}" if warned else ""
        return f"preflight ok ({len(checks)} checks{extra})"
    first = failed[0]
    more = f" (+{len(failed) - 1} more)" if len(failed) > 1 else ""
    text = " ".join(f"preflight {first.kind} problem{more}: {first.one_line()}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
