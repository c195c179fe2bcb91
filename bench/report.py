"""Raw samples -> the tables (plain text for the terminal, Markdown for docs/benchmarks.md) and
the verdict on each goal of the benchmark issue."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from bench.common import Stat
from bench.scenarios import APPROACHES, KIMI, POLLER, SUPERVISORD, SYSTEMD


def ready_means(results: dict[str, Any]) -> dict[str, str]:
    period = results.get("settings", {}).get("poller_period", 10.0)
    return {
        KIMI: "READY=1 datagram (after an 8-token decode probe)",
        SUPERVISORD: "RUNNING (stayed up startsecs=1)",
        SYSTEMD: "active (Type=exec: the exec succeeded)",
        POLLER: f"first /health 200 (polled every {period:g} s)",
    }


Table = tuple[str, list[str], list[list[str]], list[str]]  # title, header, rows, notes


def _ms(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if abs(x) >= 10_000:
        return f"{x / 1000:.1f} s"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.1f}"


def _stat_ms(st: Stat | None) -> tuple[str, str]:
    if st is None:
        return "—", "—"
    return _ms(st.median), f"{_ms(st.lo)} … {_ms(st.hi)}"


def _n_stat(st: Stat | None) -> list[str]:
    """n, median, min … max of a sample in ms."""
    return [str(st.n if st else 0), *_stat_ms(st)]


def _median(st: Stat | None) -> str:
    return _ms(st.median if st else None)


def _s(results: dict[str, Any], approach: str, key: str) -> Any:
    return (results.get(approach) or {}).get(key)


def _missing(results: dict[str, Any], approach: str, figure: str) -> str:
    if approach not in results.get("approaches", APPROACHES):
        return "not selected (--only)"
    nm = results.get("not_measured", {})
    why = nm.get(f"{approach}/{figure}") or nm.get(f"{approach}/faults") or nm.get(approach)
    return f"not measured: {why}" if why else "not measured"


# ---------------------------------------------------------------------------- tables


def readiness(results: dict[str, Any]) -> tuple[Table, dict[str, Stat | None]]:
    rows = []
    medians: dict[str, Stat | None] = {}
    means = ready_means(results)
    for a in APPROACHES:
        cyc = _s(results, a, "cycles")
        if not cyc:
            rows.append([a, means[a], "—", _missing(results, a, "cycles"), "", "", ""])
            continue
        samples = cyc["readiness"]
        lag = Stat.of((x["ready"] - x["decode"]) * 1000 for x in samples)
        bind = Stat.of((x["ready"] - x["bind"]) * 1000 for x in samples)
        medians[a] = lag
        k, vs = medians.get(KIMI), ""  # kimi-serve comes first
        if a != KIMI and lag is not None and k is not None:
            vs = (
                f"{lag.median / k.median:.0f}x later"
                if lag.median > 0 and k.median > 0
                else f"ready {_ms(-lag.median)} ms before it could serve"
            )
        rows.append([a, means[a], *_n_stat(lag), _median(bind), vs])
        if a == KIMI:
            rz = Stat.of((x["readyz"] - x["decode"]) * 1000 for x in samples if x.get("readyz"))
            rows.append(
                [f"{KIMI} /readyz", "/readyz 200 (polled every 2 ms)", *_n_stat(rz), "", ""]
            )
    notes = [
        "Lag = ready reported - the first moment a decode was served (the watcher's 8-token "
        "/generate, sent the instant the port accepted a connection, came back). Negative: "
        "ready was reported before the server could serve at all.",
        "Samples: the first start and every relaunch after a kill.",
    ]
    header = ["approach", "ready means", "n", "median", "min … max", "median from bind"]
    return ("1. Readiness lag (ms)", [*header, "vs kimi-serve"], rows, notes), medians


def false_ready(results: dict[str, Any]) -> tuple[Table, dict[str, tuple[int, int]]]:
    rows = []
    counts: dict[str, tuple[int, int]] = {}
    for a in APPROACHES:
        f = _s(results, a, "false_ready")
        if f is None:
            rows.append([a, "—", "—", _missing(results, a, "false_ready")])
            continue
        if a == KIMI:
            n, bad = f["trials"], f["false_ready"]
            how = (
                f"READY=1 sent {f['ready_datagrams']}x; /readyz 200 in "
                f"{f['readyz_200']}/{f['readyz_polls']} polls; each launch restarted "
                f"({', '.join(sorted({v['reason'] for v in f['verdicts']}))})"
            )
        else:
            n = len(f)
            bad = sum(1 for t in f if not t["decode_ok"] and t["still_ready"])
            how = "; ".join(sorted({t["detail"] for t in f}))
            how = f"still ready while a decode failed ({how})"
        counts[a] = (bad, n)
        rate = f"{100 * bad / n:.0f}%" if n else "—"
        rows.append([a, str(n), f"{bad} ({rate})", how])
    notes = [
        "Fault seed-incident: /health answers 200, the first multi-token decode kills the "
        "scheduler (the incident this project exists for). A trial is one broken launch."
    ]
    header = ["approach", "broken launches", "reported ready", "how"]
    return ("2. False ready (seed-incident)", header, rows, notes), counts


def death(results: dict[str, Any]) -> tuple[Table, dict[str, Stat | None]]:
    rows = []
    stats: dict[str, Stat | None] = {}
    for a in APPROACHES:
        cyc = _s(results, a, "cycles")
        if not cyc:
            rows.append([a, "—", _missing(results, a, "cycles"), "", "", "", ""])
            continue
        d = cyc["death"]
        total = Stat.of((x["noticed"] - x["kill"]) * 1000 for x in d)
        own = Stat.of((x["noticed"] - x["dead"]) * 1000 for x in d)
        exit_ = Stat.of((x["dead"] - x["kill"]) * 1000 for x in d)
        stats[a] = total
        k, vs = stats.get(KIMI), ""  # kimi-serve comes first
        if a != KIMI and total is not None and k is not None:
            vs = f"{total.median / k.median:.2f}x" if k.median > 0 else "—"
        rows.append([a, *_n_stat(total), _median(own), _median(exit_), vs])
        if a == KIMI:
            st = Stat.of((x["status_datagram"] - x["kill"]) * 1000 for x in d)
            rows.append([f"{KIMI} STATUS=", *_n_stat(st), "", "", "datagram arrival"])
    notes = [
        "kill = just before SIGKILL of the server's main process; exited = when the "
        "process was gone (the bench's own pidfd); noticed = the supervisor's record "
        "(see bench/scenarios.py). 'exited → noticed' is each supervisor's own share."
    ]
    header = ["approach", "n", "kill → noticed (median)", "min … max", "exited → noticed"]
    header += ["kill → exited", "vs kimi-serve"]
    return ("3. Death detection (ms)", header, rows, notes), stats


def hang(results: dict[str, Any]) -> Table:
    rows = []
    for a in APPROACHES:
        h = _s(results, a, "hang")
        if h is None:
            rows.append([a, "—", "—", _missing(results, a, "hang"), ""])
            continue
        if a == KIMI:
            trials = h["trials"]
            st = Stat.of(t["noticed"] - t["onset"] for t in trials)
            lv = h["liveness"]
            reasons = ", ".join(sorted({t["reason"] for t in trials}))
            took = f"{st.median:.2f} s ({st.lo:.2f} … {st.hi:.2f})" if st else "—"
            how = f"liveness every {lv['interval']}, timeout {lv['timeout']}, "
            how += f"{lv['failure_threshold']} strikes"
            rows.append([a, str(len(trials)), f"{len(trials)} ({reasons})", took, how])
        else:
            detected = sum(1 for t in h if t["detected"])
            watched = min(t["watched_s"] for t in h)
            health = {s for t in h for s in t["health"]}
            took = f"not noticed in {watched:.0f} s" if not detected else "noticed"
            how = f"/health answered {sorted(health, key=str)} throughout"
            rows.append([a, str(len(h)), str(detected), took, how])
    after = results.get("settings", {}).get("hang_after", 30)
    notes = [
        f"Fault decode-hang: after {after} decodes every decode hangs while /health stays 200. "
        "Onset = when the first user request that never got an answer was sent (the bench "
        "sends 20 one-token decodes a second).",
        "kimi-serve's time is interval-bound by design: about U(0, interval) + strikes x "
        "timeout + (strikes - 1) x interval. With the production liveness (15 s, 20 s, 3) that "
        "is 90-105 s; the bench uses 1 s / 1 s / 3 to measure the mechanism in seconds.",
    ]
    header = ["approach", "trials", "restarted", "hang → restart decided", "how"]
    return ("4. Hang detection", header, rows, notes)


def _recovery_parts(a: str, x: dict[str, float]) -> dict[str, float]:
    """One kill's recovery in the same terms for every approach (seconds)."""
    if a == KIMI:
        spawned = x["detect"] + x["stop"] + x["backoff"] + x["cleaning"] + x["relaunch"]
        after_bind = x["port_seen"] + x["probe"] + x["notify"]
    else:
        spawned = x["detect"] + x["respawn"]
        after_bind = x["total"] - spawned - x["load"]
    return {
        "detect": x["detect"],
        "spawned": spawned,
        "load": x["load"],
        "after_bind": after_bind,
        "total": x["total"],
        "serving": x["serving"],
        "overhead": x["serving"] - x["load"],
        "ready_vs_serving": x["total"] - x["serving"],
    }


def recovery(results: dict[str, Any]) -> tuple[list[Table], dict[str, Any]]:
    rows = []
    medians: dict[str, Any] = {}
    cols = ["detect", "spawned", "load", "after_bind", "total", "serving", "overhead"]
    cols.append("ready_vs_serving")
    for a in APPROACHES:
        cyc = _s(results, a, "cycles")
        if not cyc:
            rows.append([a, _missing(results, a, "cycles")] + [""] * (len(cols) - 1))
            continue
        parts = [_recovery_parts(a, x) for x in cyc["recovery"]]
        med = {c: Stat.of(p[c] * 1000 for p in parts) for c in cols}
        medians[a] = {c: (m.median if m else None) for c, m in med.items()}
        rows.append([a, *(_ms(medians[a][c]) for c in cols)])
    k = medians.get(KIMI)
    if k:
        for row in rows:
            m = medians.get(row[0])
            if row[0] != KIMI and m and m["overhead"] and k["overhead"]:
                row[7] += f" ({m['overhead'] / k['overhead']:.0f}x)"
    notes = [
        "Medians over the kills of table 3. 'server load' is the stand-in's own time from "
        "spawn to binding its port (interpreter start-up + STANDIN_LOAD_SECONDS); "
        "'restart overhead' = kill → serving minus that: the part a supervisor adds "
        "(in brackets: times kimi-serve's).",
        "'bind → ready' and 'ready - serving' are negative when an approach called the server "
        "ready before it could serve. kimi-serve's back-off is 0 s here (production: 5 s, "
        "doubling); supervisord respawns on its next 1-s tick; systemd waits RestartSec "
        "(100 ms default); the poller model restarts at its next 1-s relist, with no "
        "CrashLoopBackOff.",
    ]
    main: Table = (
        "5. Recovery: server killed → serving and ready again (ms, medians)",
        [
            *("approach", "noticed", "kill → respawned", "server load (stand-in)"),
            *("bind → ready reported", "kill → ready reported", "kill → serving"),
            *("restart overhead", "ready - serving"),
        ],
        rows,
        notes,
    )
    tables = [main]
    cyc = _s(results, KIMI, "cycles")
    if cyc:
        r = cyc["recovery"]
        what = {
            "detect": "kill → state restarting (pidfd wakes the loop)",
            "stop": "killpg + sweep of the launch's processes, until all are gone",
            "backoff": "restart.backoff_initial (0 s in the bench)",
            "cleaning": "leftover scan, GPU check (off), port free check",
            "relaunch": "spawn of the new SGLang",
            "load": "the stand-in: interpreter start, STANDIN_LOAD_SECONDS, bind",
            "port_seen": "port bound → daemon notices (connect poll every 50 ms)",
            "probe": "/metrics read + 8-token /generate probe",
            "notify": "state ready → READY=1 datagram queued",
            "total": "kill → READY=1",
        }
        krows = [[k, *_stat_ms(Stat.of(x[k] * 1000 for x in r)), t] for k, t in what.items()]
        header = ["step", "median", "min … max", "what"]
        tables.append(("5b. kimi-serve recovery, step by step (ms)", header, krows, []))
    return tables, medians


def log_pump(results: dict[str, Any]) -> tuple[Table, dict[str, Any]]:
    lp = results.get("log_pump")
    if not lp:
        why = results.get("not_measured", {}).get("log_pump", "not measured")
        return ("6. Log pump", ["—"], [[why]], []), {}
    dn = {st["rate"]: st for st in lp.get("devnull", [])}
    ks = {st["rate"]: st for st in lp.get("kimi-serve", [])}
    sv = {st["rate"]: st for st in lp.get("supervisord", [])}
    rows = []
    verdict: dict[str, Any] = {"steps": []}

    def fmt_rate(x: float) -> str:
        return f"{x / 1000:.0f}k" if x >= 1000 else f"{x:.0f}"

    for rate in sorted(dn, key=lambda r: (r == 0, r)):
        d, k, s = dn[rate], ks.get(rate), sv.get(rate)
        offered = fmt_rate(rate) if rate else f"max ({fmt_rate(d['lines'])} lines)"
        row = [offered, fmt_rate(d["achieved"])]
        for st in (k, s):
            if st is None:
                row += ["—", "—", "—"]
                continue
            ratio = st["achieved"] / d["achieved"]
            blocked = f"{st['eagain']} ({st['blocked_s'] * 1000:.0f} ms)" if st["eagain"] else "0"
            cap = st.get("pipe_capacity") or 0
            fill = (
                f"; pipe {st.get('median_pipe_bytes', 0) // 1024} KiB median, "
                f"{100 * st['peak_pipe_bytes'] / cap:.0f}% of {cap // 1024} KiB peak"
                if cap
                else ""
            )
            achieved = f"{fmt_rate(st['achieved'])} ({ratio:.2f}x)"
            row += [achieved, blocked + fill, f"{100 * st['cpu']:.0f}%"]
        rows.append(row)
        if k is not None:
            ratio = k["achieved"] / d["achieved"]
            verdict["steps"].append(
                {"rate": rate, "ratio": ratio, "eagain": k["eagain"], "cpu": k["cpu"]}
            )
    notes = [
        "A pipe holds capacity / (rate x 152 bytes) of log: kimi-serve grows SGLang's pipes to "
        "1 MiB, 70 ms at 100k lines/s; supervisord keeps the 64 KiB default, 4 ms. A reader "
        "that is not scheduled for longer than that blocks the writer.",
        "One write() per line (as Python's logging writes a record), ~150-byte scheduler "
        "decode-batch lines, on stderr. The writer's stderr is non-blocking, so every write "
        "that would have blocked is counted (EAGAIN) and the time until the pipe took it "
        "is summed.",
        "CPU: the supervisor process alone, % of one core, from the step's start until the "
        "pipe was empty again.",
    ]
    counted = lp.get("kimi-serve-counted")
    written = lp.get("kimi-serve-written")
    if counted is not None and written:
        notes.append(
            f"kimi-serve counted {counted:.0f} of {written} lines written "
            f"(kimi_serve_log_lines_total) and forwarded "
            f"{lp.get('kimi-serve-forwarded', 0)} to its own log (≤ 2000/s)."
        )
    header = ["offered lines/s", "/dev/null"]
    for who in ("kimi-serve", "supervisord"):
        header += [f"{who} (x /dev/null)", f"{who}: writes that would block", f"{who} CPU"]
    return ("6. Log pump: lines/s the child can write", header, rows, notes), verdict


def footprint(results: dict[str, Any]) -> tuple[Table, dict[str, Any]]:
    fp = results.get("footprint")
    rows = []
    out: dict[str, Any] = {}
    if not fp:
        why = results.get("not_measured", {}).get("footprint", "not measured")
        return ("7. Footprint at steady state", ["—"], [[why]], []), out
    for a in (KIMI, SUPERVISORD):
        f = fp.get(a)
        if f is None:
            rows.append([a, "—", "—", "—", _missing(results, a, "footprint")])
            continue
        st = Stat.of(f["rss_mib"])
        assert st is not None
        out[a] = {"rss": st.median, "rss_max": st.hi, "cpu": f["cpu_pct"]}
        if a == KIMI:
            note = (
                f"{f['liveness_probes']:.0f} liveness decode probes, {f['scrapes']} "
                f"/metrics scrapes, {f['watchdog_pings']} WATCHDOG=1"
            )
            if "uss_mib" in f:
                note += f"; USS {f['uss_mib']:.1f} MiB"
        else:
            note = "supervising the same stand-in; no probes"
        rss = f"{st.median:.1f} (max {st.hi:.1f})"
        rows.append([a, rss, f"{f['cpu_pct']:.2f}%", f"{f['seconds']:.0f}", note])
    if KIMI in out and SUPERVISORD in out:
        k, sv = out[KIMI], out[SUPERVISORD]
        cpu = f"{k['cpu'] / sv['cpu']:.1f}x" if sv["cpu"] > 0 else "—"
        rows.append(["kimi-serve ÷ supervisord", f"{k['rss'] / sv['rss']:.1f}x", cpu, "", ""])
    notes = [
        "kimi-serve with production timings: a decode probe every 15 s, WATCHDOG_USEC "
        "30 s (the unit's WatchdogSec), a /metrics scrape every 5 s by the bench. RSS "
        "sampled at each scrape; CPU = user+system time of the process over the window. "
        "The WATCHDOG=1 count is what arrived on the bench's notify socket (the unit file "
        "expects one every 15 s)."
    ]
    header = ["approach", "RSS MiB median", "CPU (one core)", "window s", "activity"]
    return ("7. Footprint at steady state", header, rows, notes), out


def goals(
    ready: dict[str, Stat | None],
    fr: dict[str, tuple[int, int]],
    dd: dict[str, Stat | None],
    lp: dict[str, Any],
    fp: dict[str, Any],
) -> Table:
    rows = []

    def add(goal: str, value: str, ok: Any) -> None:
        # ok: None where the figure is missing, else whether the goal was met.
        rows.append([goal, value, "—" if ok is None else ("met" if ok else "NOT MET")])

    k, bad, d, f = ready.get(KIMI), fr.get(KIMI), dd.get(KIMI), fp.get(KIMI)
    add("readiness lag ≤ 100 ms median", f"{k.median:.1f} ms" if k else "—", k and k.median <= 100)
    add("false ready = 0", f"{bad[0]} of {bad[1]}" if bad else "—", bad and bad[0] == 0)
    add("death detection ≤ 10 ms median", f"{d.median:.1f} ms" if d else "—", d and d.median <= 10)
    steps = [s for s in lp.get("steps", []) if 0 < s["rate"] <= 100_000]
    pump = "log pump ≥ 0.8x /dev/null up to 100k lines/s"
    if steps:
        worst = min(s["ratio"] for s in steps)
        blocked = sum(s["eagain"] for s in steps)
        add(pump, f"worst {worst:.2f}x", worst >= 0.8)
        never = "the child never blocks (up to 100k lines/s)"
        add(never, f"{blocked} blocked writes", blocked == 0)
    else:
        add(pump, "—", None)
    rss = f"{f['rss_max']:.1f} MiB (max)" if f else "—"
    add("daemon RSS ≤ 60 MiB", rss, f and f["rss_max"] <= 60)
    add("daemon CPU ≤ 1% of one core", f"{f['cpu']:.2f}%" if f else "—", f and f["cpu"] <= 1.0)
    return ("Goals", ["goal", "kimi-serve", "verdict"], rows, [])


def all_tables(results: dict[str, Any]) -> list[Table]:
    t1, ready = readiness(results)
    t2, fr = false_ready(results)
    t3, dd = death(results)
    t4 = hang(results)
    t5, _ = recovery(results)
    t6, lp = log_pump(results)
    t7, fp = footprint(results)
    return [goals(ready, fr, dd, lp, fp), t1, t2, t3, t4, *t5, t6, t7]


# ---------------------------------------------------------------------------- rendering


def _widths(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[int]:
    w = [len(h) for h in header]
    for row in rows:
        for i, cell in enumerate(row):
            if i < len(w):
                w[i] = max(w[i], len(cell))
    return w


def text(tables: list[Table]) -> str:
    out = []
    for title, header, rows, notes in tables:
        out.append(title)
        w = _widths(header, rows)
        out.append("  ".join(h.ljust(w[i]) for i, h in enumerate(header)).rstrip())
        out.append("  ".join("-" * x for x in w))
        for row in rows:
            out.append("  ".join(c.ljust(w[i]) for i, c in enumerate(row)).rstrip())
        out.extend(f"  * {n}" for n in notes)
        out.append("")
    return "\n".join(out)


def markdown(tables: list[Table]) -> str:
    out = []
    for title, header, rows, notes in tables:
        out.append(f"### {title}\n")
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "|".join("---" for _ in header) + "|")
        for row in rows:
            cells = [c.replace("|", "\\|") for c in row] + [""] * (len(header) - len(row))
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        out.extend(f"- {n}" for n in notes)
        if notes:
            out.append("")
    return "\n".join(out)
