"""Untrusted text never drives the operator's terminal (supervisor/terminal.py): every character
that could move the cursor, set the title, clear or hide text, or reorder it is shown escaped,
on code points, by the renderer and by the guard on every command's streams; legitimate UTF-8
(`status`'s `●`, other scripts) prints as it is. The commands are run against an admin port of
this process's own (the owner check passes, as for SGLang holding the port after the daemon
died) that answers with a hostile value in every field."""

from __future__ import annotations

import http.server
import io
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor import terminal
from testkit.cli import kimi_serve

# ESC ] 0 ; title BEL (the window title), ESC [ 2 J (clear), ESC [ 8 m (hide what follows), a C1
# CSI, a right-to-left override, a zero-width space and isolate, a line separator, a carriage
# return (redraw), a backspace, DEL.
HOSTILE = "\x1b]0;owned\x07\x1b[2J\x1b[8m\x9b31m\u202e\u200b\u2066\u2028\r\x08\x7f"
FORBIDDEN = {0x1B, 0x07, 0x9B, 0x202E, 0x200B, 0x2066, 0x2028, 0x0D, 0x08, 0x7F}
LEGIT = "é 日本 ●"


def forbidden_in(text: str) -> list[str]:
    return [f"U+{ord(c):04X}" for c in text if ord(c) in FORBIDDEN]


def test_shown_escapes_each_character_visibly_and_the_backslash_too() -> None:
    got = terminal.shown("a\x1b[2Jb\u202ec\\d\te\nf\x9bg\u200bh")
    assert got == "a\\e[2Jb\\u202ec\\\\d\\te\\nf\\x9bg\\u200bh"
    assert forbidden_in(got) == []


def test_legitimate_text_passes_unchanged() -> None:
    assert terminal.shown(LEGIT) == LEGIT
    guarded = io.StringIO()
    terminal.Guard(guarded).write(f"● {LEGIT}\n\tnext\n")
    assert guarded.getvalue() == f"● {LEGIT}\n\tnext\n"


def test_a_redrawn_progress_line_shows_its_last_drawing() -> None:
    assert terminal.log_line("10%\r50%\r100%") == "100% [redrawn 2 times]"
    assert terminal.log_line("plain") == "plain"
    # Anything else keeps every drawing: a value is never shortened by its own \r.
    assert terminal.shown("crash\rok") == "crash\\rok"


def test_a_long_value_is_cut_saying_how_much_was_left_out() -> None:
    got = terminal.shown("x" * 10_000, limit=100)
    assert got == "x" * 100 + "… (9900 bytes more)"


def test_sanitized_reaches_every_string_keys_included() -> None:
    doc = {"a": [HOSTILE, {HOSTILE: 1.5}], "n": 3, "none": None}
    assert forbidden_in(json.dumps(terminal.sanitized(doc), ensure_ascii=False)) == []
    assert terminal.sanitized(doc)["n"] == 3


def test_the_guard_escapes_what_did_not_go_through_shown() -> None:
    stream = io.StringIO()
    terminal.Guard(stream).write(f"version {HOSTILE}\n")
    assert forbidden_in(stream.getvalue()) == []
    assert stream.getvalue().startswith("version \\e]0;owned\\x07")


def hostile_status() -> dict[str, Any]:
    """A /status document shaped like the daemon's, every string hostile."""
    h = HOSTILE
    now = time.time()
    return {
        "state": f"ready{h}",
        "since": now - 5,
        "version": f"0.1.0{h}",
        "sglang_version": f"0.5.23{h}",
        "detail": f"detail{h}",
        "profile": f"primary{h}",
        "loading": {"launch": 2, "phase": f"weights{h}", "elapsed_s": 3, "load_timeout_s": 600},
        "daemon": {
            "version": f"0.1.0{h}",
            "pid": 1,
            "started_at": now - 50,
            "handoffs": 1,
            "last_handoff": {"outcome": f"ok{h}", "seconds": 1.0, "from_version": h, "at": now},
        },
        "child": {"pid": 2, "started_at": now - 9, "processes": [{"name": h}]},
        "restarts": {f"manual{h}": 1},
        "reload_refused": f"refused{h}",
        "last_probe": {"kind": h, "ok": False, "reason": h, "error": f"error{h}", "at": now},
        "quality": {"canary": {"state": "mismatch", "expected": h, "got": h}, "degraded": [h]},
        "upgrade": {"state": f"trial{h}", "why": h, "serving_lkg": True},
        "intent": {"mismatches": [{"arg": h, "expected": h, "actual": h}]},
        "last_restart": {
            "reason": f"liveness_failed{h}",
            "at": now - 3,
            "signal": h,
            "detail": f"the detail{h}",
            "incident": f"/var/lib/kimi-serve/incidents/x{h}",
            "log_tail": [f"ValueError: {h}", "50%\r100%\x1b]0;owned\x07", "\x1b[8mhidden crash"],
        },
        "events": [{"at": now, "from": h, "to": h, "reason": h, "detail": h}],
    }


class _Hostile(http.server.BaseHTTPRequestHandler):
    def _answer(self, code: int, doc: object) -> None:
        body = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer(200, hostile_status())

    def do_POST(self) -> None:
        doc = hostile_status()
        self._answer(202, {"accepted": True, "launch": 3, "daemon": doc["daemon"], "note": HOSTILE})

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def hostile_admin() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_status_shows_every_hostile_field_escaped(hostile_admin: str) -> None:
    done = kimi_serve("status", "--url", hostile_admin)
    both = done.stdout + done.stderr
    assert forbidden_in(both) == [], forbidden_in(both)
    assert "●" in done.stdout  # legitimate UTF-8 still prints
    assert "\\e[8mhidden crash" in done.stdout  # what was there is visible, not deleted
    # The redrawn line collapsed to its last drawing, its escapes shown.
    assert "100%\\e]0;owned\\x07 [redrawn 1 times]" in done.stdout


@pytest.mark.parametrize("command", ["restart", "reexec", "undrain"])
def test_a_wait_shows_the_hostile_answer_and_progress_escaped(
    hostile_admin: str, tmp_path: Path, command: str
) -> None:
    token = tmp_path / "admin.token"
    token.write_text("t" * 32 + "\n")
    token.chmod(0o600)
    done = kimi_serve(
        command, "--wait", "--timeout", "2s", "--url", hostile_admin, "--token-file", str(token)
    )
    both = done.stdout + done.stderr
    assert forbidden_in(both) == [], (done.returncode, forbidden_in(both), both[-2000:])
    assert "\\e" in both  # the hostile text was shown, escaped


def test_json_keeps_the_raw_text_json_escaped(hostile_admin: str) -> None:
    done = kimi_serve("status", "--json", "--url", hostile_admin)
    assert forbidden_in(done.stdout) == []
    assert json.loads(done.stdout)["state"] == f"ready{HOSTILE}"
