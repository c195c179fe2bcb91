"""/proc/net/tcp{,6} as the kernel prints it (lines copied from a real host), and the owner of
a real loopback connection."""

from __future__ import annotations

import ipaddress
import os
import socket

from supervisor.admin import sockowner

TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:07E8 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1685 1
   1: 0100007F:72F8 00000000:0000 0A 00000000:00000000 00:00000000 00000000 65534        0 29954 1
   2: 0100007F:72F8 0100007F:B570 01 00000000:00000000 00:00000000 00000000 65534        0 0 3
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue
0: 0000000000000000FFFF00000100007F:6224 0000000000000000FFFF00000100007F:B570 06 0:0 0:0 0 998
1: 00000000000000000000000001000000:1F90 00000000000000000000000000000000:0000 0A 0:0 0:0 0 998
"""


def test_lines_as_the_kernel_prints_them() -> None:
    entries = list(sockowner.parse(TCP.splitlines()))
    assert [(str(e.local[0]), e.local[1], e.state, e.uid) for e in entries] == [
        ("0.0.0.0", 2024, "0A", 0),
        ("127.0.0.1", 29432, "0A", 65534),
        ("127.0.0.1", 29432, "01", 65534),
    ]
    assert entries[2].remote == (ipaddress.ip_address("127.0.0.1"), 0xB570)
    six = list(sockowner.parse(TCP6.splitlines()))
    # An IPv4 connection to a dual-stack socket: listed as ::ffff:127.0.0.1, read as IPv4.
    assert six[0].local == (ipaddress.ip_address("127.0.0.1"), 0x6224)
    assert six[1].local == (ipaddress.ip_address("::1"), 8080) and six[1].uid == 998
    assert sockowner.listener_uids("127.0.0.1", 29432, entries) == {65534}
    assert sockowner.listener_uids("127.0.0.1", 2024, entries) == {0}  # the wildcard one
    assert sockowner.listener_uids("::1", 8080, six) == {998}
    assert sockowner.listener_uids("127.0.0.1", 1, entries) == set()


def test_the_owner_of_a_real_connection_is_this_process_user() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            assert sockowner.peer_owner(client) == os.geteuid()
        assert sockowner.listener_uids("127.0.0.1", port) == {os.geteuid()}
