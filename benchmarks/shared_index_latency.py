"""Added lookup latency of the shared index over the single-instance disk-tier lookup.

Command (results in benchmarks/README.md, "shared_index_latency")::

    .venv/bin/python benchmarks/shared_index_latency.py
    .venv/bin/python benchmarks/shared_index_latency.py --live --repeats 400

What one LOOKUP of a hit costs on the server, per number of disk objects in the hit:

* ``single``: the single-instance path, the real disk tier (``HiStateDiskAdapter``) on a
  folder of ``--files`` objects: ``submit_lookup_and_lock_task`` + its result +
  ``submit_unlock`` (an in-memory index under a lock; no I/O);
* ``shared``: the same plus ``SharedIndex.lookup`` on a real ``redis-server`` on
  loopback holding the same objects: one EVALSHA that reads the entries, takes load
  leases and refreshes last access (the hot path: one round trip);
* ``shared+release``: plus ``release`` of the leases (a second round trip, which the
  server makes after the load, off the request's path).

With ``--live``: the whole server path instead. Two real ``histate-server`` processes at
once, one without a ``shared_index`` section, one with it (a real ``redis-server`` on
loopback), sampled alternately, each holding ``--sessions`` sessions of 4 chunks all on
its disk tier (a CPU tier below one chunk); per sample, ``POST /cache/clear`` empties L1
(untimed), then one LOOKUP (+ prefetch wait) of a session is timed from the toy engine
client (``tests/support/lmcache_mp``): the disk tier's lookup-and-lock (with the index: one
``lookup`` script, the leases) and the load of 4 KV chunks + 1 snapshot from disk into L1.

Each with redis-py's pure-Python reply parser and with hiredis when it is installed
(``.venv/bin/pip install hiredis``; not a dependency: it does not measurably help, see
benchmarks/README.md), in one run, interleaved: read the ratios, not the absolute times
(shared 2-core machine). The last column is the time Redis itself spent in the lookup
script per call (``INFO commandstats``), the part no client-side change removes.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis
from lmcache.v1.distributed.api import ObjectKey
from lmcache_histate.backends.server.disk import file_format as df
from lmcache_histate.backends.server.disk.tier import HiStateDiskAdapter
from lmcache_histate.backends.server.shared_index.connection import IndexConnection
from lmcache_histate.backends.server.shared_index.index import SharedIndex
from lmcache_histate.backends.server.shared_index.layout import KeySpace, ObjectRecord, object_id
from redis._parsers import _HiredisParser, _RESP2Parser
from redis.utils import HIREDIS_AVAILABLE

from lmcache_histate.config import SharedIndexConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' redis-server starter, reused
from support.redis_server import RedisServer  # noqa: E402

MODEL = "bench-model"


def _objects(root: Path, n: int) -> list[tuple[ObjectKey, ObjectRecord]]:
    out = []
    for i in range(n):
        oid = df.ObjectId(MODEL, 0, i % 2, i.to_bytes(4, "big") * 4)
        path = df.object_path(root, oid)
        payload = bytes(64)
        size = df.write_object(path, oid, payload, kind=i % 2, depth=i, parent=b"", fsync=False)
        key = ObjectKey(chunk_hash=oid.chunk_hash, model_name=MODEL, kv_rank=0,
                        object_group_id=oid.object_group_id, cache_salt="")
        out.append((key, ObjectRecord(df.encode_id(oid), str(path.relative_to(root)), size, 0,
                                      i % 2, i, b"", cost=1.0, freed=float(size))))
    return out


def _script_usec(client: redis.Redis) -> tuple[int, int]:
    """(calls, µs) Redis spent in EVALSHA so far."""
    stat = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stat.get("calls", 0)), int(stat.get("usec", 0))


def _timed(fn: Callable[[], object], repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1000)
    return samples


def live(repeats: int, sessions: int) -> None:
    """The ``--live`` rows (module docstring): both servers up at once, samples interleaved,
    so the machine's load changes touch both alike."""
    import contextlib

    import yaml
    from support.lmcache_mp import EngineGeometry, HybridEngineClient, TokenSource, lmcache_server

    chunk, l1_bytes = 16, int(0.05 * 2**30)
    work = Path(tempfile.mkdtemp(prefix="histate-bench-live-"))
    server = RedisServer(work / "redis")
    server.start()
    rows: dict[str, list[float]] = {"single": [], "shared": []}
    source = TokenSource(seed=1)
    prompts = [source.tokens(4 * chunk) for _ in range(sessions)]
    try:
        with contextlib.ExitStack() as stack:
            pairs = {}
            for mode in rows:
                cfg = {
                    "model": "tiny-qwen3-next", "chunk_size": chunk, "cpu_gib": 0.05,
                    "cpu_fill": 512 / l1_bytes,  # below one 2,048 B KV chunk: all on disk
                    "disk_path": str(work / mode / "disk"), "disk_gib": 0.05,
                    "disk_fsync": False,
                }
                if mode == "shared":
                    cfg["shared_index"] = {"url": server.url, "deployment": "bench",
                                           "instance": "a"}
                (work / mode).mkdir(parents=True)
                path = work / mode / "histate.yaml"
                path.write_text(yaml.safe_dump(cfg))
                command = [sys.executable, "-m", "lmcache_histate.backends.server.launcher",
                           "--config", str(path)]
                srv = stack.enter_context(
                    lmcache_server(workdir=work / mode, chunk_size=chunk, command=command))
                e = stack.enter_context(
                    HybridEngineClient(srv.endpoints.zmq_url, EngineGeometry(num_blocks=2048)))
                for p in prompts:
                    e.store_chunks(p, snapshot_chunks=[3])
                srv.wait_l2_flushed()
                pairs[mode] = (srv, e)
            for i in range(repeats):
                for mode, (srv, e) in pairs.items():
                    srv.clear_l1()
                    p, rid = prompts[i % sessions], f"bench-{i}"
                    t0 = time.perf_counter_ns()
                    hits = e.lookup(p, rid)
                    rows[mode].append((time.perf_counter_ns() - t0) / 1000)
                    if hits != 4:
                        raise SystemExit(f"{mode}: LOOKUP hit {hits} chunks, expected 4")
                    e.free_lookup_locks(p, hits, rid)
                    e.end_session(rid)
    finally:
        server.stop()
    print(f"live server path: {repeats} LOOKUPs of 4 chunks (4 KV + 1 snapshot from disk) "
          f"over {sessions} sessions, L1 cleared before each; the two servers sampled alternately")
    print("| path | median (µs) | p99 (µs) | median − single (µs) |")
    print("|---|---:|---:|---:|")
    base = statistics.median(rows["single"])
    for mode, samples in rows.items():
        samples.sort()
        med = statistics.median(samples)
        p99 = samples[int(0.99 * (len(samples) - 1))]
        print(f"| {mode} | {med:.1f} | {p99:.1f} | {med - base:+.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=5000)
    ap.add_argument("--objects", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--live", action="store_true", help="the live server path (docstring)")
    ap.add_argument("--sessions", type=int, default=20, help="--live: sessions stored")
    args = ap.parse_args()
    if args.live:
        live(args.repeats, args.sessions)
        return
    work = Path(tempfile.mkdtemp(prefix="histate-bench-"))
    objects = _objects(work / "disk", args.files)
    adapter = HiStateDiskAdapter(
        {"disk_path": str(work / "disk"), "disk_gib": 1, "disk_adopt": True}
    )
    server = RedisServer(work / "redis")
    server.start()
    cfg = SharedIndexConfig(url=server.url, deployment="bench", instance="A")
    parsers = {"python parser": _RESP2Parser}
    if HIREDIS_AVAILABLE:
        parsers["hiredis"] = _HiredisParser
    indexes = {
        name: SharedIndex(IndexConnection(cfg, client=redis.Redis.from_url(
            server.url, decode_responses=True, parser_class=cls)), KeySpace("bench", MODEL),
            tau=None)
        for name, cls in parsers.items()
    }
    first = next(iter(indexes.values()))
    first.join(1 << 40)
    for start in range(0, len(objects), 500):
        first.commit([r for _, r in objects[start : start + 500]])
    rng = random.Random(0)

    print(f"{args.files} objects on disk and in the index; {args.repeats} lookups per cell; "
          f"redis-py {redis.__version__}, hiredis {'yes' if HIREDIS_AVAILABLE else 'no'}")
    print("| objects | path | median (µs) | p99 (µs) | median / single | in Redis (µs/call) |")
    print("|---:|---|---:|---:|---:|---:|")
    probe = first.conn.client
    try:
        for k in args.objects:
            def pick(k: int = k) -> list[tuple[ObjectKey, ObjectRecord]]:
                s = rng.randrange(0, len(objects) - k)
                return objects[s : s + k]

            def single(chosen=None) -> None:  # type: ignore[no-untyped-def]
                keys = [key for key, _ in (chosen or pick())]
                tid = adapter.submit_lookup_and_lock_task(keys, {})
                adapter.query_lookup_and_lock_result(tid)
                adapter.submit_unlock(keys)

            rows: dict[str, list[float]] = {"single": []}
            in_redis: dict[str, list[int]] = {}
            cells: dict[str, Callable[[], None]] = {"single": single}
            for name, index in indexes.items():
                def shared(index=index, release=False) -> None:  # type: ignore[no-untyped-def]
                    chosen = pick()
                    single(chosen)
                    ids = [object_id(r.oid) for _, r in chosen]
                    index.lookup(ids)
                    if release:
                        index.release(ids)

                cells[f"shared, {name}"] = shared
                cells[f"shared+release, {name}"] = lambda s=shared: s(release=True)
            for _ in range(4):  # interleaved rounds
                for name, fn in cells.items():
                    calls0, usec0 = _script_usec(probe)
                    rows.setdefault(name, []).extend(_timed(fn, args.repeats // 4))
                    calls1, usec1 = _script_usec(probe)
                    acc = in_redis.setdefault(name, [0, 0])
                    acc[0] += calls1 - calls0
                    acc[1] += usec1 - usec0
            base = statistics.median(rows["single"])
            for name, samples in rows.items():
                samples.sort()
                med = statistics.median(samples)
                p99 = samples[int(0.99 * (len(samples) - 1))]
                calls, usec = in_redis[name]
                script = f"{usec / calls:.1f}" if calls > 0 else "–"
                print(f"| {k} | {name} | {med:.1f} | {p99:.1f} | {med / base:.1f}× | {script} |")
    finally:
        adapter.close()
        server.stop()


if __name__ == "__main__":
    main()
