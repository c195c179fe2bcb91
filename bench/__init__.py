"""Benchmarks: how fast kimi-serve sees the truth and recovers, beside supervisord, systemd and
a /health poller, all on the SGLang stand-in. Run `python -m bench`; see docs/benchmarks.md."""
