"""Concurrent eviction from several server processes on one budget and one folder."""

from __future__ import annotations

import multiprocessing
from collections import Counter
from pathlib import Path

from lmcache_histate.backends.server.disk import file_format as df
from support.redis_server import RedisServer
from support.shared_index import eviction_worker, make_index

WORKERS = 3
ITERATIONS = 150
BUDGET = 20_000  # bytes: 10-90 objects of 200-2,000 payload bytes (+ ~90 header bytes)


def test_concurrent_eviction_never_claims_twice_nor_deletes_under_a_lease(
    redis_server: RedisServer, shared_dir: Path
) -> None:
    make_index(redis_server.url, "parent").join(BUDGET)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=eviction_worker,
                    args=(redis_server.url, str(shared_dir), w, ITERATIONS, queue))
        for w in range(WORKERS)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0

    claims = Counter(i for r in results for i in r["claimed"])
    stored = sum(r["stored"] for r in results)
    assert max(claims.values()) == 1  # no object evicted twice
    # At most 20,000 / 290 = 68 objects (>= 200 payload + ~90 header bytes) fit at once, so
    # of the objects stored all but at most 68 were evicted.
    assert sum(claims.values()) >= stored - BUDGET // 290
    assert sum(r["loads"] for r in results) > 0
    assert sum(r["bad"] for r in results) == 0  # no leased file was ever deleted
    assert max(r["max_used"] for r in results) <= BUDGET
    # At rest the index counts exactly the files on disk.
    on_disk = sum(p.stat().st_size for p in df.iter_files(shared_dir)
                  if df.OWN_NAME.fullmatch(p.name))
    files = sum(1 for p in df.iter_files(shared_dir) if df.OWN_NAME.fullmatch(p.name))
    assert files == stored - sum(claims.values())  # every stored object evicted or kept
    index = make_index(redis_server.url, "parent")
    assert index.usage() == (on_disk, BUDGET, 0)
