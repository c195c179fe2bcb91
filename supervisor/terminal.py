"""Untrusted text on an operator's terminal: what SGLang, a peer, a file or an admin answer
sent is shown with every character that could drive the terminal or hide text made visible.

- `shown(text)`: one value. Control characters (C0, DEL, C1), format characters (bidi
  overrides and isolates, zero-width ones, the BOM), line and paragraph separators and private
  use characters are escaped, never deleted (on-call must see that something was there), as
  `\\n`, `\\r`, `\\t`, `\\e` (ESC), `\\xNN`, `\\uNNNN` or `\\UNNNNNNNN`; a backslash becomes
  `\\\\`, so an escape shown can always be told from text that looks like one. A value over
  `limit` bytes is cut, saying how many bytes were left out.
- `log_line(text)`: a line SGLang printed: as `shown`, but a line redrawn with `\\r` (a tqdm
  progress bar) shows its last drawing, marked `[redrawn N times]`, as a terminal would have
  left it.
- `sanitized(doc)`: every string of a JSON document (keys included) through `shown`: what a
  human-readable rendering is built from.
- `Guard`: a command's stdout and stderr: anything written that still holds such a character
  is escaped there (newlines and tabs pass: the command's own layout), the last line of
  defence for text that did not go through `shown`. `redraw` is the one way to rewrite the
  current line (`--wait`'s progress on a terminal).

Legitimate text passes unchanged: letters of any script, `●`, `…`, emoji.
"""

from __future__ import annotations

import io
import unicodedata
from typing import Any, TextIO

# Unicode categories escaped: controls, format characters (bidi, zero-width), separators
# that break lines, private use and unassigned code points, surrogates.
UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Co", "Cn", "Cs"})
NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\x1b": "\\e", "\\": "\\\\"}
DEFAULT_LIMIT = 4096  # bytes of one value shown


def unsafe(c: str) -> bool:
    return unicodedata.category(c) in UNSAFE_CATEGORIES


def escape_char(c: str) -> str:
    named = NAMED.get(c)
    if named is not None:
        return named
    n = ord(c)
    if n < 0x100:
        return f"\\x{n:02x}"
    if n < 0x10000:
        return f"\\u{n:04x}"
    return f"\\U{n:08x}"


def collapse_redraws(text: str) -> str:
    """`a\\rab\\rabc` -> `abc [redrawn 2 times]`: what a terminal would have left."""
    if "\r" not in text:
        return text
    lines = []
    for line in text.split("\n"):
        drawings = [d for d in line.split("\r") if d]
        if len(drawings) > 1:
            lines.append(f"{drawings[-1]} [redrawn {len(drawings) - 1} times]")
        else:
            lines.append(drawings[0] if drawings else "")
    return "\n".join(lines)


def log_line(text: object, limit: int = DEFAULT_LIMIT) -> str:
    """A line SGLang printed, as it may reach a terminal: see the module."""
    return shown(collapse_redraws(text if isinstance(text, str) else str(text)), limit)


def shown(text: object, limit: int = DEFAULT_LIMIT) -> str:
    """`text` (str() of anything else) as it may reach a terminal: see the module."""
    s = text if isinstance(text, str) else str(text)
    out = "".join(escape_char(c) if c in NAMED or unsafe(c) else c for c in s)
    data = out.encode("utf-8", "backslashreplace")
    if limit and len(data) > limit:
        kept = data[:limit].decode("utf-8", "ignore")
        return f"{kept}… ({len(data) - len(kept.encode())} bytes more)"
    return out


def sanitized(doc: Any, limit: int = DEFAULT_LIMIT) -> Any:
    """`doc` with every string in it (keys included) through `shown`."""
    if isinstance(doc, str):
        return shown(doc, limit)
    if isinstance(doc, dict):
        return {
            shown(k, limit) if isinstance(k, str) else k: sanitized(v, limit)
            for k, v in doc.items()
        }
    if isinstance(doc, list | tuple):
        return [sanitized(v, limit) for v in doc]
    return doc


class Wrapped(io.TextIOBase):
    """A text stream passed through to `stream`: what every wrapper of a command's stdout or
    stderr shares (the log's setup asks isatty and fileno of its stream)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", "utf-8")

    def write(self, s: str) -> int:
        return self._stream.write(s)

    def flush(self) -> None:
        self._stream.flush()


class Guard(Wrapped):
    """A text stream that escapes, in whatever is written, every character `shown` would,
    but for newlines and tabs (see the module)."""

    def write(self, s: str) -> int:
        self._stream.write(
            "".join(escape_char(c) if c not in "\n\t" and unsafe(c) else c for c in s)
        )
        return len(s)

    def redraw(self, line: str) -> None:
        """Rewrite the terminal's current line with `line` (escaped)."""
        self._stream.write("\r" + shown(line) + "\x1b[K")
        self._stream.flush()
