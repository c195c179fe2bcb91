"""Everything the daemon does to the world, handed to it as one object.

`Daemon(cfg, Effects(...))`: the process owner, the launch-record store, the HTTP client, the
router's HTTP client factory, the NVML opener, the clocks, the systemd notifier and the metrics
registry. `cli.commands.cmd_run` builds the real ones (`Effects.real`), choosing real or
simulated GPUs; tests build theirs with fakes. The daemon's parts are built from them once, by
`wiring.wire`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from supervisor.config import Config
from supervisor.daemon.notify import Notifier
from supervisor.gpu.nvml import NvmlOpener, PynvmlNvml
from supervisor.metrics import Metrics
from supervisor.process import ProcessOwner
from supervisor.process.identity import RecordStore, owner_marker
from supervisor.sglang.own_ports import OwnPorts


@dataclass
class Effects:
    owner: ProcessOwner
    store: RecordStore
    http: httpx.AsyncClient
    open_nvml: NvmlOpener = PynvmlNvml  # used only when gpus.manage is on
    clock: Callable[[], float] = time.monotonic  # decisions and timers
    wall: Callable[[], float] = time.time  # what /status shows
    notifier: Notifier = field(default_factory=Notifier)
    metrics: Metrics = field(default_factory=Metrics)
    # The router link's own client, one per link (router.url set, or set by a reload): a router
    # that hangs must not hold the connections the probes need.
    router_http: Callable[[], httpx.AsyncClient] = lambda: httpx.AsyncClient(trust_env=False)
    # The local addresses of `http`'s connections: SGLang's access lines for them go to debug.
    own_ports: OwnPorts = field(default_factory=OwnPorts)

    @classmethod
    def real(cls, cfg: Config, open_nvml: NvmlOpener = PynvmlNvml) -> Effects:
        own = OwnPorts()
        return cls(
            owner=ProcessOwner(owner_marker(cfg.state_dir)),
            store=RecordStore(cfg.state_dir),
            http=httpx.AsyncClient(trust_env=False, transport=own.transport()),
            open_nvml=open_nvml,
            own_ports=own,
        )
