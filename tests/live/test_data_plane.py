"""Health is the data plane, on a real ``histate-server``: malformed ZMQ frames are dropped
with one log line and the request thread serves on; a stopped request thread fails
``/healthcheck``, ``/status`` and ``/metrics``.

Frames are sent from a raw ZMQ DEALER, as any local user could; the engine is LMCache's own
client (``support.lmcache_mp.HybridEngineClient``).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import pytest
import zmq
from support.lmcache_mp import HybridEngineClient, LMCacheServer, TokenSource
from test_backend_server import CHUNK, GEOMETRY, histate, tokens

__all__ = ["tokens"]  # the fixture, re-exported for pytest

pytestmark = pytest.mark.timeout(240)


def get(server: LMCacheServer, path: str) -> tuple[int, str]:
    """(status, body) of ``GET path`` (no exception for 4xx/5xx)."""
    try:
        with urllib.request.urlopen(server.endpoints.http_url + path, timeout=15) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def pack(value: object) -> bytes:
    return msgspec.msgpack.encode(value)


MALFORMED: list[tuple[str, list[bytes]]] = [
    # ROUTER prepends the sender's identity: one frame sent arrives as two parts.
    ("one frame", [b"just-one-frame"]),
    ("ping with no payload", [pack(1), pack(22)]),
    ("undecodable operation id", [pack(2), b"\xc1\xc1garbage", pack(None)]),
    ("operation id of the wrong type", [pack(3), pack([1, 2]), pack(None)]),
    ("unknown legacy operation id", [pack(4), pack(9999), pack(None)]),
    ("unknown operation name", [pack(5), pack("no.such.operation"), pack(None)]),
    ("garbage lookup payloads", [pack(6), pack(8), b"\xc1\xc1", b"not msgpack", b"\xff"]),
    ("lookup with no payload", [pack(7), pack(8)]),
    ("ping payload of the wrong type", [pack(8), pack(22), pack({"a": [1.5]})]),
]


def log_lines(server: LMCacheServer) -> list[str]:
    return server.log_path.read_text(errors="replace").splitlines()


def test_malformed_frames_are_dropped_and_the_data_plane_serves(
    tmp_path: Path, tokens: TokenSource
) -> None:
    """Each malformed message 3 times (27 messages; the probe's 20 frames gave 480 log lines
    and one of them stopped the request thread): at most 2 log lines, no traceback,
    /healthcheck healthy, then a store and a bit-exact retrieve."""
    with histate(tmp_path / "srv", tmp_path / "disk") as server:
        before = len(log_lines(server))
        context = zmq.Context()
        try:
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(server.endpoints.zmq_url)
            for _ in range(3):
                for _name, frames in MALFORMED:
                    sock.send_multipart(frames)
            # A well-formed ping on the same socket is answered after all of them.
            sock.send_multipart([pack(99), pack(22), pack(None)])
            assert sock.poll(20_000), "no answer: the request thread did not survive"
            uid, _op, answer = sock.recv_multipart()
            while uid != pack(99):  # answers to the malformed pings never come
                assert sock.poll(20_000)
                uid, _op, answer = sock.recv_multipart()
            assert msgspec.msgpack.decode(answer) is True
            sock.close()
        finally:
            context.term()

        status, body = get(server, "/healthcheck")
        assert (status, json.loads(body)) == (200, {"status": "healthy"})
        with HybridEngineClient(server.endpoints.zmq_url, GEOMETRY) as engine:
            p = tokens.tokens(4 * CHUNK)
            sp = engine.store_chunks(p, snapshot_chunks=[1, 3])
            got = engine.lookup_and_retrieve(p)
            assert got.hit_chunks == 4 and engine.matches(sp, got)
        added = log_lines(server)[before:]
        text = "\n".join(added)
        assert "Traceback" not in text
        dropped = [x for x in added if "malformed request" in x]
        assert len(dropped) == 1, text
        assert "too few frames" in dropped[0]  # the first frame sent: one frame
        assert "further ones: one line per 60 s" in dropped[0]


def test_a_stopped_request_thread_fails_health(tmp_path: Path) -> None:
    """The request thread made to stop (a fault injected from inside the server: no frame
    stops it once the loop guard holds): /healthcheck, /status and /metrics answer 503
    naming the thread, and the log says so once."""
    flag = tmp_path / "break-request-loop"
    with histate(tmp_path / "srv", tmp_path / "disk",
                 test_module=("request_loop_fault", {"flag": str(flag)})) as server:
        for path in ("/healthcheck", "/status", "/metrics"):
            assert get(server, path)[0] == 200, path
        metrics = get(server, "/metrics")[1]
        assert "histate_disk_write_lag_seconds " in metrics  # idle: a lag of 0
        assert "histate_disk_write_lag_bound_seconds 10.0" in metrics
        flag.touch()
        # While the thread ends, a ping sent just before may be the first to fail
        # ("no answer to a ping RPC"); once it has ended, the check names the thread.
        deadline = time.monotonic() + 30
        status, body = get(server, "/healthcheck")
        while "has stopped" not in body and time.monotonic() < deadline:
            assert status == 200 or "unhealthy" in body, body
            time.sleep(0.2)
            status, body = get(server, "/healthcheck")
        assert status == 503, body
        answer = json.loads(body)
        assert answer["status"] == "unhealthy"
        assert "request thread (mq-server-thread) has stopped" in answer["reason"]
        assert get(server, "/status")[0] == 503
        assert get(server, "/metrics")[0] == 503
        critical = [x for x in log_lines(server) if "LMCache's request thread stopped" in x]
        assert len(critical) == 1 and "TEST: injected request-loop fault" in critical[0]
