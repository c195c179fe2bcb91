"""Every exit status kimi-serve gives, in one place (README's CLI table says which command
gives which). sysexits.h names where one fits: systemd's unit and Kubernetes read them."""

from __future__ import annotations

EX_OK = 0
# An internal error, a failed probe or cleaning, a refused request; `preflight`: host not ready.
EX_FAIL = 1
EXIT_HOST = EX_FAIL
# `canary show|accept`: there is nothing to show or accept (no golden, no answer yet).
EX_NOTHING = EX_FAIL
# `status`: the daemon answered and is not ready; the daemon could not be reached.
EX_NOT_READY = 3
EX_UNREACHABLE = 4
# `restart`, `drain`, `undrain`: the admin address is held by a socket of another user (not
# root, this user or the service user): nothing was sent to it and its answer is not trusted.
# (`status` says EX_UNREACHABLE then: its statuses are the contract's 0 / 3 / 4.)
EX_NOT_SERVICE = 5
# `restart --wait`, `undrain --wait`: ready, but not as asked (supervisor/admin/wait.py): on the
# fallback profile; on the rolled-back last known good; after a hand-over fell back to a restart.
EX_READY_FALLBACK = 6
EX_READY_ROLLED_BACK = 7
EX_READY_RESTARTED = 8
# restart.mode: exit — the exit status that asks an orchestrator to relaunch (sysexits'
# EX_TEMPFAIL: "try again later"). Not 78 (EX_CONFIG), which the systemd unit lists in
# RestartPreventExitStatus= and which means "do not retry"; not 1, which an internal error gives.
EX_RESTART_BY_ORCHESTRATOR = 75
# sysexits' EX_NOPERM: the admin token is unreadable for this user, or the daemon rejected it.
EX_NOPERM = 77
# sysexits' EX_CONFIG: the contract's exit status for a config problem (RestartPreventExitStatus=).
EX_CONFIG = 78

# The names the commands use for them.
EX_READY = EX_OK
EX_DONE = EX_OK
EX_REFUSED = EX_FAIL
