"""The canary's golden answers under <state_dir>/canary/, keyed by what the model *is*.

The key is the model files' content identity plus SGLang's version (and the canary's prompt and
length): a model copied to another path keeps its golden; a model whose weights change gets a new
one. A full hash of hundreds of GB at every start would cost minutes, so the identity reads only:

- every file's relative name and size;
- every small file (config, tokenizer, index: up to SMALL_FILE_BYTES) whole;
- each safetensors file's header (tensor names, dtypes, shapes, offsets: its first 8 + N bytes);
- SAMPLES blocks of SAMPLE_BYTES spread evenly over every large file, the last one its end.

Fine-tuned, re-quantised or corrupted weights of the same shapes change bytes everywhere, so
the samples see them; a truncated or re-sharded copy changes sizes or headers. What it cannot
see is a change confined to bytes no sample reads (a single flipped weight): that is the
canary's own job, on the answer. Cost: a few MiB read per TB (docs/quality.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import secrets
import struct
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor import untrusted
from supervisor.quality import Answer, KnownResult

SMALL_FILE_BYTES = 16 << 20
SAMPLES = 16
SAMPLE_BYTES = 4096
MAX_HEADER_BYTES = 100 << 20  # safetensors caps its header at 100 MB
MAX_FILES = 100_000
IDENTITY_VERSION = "1"
_MAX_TOKENS = 1 << 20  # far beyond any canary's length
_LATEST = 1 << 34  # a wall time before the year 2514 (NaN fails the comparison too)


def model_identity(model_path: str) -> str:
    """A hex digest of the model's content identity; a path that is not a local file or
    directory (a hub id) is identified by its name."""
    h = hashlib.sha256(f"kimi-serve model identity v{IDENTITY_VERSION}\n".encode())
    root = Path(model_path)
    try:
        if root.is_file():
            files = [(root.name, root)]
        elif root.is_dir():
            found = sorted(
                (str(p.relative_to(root)), p)
                for p in root.rglob("*")
                if p.is_file() and not p.name.startswith(".")
            )
            files = found[:MAX_FILES]
        else:
            h.update(f"name {model_path}\n".encode())
            return h.hexdigest()
        for rel, path in files:
            _one_file(h, rel, path)
    except OSError as exc:
        h.update(f"unreadable {exc.__class__.__name__}\n".encode())
    return h.hexdigest()


def _one_file(h: Any, rel: str, path: Path) -> None:
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(f"file {rel} {size}\n".encode())
        if size <= SMALL_FILE_BYTES:
            h.update(f.read())
            return
        if rel.endswith(".safetensors"):
            raw = f.read(8)
            if len(raw) == 8:
                (n,) = struct.unpack("<Q", raw)
                h.update(f.read(min(n, MAX_HEADER_BYTES)))
        for i in range(SAMPLES):
            f.seek(max(0, (size - SAMPLE_BYTES) * i // (SAMPLES - 1)))
            h.update(f.read(SAMPLE_BYTES))


# The launch's flags that change the numerics, and so a golden: the parallel layout, the
# kernels, the precision, speculation. A profile that changes one (the fallback, another tp)
# has a key of its own, verified against the previous key's golden before it is learned.
LAYOUT_FLAGS = (
    "tp-size",
    "tensor-parallel-size",
    "dp-size",
    "data-parallel-size",
    "pp-size",
    "pipeline-parallel-size",
    "ep-size",
    "expert-parallel-size",
    "enable-dp-attention",
    "attention-backend",
    "quantization",
    "dtype",
    "kv-cache-dtype",
    "moe-runner-backend",
    "speculative-algorithm",
    "speculative-draft-model-path",
    "speculative-num-steps",
    "speculative-eagle-topk",
    "speculative-num-draft-tokens",
)


def layout(args: Mapping[str, object]) -> str:
    """The launch's LAYOUT_FLAGS that are set, as `flag=value` joined by spaces ("" for none)."""
    return " ".join(f"{k}={args[k]}" for k in LAYOUT_FLAGS if args.get(k) not in (None, False, ""))


def golden_key(
    identity: str, sglang_version: str, prompt: str, max_tokens: int, layout: str = ""
) -> str:
    """A launch without layout flags keeps the key it had before they were part of it."""
    raw = f"{identity}\n{sglang_version}\n{max_tokens}\n{prompt}"
    if layout:
        raw += f"\nlayout {layout}"
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Golden:
    key: str
    answer: Answer
    model_path: str
    identity: str
    sglang_version: str
    prompt: str
    max_tokens: int
    learned_at: float  # wall time
    how: str  # "learned" (first verified launch) | "accepted" (kimi-serve canary accept)
    # The known answers asked when this answer was received (quality.known_answers).
    known: tuple[KnownResult, ...] = ()
    # The previous key's golden this answer was verified against before it was learned.
    verified_against: str | None = None
    # When the write was asked for (time.time_ns()): an older write never replaces a newer one.
    generation: int = 0
    layout: str = ""  # the launch's layout flags (`layout()`), part of the key

    @property
    def known_ok(self) -> bool:
        return all(k.ok for k in self.known)

    def to_json(self) -> dict[str, Any]:
        return {
            "known": [k.to_json() for k in self.known],
            "verified_against": self.verified_against,
            "generation": self.generation,
            "layout": self.layout,
            "key": self.key,
            "answer": self.answer.to_json(),
            "model_path": self.model_path,
            "identity": self.identity,
            "sglang_version": self.sglang_version,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "learned_at": self.learned_at,
            "how": self.how,
        }

    @staticmethod
    def from_json(doc: object) -> Golden | None:
        if not isinstance(doc, dict):
            return None
        answer = Answer.from_json(doc.get("answer"))
        strings = ("key", "model_path", "identity", "sglang_version", "prompt", "how")
        if answer is None or not all(isinstance(doc.get(k), str) for k in strings):
            return None
        mt, at = doc.get("max_tokens"), doc.get("learned_at")
        # The service user writes these files and root reads them (`canary show`, `accept`):
        # a count and a wall time in range, or no golden (1e300 is a float, and no date).
        if not isinstance(mt, int) or isinstance(mt, bool) or not 0 < mt <= _MAX_TOKENS:
            return None
        if not isinstance(at, int | float) or isinstance(at, bool) or not 0 <= at < _LATEST:
            return None
        raw_known, against, gen = (
            doc.get("known"),
            doc.get("verified_against"),
            doc.get("generation"),
        )
        known = [KnownResult.from_json(k) for k in raw_known] if isinstance(raw_known, list) else []
        return Golden(
            known=tuple(k for k in known if k is not None),
            verified_against=against if isinstance(against, str) and _KEY.match(against) else None,
            generation=gen if isinstance(gen, int) and not isinstance(gen, bool) else 0,
            layout=doc["layout"] if isinstance(doc.get("layout"), str) else "",
            key=doc["key"],
            answer=answer,
            model_path=doc["model_path"],
            identity=doc["identity"],
            sglang_version=doc["sglang_version"],
            prompt=doc["prompt"],
            max_tokens=mt,
            learned_at=float(at),
            how=doc["how"],
        )


# A golden's key names its file: only what golden_key makes (a key in last.json is the service
# user's to write, and root's `canary accept` writes the golden it names).
_KEY = re.compile(r"^[0-9a-f]{32}$")
_READ_MAX = 4 * 2**20  # a golden holds one short answer; anything larger is not one
_GOLDEN = re.compile(r"^golden-[0-9a-f]{32}\.json$")


@contextlib.contextmanager
def _store_dir(directory: Path) -> Iterator[int]:
    """The store's directory, not through a link, for writing. Made only by its owner-to-be:
    the daemon makes it in its own state directory; root's CLI never makes one in the service
    user's."""
    if not directory.is_dir():
        existing = next((p for p in directory.parents if p.is_dir()), Path("/"))
        if existing.stat().st_uid == os.geteuid():
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    with untrusted.opened_dir(directory) as dfd:
        yield dfd


# Held from the check of the file's generation to its rename: of two writes of one name by this
# process, the newer one lands, whichever thread finishes last (the daemon abandons a write at
# its deadline: threads.in_thread, and its thread may still finish after a newer write).
_WRITE_LOCK = threading.Lock()


def _generation(directory: Path, name: str) -> int:
    doc = _read_json(directory, name)
    gen = doc.get("generation") if isinstance(doc, dict) else None
    return gen if isinstance(gen, int) and not isinstance(gen, bool) else 0


def _write_json(directory: Path, name: str, doc: dict[str, Any]) -> None:
    """Write `name` in `directory` in one step (temporary file, fsync, rename), all relative to
    the directory's descriptor: a name swapped meanwhile cannot redirect it. A document whose
    `generation` is older than the file's is dropped (a write that outlived its deadline).
    When root writes into another user's directory (`sudo kimi-serve canary accept` in the
    service user's), the file is that user's: the daemon must read and replace it (a root-owned
    0600 golden reads as none)."""
    with _store_dir(directory) as dfd:
        st = os.fstat(dfd)
        owner = (st.st_uid, st.st_gid) if os.geteuid() == 0 and st.st_uid != 0 else None
        tmp = f".tmp-{secrets.token_hex(8)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
        try:
            if owner is not None:
                os.fchown(fd, *owner)
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            with _WRITE_LOCK:
                gen = doc.get("generation")
                if isinstance(gen, int) and gen < _generation(directory, name):
                    os.unlink(tmp, dir_fd=dfd)
                    return
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise


def _read_json(directory: Path, name: str) -> object:
    """The document, or None for anything that is not one: no file, a link, a FIFO, more than
    _READ_MAX, not JSON (any depth)."""
    try:
        with untrusted.opened_dir(directory) as dfd:
            return untrusted.loads(untrusted.read_file(name, _READ_MAX, dir_fd=dfd))
    except (OSError, ValueError):
        return None


class CanaryStore:
    """<dir>/golden-<key>.json, one per identity; <dir>/last.json, the last answer received
    (what `kimi-serve canary accept` takes); <dir>/current.json names the key in use."""

    def __init__(self, directory: str) -> None:
        self.dir = Path(directory)

    def golden(self, key: str) -> Golden | None:
        if not _KEY.match(key):
            return None
        g = Golden.from_json(_read_json(self.dir, f"golden-{key}.json"))
        return g if g is not None and g.key == key else None

    def save_golden(self, golden: Golden) -> None:
        if not _KEY.match(golden.key):
            raise ValueError(f"not a golden key: {golden.key!r}")
        _write_json(self.dir, f"golden-{golden.key}.json", golden.to_json())

    def save_last(self, golden: Golden) -> None:
        """The last received answer, as the golden it would be if accepted."""
        _write_json(self.dir, "last.json", golden.to_json())

    def last(self) -> Golden | None:
        g = Golden.from_json(_read_json(self.dir, "last.json"))
        return g if g is not None and _KEY.match(g.key) else None

    def accept(self, last: Golden | None = None) -> Golden | None:
        """`canary accept`: the last received answer (or `last`, as shown to the operator)
        becomes the golden for its key."""
        last = self.last() if last is None else last
        if last is None:
            return None
        accepted = dataclasses.replace(
            last, how="accepted", learned_at=time.time(), generation=time.time_ns()
        )
        self.save_golden(accepted)
        return accepted

    def previous(self, prompt: str, max_tokens: int, key: str) -> Golden | None:
        """The newest golden of another key for the same prompt and length: what a changed key
        (another SGLang version, other model files) is verified against before it learns."""
        same = [
            g
            for g in self.goldens()
            if g.key != key and g.prompt == prompt and g.max_tokens == max_tokens
        ]
        return max(same, key=lambda g: g.learned_at) if same else None

    def forget(self) -> list[str]:
        """`canary forget`: every golden is removed, and the last received answer with them
        (`accept` after `forget` cannot put back what was just forgotten)."""
        removed: list[str] = []
        try:
            with untrusted.opened_dir(self.dir) as dfd:
                for name in sorted(os.listdir(dfd)):
                    golden = name.startswith("golden-") and name.endswith(".json")
                    if not golden and name != "last.json":
                        continue
                    with contextlib.suppress(OSError):  # gone meanwhile, or not a file
                        os.unlink(name, dir_fd=dfd)
                        removed.append(name)
        except FileNotFoundError:
            pass  # no store yet: nothing to forget
        return removed

    def goldens(self) -> list[Golden]:
        try:
            with untrusted.opened_dir(self.dir) as dfd:
                names = sorted(n for n in os.listdir(dfd) if _GOLDEN.match(n))
        except OSError:
            return []
        out = [Golden.from_json(_read_json(self.dir, n)) for n in names]
        return [g for g in out if g is not None]


def default_dir(state_dir: str) -> str:
    return os.path.join(state_dir, "canary")


# The store's atomic JSON, for the daemon's other stores (daemon/upgrades.py).
write_json = _write_json
read_json = _read_json
