"""The disk tier wired to the runtime: headers decided under the lock, reports queued.

A file's header (kind, prefix depth, parent chunk hash) is decided where the runtime routes
the write, under its lock, and travels down with it (``disk.tier`` NOTE 2); what the I/O
threads learn goes up through the tier's report queue, drained by the runtime under its
lock (``disk.tier`` NOTE 3): no disk I/O thread runs any code of the runtime or the core.
Real files and threads: a real ``HiStateDiskAdapter`` (one fsynced I/O
worker, so writes queue) behind the runtime on the stand-in L1 of ``test_backend_runtime``,
found by ``attach_server`` among the storage manager's L2 adapters as LMCache builds it,
writes submitted as LMCache's store controller submits them, racing a thread that changes
the chains (new chains past a small link table, CPU evictions, session ends, janitor ticks).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from lmcache.v1.multiprocess.token_hasher import TokenHasher
from lmcache_histate.backends.server.disk import file_format as df
from lmcache_histate.backends.server.disk.entries import to_key
from lmcache_histate.backends.server.disk.tier import HiStateDiskAdapter
from lmcache_histate.backends.server.runtime import objects as objects_module
from lmcache_histate.backends.server.runtime.runtime import HiStateRuntime
from test_backend_disk_tier import finished
from test_backend_runtime import (
    CHUNK,
    KV_BYTES,
    SNAP_BYTES,
    Ctx,
    FakeL1,
    Obj,
    StorageManager,
    ipc,
    objects,
    toks,
)

import lmcache_histate.core
from lmcache_histate.config import parse_config
from lmcache_histate.core.tiers import ServerTier

# What a disk I/O thread must never run: the runtime's parts and the core.
RUNTIME_DIR = str(Path(objects_module.__file__).parent)
CORE_DIR = str(Path(lmcache_histate.core.__file__).parent)
DISK = ServerTier.DISK


def disk_runtime(tmp_path: Path, disk_capacity: int) -> tuple[HiStateRuntime, HiStateDiskAdapter]:
    disk = HiStateDiskAdapter({"disk_path": str(tmp_path / "disk"),
                               "disk_gib": disk_capacity / 2**30, "disk_io_workers": 1,
                               "disk_fsync": True})
    cfg = parse_config(
        {"model": "tiny-qwen3-next", "chunk_size": CHUNK, "cpu_gib": 1, "cpu_fill": 0.5,
         "disk_path": str(tmp_path / "disk"), "disk_gib": 1}
    )
    runtime = HiStateRuntime(cfg)
    l1 = FakeL1()
    runtime.attach_server(Ctx(StorageManager(l1, {0: disk})))
    l1.runtime = runtime
    return runtime, disk


def test_attach_server_finds_the_disk_tier_and_drains_its_reports(tmp_path: Path) -> None:
    """A failed write is queued by the I/O thread and taken by the runtime's next step."""
    runtime, disk = disk_runtime(tmp_path, 4096)
    try:
        assert runtime.actions.disk is disk
        key = objects(runtime, ipc(toks(1, 1), 0, CHUNK, "r"), [0], 0)[0]
        task = disk.submit_store_task([key], [Obj(8192)])  # over the capacity: fails
        assert not finished(disk, task)
        runtime.tick()  # the janitor's step drains the queue
        assert disk.take_reports() == []
        assert disk.stats["not_persisted_capacity"] == 1
    finally:
        disk.close()


def expected_headers(key: Any, chunks: int) -> dict[tuple[bytes, int], tuple[int, int, bytes]]:
    """By hand, per (chunk hash, object group): chunk i of a prompt sits at depth i after
    chunk i - 1 (LMCache's hasher names the chunks); group 0 is KV, group 1 the recurrent
    snapshot."""
    hasher = TokenHasher(CHUNK, "blake3")
    hashes = [TokenHasher.hash_to_bytes(h)
              for h in hasher.compute_chunk_hashes(list(key.token_ids), end=key.end)]
    return {(hashes[i], group): (kind, i, hashes[i - 1] if i else b"")
            for i in range(chunks) for group, kind in ((0, df.KIND_KV), (1, df.KIND_SNAPSHOT))}


def test_written_headers_are_the_routing_decisions_while_chains_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """60 prompts of 6 chunks stored (snapshots after chunks 1, 3, 5), their routed objects
    written as LMCache submits them, while another thread links 400 fresh chains through a
    64-link table (the links of chunks the core dropped are trimmed), evicts the CPU tier
    and ends sessions, and the disk (room for ~40 snapshots) makes the core drop disk
    copies. Every file left has the header its routing (or demotion) decision gave it, no
    disk I/O thread ran any code of the runtime or the core (their reports are queued and
    drained under the lock), and the object map still passes its ``check``."""
    monkeypatch.setattr(objects_module, "_LINKS_MAX", 64)
    violations: list[str] = []
    io_calls: list[str] = []
    runtime: HiStateRuntime | None = None

    def tracer(frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call" or not threading.current_thread().name.startswith("histate-disk"):
            return
        path = frame.f_code.co_filename
        io_calls.append(frame.f_code.co_name)
        if path.startswith((RUNTIME_DIR, CORE_DIR)):
            violations.append(f"{Path(path).name}:{frame.f_code.co_qualname}")

    threading.setprofile(tracer)  # the tier's I/O thread starts at its first task
    try:
        runtime, disk = disk_runtime(tmp_path, 40 * (4096 + 200))
        expected: dict[tuple[bytes, int], tuple[int, int, bytes]] = {}
        submitted: list[int] = []
        stop = threading.Event()

        def churn() -> None:
            assert runtime is not None
            n = 0
            while not stop.is_set() or n < 400:
                t = toks(6, 10_000 + n)
                runtime.on_lookup(ipc(t, 0, len(t), f"l{n}", worker=None))
                if n % 7 == 0:
                    runtime.evict_cpu(1 << 16)
                if n % 5 == 0:
                    runtime.on_end_session(f"w{n // 10}")
                if n % 11 == 0:
                    runtime.tick()
                n += 1

        churner = threading.Thread(target=churn, name="chain-churn")
        churner.start()
        for p in range(60):
            t = toks(6, p + 1)
            key = ipc(t, 0, len(t), f"w{p}")
            expected.update(expected_headers(key, 6))
            runtime.on_store(key)
            keys = objects(runtime, key, [0, 1, 2, 3, 4, 5], 0) + objects(
                runtime, key, [1, 3, 5], 1)
            runtime.actions.l1.resident.update(keys)
            route = runtime.on_committed(keys)  # the store policy's routing decision
            mine = [k for k in keys if k in route]
            if mine:  # what LMCache's store controller then submits
                submitted.append(disk.submit_store_task(
                    mine, [Obj(SNAP_BYTES if k.object_group_id else KV_BYTES) for k in mine]))
        stop.set()
        churner.join(timeout=120)
        assert not churner.is_alive()
        done: set[int] = set()
        deadline = time.monotonic() + 60
        while len(done) < len(submitted) and time.monotonic() < deadline:
            done.update(disk.pop_completed_store_tasks())
            time.sleep(0.01)
        assert len(done) == len(submitted)
        disk.close()  # waits for the demotions in flight too
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
        sys.setprofile(None)

    files = sorted((tmp_path / "disk").rglob("*" + df.SUFFIX))
    assert len(files) >= 20, len(files)
    wrong = []
    for path in files:
        header = df.read_header(path)
        key = to_key(header.oid)
        got, want = (header.kind, header.depth, header.parent), expected[
            (key.chunk_hash, key.object_group_id)]
        if got != want:
            wrong.append((path.name, got, want))
    assert wrong == []
    assert "write_batch" in io_calls  # the tracer saw the I/O thread's work
    # ... and the demotions' (their L1 read locks released there, LMCache's call)
    assert runtime.stats["kv_demoted"] > 0 and "finish_read" in io_calls
    assert violations == [], sorted(set(violations))
    runtime.tick()  # the last reports, as the janitor drains them
    assert disk.take_reports() == []
    # The drains let each demotion's written objects leave L1: no KV object the core holds
    # on disk only is still resident (KV reaches the disk only by demotion here: the CPU
    # tier has room for every committed chunk).
    stale = [k for k in runtime.actions.l1.resident
             if k.object_group_id == 0 and runtime.objects.key_tiers(k) == 1 << DISK]
    assert stale == []
    runtime.check()  # the object map kept a link for every mapped node through the trims


def store_prompt(runtime: HiStateRuntime, disk: HiStateDiskAdapter, p: int,
                 request: str) -> list[Any]:
    """Store prompt ``p`` (4 chunks, snapshots after chunks 1 and 3) as request
    ``request``, write what the runtime routes to disk as LMCache's store controller does,
    wait until the write succeeded; the routed keys."""
    t = toks(4, 500 + p)
    key = ipc(t, 0, len(t), request)
    runtime.on_store(key)
    keys = objects(runtime, key, [0, 1, 2, 3], 0) + objects(runtime, key, [1, 3], 1)
    runtime.actions.l1.resident.update(keys)
    route = runtime.on_committed(keys)
    mine = [k for k in keys if k in route]
    task = disk.submit_store_task(mine, [Obj(SNAP_BYTES) for _ in mine])
    assert finished(disk, task), (p, disk.stats)
    return mine


def test_a_write_gets_the_room_its_eviction_made_while_a_reader_holds_the_victim(
    tmp_path: Path,
) -> None:
    """``disk.tier`` NOTE 9: a 16,000-byte disk tier. The core counts 16,000 - 13 x 175
    = 13,725 payload bytes there (``payload_capacity``: 175 = a 111-byte header + 64 per
    1,024-byte KV chunk that could fit): three 4,096-byte snapshots; their files take
    4,207 bytes each, so the tier holds three and refuses a fourth (16,828 > 16,000).
    Prompts of 4 chunks each route two snapshots to disk (the intermediate one after chunk
    1 and the final's durable copy); before each commit a reader locks every file on disk,
    as LMCache's prefetch does after a lookup. Each write the core made room for is
    stored although its victim's file stays until the reader lets go; once it does, at
    most three files remain and the bytes held match them."""
    runtime, disk = disk_runtime(tmp_path, 16_000)
    try:
        for p in range(6):
            held = list(disk.entries())
            locked = disk.submit_lookup_and_lock_task(held, {})
            assert disk.query_lookup_and_lock_result(locked).get_indices_list() == list(
                range(len(held)))
            mine = store_prompt(runtime, disk, p, f"p{p}")
            assert len(mine) == 2 and all(k.object_group_id == 1 for k in mine)
            disk.submit_unlock(held)
            runtime.tick()
        files = list((tmp_path / "disk").rglob("*" + df.SUFFIX))
        assert len(files) == 3
        status = disk.report_status()
        assert status["bytes_used"] == sum(f.stat().st_size for f in files) == 3 * 4207
        assert status["bytes_leaving"] == 0
        assert disk.stats["not_persisted_capacity"] == 0
        assert runtime.stats["snapshot_evicted.disk"] == 12 - 3
    finally:
        disk.close()


def test_a_snapshot_stored_again_while_its_delete_waits_keeps_its_file(tmp_path: Path) -> None:
    """``disk.tier`` NOTE 4 through the runtime, on the 16,000-byte tier of the test above
    (three snapshot files). Prompt 0 routes its two snapshots to disk; a reader locks
    them; prompts 1 and 2 route two each, so the core drops prompt 0's (their deletes wait
    for the reader). Prompt 0 is then stored again (another request computed the same
    chunks): the core takes its snapshots back on disk and the write finds their files.
    When the reader lets go, every object the core holds on disk still has its file."""
    runtime, disk = disk_runtime(tmp_path, 16_000)
    requests = iter(range(100))

    def commit(p: int) -> list[Any]:
        mine = store_prompt(runtime, disk, p, f"r{next(requests)}")
        runtime.tick()
        return mine

    try:
        first = commit(0)
        assert len(first) == 2
        locked = disk.submit_lookup_and_lock_task(first, {})
        assert disk.query_lookup_and_lock_result(locked).get_indices_list() == [0, 1]
        commit(1)
        commit(2)
        assert not any(runtime.objects.key_tiers(k) & (1 << DISK) for k in first)
        assert commit(0) == first
        assert all(runtime.objects.key_tiers(k) & (1 << DISK) for k in first)
        disk.submit_unlock(first)
        runtime.tick()
        on_disk = set(disk.entries())
        tracked = {k for k in runtime.objects.part_of if runtime.objects.key_tiers(k) & (1 << DISK)}
        assert set(first) <= tracked == on_disk and len(on_disk) == 3
        assert disk.stats["deletes_superseded"] == 2
    finally:
        disk.close()
