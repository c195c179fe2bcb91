"""The admin endpoint's bearer token: one file, readable by the service user (and root) only.

The daemon creates it on its first start (`ensure`), the CLI reads it (`read_for_client`).
The token itself never appears in a log line, an error message or an exception.

An existing file that others could read (or that another user owns) is refused, not repaired:
whoever could read it may already hold the token, so a chmod would hide a leak. The operator
removes the file and the daemon writes a fresh one (docs/security.md). A symbolic link (a
Kubernetes Secret volume is made of them) is followed only where nobody but root and the
service user could have made it or could swap what it points to (`resolve`).
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

TOKEN_BYTES = 32  # secrets.token_urlsafe(32): 43 characters
MIN_LENGTH = 32  # an operator-written token must be as long as ours, about
MAX_FILE_BYTES = 4096
MAX_LINKS = 40  # as the kernel's own limit on a path (ELOOP)
_ALLOWED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~+/=")


class TokenFileError(OSError):
    """The token file cannot be used; the message names the file and what to do."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EACCES, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Token:
    """A loaded token and the identity of the file it came from (to notice a rotation)."""

    value: str
    # (st_dev, st_ino, st_mtime_ns, st_ctime_ns): a new file, new content, or a chmod/chown
    identity: tuple[int, int, int, int]

    def matches(self, presented: str) -> bool:
        # Constant time in the presented value: a timing oracle must not reveal a prefix.
        try:
            given = presented.encode("ascii")
        except UnicodeEncodeError:
            # Bytes that are not UTF-8 reach us as lone surrogates (aiohttp decodes headers
            # with surrogateescape); no token is anything but ASCII: simply wrong.
            return False
        return hmac.compare_digest(self.value.encode(), given)


def ensure(path: str) -> Token:
    """The daemon's start: create the file if absent (0600, atomic), then load and check it."""
    if not os.path.lexists(path):
        _create(path)
    return load(path)


def _create(path: str) -> None:
    target = Path(path)
    check_directory(target.parent)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
    except OSError as exc:
        raise TokenFileError(f"cannot create the admin token file {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)  # whatever the umask
            f.write(secrets.token_urlsafe(TOKEN_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
        # link() never replaces: if another process created the file meanwhile, its token wins
        # and ours is discarded, so two starters never hand out different tokens.
        with contextlib.suppress(FileExistsError):
            os.link(tmp, target)
    except OSError as exc:
        raise TokenFileError(f"cannot create the admin token file {path}: {exc.strerror}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    dir_fd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def check_directory(directory: Path) -> None:
    """Refuse a directory for the token that someone other than us (or root) could write."""
    try:
        st = directory.stat()
    except OSError as exc:
        raise TokenFileError(
            f"cannot create the admin token file in {directory}: {exc.strerror}"
        ) from None
    if st.st_uid not in (0, os.geteuid()) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise TokenFileError(
            f"{directory} (where the admin token file goes) is writable by others "
            f"(mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}): someone else could "
            "replace the token; use a directory only the service user can write "
            "(admin.token_file or state_dir)"
        )


def load(path: str) -> Token:
    """Read and check the file as the daemon: a regular file, ours, mode 0600 or stricter.

    A symbolic link is followed only where nobody but root and the service user could have
    made or changed it (`resolve`), as a Kubernetes Secret volume mounts its keys
    (`token -> ..data/token`, `..data -> ..<timestamp>`); the checks apply to the file at the
    end of the chain."""
    f, st, where = open_resolved(path, frozenset({0, os.geteuid()}), "admin token file")
    with f:
        problem = _permission_problem(st)
        if problem:
            raise TokenFileError(
                f"admin token file {where} {problem}; the token may have leaked: remove the "
                "file (the daemon writes a new one at start) or fix it (chown to the service "
                "user, chmod 600; a Kubernetes Secret: defaultMode 0400) if you are sure "
                "nobody read it"
            )
        data = f.read(MAX_FILE_BYTES + 1)
    return Token(_parse(path, data), _identity(st))


def open_resolved(
    path: str, trusted: frozenset[int], what: str
) -> tuple[BinaryIO, os.stat_result, str]:
    """The file at the end of `path`'s chain (`resolve`), open, with its fstat and a name for
    messages; never a file swapped in between the walk and the open."""
    real, seen = resolve(path, trusted, what)
    where = path if real == path else f"{path} (-> {real})"
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise TokenFileError(f"cannot read the {what} {where}: {exc.strerror}") from None
    f = os.fdopen(fd, "rb")
    st = os.fstat(f.fileno())
    if (st.st_dev, st.st_ino) != (seen.st_dev, seen.st_ino):
        f.close()
        # Swapped between the walk and the open: by root or us (nobody else can), e.g. a
        # Secret's rotation. The next read sees the new one.
        raise TokenFileError(f"{what} {where} changed while it was read; retry")
    return f, st, where


def resolve(
    path: str, trusted: frozenset[int] | None = None, what: str = "admin token file"
) -> tuple[str, os.stat_result]:
    """The file `path` names, links followed one component at a time, and its lstat.

    Every directory on the way must belong to root or the service user and be writable by
    nobody else, except a sticky one (the mount point of a Kubernetes Secret volume is a
    tmpfs of mode 1777) whose entry we use belongs to root or the service user: the sticky bit
    keeps others from renaming or removing it. Every link followed must belong to root or the
    service user. So nobody else can point the path at a file of their choosing, now or by a
    later swap. TokenFileError names the component that breaks the rule. `trusted`: the uids
    taken for root and the service user (default root and this process's user)."""
    ok = trusted if trusted is not None else frozenset({0, os.geteuid()})
    me = _service(ok)
    # Not os.path.abspath: it drops "x/.." before x is known to be a directory or a link.
    full = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    todo = [c for c in reversed(full.split("/")) if c]
    current = "/"
    dir_st = _lstat(path, current, what)
    links = 0
    while True:
        _check_dir(path, current, dir_st, ok, what)
        if not todo:
            raise TokenFileError(f"{what} {path} is a directory")
        name = todo.pop()
        if name == ".":
            continue
        if name == "..":
            current = os.path.dirname(current)
            dir_st = _lstat(path, current, what)
            continue
        entry = os.path.join(current, name)
        st = _lstat(path, entry, what)
        if dir_st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and st.st_uid not in ok:
            raise TokenFileError(
                f"{what} {path}: {entry} belongs to uid {st.st_uid} in a directory "
                f"others can write ({current}); refusing it"
            )
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_LINKS:
                raise TokenFileError(f"{what} {path}: more than {MAX_LINKS} links")
            if st.st_uid not in ok:
                raise TokenFileError(
                    f"{what} {path}: the link {entry} belongs to uid {st.st_uid}, "
                    f"not to root or the service user (uid {me}); refusing to follow it"
                )
            target = os.readlink(entry)
            todo.extend(c for c in reversed(target.split("/")) if c)
            if target.startswith("/"):
                current = "/"
                dir_st = _lstat(path, current, what)
            continue
        if not todo:
            return entry, st
        current, dir_st = entry, st


def _service(trusted: frozenset[int]) -> int:
    """The service user's uid among `trusted`, for messages (root where it is the only one)."""
    return max(trusted)


def _lstat(path: str, component: str, what: str = "admin token file") -> os.stat_result:
    try:
        return os.lstat(component)
    except FileNotFoundError:
        why = "does not exist" if component == path else f"does not exist ({component} is missing)"
        raise TokenFileError(f"{what} {path} {why}") from None
    except OSError as exc:
        raise TokenFileError(
            f"cannot read the {what} {path}: {component}: {exc.strerror}"
        ) from None


def _check_dir(
    path: str, directory: str, st: os.stat_result, trusted: frozenset[int], what: str
) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise TokenFileError(f"{what} {path}: {directory} is not a directory")
    if st.st_uid not in trusted:
        raise TokenFileError(
            f"{what} {path}: the directory {directory} belongs to uid {st.st_uid}, "
            f"not to root or the service user (uid {_service(trusted)}): its owner could swap "
            "the file"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise TokenFileError(
            f"{what} {path}: the directory {directory} is writable by others "
            f"(mode {stat.S_IMODE(st.st_mode):04o}): someone else could swap the file"
        )


def _permission_problem(
    st: os.stat_result, owners: frozenset[int] | None = None, group_read: bool = False
) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if owners is None and st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by the service user (uid {os.geteuid()})"
    if owners is not None and st.st_uid not in owners:
        return f"is owned by uid {st.st_uid}, not by root or the service user"
    mode = stat.S_IMODE(st.st_mode)
    if group_read and mode & 0o037:
        return (
            f"is mode {mode:04o}: others may read it or group or others write it "
            "(0600, 0400 or 0640 is required)"
        )
    if not group_read and mode & 0o077:
        return (
            f"is mode {mode:04o}: group or others may read or write it (0600 or 0400 is required)"
        )
    if st.st_nlink != 1:
        return f"has {st.st_nlink} hard links; another name may be readable by others"
    return None


def _parse(path: str, data: bytes) -> str:
    if len(data) > MAX_FILE_BYTES:
        raise TokenFileError(f"admin token file {path} is larger than {MAX_FILE_BYTES} bytes")
    text = data.decode("ascii", "replace").strip()
    if not text:
        raise TokenFileError(
            f"admin token file {path} is empty; remove it and the daemon writes a new one"
        )
    if len(text) < MIN_LENGTH or not set(text) <= _ALLOWED:
        raise TokenFileError(
            f"admin token file {path} does not hold a usable token (one line of at least "
            f"{MIN_LENGTH} URL-safe characters); remove it and the daemon writes a new one"
        )
    return text


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


def changed(token: Token, path: str) -> bool:
    """Whether the file on disk is no longer the one `token` was read from (a rotation)."""
    try:
        # Followed: a Secret's rotation swaps `..data`, never the visible link.
        st = os.stat(path)
    except OSError:
        return True
    return _identity(st) != token.identity


def service_uids(path: str) -> frozenset[int]:
    """Whom a client (the CLI, often root) takes for root and the service user: root, itself,
    and the owner of the directory the token file is configured in (the state directory,
    `kimi`'s under the shipped unit). The daemon refuses to start with a token directory
    anyone else owns (check_directory), so nobody else is trusted with it."""
    uids = {0, os.geteuid()}
    with contextlib.suppress(OSError):
        uids.add(os.stat(os.path.dirname(os.path.abspath(path)) or "/").st_uid)
    return frozenset(uids)


def read_for_client(path: str) -> str:
    """The CLI's read: the token, or TokenFileError naming the file and who may read it.

    With the daemon's checks, for the uids of `service_uids`: links and directories only of
    root's or the service user's making (a link someone else planted could make the CLI
    send another secret it can read), a regular file of theirs, no access for group or
    others, one hard link."""
    trusted = service_uids(path)
    real, seen = resolve(path, trusted)
    where = path if real == path else f"{path} (-> {real})"
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except PermissionError:
        raise TokenFileError(
            f"cannot read the admin token file {path}: permission denied; only root and the "
            f"service user ({_owner(path)}) may read it: run with sudo or as that user"
        ) from None
    except FileNotFoundError:
        raise TokenFileError(
            f"admin token file {path} does not exist; the daemon creates it at start "
            "(is it running with the same config? admin.token_file)"
        ) from None
    except OSError as exc:
        raise TokenFileError(f"cannot read the admin token file {where}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if (st.st_dev, st.st_ino) != (seen.st_dev, seen.st_ino):
            raise TokenFileError(f"admin token file {where} changed while it was read; retry")
        problem = _permission_problem(st, trusted)
        if problem:
            raise TokenFileError(f"admin token file {where} {problem}; refusing to send it")
        data = f.read(MAX_FILE_BYTES + 1)
    return _parse(path, data)


def read_secret(path: str, what: str) -> str:
    """Another secret the daemon reads (router.api_key_file): the links and directories as for
    the token file; a regular file of root or the service user, one hard link, nothing for
    others and no write for the group (root:kimi 0640 is fine). Its first line, stripped."""
    trusted = frozenset({0, os.geteuid()})
    f, st, where = open_resolved(path, trusted, what)
    with f:
        problem = _permission_problem(st, trusted, group_read=True)
        if problem:
            raise TokenFileError(f"{what} {where} {problem}")
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise TokenFileError(f"{what} {where} is larger than {MAX_FILE_BYTES} bytes")
    try:
        return data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise TokenFileError(f"{what} {where} is not ASCII text") from None


def _owner(path: str) -> str:
    try:
        uid = os.stat(path).st_uid
    except OSError:
        return "the owner of the file"
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"
