"""Configuration, the YAML reader: the line of every key path, durations, sizes and addresses,
`_Reader` (each value read with its key path and line at hand, every problem collected), the
value converters the sections share, and `${VAR}` expansion.

The section parsers (`config_sections`) are written in these terms; nothing here knows a section.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
import stat
import urllib.parse
from collections.abc import Callable
from typing import Any, TypeVar

import yaml

from supervisor.config.types import ConfigIssue

# `${NAME}` in a string value of sglang.args / profiles.*.args, group.peers and group.leader:
# filled in from the daemon's environment when the file is read, so one file serves every node
# of a multi-node replica (a LeaderWorkerSet gives each pod LWS_WORKER_INDEX and
# LWS_LEADER_ADDRESS).
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


# --------------------------------------------------------------------------------------------
# The line of every key; YAML errors
# --------------------------------------------------------------------------------------------


def _marks(root: yaml.Node | None) -> tuple[dict[str, int], list[ConfigIssue]]:
    """The line of every key path, and the keys written twice in one mapping (PyYAML keeps
    the last silently, so a second `port:` further down would quietly win)."""
    marks: dict[str, int] = {}
    twice: list[ConfigIssue] = []
    seen: set[int] = set()

    def walk(node: yaml.Node, path: str) -> None:
        # An alias is the same node again: walk it once (a recursive or exponential
        # alias would otherwise never finish).
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            for key_node, value_node in node.value:
                key = str(key_node.value)
                sub = f"{path}.{key}" if path else key
                line = key_node.start_mark.line + 1
                ident = (key_node.tag, key)
                if ident in first and key_node.tag != "tag:yaml.org,2002:merge":
                    twice.append(
                        ConfigIssue(sub, line, f"is set twice (first on line {first[ident]})")
                    )
                first.setdefault(ident, line)
                marks[sub] = line
                walk(value_node, sub)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                sub = f"{path}[{i}]"
                marks[sub] = item.start_mark.line + 1
                walk(item, sub)

    if root is not None:
        marks[""] = root.start_mark.line + 1
        walk(root, "")
    return marks, twice


def _yaml_issue(exc: yaml.YAMLError, text: str) -> ConfigIssue:
    mark = getattr(exc, "problem_mark", None)
    line = mark.line + 1 if mark is not None else None
    if isinstance(exc, yaml.reader.ReaderError):  # a control character: it has a position only
        line = text.count("\n", 0, exc.position) + 1
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    # An unclosed quote or bracket is found only at the end of the file; where it was opened
    # is the line to fix.
    context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and start is not None and start.line + 1 != line:
        problem = f"{context} (line {start.line + 1}): {problem}"
    return ConfigIssue("", line, f"invalid YAML: {problem}")


# --------------------------------------------------------------------------------------------
# Scalars
# --------------------------------------------------------------------------------------------


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: object) -> float:
    """`500ms`, `30s`, `5m`, `1h` or a number of seconds -> seconds. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 30s, 5m, 1h or 500ms, got a boolean")
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:
            raise ValueError("is too long for a duration") from None
        if seconds < 0:
            raise ValueError(f"{value!r} is negative; a duration is 0 or more")
    elif isinstance(value, str):
        m = _DURATION.match(value)
        if not m:
            raise ValueError(
                f"{value!r} is not a duration; write it as 500ms, 30s, 5m, 1h or seconds"
            )
        seconds = float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
    else:
        raise ValueError(f"expected a duration such as 30s, got {type(value).__name__}")
    if not math.isfinite(seconds):
        raise ValueError(f"{value!r} is too long for a duration")
    return seconds


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*$")
_UNIT_BYTES = {
    None: 1,
    "B": 1,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}


def parse_size(value: object) -> int:
    """`512MiB`, `1GiB`, `100MB` or a number of bytes -> bytes. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 256MiB or 1GiB, got a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{value} is negative; a size is 0 or more")
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            return int(float(m.group(1)) * _UNIT_BYTES[m.group(2)])
    raise ValueError(f"{value!r} is not a size; write it as 256MiB, 1GiB, 100MB or bytes")


def parse_listen(value: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host, port). Raises ValueError."""
    m = re.match(r"^\[(?P<h6>[^\]]+)\]:(?P<p6>\d+)$|^(?P<h>[^:\[\]]+):(?P<p>\d+)$", value)
    if not m:
        raise ValueError(f"{value!r} is not host:port (e.g. 127.0.0.1:29400 or [::1]:29400)")
    host = m.group("h6") or m.group("h")
    port = int(m.group("p6") or m.group("p"))
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is out of range 1-65535")
    return host, port


# --------------------------------------------------------------------------------------------
# The reader: walks the raw YAML with the key path and line of every value at hand
# --------------------------------------------------------------------------------------------


T = TypeVar("T")
_MISSING = object()


class _Reader:
    def __init__(self, file: str, marks: dict[str, int]) -> None:
        self.file = file
        self.marks = marks
        self.issues: list[ConfigIssue] = []

    def line(self, path: str) -> int | None:
        # The value's own line, else the closest enclosing key's.
        while path not in self.marks:
            path = path.rpartition(".")[0]
            if not path:
                return None  # a missing top-level key: no line to point at
        return self.marks[path]

    def error(self, path: str, message: str) -> None:
        self.issues.append(ConfigIssue(path, self.line(path), message))

    def section(self, raw: object, path: str, known: tuple[str, ...]) -> dict[str, Any]:
        """A mapping whose keys must all be known; unknown keys get a did-you-mean hint."""
        if raw is None:
            return {}
        if not isinstance(raw, dict):
            what = "" if path else "the top level: "
            self.error(path, f"{what}expected a mapping of {', '.join(known)}; got {_kind(raw)}")
            return {}
        for key in raw:
            if not isinstance(key, str):
                self.error(path, f"key {key!r} is not a string")
            elif key not in known:
                sub = f"{path}.{key}" if path else key
                close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                self.error(sub, f"unknown key {key!r}{hint} (known: {', '.join(known)})")
        return raw

    def get(
        self,
        raw: dict[str, Any],
        path: str,
        key: str,
        conv: Callable[[object], T],
        default: object = _MISSING,
    ) -> T:
        sub = f"{path}.{key}" if path else key
        if key not in raw:
            if default is _MISSING:
                self.error(sub, "is required but missing")
                return None  # type: ignore[return-value]
            return default  # type: ignore[return-value]
        try:
            return conv(raw[key])
        except (TypeError, ValueError) as exc:
            self.error(sub, str(exc))
            return None  # type: ignore[return-value]


def _kind(value: object) -> str:
    if value is None:
        return "nothing (null)"
    kinds = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}
    kinds |= {int: "an integer", float: "a number"}
    return kinds.get(type(value), f"a {type(value).__name__}")


def _string(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a non-empty string, got {_kind(value)}")
    return value


def _opt_string(value: object) -> str | None:
    return None if value is None else _string(value)


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {_kind(value)}")
    return value


def _int_in(lo: int, hi: int | None = None) -> Callable[[object], int]:
    def conv(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected a whole number, got {_kind(value)}")
        if value < lo or (hi is not None and value > hi):
            rng = f"{lo}-{hi}" if hi is not None else f">= {lo}"
            raise ValueError(f"{value} is out of range {rng}")
        return value

    return conv


def _positive_duration(value: object) -> float:
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError(f"must be greater than zero, got {value!r}")
    return seconds


def _choice(*choices: str) -> Callable[[object], str]:
    def conv(value: object) -> str:
        if value not in choices:
            close = difflib.get_close_matches(str(value), choices, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}{hint}")
        return str(value)

    return conv


def _regex(value: object) -> str:
    text = _string(value)
    try:
        re.compile(text)
    except re.error as exc:
        raise ValueError(f"{text!r} is not a valid regular expression: {exc}") from None
    return text


def _opt_regex(value: object) -> str | None:
    return None if value is None else _regex(value)


def _string_list(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"expected a list of strings, got {_kind(value)}")
    return tuple(value)


def _regex_list(value: object) -> tuple[str, ...]:
    return tuple(_regex(v) for v in _string_list(value))


def _host(value: object) -> str:
    text = _string(value)
    if any(c.isspace() for c in text) or "/" in text:
        raise ValueError(f"{text!r} is not a host name or address")
    return text


# --------------------------------------------------------------------------------------------
# ${VAR} from the environment
# --------------------------------------------------------------------------------------------


def _expand_env(r: _Reader, path: str, value: T) -> T:
    """`${NAME}` in a string replaced by the variable's value; unset or empty is an error."""
    if not isinstance(value, str) or "${" not in value:
        return value

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        got = os.environ.get(name)
        if not got:
            how = "is empty" if got == "" else "is not set"
            r.error(path, f"{value!r} needs the environment variable {name}, which {how}")
            return m.group(0)
        return got

    return _ENV_REF.sub(one, value)  # type: ignore[return-value]


def _env_filled(text: str) -> str:
    """`${NAME}` in a group URL filled in from the environment (as in sglang.args)."""

    def one(m: re.Match[str]) -> str:
        got = os.environ.get(m.group(1))
        if not got:
            how = "is empty" if got == "" else "is not set"
            raise ValueError(f"{text!r} needs the environment variable {m.group(1)}, which {how}")
        return got

    return _ENV_REF.sub(one, text)


# --------------------------------------------------------------------------------------------
# Paths, addresses, URLs and files
# --------------------------------------------------------------------------------------------


def _opt_absolute_path(value: object) -> str | None:
    if value is None:
        return None
    text = _string(value)
    if not os.path.isabs(text):
        raise ValueError(f"{text!r} is not an absolute path")
    return text


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address; a name other than localhost counts as remote."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "0.0.0.0", "::", "")


def _http_url(value: object) -> str:
    text = _string(value).strip()
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{text!r} is not an http:// or https:// URL")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{text!r} has an invalid port") from None
    if not parts.hostname or (port is not None and not 1 <= port <= 65535):
        raise ValueError(f"{text!r} names no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{text!r} must be scheme://host:port only, without a path")
    return text.rstrip("/")


def _opt_http_url(value: object) -> str | None:
    return None if value is None else _http_url(value)


def _readable_file(value: object) -> str:
    text = _string(value)
    try:
        with open(text, "rb"):
            pass
    except FileNotFoundError:
        raise ValueError(f"{text!r} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"{text!r} is a directory, not a file") from None
    except PermissionError:
        raise ValueError(f"{text!r} is not readable by this user") from None
    except OSError as exc:
        raise ValueError(f"{text!r} cannot be read: {exc.strerror}") from None
    return text


def key_file_problem(st: os.stat_result) -> str:
    """Why a file holding a secret may leak or be swapped; "" when its mode is fine."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o007:
        return f"is mode {mode:04o}: others may read or write it (0600, 0400 or 0440 is required)"
    if mode & 0o020:
        return f"is mode {mode:04o}: its group may write it (0600, 0400 or 0440 is required)"
    return ""


def _opt_key_file(value: object) -> str | None:
    if value is None:
        return None
    text = _readable_file(value)
    if not os.path.isabs(text):
        raise ValueError(f"{text!r} must be an absolute path")
    problem = key_file_problem(os.stat(text))
    if problem:
        raise ValueError(f"{text!r} {problem}")
    return text


def _opt_readable_file(value: object) -> str | None:
    return None if value is None else _readable_file(value)


def is_loopback_url(url: str) -> bool:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    return host in _LOOPBACK_HOSTS or host.startswith("127.")
