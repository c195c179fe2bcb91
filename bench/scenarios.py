"""The measurements. Each function runs one approach through one scenario and returns raw
samples (wall-clock times); bench/report.py turns them into the tables.

What `bind` and `decode` (can serve), ready reported and death noticed are for each approach:
docs/benchmarks.md, "What is compared" and "Definitions". Death noticed is kimi-serve's "state"
event (ready -> restarting), supervisord's "exited:" log line, systemd's ActiveExitTimestamp,
the poller's relist that found the process gone; `dead` is when the killed process had
actually exited (a pidfd the bench holds).
"""

from __future__ import annotations

import contextlib
import itertools
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench import supervisord as sv_mod
from bench.common import (
    PYTHON,
    REPO_ROOT,
    BenchError,
    Lines,
    NotifySocket,
    Observer,
    Procs,
    Sampler,
    at,
    cpu_seconds,
    is_ready_msg,
    kill_now,
    state_is,
    wait_until,
)
from bench.kimi import KimiServe, bench_config, launch_spec
from bench.observe import url_status
from bench.systemd_box import SystemdBox

KIMI, SUPERVISORD, SYSTEMD, POLLER = "kimi-serve", "supervisord", "systemd", "health-poller"
APPROACHES = (KIMI, SUPERVISORD, SYSTEMD, POLLER)


@dataclass(frozen=True)
class Settings:
    """The full run's sizes; `tiny()` the --quick ones."""

    quick: bool = False
    load_s: float = 2.0  # STANDIN_LOAD_SECONDS
    warmup_s: float = 1.0  # STANDIN_WARMUP_SECONDS
    cycles: int = 8  # kills per approach (phase A)
    poller_cycles: int = 3
    poller_period: float = 10.0
    false_ready_trials: int = 3
    hang_trials: int = 3
    hang_window: float = 20.0  # how long a baseline is watched after a hang began
    hang_after: int = 30  # STANDIN_HANG_AFTER_DECODES: decodes served before every decode hangs
    hang_liveness: dict[str, Any] = field(
        default_factory=lambda: {"interval": "1s", "timeout": "1s", "failure_threshold": 3}
    )
    footprint_s: float = 150.0
    scrape_every: float = 5.0
    flood_plan: str = "10000:2,50000:2,100000:2,200000:2,0:1"
    flood_max_lines: int = 300_000
    flood_gap: float = 0.5  # quiet seconds between the log writer's steps
    broken_timeout: float = 3.0  # a decode slower than this counts as broken (false-ready check)

    @classmethod
    def tiny(cls) -> Settings:
        return cls(
            True, 0.3, 0.1, 2, 1, 1.0, 1, 1, 2.0, 10,
            {"interval": "0.5s", "timeout": "0.5s", "failure_threshold": 2},
            2.0, 1.0, "10000:0.3,100000:0.3,0:1", 20_000, 0.2, 1.0,
        )  # fmt: skip


@dataclass
class Ctx:
    procs: Procs
    root: Path
    s: Settings
    box: SystemdBox | None = None
    progress: Callable[[str], None] = print
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def dir(self, name: str, base: Path | None = None) -> Path:
        d = (base or self.root) / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def say(self, text: str) -> None:
        with self._lock:
            self.progress(text)


def _hang_env(s: Settings) -> dict[str, str]:
    return {"STANDIN_FAULT": "decode-hang", "STANDIN_HANG_AFTER_DECODES": str(s.hang_after)}


SEED_INCIDENT = {"STANDIN_FAULT": "seed-incident"}


def _cfg(ctx: Ctx, work: Path, **kw: Any) -> dict[str, Any]:
    """The bench's kimi-serve config at this run's stand-in sizes."""
    return bench_config(work, load_s=ctx.s.load_s, warmup_s=ctx.s.warmup_s, **kw)


def _standin(ctx: Ctx, work: Path, env: dict[str, str] | None) -> tuple[Any, int]:
    """The stand-in of `work` as kimi-serve would launch it (argv, env), and its port."""
    cfg = _cfg(ctx, work, env=env)
    return launch_spec(cfg, work), int(cfg["sglang"]["port"])


def _supervisord(
    ctx: Ctx, work: Path, env: dict[str, str] | None = None
) -> tuple[sv_mod.Supervisord, int]:
    """A supervisord (not started) over the stand-in of `work`, and the stand-in's port."""
    spec, port = _standin(ctx, work, env)
    return sv_mod.Supervisord(ctx.procs, work / "sv", spec.argv, dict(spec.env)), port


def _unit(ctx: Ctx, name: str, unit: str, env: dict[str, str] | None = None) -> int:
    """Install `unit` in the box over the stand-in of the box's `name` directory: its port."""
    assert ctx.box is not None
    # Only the box's own directory is visible inside it (it masks /tmp): the stand-in's launch
    # counter and model path must live there.
    spec, port = _standin(ctx, ctx.dir(name, ctx.box.box.workdir), env)
    ctx.box.install(unit, spec.argv, dict(spec.env), REPO_ROOT)
    return port


def _readiness(when: str, r: dict[str, float], ready: float, **extra: Any) -> dict[str, Any]:
    return {"when": when, "bind": r["bind"], "decode": r["decode"], "ready": ready, **extra}


# In the cycles the serving watcher is started right after the kill, not before: its
# millisecond connect loop would otherwise compete for the CPU at the very moment a supervisor
# should notice the death (it still starts long before the next server can bind).


def _settle(ctx: Ctx, decode_at: float) -> None:
    """Let the stand-in finish its warmup before the next kill: kill a steady server."""
    time.sleep(max(0.0, decode_at + ctx.s.warmup_s + 0.3 - time.time()))


def _first(events: list[dict[str, Any]], pred: Callable[[dict[str, Any]], bool]) -> float:
    for e in events:
        if pred(e):
            return at(e)
    return float("nan")


def _named(name: str) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e.get("event") == name


# ====================================================================== phase A: cycles


RECOVERY_STEPS = ("detect", "stop", "backoff", "cleaning", "relaunch", "load", "port_seen")
RECOVERY_STEPS += ("probe", "notify")


def kimi_cycles(ctx: Ctx) -> dict[str, Any]:
    """Start, then kill SGLang `cycles` times: readiness, death detection, recovery."""
    s = ctx.s
    work = ctx.dir("kimi-cycles")
    ns = NotifySocket(work / "notify.sock")
    ks = KimiServe(ctx.procs, work, _cfg(ctx, work), ns)
    out: dict[str, Any] = {"readiness": [], "death": [], "recovery": []}
    try:
        obs = Observer(ctx.procs, ks.port, fresh=False, readyz=ks.admin + "/readyz")
        t0 = time.time()
        ks.start()
        ks.wait_state("ready", 90)
        r = obs.served(30)
        ready = ns.wait(is_ready_msg, t0, 10)
        if ready is None:
            raise BenchError("kimi-serve reached ready but no READY=1 arrived")
        out["readiness"].append(_readiness("start", r, ready[0], readyz=r["readyz"]))
        for i in range(s.cycles):
            _settle(ctx, r["decode"])
            pid = ks.child_pid()
            start = len(ks.lines or [])
            t_kill, death = kill_now(ctx.procs, pid)
            obs = Observer(ctx.procs, ks.port, readyz=ks.admin + "/readyz")
            ks.wait_state("ready", 90, start)
            r = obs.served(30)
            dead = death(10)
            ready = ns.wait(is_ready_msg, t_kill, 10)
            status = ns.wait(lambda m: m.startswith("STATUS=restarting"), t_kill, 10)
            if ready is None or status is None:
                raise BenchError("kimi-serve sent no STATUS=restarting / READY=1 after a kill")
            assert ks.lines is not None
            evs = ks.lines.events[start:]
            st = {k: _first(evs, state_is(k)) for k in ("restarting", "cleaning", "launching")}
            st |= {k: _first(evs, state_is(k)) for k in ("loading", "warming", "ready")}
            restarting = st["restarting"]
            out["death"].append(
                {
                    "kill": t_kill,
                    "dead": dead,
                    "noticed": restarting,
                    "exited_log": _first(evs, _named("sglang exited")),
                    "status_datagram": status[0],
                }
            )
            # The kill, each step of the recovery in order, READY=1: a step is the gap before it.
            gone = _first(evs, _named("sglang restart"))
            marks = (t_kill, restarting, gone, st["cleaning"], st["launching"], st["loading"])
            marks += (r["bind"], st["warming"], st["ready"], ready[0])
            gaps = [b - a for a, b in itertools.pairwise(marks)]
            steps = dict(zip(RECOVERY_STEPS, gaps, strict=True))
            total = {"total": ready[0] - t_kill, "serving": r["decode"] - t_kill}
            out["recovery"].append(steps | total)
            out["readiness"].append(_readiness("restart", r, ready[0], readyz=r["readyz"]))
            ctx.say(
                f"  kimi-serve kill {i + 1}/{s.cycles}: noticed {(restarting - t_kill) * 1000:.1f}"
                f" ms, ready again {ready[0] - t_kill:.2f} s"
            )
    finally:
        out["left_behind"] = ks.stop()
        ns.close()
    return out


Recovered = tuple[float, float, float, dict[str, float], str, float]


def _kill_cycles(
    ctx: Ctx,
    who: str,
    n: int,
    port: int,
    r: dict[str, float],
    out: dict[str, Any],
    victim: Callable[[], tuple[int, Any]],
    recovered: Callable[[float, Any, Observer], Recovered],
    prefix: Sequence[str] = (),
) -> None:
    """`n` kills of a baseline's server, each to readiness reported again: `victim()` gives the
    pid and where to look from, `recovered(kill time, that, watcher)` the times noticed,
    respawned and ready, the watcher's result and the baseline's own ready step."""
    for i in range(n):
        _settle(ctx, r["decode"])
        pid, since = victim()
        t_kill, death = kill_now(ctx.procs, pid)
        obs = Observer(ctx.procs, port, prefix=prefix)
        noticed, spawned, ready, r, ready_key, ready_after = recovered(t_kill, since, obs)
        out["death"].append({"kill": t_kill, "dead": death(10), "noticed": noticed})
        out["recovery"].append(
            {
                "detect": noticed - t_kill,
                "respawn": spawned - noticed,
                "load": r["bind"] - spawned,
                ready_key: ready_after,
                "total": ready - t_kill,
                "serving": r["decode"] - t_kill,
            }
        )
        out["readiness"].append(_readiness("restart", r, ready))
        ctx.say(
            f"  {who} kill {i + 1}/{n}: noticed {(noticed - t_kill) * 1000:.1f} ms, "
            f"ready again {ready - t_kill:.2f} s"
        )


def supervisord_cycles(ctx: Ctx) -> dict[str, Any]:
    sv, port = _supervisord(ctx, ctx.dir("supervisord-cycles"))
    out: dict[str, Any] = {"readiness": [], "death": [], "recovery": []}

    def victim() -> tuple[int, int]:
        return sv.child_pid(), len(sv.log or [])

    def recovered(_t_kill: float, start: int, obs: Observer) -> Recovered:
        _, t_exit, _ = sv.wait(sv_mod.EXITED, 10, start)
        _, t_spawn, _ = sv.wait(sv_mod.SPAWNED, 10, start)
        _, t_run, _ = sv.wait(sv_mod.RUNNING, 30, start)
        return t_exit, t_spawn, t_run, obs.served(30), "startsecs", t_run - t_spawn

    try:
        obs = Observer(ctx.procs, port, fresh=False)
        sv.start()
        _, t_run, _ = sv.wait(sv_mod.RUNNING, 60)
        r = obs.served(60)
        out["readiness"].append(_readiness("start", r, t_run))
        _kill_cycles(ctx, "supervisord", ctx.s.cycles, port, r, out, victim, recovered)
        out["rss_mib"] = psutil.Process(sv.pid).memory_info().rss / 2**20
    finally:
        sv.stop()
    return out


def systemd_cycles(ctx: Ctx) -> dict[str, Any]:
    box = ctx.box
    assert box is not None
    unit = "standin-cycles.service"
    port = _unit(ctx, "systemd-cycles", unit)
    out: dict[str, Any] = {"readiness": [], "death": [], "recovery": []}

    def victim() -> tuple[int, float]:
        return box.main_host_pid(unit), box.times(unit)["restarts"] or 0.0

    def recovered(t_kill: float, restarts: float, obs: Observer) -> Recovered:
        r = obs.served(30)
        t = box.wait_restarted(unit, restarts, t_kill, 30)
        exited, started, active = t["noticed"], t["started"], t["active"]
        assert exited is not None and started is not None and active is not None
        return exited, started, active, r, "ready_after_spawn", active - started

    try:
        obs = Observer(ctx.procs, port, fresh=False, prefix=box.prefix)
        box.start(unit)
        r = obs.served(60)
        active = box.times(unit)["active"]
        assert active is not None
        out["readiness"].append(_readiness("start", r, active))
        _kill_cycles(ctx, "systemd", ctx.s.cycles, port, r, out, victim, recovered, box.prefix)
    finally:
        with contextlib.suppress(Exception):
            box.stop_unit(unit)
    return out


class PollerRun:
    """One bench/poller.py process (with its own stand-in)."""

    def __init__(
        self, ctx: Ctx, work: Path, env: dict[str, str] | None = None, seed: int = 0
    ) -> None:
        spec, self.port = _standin(ctx, work, env)
        poller = [PYTHON, "-m", "bench.poller", "--port", str(self.port), "--seed", str(seed)]
        self.proc = ctx.procs.start(
            [*poller, "--period", str(ctx.s.poller_period), "--", *spec.argv],
            env=dict(spec.env),
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines = Lines(self.proc.stdout)
        self.procs = ctx.procs

    def wait(
        self, name: str, timeout: float, start: int = 0, launch: int | None = None
    ) -> tuple[int, dict[str, Any]]:
        return self.lines.wait(
            lambda e: e.get("event") == name and (launch is None or e.get("launch") == launch),
            timeout,
            start,
        )

    def child(self) -> tuple[int, int]:
        spawned = self.lines.find(_named("spawned"))
        return int(spawned[-1]["pid"]), int(spawned[-1]["launch"])

    def stop(self) -> None:
        self.procs.stop(self.proc, timeout=10)


def poller_cycles(ctx: Ctx) -> dict[str, Any]:
    s = ctx.s
    out: dict[str, Any] = {"readiness": [], "death": [], "recovery": []}
    wait_s = s.load_s + s.poller_period + 30
    pr = PollerRun(ctx, ctx.dir("poller-cycles"), seed=1)

    def victim() -> tuple[int, tuple[int, int]]:
        pid, launch = pr.child()
        return pid, (launch, len(pr.lines))

    def recovered(_t_kill: float, since: tuple[int, int], obs: Observer) -> Recovered:
        launch, start = since
        _, died = pr.wait("died", 30, start)
        _, spawned = pr.wait("spawned", 30, start)
        _, ready = pr.wait("ready", wait_s, start, launch=launch + 1)
        r = obs.served(wait_s)
        return died["t"], spawned["t"], ready["t"], r, "ready_after_bind", ready["t"] - r["bind"]

    try:
        obs = Observer(ctx.procs, pr.port, fresh=False)
        _, ev = pr.wait("ready", wait_s)
        r = obs.served(wait_s)
        out["readiness"].append(_readiness("start", r, ev["t"]))
        _kill_cycles(ctx, "poller", s.poller_cycles, pr.port, r, out, victim, recovered)
    finally:
        pr.stop()
    return out


# ====================================================================== log pump


def _flood_env(ctx: Ctx, result: Path) -> dict[str, str]:
    return {
        "BENCH_FLOOD_PLAN": ctx.s.flood_plan,
        "BENCH_FLOOD_RESULT": str(result),
        "BENCH_FLOOD_MAX_LINES": str(ctx.s.flood_max_lines),
        "BENCH_FLOOD_GAP": str(ctx.s.flood_gap),
    }


def _flood_steps_cpu(ctx: Ctx, result: Path, pid: int) -> list[dict[str, Any]]:
    """The writer's steps, each with the supervisor's CPU share from its start to drained."""
    proc = psutil.Process(pid)
    cpu = Sampler(lambda: cpu_seconds(proc), clock=time.time)
    steps = _flood_steps(result, _plan_seconds(ctx))
    cpu.stop()
    for step in steps:
        step["cpu"] = cpu.between(step["start"], step["drained"]) / (
            step["drained"] - step["start"]
        )
    return steps


def _flood_steps(result: Path, timeout: float) -> list[dict[str, Any]]:
    import json

    wait_until(
        lambda: result.exists() and '"done"' in result.read_text(),
        timeout,
        0.1,
        "the log writer finished its plan",
    )
    return [d for d in map(json.loads, result.read_text().splitlines()) if "rate" in d]


def _plan_seconds(ctx: Ctx) -> float:
    return sum(float(p.split(":")[1]) + ctx.s.flood_gap for p in ctx.s.flood_plan.split(",")) + 30


def log_pump(ctx: Ctx, with_supervisord: bool) -> dict[str, Any]:
    """Lines a second the child can write: to /dev/null, through kimi-serve, through
    supervisord; whether its writes ever blocked; the supervisor's CPU meanwhile."""
    work = ctx.dir("log-pump")
    out: dict[str, Any] = {}
    # /dev/null: the writer alone.
    result = work / "devnull.jsonl"
    proc = ctx.procs.start([PYTHON, "-m", "bench.flood", "--exit"], env=_flood_env(ctx, result))
    proc.wait(_plan_seconds(ctx))
    out["devnull"] = _flood_steps(result, 5)
    ctx.say("  log pump: /dev/null done")

    # kimi-serve: the writer is launched in SGLang's place.
    kwork = ctx.dir("kimi", work)
    result = kwork / "steps.jsonl"
    cfg = _cfg(ctx, kwork, env=_flood_env(ctx, result))
    cfg["sglang"]["module"] = "bench.flood"
    cfg["sglang"]["args"] = {}
    cfg["readiness"]["load_timeout"] = "30m"
    ks = KimiServe(ctx.procs, kwork, cfg)
    try:
        ks.start()
        ks.wait_state("loading", 60)
        out["kimi-serve"] = steps = _flood_steps_cpu(ctx, result, ks.pid)
        metrics = _get(ks.admin + "/metrics")
        out["kimi-serve-counted"] = _metric(metrics, 'kimi_serve_log_lines_total{stream="stderr"}')
        out["kimi-serve-written"] = sum(st["lines"] for st in steps)
        out["kimi-serve-forwarded"] = ks.lines.skipped if ks.lines else 0
    finally:
        ks.stop()
    ctx.say("  log pump: kimi-serve done")

    if with_supervisord:
        swork = ctx.dir("supervisord", work)
        result = swork / "steps.jsonl"
        sv = sv_mod.Supervisord(
            ctx.procs, swork, [str(PYTHON), "-m", "bench.flood"], _flood_env(ctx, result)
        )
        try:
            sv.start()
            sv.wait(sv_mod.SPAWNED, 30)
            out["supervisord"] = _flood_steps_cpu(ctx, result, sv.pid)
        finally:
            sv.stop()
        ctx.say("  log pump: supervisord done")
    return out


def _get(url: str) -> str:
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=5) as r:
        return str(r.read().decode())


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return float("nan")


# ====================================================================== phase B


def kimi_hang(ctx: Ctx) -> dict[str, Any]:
    """decode-hang on every launch: user traffic finds the hang, kimi-serve's liveness
    decode probe must restart SGLang while /health stays 200."""
    s = ctx.s
    work = ctx.dir("kimi-hang")
    cfg = _cfg(ctx, work, liveness=s.hang_liveness, env=_hang_env(s))
    # A hung request keeps SGLang's SIGTERM drain waiting forever; do not wait long at the end.
    cfg["stop"]["drain_timeout"] = "1s"
    ks = KimiServe(ctx.procs, work, cfg)
    trials: list[dict[str, Any]] = []
    try:
        ks.start()
        start = 0
        for _ in range(s.hang_trials):
            start, _ = ks.wait_state("ready", 90, start)
            obs = Observer(ctx.procs, ks.port, fresh=False, mode="hang", window=0)
            onset = float(obs.event("onset", timeout=60)["t"])
            obs.close()
            start, ev = ks.wait_state("restarting", 120, start)
            trials.append({"onset": onset, "noticed": at(ev), "reason": ev["reason"]})
            ctx.say(
                f"  kimi-serve hang: restart ({ev['reason']}) "
                f"{at(ev) - onset:.2f} s after the hang began"
            )
    finally:
        ks.stop()
    return {"trials": trials, "liveness": s.hang_liveness}


def kimi_false_ready(ctx: Ctx) -> dict[str, Any]:
    """seed-incident on every launch: /health is fine, the first real decode kills the
    scheduler. kimi-serve must never say ready; each launch it judges is one trial."""
    s = ctx.s
    work = ctx.dir("kimi-false-ready")
    ns = NotifySocket(work / "notify.sock")
    ks = KimiServe(ctx.procs, work, _cfg(ctx, work, env=SEED_INCIDENT), ns)
    verdicts: list[dict[str, Any]] = []
    poller = None
    try:
        t0 = time.time()
        ks.start()
        poller = Sampler(lambda: url_status(ks.admin + "/readyz", 1.0), interval=0.05)
        start = 0
        for _ in range(s.false_ready_trials):
            start, ev = ks.wait_state("restarting", 120, start)
            assert ks.lines is not None
            # The port opened (warming) before the probe found the launch broken.
            warming = [e for e in ks.lines.events[:start] if state_is("warming")(e)]
            opened = at(warming[-1]) if warming else None
            verdicts.append({"reason": ev["reason"], "at": at(ev), "warming": opened})
            start += 1
        poller.stop()
        ready_msgs = ns.count(is_ready_msg, t0)
        ready_states = len(ks.lines.find(state_is("ready"))) if ks.lines else 0
    finally:
        if poller is not None:
            poller.stop()
        ks.stop()
        ns.close()
    statuses = [v for _, v in poller.samples if v is not None]
    readyz_200, polls = statuses.count(200), len(statuses)
    ctx.say(
        f"  kimi-serve false ready: {ready_msgs} READY=1 over {len(verdicts)} broken "
        f"launches, /readyz 200 {readyz_200}/{polls}"
    )
    # Every launch is broken, so any ready at all is a false one.
    return {
        "trials": len(verdicts),
        "false_ready": max(ready_msgs, ready_states),
        "ready_datagrams": ready_msgs,
        "ready_states": ready_states,
        "readyz_200": readyz_200,
        "readyz_polls": polls,
        "verdicts": verdicts,
    }


def _broken_check(ctx: Ctx, port: int, prefix: Sequence[str] = ()) -> dict[str, Any]:
    timeout = ctx.s.broken_timeout
    obs = Observer(
        ctx.procs, port, fresh=False, mode="broken", decode_timeout=timeout, prefix=prefix
    )
    try:
        return obs.event("verdict", timeout=70)
    finally:
        obs.close()


def _fr_trial(ready: float | None, verdict: dict[str, Any], still_ready: bool) -> dict[str, Any]:
    """One broken launch under a baseline: was it (still) called ready while a decode failed."""
    return {
        "ready": ready,
        "decode_ok": verdict["decode_ok"],
        "still_ready": still_ready,
        "detail": verdict["detail"],
    }


def _watch_hang(ctx: Ctx, port: int, prefix: Sequence[str] = ()) -> tuple[float, dict[str, Any]]:
    """A baseline under the decode hang: the onset, and the watcher's `window` event once it
    had watched for `hang_window` seconds after it."""
    obs = Observer(
        ctx.procs, port, fresh=False, mode="hang", window=ctx.s.hang_window, prefix=prefix
    )
    onset = float(obs.event("onset", timeout=70)["t"])
    window = obs.event("window", timeout=ctx.s.hang_window + 30)
    obs.close()
    return onset, window


def _faults(
    ctx: Ctx,
    who: str,
    trial: Callable[[int], dict[str, Any]],
    hang: Callable[[], tuple[float, dict[str, Any], bool]],
    seen: str = "restarted",
) -> dict[str, Any]:
    """A baseline's false-ready trials (`trial(i)`: one broken launch each) and its hang trial
    (`hang()`: the onset, the watcher's `window` event, whether it was detected)."""
    false_ready = [trial(i) for i in range(ctx.s.false_ready_trials)]
    bad = sum(1 for t in false_ready if not t["decode_ok"] and t["still_ready"])
    ctx.say(f"  {who} false ready: {bad}/{len(false_ready)}")
    onset, window, detected = hang()
    watched = window["t"] - onset
    ctx.say(f"  {who} hang: {seen if detected else 'not noticed'} in {watched:.0f} s")
    hung = {"onset": onset, "detected": detected, "watched_s": watched}
    hung |= {k: window[k] for k in ("health", "decode_ok_at_end")}
    return {"false_ready": false_ready, "hang": [hung]}


def supervisord_faults(ctx: Ctx) -> dict[str, Any]:
    """False ready (seed-incident) and hang (decode-hang) under supervisord."""

    def exits(sv: sv_mod.Supervisord) -> list[float]:
        assert sv.log is not None
        return [t for t, text in sv.log.events if sv_mod.EXITED in text]

    def trial(i: int) -> dict[str, Any]:
        sv, port = _supervisord(ctx, ctx.dir(f"supervisord-false-ready-{i}"), SEED_INCIDENT)
        try:
            sv.start()
            _, t_run, _ = sv.wait(sv_mod.RUNNING, 60)
            verdict = _broken_check(ctx, port)
            exited_before = any(t <= verdict["t"] for t in exits(sv))
            return _fr_trial(t_run, verdict, not exited_before)
        finally:
            sv.stop()

    def hang() -> tuple[float, dict[str, Any], bool]:
        sv, port = _supervisord(ctx, ctx.dir("supervisord-hang"), _hang_env(ctx.s))
        try:
            sv.start()
            sv.wait(sv_mod.RUNNING, 60)
            onset, window = _watch_hang(ctx, port)
            return onset, window, any(t > onset for t in exits(sv))
        finally:
            sv.stop()

    return _faults(ctx, "supervisord", trial, hang)


def systemd_faults(ctx: Ctx) -> dict[str, Any]:
    box = ctx.box
    assert box is not None

    def trial(i: int) -> dict[str, Any]:
        unit = f"standin-false-ready-{i}.service"
        port = _unit(ctx, f"systemd-false-ready-{i}", unit, SEED_INCIDENT)
        try:
            box.start(unit)
            active = box.times(unit)["active"]
            verdict = _broken_check(ctx, port, box.prefix)
            state = box.show(unit, "ActiveState", "NRestarts")
            still = state.get("ActiveState") == "active" and state.get("NRestarts") == "0"
            return _fr_trial(active, verdict, still)
        finally:
            box.stop_unit(unit)

    def hang() -> tuple[float, dict[str, Any], bool]:
        unit = "standin-hang.service"
        port = _unit(ctx, "systemd-hang", unit, _hang_env(ctx.s))
        try:
            box.start(unit)
            onset, window = _watch_hang(ctx, port, box.prefix)
            t = box.times(unit)
        finally:
            box.stop_unit(unit)
        return onset, window, bool(t["restarts"]) or (t["noticed"] or 0) > onset

    return _faults(ctx, "systemd", trial, hang)


def poller_faults(ctx: Ctx) -> dict[str, Any]:
    wait_s = ctx.s.load_s + ctx.s.poller_period + 30

    def gave_up(pr: PollerRun) -> list[float]:
        return [e["t"] for e in pr.lines.find(lambda e: e.get("event") in ("unready", "died"))]

    def trial(i: int) -> dict[str, Any]:
        pr = PollerRun(ctx, ctx.dir(f"poller-false-ready-{i}"), SEED_INCIDENT, seed=10 + i)
        try:
            _, ready = pr.wait("ready", wait_s)
            verdict = _broken_check(ctx, pr.port)
            unready = any(t <= verdict["t"] for t in gave_up(pr))
            return _fr_trial(ready["t"], verdict, not unready)
        finally:
            pr.stop()

    def hang() -> tuple[float, dict[str, Any], bool]:
        pr = PollerRun(ctx, ctx.dir("poller-hang"), seed=20, env=_hang_env(ctx.s))
        try:
            pr.wait("ready", wait_s)
            onset, window = _watch_hang(ctx, pr.port)
            return onset, window, any(t > onset for t in gave_up(pr))
        finally:
            pr.stop()

    return _faults(ctx, "poller", trial, hang, "noticed")


LIVENESS_OK = 'kimi_serve_probe_duration_seconds_count{kind="liveness",outcome="ok"}'


def footprint(ctx: Ctx, with_supervisord: bool) -> dict[str, Any]:
    """Steady state: production liveness (a decode probe every 15 s, WATCHDOG=1 at 15 s), a
    /metrics scrape every 5 s; RSS and CPU of the daemon, beside supervisord's."""
    s = ctx.s
    work = ctx.dir("footprint")
    ns = NotifySocket(work / "notify.sock")
    kwork = ctx.dir("kimi", work)
    ks = KimiServe(ctx.procs, kwork, _cfg(ctx, kwork), ns, env={"WATCHDOG_USEC": "30000000"})
    sv = None
    out: dict[str, Any] = {}
    try:
        ks.start()
        if with_supervisord:
            sv = _supervisord(ctx, ctx.dir("supervisord", work))[0].start()
            sv.wait(sv_mod.RUNNING, 60)
        ks.wait_state("ready", 90)
        time.sleep(s.load_s + s.warmup_s + (5.0 if not s.quick else 0.5))
        targets = {KIMI: psutil.Process(ks.pid)}
        if sv is not None:
            targets[SUPERVISORD] = psutil.Process(sv.pid)
        cpu0 = {k: cpu_seconds(p) for k, p in targets.items()}
        t0 = time.time()
        liveness0 = _metric(_get(ks.admin + "/metrics"), LIVENESS_OK)
        rss: dict[str, list[float]] = {k: [] for k in targets}
        watchdog0 = ns.count(lambda m: m == "WATCHDOG=1")
        scrapes = 0
        while time.time() - t0 < s.footprint_s:
            _get(ks.admin + "/metrics")
            scrapes += 1
            for k, p in targets.items():
                rss[k].append(p.memory_info().rss / 2**20)
            time.sleep(max(0.0, t0 + scrapes * s.scrape_every - time.time()))
        t1 = time.time()
        cpu1 = {k: cpu_seconds(p) for k, p in targets.items()}
        liveness1 = _metric(_get(ks.admin + "/metrics"), LIVENESS_OK)
        for k in targets:
            used, span = cpu1[k] - cpu0[k], t1 - t0
            out[k] = {"rss_mib": rss[k], "cpu_s": used, "seconds": span}
            out[k]["cpu_pct"] = 100 * used / span
        with contextlib.suppress(psutil.Error):
            out[KIMI]["uss_mib"] = targets[KIMI].memory_full_info().uss / 2**20
        out[KIMI]["liveness_probes"] = liveness1 - liveness0
        out[KIMI]["scrapes"] = scrapes
        out[KIMI]["watchdog_pings"] = ns.count(lambda m: m == "WATCHDOG=1") - watchdog0
        out["processes_on_host"] = len(psutil.pids())
    finally:
        if sv is not None:
            sv.stop()
        ks.stop()
        ns.close()
    return out
