"""Fleet benchmark: two replicas behind the real sglang-router, load through the router.

    .venv/bin/python -m bench fleet --quick            # about a minute
    .venv/bin/python -m bench fleet --json out.json
    .venv/bin/python -m bench fleet --smoke --only router-2s   # the suite's form (tests/bench)

Approaches, side by side in one run:
- `router-default`: the router's own health checking alone, at its defaults (every 60 s,
  5 s timeout, 3 failures); replicas restarted under it as a supervisor without coupling does
  (SIGTERM, wait for the exit, start again);
- `router-2s`: the same with `--health-check-interval-secs 2`;
- `kimi-serve`: each replica run by `kimi-serve run` with `router.url` set, so it registers
  only when decode-verified and deregisters before every stop. Measured only when the daemon
  carries out the machine's router actions (its `/status` has a `router` section); otherwise
  recorded under `not_measured`.

Per approach, with the load generator (bench.loadgen) running for the whole scenario:
- `planned_restart`: one replica restarted; failed requests, cut streams;
- `broken`: the second replica's launch has the seed incident (healthy by /health, dead on
  its first real decode); requests it received, and how long it stayed in the router's list.
- `hung`: the second replica's decode hangs after a few requests (/health still 200);
  seconds it stays in the list after the hang began, requests failed meanwhile.

Every 2nd request streams (the stand-in answers SGLang's server-sent events) and
`streams_cut` is counted; `--no-streams` sends plain requests only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.common import parser, start_daemon
from bench.loadgen import LoadGenerator
from testkit import DaemonProcess
from testkit.fleet import ListWatch, replica_config, user_arrivals, worker_url
from testkit.router import RouterProcess, free_port
from testkit.standin import Standin

DEFAULT, TWO_S, KIMI = "router-default", "router-2s", "kimi-serve"
APPROACHES = (DEFAULT, TWO_S, KIMI)
# Round robin everywhere: the default cache-aware policy sends prompts with a common prefix to
# one replica, so the replica a scenario is about would see no traffic at all.
POLICY = ["--policy", "round_robin"]
ROUTER_FLAGS: Mapping[str, list[str]] = {
    DEFAULT: POLICY,
    TWO_S: [*POLICY, "--health-check-interval-secs", "2"],
    KIMI: POLICY,
}
MODEL = "/models/kimi-k2.5-int4"


@dataclass(frozen=True)
class Settings:
    quick: bool
    warm_s: float  # load before the event
    after_s: float  # load after the event
    watch_s: float  # how long a broken/hung replica is watched
    concurrency: int
    stream_every: int
    client_timeout: float = 30.0  # a request to a hung replica fails after this

    @classmethod
    def make(cls, quick: bool, streams: bool, smoke: bool = False) -> Settings:
        every = 2 if streams else 0
        if smoke:  # the suite's form: every step runs, too short for figures
            return cls(True, 0.3, 0.5, 2.0, 2, every, client_timeout=3.0)
        if quick:
            return cls(True, 1.0, 2.0, 8.0, 3, every)
        return cls(False, 3.0, 5.0, 70.0, 4, every)


def served(lines: list[str]) -> int:
    """User requests a stand-in served: its access log, less its own warmup decode (one per
    launch, logged the same way)."""
    decodes = sum('"POST /generate' in line for line in lines)
    launches = sum("The server is fired up" in line for line in lines)
    return max(0, decodes - launches)


# ----------------------------------------------------------------------------- replicas


class Replica:
    """One SGLang stand-in, started and restarted by hand (the uncoupled approaches)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.port = free_port()
        # The same decode speed as the coupled replicas (testkit/fleet.py): 16 tokens take
        # 0.3 s, so streams are in flight when a replica is stopped.
        # Every request on arrival, hung ones included (docs/standin.md): what reached it.
        self.request_log = tempfile.mkstemp(prefix="fleet-requests-", suffix=".jsonl")[1]
        self.env = {
            "STANDIN_DECODE_SECONDS_PER_TOKEN": "0.02",
            "STANDIN_REQUEST_LOG": self.request_log,
            **(env or {}),
        }
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Standin | None = None
        self.history: list[str] = []

    def start(self) -> None:
        flags = ["--model-path", MODEL, "--port", str(self.port), "--enable-metrics"]
        self.proc = Standin(flags, self.env, self.port)
        self.proc.wait_ready()

    def lines(self) -> list[str]:
        return [*self.history, *(self.proc.lines if self.proc else [])]

    def restart(self) -> None:
        """SIGTERM, wait for SGLang's drain and exit, start again on the same port."""
        assert self.proc is not None
        self.proc.signal(15)
        self.proc.wait_exit(60)
        self.history += self.proc.lines
        self.proc.cleanup()
        self.start()

    def user_arrivals(self) -> list[float]:
        return user_arrivals({"sglang": {"env": {"STANDIN_REQUEST_LOG": self.request_log}}})

    def cleanup(self) -> None:
        if self.proc is not None:
            self.proc.cleanup()
        with contextlib.suppress(OSError):
            os.unlink(self.request_log)


async def _register(router: RouterProcess, url: str) -> None:
    async with httpx.AsyncClient(trust_env=False) as c:
        r = await c.post(router.url + "/workers", json={"url": url})
        r.raise_for_status()


async def _listed_until(router: RouterProcess, url: str, limit: float) -> float | None:
    """Seconds until `url` leaves the router's list (None: still listed after `limit`)."""
    began = time.monotonic()
    async with httpx.AsyncClient(trust_env=False) as c:
        while time.monotonic() - began < limit:
            r = await c.get(router.url + "/workers")
            if url not in [w["url"] for w in r.json()["workers"]]:
                return time.monotonic() - began
            await asyncio.sleep(0.1)
    return None


async def _load(router: RouterProcess, s: Settings) -> LoadGenerator:
    """The load generator, started, for the whole scenario."""
    return await LoadGenerator(
        router.url, concurrency=s.concurrency, stream_every=s.stream_every, timeout=s.client_timeout
    ).start()


@contextlib.contextmanager
def _fleet(
    approach: str, envs: tuple[Mapping[str, str], Mapping[str, str]]
) -> Iterator[tuple[RouterProcess, list[Replica]]]:
    router = RouterProcess(ROUTER_FLAGS[approach]).start()
    replicas = [Replica(envs[0]), Replica(envs[1])]
    try:
        yield router, replicas
    finally:
        for r in replicas:
            r.cleanup()
        router.cleanup()


# ----------------------------------------------------------------------------- scenarios


async def planned_restart_uncoupled(approach: str, s: Settings) -> dict[str, Any]:
    with _fleet(approach, ({}, {})) as (router, (a, b)):
        for r in (a, b):
            r.start()
            await _register(router, r.url)
        load = await _load(router, s)
        try:
            await asyncio.sleep(s.warm_s)
            load.mark("restart")
            await asyncio.to_thread(b.restart)
            await asyncio.sleep(s.after_s)
        finally:
            stats = await load.stop()
        return {**stats.to_dict(), "served_by_restarted": served(b.lines())}


async def broken_uncoupled(approach: str, s: Settings, fault: dict[str, str]) -> dict[str, Any]:
    # An uncoupled supervisor hands the replica to the router once /health passes.
    with _fleet(approach, ({}, fault)) as (router, (a, b)):
        a.start()
        await _register(router, a.url)
        load = await _load(router, s)
        try:
            await asyncio.sleep(s.warm_s)
            b.start()
            began = load.mark("broken replica added")
            await _register(router, b.url)
            await asyncio.sleep(0.5)
            out_after = await _listed_until(router, b.url, s.watch_s)
        finally:
            stats = await load.stop()
        # From its first decode (seed incident) or the decode after HANG_AFTER (hang): the
        # user requests that reached the broken replica while the router listed it.
        arrivals = b.user_arrivals()
        hang = fault is HANG
        broke = arrivals[HANG_AFTER] if hang and len(arrivals) > HANG_AFTER else began
        return {
            **stats.to_dict(),
            "served_by_broken": len([t for t in arrivals if t >= broke]),
            "listed_s": round(out_after, 2) if out_after is not None else f">{s.watch_s:g}",
            "after_broken": load.stats(since=began).to_dict(),
        }


def _daemon(tmp: Path, router: RouterProcess, env: Mapping[str, str]) -> DaemonProcess:
    """`kimi-serve run` for one replica, with router.url set."""
    tmp.mkdir(parents=True, exist_ok=True)
    return start_daemon(tmp, replica_config(tmp, router.url, env))


def _until(d: DaemonProcess, pred: Callable[[dict[str, Any]], bool], timeout: float = 30) -> None:
    """Until `pred` holds for the daemon's /status."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # OSError: the admin token is written once the daemon has started.
        with contextlib.suppress(httpx.HTTPError, ValueError, OSError):
            if pred(d.status()):
                return
        time.sleep(0.1)
    raise TimeoutError("the daemon did not get there")


def _registered(doc: dict[str, Any]) -> bool:
    return bool((doc.get("router") or {}).get("registered"))


def _in_service(doc: dict[str, Any]) -> bool:
    """Ready and registered with the router."""
    return doc.get("state") == "ready" and _registered(doc)


async def _reached(
    d: DaemonProcess, pred: Callable[[dict[str, Any]], bool], timeout: float = 30
) -> None:
    await asyncio.to_thread(_until, d, pred, timeout)


def _restart(d: DaemonProcess) -> None:
    d.post("/restart").raise_for_status()
    # Out of ready first, so the wait for ready below is for the new launch.
    _until(d, lambda doc: doc.get("state") != "ready", 10)


def _stop(d: DaemonProcess) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        d.stop(30)


class NotIntegrated(RuntimeError):
    pass


async def planned_restart_coupled(s: Settings, tmp: Path) -> dict[str, Any]:
    router = RouterProcess(ROUTER_FLAGS[KIMI]).start()
    daemons = [_daemon(tmp / "a", router, {}), _daemon(tmp / "b", router, {})]
    try:
        for d in daemons:
            await _reached(d, lambda doc: doc.get("state") == "ready")
            if "router" not in daemons[0].status():
                raise NotIntegrated("the daemon's /status has no router section yet")
            await _reached(d, _registered)
        load = await _load(router, s)
        try:
            await asyncio.sleep(s.warm_s)
            load.mark("restart")
            await asyncio.to_thread(_restart, daemons[1])
            await _reached(daemons[1], _in_service)
            await asyncio.sleep(s.after_s)
        finally:
            stats = await load.stop()
        return stats.to_dict()
    finally:
        for d in daemons:
            _stop(d)
        router.cleanup()


SEED = {"STANDIN_FAULT": "seed-incident", "STANDIN_CRASH_SLEEP_SECONDS": "65"}
HANG_AFTER = 20
HANG = {"STANDIN_FAULT": "decode-hang", "STANDIN_HANG_AFTER_DECODES": str(HANG_AFTER)}
# Under kimi-serve the fault is the first launch's: the replica it restarts is sound.
FIRST = {"STANDIN_FAULT_LAUNCH": "1"}


def _arrivals(cfg: Mapping[str, Any]) -> list[float]:
    """Every /generate that reached the replica (probes too), in order of arrival."""
    path = Path(cfg["sglang"]["env"]["STANDIN_REQUEST_LOG"])
    lines = path.read_text().splitlines() if path.exists() else []
    return sorted(json.loads(line)["t"] for line in lines)


async def broken_coupled(s: Settings, tmp: Path, fault: Mapping[str, str]) -> dict[str, Any]:
    """The second replica's first launch is broken (seed incident) or hangs after HANG_AFTER
    decodes; kimi-serve runs both. Counted: user requests that reached the broken launch, and
    seconds it stayed listed once broken."""
    router = RouterProcess(ROUTER_FLAGS[KIMI]).start()
    hang = fault is HANG
    a = _daemon(tmp / "a", router, {})
    b: DaemonProcess | None = None
    try:
        await _reached(a, _registered)
        with ListWatch(router.url) as watch:
            load = await _load(router, s)
            try:
                await asyncio.sleep(s.warm_s)
                began = load.mark("broken replica started")
                b = _daemon(tmp / "b", router, {**fault, **FIRST})
                # Sound again: the second launch is decode-verified and registered.
                limit = s.watch_s + 60
                await _reached(b, lambda doc: bool(doc.get("restarts")) and _in_service(doc), limit)
                verified = float(b.status()["since"])  # when it entered ready
                await asyncio.sleep(s.after_s)
            finally:
                stats = await load.stop()
        url = worker_url(b.cfg)
        if hang:
            # The hang begins with the decode after HANG_AFTER (probes count); it ends when
            # the router stops listing the replica.
            every = _arrivals(b.cfg)
            broke = every[HANG_AFTER] if len(every) > HANG_AFTER else began
            out = watch.first_unlisted_after(url, broke)
            end = out if out is not None else verified
            listed_s = end - broke
        else:
            # Broken from its first decode until its second launch is decode-verified: what
            # the router listed meanwhile.
            broke, end = began, verified
            listed = [at for at, urls in watch.history if broke <= at < end and url in urls]
            listed_s = (end - listed[0]) if listed else 0.0
        reached = [t for t in user_arrivals(b.cfg) if broke <= t < end]
        return {
            **stats.to_dict(),
            "served_by_broken": len(reached),
            "listed_s": round(listed_s, 2),
            "verified_after_s": round(verified - began, 2),
        }
    finally:
        for d in (a, b):
            if d is not None:
                _stop(d)
        router.cleanup()


async def run(s: Settings, only: tuple[str, ...]) -> dict[str, Any]:
    results: dict[str, Any] = {"settings": s.__dict__, "not_measured": {}}
    for approach in only:
        out: dict[str, Any] = {}
        try:
            if approach == KIMI:
                with tempfile.TemporaryDirectory(prefix="kimi-fleet-") as tmp:
                    out["planned_restart"] = await planned_restart_coupled(s, Path(tmp))
                    out["broken"] = await broken_coupled(s, Path(tmp) / "seed", SEED)
                    out["hung"] = await broken_coupled(s, Path(tmp) / "hang", HANG)
            else:
                out["planned_restart"] = await planned_restart_uncoupled(approach, s)
                out["broken"] = await broken_uncoupled(approach, s, SEED)
                out["hung"] = await broken_uncoupled(approach, s, HANG)
        except Exception as exc:
            results["not_measured"][approach] = f"{type(exc).__name__}: {exc}"[:300]
        results[approach] = out
        print(f"{approach}: {json.dumps(out)}", file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = parser("fleet", __doc__, json_out=True)
    p.add_argument("--quick", action="store_true", help="short scenarios (about a minute)")
    p.add_argument("--smoke", action="store_true", help="shorter still: the suite's form")
    streams = argparse.BooleanOptionalAction
    p.add_argument("--streams", action=streams, default=True, help="every 2nd request streams")
    p.add_argument("--only", default=",".join(APPROACHES))
    args = p.parse_args(argv)
    only = tuple(a for a in args.only.split(",") if a)
    results = asyncio.run(run(Settings.make(args.quick, args.streams, args.smoke), only))
    text = json.dumps(results, indent=2, default=str)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
