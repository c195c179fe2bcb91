"""Owning SGLang's processes: spawn, pump output, notice death, stop, sweep.

- SGLang runs in a session (and process group) of its own, so one killpg reaches the scheduler
  and detokenizer children (docs/sglang.md, "Processes"; `SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION`
  relies on it).
- Death is noticed through a pidfd on the event loop: no polling delay, no thread. asyncio's own
  `Process.wait()` is not used because it only returns once every pipe is closed, and SGLang's
  children inherit its stdout: an orphaned scheduler would hide the main process's death.
- Any SGLang process of the launch dying counts, not only the main one: each recorded worker
  (scheduler, detokenizer, multiprocessing's resource tracker) gets a pidfd of its own. Real
  SGLang's main process notices a dead scheduler only after sleeping 5 s, and its HTTP requests
  hang meanwhile (docs/sglang.md); here the death is reported at once through `on_exit`.
- Children that escape the group (a child still loading sets PR_SET_PDEATHSIG only later,
  sglang #23627) are found by their recorded (pid, create time), by the session of the launch
  (its main process is the session leader), and by an environment marker every process of ours
  inherits (which setproctitle wipes in SGLang's workers unless SPT_NOENV=1); identity is
  checked before any signal.

The owner is `owner.ProcessOwner`, one launch as it sees it `child.Child`, the pumps `pipes`,
what is a worker of SGLang's `workers`, the port watcher `port`. What other rooms import is
importable from here.
"""

from __future__ import annotations

from supervisor.process.child import Child as Child
from supervisor.process.child import ChildPhase as ChildPhase
from supervisor.process.child import ExitInfo as ExitInfo
from supervisor.process.child import Reapable as Reapable
from supervisor.process.identity import OWNER_ENV as OWNER_ENV
from supervisor.process.owner import LAUNCH_ENV as LAUNCH_ENV
from supervisor.process.owner import MAIN_SETTLE_S as MAIN_SETTLE_S
from supervisor.process.owner import STUCK_AFTER_KILL_S as STUCK_AFTER_KILL_S
from supervisor.process.owner import ProcessOwner as ProcessOwner
from supervisor.process.pipes import LineSink as LineSink
from supervisor.process.port import wait_port_open as wait_port_open
from supervisor.process.workers import SPAWN_TITLE as SPAWN_TITLE
from supervisor.process.workers import exit_status_of_zombie as exit_status_of_zombie
from supervisor.process.workers import worker_title as worker_title
