"""Configuration, the values: durations, sizes and addresses, the converters every setting
names (each takes the raw YAML value and returns the typed one, or raises ValueError with the
message the operator reads), and `${VAR}` expansion.

Nothing here knows a section or a key: `settings` pairs each key with its converter.
"""

from __future__ import annotations

import difflib
import importlib
import ipaddress
import math
import os
import re
import stat
import urllib.parse
from collections.abc import Callable
from typing import Any

# `${NAME}` in a string value of sglang.args / profiles.*.args, group.peers and group.leader:
# filled in from the daemon's environment when the file is read, so one file serves every node
# of a multi-node replica (a LeaderWorkerSet gives each pod LWS_WORKER_INDEX and
# LWS_LEADER_ADDRESS).
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")

# --------------------------------------------------------------------------------------------
# Durations, sizes, addresses
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
# Converters
# --------------------------------------------------------------------------------------------


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


try:  # CPython's own regex parser, to see a pattern's shape
    _sre: Any = importlib.import_module("re._parser")
except ImportError:  # pragma: no cover - other interpreters: only re.compile's checks
    _sre = None


def backtracking_risk(pattern: str) -> str | None:
    """Why `pattern` may take time exponential in a line's length on the event loop (`re`
    backtracks, holding the GIL for the whole match), or None: a repeat inside a repeat
    (`(a+)+`, `(\\w*\\s?)*`), an alternation inside a repeat (`(a|ab)*`), a backreference."""
    if _sre is None:
        return None
    repeats = (_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", None))

    def walk(items: Any, in_repeat: bool) -> str | None:
        for op, av in items:
            if op in (_sre.GROUPREF, _sre.GROUPREF_EXISTS):
                return "a backreference"
            if op in repeats and op is not None:
                _lo, hi, sub = av
                many = hi is _sre.MAXREPEAT or hi > 1
                if in_repeat and many and op is not getattr(_sre, "POSSESSIVE_REPEAT", None):
                    return "a repeat inside a repeat"
                found = walk(sub, in_repeat or (many and op is not repeats[2]))
                if found:
                    return found
            elif op is _sre.BRANCH:
                if in_repeat:
                    return "an alternation inside a repeat"
                for branch in av[1]:
                    if found := walk(branch, in_repeat):
                        return found
            elif op is _sre.SUBPATTERN:
                if found := walk(av[3], in_repeat):
                    return found
            elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
                if found := walk(av[1], in_repeat):
                    return found
            elif op is getattr(_sre, "ATOMIC_GROUP", None):
                continue  # an atomic group never backtracks into itself
        return None

    try:
        return walk(_sre.parse(pattern), False)
    except (re.error, RecursionError, ValueError, TypeError):
        return None  # re.compile judged it already; no shape to tell


def _linear_regex_list(value: object) -> tuple[str, ...]:
    """Regexes run on every SGLang line: each compiled, and none that can backtrack without
    bound (`backtracking_risk`)."""
    out = _regex_list(value)
    for i, text in enumerate(out):
        why = backtracking_risk(text)
        if why:
            raise ValueError(
                f"[{i}] {text!r} has {why}: on a long line it can stall the daemon for"
                " minutes (write it without nesting, e.g. `a+b` for `(a+)+b`, or make the"
                " inner repeat possessive, `(?:a++)`)"
            )
    return out


def _host(value: object) -> str:
    text = _string(value)
    if any(c.isspace() for c in text) or "/" in text:
        raise ValueError(f"{text!r} is not a host name or address")
    return text


# --------------------------------------------------------------------------------------------
# ${VAR} from the environment
# --------------------------------------------------------------------------------------------


def expand_env(text: str) -> tuple[str, list[str]]:
    """`${NAME}` in `text` replaced by the variable's value, and one problem for each variable
    that is unset or empty (its reference is then left as written)."""
    problems: list[str] = []

    def one(m: re.Match[str]) -> str:
        got = os.environ.get(m.group(1))
        if not got:
            how = "is empty" if got == "" else "is not set"
            problems.append(f"{text!r} needs the environment variable {m.group(1)}, which {how}")
            return m.group(0)
        return got

    return _ENV_REF.sub(one, text), problems


def _env_filled(text: str) -> str:
    """`text` with `${NAME}` filled in; a variable unset or empty is the ValueError."""
    filled, problems = expand_env(text)
    if problems:
        raise ValueError(problems[0])
    return filled


def _http_url_list(value: object) -> tuple[str, ...]:
    """A list of http(s) URLs, `${NAME}` filled in (group.peers)."""
    return tuple(_http_url(_env_filled(u)) for u in _string_list(value))


def _opt_env_http_url(value: object) -> str | None:
    """An http(s) URL, `${NAME}` filled in (group.leader)."""
    return None if value is None else _http_url(_env_filled(_string(value)))


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


# --------------------------------------------------------------------------------------------
# Converters of one key each
# --------------------------------------------------------------------------------------------


def _listen(value: object) -> tuple[str, int]:
    return parse_listen(_string(value))


def _devices(value: object) -> str | tuple[int | str, ...]:
    if value == "all":
        return "all"
    if isinstance(value, list) and value:
        out: list[int | str] = []
        for v in value:
            index = isinstance(v, int) and not isinstance(v, bool) and v >= 0
            if index or (isinstance(v, str) and v.startswith(("GPU-", "MIG-"))):
                out.append(v)
            else:
                raise ValueError(
                    f"device {v!r} is neither an index (0, 1, ...) nor a UUID (GPU-...)"
                )
        if len(set(out)) != len(out):
            raise ValueError("the device list names a GPU twice")
        return tuple(out)
    raise ValueError(f"expected 'all' or a non-empty list of indexes/UUIDs, got {_kind(value)}")


def _prewarm(value: object) -> str:
    # YAML 1.1 reads a bare `off` as false.
    return "off" if value is False else _choice("auto", "off")(value)


def _floor(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"expected a number, got {_kind(value)}")
    if not 1.0 <= value <= 64.0:
        raise ValueError(f"{value} is out of range 1-64 (a mean accept length, in tokens)")
    return float(value)
