"""The last known good (LKG) of each profile, kept and compared (docs/quality.md, "Trials and
the last known good"). The decisions are the machine's (core/upgrade_rules.py); this module
reads and writes what they need.

- `Print`: what a launch is, for the comparison: the SGLang interpreter and the version it
  reports, the model files' content identity (and the draft model's), argv and env (the
  additions the config makes; never the per-launch variables the process owner adds).
- The store: `<state_dir>/upgrade/lkg.json`, one print per profile with its gate readings,
  written in one step (quality/golden.py's atomic JSON). The service user, and so SGLang, can
  write that file: it is read for the comparison and the readings, never as a command to run.
- The rollback's command comes from a root-owned source only: the `LaunchSpec` this daemon
  built from its own configuration when the launch became the LKG (kept in memory and carried
  across a hand-over), or, after a restart of the daemon, the current configuration when it
  builds exactly the stored command. Otherwise a rollback is refused and the trial is held.
- Before a rollback is allowed, the LKG must be verifiably unchanged: its interpreter still
  reports its SGLang version, its model files still have their identity. A venv upgraded in
  place, or weights replaced at the same path, hold instead (side-by-side venvs: docs).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from supervisor import log, threads
from supervisor.config import Config
from supervisor.core.events import LaunchCompared, LkgKnown, RecordLkg, RolledBack, UpgradeChanged
from supervisor.core.states import TrialVerdict, UpgradeState
from supervisor.metrics import Metrics
from supervisor.quality import golden
from supervisor.sglang import argv as command
from supervisor.sglang.argv import LaunchSpec
from supervisor.sglang.options import sglang_version

STORE_FILE = "lkg.json"
FORMAT = 1
# A comparison reads package metadata (a subprocess, ~50 ms) and the model files' identity (a
# few MiB per TB of weights): off the loop, abandoned at this deadline (then: "cannot compare").
COMPARE_TIMEOUT_S = 120.0
DRAFT_FLAG = "--speculative-draft-model-path"


def store_dir(state_dir: str) -> Path:
    return Path(state_dir) / "upgrade"


def _flag(argv: tuple[str, ...], flag: str) -> str | None:
    for i, token in enumerate(argv[:-1]):
        if token == flag:
            return argv[i + 1]
    return None


@dataclasses.dataclass(frozen=True)
class Print:
    """What a launch is, for the comparison with the last known good."""

    profile: str
    python: str
    sglang_version: str
    model_path: str
    identity: str
    draft_path: str | None
    draft_identity: str | None
    argv: tuple[str, ...]
    env: Mapping[str, str]

    def differs(self, new: Print) -> list[str]:
        """What differs from `new`, in words (an empty list: the same launch)."""
        out = []
        if self.python != new.python:
            out.append(f"interpreter {self.python} -> {new.python}")
        if self.sglang_version != new.sglang_version:
            out.append(f"SGLang {self.sglang_version} -> {new.sglang_version}")
        if self.model_path != new.model_path:
            out.append(f"model path {self.model_path} -> {new.model_path}")
        elif self.identity != new.identity:
            out.append(f"model files {self.identity[:12]} -> {new.identity[:12]}")
        if self.draft_identity != new.draft_identity:
            out.append(f"draft model {self.draft_path} -> {new.draft_path}")
        if self.argv[1:] != new.argv[1:]:
            out.append("argv: " + _argv_change(self.argv, new.argv))
        if dict(self.env) != dict(new.env):
            names = sorted(
                {*self.env, *new.env} - {k for k in self.env if new.env.get(k) == self.env[k]}
            )
            out.append("env: " + ", ".join(names))
        return out

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "argv": list(self.argv), "env": dict(self.env)}

    @staticmethod
    def from_json(doc: object) -> Print | None:
        if not isinstance(doc, dict):
            return None
        strs = ("profile", "python", "sglang_version", "model_path", "identity")
        argv, env = doc.get("argv"), doc.get("env")
        if not all(isinstance(doc.get(k), str) for k in strs):
            return None
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv) or not argv:
            return None
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            return None
        draft, draft_id = doc.get("draft_path"), doc.get("draft_identity")
        if not (draft is None or isinstance(draft, str)):
            return None
        if not (draft_id is None or isinstance(draft_id, str)):
            return None
        return Print(
            doc["profile"],
            doc["python"],
            doc["sglang_version"],
            doc["model_path"],
            doc["identity"],
            draft,
            draft_id,
            tuple(argv),
            dict(env),
        )


def _argv_change(old: tuple[str, ...], new: tuple[str, ...]) -> str:
    gone = [t for t in old[1:] if t.startswith("--") and t not in new]
    added = [t for t in new[1:] if t.startswith("--") and t not in old]
    parts = [*(f"-{t}" for t in gone), *(f"+{t}" for t in added)]
    return " ".join(parts) or "flag values changed"


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if number == number and 0 <= number < 1e12 else None


@dataclasses.dataclass(frozen=True)
class Record:
    """A profile's last known good: its print, its gate readings, when and how it became one."""

    print: Print
    tps: float | None
    accept: float | None
    at: float
    launch: int
    how: str = "served its trial period"

    def to_json(self) -> dict[str, Any]:
        return {
            "print": self.print.to_json(),
            "tps": self.tps,
            "accept": self.accept,
            "at": self.at,
            "launch": self.launch,
            "how": self.how,
        }

    @staticmethod
    def from_json(doc: object) -> Record | None:
        if not isinstance(doc, dict):
            return None
        p = Print.from_json(doc.get("print"))
        at, launch, how = _number(doc.get("at")), doc.get("launch"), doc.get("how", "")
        if p is None or at is None or not isinstance(launch, int) or isinstance(launch, bool):
            return None
        tps, accept = _number(doc.get("tps")), _number(doc.get("accept"))
        return Record(p, tps, accept, at, launch, str(how)[:200])


def fingerprint(spec: LaunchSpec) -> Print:
    """The print of a launch (blocking: run it in a thread)."""
    python = spec.argv[0]
    model = _flag(spec.argv, "--model-path") or ""
    draft = _flag(spec.argv, DRAFT_FLAG)
    return Print(
        profile=spec.profile,
        python=python,
        sglang_version=sglang_version(python) or "unknown",
        model_path=model,
        identity=golden.model_identity(model),
        draft_path=draft,
        draft_identity=None if draft is None else golden.model_identity(draft),
        argv=spec.argv,
        env=dict(spec.env),
    )


class Upgrades:
    """The store, the comparison and the trusted LKG commands of a daemon."""

    def __init__(self, cfg: Config, wall: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.wall = wall
        self.log = log.get()
        self.dir = store_dir(cfg.state_dir)
        self.records: dict[str, Record] = {}
        # The commands a rollback may launch: built by this daemon from its own configuration.
        self.trusted: dict[str, LaunchSpec] = {}

    def reconfigure(self, cfg: Config) -> None:
        self.cfg = cfg
        self._trust_current()

    # ------------------------------------------------------------------ the store

    def load(self) -> list[LkgKnown]:
        """The store's records, as events for the machine (blocking: a few KiB)."""
        doc = golden.read_json(self.dir, STORE_FILE)
        profiles = doc.get("profiles") if isinstance(doc, dict) else None
        self.records = {}
        if isinstance(profiles, dict):
            for name, item in profiles.items():
                rec = Record.from_json(item)
                if isinstance(name, str) and rec is not None and rec.print.profile == name:
                    self.records[name] = rec
        self._trust_current()
        return [LkgKnown(name, r.tps, r.accept) for name, r in sorted(self.records.items())]

    def known_now(self) -> list[LkgKnown]:
        """`load` on the caller's thread; none when the store cannot be read."""
        try:
            return self.load()
        except OSError as exc:
            self.log.error("last known good unreadable", error=str(exc))
            return []

    async def known(self) -> list[LkgKnown]:
        """`load`, off the loop; none when the store cannot be read in time."""
        try:
            return await threads.in_thread(self.load, COMPARE_TIMEOUT_S)
        except (TimeoutError, OSError) as exc:
            self.log.error("last known good unreadable", error=str(exc) or "timed out")
            return []

    def _trust_current(self) -> None:
        """A stored command that the current (root-owned) configuration builds exactly is
        trusted: the configuration is its source, not the file."""
        for name, rec in self.records.items():
            if name in self.trusted or name not in self.cfg.profile_names:
                continue
            spec = command.build(self.cfg, name)
            if spec.argv == rec.print.argv and dict(spec.env) == dict(rec.print.env):
                self.trusted[name] = spec

    def _save(self) -> None:
        doc = {
            "format": FORMAT,
            "generation": time.time_ns(),
            "profiles": {k: r.to_json() for k, r in sorted(self.records.items())},
        }
        golden.write_json(self.dir, STORE_FILE, doc)

    async def record(self, action: RecordLkg, spec: LaunchSpec, how: str) -> None:
        """The launch `spec` became its profile's LKG: kept in memory (trusted) and stored."""
        self.trusted[action.profile] = spec
        try:
            p = await threads.in_thread(lambda: fingerprint(spec), COMPARE_TIMEOUT_S)
            rec = Record(p, action.tps, action.accept, self.wall(), action.launch, how)
            self.records[action.profile] = rec
            await threads.in_thread(self._save, COMPARE_TIMEOUT_S)
        except (TimeoutError, OSError) as exc:
            self.log.error(
                "last known good not stored", dir=str(self.dir), error=str(exc) or "timed out"
            )
            return
        self.log.info(
            "last known good",
            profile=action.profile,
            launch=action.launch,
            sglang_version=rec.print.sglang_version,
            tps=action.tps,
            accept=action.accept,
        )

    def carry_out(
        self, action: RolledBack | UpgradeChanged, metrics: Metrics, on_lkg: bool
    ) -> None:
        """The metrics and the log of the machine's view of the trial."""
        match action:
            case RolledBack():
                metrics.rollbacks.labels(action.regression.value).inc()
                self.log.error(
                    "rolled back to the last known good",
                    launch=action.launch,
                    regression=action.regression.value,
                    why=action.why,
                )
            case UpgradeChanged():
                metrics.trial.set(1 if action.trial else 0)
        metrics.lkg_serving.set(1 if on_lkg else 0)

    def spec_for(self, profile: str) -> LaunchSpec | None:
        """The LKG's command for a rollback: a trusted one, or None."""
        return self.trusted.get(profile)

    # ------------------------------------------------------------------ the comparison

    async def compare(self, launch: int, spec: LaunchSpec) -> LaunchCompared:
        rec = self.records.get(spec.profile)
        if rec is None:
            return LaunchCompared(launch, False)
        started = time.monotonic()
        try:
            got = await threads.in_thread(
                lambda: self._compare(launch, spec, rec), COMPARE_TIMEOUT_S
            )
        except Exception as exc:  # fail closed: a launch that cannot be compared is a trial
            why = f"cannot compare with the last known good: {type(exc).__name__} {exc}".strip()
            got = LaunchCompared(launch, True, (why,), rec.tps, rec.accept, why)
        self.log.info(
            "compared with the last known good",
            launch=launch,
            seconds=round(time.monotonic() - started, 3),
            trial=bool(got.differs),
            differs="; ".join(got.differs) or None,
            rollback_refused=got.refusal,
        )
        return got

    def _compare(self, launch: int, spec: LaunchSpec, rec: Record) -> LaunchCompared:
        now = fingerprint(spec)
        differs = tuple(rec.print.differs(now))
        return LaunchCompared(launch, True, differs, rec.tps, rec.accept, self._refusal(rec, now))

    def _refusal(self, rec: Record, now: Print) -> str | None:
        """Why the LKG cannot be relaunched as it was, or None (blocking)."""
        lkg = rec.print
        if lkg.profile not in self.trusted:
            return (
                "its command has no root-owned source: the configuration that built it is "
                "gone (the daemon restarted since), and the stored one is the service user's"
            )
        version = now.sglang_version if lkg.python == now.python else sglang_version(lkg.python)
        if (version or "unknown") != lkg.sglang_version:
            return (
                f"its interpreter {lkg.python} now reports SGLang {version or '(none)'}, not "
                f"{lkg.sglang_version} (a venv upgraded in place: keep versions side by side)"
            )
        identity = (
            now.identity
            if lkg.model_path == now.model_path
            else golden.model_identity(lkg.model_path)
        )
        if identity != lkg.identity:
            return f"its model files at {lkg.model_path} changed in place"
        return None

    # ------------------------------------------------------------------ /status

    def status_document(self, ctx: Any, now: float) -> dict[str, Any]:
        """/status.upgrade: where the launch (the machine's `Context`) stands against the last
        known good; `now` on the machine's clock."""
        trial = None
        if ctx.trial:
            trial = {
                "launch": ctx.launch,
                "served_s": None if ctx.ready_at is None else now - ctx.ready_at,
                "period_s": self.cfg.quality.trial_period,
                "decode_tokens_per_second": ctx.gate_tps,
                "accept_length": ctx.gate_accept,
                # pass | regressed | inconclusive (read while SGLang was busy); null before
                # its gate.
                "verdict": None if ctx.verdict is None else str(ctx.verdict),
            }
        return {
            "state": ctx.upgrade.value,
            "why": ctx.upgrade_why,
            "serving_lkg": ctx.on_lkg,
            "trial": trial,
            "lkg": self.status(ctx.profile),
            "rollback_refused": ctx.rollback_refusal,
            "on_trial_regression": self.cfg.quality.on_trial_regression,
        }

    def status(self, profile: str) -> dict[str, Any] | None:
        rec = self.records.get(profile)
        if rec is None:
            return None
        p = rec.print
        return {
            "profile": p.profile,
            "sglang_version": p.sglang_version,
            "python": p.python,
            "model_path": p.model_path,
            "identity": p.identity[:16],
            "decode_tokens_per_second": rec.tps,
            "accept_length": rec.accept,
            "since": rec.at,
            "launch": rec.launch,
            "how": rec.how,
            "rollback_possible": p.profile in self.trusted,
        }


# ---------------------------------------------------------------------- across a hand-over

# The machine's view of the launch against its LKG (core/context.py): a hand-over is neither a
# trial nor a restart, so the launch keeps its trial status and its trial_period clock.
_CARRIED = (
    "compared",
    "has_lkg",
    "trial",
    "lkg_tps",
    "lkg_accept",
    "rollback_refusal",
    "on_lkg",
    "rolled_back",
    "holding",
    "accept_next",
    "awaiting_lkg",
    "regressed",
    "gate_tps",
    "gate_accept",
    "upgrade_why",
)


def _spec_json(spec: LaunchSpec) -> dict[str, Any]:
    args = {k: list(v) if isinstance(v, tuple) else v for k, v in spec.args.items()}
    return {"profile": spec.profile, "argv": list(spec.argv), "env": dict(spec.env), "args": args}


def _spec_of(doc: Any) -> LaunchSpec:
    args = {k: tuple(v) if isinstance(v, list) else v for k, v in dict(doc["args"]).items()}
    argv = tuple(str(a) for a in doc["argv"])
    env = {str(k): str(v) for k, v in dict(doc["env"]).items()}
    return LaunchSpec(str(doc["profile"]), argv, env, args)


def carried(ctx: Any, up: Upgrades) -> dict[str, Any]:
    """What the hand-over's state holds of the trial and the LKG (the document is bound to
    the exec, so the trusted commands may travel in it)."""
    return {
        **{name: getattr(ctx, name) for name in _CARRIED},
        "verdict": None if ctx.verdict is None else str(ctx.verdict),
        "upgrade": str(ctx.upgrade),
        "lkgs": {k: list(v) for k, v in ctx.lkgs.items()},
        "trusted": {k: _spec_json(s) for k, s in up.trusted.items()},
    }


def restore(ctx: Any, up: Upgrades, doc: object) -> None:
    """The carried state back into the machine's context; an older daemon's state has none
    (then the launch is compared as after a restart: nothing is judged again)."""
    if not isinstance(doc, dict):
        ctx.compared = True
        return
    for name in _CARRIED:
        if name in doc:
            setattr(ctx, name, doc[name])
    ctx.upgrade = UpgradeState(doc.get("upgrade", "none"))
    verdict = doc.get("verdict")
    ctx.verdict = TrialVerdict(verdict) if verdict in {str(v) for v in TrialVerdict} else None
    ctx.lkgs = {str(k): (v[0], v[1]) for k, v in dict(doc.get("lkgs") or {}).items()}
    up.trusted.update(trusted_of(doc))


def trusted_of(doc: dict[str, Any]) -> dict[str, LaunchSpec]:
    """The trusted LKG commands a hand-over's state carries."""
    return {str(name): _spec_of(spec) for name, spec in dict(doc.get("trusted") or {}).items()}
