"""Redis restarted empty under load, the index rebuilt: server B finds every prefix that
server A stored after the restart.

Real parts only: a real ``redis-server`` (killed with SIGKILL and started again, empty, on
the same port), two HiState servers on one disk folder (``test_shared_index_servers``),
the real ``reconcile`` run by a third handle on the namespace as another server's
periodic reconcile would, in a loop while A stores, with a grace of 5 s (the launcher's
reconcile waits ``GRACE_S`` = 60 s and runs every ``RECONCILE_S``: too slow for a test).

Each prefix is a 4-chunk session with its snapshot at chunk 3; A's CPU tier holds about
one of them, so each store demotes the previous session's 4 KV chunks and snapshot to the
shared folder. A prefix counts as stored on the folder when its 5 files are there; B's
lookup of such a prefix must hit all 4 chunks. The disk budget holds every file (no
deployment eviction), so a miss can only be an index entry lost by the restart.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from lmcache_histate.backends.server.shared_index import open_index
from lmcache_histate.backends.server.shared_index.reconcile import reconcile
from support.lmcache_mp import ATTN_GROUP, REC_GROUP, HybridEngineClient, TokenSource
from support.redis_server import RedisServer
from test_backend_server import CHUNK, GEOMETRY, KV, SNAP, cpu_fill_for, hs, on_disk, settle
from test_shared_index_servers import (
    DEPLOYMENT,
    MODEL,
    entries,
    files,
    shared,
    two_servers,
)

from lmcache_histate.config import SharedIndexConfig

BEFORE, AFTER = 60, 160
"""Prefixes A stores at least before the restart, and exactly after it (the ones B must
find): the restart also waits until A's first files are past the reconcile's grace."""
GRACE_S = 5.0
"""The test's reconcile leaves files and temporaries younger than this alone. With 0 it
removes A's temporaries mid-write (A's rename fails: a prefix with 4 of its 5 files, a
miss of the test's making); a write lasts milliseconds, but a writer thread stalled on
this shared machine can outlast 1 s. 5 s still adopts A's files from before the restart
while A stores for at least 5 s after it."""
PACE_S = 0.05
"""A stores at most one prefix per this, so it keeps storing for at least AFTER x PACE_S =
8 s after the restart (longer than GRACE_S: the looping reconcile sees files older and
younger than its grace); it stores AFTER + 2 prefixes once the restart is done, however
long the wait before it took on a loaded machine."""
ENGINE = dataclasses.replace(GEOMETRY, num_blocks=4096)  # 5 fresh blocks per store or hit


def rebuild_probe(
    tmp_path: Path, redis_server: RedisServer, tokens: TokenSource, *, down_s: float
) -> dict[str, Any]:
    """One run of the scenario (module docstring); the counts B's lookups give."""
    disk = tmp_path / "disk"
    fill = cpu_fill_for(4 * KV + SNAP + 3 * KV)
    sessions: list[list[int]] = []  # A's prefixes in store order (only the writer adds)
    # Every file fits the deployment budget: a few hundred sessions x 5 files, under 10 MB.
    with two_servers(tmp_path, disk, redis_server.url, cpu_fill=fill, disk_gib=0.05) as (a, b):
        restarted = threading.Event()
        first_after: list[int] = []
        errors: list[BaseException] = []

        with HybridEngineClient(a.endpoints.zmq_url, ENGINE) as engine_a:
            started = time.monotonic()

            def drive() -> None:
                try:
                    n = 0
                    while not first_after or n < first_after[0] + AFTER + 2:
                        time.sleep(max(0.0, started + n * PACE_S - time.monotonic()))
                        if restarted.is_set() and not first_after:
                            first_after.append(n)
                        sessions.append(tokens.tokens(4 * CHUNK))
                        engine_a.store_chunks(sessions[-1], snapshot_chunks=[3])
                        n += 1
                except BaseException as exc:  # reported by the main thread
                    errors.append(exc)

            writer = threading.Thread(target=drive)
            writer.start()
            # A's first files are past the grace at the restart: the reconcile adopts them
            # while A re-registers (the race ``test_shared_index_rebuild`` pins down).
            while not errors and (len(files(disk)) < 5 * (BEFORE - 1)
                                  or time.monotonic() - started < GRACE_S + 1):
                time.sleep(0.01)
            redis_server.kill()
            time.sleep(down_s)
            redis_server.start()  # same port, empty
            restarted.set()
            other = open_index(SharedIndexConfig(
                url=redis_server.url, deployment=DEPLOYMENT, instance="c",
                connect_timeout_s=0.3, op_timeout_s=0.3), MODEL)
            adopted = 0
            while writer.is_alive():  # races A's re-registration and its new commits
                report = reconcile(other, disk, grace_s=GRACE_S)
                adopted += report["adopted"] if report else 0
            writer.join(180)
            assert not errors, errors
            assert first_after, "the restart came after the last store"
            settle(a)
            report = reconcile(other, disk, grace_s=GRACE_S)
            adopted += report["adopted"] if report else 0
            other.conn.close()
            probe = sessions[first_after[0] : first_after[0] + AFTER]  # + 2 push them out
            on_folder = [p for p in probe if len(on_disk_chunks(disk, engine_a, p)) == 5]
            partial = {n: on_disk_chunks(disk, engine_a, p) for n, p in enumerate(probe)
                       if len(on_disk_chunks(disk, engine_a, p)) != 5}
        index = entries(redis_server.url)
        with HybridEngineClient(b.endpoints.zmq_url, ENGINE, seed=1) as engine_b:
            missed = sum(1 for p in probe if engine_b.lookup_and_retrieve(p).hit_chunks != 4)
        return {
            "after": len(probe), "on_folder": len(on_folder), "missed": missed,
            "partial": partial,  # probe position -> the files that are there
            "adopted": adopted, "evicted": shared(a)["link"].get("evicted", 0),
            "entries": len(index), "files": len(files(disk)),
            "taken_back": shared(a)["registrar"].get("taken_back", 0),
            # A saw the restart: a failed call, or its heartbeat's epoch (index NOTE 1).
            "noticed": sum(shared(a)["connection"].get(k, 0) for k in ("outages",
                                                                        "restarts_seen")),
            **{k: v for k, v in hs(a)["disk"]["stats"].items()
               if k.startswith(("not_persisted", "writes_cancelled"))},
        }


def on_disk_chunks(disk: Path, engine: HybridEngineClient, prefix: list[int]) -> list[str]:
    """The prefix's files on the folder: ``kv<i>`` per KV chunk, ``snap<i>`` per snapshot."""
    return [f"kv{i}" for i in on_disk(disk, engine, prefix, ATTN_GROUP)] + [
        f"snap{i}" for i in on_disk(disk, engine, prefix, REC_GROUP)]


@pytest.mark.parametrize("down_s", [0.0, 1.0])
def test_b_misses_none_of_the_prefixes_a_stored_after_an_empty_restart(
    tmp_path: Path, redis_server: RedisServer, down_s: float
) -> None:
    """Redis killed while A stores (back at once, or after 1 s), a reconcile looping
    meanwhile (it adopts A's older files as A re-registers them): every prefix A stored
    after the restart is on the folder (the budget evicted nothing) and B's lookup hits
    all 4 chunks of each: 0 misses."""
    got = rebuild_probe(tmp_path, redis_server, TokenSource(seed=int(down_s * 10) + 30),
                        down_s=down_s)
    print(got)
    assert got["evicted"] == 0
    # One restart, seen once or twice: a call that failed while Redis was down (an outage)
    # and, once it is back, the heartbeat's changed epoch; never zero.
    assert 1 <= got["noticed"] <= 2
    assert got["after"] == AFTER  # every prefix A stored after the restart is probed
    assert got["partial"] == {}
    assert got["on_folder"] == got["after"]
    assert got["missed"] == 0
    assert got["entries"] == got["files"]  # the rebuilt index: one entry per file
