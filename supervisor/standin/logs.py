"""SGLang-shaped log lines on stderr.

SGLang logs through `logging.basicConfig` (stderr) with `[%(asctime)s{prefix}] %(message)s`,
where the prefix is " TP<rank>" in a scheduler process when tp > 1, empty with tp 1
(sglang/srt/utils, configure_logger; sglang/srt/managers/scheduler.py:6287). Warnings from
server_args.py read `[... ] WARNING server_args.py:<line>: ...` (seen in the seed incident's
log), and uvicorn's lines are reformatted to `[...] INFO:     ...` (http_server.py,
set_uvicorn_logging_configs).

Each message goes out in one write() and is flushed at once, like a logging.StreamHandler:
a multi-line traceback arrives in one piece, and a reader that stops draining the pipe stalls
the process, as it would stall SGLang.
"""

from __future__ import annotations

import os
import time


def _stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


class Log:
    def __init__(self, fd: int = 2, tp_size: int = 1) -> None:
        self._fd = fd
        self._tp_size = tp_size

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError:
            # Like logging's handleError: a closed or broken stderr must not kill the server.
            pass

    def info(self, message: str) -> None:
        self._write(f"[{_stamp()}] {message}\n".encode())

    def warning(self, where: str, message: str) -> None:
        self._write(f"[{_stamp()}] WARNING {where}: {message}\n".encode())

    def _prefix(self, rank: int) -> str:
        # sglang/srt/managers/scheduler.py:6287: " TP<rank>" only when tp > 1.
        return f" TP{rank}" if self._tp_size > 1 else ""

    def tp(self, rank: int, message: str) -> None:
        self._write(f"[{_stamp()}{self._prefix(rank)}] {message}\n".encode())

    def uvicorn(self, message: str) -> None:
        self._write(f"[{_stamp()}] INFO:     {message}\n".encode())

    def uvicorn_error(self, message: str) -> None:
        self._write(f"[{_stamp()}] ERROR:    {message}\n".encode())

    def access(self, peer: str, method: str, path: str, status: int, reason: str) -> None:
        self.uvicorn(f'{peer} - "{method} {path} HTTP/1.1" {status} {reason}')

    def flood(self, lines: int, chunk: int = 2000) -> None:
        """Write `lines` scheduler decode-log lines as fast as the pipe takes them."""
        stamp = f"{_stamp()}{self._prefix(0)}"
        for start in range(0, lines, chunk):
            self._write(
                "".join(
                    f"[{stamp}] Decode batch, #running-req: 1, #token: {i}, "
                    "token usage: 0.01, cuda graph: True, gen throughput (token/s): 88.00, "
                    "#queue-req: 0\n"
                    for i in range(start, min(start + chunk, lines))
                ).encode()
            )
