"""SGLang's API key: read from `sglang.api_key_file`, handed to SGLang where `ps` cannot see
it, and sent on every request kimi-serve makes to SGLang.

SGLang 0.5.23 reads the key only from its arguments (`--api-key`; no environment variable,
srt/arg_groups/fields/serving.py:160), so a key on the command line is in every local user's
`ps`. Its `--config FILE` (srt/server_args.py:402, merged by
srt/utils/server_args_config_parser.py:75) reads arguments from a YAML file instead: the
daemon writes `api-key: <key>` into `<state_dir>/sglang-secrets.yaml` (mode 0600, the service
user's) before each launch, and `ps` shows `--config <that path>` (docs/sglang.md).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Generator

import httpx
import yaml

from supervisor import secret_files, untrusted
from supervisor.config import Config, key_file_problem
from supervisor.sglang.argv import secrets_path

MAX_KEY_BYTES = 4096


class KeyFileError(Exception):
    pass


def read(path: str, *, owners: tuple[int, ...] | None = None) -> str:
    """The key in `path`: one line, checked like the admin token file (a regular file nobody
    but its owner and group can read, nobody else can write, owned by `owners`: default the
    service user, i.e. us, or root). Raises KeyFileError naming the problem."""
    allowed = (os.geteuid(), 0) if owners is None else owners
    # Links and directories walked as for the admin token (secret_files.resolve): root's CLI
    # must not follow a link the service user planted to a file of root's choosing.
    trusted = frozenset({os.geteuid(), 0, *allowed}) | (
        secret_files.service_uids(path) if owners == () else frozenset()
    )
    try:
        f, st, _ = secret_files.open_resolved(path, trusted, "sglang.api_key_file")
    except secret_files.TokenFileError as exc:
        raise KeyFileError(str(exc)) from None
    with f:
        problem = key_file_problem(st)
        if not problem and allowed and st.st_uid not in allowed:
            problem = f"belongs to uid {st.st_uid}: only the service user or root may own it"
        if problem:
            raise KeyFileError(f"{path} {problem}")
        raw = f.read(MAX_KEY_BYTES + 1)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise KeyFileError(f"{path} is not UTF-8 text") from None
    lines = text.splitlines()
    key = lines[0].strip() if lines else ""
    if len(raw) > MAX_KEY_BYTES or len([ln for ln in lines if ln.strip()]) != 1 or not key:
        raise KeyFileError(f"{path} must hold the key alone, on one line")
    if any(c.isspace() or not c.isprintable() for c in key):
        raise KeyFileError(f"{path}: the key may not contain spaces or control characters")
    return key


def configured_key(cfg: Config, owners: tuple[int, ...] | None = None) -> str | None:
    """The key SGLang is launched with: the file's, else an `api-key` in sglang.args (which
    `ps` shows; `kimi-serve check` warns). `owners`: as read()'s (() for root's CLI)."""
    if cfg.sglang.api_key_file:
        return read(cfg.sglang.api_key_file, owners=owners)
    value = cfg.sglang.args.get("api-key")
    return value if isinstance(value, str) and value else None


def write_secrets(state_dir: str, key: str) -> str:
    """`<state_dir>/sglang-secrets.yaml` holding `api-key`, mode 0600, replaced atomically."""
    target = secrets_path(state_dir)
    fd, tmp = tempfile.mkstemp(dir=state_dir, prefix=".sglang-secrets-", suffix=".yaml")
    try:
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump({"api-key": key}, f)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target


def launched_key(cfg: Config) -> tuple[str | None, str | None]:
    """The key a running SGLang was launched with, for the daemon that adopts it after a
    hand-over, and what went wrong finding it (None when nothing did). With
    `sglang.api_key_file`: the key the launch wrote into `<state_dir>/sglang-secrets.yaml`
    (SGLang read it then; the key file may have changed since), else the key file's; without:
    the `api-key` of sglang.args. The secrets file is read as hostile input: at most
    MAX_KEY_BYTES, a mapping whose `api-key` is one printable string."""
    if cfg.sglang.api_key_file:
        written = _written_key(secrets_path(cfg.state_dir))
        if written is not None:
            return written, None
    try:
        return configured_key(cfg), None
    except KeyFileError as exc:
        return None, f"sglang.api_key_file: {exc}"


def _written_key(path: str) -> str | None:
    try:
        raw = untrusted.read_file(path, MAX_KEY_BYTES)  # regular, no link, no FIFO, bounded
        doc = yaml.safe_load(raw.decode("utf-8"))
    except (OSError, ValueError, yaml.YAMLError):  # UnicodeDecodeError is a ValueError
        return None
    key = doc.get("api-key") if isinstance(doc, dict) else None
    if (
        not isinstance(key, str)
        or not key
        or not all(c.isprintable() and not c.isspace() for c in key)
    ):
        return None
    return key


class Bearer(httpx.Auth):
    """`Authorization: Bearer <key>` on requests to SGLang's own address only (a group peer, a
    router never see SGLang's key), unless the request carries its own Authorization."""

    def __init__(self, base_url: str, key: str) -> None:
        url = httpx.URL(base_url)
        self.origin = (url.scheme, url.host, url.port)
        self.key = key

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        url = request.url
        if (url.scheme, url.host, url.port) == self.origin and "authorization" not in (
            request.headers
        ):
            request.headers["Authorization"] = f"Bearer {self.key}"
        yield request


def auth_for(
    cfg: Config, base_url: str, owners: tuple[int, ...] | None = None
) -> httpx.Auth | None:
    key = configured_key(cfg, owners)
    return None if key is None else Bearer(base_url, key)
