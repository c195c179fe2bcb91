"""The router's API (sglang-router 0.3.x / SMG) as data: its answers parsed, URLs compared,
the retry backoff, the clear-HTTP key check. Pure and total; `router.link` makes the calls."""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from supervisor import untrusted
from supervisor.config import RouterConfig, is_loopback_url


@dataclass(frozen=True)
class Failure:
    """One failed call, classified. `kind` is stable (tests, alerts); `message` is the line."""

    op: str  # register | deregister | list | drain
    # connect | timeout | http_status | malformed | not_listed | still_listed | still_draining |
    # vanished
    kind: str
    message: str


@dataclass(frozen=True)
class Worker:
    id: str
    url: str
    healthy: bool | None
    # SMG (1.x) keeps a removed worker listed with status "draining" while its requests end;
    # it routes nothing new to it. "pending": being added, routed nothing yet.
    # sglang-router 0.3.2 lists no status.
    status: str | None = None

    @property
    def leaving(self) -> bool:
        return self.status == "draining"

    @property
    def adding(self) -> bool:
        return self.status == "pending"


@dataclass(frozen=True)
class Known:
    """SMG's 409 to `POST /workers`: it already lists this URL (`WORKER_ALREADY_EXISTS`, also
    while the entry is draining) or is adding it (`WORKER_CREATE_IN_PROGRESS`). Not a failure:
    the list says which."""

    code: str
    message: str


KNOWN_CODES = frozenset({"WORKER_ALREADY_EXISTS", "WORKER_CREATE_IN_PROGRESS"})


def same_url(a: str, b: str) -> bool:
    """URLs equal up to case of scheme and host, a trailing slash and a default port."""

    def norm(u: str) -> tuple[str, str, int | None]:
        p = urllib.parse.urlsplit(u.strip().rstrip("/"))
        try:
            port = p.port
        except ValueError:
            port = None
        default = {"http": 80, "https": 443}.get(p.scheme.lower())
        return p.scheme.lower(), (p.hostname or "").lower(), port or default

    return norm(a) == norm(b)


def parse_workers(status: int, body: bytes, content_type: str) -> list[Worker] | Failure:
    """The answer to `GET /workers`, or why it is not one. Pure and total."""
    if status != 200:
        return Failure("list", "http_status", f"GET /workers answered HTTP {status}{_snip(body)}")
    doc = _json(body)
    if doc is None:
        return Failure("list", "malformed", f"GET /workers answered {_not_json(content_type)}")
    raw = doc.get("workers") if isinstance(doc, dict) else None
    if not isinstance(raw, list):
        return Failure("list", "malformed", "GET /workers answered JSON without a workers list")
    out: list[Worker] = []
    for item in raw:
        if not isinstance(item, dict):
            return Failure("list", "malformed", "GET /workers: an entry is not an object")
        wid, url = item.get("id"), item.get("url")
        if not isinstance(wid, str) or not isinstance(url, str):
            return Failure("list", "malformed", "GET /workers: an entry has no id or url")
        healthy = item.get("is_healthy")
        state = item.get("status")
        out.append(
            Worker(
                wid,
                url,
                healthy if isinstance(healthy, bool) else None,
                state if isinstance(state, str) else None,
            )
        )
    return out


def parse_added(status: int, body: bytes, content_type: str) -> str | Known | Failure:
    """The worker id from the answer to `POST /workers`, SMG's "already known", or why there is
    neither."""
    if status == 409:
        doc = _json(body)
        if isinstance(doc, dict) and doc.get("code") in KNOWN_CODES:
            text = doc.get("error")
            return Known(str(doc["code"]), " ".join(str(text or "").split())[:200])
    if status not in (200, 201, 202):
        return Failure(
            "register", "http_status", f"POST /workers answered HTTP {status}{_snip(body)}"
        )
    doc = _json(body)
    if doc is None:
        return Failure("register", "malformed", f"POST /workers answered {_not_json(content_type)}")
    wid = doc.get("worker_id") if isinstance(doc, dict) else None
    if not isinstance(wid, str) or not wid:
        return Failure("register", "malformed", "POST /workers answered JSON without a worker_id")
    return wid


def key_in_clear(cfg: RouterConfig) -> str | None:
    """A warning when router.api_key_file's key would travel in clear HTTP to another host."""
    if cfg.url is None or cfg.api_key_file is None:
        return None
    if urllib.parse.urlsplit(cfg.url).scheme != "http" or is_loopback_url(cfg.url):
        return None
    return (
        f"router: router.api_key_file's key is sent in clear HTTP to {cfg.url}, another host: "
        "anyone on the path can read it; use an https:// router.url or a mesh that encrypts"
    )


def _json(body: bytes) -> Any:
    try:
        return untrusted.loads(body)
    except ValueError:
        return None


def _not_json(content_type: str) -> str:
    kind = content_type.split(";")[0].strip() or "no content type"
    return f"something that is not JSON ({kind}): is router.url the router's API?"


def _snip(body: bytes) -> str:
    text = " ".join(body[:160].decode("utf-8", "replace").split())
    return f": {text}" if text else ""


def backoff(attempt: int, initial: float, cap: float, rng: Callable[[], float]) -> float:
    """Exponential, capped, with full jitter in [0.5, 1] of the step (no thundering herd of
    replicas re-registering at once after a router restart)."""
    step = min(cap, initial * float(2 ** min(attempt, 30)))
    return step * (0.5 + 0.5 * rng())
