"""A tiny ASGI server run by SGLang's own interpreter with SGLang's own uvicorn logging
configuration: the access lines it prints are SGLang's, byte for byte.

`python testkit/uvicorn_access.py PORT` (the SGLang environment's python). SGLang 0.5.23 formats
uvicorn's records with `set_uvicorn_logging_configs` (sglang/srt/utils/common.py:3509); that
module imports torch (half a minute on a cold disk), so the two functions are taken from its
source and run alone, as SGLang runs them before `uvicorn.Server(...)`. Imports nothing of
kimi-serve: it is another process, as SGLang is.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from typing import Any

import uvicorn

NAMES = ("set_uvicorn_logging_configs", "_configure_uvicorn_access_log_filter")


def sglang_logging() -> None:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).parent / "srt" / "utils" / "common.py"
    tree = ast.parse(source.read_text())
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in NAMES]
    assert len(funcs) == len(NAMES), f"{source} no longer defines {NAMES}"
    scope: dict[str, Any] = {}
    exec(compile(ast.Module(body=funcs, type_ignores=[]), str(source), "exec"), scope)
    scope["set_uvicorn_logging_configs"](None)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


if __name__ == "__main__":
    sglang_logging()
    # As SGLang's http_server.launch_server: uvloop, the default (h11) protocol.
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="info", loop="uvloop")
