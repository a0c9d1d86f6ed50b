"""The HiState disk tier (L2 adapter plugin) driven directly through LMCache's adapter API.

No server: these pin down the file format, atomic writes, restart recovery, capacity,
corruption handling and lookup locks. The server-level behaviour is in
``test_backend_server.py``.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lmcache.v1.distributed.api import ObjectKey
from lmcache_histate.backends.server.disk import file_format as df
from lmcache_histate.backends.server.disk.entries import ObjectMeta
from lmcache_histate.backends.server.disk.tier import FilesLost, HiStateDiskAdapter, WriteDone

MODEL = "org/model"


class Obj:
    """Stands in for LMCache's MemoryObj: the adapter only touches ``byte_array``."""

    def __init__(self, data: bytes | int) -> None:
        self.byte_array = bytearray(data)


def key(i: int, group: int = 1) -> ObjectKey:
    return ObjectKey(
        chunk_hash=i.to_bytes(4, "little") * 8, model_name=MODEL, kv_rank=0x01000100,
        object_group_id=group,
    )


def adapter(path: Path, capacity: int = 1 << 20, **kw: object) -> HiStateDiskAdapter:
    """A tier of ``capacity`` bytes; ``kw``: more ``adapter_params`` (the server's keys)."""
    return HiStateDiskAdapter({"disk_path": str(path), "disk_gib": capacity / 2**30, **kw})


def wait(fd: int, timeout: float = 10.0) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    assert poller.poll(timeout * 1000), "adapter did not signal completion"
    os.read(fd, 8)


def store(a: HiStateDiskAdapter, keys: list[ObjectKey], payloads: list[bytes]) -> bool:
    return finished(a, a.submit_store_task(keys, [Obj(p) for p in payloads]))


def finished(a: HiStateDiskAdapter, tid: Any) -> bool:
    """Wait for store task ``tid``; whether it succeeded."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done = a.pop_completed_store_tasks()
        if tid in done:
            return done[tid].is_successful()
        time.sleep(0.01)
    raise TimeoutError("store task did not complete")


def lookup(a: HiStateDiskAdapter, keys: list[ObjectKey]) -> list[int]:
    tid = a.submit_lookup_and_lock_task(keys, {})
    wait(a.get_lookup_and_lock_event_fd())
    bitmap = a.query_lookup_and_lock_result(tid)
    assert bitmap is not None
    return bitmap.get_indices_list()


def load(a: HiStateDiskAdapter, keys: list[ObjectKey], sizes: list[int]) -> tuple[list[int], list]:
    objs = [Obj(n) for n in sizes]
    tid = a.submit_load_task(keys, objs)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        bitmap = a.query_load_result(tid)
        if bitmap is not None:
            return bitmap.get_indices_list(), [bytes(o.byte_array) for o in objs]
        time.sleep(0.01)
    raise TimeoutError("load task did not complete")


def test_round_trip_files_and_accounting(tmp_path: Path) -> None:
    a = adapter(tmp_path)
    try:
        payloads = [os.urandom(3000), os.urandom(5000)]
        assert store(a, [key(1), key(2)], payloads)
        files = sorted(p.name for p in tmp_path.rglob("*.hsf"))
        assert len(files) == 2 and all("@1@" in f for f in files)
        assert all(f.startswith("org_model@0x01000100@1@") for f in files)
        usage = a.get_usage()
        assert usage.total_bytes_used == sum(p.stat().st_size for p in tmp_path.rglob("*.hsf"))
        assert usage.total_capacity_bytes == 1 << 20
        assert lookup(a, [key(1), key(3), key(2)]) == [0, 2]
        hits, data = load(a, [key(1), key(2)], [3000, 5000])
        assert hits == [0, 1] and data == payloads
        a.submit_unlock([key(1), key(2)])
        a.delete([key(1)])
        assert lookup(a, [key(1)]) == []
        assert len(list(tmp_path.rglob("*.hsf"))) == 1
        assert a.get_usage().total_bytes_used == sum(
            p.stat().st_size for p in tmp_path.rglob("*.hsf")
        )
        # A second store of an existing object is a success that writes nothing.
        assert store(a, [key(2)], [b"x" * 5000])
        assert load(a, [key(2)], [5000])[1] == [payloads[1]]
    finally:
        a.close()


def test_a_delete_before_its_write_starts_cancels_it(tmp_path: Path) -> None:
    """tier NOTE 8: the one I/O thread is held, so the store waits in the pool's queue
    when the delete of one of its keys arrives; that key must never reach the disk (no
    orphan file outside the index), the other must, and a store submitted after the delete
    is written."""
    a = adapter(tmp_path, disk_io_workers=1)
    try:
        gate = threading.Event()
        a._pool.submit(gate.wait)  # the only I/O thread is busy until the gate opens
        tid = a.submit_store_task([key(1), key(2)], [Obj(b"a" * 3000), Obj(b"b" * 4000)])
        a.delete([key(1)])
        gate.set()
        assert finished(a, tid)
        files = list(tmp_path.rglob("*.hsf"))
        assert len(files) == 1  # key 2 only
        assert lookup(a, [key(1), key(2)]) == [1]
        a.submit_unlock([key(2)])
        assert a.get_usage().total_bytes_used == files[0].stat().st_size
        assert a.report_status()["stats"]["writes_cancelled_queued"] == 1
        assert store(a, [key(1)], [b"c" * 3000])  # submitted after the delete: written
        assert lookup(a, [key(1), key(2)]) == [0, 1]
    finally:
        a.close()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_write_behind_lag_is_reported_and_bounded(tmp_path: Path) -> None:
    """tier NOTE 10: with the one I/O thread held, an accepted write waits and its age is the
    reported lag; once it has waited over the bound (10 s, an injected clock) a new write
    is refused at once: its store task completes failed, its keys counted
    not_persisted_backlog; the held write, released, is written."""
    from lmcache_histate.backends.server.disk.tier import WriteBacklog

    a = adapter(tmp_path, disk_io_workers=1)
    clock = Clock()
    a.backlog = WriteBacklog(10.0, clock)
    try:
        gate = threading.Event()
        a._pool.submit(gate.wait)  # the only I/O thread is busy until the gate opens
        held = a.submit_store_task([key(1)], [Obj(b"a" * 3000)])
        clock.now += 4.0
        assert a.report_status()["write_lag_s"] == 4.0
        assert a.backlog.pending == 1
        clock.now += 6.5  # 10.5 s
        refused = a.submit_store_task([key(2), key(3)], [Obj(b"b" * 10), Obj(b"c" * 10)])
        done = a.pop_completed_store_tasks()
        assert list(done) == [refused] and not done[refused].is_successful()
        assert a.report_status()["stats"]["not_persisted_backlog"] == 2
        gate.set()
        assert finished(a, held)
        assert a.backlog.pending == 0 and a.report_status()["write_lag_s"] == 0.0
        assert store(a, [key(2)], [b"b" * 10])  # under the bound again: written
        assert lookup(a, [key(1), key(2), key(3)]) == [0, 1]
    finally:
        a.close()


def test_a_decided_delete_makes_room_before_it_runs(tmp_path: Path) -> None:
    """tier NOTE 9: room for two 3,000-byte objects (each file 3,087 bytes with its
    87-byte header; 7,000 bytes hold two, not three). A reader holds key 1 when its
    delete is decided: from the mark on it is no hit and its bytes no longer count, so a
    write of key 3 is stored although key 1's file stays until the unlock. The same holds
    in the window between the decision and the delete (key 2), and the room is counted
    once: a fifth object is refused while two files are held."""
    a = adapter(tmp_path, capacity=7000)
    try:
        assert store(a, [key(1), key(2)], [b"a" * 3000, b"b" * 3000])
        assert lookup(a, [key(1)]) == [0]  # a reader holds key 1
        assert not store(a, [key(3)], [b"c" * 3000])  # full: refused
        a.mark_decisions([key(1)])
        assert a.report_status()["bytes_leaving"] == 3087
        assert lookup(a, [key(1)]) == []  # doomed: no longer a hit
        a.delete([key(1)])  # deferred to the unlock
        assert store(a, [key(3)], [b"c" * 3000])
        assert len(list(tmp_path.rglob("*.hsf"))) == 3  # key 1 still read
        a.submit_unlock([key(1)])
        assert len(list(tmp_path.rglob("*.hsf"))) == 2
        status = a.report_status()
        assert status["bytes_leaving"] == 0 and status["bytes_used"] == 2 * 3087
        a.mark_decisions([key(2)])  # decided, delete not run yet
        assert store(a, [key(4)], [b"d" * 3000])
        a.delete([key(2)])
        assert not store(a, [key(5)], [b"e" * 3000])  # keys 3 and 4 fill it again
        assert lookup(a, [key(2), key(3), key(4)]) == [1, 2]
        status = a.report_status()
        assert status["bytes_used"] == 2 * 3087 == sum(
            f.stat().st_size for f in tmp_path.rglob("*.hsf"))
        assert status["stats"]["not_persisted_capacity"] == 2
    finally:
        a.close()


def test_a_write_decided_after_a_delete_keeps_the_file(tmp_path: Path) -> None:
    """tier NOTE 4: the decisions' order, not their runs', decides. Key 1 (100 bytes, a
    187-byte file): (a) a delete decided, then a write of it: a hit again, its bytes count
    again, the write answers present, and the delete, run last, leaves the file; (b) the
    delete already run and waiting for a reader when the write is decided: the unlock
    leaves the file; (c) delete, write, delete decided, the two deletes run: the file goes.
    A delete nobody decided (LMCache's own, key 2) runs as before."""
    a = adapter(tmp_path)
    files = lambda: len(list(tmp_path.rglob("*.hsf")))  # noqa: E731
    try:
        assert store(a, [key(1), key(2)], [b"a" * 100, b"b" * 100])
        a.mark_decisions([key(1)])
        assert a.report_status()["bytes_leaving"] == 187
        a.mark_decisions([], [key(1)])
        assert a.report_status()["bytes_leaving"] == 0
        assert store(a, [key(1)], [b"a" * 100])  # present
        a.delete([key(1)])
        assert files() == 2 and lookup(a, [key(1)]) == [0]  # (b): the lookup holds key 1
        a.mark_decisions([key(1)])
        a.delete([key(1)])  # waits for the reader
        a.mark_decisions([], [key(1)])
        a.submit_unlock([key(1)])
        assert files() == 2 and lookup(a, [key(1)]) == [0]
        a.submit_unlock([key(1)])
        assert a.report_status()["stats"]["deletes_superseded"] == 2
        a.mark_decisions([key(1)])  # (c)
        a.mark_decisions([], [key(1)])
        a.mark_decisions([key(1)])
        a.delete([key(1)])
        a.delete([key(1)])
        assert lookup(a, [key(1)]) == []
        a.delete([key(2)])
        assert files() == 0
        status = a.report_status()
        assert status["bytes_used"] == 0 and status["bytes_leaving"] == 0
        assert status["stats"]["deletes_superseded"] == 3
        assert status["stats"]["objects_deleted"] == 2
    finally:
        a.close()


def test_a_write_decided_after_a_delete_that_cancelled_it_in_flight_completes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tier NOTE 4 while the file is being written: key 1's write is held inside the file
    write (a gate, the only timing this test controls), a delete is decided and run (it
    cancels the write in flight), then a write of key 1 is decided. The held write
    completes and its file stays: indexed, one 187-byte file, counted once."""
    gate, entered = threading.Event(), threading.Event()
    real = df.write_object

    def held(*args: Any, **kw: Any) -> Any:
        entered.set()
        assert gate.wait(10)
        return real(*args, **kw)

    monkeypatch.setattr(df, "write_object", held)
    a = adapter(tmp_path, disk_io_workers=1)
    try:
        tid = a.submit_store_task([key(1)], [Obj(b"a" * 100)])
        assert entered.wait(10)
        a.mark_decisions([key(1)])
        a.delete([key(1)])  # cancels the write in flight
        a.mark_decisions([], [key(1)])
        gate.set()
        assert finished(a, tid)
        assert lookup(a, [key(1)]) == [0]
        assert [f.stat().st_size for f in tmp_path.rglob("*.hsf")] == [187]
        status = a.report_status()
        assert status["bytes_used"] == 187
        assert status["stats"]["deletes_superseded"] == 1
        assert status["stats"].get("writes_cancelled", 0) == 0
    finally:
        gate.set()
        a.close()


def test_restart_rebuilds_index_and_removes_leftovers(tmp_path: Path) -> None:
    a = adapter(tmp_path)
    assert store(a, [key(1), key(2)], [b"a" * 100, b"b" * 200])
    used = a.get_usage().total_bytes_used
    a.close()
    shard = next(p for p in tmp_path.iterdir() if p.is_dir())
    leftover = df.file_name(df.ObjectId(MODEL, 1, 1, b"t" * 32)) + ".1.2" + df.TMP_SUFFIX
    (shard / leftover).write_bytes(b"partial")
    (shard / df.file_name(df.ObjectId(MODEL, 1, 1, b"z" * 32))).write_bytes(b"HSD1garbage")
    (tmp_path / "README").write_text("not ours")  # foreign files are left alone
    b = adapter(tmp_path)
    try:
        assert b.stats["restart_objects"] == 2
        assert b.stats["restart_tmp_removed"] == 1
        assert b.stats["restart_invalid_removed"] == 1
        assert b.get_usage().total_bytes_used == used
        assert lookup(b, [key(1), key(2)]) == [0, 1]
        assert (tmp_path / "README").exists()
        assert not list(tmp_path.rglob("*" + df.TMP_SUFFIX))
    finally:
        b.close()


def test_corrupted_file_is_a_miss_and_is_deleted(tmp_path: Path) -> None:
    a = adapter(tmp_path)
    a.start_reports()
    try:
        assert store(a, [key(1), key(2)], [b"a" * 4000, b"b" * 4000])
        path = a.path_of(key(1))
        raw = bytearray(path.read_bytes())
        raw[-10] ^= 0xFF  # flip a payload bit: header intact, checksum wrong
        path.write_bytes(raw)
        torn = a.path_of(key(2))
        torn.write_bytes(torn.read_bytes()[:-100])  # a torn write under the final name
        assert lookup(a, [key(1), key(2)]) == [0, 1]  # the index does not read payloads
        hits, _ = load(a, [key(1), key(2)], [4000, 4000])
        assert hits == []  # neither is served
        assert not path.exists() and not torn.exists()
        lost = [k for r in a.take_reports() if isinstance(r, FilesLost) for k in r.keys]
        assert sorted(lost, key=lambda k: k.chunk_hash) == [key(1), key(2)]
        assert a.stats["corrupt_files"] == 2
        assert lookup(a, [key(1), key(2)]) == []
        assert a.get_usage().total_bytes_used == 0
    finally:
        a.close()


def test_capacity_full_is_not_persisted(tmp_path: Path) -> None:
    a = adapter(tmp_path, capacity=2 * 4300)
    a.start_reports()
    try:
        assert store(a, [key(1), key(2)], [b"a" * 4000, b"b" * 4000])
        assert not store(a, [key(3)], [b"c" * 4000])  # the task reports the failure
        # and so does the queue, the first batch's success before it
        assert a.take_reports() == [WriteDone([key(1), key(2)], [], store_task=True),
                                    WriteDone([], [key(3)], store_task=True)]
        assert a.stats["not_persisted_capacity"] == 1
        assert lookup(a, [key(3)]) == []
        a.delete([key(1)])
        assert store(a, [key(3)], [b"c" * 4000])
    finally:
        a.close()


def test_a_tier_nobody_drives_queues_no_reports(tmp_path: Path) -> None:
    """A stock ``lmcache server`` never drains the queue, so it is never filled."""
    a = adapter(tmp_path, capacity=4300)
    try:
        assert store(a, [key(1)], [b"a" * 4000])
        assert not store(a, [key(2)], [b"b" * 4000])
        a.start_reports()
        assert a.take_reports() == []
    finally:
        a.close()


def test_delete_waits_for_unlock(tmp_path: Path) -> None:
    a = adapter(tmp_path)
    try:
        assert store(a, [key(1)], [b"a" * 100])
        assert lookup(a, [key(1)]) == [0]
        a.delete([key(1)])
        assert a.path_of(key(1)).exists()  # locked by the lookup: still loadable
        assert load(a, [key(1)], [100])[0] == [0]
        assert lookup(a, [key(1)]) == []  # but no new lookup finds it
        a.submit_unlock([key(1)])
        a.submit_unlock([key(1)])
        assert not a.path_of(key(1)).exists()
    finally:
        a.close()


def test_header_carries_prefix_structure(tmp_path: Path) -> None:
    """The header holds what the write's decider handed down before submitting it; a write
    nobody described gets the unknown header (kind other, depth -1, no parent)."""
    a = adapter(tmp_path, disk_fsync=False)
    a.expect_headers({key(1): ObjectMeta(df.KIND_SNAPSHOT, 7, b"p" * 32)})
    try:
        assert store(a, [key(1), key(2)], [b"a" * 10, b"b" * 10])
        header = df.read_header(a.path_of(key(1)))
        assert (header.kind, header.depth, header.parent) == (df.KIND_SNAPSHOT, 7, b"p" * 32)
        assert header.oid == df.ObjectId(MODEL, 0x01000100, 1, key(1).chunk_hash)
        other = df.read_header(a.path_of(key(2)))
        assert (other.kind, other.depth, other.parent) == (df.KIND_OTHER, -1, b"")
    finally:
        a.close()


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="disk_gib: must be a positive number, got 0"):
        HiStateDiskAdapter({"disk_path": str(tmp_path), "disk_gib": 0})
    with pytest.raises(ValueError, match="size: unknown key; allowed keys: disk_path, disk_gib"):
        HiStateDiskAdapter({"disk_path": str(tmp_path), "disk_gib": 1, "size": 2})


# ------------------------------------------------------------ hardening: whose files, bad keys
def test_scan_touches_only_its_own_layout(tmp_path: Path) -> None:
    """A restart removes its own temporaries and invalid objects, never a foreign file:
    not one at the top, not one in a shard folder, not one in another folder."""
    a = adapter(tmp_path)
    assert store(a, [key(1)], [b"a" * 100])
    a.close()
    shard = a.path_of(key(1)).parent
    foreign = [
        tmp_path / "draft.tmp", tmp_path / "model.hsf", shard / "draft.tmp",
        shard / "model.hsf", shard / ("model" + df.SUFFIX + ".1.2" + df.TMP_SUFFIX),
        tmp_path / "notes" / "x.tmp", tmp_path / "zz" / "model.hsf",
    ]
    for path in foreign:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"user data")
    own_tmp = shard / (df.file_name(df.ObjectId(MODEL, 1, 1, b"t" * 32)) + ".7.7.tmp")
    own_tmp.write_bytes(b"partial")
    b = adapter(tmp_path)
    try:
        assert [p for p in foreign if p.read_bytes() != b"user data"] == []
        assert not own_tmp.exists()
        assert (b.stats["restart_objects"], b.stats["restart_tmp_removed"]) == (1, 1)
        assert b.stats["restart_invalid_removed"] == 0
    finally:
        b.close()


def test_refuses_a_foreign_folder_unless_adopted(tmp_path: Path) -> None:
    """A non-empty folder without the tier's marker is not used (nothing is touched);
    with adopt the marker is written, the tier works there and the folder's files stay."""
    (tmp_path / "draft.tmp").write_bytes(b"mine")
    (tmp_path / "model.hsf").write_bytes(b"mine too")
    with pytest.raises(ValueError, match=r"not empty \(2 entries: draft.tmp, model.hsf\)"):
        adapter(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft.tmp", "model.hsf"]
    a = adapter(tmp_path, disk_adopt=True)
    try:
        assert (tmp_path / ".histate-disk").is_file()
        assert store(a, [key(1)], [b"x" * 10])
    finally:
        a.close()
    b = adapter(tmp_path)  # the marker makes it the tier's own from now on
    try:
        assert lookup(b, [key(1)]) == [0]
        assert (tmp_path / "draft.tmp").read_bytes() == b"mine"
        assert (tmp_path / "model.hsf").read_bytes() == b"mine too"
    finally:
        b.close()


def test_an_empty_folder_or_a_new_one_is_claimed(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "lost+found").mkdir()  # the root of a dedicated filesystem
    for root in (tmp_path / "empty", tmp_path / "new" / "deeper"):
        adapter(root).close()
        assert (root / ".histate-disk").is_file()


def odd_key(model: str, i: int = 1) -> ObjectKey:
    return ObjectKey(chunk_hash=bytes([i]) * 32, model_name=model, kv_rank=0, object_group_id=0)


@pytest.fixture
def tier_log() -> Iterator[list[str]]:
    """Warnings of the disk tier's write path (lmcache loggers do not propagate)."""
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("lmcache_histate.backends.server.disk.tier")
    log.addHandler(handler)
    try:
        yield lines
    finally:
        log.removeHandler(handler)


def test_odd_and_long_model_names_are_stored_under_bounded_names(tmp_path: Path) -> None:
    """A NUL byte, separators, 300 bytes, or two names that read alike: each object gets
    its own file (name under 200 bytes) and loads back byte-exact."""
    names = ["a/b", "a_b", "a\0b", "../../etc/x", "é" * 150, "m" * 300]
    keys = [odd_key(m) for m in names]
    payloads = [os.urandom(64 + i) for i in range(len(names))]
    a = adapter(tmp_path)
    try:
        assert store(a, keys, payloads)
        files = list(tmp_path.rglob("*" + df.SUFFIX))
        assert len(files) == len(names)
        assert max(len(f.name.encode()) for f in files) < 200
        assert all(f.parent.parent == tmp_path for f in files)
        assert lookup(a, keys) == list(range(len(names)))
        hits, data = load(a, keys, [len(p) for p in payloads])
        assert hits == list(range(len(names))) and data == payloads
    finally:
        a.close()


def test_every_write_task_completes_and_each_cause_is_logged_once(
    tmp_path: Path, tier_log: list[str]
) -> None:
    """A key that cannot be written (a model name over the header's 65,535 bytes) fails
    its object only: the task completes, the good objects are stored, the reservation is
    released, the failure is counted, and a second one is counted but not logged again."""
    a = adapter(tmp_path)
    try:
        huge = [odd_key("m" * 70_000, i) for i in (1, 2)]
        assert not store(a, [huge[0], key(1)], [b"x" * 10, b"y" * 10])
        assert lookup(a, [key(1)]) == [0]
        assert not store(a, [huge[1]], [b"z" * 10])
        assert a.stats["not_persisted_bad_key"] == 2
        status = a.report_status()
        assert status["writes_in_flight"] == 0 and status["files"] == 1
        assert status["bytes_in_flight"] == 0
        assert [line for line in tier_log if "bad_key" in line] == [tier_log[0]]
        assert len(tier_log) == 1
        # A buffer that is not one: the demotion path reports it failed, nothing escapes.
        a.start_reports()
        released = threading.Event()
        a.write_objects([key(2)], [None], released.set)
        assert released.wait(10)
        assert a.take_reports() == [WriteDone([], [key(2)], store_task=False)]
        assert a.stats["not_persisted_error"] == 1
    finally:
        a.close()


def test_a_folder_serves_one_tier_at_a_time(tmp_path: Path) -> None:
    """A second tier on a folder in use is refused (its start scan would delete the first
    one's temporary files); once the first closes, the folder is free again."""
    a = adapter(tmp_path)
    try:
        with pytest.raises(ValueError, match="is in use by another HiState disk tier"):
            adapter(tmp_path)
        assert store(a, [key(1)], [b"still mine"])  # the refusal touched nothing
    finally:
        a.close()
    b = adapter(tmp_path)
    try:
        assert lookup(b, [key(1)]) == [0]
    finally:
        b.close()


def test_a_touch_marks_only_the_keys_on_disk_accessed(tmp_path: Path) -> None:
    # LMCache 0.5.7's submit_touch (the tier defines it on 0.5.6 too, where nothing calls
    # it): the adapter's listeners -- LMCache's L2 eviction -- see an access for the keys
    # the tier holds, and nothing for a key it does not.
    from lmcache.v1.distributed.internal_api import L2AdapterListener

    class Accesses(L2AdapterListener):
        def __init__(self) -> None:
            self.touched: list[list[ObjectKey]] = []

        def on_l2_keys_stored(self, keys: list[ObjectKey], sizes: list[int]) -> None:
            pass

        def on_l2_keys_accessed(self, keys: list[ObjectKey]) -> None:
            self.touched.append(list(keys))

        def on_l2_keys_deleted(self, keys: list[ObjectKey]) -> None:
            pass

    a = adapter(tmp_path)
    try:
        seen = Accesses()
        a.register_listener(seen)
        assert store(a, [key(1)], [b"x" * 100])
        a.submit_touch([key(1), key(2)])
        a.submit_touch([key(3)])
        assert seen.touched == [[key(1)]]
    finally:
        a.close()


def test_memory_tags_are_refused_on_an_lmcache_without_them(tmp_path: Path) -> None:
    # get_memory_tags is abstract from LMCache 0.5.7 (checked statically: make compat,
    # tests/test_compat.py); on the installed 0.5.6 nothing asks, and a call says why.
    from lmcache_histate.backends.upstream import UpstreamVersionError

    a = adapter(tmp_path)
    try:
        with pytest.raises(UpstreamVersionError) as raised:
            a.get_memory_tags()
        assert str(raised.value) == (
            "LMCache memory tags were checked on lmcache 0.5.7rc2, found 0.5.6: LMCache "
            "before 0.5.7 has none and never asks for them")
    finally:
        a.close()
