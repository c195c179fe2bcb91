"""Secrets out of what a log or an unauthenticated reader sees.

SGLang 0.5.22+ logs its resolved server arguments at start, `--api-key` and `--admin-api-key`
included (`server_args={'model_path': ..., 'api_key': '...', ...}`, engine.py:311 and :1185 in
0.5.23, docs/sglang.md): every line SGLang prints goes through `line()` before kimi-serve
forwards it to the journal, keeps it in the log tail (/status.last_restart.log_tail, the
incident's log_tail.txt) or records it. `argv()` does the same for a command line we print or
log. Pure functions; the patterns err on the side of hiding.

Every pattern here is linear in the line: no two ways to match the same character (an item's
value is `\\.` or a character that is neither the quote nor a backslash), possessive repeats,
and a value left open at the end of the line is redacted to the end instead of being retried
from every later position. A line is cut to MAX_LINE_BYTES before any pattern runs (`line`),
so the work per line is bounded whatever SGLang (or a prompt it echoes) prints. `re` holds the
GIL for a whole match: a pattern that backtracks stalls the event loop, /livez and WATCHDOG=1
alike, thread or not.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

REDACTED = "<redacted>"
# A log line longer than this (in UTF-8 bytes) is cut before any pattern sees it. SGLang's
# longest line, the resolved `server_args=ServerArgs(...)`, is about 8 KiB in 0.5.23.
MAX_LINE_BYTES = 16 << 10
# A JSON document (/server_info) deeper than this is not SGLang's: what lies below is replaced.
MAX_DEPTH = 64

# A name that holds a secret: api_key, admin_api_key, hf_token, client_secret, password. Not
# max_tokens or tokenizer_path: "token" counts as a whole part of the name only.
_PARTS = re.compile(r"[_.-]+")
_NAME = r"[A-Za-z0-9_.-]++"

# 'api_key': 'value' / "api_key": "value" (a dict's repr, JSON): the quoted value, to its
# closing quote or, left open (a line cut at MAX_LINE_BYTES), to the end of the line.
_QUOTED_ITEM = re.compile(
    rf"""(?P<head>(?P<q>['"])(?P<name>{_NAME})(?P=q)\s*+:\s*+)"""
    r"""(?P<vq>['"])(?P<value>(?:\\.|(?!(?P=vq))[^\\])*+)(?:(?P<end>(?P=vq))|\\?\Z)""",
    re.DOTALL,
)
# api_key='value' (a dataclass's repr), api_key=value, --api-key value, --api-key=value.
_KEYWORD = re.compile(
    rf"""(?P<head>(?<![A-Za-z0-9_.-])(?:--(?P<flag>{_NAME})(?:=|\s+(?=[^-\s]))|(?P<name>{_NAME})=))"""
    r"""(?P<value>'[^']*+'|"[^"]*+"|[^\s,)}\]]++)"""
)
# Authorization: Bearer xyz, 'authorization': 'Bearer xyz', a bare "Bearer xyz".
_BEARER = re.compile(r"(?P<head>\b(?:Bearer|Basic)\s+)(?P<value>[A-Za-z0-9._~+/=-]+)")
_AUTH_HEADER = re.compile(
    r"""(?P<head>\bAuthorization['"]?\s*[:=]\s*['"]?)(?P<value>[^'"\s,}]+(?:\s+[^'"\s,}]+)?)""",
    re.IGNORECASE,
)


def is_secret_flag(name: str) -> bool:
    """Whether an SGLang flag or field (`api-key`, `--admin-api-key`, `hf_token`) is a secret."""
    low = name.lower().lstrip("-")
    if "apikey" in low.replace("_", "").replace("-", "").replace(".", ""):
        return True
    if "secret" in low or "passw" in low:
        return True
    return "token" in _PARTS.split(low)


def _quoted(m: re.Match[str]) -> str:
    if not is_secret_flag(m["name"]):
        return m.group(0)
    return f"{m['head']}{m['vq']}{REDACTED}{m['end'] or ''}"


def _keyword(m: re.Match[str]) -> str:
    value = m["value"]
    if not is_secret_flag(m["flag"] or m["name"]) or value in ("None", "null", "''", '""'):
        return m.group(0)  # not a secret, or not set (the reader may learn that it is unset)
    quote = value[0] if value[:1] in ("'", '"') else ""
    return f"{m['head']}{quote}{REDACTED}{quote}"


def _cut(text: str, limit: int) -> tuple[str, int]:
    """`text` cut to at most `limit` UTF-8 bytes, and how many bytes were cut."""
    if len(text) <= limit // 4:  # no character is more than 4 bytes: the common case, cheaply
        return text, 0
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= limit:
        return text, 0
    return data[:limit].decode("utf-8", "ignore"), len(data) - limit


def line(text: str) -> str:
    """`text`, cut to MAX_LINE_BYTES (saying so), with every secret value replaced by
    <redacted>: a secret left open by the cut is redacted to the end of what is kept."""
    text, cut = _cut(text, MAX_LINE_BYTES)
    if _could_hold_a_secret(text):
        text = _every_pattern(text)
    return f"{text} [{cut} bytes cut]" if cut else text


def _every_pattern(text: str) -> str:
    text = _QUOTED_ITEM.sub(_quoted, text)
    text = _AUTH_HEADER.sub(lambda m: f"{m['head']}{REDACTED}", text)
    text = _BEARER.sub(lambda m: f"{m['head']}{REDACTED}", text)
    return _KEYWORD.sub(_keyword, text)


# The cheap test first: a log flood of ordinary lines costs one search each. It matches
# wherever a pattern above could: a secret-looking name before `=` or before a quote and `:`,
# a secret-looking flag before a space, Bearer / Basic / Authorization. SGLang's decode-batch
# lines ("#token: 30, token usage: 0.01, ...") name tokens but hold no secret, and pass.
# Linear: a name is taken whole from where it starts (the look-behind) and never given back
# (possessive), so each name of the line is read once, wherever the secret-looking word is in
# it; that word is then looked for in the name alone.
_NAMED = re.compile(
    r"""(?<![A-Za-z0-9_.-])(?:--[A-Za-z0-9_.-]++(?=\s)|[A-Za-z0-9_.-]++(?:['"]\s*+:|=))"""
)
_SECRET_WORDS = ("key", "token", "secret", "passw")


def _could_hold_a_secret(text: str) -> bool:
    low = text.lower()
    # A named form needs `=`, a quote or a `--` flag; without any, only a Bearer / Basic /
    # Authorization form can hold a secret. Plain `in` tests: a fraction of one regex search.
    if "=" not in text and "'" not in text and '"' not in text and "--" not in text:
        return "bearer" in low or "basic" in low or "authorization" in low
    if not any(w in low for w in ("key", "token", "secret", "passw", "bearer", "basic", "auth")):
        return False
    if "bearer" in low or "basic" in low or "authorization" in low:
        return True
    return any(any(w in m.group() for w in _SECRET_WORDS) for m in _NAMED.finditer(low))


def document(value: Any, depth: int = 0) -> Any:
    """A JSON document (SGLang's /server_info) with every secret out: the value of a field named
    as a secret (`api_key`, `admin_api_key`, `hf_token`, at any depth) is <redacted> unless unset
    (None, "", false), and every string is `line()`d (a `launch_command` carries `--api-key`).
    Below MAX_DEPTH levels whatever is there is <redacted> (never a RecursionError)."""
    if isinstance(value, dict | list) and depth >= MAX_DEPTH:
        return REDACTED
    if isinstance(value, dict):
        return {
            k: REDACTED
            if isinstance(k, str) and is_secret_flag(k) and value[k] not in (None, "", False)
            else document(value[k], depth + 1)
            for k in value
        }
    if isinstance(value, list):
        return [document(v, depth + 1) for v in value]
    if isinstance(value, str):
        return line(value)
    return value


def argv(tokens: Iterable[str]) -> list[str]:
    """A command line with the value of every secret flag replaced by <redacted>."""
    out: list[str] = []
    hide_next = False
    for tok in tokens:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        name, eq, _value = tok.partition("=")
        if tok.startswith("--") and is_secret_flag(name):
            if eq:
                out.append(f"{name}={REDACTED}")
            else:
                out.append(tok)
                hide_next = True
            continue
        out.append(line(tok))
    return out
