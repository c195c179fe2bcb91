"""Benchmarks: `python -m bench` (the comparison, bench/compare.py) and `python -m bench NAME`
for each bench below (docs/benchmarks.md). Kept free of imports, so that a bench loads only
what it uses (the GPU benches run on machines without the test tools)."""

# name -> (module in bench/, what it measures). `python -m bench NAME ARGS...` runs that
# module's main(ARGS); each has a quick, --standin or --simulated form that tests/bench runs.
BENCHES: dict[str, tuple[str, str]] = {
    "real-sglang": ("real_sglang", "kimi-serve's rows on the real SGLang 0.5.23 server (CPU)"),
    "downtime": ("downtime", "restart downtime on real SGLang, cold and warm (root)"),
    "canary": ("canary", "how stable greedy text is on the real server"),
    "quality-canary": ("quality_canary", "the canary comparison against a bare real server"),
    "fleet": ("fleet", "two replicas behind the real sglang-router"),
    "multinode": ("multinode", "a two-node replica's relaunch, on one machine"),
    "slow-clients": ("slow_clients", "/livez under the slow-client attack"),
    "stack-dump": ("stack_dump", "what a stack dump before the kill costs"),
    "incident-restart": ("incident_restart", "the stack dump in the restart, through the daemon"),
    "profile-pump": ("profile_pump", "where the log pump's time goes, per line"),
    "gpu-leftovers": ("gpu_leftovers", "GPU leftovers found, removed; a foreign one untouched"),
    "gpu-fitness": ("gpu_fitness", "GPU fitness, the event set, leftover counting"),
    "gpu-multi": ("gpu_multi", "hygiene and fitness across several GPUs"),
    "handoff": ("handoff", "a hand-over (reexec) against a restart, under a client loop"),
}
