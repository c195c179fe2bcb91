"""When can the server serve? A stdlib-only watcher, run as its own process.

    python -m bench.observe --port P [--timeout S] [--fresh]
    python -m bench.observe --port P --mode broken     # is decode broken once /health is 200?
    python -m bench.observe --port P --mode hang --window W   # user traffic until it hangs
    python -m bench.observe --port P --readyz URL   # also: when URL first answered 200
    python -m bench.observe --mode kill --pid N --port 0      # SIGKILL N, report its exit

It tries a TCP connect every millisecond. The first accepted connection is `bind` (the port
is open: SGLang binds it only after loading); with `--fresh` only one that follows a refused
attempt counts, so a watcher started around a kill never mistakes the dying server for the
next one. On that connection it sends an 8-token /generate at once, and again after every
failure, until one comes back with all the tokens: `decode` is the moment that answer arrived.
One JSON line per event on stdout, with wall-clock times (`time.time()`), so they compare with
the daemons' log timestamps.

It is a separate process so the same watcher runs beside every supervisor, also inside the
systemd box's network namespace (through nsenter), and it imports nothing heavy: it must be
polling before the server it watches can bind.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import select
import signal
import sys
import threading
import time
from urllib.parse import urlsplit

POLL_S = 0.001
HOST = "127.0.0.1"
TOKENS = 8


_done_readyz = threading.Event()
_out = threading.Lock()


def emit(event: str, **fields: object) -> None:
    """One JSON line on stdout: the event, its fields, `t` (now, unless given)."""
    fields.setdefault("t", time.time())
    with _out:
        sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
        sys.stdout.flush()
    if event in ("readyz", "readyz_timeout"):
        _done_readyz.set()


def _decode(conn: http.client.HTTPConnection, tokens: int) -> tuple[bool, str]:
    params = {"max_new_tokens": tokens, "temperature": 0}
    body = json.dumps({"text": "The capital city of France is", "sampling_params": params})
    conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    raw = response.read()
    if response.status != 200:
        return False, f"HTTP {response.status}"
    try:
        got = json.loads(raw)["meta_info"]["completion_tokens"]
    except (ValueError, KeyError, TypeError):
        return False, "malformed answer"
    return got == tokens, f"{got} tokens"


def _readyz(url: str, deadline: float) -> None:
    """Poll `url` every 2 ms until it answers 200 (started once the server's port is bound:
    a daemon cannot be ready earlier, and polling it during the load would only load it)."""
    while time.monotonic() < deadline:
        if url_status(url, 1.0) == 200:
            emit("readyz")
            return
        time.sleep(0.002)
    emit("readyz_timeout")


def kill(pid: int) -> int:
    """SIGKILL `pid`; `killed` is the time just before the signal, `dead` when a pidfd said
    the process had exited. Real-time priority (where allowed: root) so that on a busy machine
    this process wakes at the exit itself, not when the scheduler gets round to it; it sleeps
    in poll() the whole time, so it takes nothing from the supervisors it watches."""
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    try:
        fd = os.pidfd_open(pid)
    except OSError as exc:
        emit("error", detail=str(exc))
        return 1
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    t = time.time()
    os.kill(pid, signal.SIGKILL)
    emit("killed", t=t)
    if poller.poll(30_000):
        t = time.time()
        # Back to normal priority before anything else (the JSON, the interpreter's exit):
        # at real-time priority that would take the CPU from the supervisors being measured.
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        emit("dead", t=t)
        return 0
    emit("error", detail="still alive after 30 s")
    return 1


def watch(port: int, timeout: float, fresh: bool, readyz: str | None) -> int:
    deadline = time.monotonic() + timeout
    bound = False
    refused = not fresh
    attempts = 0
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection(HOST, port, timeout=max(0.1, deadline - time.monotonic()))
        try:
            conn.connect()
        except OSError:
            conn.close()
            refused = True
            time.sleep(POLL_S)
            continue
        now = time.time()
        if not refused:
            conn.close()  # still the previous server
            time.sleep(POLL_S)
            continue
        if not bound:
            bound = True
            emit("bind", t=now)
            if readyz:
                threading.Thread(target=_readyz, args=(readyz, deadline), daemon=True).start()
        attempts += 1
        try:
            ok, what = _decode(conn, TOKENS)
        except (OSError, http.client.HTTPException) as exc:
            ok, what = False, f"{type(exc).__name__}: {exc}"
        finally:
            conn.close()
        if ok:
            emit("decode", t=time.time(), sent=now, attempts=attempts)
            if readyz:
                while time.monotonic() < deadline and not _done_readyz.is_set():
                    time.sleep(0.01)
            return 0
        emit("decode_failed", sent=now, error=what)
        time.sleep(POLL_S)
    emit("timeout")
    return 1


def health_status(host: str, port: int, timeout: float = 1.0, path: str = "/health") -> int | None:
    """GET `path`: its status, or None when nothing answered."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def url_status(url: str, timeout: float) -> int | None:
    u = urlsplit(url)
    return health_status(u.hostname or HOST, u.port or 80, timeout, u.path or "/")


def _healthy(port: int, timeout: float) -> float | None:
    """When /health first answered 200 (None, and a `timeout` event: not within `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if health_status(HOST, port) == 200:
            return time.time()
        time.sleep(0.05)
    emit("timeout")
    return None


def _one_decode(port: int, tokens: int, timeout: float) -> tuple[bool, str]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        return _decode(conn, tokens)
    except (OSError, http.client.HTTPException) as exc:
        return False, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    finally:
        conn.close()


def broken(port: int, timeout: float, decode_timeout: float) -> int:
    """Once /health answers 200: does an 8-token decode come back in time?"""
    healthy = _healthy(port, timeout)
    if healthy is None:
        return 1
    sent = time.time()
    ok, what = _one_decode(port, TOKENS, decode_timeout)
    emit("verdict", healthy=healthy, sent=sent, decode_ok=ok, detail=what)
    return 0


def hang(port: int, timeout: float, window: float) -> int:
    """User traffic (20 one-token decodes a second) from the first /health 200 until a request
    gets no answer within 0.5 s: `onset` is when that request was sent. Then /health once a
    second for `window` seconds: the baselines only ever look there."""
    if _healthy(port, timeout) is None:
        return 1
    deadline = time.monotonic() + timeout
    answered = 0
    onset = None
    while time.monotonic() < deadline:
        sent = time.time()
        if not _one_decode(port, 1, 0.5)[0]:
            onset = sent
            break
        answered += 1
        time.sleep(max(0.0, sent + 0.05 - time.time()))
    if onset is None:
        emit("timeout")
        return 1
    emit("onset", t=onset, answered=answered)
    end = time.monotonic() + window
    statuses = []
    while time.monotonic() < end:
        statuses.append(health_status(HOST, port))
        time.sleep(1.0)
    ok, _ = _one_decode(port, 1, 0.5)
    emit("window", health=statuses, decode_ok_at_end=ok)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.observe", description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--fresh", action="store_true", help="count a bind only after a refusal")
    p.add_argument("--mode", choices=("serve", "broken", "hang", "kill"), default="serve")
    p.add_argument("--window", type=float, default=20.0, help="hang: seconds to keep watching")
    failed = "broken: how long a decode may take before it counts as failed"
    p.add_argument("--decode-timeout", type=float, default=3.0, help=failed)
    p.add_argument("--readyz", help="serve: also poll this URL from the bind until 200")
    p.add_argument("--pid", type=int, help="kill: the process to SIGKILL")
    a = p.parse_args(argv)
    if a.mode == "kill":
        return kill(a.pid)
    emit("started")
    if a.mode == "broken":
        return broken(a.port, a.timeout, a.decode_timeout)
    if a.mode == "hang":
        return hang(a.port, a.timeout, a.window)
    return watch(a.port, a.timeout, a.fresh, a.readyz)


if __name__ == "__main__":
    raise SystemExit(main())
