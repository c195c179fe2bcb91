"""The probes a launch is judged by: the decode probe (`StartProbe`) and the intent check
(`CheckIntent`), each answered by one result. Verdicts are pure (`probe.judge`,
`probe.is_busy`, `intent.compare`); this module only asks SGLang over HTTP.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import httpx

from supervisor.config import Config
from supervisor.core.machine import ProbeDone, ProbeKind
from supervisor.sglang import endpoints, intent
from supervisor.sglang.argv import LaunchSpec
from supervisor.sglang.probe import (
    ProbeGate,
    is_busy,
    probe,
    prompt_token_bound,
    read_progress,
    server_url,
)


async def decode(
    http: httpx.AsyncClient,
    cfg: Config,
    spec: LaunchSpec,
    launch: int,
    kind: ProbeKind,
    gate: ProbeGate | None = None,
) -> ProbeDone:
    """One decode probe against the launch, and whether SGLang was busy meanwhile.

    Through `gate` (the daemon's one ProbeGate): at most one probe in flight, each with its own
    request id, aborted inside SGLang when it times out (docs/gpu.md, "Probe hygiene").
    """
    pcfg = cfg.readiness.probe
    timeout = pcfg.timeout if kind is ProbeKind.READINESS else cfg.liveness.timeout
    base = server_url(cfg.sglang.host, cfg.sglang.port)
    # SGLang's own token counter, read around the probe: if it advanced while the probe timed
    # out, the server is loaded, not hung (and the failure does not count). The first read runs
    # beside the probe, so a frozen server costs one probe timeout, not more.
    sample = min(2.0, timeout)
    first = asyncio.get_running_loop().create_task(read_progress(http, base, sample))
    if gate is not None:
        result = await gate.probe(
            http, base, pcfg, spec.speculative, timeout=timeout, kind=kind.value
        )
    else:
        result = await probe(http, base, pcfg, spec.speculative, timeout=timeout)
    before = await first
    busy = False
    if result.reason == "timeout" and before is not None:
        after = await read_progress(http, base, sample)
        busy = is_busy(
            result, before, after, pcfg.max_tokens, prompt_tokens=prompt_token_bound(pcfg)
        )
    return ProbeDone(launch, kind, result, busy, progress_before=before)


async def server_info(http: httpx.AsyncClient, cfg: Config) -> dict[str, Any] | None:
    """SGLang's resolved arguments, or None (`endpoints.server_info`: bounded, untrusted)."""
    return await endpoints.server_info(http, server_url(cfg.sglang.host, cfg.sglang.port))


async def check_intent(
    http: httpx.AsyncClient, cfg: Config, spec: LaunchSpec, meta: Mapping[str, Any]
) -> tuple[dict[str, Any] | None, list[intent.Mismatch]]:
    info = await server_info(http, cfg)
    if info is None:
        return None, []
    try:
        return info, intent.compare(spec, info, meta)
    except Exception:  # odd values SGLang sent: reported as unavailable
        return None, []
