"""The HiState disk tier: an LMCache L2 adapter plugin storing one file per object.

Load it with ``--l2-adapter '{"type": "plugin", "module_path":
"lmcache_histate.backends.server.disk.tier", "class_name": "HiStateDiskAdapter",
"adapter_params": {"disk_path": ..., "disk_gib": ...}}'`` (the launcher does; the keys
are the server YAML's, ``config``).

Modelled on LMCache's ``fs_l2_adapter.FSL2Adapter`` (event fds, tmp + rename, files
found again after a restart) with what HiState needs on top:

* a self-describing file format (``file_format``: key, kind, prefix depth and parent,
  payload crc32), written tmp → fsync → rename;
* a folder it owns (``folder``: a marker written at first use; a foreign non-empty
  folder is refused unless ``adopt``);
* an in-memory index rebuilt by scanning its own layout at start (its leftover
  temporaries and invalid files removed, nothing else touched), so lookups cost no I/O and
  byte accounting survives restarts (``_notify_keys_stored`` / ``_notify_keys_deleted``
  keep the base class counters);
* a hard capacity that never exceeds what the filesystem holds (``writes``): a
  write that would exceed it, or that the filesystem refuses, leaves the object "not
  persisted" — every task completes, the failure is counted and logged once per cause,
  the HiState runtime is told per key, and ENOSPC lowers the capacity (the runtime's core
  follows);
* a torn or corrupted file found on load is a miss, never served, and is deleted;
* per-key lookup locks: a delete that races a lookup→load waits for the unlock;
* one completion queue (``DiskReport``: writes done or failed, files lost, capacity
  changes), filled by the I/O threads once ``start_reports`` is called and emptied by
  whoever drives the tier (``take_reports``, NOTE 3). The tier asks nothing of its driver:
  what a file's header holds comes down with the write (``expect_headers``, NOTE 2).
* with a ``shared_index`` section, one folder (held with a shared lock) for a deployment's
  servers: the Redis index answers lookups, reserves writes, picks victims (``shared_link``).

NOTE 1: a shared folder is never scanned at start (``file_format.scan`` would delete the
other servers' writes in progress); ``shared_link`` reconciles it instead.

NOTE 2 (headers travel down): the HiState runtime decides which objects are written (its
store policy's routing, a demotion) under its lock, where it knows each object's kind, prefix
depth and parent; it hands them to ``expect_headers`` before the write is submitted
(LMCache's ``submit_store_task`` carries keys and buffers only), and the write takes them.
An I/O thread so never reads the runtime's state, which it could only do without its lock.
Headers of writes that never come (an object LMCache could not read back from L1) are
bounded (``l2_tasks.HEADERS_MAX``, oldest dropped).

NOTE 3 (reports are queued, not called). What an I/O thread learns (a write failed, a file
is corrupt, the capacity fell) matters to the runtime's core, which only its lock guards.
Calling up from the I/O thread would run the runtime on a thread that holds disk buffers
and make the two locks' order matter; instead the I/O thread appends a ``DiskReport`` to
a ``deque`` (its ``append`` / ``popleft`` are atomic) and goes on, as LMCache's own L2
adapters hand completed tasks to their controller (``pop_completed_store_tasks``). The
runtime drains the queue under its lock at each of its steps and on its janitor tick, so a
report waits at most one tick. A tier nobody drives (a stock ``lmcache server``) never
starts reporting and queues nothing.

Threads and locks: LMCache calls the ``submit_*`` / ``query_*`` / ``pop_*`` / ``delete``
methods from its controller threads; reads and writes run on the I/O pool
(``histate-disk-*``). ``self._lock`` guards the index, the lookup locks, the expected
headers and the task results, and is never held across file I/O. Reports are queued on
the thread that saw the event, without it (NOTE 3). The runtime calls ``mark_decisions``
with its own lock held (``writes`` NOTE 5): the runtime's lock may be taken before this
one, never after it (nothing here calls up).

NOTE 4 (the last decision wins): the runtime decides deletes and writes under its lock but
runs them after releasing it, on whichever thread took them, and a delete of a file a
reader holds runs only at the unlock. Between a delete's decision and its run the core may
take the same object back (another request stored the same chunk, which LMCache names by
its tokens, so the bytes are the same): the write would find the file still indexed and
answer "present", and the delete then remove it, leaving the core counting a snapshot on
disk that no file holds, a hit that cannot load. So ``mark_decisions`` also takes the
writes decided, in the runtime lock's order: a write voids every delete of its key decided
before it (counted per key, ``_doomed`` / ``_spared``; a delete already run that waits for
a reader, or that cancelled a write still in flight, is undone), and a delete decided after
the write still runs. Objects are immutable, so keeping the file is the write.

I/O runs on a thread pool (``pwrite``/``pread`` release the GIL): benchmarks/disk_io.py
measured it faster than aiofiles for every object size (benchmarks/README.md).

Without the HiState runtime (a stock ``lmcache server``) the adapter is a plain
capacity-bounded disk tier: LMCache's own L2 eviction can then manage it
(``"eviction": {"eviction_policy": "LRU"}`` in the adapter JSON, as the LRU baseline does).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmcache.lmcache_native import Bitmap
from lmcache.logging import init_logger
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache_histate.backends.upstream.lmcache_symbols import l2_memory_tags

from ..l2_tasks import ExpectedHeaders, TaskBoard
from . import file_format as df
from .backlog import WriteBacklog, WriteBacklogFull
from .config import HiStateDiskAdapterConfig
from .entries import DiskEntry, ObjectMeta, recover_entries
from .folder import FolderError, claim, hold
from .shared_link import SharedIndexLink
from .writes import DiskWriter, TierAccess

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc
    from lmcache.v1.memory_management import MemoryObj

logger = init_logger(__name__)

__all__ = ["CapacityChanged", "DiskReport", "FilesLost", "HiStateDiskAdapter", "WriteDone"]

@dataclass(frozen=True, slots=True)
class WriteDone:
    """A write batch finished: ``ok`` are on disk (written now or present already),
    ``failed`` were not persisted (capacity, I/O error, budget). ``store_task``: submitted
    by LMCache's store controller (which reads the outcome from the task itself), not by
    ``write_objects``."""

    ok: list[ObjectKey]
    failed: list[ObjectKey]
    store_task: bool


@dataclass(frozen=True, slots=True)
class FilesLost:
    """Files found corrupted or missing on load (already forgotten and removed)."""

    keys: list[ObjectKey]


@dataclass(frozen=True, slots=True)
class CapacityChanged:
    """The effective capacity changed (ENOSPC lowered it, freed space raised it)."""

    capacity_bytes: int


DiskReport = WriteDone | FilesLost | CapacityChanged
"""What the tier queues for its driver (NOTE 3)."""


class HiStateDiskAdapter(L2AdapterInterface):
    """One file per object under ``path``; thread-pool I/O; hard capacity."""

    def __init__(
        self,
        config: HiStateDiskAdapterConfig | dict[str, Any],
        l1_memory_desc: object = None,
    ) -> None:
        if isinstance(config, dict):
            config = HiStateDiskAdapterConfig.from_dict(config)
        super().__init__(max_capacity_bytes=config.capacity_bytes)
        self.config = config
        self.root = Path(config.path)
        try:
            claimed = claim(self.root, adopt=config.adopt)
            self._folder_fd: int | None = hold(self.root, shared=config.shared_index is not None)
        except FolderError as exc:
            raise ValueError(f"HiState disk tier path {exc}") from None
        self._lock = threading.Lock()
        self._index: dict[ObjectKey, DiskEntry] = {}
        self._locks: Counter[ObjectKey] = Counter()
        self._delete_on_unlock: set[ObjectKey] = set()
        self._doomed: Counter[ObjectKey] = Counter()  # deletes decided, not run (NOTE 4)
        self._spared: Counter[ObjectKey] = Counter()  # of those, voided by a later write
        self.tasks = TaskBoard()
        self.stats: Counter[str] = Counter()
        self._reports: deque[DiskReport] | None = None  # NOTE 3: None until started
        self._headers = ExpectedHeaders(self.stats)
        self._closed = False
        self.shared: SharedIndexLink | None = None
        self.writer = DiskWriter(config, self.root, self.stats, TierAccess(
            self._lock, self._index, lambda: self._total_bytes_used,
            lambda: self._max_capacity_bytes,
            lambda nbytes: setattr(self, "_max_capacity_bytes", nbytes),
            self._notify_keys_stored, self._notify_keys_deleted,
            lambda nbytes: self._report(CapacityChanged(nbytes)),
        ))
        if config.shared_index is None:
            self._recover_index(claimed)
        self._pool = ThreadPoolExecutor(config.io_workers, thread_name_prefix="histate-disk")
        self.backlog = WriteBacklog()
        if config.shared_index is not None:
            # NOTE 1: no start-up scan; the deployment's index, reconciled.
            self.shared = SharedIndexLink(
                config.shared_index, config.model, self.root, config.capacity_bytes,
                lambda keys: self._forget(keys, unlink=False),
                own_bytes=lambda: int(self._total_bytes_used + self.writer.reserved),
            )
            self.writer.shared = self.shared
            logger.info("HiState disk tier at %s (%s folder), shared through Redis at %s",
                        self.root, claimed, self.shared.index.conn.where)

    # ------------------------------------------------------------------ wiring
    def start_reports(self) -> None:
        """Queue ``DiskReport``s from now on for ``take_reports`` (NOTE 3). A stock
        ``lmcache server`` never starts them."""
        if self._reports is None and not self._closed:
            self._reports = deque()

    def take_reports(self) -> list[DiskReport]:
        """The reports queued so far, oldest first (any thread)."""
        reports = self._reports
        out: list[DiskReport] = []
        while reports:
            out.append(reports.popleft())
        return out

    def _report(self, report: DiskReport) -> None:
        reports = self._reports
        if reports is not None:
            reports.append(report)

    def expect_headers(self, metas: Mapping[ObjectKey, ObjectMeta]) -> None:
        """The headers of writes about to be submitted (NOTE 2)."""
        self._headers.expect(metas)

    def _recover_index(self, claimed: str) -> None:
        """Index the files of an own folder (one server); leftovers removed."""
        t0 = time.monotonic()
        entries, result = recover_entries(self.root)
        self._index.update(entries)  # the writer shares this dict
        self.stats["restart_tmp_removed"] = result.removed_tmp
        self.stats["restart_invalid_removed"] = result.removed_corrupt
        keys = list(self._index)
        sizes = [e.size for e in self._index.values()]
        if keys:
            self._notify_keys_stored(keys, sizes)
        self.stats["restart_objects"] = len(keys)
        self.writer.recheck_capacity()  # never more than the filesystem can hold
        logger.info(
            "HiState disk tier at %s (%s folder): %d objects (%d bytes) recovered in %.2fs, "
            "%d temporary and %d invalid files removed; capacity %d bytes (configured %d)",
            self.root, claimed, len(keys), sum(sizes), time.monotonic() - t0,
            result.removed_tmp, result.removed_corrupt, self.capacity_bytes(),
            self.config.capacity_bytes,
        )

    # ---------------------------------------------------------------- event fds
    def get_store_event_fd(self) -> int:
        return self.tasks.store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self.tasks.lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self.tasks.load_efd.fileno()

    # -------------------------------------------------------------------- store
    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        tid = self.tasks.new_id()
        if not self._submit_write(keys, self._store_task, tid, list(keys), list(objects)):
            self._report(WriteDone([], list(keys), store_task=True))
            self.tasks.store_done(tid, L2StoreResult(False, 0))
        return tid

    def _submit_write(self, keys: Sequence[ObjectKey], task: Callable[..., None],
                      *args: Any) -> bool:
        """Queue a write of ``keys`` on an I/O thread, counted first so that a delete
        before it starts cancels it (``writes`` NOTE 4); False, with every key counted
        not persisted, when the write-behind backlog refuses it (``backlog``)."""
        token = self.backlog.admit()
        if token is None:
            exc = WriteBacklogFull(
                f"the oldest accepted write has waited over {self.backlog.max_lag_s:g} s")
            for key in keys:
                self.writer.not_persisted(key, exc)
            return False
        with self._lock:
            self.writer.enqueue(keys)

        def run() -> None:
            try:
                task(*args)
            finally:
                self.backlog.done(token)

        self._pool.submit(run)
        return True

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        return self.tasks.pop_stores()

    def _store_task(self, tid: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        result = L2StoreResult(False, 0)
        try:
            ok, failed, _stored, written = self.writer.write_batch(
                keys, [o.byte_array for o in objects], self._headers.take(keys))
            result = L2StoreResult(not failed, written)
            self._report(WriteDone(ok, failed, store_task=True))
        except BaseException as exc:  # the task must complete whatever happened
            self.writer.not_persisted_all(keys, exc)
        finally:
            self.tasks.store_done(tid, result)

    def write_objects(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Any], release: Callable[[], None]
    ) -> None:
        """Persist objects outside LMCache's store path (demotion of KV from the CPU tier).

        ``buffers`` must stay valid until ``release()`` runs (on an I/O thread, once the
        batch is written or failed; it must not call into the tier's driver); the headers
        are the ones ``expect_headers`` was given. The outcome is queued as a ``WriteDone``
        (``store_task`` False) before ``release`` runs.
        """
        def run() -> None:
            ok: list[ObjectKey] = []
            failed = list(keys)
            try:
                ok, failed, _stored, _ = self.writer.write_batch(
                    list(keys), list(buffers), self._headers.take(keys))
            except BaseException as exc:
                self.writer.not_persisted_all(keys, exc)
            finally:
                self._report(WriteDone(ok, failed, store_task=False))
                release()

        if not self._submit_write(keys, run):
            self._report(WriteDone([], list(keys), store_task=False))
            release()

    def capacity_bytes(self) -> int:
        """The effective capacity: configured, or less when the filesystem is smaller."""
        return int(self._max_capacity_bytes)


    # ------------------------------------------------------------ lookup / lock
    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> L2TaskId:
        tid = self.tasks.new_id()
        bitmap = Bitmap(len(keys))
        # Shared: the deployment's entries decide, leased (one round trip); None = degraded.
        found = None if self.shared is None else self.shared.lookup(keys)
        with self._lock:
            for i, key in enumerate(keys):
                if found is not None:
                    if found[i]:
                        self._locks[key] += 1
                        bitmap.set(i)
                elif key in self._index and key not in self._delete_on_unlock and (
                        key not in self.writer.leaving):
                    self._locks[key] += 1
                    bitmap.set(i)
        self.tasks.lookup_done(tid, bitmap)
        return tid

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self.tasks.pop_lookup(task_id)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        doomed: list[ObjectKey] = []
        unleased: list[ObjectKey] = []
        with self._lock:
            for key in keys:
                if self._locks[key] <= 1:
                    self._locks.pop(key, None)
                    unleased.append(key)
                    if key in self._delete_on_unlock:
                        self._delete_on_unlock.discard(key)
                        doomed.append(key)
                else:
                    self._locks[key] -= 1
        if self.shared is not None:
            self.shared.release(unleased)
        if doomed:
            self._delete_now(doomed)

    # --------------------------------------------------------------------- load
    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        tid = self.tasks.new_id()
        self._pool.submit(self._load_task, tid, list(keys), [o.byte_array for o in objects])
        return tid

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self.tasks.pop_load(task_id)

    def _load_task(self, tid: L2TaskId, keys: list[ObjectKey], buffers: list[Any]) -> None:
        bitmap = Bitmap(len(keys))
        loaded: list[ObjectKey] = []
        corrupt: list[ObjectKey] = []
        for i, (key, buf) in enumerate(zip(keys, buffers, strict=True)):
            try:
                oid = df.ObjectId.of(key)
                status, why = df.read_object(df.object_path(self.root, oid), oid, memoryview(buf))
            except Exception as exc:  # a bad buffer, an I/O error: a miss either way
                status, why = df.ReadStatus.MISSING, str(exc)
            if status is df.ReadStatus.OK:
                bitmap.set(i)
                loaded.append(key)
                self.stats[f"loads_group_{key.object_group_id}"] += 1
            elif status is df.ReadStatus.CORRUPT:
                logger.warning("HiState disk tier: %s is corrupted (%s); deleting it", key, why)
                self.stats["corrupt_files"] += 1
                corrupt.append(key)
            else:
                self.stats["load_misses"] += 1
                logger.warning("HiState disk tier: %s could not be read (%s)", key, why)
                corrupt.append(key)  # gone from disk: forget it too
        if corrupt:
            self._forget(corrupt, unlink=True)
            if self.shared is not None:
                self.shared.lost(corrupt)
            self._report(FilesLost(corrupt))
        if loaded:
            self.stats["objects_loaded"] += len(loaded)
            self._notify_keys_accessed(loaded)
        self.tasks.load_done(tid, bitmap)

    # ------------------------------------------------------------------- delete
    def mark_decisions(
        self, deletes: Sequence[ObjectKey], writes: Sequence[ObjectKey] = ()
    ) -> None:
        """The driver decided to delete ``deletes`` (``delete`` follows) and, after every
        earlier decision, to keep ``writes`` on disk (their writes follow). From now on a
        file to be deleted is no hit and no longer counts against writes (``writes``
        NOTE 5), and a decided write voids the deletes of its key decided before it
        (NOTE 4). Called under the driver's lock, which orders the decisions; takes only
        this tier's lock. A key is in at most one of the two lists."""
        with self._lock:
            for key in writes:
                if pending := self._doomed.get(key):
                    self._spared[key] = pending  # every delete decided so far is void
                if key in self._delete_on_unlock:  # already run, waiting for a reader
                    self._delete_on_unlock.discard(key)
                    self.stats["deletes_superseded"] += 1
                if self.writer.keep(key):  # already run, the file still being written
                    self.stats["deletes_superseded"] += 1
                self.writer.left(key)  # its file, if indexed, stays and counts again
            for key in deletes:
                self._doomed[key] += 1
                entry = self._index.get(key)
                if entry is not None:
                    self.writer.mark_leaving(key, entry.size)

    def _superseded(self, key: ObjectKey) -> bool:
        """Under the lock: take one decided delete of ``key``; True when a write decided
        after it voids it (NOTE 4). A delete nobody decided (LMCache's own) takes none.
        Invariant: ``_spared[k] <= _doomed[k]``, neither holds a zero."""
        pending = self._doomed.get(key, 0)
        if not pending:
            return False
        spared = self._spared.pop(key, 0)
        if pending == 1:
            del self._doomed[key]
        else:
            self._doomed[key] = pending - 1
            if spared > 1:
                self._spared[key] = spared - 1
        if spared:
            self.stats["deletes_superseded"] += 1
        return spared > 0

    def delete(self, keys: list[ObjectKey]) -> None:
        with self._lock:
            keys = [key for key in keys if not self._superseded(key)]
        if self.shared is not None:  # shared_link NOTE 1: the deployment ranking deletes
            self._forget(keys, unlink=False)
            self.stats["objects_forgotten_locally"] += len(keys)
            return
        now: list[ObjectKey] = []
        with self._lock:
            for key in keys:
                # A write in flight or queued is cancelled (writes NOTE 4); a file already
                # indexed is deleted as well.
                self.writer.cancel(key)
                if key not in self._index:
                    continue
                if self._locks.get(key):
                    self._delete_on_unlock.add(key)
                else:
                    now.append(key)
        if now:
            self._delete_now(now)

    def _delete_now(self, keys: list[ObjectKey]) -> None:
        self._forget(keys, unlink=True)
        self.stats["objects_deleted"] += len(keys)

    def _forget(self, keys: list[ObjectKey], *, unlink: bool) -> None:
        gone: list[tuple[ObjectKey, int]] = []
        with self._lock:
            for key in keys:
                entry = self._index.pop(key, None)
                self._delete_on_unlock.discard(key)
                self.writer.left(key)
                if entry is not None:
                    gone.append((key, entry.size))
        # Accounted before the unlinks: the bytes stopped counting as leaving just now
        # (writes NOTE 5), and a write checked meanwhile must not see them counted again.
        if gone:
            self._notify_keys_deleted([k for k, _ in gone], [s for _, s in gone])
        if unlink:
            for key in keys:
                with contextlib.suppress(FileNotFoundError):
                    try:
                        df.object_path(self.root, df.ObjectId.of(key)).unlink()
                    except OSError as exc:
                        if not isinstance(exc, FileNotFoundError):
                            logger.warning("HiState disk tier: cannot delete %s: %s", key, exc)

    # ------------------------------------------- LMCache 0.5.7's adapter interface
    def get_memory_tags(self) -> Any:
        """The medium's tags: storage on this host, ``REMOTE`` when a deployment's servers
        share the folder (``shared_index``). Abstract from LMCache 0.5.7, which filters
        prefetch targets by them; 0.5.6 never calls it (``upstream.lmcache_symbols``)."""
        return l2_memory_tags(shared=self.config.shared_index is not None)

    def submit_touch(self, keys: list[ObjectKey]) -> None:
        """Mark the keys this tier holds as accessed, without I/O: LMCache 0.5.7 calls it on
        a hit served from L1, so its L2 eviction (the LRU baseline's) sees the use. Keys not
        on disk are not this tier's to touch."""
        with self._lock:
            held = [k for k in keys if k in self._index]
        if held:
            self._notify_keys_accessed(held)

    # -------------------------------------------------------------- inspection
    def contains(self, key: ObjectKey) -> bool:
        with self._lock:
            return key in self._index

    def entries(self) -> dict[ObjectKey, DiskEntry]:
        with self._lock:
            return dict(self._index)

    def path_of(self, key: ObjectKey) -> Path:
        return df.object_path(self.root, df.ObjectId.of(key))

    def report_status(self) -> dict:
        usage = self.get_usage()
        with self._lock:
            files = len(self._index)
            locked = len(self._locks)
            writing = len(self.writer.writing)
            queued = sum(self.writer.queued.values())
            leaving = self.writer.leaving_bytes
        return {
            "is_healthy": not self._closed,
            "type": "HiStateDiskAdapter",
            "path": str(self.root),
            "files": files,
            "bytes_used": usage.total_bytes_used,
            "bytes_leaving": leaving,
            "capacity_bytes": usage.total_capacity_bytes,
            "locked_keys": locked,
            "writes_in_flight": writing,
            "writes_queued": queued,
            "write_lag_s": round(self.backlog.lag_s(), 3),
            "write_lag_bound_s": self.backlog.max_lag_s,
            "stats": dict(self.stats),
            **({} if self.shared is None else {"shared_index": self.shared.status()}),
        }

    # -------------------------------------------------------------------- close
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=False)
        if self.shared is not None:
            self.shared.close()
        self.tasks.close()
        fd, self._folder_fd = self._folder_fd, None
        if fd is not None:
            os.close(fd)  # releases the folder for the next server
        logger.info("HiState disk tier at %s closed", self.root)
