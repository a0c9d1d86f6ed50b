"""Signals on a real ``histate-server``: SIGTERM and SIGHUP stop it gracefully, without a
traceback in its log, and what it acknowledged is served again after a restart.

SIGHUP used to kill the process at once (no shutdown lines, the disk tier never closed);
SIGTERM was graceful but logged LMCache's ``_notify_response`` traceback for every request
in flight (``file descriptor cannot be a negative integer (-1)``). Each run stores under
load (a second engine keeps storing without waiting while the signal arrives) and has 4
END_SESSION requests that end on pool threads after the request server closed: a
test-only server module holds them back until then (``support/late_end_session.py``),
because a quick server finishes its requests before any signal lands.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from support.late_end_session import LATE_PREFIX
from support.lmcache_mp import HybridEngineClient, LMCacheServer, TokenSource
from test_backend_server import CHUNK, GEOMETRY, histate, tokens

__all__ = ["tokens"]  # the fixture, re-exported for pytest

pytestmark = pytest.mark.timeout(300)

PREFIXES = 8
LATE = ("late_end_session", {})


def store_prefixes(url: str, tokens: TokenSource) -> list[tuple[list[int], object]]:
    """``PREFIXES`` four-chunk prefixes stored (acknowledged) with 2 snapshots each."""
    with HybridEngineClient(url, GEOMETRY) as engine:
        out = []
        for _ in range(PREFIXES):
            p = tokens.tokens(4 * CHUNK)
            sp = engine.store_chunks(p, snapshot_chunks=[1, 3])
            out.append((p, engine.stored_bytes(sp, 4)))
        return out


def all_back(url: str, expected: list[tuple[list[int], object]]) -> None:
    with HybridEngineClient(url, GEOMETRY) as engine:
        for p, want in expected:
            got = engine.lookup_and_retrieve(p)
            assert got.hit_chunks == 4
            assert engine.retrieved_bytes(got) == want


def stop_under_load(server: LMCacheServer, sig: signal.Signals) -> str:
    """Send ``sig`` while an engine stores and 4 requests wait on pool threads; assert a
    graceful stop with no traceback; return the log."""
    url = server.endpoints.zmq_url
    stop, stored = threading.Event(), []

    def load() -> None:
        source = TokenSource(seed=int(sig))
        with HybridEngineClient(url, GEOMETRY, rpc_timeout=5) as busy:
            while not stop.is_set() and busy._next_block < GEOMETRY.num_blocks - 64:
                try:
                    busy.store_chunks(source.tokens(4 * CHUNK), snapshot_chunks=[1, 3],
                                      wait=False)
                except Exception:
                    return  # the server has stopped
                stored.append(1)

    writer = threading.Thread(target=load)
    writer.start()
    deadline = time.monotonic() + 30
    while len(stored) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    context = zmq.Context()
    late = context.socket(zmq.DEALER)
    late.connect(url)
    for i in range(4):  # END_SESSION: legacy operation id 13
        late.send_multipart([msgspec.msgpack.encode(i), msgspec.msgpack.encode(13),
                             msgspec.msgpack.encode(f"{LATE_PREFIX}{i}")])
    time.sleep(0.5)  # taken by pool threads; they end after the request server closed
    server.proc.send_signal(sig)
    rc = server.proc.wait(timeout=90)
    stop.set()
    writer.join(timeout=90)
    late.close(linger=0)
    context.term()
    log = server.log_path.read_text(errors="replace")
    assert rc == -signal.SIGTERM, log[-3000:]  # SIGHUP stops as SIGTERM does
    assert "Traceback" not in log, log[-3000:]
    assert "LMCache HTTP server stopped" in log  # the lifespan shutdown ran to its end
    return log


def test_sigterm_and_sighup_stop_gracefully_and_objects_come_back(
    tmp_path: Path, tokens: TokenSource
) -> None:
    """SIGTERM, then SIGHUP on the restarted server: each a graceful stop (exit as by
    SIGTERM, no traceback, no temporary file left), and after each restart every prefix
    acknowledged before it is served complete and byte-exact."""
    disk = tmp_path / "disk"
    # policy lru: every object is written through to the disk tier (a restart finds all).
    with histate(tmp_path / "srv1", disk, policy="lru", test_module=LATE) as server:
        expected = store_prefixes(server.endpoints.zmq_url, tokens)
        log = stop_under_load(server, signal.SIGTERM)
        assert "SIGHUP" not in log
    assert not list(disk.rglob("*.tmp"))

    with histate(tmp_path / "srv2", disk, policy="lru", test_module=LATE) as server:
        all_back(server.endpoints.zmq_url, expected)
        expected += store_prefixes(server.endpoints.zmq_url, tokens)
        log = stop_under_load(server, signal.SIGHUP)
        assert "SIGHUP: stopping as for SIGTERM" in log
    assert not list(disk.rglob("*.tmp"))

    with histate(tmp_path / "srv3", disk, policy="lru") as server:
        all_back(server.endpoints.zmq_url, expected)
