"""Soak and fault runs against a real ``histate-server`` (the figures of docs/reliability.md).

Scenarios (each prints one JSON line of figures):

* ``reconnects``: ``--clients`` engines at a time register, store a chunk and unregister,
  again and again for ``--seconds``; the server's RSS, shared-memory mappings and open
  fds are sampled before and after. ``--stock`` runs plain ``lmcache server`` instead
  of the launcher (upstream's behaviour, for comparison).
* ``clients``: ``--clients`` engines store and retrieve random prefixes concurrently for
  ``--seconds``; every hit is compared byte for byte with what was stored.
* ``kill9``: ``--clients`` writers store prefixes (``--policy``, default ``lru``: every
  object written through to the disk tier; ``--fsync``: ``disk_fsync: true``) until the
  server is killed with SIGKILL mid-write; a restarted server on the same folder is then
  asked for every prefix: a hit must be byte-identical. Misses are split by how long
  before the kill the STORE was acknowledged, and the disk tier's write-behind lag
  (``/status``) is sampled every 0.5 s until the kill.

Usage: .venv/bin/python benchmarks/soak_server.py {reconnects,clients,kill9}
       [--seconds 60] [--clients 6] [--stock] [--policy lru|histate] [--fsync]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.lmcache_mp import (
    EngineGeometry,
    HybridEngineClient,
    TokenSource,
    lmcache_server,
)

CHUNK = 16
GEOMETRY = EngineGeometry(num_blocks=2048)
LAUNCHER = [sys.executable, "-m", "lmcache_histate.backends.server.launcher"]


def server_for(work: Path, *, policy: str = "histate", stock: bool = False,
               fsync: bool = False) -> Any:
    """A context manager running the launcher (or stock ``lmcache server``) in ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    if stock:
        return lmcache_server(workdir=work / "srv", chunk_size=CHUNK, l1_size_gb=0.5)
    config = work / "histate.yaml"
    config.write_text(yaml.safe_dump({
        "model": "tiny-qwen3-next", "chunk_size": CHUNK, "cpu_gib": 0.5, "policy": policy,
        "disk_path": str(work / "disk"), "disk_gib": 1, "disk_fsync": fsync,
    }))
    return lmcache_server(workdir=work / "srv", chunk_size=CHUNK, l1_size_gb=0.5,
                          command=[*LAUNCHER, "--config", str(config)])


def process_figures(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    with open(f"/proc/{pid}/maps") as f:
        maps = sum(1 for line in f if "/dev/shm/" in line)
    fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    return {"rss_mib": rss_kib // 1024, "shm_mappings": maps, "fds": fds}


def run_threads(n: int, seconds: float, body: Any) -> Counter[str]:
    """Run ``body(i, stop, counts)`` in ``n`` threads for ``seconds``; merged counts."""
    stop = threading.Event()
    counts: list[Counter[str]] = [Counter() for _ in range(n)]
    threads = [threading.Thread(target=body, args=(i, stop, counts[i])) for i in range(n)]
    for t in threads:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    return sum(counts, Counter())


# --------------------------------------------------------------------------- scenarios
def reconnects(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    with server_for(work, stock=args.stock) as server:
        url = server.endpoints.zmq_url
        with HybridEngineClient(url, GEOMETRY) as engine:  # warm-up: core, L1, threads
            engine.store_chunks(TokenSource(seed=1).tokens(CHUNK), snapshot_chunks=[0])
        before = process_figures(server.pid)

        def body(i: int, stop: threading.Event, counts: Counter[str]) -> None:
            source = TokenSource(seed=100 + i)
            while not stop.is_set():
                with HybridEngineClient(url, GEOMETRY) as engine:
                    engine.store_chunks(source.tokens(CHUNK), snapshot_chunks=[0], wait=False)
                counts["reconnects"] += 1

        counts = run_threads(args.clients, args.seconds, body)
        time.sleep(2)  # let the last unregisters finish
        after = process_figures(server.pid)
    return {"scenario": "reconnects", "server": "stock" if args.stock else "histate",
            "clients": args.clients, "seconds": args.seconds, **counts,
            "before": before, "after": after}


def clients(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    with server_for(work) as server:
        url = server.endpoints.zmq_url

        def body(i: int, stop: threading.Event, counts: Counter[str]) -> None:
            source, rng = TokenSource(seed=200 + i), random.Random(i)
            stored: list[tuple[list[int], Any]] = []
            with HybridEngineClient(url, GEOMETRY) as engine:
                while not stop.is_set() and engine._next_block < GEOMETRY.num_blocks - 64:
                    if not stored or rng.random() < 0.5:
                        prefix = source.tokens(4 * CHUNK)
                        stored.append((prefix, engine.store_chunks(
                            prefix, snapshot_chunks=[1, 3], wait=False)))
                        counts["stores"] += 1
                        continue
                    prefix, sp = rng.choice(stored)
                    got = engine.lookup_and_retrieve(prefix)
                    counts["retrieves"] += 1
                    counts["hit_chunks"] += got.hit_chunks
                    if got.hit_chunks and not engine.matches(sp, got):
                        counts["wrong_bytes"] += 1

        counts = run_threads(args.clients, args.seconds, body)
        healthy = server.http("GET", "/healthcheck") == {"status": "healthy"}
    return {"scenario": "clients", "clients": args.clients, "seconds": args.seconds,
            "wrong_bytes": 0, **counts, "healthy_after": healthy}


def kill9(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    # (prefix, bytes by hit length, monotonic time the STORE was acknowledged)
    expected: list[tuple[list[int], dict[int, tuple[bytes, bytes]], float]] = []
    lock = threading.Lock()
    lags: list[float] = []
    refused, killed_at = [0], [0.0]
    with server_for(work, policy=args.policy, fsync=args.fsync) as server:
        url = server.endpoints.zmq_url

        def body(i: int, stop: threading.Event, counts: Counter[str]) -> None:
            source = TokenSource(seed=300 + i)
            while not stop.is_set():  # a fresh engine whenever one runs out of blocks
                with HybridEngineClient(url, GEOMETRY, rpc_timeout=5) as engine:
                    while not stop.is_set() and engine._next_block < GEOMETRY.num_blocks - 64:
                        prefix = source.tokens(4 * CHUNK)
                        try:
                            sp = engine.store_chunks(prefix, snapshot_chunks=[1, 3], wait=False)
                        except Exception:
                            counts["store_errors"] += 1  # the server is gone
                            return
                        acked = time.monotonic()
                        by_hit = {n: engine.stored_bytes(sp, n) for n in (2, 4)}
                        with lock:
                            expected.append((prefix, by_hit, acked))
                        counts["stores"] += 1

        def killer() -> None:
            deadline = time.monotonic() + args.seconds
            while time.monotonic() < deadline:
                time.sleep(0.5)
                try:
                    adapters = server.status()["storage_manager"].get("l2_adapters") or []
                    for a in adapters:
                        lags.append(float(a.get("write_lag_s", 0)))
                        refused[0] = int(a.get("stats", {}).get("not_persisted_backlog", 0))
                except Exception:
                    pass
            killed_at[0] = time.monotonic()
            server.kill()

        threading.Thread(target=killer).start()
        counts = run_threads(args.clients, args.seconds + 30, body)
    outcome: Counter[str] = Counter()
    per_engine = (GEOMETRY.num_blocks - 64) // 5  # a retrieve takes 4 + 1 blocks
    with server_for(work, policy=args.policy, fsync=args.fsync) as server:
        for start in range(0, len(expected), per_engine):
            with HybridEngineClient(server.endpoints.zmq_url, GEOMETRY) as engine:
                for prefix, by_hit, acked in expected[start : start + per_engine]:
                    got = engine.lookup_and_retrieve(prefix)
                    age = killed_at[0] - acked
                    if got.hit_chunks == 0:
                        outcome["missing"] += 1
                        for s in (2, 12):
                            outcome[f"missing_acked_over_{s}s_before_kill"] += age > s
                    elif engine.retrieved_bytes(got) != by_hit.get(got.hit_chunks):
                        outcome["wrong_bytes"] += 1
                    else:
                        outcome["complete" if got.hit_chunks == 4 else "partial"] += 1
                    outcome["acked_over_12s_before_kill"] += age > 12
        disk = server.status()["storage_manager"]
    return {"scenario": "kill9", "policy": args.policy, "fsync": args.fsync,
            "clients": args.clients, "seconds_before_kill": args.seconds,
            **counts, "prefixes": len(expected), "wrong_bytes": 0, **outcome,
            "max_write_lag_s": round(max(lags, default=0.0), 2),
            "objects_refused_by_lag_bound": refused[0],
            "l2_after_restart": json.dumps(disk.get("l2_adapters", disk))[:200]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", choices=["reconnects", "clients", "kill9"])
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--stock", action="store_true", help="reconnects: plain lmcache server")
    p.add_argument("--policy", choices=["lru", "histate"], default="lru", help="kill9")
    p.add_argument("--fsync", action="store_true", help="kill9: disk_fsync: true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="histate-soak-") as tmp:
        result = {"reconnects": reconnects, "clients": clients, "kill9": kill9}[args.scenario](
            args, Path(tmp)
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
