"""A bounded, quiet control plane on a real ``histate-server``: refused RPCs do not flood
the log, and an over-sized HTTP body is answered 413 before it is read, with or without
the secret.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
from support.lmcache_mp import LMCacheServer
from test_backend_server import histate
from test_hardening_server import SECRET, raw_http, rpc, token_file

pytestmark = pytest.mark.timeout(240)

MAX_BODY = 1 << 20  # backends/server/access.py, written out


def test_hundred_refused_rpcs_add_at_most_five_log_lines(tmp_path: Path) -> None:
    with histate(tmp_path / "srv", tmp_path / "disk",
                 auth_token_file=str(token_file(tmp_path))) as server:
        time.sleep(1.0)  # start-up lines written
        before = server.log_path.read_text(errors="replace")
        for i in range(100):
            method = "histate.plan" if i % 2 else "histate.status"
            ok, error, _ = rpc(server, method, json.dumps({"input_tokens": 64}).encode())
            assert not ok and "missing or wrong token" in error
        ok, error, _ = rpc(server, "histate.plan", b"\xff not json")  # a bad argument
        assert not ok and "payload is not JSON" in error
        time.sleep(0.5)
        added = server.log_path.read_text(errors="replace")[len(before):]
    lines = [x for x in added.splitlines() if x.strip()]
    assert len(lines) <= 5, added
    assert "Traceback" not in added
    refusals = [x for x in lines if "RPC refused" in x or "RPCs refused" in x]
    assert len(refusals) == 1 and "RPC refused: HiState RPC: missing or wrong token" in refusals[0]


def http_exchange(server: LMCacheServer, head: str, body_chunks: list[bytes] = ()) -> bytes:
    """Send ``head`` (and the chunks, as long as the server reads), return the reply."""
    with socket.create_connection(("127.0.0.1", server.endpoints.http_port), timeout=10) as s:
        s.sendall(head.encode())
        try:
            for chunk in body_chunks:
                s.sendall(chunk)
        except OSError:  # the server answered and closed: the rest was never read
            pass
        s.settimeout(10)
        reply = b""
        while b"\r\n\r\n" not in reply:
            part = s.recv(65536)
            if not part:
                break
            reply += part
    return reply


def head(path: str, length: int | None, token: str | None) -> str:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines.append(f"Content-Length: {length}" if length is not None
                 else "Transfer-Encoding: chunked")
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    return "\r\n".join(lines) + "\r\n\r\n"


def chunked(total: int) -> list[bytes]:
    piece = b" " * 65536
    return [b"%x\r\n" % len(piece) + piece + b"\r\n"] * (total // len(piece) + 1) + [b"0\r\n\r\n"]


@pytest.mark.parametrize("secret", [True, False], ids=["with-secret", "loopback-open"])
def test_oversized_bodies_get_413_before_they_are_read(tmp_path: Path, secret: bool) -> None:
    values = {"auth_token_file": str(token_file(tmp_path))} if secret else {}
    token = SECRET if secret else None
    with histate(tmp_path / "srv", tmp_path / "disk", **values) as server:
        # 200 MB announced, not one byte sent: the answer comes without waiting for it.
        t0 = time.monotonic()
        reply = http_exchange(server, head("/cache/clear", 200_000_000, token))
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert time.monotonic() - t0 < 5
        if secret:  # unauthenticated too (401 would also do; 413 is checked first)
            reply = http_exchange(server, head("/cache/clear", 200_000_000, None))
            assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        # Chunked: the bound is enforced while reading.
        reply = http_exchange(server, head("/cache/clear", None, token), chunked(2 * MAX_BODY))
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        # At the bound a route still answers itself (a JSON body padded to MAX_BODY bytes).
        body = json.dumps({"tier": "l1"}).encode()
        body += b" " * (MAX_BODY - len(body))
        reply = http_exchange(server, head("/cache/clear", len(body), token), [body])
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
        assert raw_http(server, "GET", "/healthcheck") == 200
        assert "Traceback" not in server.log_path.read_text(errors="replace")
