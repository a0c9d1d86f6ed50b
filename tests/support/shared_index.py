"""Helpers of the shared-index tests: servers' index handles and objects in a shared folder."""

from __future__ import annotations

import random
import time
import zlib
from pathlib import Path

from lmcache_histate.backends.server.disk import file_format as df
from lmcache_histate.backends.server.shared_index.budget import (
    delete_victims,
    reserve_with_eviction,
)
from lmcache_histate.backends.server.shared_index.connection import IndexConnection
from lmcache_histate.backends.server.shared_index.index import SharedIndex
from lmcache_histate.backends.server.shared_index.layout import (
    KeySpace,
    ObjectRecord,
    object_id,
)

from lmcache_histate.config import SharedIndexConfig

__all__ = ["MODEL", "eviction_worker", "hold_lease", "make_index", "oid", "record_size",
           "settings", "write"]

MODEL = "tiny-qwen3-next"


def settings(url: str, instance: str, **kw: float) -> SharedIndexConfig:
    base = {"op_timeout_s": 1.0, "connect_timeout_s": 1.0, "retry_s": 0.05}
    return SharedIndexConfig(url=url, deployment="test", instance=instance, **{**base, **kw})


def make_index(url: str, instance: str, tau: float | None = 0.0, **kw: float) -> SharedIndex:
    """A server's handle; ``tau = 0`` (LRU) unless a test ranks by cost."""
    return SharedIndex(IndexConnection(settings(url, instance, **kw)), KeySpace("test", MODEL),
                       tau=tau)


def oid(n: int) -> df.ObjectId:
    """Object ``n``: a 16-byte chunk hash, ``n`` in its first four bytes."""
    return df.ObjectId(MODEL, 0, 1, n.to_bytes(4, "big") * 4)


def write(root: Path, n: int, payload: bytes, *, kind: int = df.KIND_SNAPSHOT,
          cost: float = 0.0, freed: float = 0.0) -> ObjectRecord:
    """Write object ``n`` into the shared folder as a server does; its record."""
    o = oid(n)
    path = df.object_path(root, o)
    size = df.write_object(path, o, payload, kind=kind, depth=n, parent=b"", fsync=False)
    return ObjectRecord(df.encode_id(o), str(path.relative_to(root)), size, zlib.crc32(payload),
                        kind, n, b"", cost=cost, freed=freed or float(size))


def record_size(n: int, payload_len: int) -> int:
    """File size of object ``n`` with a payload of ``payload_len`` bytes."""
    return df.header_size(oid(n), b"") + payload_len



def hold_lease(url: str, object_id: str, lease_ttl_s: float, ready) -> None:  # type: ignore[no-untyped-def]
    """Child process body: lease ``object_id`` as server "H", signal ``ready``, then wait
    to be killed (the lease is never released)."""
    index = make_index(url, "H", lease_ttl_s=lease_ttl_s)
    assert object_id in index.lookup([object_id])
    ready.set()
    time.sleep(600)


def eviction_worker(url: str, root: str, worker: int, iterations: int, queue) -> None:  # type: ignore[no-untyped-def]
    """Child process body: a server writing under the budget (evicting by H as needed)
    and loading random objects of the deployment under leases. Puts what it saw on
    ``queue``: ids it claimed, loads tried and loads that found no valid file, and the
    highest ``used`` it read."""
    folder = Path(root)
    index = make_index(url, f"W{worker}", tau=5.0)
    rng = random.Random(worker)
    claimed: list[str] = []
    loads = bad = max_used = stored = 0
    unlink = delete_victims(folder)

    def deleter(victims):  # type: ignore[no-untyped-def]
        claimed.extend(v.id for v in victims)
        return unlink(victims)

    for i in range(iterations):
        n = worker * 100_000 + i
        payload = bytes([i % 256]) * rng.randint(200, 2000)
        o = oid(n)
        rel = str(df.object_path(folder, o).relative_to(folder))
        size = df.header_size(o, b"") + len(payload)
        oid_hex = object_id(df.encode_id(o))
        got = reserve_with_eviction(index, [(oid_hex, size, rel)], deleter)
        if got is not None and got.reserved:
            index.commit([write(folder, n, payload, cost=rng.uniform(1, 1000), freed=size)])
            stored += 1
        some = index.conn.client.zrandmember(index.keys.rank, 3) or []
        found = index.lookup(some) or {}
        time.sleep(0.002)  # a load takes a while: other servers evict meanwhile
        for loc in found.values():
            key = df.decode_id(loc.oid)
            buf = bytearray(loc.size - df.header_size(key, loc.parent))
            status, _ = df.read_object(folder / loc.path, key, memoryview(buf))
            loads += 1
            bad += status is not df.ReadStatus.OK
        index.release(found)
        max_used = max(max_used, index.usage()[0])
    queue.put({"claimed": claimed, "stored": stored, "loads": loads, "bad": bad,
               "max_used": max_used})
