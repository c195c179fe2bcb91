"""Who owns a TCP socket on this host: the uid column of /proc/net/tcp and /proc/net/tcp6.

Any local user can bind the admin port while the daemon is not running (a restart, a start that
failed), answer as the daemon would, and collect the bearer token of whoever asks. So before
the CLI sends the token to a loopback address it asks the kernel who owns the socket it is
connected to (`peer_owner`): the server side of that very connection, or failing that (it may
not be listed yet, a fraction of a millisecond after the handshake) the listening socket it
came from. A socket's uid is its creator's effective uid (sk_uid), inherited by the
connections it accepts; no process can forge it.

/proc/net/tcp: one line per socket, `sl local_address rem_address st ... uid timeout inode`;
an address is hex `IP:PORT`, the IPv4 part one 32-bit word in host (little-endian) byte order,
the IPv6 part four of them. State 0A is LISTEN, 01 ESTABLISHED.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
LISTEN, ESTABLISHED = "0A", "01"
Address = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]


@dataclass(frozen=True)
class Entry:
    local: Address
    remote: Address
    state: str
    uid: int


def _address(text: str) -> Address:
    ip_hex, port_hex = text.split(":")
    raw = bytes.fromhex(ip_hex)
    # Each 32-bit word as the kernel printed it: in host byte order.
    words = struct.unpack(f"<{len(raw) // 4}I", raw)
    packed = b"".join(struct.pack(">I", w) for w in words)
    ip = ipaddress.ip_address(packed)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped, int(port_hex, 16)
    return ip, int(port_hex, 16)


def parse(lines: Iterable[str]) -> Iterator[Entry]:
    for line in lines:
        fields = line.split()
        if len(fields) < 8 or not fields[0].endswith(":"):
            continue  # the header, or a line cut short
        try:
            yield Entry(_address(fields[1]), _address(fields[2]), fields[3], int(fields[7]))
        except ValueError:
            continue


def entries(tables: Iterable[Path] = TABLES) -> list[Entry]:
    out: list[Entry] = []
    for table in tables:
        try:
            out.extend(parse(table.read_text().splitlines()))
        except OSError:
            continue  # no IPv6 on this host
    return out


def _norm(host: str, port: int) -> Address:
    ip = ipaddress.ip_address(host.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip, port


def _wildcard(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return ip.is_unspecified


def listener_uids(host: str, port: int, table: list[Entry] | None = None) -> set[int]:
    """The owners of the listening sockets a connection to host:port could reach: bound to
    that address or to a wildcard one, on that port."""
    want = _norm(host, port)
    found = table if table is not None else entries()
    return {
        e.uid
        for e in found
        if e.state == LISTEN
        and e.local[1] == port
        and (e.local[0] == want[0] or _wildcard(e.local[0]))
    }


def peer_owner(sock: socket.socket) -> int | None:
    """The uid owning the other end of a connected loopback TCP socket, or None if the kernel
    lists no such socket."""
    peer = sock.getpeername()
    me = sock.getsockname()
    server, client = _norm(peer[0], peer[1]), _norm(me[0], me[1])
    table = entries()
    for e in table:
        if e.local == server and e.remote == client and e.state != LISTEN:
            return e.uid
    uids = listener_uids(str(server[0]), server[1], table)
    if len(uids) == 1:
        return uids.pop()
    return None


def is_loopback_host(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]").split("%")[0]).is_loopback
    except ValueError:
        return False


def user_name(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"
