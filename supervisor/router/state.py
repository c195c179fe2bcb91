"""What the router link shows (`/status.router`) and what it is given to report with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class RouterMetrics(Protocol):
    def set_router_registered(self, registered: bool) -> None: ...
    def router_error(self, op: str) -> None: ...


class Log(Protocol):
    def info(self, event: str, **kw: Any) -> Any: ...
    def warning(self, event: str, **kw: Any) -> Any: ...


@dataclass
class RouterState:
    """What `/status.router` shows. Only RouterLink writes it."""

    url: str
    worker_url: str
    registered: bool = False  # confirmed by the router's list
    worker_id: str | None = None
    wanted: bool = False  # the machine wants us registered (ready)
    last_error: str | None = None
    last_error_at: float | None = None
    last_ok_at: float | None = None
    last_drain: dict[str, Any] | None = None
    errors: dict[str, int] = field(default_factory=dict)

    def to_status(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "worker_url": self.worker_url,
            "registered": self.registered,
            "worker_id": self.worker_id,
            "wanted": self.wanted,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
            "last_ok_at": self.last_ok_at,
            "last_drain": self.last_drain,
        }


def unlinked_status() -> dict[str, Any]:
    """`/status.router` without router.url: the same keys, so a client reads one shape;
    `url` and `worker_url` null, nothing registered."""
    return {**RouterState(url="", worker_url="").to_status(), "url": None, "worker_url": None}
