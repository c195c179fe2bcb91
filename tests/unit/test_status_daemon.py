"""`kimi-serve status` shows the daemon's own version, uptime and last hand-over
(/status.daemon), beside SGLang's."""

from __future__ import annotations

from supervisor.admin import status_command as status

NOW = 1_700_000_000.0


def test_the_daemon_line_gives_version_uptime_and_the_last_hand_over() -> None:
    doc = {
        "state": "ready",
        "version": "0.2.0",
        "daemon": {
            "version": "0.2.0",
            "pid": 77,
            "started_at": NOW - 3 * 3600,
            "handoffs": 2,
            "last_handoff": {
                "at": NOW - 60,
                "seconds": 1.25,
                "from_version": "0.1.0",
                "outcome": "ok",
            },
        },
        "child": {"pid": 4242, "started_at": NOW - 4 * 3600, "processes": [4242]},
    }
    text = status.render(doc, NOW)
    line = next(x for x in text.splitlines() if x.strip().startswith("Daemon:"))
    assert "kimi-serve 0.2.0, pid 77, up 3.0 h" in line
    assert "2 hand-overs, the last ok in 1.2 s from 0.1.0, 60 s ago" in line
    assert "SGLang: pid 4242, up 4.0 h" in text


def test_a_daemon_that_never_handed_over_shows_its_uptime_only() -> None:
    lines = status.daemon_lines(
        {"version": "0.1.0", "pid": 5, "started_at": NOW - 30, "handoffs": 0}, NOW
    )
    assert lines == ["    Daemon: kimi-serve 0.1.0, pid 5, up 30 s"]
    assert status.daemon_lines(None, NOW) == []  # an older daemon: no line


def test_one_hand_over_is_singular() -> None:
    last = {"at": NOW - 5, "seconds": 0.5, "from_version": "0.1.0", "outcome": "fallback"}
    d = {"version": "0.1.0", "pid": 5, "started_at": NOW - 30, "handoffs": 1, "last_handoff": last}
    (line,) = status.daemon_lines(d, NOW)
    assert "; 1 hand-over, the last fallback in 0.5 s from 0.1.0, 5 s ago" in line
