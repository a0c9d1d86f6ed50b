"""The HiState disk tier: an LMCache L2 adapter plugin storing one file per object, with its
write path (admission, capacity, the writes in flight) in the same class.

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
* a hard capacity that never exceeds what the filesystem holds: a write that would exceed
  it, or that the filesystem refuses, leaves the object "not persisted" — every task
  completes, the failure is counted and logged once per cause, the HiState runtime is
  told per key, and ENOSPC lowers the capacity (NOTE 5; the runtime's core follows);
* a bounded write-behind lag (``WriteBacklog``, NOTE 10);
* a torn or corrupted file found on load is a miss, never served, and is deleted;
* per-key lookup locks: a delete that races a lookup→load waits for the unlock;
* one completion queue (``DiskReport``: writes done or failed, files lost, capacity
  changes), filled by the I/O threads once ``start_reports`` is called and emptied by
  whoever drives the tier (``take_reports``, NOTE 3). The tier asks nothing of its driver:
  what a file's header holds comes down with the write (``expect_headers``, NOTE 2).
* with a ``shared_index`` section, one folder (held with a shared lock) for a deployment's
  servers: the Redis index answers lookups, reserves writes, picks victims (``shared_link``).

The write path: ``_submit_write`` admits a batch (``WriteBacklog``) and counts its keys
queued (NOTE 8); ``write_batch`` runs it on an I/O thread and returns a ``WriteBatch``;
``_write_one`` reserves an object's bytes against the capacity net of the files already
leaving (NOTE 9), writes its file (``file_format.write_object``) and indexes it. Its state
(``_writing``, ``_queued``, ``_cancelled_queued``, ``_reserved``, ``_leaving``) sits next
to the index it is checked against, under the same lock.

Invariants:

* every object handed to ``write_batch`` ends up stored or failed, whatever happens
  (a key that cannot be encoded, an I/O error, a bug): its reservation is released (in
  a shared folder the deployment's too: committed if stored, given back by
  ``unreserve`` otherwise), the batch reports it, the store task completes. A failure
  is counted per cause (``stats["not_persisted_<cause>"]``, ``failure_cause``) and
  logged once per cause, so a full disk does not flood the log with one warning per
  object;
* the effective capacity (``_max_capacity_bytes``, what ``get_usage`` reports and what the
  HiState core learns from a ``CapacityChanged`` report) never exceeds what the
  filesystem can hold: ENOSPC lowers it to the bytes held + the free space (NOTE 5), and
  while it is below the configured capacity it is re-measured at most every ``RECHECK_S``
  seconds, so it grows back when space is freed;
* ``_spared[k] <= _doomed[k]``, neither holds a zero (NOTE 4); ``WriteBacklog.pending``
  counts the write tasks admitted and not done.

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

NOTE 5 (ENOSPC lowers the capacity): after ENOSPC the HiState core must learn the real
size, or it keeps placing snapshots on a disk it believes has room and never evicts (the
probe saw 48 MB used of a "1 GiB" tier on a 64 MiB filesystem). Lowering the capacity makes
the core evict by H until what it holds fits, which frees real space for the next writes.

NOTE 6 (bytes before visibility): a written object's bytes are accounted
(``_notify_keys_stored``) before its key enters the index, so a delete (which only finds
indexed keys) can never subtract them first.

NOTE 7 (shared folder: the deployment's reservation decides): an object the deployment
reserved for this server is in no server's index, so it is written even where this
server's own view disagrees. Its local entry, if any, is stale (another server's claim
deleted the file, or the entry was forgotten as corrupt) and is replaced; and the local
capacity check is skipped, because this server's view still counts files other servers
evicted (it is told only of its own claims, shared_link NOTE 1) and the deployment's
budget already bounds the folder. Without this, such an object would be reported present
or not persisted while its reservation stayed ``writing`` until its deadline, holding
budget.

NOTE 8 (a delete before its write starts): LMCache and the runtime may delete an object
whose write is submitted but still waits for an I/O thread. The index does not have it
yet and ``_writing`` does not either, so without the queue count the delete would be
lost and the file written afterwards: an object on disk that the core no longer tracks,
holding capacity and served as a hit outside its accounting (a race test saw 43 of 45
files left be such orphans). ``_submit_write`` counts a write at submission, under the
lock; ``_cancel`` marks every queued write of the key; ``_write_one`` takes its write off
the queue in the same lock hold that enters it into ``_writing``, and skips it if marked.
A write submitted after the delete is not marked.

NOTE 9 (capacity net of deletes already decided): the runtime decides under its lock
which files go to make room for a write, but the delete runs after it releases the lock,
and a file a reader has locked is deleted only at its unlock (``delete``). Meanwhile
LMCache's store controller may already have submitted the write the eviction made room
for; counting the doomed file would refuse it (``not_persisted_capacity``), losing the
newest snapshot exactly when the policy had made room for it. ``mark_decisions`` (called
under the runtime's lock as the actions are taken) marks such files leaving, and the
capacity check counts ``held - leaving``. The disk may so hold more than the capacity for
as long as a reader keeps a doomed file; the capacity is the policy's budget, not the
filesystem's size, and a real lack of space still fails the write with ENOSPC (NOTE 5).

NOTE 10 (the write-behind lag is bounded; refuse, not wait). An acknowledged STORE is in
LMCache's L1 (memory); the tier writes it afterwards, on its I/O threads. When STOREs
arrive faster than the disk writes, the queue of writes grows, and so does the time an
acknowledged object waits before it is on disk: under a kill -9 those objects are lost
(the probe measured objects acknowledged more than 2 s before a kill missing after
restart, 270 of 582, ``lru``, with nothing reporting the lag). ``WriteBacklog`` keeps the
submit time of every unfinished write task: ``lag_s`` (exported as
``histate_disk_write_lag_seconds``) is the age of the oldest, and ``admit`` refuses a new
write while it is over ``max_lag_s``: the write then completes as not persisted (counted
``not_persisted_backlog``, logged once) and the object stays in L1 only. The lag is so at
most ``max_lag_s`` plus the time of the writes already queued when it was crossed. Why
refuse rather than wait: the submit calls come from LMCache's store controller thread,
which also hands completions back; making it wait for the disk stalls every L1-to-L2
hand-off. A refused write is what a full disk already produces (a failed store task), a
path LMCache and the HiState core handle. Under the bound, nothing changes.

Threads and locks: LMCache calls the ``submit_*`` / ``query_*`` / ``pop_*`` / ``delete``
methods from its controller threads; reads and writes run on the I/O pool
(``histate-disk-*``; ``pwrite``/``pread`` release the GIL: benchmarks/disk_io.py measured
it faster than aiofiles for every object size, benchmarks/README.md). ``self._lock``
guards the index, the lookup locks, the decided deletes, the write path's state and the
capacity, and is never held across file I/O. Reports are queued on the thread that saw
the event, without it (NOTE 3). The runtime calls ``mark_decisions`` with its own lock
held (NOTE 9): the runtime's lock may be taken before this one, never after it (nothing
here calls up).

Without the HiState runtime (a stock ``lmcache server``) the adapter is a plain
capacity-bounded disk tier: LMCache's own L2 eviction can then manage it
(``"eviction": {"eviction_policy": "LRU"}`` in the adapter JSON, as the LRU baseline does).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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
from .config import HiStateDiskAdapterConfig
from .entries import UNKNOWN_META, DiskEntry, ObjectMeta, recover_entries
from .folder import FolderError, capacity_limit, claim, hold
from .shared_link import SharedIndexLink, key_id

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc
    from lmcache.v1.memory_management import MemoryObj

logger = init_logger(__name__)

__all__ = ["MAX_WRITE_LAG_S", "RECHECK_S", "CapacityChanged", "DiskReport", "FilesLost",
           "HiStateDiskAdapter", "WriteBacklog", "WriteBacklogFull", "WriteBatch", "WriteDone",
           "failure_cause"]

RECHECK_S = 5.0
"""While the capacity is below the configured one, free space is re-measured this often."""
MAX_WRITE_LAG_S = 10.0
"""Seconds: no new disk write is accepted while an accepted one has waited longer."""
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


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


@dataclass(slots=True)
class WriteBatch:
    """The outcome of one ``write_batch``: every key given is in ``ok`` or ``failed``.

    ``ok``: on disk, written now or present already (another write of the same immutable
    object, a deployment's server that stored it, a write a delete cancelled); ``stored``:
    the part of ``ok`` whose files this batch wrote, ``payload_bytes`` their payloads;
    ``failed``: not persisted (capacity, I/O error, deployment budget), counted per cause.
    """

    ok: list[ObjectKey] = field(default_factory=list)
    failed: list[ObjectKey] = field(default_factory=list)
    stored: list[ObjectKey] = field(default_factory=list)
    payload_bytes: int = 0


class WriteBacklogFull(RuntimeError):
    """A write refused because the oldest accepted write is older than the bound."""


class WriteBacklog:
    """Submit times of the unfinished writes, in submit order (NOTE 10); O(1) per call
    (a dict in submit order: the oldest is its first entry)."""

    def __init__(self, max_lag_s: float = MAX_WRITE_LAG_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_lag_s = max_lag_s
        self._clock = clock
        self._lock = threading.Lock()
        self._since: dict[int, float] = {}
        self._ids = itertools.count()
        self.refused = 0

    def admit(self) -> int | None:
        """A token for a new write, or None while the lag is over ``max_lag_s``."""
        with self._lock:
            now = self._clock()
            if self._since and now - next(iter(self._since.values())) > self.max_lag_s:
                self.refused += 1
                return None
            token = next(self._ids)
            self._since[token] = now
            return token

    def done(self, token: int) -> None:
        with self._lock:
            self._since.pop(token, None)

    def lag_s(self) -> float:
        """Age of the oldest unfinished write (0 with none)."""
        with self._lock:
            if not self._since:
                return 0.0
            return max(0.0, self._clock() - next(iter(self._since.values())))

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._since)


def failure_cause(exc: BaseException) -> str:
    """Short cause name of a failed write (the suffix of its ``not_persisted_*`` counter)."""
    if isinstance(exc, WriteBacklogFull):
        return "backlog"  # refused: the write-behind lag is over its bound
    if isinstance(exc, OSError):
        return "no_space" if exc.errno in _NO_SPACE else "io_error"
    if isinstance(exc, ValueError | struct.error | OverflowError):
        return "bad_key"  # e.g. a model name over 65,535 bytes, a rank over 32 bits
    return "error"


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
        # The write path (under ``_lock``): writes in flight (key -> cancelled), writes
        # submitted and not started and how many of those a delete cancelled (NOTE 8),
        # the bytes in flight, and indexed files whose delete is decided (NOTE 9).
        self._writing: dict[ObjectKey, bool] = {}
        self._queued: Counter[ObjectKey] = Counter()
        self._cancelled_queued: Counter[ObjectKey] = Counter()
        self._reserved = 0
        self._leaving: dict[ObjectKey, int] = {}
        self._leaving_bytes = 0
        self._logged_causes: set[str] = set()
        self._capacity_checked = 0.0
        self.tasks = TaskBoard()
        self.stats: Counter[str] = Counter()
        self._reports: deque[DiskReport] | None = None  # NOTE 3: None until started
        self._headers = ExpectedHeaders(self.stats)
        self._closed = False
        self.shared: SharedIndexLink | None = None
        if config.shared_index is None:
            self._recover_index(claimed)
        self._pool = ThreadPoolExecutor(config.io_workers, thread_name_prefix="histate-disk")
        self.backlog = WriteBacklog()
        if config.shared_index is not None:
            # NOTE 1: no start-up scan; the deployment's index, reconciled.
            self.shared = SharedIndexLink(
                config.shared_index, config.model, self.root, config.capacity_bytes,
                lambda keys: self._forget(keys, unlink=False),
                own_bytes=lambda: int(self._total_bytes_used + self._reserved),
            )
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
        self._index.update(entries)
        self.stats["restart_tmp_removed"] = result.removed_tmp
        self.stats["restart_invalid_removed"] = result.removed_corrupt
        keys = list(self._index)
        sizes = [e.size for e in self._index.values()]
        if keys:
            self._notify_keys_stored(keys, sizes)
        self.stats["restart_objects"] = len(keys)
        self.recheck_capacity()  # never more than the filesystem can hold
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
        before it starts cancels it (NOTE 8); False, with every key counted not
        persisted, when the write-behind backlog refuses it (NOTE 10)."""
        token = self.backlog.admit()
        if token is None:
            exc = WriteBacklogFull(
                f"the oldest accepted write has waited over {self.backlog.max_lag_s:g} s")
            for key in keys:
                self._not_persisted(key, exc)
            return False
        with self._lock:
            self._queued.update(keys)

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
            batch = self.write_batch(keys, [o.byte_array for o in objects],
                                     self._headers.take(keys))
            result = L2StoreResult(not batch.failed, batch.payload_bytes)
            self._report(WriteDone(batch.ok, batch.failed, store_task=True))
        except BaseException as exc:  # the task must complete whatever happened
            self._not_persisted_all(keys, exc)
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
            batch = WriteBatch(failed=list(keys))
            try:
                batch = self.write_batch(list(keys), list(buffers), self._headers.take(keys))
            except BaseException as exc:
                self._not_persisted_all(keys, exc)
            finally:
                self._report(WriteDone(batch.ok, batch.failed, store_task=False))
                release()

        if not self._submit_write(keys, run):
            self._report(WriteDone([], list(keys), store_task=False))
            release()

    def capacity_bytes(self) -> int:
        """The effective capacity: configured, or less when the filesystem is smaller."""
        return int(self._max_capacity_bytes)

    # -------------------------------------------------------------- write path
    def write_batch(
        self, keys: list[ObjectKey], buffers: list[Any], metas: Mapping[ObjectKey, ObjectMeta]
    ) -> WriteBatch:
        """Write ``keys`` (on an I/O thread) with the headers ``metas`` gives
        (``UNKNOWN_META`` for a key it lacks). Never raises: a key that fails is in
        ``failed``, counted and logged once per cause."""
        out = WriteBatch()
        dirs: set[Path] = set()
        self._maybe_recheck_capacity()
        meta = [metas.get(key, UNKNOWN_META) for key in keys]
        reserved, skip = self._shared_reserve(keys, buffers, meta)
        for i, key in enumerate(keys):
            if key in skip:  # shared: another server stored it, or over the budget
                with self._lock:
                    self._leave_queue(key)
                (out.ok if skip[key] == "present" else out.failed).append(key)
                continue
            try:
                outcome, nbytes, path = self._write_one(key, buffers[i], meta[i],
                                                        key in reserved)
            except BaseException as exc:  # its local reservation released; unreserved below
                self._not_persisted(key, exc)
                out.failed.append(key)
                continue
            if outcome == "failed":
                out.failed.append(key)
                continue
            out.ok.append(key)
            if outcome == "stored":
                out.stored.append(key)
                out.payload_bytes += nbytes
                dirs.add(path.parent)
        if self.config.fsync:
            for d in dirs:
                with contextlib.suppress(OSError):
                    df.fsync_dir(d)
        self.stats["objects_written"] += len(out.stored)
        if self.shared is not None and out.stored:
            written_with = zip(keys, zip(buffers, meta, strict=True), strict=True)
            self._shared_commit(out.stored, dict(written_with))
        if unwritten := reserved.difference(out.stored):
            assert self.shared is not None  # only a shared folder reserves
            self.shared.unreserve(list(unwritten))
        return out

    def _leave_queue(self, key: ObjectKey) -> bool:
        """Under the lock, as a write of ``key`` starts (or is given up): it leaves the
        queue; True when a delete cancelled it while it waited (NOTE 8)."""
        if self._queued.get(key, 0) <= 0:
            return False  # not submitted through _submit_write (or already left)
        self._queued[key] -= 1
        if not self._queued[key]:
            del self._queued[key]
        if self._cancelled_queued.get(key, 0) <= 0:
            return False
        self._cancelled_queued[key] -= 1
        if not self._cancelled_queued[key]:
            del self._cancelled_queued[key]
        return True

    def _left(self, key: ObjectKey) -> None:
        """Under the lock: ``key``'s file no longer leaves — its entry left the index, or a
        later decision keeps it (NOTE 4) — and stops counting as leaving (NOTE 9)."""
        size = self._leaving.pop(key, None)
        if size is not None:
            self._leaving_bytes -= size

    def _committed(self) -> int:
        """Under the lock: the bytes writes are measured against — held, less what is
        leaving (NOTE 9), plus what writes in flight reserved."""
        return self._total_bytes_used - self._leaving_bytes + self._reserved

    def _cancel(self, key: ObjectKey) -> None:
        """Under the lock: a write of ``key`` in flight is cancelled (its file is removed
        once written), and so is every one still queued (NOTE 8)."""
        waiting = self._queued.get(key, 0) - self._cancelled_queued.get(key, 0)
        if waiting > 0:
            self._cancelled_queued[key] += waiting
        if key in self._writing:
            self._writing[key] = True

    def _shared_reserve(
        self, keys: list[ObjectKey], buffers: list[Any], metas: list[ObjectMeta]
    ) -> tuple[set[ObjectKey], dict[ObjectKey, str]]:
        """Shared folder: reserve the batch under the deployment budget (evicting by the
        deployment's ranking); returns the keys reserved for this server, and the keys
        not to write: ``"present"`` (another server stored it) or ``"full"`` (not
        persisted). Not shared, or degraded: nothing reserved, the local view decides."""
        if self.shared is None:
            return set(), {}
        sized = []
        for key, buf, meta in zip(keys, buffers, metas, strict=True):
            with contextlib.suppress(Exception):  # a bad key fails in _write_one
                oid = df.ObjectId.of(key)
                payload = memoryview(buf).nbytes
                sized.append((key, df.header_size(oid, meta.parent) + payload))
        got = self.shared.reserve(sized)
        if got is None:
            return set(), {}
        reserved, present, full = got
        mine: set[ObjectKey] = set()
        out: dict[ObjectKey, str] = {}
        for key, _size in sized:
            i = key_id(key)
            if i in reserved:
                mine.add(key)
            elif i in present:
                out[key] = "present"
            elif i in full:
                out[key] = "full"
                self.stats["not_persisted_deployment_budget"] += 1
        return mine, out

    def _shared_commit(
        self, stored: list[ObjectKey], written: dict[ObjectKey, tuple[Any, ObjectMeta]]
    ) -> None:
        """Shared folder: the renamed files are committed to the deployment's index, each
        with the score its write carried."""
        assert self.shared is not None
        with self._lock:
            entries = [(k, self._index.get(k)) for k in stored]
        self.shared.commit_written([
            (k, e.size, written[k][0], e.kind, e.depth, e.parent, written[k][1].score)
            for k, e in entries if e is not None
        ])

    def _write_one(
        self, key: ObjectKey, buf: Any, meta: ObjectMeta, deployment_reserved: bool = False
    ) -> tuple[str, int, Path]:
        """Write one object: ``("stored" | "present" | "failed", payload bytes, path)``.
        ``deployment_reserved``: a shared folder's deployment reserved it (NOTE 7).

        Raises whatever the write raised, after releasing the local reservation it took
        (the caller gives the deployment's back).
        """
        try:
            view = memoryview(buf).cast("B")
            kind, depth, parent, _score = meta
            oid = df.ObjectId.of(key)
            size = df.header_size(oid, parent) + len(view)
            path = df.object_path(self.root, oid)
            share = None if self.shared is None else self.shared.degraded_share()
        except BaseException:
            with self._lock:
                self._leave_queue(key)
            raise
        stale = None
        with self._lock:
            # Leaving the queue and entering ``_writing`` under one lock hold: a delete
            # finds the write in one of the two (NOTE 8).
            if self._leave_queue(key):
                self.stats["writes_cancelled_queued"] += 1
                return "present", 0, path
            if key in self._writing or (key in self._index and not deployment_reserved):
                # Already persisted (objects are immutable), or a concurrent writer owns
                # it and reports its outcome.
                return "present", 0, path
            if deployment_reserved:  # NOTE 7
                stale = self._index.pop(key, None)
                self._left(key)
            elif self._committed() + size > self._max_capacity_bytes:
                self.stats["not_persisted_capacity"] += 1
                return "failed", 0, path
            if share is not None and self._committed() + size > share:
                self.stats["not_persisted_degraded_share"] += 1  # shared_link NOTE 4
                return "failed", 0, path
            self._reserved += size
            self._writing[key] = False
        if stale is not None:
            self._notify_keys_deleted([key], [stale.size])
            self.stats["stale_entries_replaced"] += 1
        try:
            df.write_object(
                path, oid, view, kind=kind, depth=depth, parent=parent,
                fsync=self.config.fsync, direct=self.config.direct_io,
            )
        except BaseException:
            with self._lock:
                self._reserved -= size
                self._writing.pop(key, None)
            raise
        self._notify_keys_stored([key], [size])  # NOTE 6: before the index has it
        with self._lock:
            self._reserved -= size
            cancelled = self._writing.pop(key, False)
            if not cancelled:
                self._index[key] = DiskEntry(size, len(view), kind, depth, parent, time.time())
        if cancelled:
            # Deleted while being written: it must not outlive its delete.
            with contextlib.suppress(OSError):
                path.unlink()
            self._notify_keys_deleted([key], [size])
            self.stats["writes_cancelled"] += 1
            return "present", 0, path
        return "stored", len(view), path

    def _not_persisted_all(self, keys: Sequence[ObjectKey], exc: BaseException) -> None:
        """A whole batch failed before its objects were tried (e.g. a bad buffer)."""
        with self._lock:
            for key in keys:
                self._leave_queue(key)
        for key in keys:
            self._not_persisted(key, exc)

    def _not_persisted(self, key: ObjectKey, exc: BaseException) -> None:
        cause = failure_cause(exc)
        with self._lock:  # I/O threads fail together when a disk fills: log once
            self.stats[f"not_persisted_{cause}"] += 1
            first = cause not in self._logged_causes
            self._logged_causes.add(cause)
        if first:
            logger.warning(
                "HiState disk tier: object not persisted (%s: %s: %s); further failures "
                "of this cause are only counted (stats not_persisted_%s)",
                cause, type(exc).__name__, exc, cause,
            )
        if cause == "no_space":
            self.recheck_capacity()

    # ---------------------------------------------------------------- capacity
    def _maybe_recheck_capacity(self) -> None:
        if self._max_capacity_bytes < self.config.capacity_bytes and (
            time.monotonic() - self._capacity_checked >= RECHECK_S
        ):
            self.recheck_capacity()

    def recheck_capacity(self) -> None:
        """Set the capacity to min(configured, held + in flight + free); report a change
        (NOTE 5). Writes in flight count as held: their temporary files take the space."""
        try:
            with self._lock:
                held = self._total_bytes_used + self._reserved
            limit = min(self.config.capacity_bytes, capacity_limit(self.root, held))
        except OSError as exc:
            logger.warning("HiState disk tier: cannot measure free space: %s", exc)
            return
        self._capacity_checked = time.monotonic()
        with self._lock:
            changed = limit != self._max_capacity_bytes
            self._max_capacity_bytes = limit
        if not changed:
            return
        self.stats["capacity_changes"] += 1
        logger.warning(
            "HiState disk tier: capacity now %d bytes (configured %d; %d held + free space)",
            limit, self.config.capacity_bytes, held,
        )
        self._report(CapacityChanged(limit))

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
                        key not in self._leaving):
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
        file to be deleted is no hit and no longer counts against writes (NOTE 9), and a
        decided write voids the deletes of its key decided before it (NOTE 4). Called
        under the driver's lock, which orders the decisions; takes only this tier's lock.
        A key is in at most one of the two lists."""
        with self._lock:
            for key in writes:
                if pending := self._doomed.get(key):
                    self._spared[key] = pending  # every delete decided so far is void
                if key in self._delete_on_unlock:  # already run, waiting for a reader
                    self._delete_on_unlock.discard(key)
                    self.stats["deletes_superseded"] += 1
                if self._writing.get(key):  # already run, the file still being written
                    self._writing[key] = False  # its write completes after all
                    self.stats["deletes_superseded"] += 1
                self._left(key)  # its file, if indexed, stays and counts again
            for key in deletes:
                self._doomed[key] += 1
                entry = self._index.get(key)
                if entry is not None and key not in self._leaving:  # NOTE 9
                    self._leaving[key] = entry.size
                    self._leaving_bytes += entry.size

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
                # A write in flight or queued is cancelled (NOTE 8); a file already
                # indexed is deleted as well.
                self._cancel(key)
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
                self._left(key)
                if entry is not None:
                    gone.append((key, entry.size))
        # Accounted before the unlinks: the bytes stopped counting as leaving just now
        # (NOTE 9), and a write checked meanwhile must not see them counted again.
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
            writing = len(self._writing)
            queued = sum(self._queued.values())
            leaving = self._leaving_bytes
            in_flight = self._reserved
        return {
            "is_healthy": not self._closed,
            "type": "HiStateDiskAdapter",
            "path": str(self.root),
            "files": files,
            "bytes_used": usage.total_bytes_used,
            "bytes_leaving": leaving,
            "bytes_in_flight": in_flight,
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
