"""GPU fitness: is each managed GPU fit to run SGLang, and if not, what must an operator do?

Pure. NVML's answers per GPU (`HealthRead`, read by `nvml.PynvmlNvml.health()` or the
simulation) go in; a verdict per GPU comes out (`Fitness`: ok, the action needed, the reasons),
and one line that names the GPU, its UUID and the action, for `failed` and `systemctl status`.

Why this exists: a GPU with pending row remaps, uncorrectable ECC errors or a driver recovery
action pending turns every relaunch into another ten-minute load that fails (or serves wrong
answers): a crash loop that no fallback profile can fix. Such a GPU is never launched on.

Every field can be unsupported by a GPU or driver (e.g. ECC off, a consumer part, an old
driver): that reads as `NOT_SUPPORTED`, a value of its own, which never makes a GPU fit or unfit
by itself; /status shows it as "not_supported" so nobody mistakes it for a zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Any, TypeVar

T = TypeVar("T")


class _NotSupported(Enum):
    NOT_SUPPORTED = "not_supported"

    def __repr__(self) -> str:
        return "NOT_SUPPORTED"


NOT_SUPPORTED = _NotSupported.NOT_SUPPORTED
Reading = int | _NotSupported  # a counter or code, or "the GPU/driver does not report this"
Flag = bool | _NotSupported


class Action(StrEnum):
    """What an operator must do before the GPU can be used (least to most drastic)."""

    NONE = "none"
    RESET = "reset"  # nvidia-smi -r (or the driver's drain-and-reset)
    REBOOT = "reboot"  # the node
    REPLACE = "replace"  # the GPU: it cannot repair itself any more (RMA)


_RANK = {a: i for i, a in enumerate(Action)}

# nvmlGpuRecoveryAction_t (nvml.h, NVML_FI_DEV_GET_GPU_RECOVERY_ACTION).
RECOVERY_ACTIONS: Mapping[int, tuple[str, Action]] = {
    0: ("none", Action.NONE),
    1: ("gpu_reset", Action.RESET),
    2: ("node_reboot", Action.REBOOT),
    3: ("drain_p2p", Action.RESET),
    4: ("drain_and_reset", Action.RESET),
    5: ("recover_imex_domain", Action.RESET),
    6: ("bus_reset", Action.RESET),
    7: ("system_reboot", Action.REBOOT),
}

# Xids an operator reads about first (NVIDIA's Xid catalogue); any other is shown by number.
XID_NAMES: Mapping[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "row remapping pending (ECC page retirement)",
    64: "row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "ECC unrecovered error",
}


@dataclass(frozen=True)
class XidEvent:
    """One critical event NVML delivered (an Xid, a double-bit ECC error, a recovery action)."""

    index: int
    uuid: str
    kind: str  # "xid", "ecc_double_bit", "ecc_single_bit", "recovery_action", "other"
    xid: int  # NVML's eventData: the Xid number for "xid", else the raw value
    at: float  # unix time it was received

    def describe(self) -> str:
        if self.kind == "xid":
            name = XID_NAMES.get(self.xid)
            return f"Xid {self.xid}" + (f" ({name})" if name else "")
        return f"{self.kind.replace('_', ' ')} event (data {self.xid})"

    def to_dict(self) -> dict[str, Any]:
        return {"xid": self.xid, "kind": self.kind, "at": self.at, "what": self.describe()}


@dataclass(frozen=True)
class HealthRead:
    """What NVML said about one GPU's fitness, field by field."""

    index: int
    uuid: str
    lost: bool  # NVML_ERROR_GPU_IS_LOST on any call: the GPU fell off the bus (Xid 79)
    recovery_action: Reading = NOT_SUPPORTED  # nvmlGpuRecoveryAction_t
    remapped_pending: Flag = NOT_SUPPORTED  # rows waiting for a GPU reset to be remapped
    remapped_failure: Flag = NOT_SUPPORTED  # a remap failed: no spare rows left
    remapped_uncorrectable: Reading = NOT_SUPPORTED  # rows remapped for uncorrectable errors
    remapped_correctable: Reading = NOT_SUPPORTED
    ecc_uncorrected_volatile: Reading = NOT_SUPPORTED  # since the last driver load / reset


@dataclass(frozen=True)
class Fitness:
    index: int
    uuid: str
    ok: bool
    action: Action
    reasons: tuple[str, ...]  # why not ok; empty when ok
    not_supported: tuple[str, ...]  # fields this GPU/driver does not report
    read: HealthRead
    last_xid: XidEvent | None = None

    def line(self) -> str:
        """One line: GPU, UUID, the action and why."""
        if self.ok:
            return f"GPU {self.index} ({self.uuid}) is fit"
        why = "; ".join(self.reasons)
        return f"GPU {self.index} ({self.uuid}) needs a {self.action.value}: {why}"

    def health(self) -> dict[str, Any]:
        """/status.gpus[].health (contract: ok, recovery_action, remapped_rows,
        ecc_uncorrected_volatile, last_xid), plus the action and reasons."""
        r = self.read
        return {
            "ok": self.ok,
            "action": self.action.value,
            "reasons": list(self.reasons),
            "lost": r.lost,
            "recovery_action": _recovery_name(r.recovery_action),
            "remapped_rows": {
                "pending": _json(r.remapped_pending),
                "failure": _json(r.remapped_failure),
                "uncorrectable": _json(r.remapped_uncorrectable),
                "correctable": _json(r.remapped_correctable),
            },
            "ecc_uncorrected_volatile": _json(r.ecc_uncorrected_volatile),
            "last_xid": self.last_xid.to_dict() if self.last_xid else None,
            "not_supported": list(self.not_supported),
        }


def _json(v: Reading | Flag) -> int | bool | str:
    return v.value if isinstance(v, _NotSupported) else v


def _recovery_name(v: Reading) -> str:
    if isinstance(v, _NotSupported):
        return v.value
    return RECOVERY_ACTIONS.get(v, (f"unknown ({v})", Action.RESET))[0]


def _worse(a: Action, b: Action) -> Action:
    return a if _RANK[a] >= _RANK[b] else b


def assess(read: HealthRead, last_xid: XidEvent | None = None) -> Fitness:
    """The verdict on one GPU. An Xid alone is reported, not judged: the driver's recovery
    action and the error counters say whether the GPU needs anything (many Xids, e.g. 13 or
    31, are an application's fault and leave the GPU fine)."""
    reasons: list[str] = []
    action = Action.NONE
    unsupported = [
        name
        for name in (
            "recovery_action",
            "remapped_pending",
            "remapped_failure",
            "remapped_uncorrectable",
            "remapped_correctable",
            "ecc_uncorrected_volatile",
        )
        if getattr(read, name) is NOT_SUPPORTED
    ]
    if read.lost:
        # Nothing else can be read from a lost GPU; a reset rarely brings one back.
        reasons.append("the GPU is lost (fell off the bus, Xid 79 in dmesg)")
        action = Action.REBOOT
    ra = read.recovery_action
    if not isinstance(ra, _NotSupported) and ra != 0:
        name, needed = RECOVERY_ACTIONS.get(ra, (f"unknown ({ra})", Action.RESET))
        reasons.append(f"the driver asks for recovery action {name}")
        action = _worse(action, needed)
    if read.remapped_failure is True:
        reasons.append("row remapping failed (no spare rows left)")
        action = _worse(action, Action.REPLACE)
    if read.remapped_pending is True:
        reasons.append("row remapping pending (applied at the next GPU reset)")
        action = _worse(action, Action.RESET)
    ecc = read.ecc_uncorrected_volatile
    if not isinstance(ecc, _NotSupported) and ecc > 0:
        reasons.append(f"{ecc} uncorrectable ECC error(s) since the last reset")
        action = _worse(action, Action.RESET)
    if reasons and last_xid is not None:
        reasons.append(f"last event {last_xid.describe()}")
    return Fitness(
        index=read.index,
        uuid=read.uuid,
        ok=not reasons,
        action=action,
        reasons=tuple(reasons),
        not_supported=tuple(unsupported),
        read=read,
        last_xid=last_xid,
    )


@dataclass(frozen=True)
class FitnessReport:
    gpus: tuple[Fitness, ...]

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.gpus)

    @property
    def unfit(self) -> tuple[Fitness, ...]:
        return tuple(f for f in self.gpus if not f.ok)

    @property
    def action(self) -> Action:
        out = Action.NONE
        for f in self.gpus:
            out = _worse(out, f.action)
        return out

    @property
    def restart_needed(self) -> bool:
        """While serving: restart SGLang only where a GPU is lost or the driver asks for an
        action. Counters alone (a pending remap, a volatile ECC count) are reported; the
        running server is left alone until the driver says it cannot go on."""
        return any(
            f.read.lost
            or (
                not isinstance(f.read.recovery_action, _NotSupported)
                and f.read.recovery_action != 0
            )
            for f in self.gpus
        )

    def line(self) -> str:
        """The one line for `failed` / STATUS=: every unfit GPU, most drastic action first."""
        bad = sorted(self.unfit, key=lambda f: (-_RANK[f.action], f.index))
        if not bad:
            n = len(self.gpus)
            return f"{n} GPU(s) fit" if n != 1 else self.gpus[0].line()
        return " | ".join(f.line() for f in bad)


def assess_all(
    reads: Iterable[HealthRead], last_xids: Mapping[str, XidEvent] | None = None
) -> FitnessReport:
    """Verdicts for every read GPU; `last_xids` by UUID."""
    xids = last_xids or {}
    return FitnessReport(tuple(assess(r, xids.get(r.uuid)) for r in sorted(reads, key=_index)))


def _index(r: HealthRead) -> int:
    return r.index


def select_reads(
    reads: Sequence[HealthRead], devices: str | tuple[int | str, ...]
) -> list[HealthRead]:
    """The managed GPUs' reads (`gpus.devices`: "all", NVML indexes or UUIDs), in NVML order.
    A device named but not read is left out: `nvml.select` already reports unknown devices."""
    if devices == "all":
        return sorted(reads, key=_index)
    out = []
    for r in sorted(reads, key=_index):
        for dev in devices:
            if (isinstance(dev, int) and dev == r.index) or (
                isinstance(dev, str) and dev.lower() == r.uuid.lower()
            ):
                out.append(r)
                break
    return out
