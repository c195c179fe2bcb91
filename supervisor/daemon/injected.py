"""An internal error on purpose, for the end-to-end test of the hand-over after one
(docs/architecture.md, "Internal errors hand over").

No input from outside is known to raise one any more: each answer, line or file that did was
made a bad answer instead (docs/security.md; tests/integration/test_hostile_peer.py and
test_hostile_neighbours.py assert that none does), so the test needs a trigger of its own. Off
unless `KIMI_SERVE_TEST_INTERNAL_ERROR` names a file at start (read once; never set in
production): then `check(where)` raises where the file's text says (`task`: the daemon's
ticker task; `dispatch`: the loop's dispatch of the next event) and removes the file, one
error per file written. Only a regular file of the daemon's own user counts.
"""

from __future__ import annotations

import contextlib
import os
import stat

ENV = "KIMI_SERVE_TEST_INTERNAL_ERROR"
WHERE = ("task", "dispatch")
_PATH = os.environ.get(ENV) or None


class InjectedError(RuntimeError):
    pass


def check(where: str, path: str | None = _PATH) -> None:
    if path is None:
        return
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return
        with open(path, encoding="utf-8", errors="replace") as f:
            wanted = f.read(64).strip()
    except OSError:
        return
    if wanted != where:
        return
    with contextlib.suppress(OSError):
        os.unlink(path)
    raise InjectedError(f"an internal error injected in the {where} ({ENV})")
