"""The demo's and the live benchmark's servers get ports that do not collide.

A benchmark's second repetition stopped at start with "http_port: must differ from port":
two ports picked one after the other by binding port 0 and closing the socket can be the
same number. ``free_ports`` holds every socket until all are chosen.
"""

from __future__ import annotations

import socket

from lmcache_histate.backends.demo.servers import free_ports


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(64)
    assert len(ports) == 64 and len(set(ports)) == 64
    for port in ports[:8]:  # released: each can be bound by the server it is meant for
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
