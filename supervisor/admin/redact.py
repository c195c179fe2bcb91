"""What GET /status leaves out without the admin token: the text SGLang printed, and every
process on the GPUs beyond its pid, program name and whether it is ours (docs/security.md).
Pure; supervisor/admin/app.py applies it."""

from __future__ import annotations

from typing import Any

# Keys whose values are text SGLang printed, or may quote it: a fatal log line in `detail`,
# an HTTP error body in a probe's `error`, the log tail. Left out of /status without a token:
# the bulk ones (log tail, stacks) whole; the one-line ones keep their key, so that a client
# sees there is an error (`last_probe.error`, `router.last_error` are the contract's fields),
# with WITHHELD for the text (null stays null).
SGLANG_BULK_KEYS = frozenset({"log_tail", "stacks", "traceback"})
SGLANG_LINE_KEYS = frozenset({"detail", "error", "last_error", "status_line", "text"})
SGLANG_TEXT_KEYS = SGLANG_BULK_KEYS | SGLANG_LINE_KEYS
WITHHELD = "<withheld: the admin token shows it>"
# /status.quality.evidence: SGLang's own start-up lines that showed the overlap scheduler, the
# spec v2 path, a graph capture (quality.STARTUP_EVIDENCE); its counts stay.
EVIDENCE_KEY = "evidence"

# A process's details beyond pid, program name and whether it is ours: left out of /status
# without a token (the reason may name the user: "runs as alice, not the daemon's uid").
PROCESS_KEYS = frozenset({"cmdline", "user", "reason", "ppid"})
CLEAN_TEXT_KEYS = frozenset({"message", "wedged"})
# The canary's answers (/status.quality.canary): text the model generated, so SGLang's text.
CANARY_TEXT_KEYS = frozenset({"expected", "got"})


def redact(doc: Any) -> Any:
    """The /status document without SGLang's text (see SGLANG_TEXT_KEYS), at any depth, and
    with every process on the GPUs as pid, program name and ours-or-foreign only (see
    PROCESS_KEYS): a foreign process's command line and user are someone else's business."""
    if isinstance(doc, dict):
        out = {
            k: _withheld(v) if k in SGLANG_LINE_KEYS else redact(v)
            for k, v in doc.items()
            if k not in SGLANG_BULK_KEYS
        }
        if EVIDENCE_KEY in out:
            out[EVIDENCE_KEY] = _every_string_withheld(out[EVIDENCE_KEY])
        if "cmdline" in doc:
            out = {k: v for k, v in out.items() if k not in PROCESS_KEYS}
            out["name"] = program_name(str(doc.get("cmdline") or ""))
        if "found" in doc:  # a cleaning report: its message and wedged lines quote them
            out = {k: v for k, v in out.items() if k not in CLEAN_TEXT_KEYS}
        if "got" in doc:  # the canary's expected and received answers
            out = {k: v for k, v in out.items() if k not in CANARY_TEXT_KEYS}
        return out
    if isinstance(doc, list):
        return [redact(v) for v in doc]
    return doc


def _withheld(value: Any) -> Any:
    """A text's place kept, its words not: null and "" (nothing to tell) stay as they are."""
    return value if value is None or value == "" else WITHHELD


def _every_string_withheld(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _every_string_withheld(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_every_string_withheld(v) for v in value]
    return _withheld(value) if isinstance(value, str) else value


def program_name(cmdline: str) -> str:
    """What `ps -o comm` would say, near enough: the program's base name, no arguments."""
    first = cmdline.split(maxsplit=1)[0] if cmdline.strip() else ""
    return first.rsplit("/", 1)[-1][:64]
