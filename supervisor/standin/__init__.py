"""A stand-in for the SGLang server, for tests and for `kimi-serve demo`.

It is launched the way SGLang is (`<python> -m supervisor.standin <sglang flags>`), imports
nothing from the rest of `supervisor` (it is another process, as SGLang is), and imitates
SGLang's processes, logs, HTTP endpoints and failure modes. See docs/standin.md.

This module stays import-free: every scheduler child imports it on start-up.
"""
