"""The disk tier's write path: every write task completes, and the capacity follows the disk.

``DiskWriter`` is a part owned by ``tier.HiStateDiskAdapter`` and called explicitly by it
(``enqueue``, ``write_batch``, ``cancel``, ``recheck_capacity``). It owns the writes queued
and in flight and the bytes they reserve; it shares with its tier, through ``TierAccess``,
the tier's lock and index (a written object's entry is added under the lock) and its byte
accounting and capacity (held by LMCache's adapter base class, which ``get_usage`` reads).
It holds no reference to the tier and calls nothing above it: each write gets its header
fields (``entries.ObjectMeta``) from its caller, and the outcome is returned for the tier
to report.

Threads and locks: ``write_batch`` runs on the tier's I/O threads; ``cancel`` on any thread,
under the tier's lock; the tier's lock is never held across file I/O, and nothing outside
the disk tier is called from here (``TierAccess.capacity_changed`` is the tier's own
method, which reports with no lock held).

Invariants:

* every object handed to ``_write_batch`` ends up stored or failed, whatever happens
  (a key that cannot be encoded, an I/O error, a bug): its reservation is released (in
  a shared folder the deployment's too: committed if stored, given back by
  ``unreserve`` otherwise), the batch reports it, the store task completes. A failure
  is counted per cause (``stats["not_persisted_<cause>"]``) and logged once per cause,
  so a full disk does not flood the log with one warning per object;
* the effective capacity (``_max_capacity_bytes``, what ``get_usage`` reports and what the
  HiState core learns from the tier's ``CapacityChanged`` report) never exceeds what the filesystem
  can hold: ENOSPC lowers it to the bytes held + the free space (NOTE 1), and while it
  is below the configured capacity it is re-measured at most every ``RECHECK_S`` seconds,
  so it grows back when space is freed.

NOTE 1: after ENOSPC the HiState core must learn the real size, or it keeps placing
snapshots on a disk it believes has room and never evicts (the probe saw 48 MB used of a
"1 GiB" tier on a 64 MiB filesystem). Lowering the capacity makes the core evict by H
until what it holds fits, which frees real space for the next writes.

NOTE 3 (shared folder: the deployment's reservation decides): an object the deployment
reserved for this server is in no server's index, so it is written even where this
server's own view disagrees. Its local entry, if any, is stale (another server's claim
deleted the file, or the entry was forgotten as corrupt) and is replaced; and the local
capacity check is skipped, because this server's view still counts files other servers
evicted (it is told only of its own claims, shared_link NOTE 1) and the deployment's
budget already bounds the folder. Without this, such an object would be reported present
or not persisted while its reservation stayed ``writing`` until its deadline, holding
budget.

NOTE 4 (a delete before its write starts): LMCache and the runtime may delete an object
whose write is submitted but still waits for an I/O thread. The index does not have it
yet and ``writing`` does not either, so without the queue count the delete would be
lost and the file written afterwards: an object on disk that the core no longer tracks,
holding capacity and served as a hit outside its accounting (a race test saw 43 of 45
files left be such orphans). ``enqueue`` counts a write at submission, under the tier's
lock; ``cancel`` marks every queued write of the key; ``_write_one`` takes its write off
the queue in the same lock hold that enters it into ``writing``, and skips it if marked.
A write submitted after the delete is not marked.

NOTE 5 (capacity net of deletes already decided): the runtime decides under its lock
which files go to make room for a write, but the delete runs after it releases the lock,
and a file a reader has locked is deleted only at its unlock (``tier.delete``). Meanwhile
LMCache's store controller may already have submitted the write the eviction made room
for; counting the doomed file would refuse it (``not_persisted_capacity``), losing the
newest snapshot exactly when the policy had made room for it. The tier marks such files
``leaving`` under the runtime's lock (``tier.mark_decisions``, called as the actions are
taken) and the capacity check counts ``held - leaving``. The disk may so hold more than
the capacity for as long as a reader keeps a doomed file; the capacity is the policy's
budget, not the filesystem's size, and a real lack of space still fails the write with
ENOSPC (NOTE 1).
"""

from __future__ import annotations

import contextlib
import errno
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmcache.logging import init_logger

from . import file_format as df
from .backlog import WriteBacklogFull
from .config import HiStateDiskAdapterConfig
from .entries import UNKNOWN_META, DiskEntry, ObjectMeta
from .folder import capacity_limit
from .shared_link import SharedIndexLink, key_id

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey

logger = init_logger(__name__)

RECHECK_S = 5.0
"""While the capacity is below the configured one, free space is re-measured this often."""
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})

Accounting = Callable[[list["ObjectKey"], list[int]], None]


@dataclass(frozen=True, slots=True)
class TierAccess:
    """What a ``DiskWriter`` shares with its tier (module docstring)."""

    lock: threading.Lock
    index: dict[ObjectKey, DiskEntry]
    held: Callable[[], int]  # bytes of the objects on disk (the base class's count)
    capacity: Callable[[], int]  # the effective capacity (``get_usage`` reports it)
    set_capacity: Callable[[int], None]
    stored: Accounting  # ``_notify_keys_stored`` of the base class
    deleted: Accounting  # ``_notify_keys_deleted``
    capacity_changed: Callable[[int], None]  # the tier reports the new capacity up


def failure_cause(exc: BaseException) -> str:
    """Short cause name of a failed write (the suffix of its ``not_persisted_*`` counter)."""
    if isinstance(exc, WriteBacklogFull):
        return "backlog"  # refused: the write-behind lag is over its bound
    if isinstance(exc, OSError):
        return "no_space" if exc.errno in _NO_SPACE else "io_error"
    if isinstance(exc, ValueError | struct.error | OverflowError):
        return "bad_key"  # e.g. a model name over 65,535 bytes, a rank over 32 bits
    return "error"


class DiskWriter:
    """The write path and capacity feedback of one ``HiStateDiskAdapter``."""

    def __init__(
        self, config: HiStateDiskAdapterConfig, root: Path, stats: Counter[str],
        access: TierAccess,
    ) -> None:
        self.config = config
        self.root = root
        self.stats = stats
        self._access = access
        self._lock = access.lock
        self._index = access.index
        self.shared: SharedIndexLink | None = None  # set by the tier once it has built it
        self.writing: dict[ObjectKey, bool] = {}  # key -> cancelled
        # Writes submitted to the I/O pool and not started (key -> how many), and how many
        # of those a delete cancelled (NOTE 4).
        self.queued: Counter[ObjectKey] = Counter()
        self.cancelled_queued: Counter[ObjectKey] = Counter()
        self.reserved = 0
        # Indexed files whose delete is decided but not done (NOTE 5): key -> size.
        self.leaving: dict[ObjectKey, int] = {}
        self.leaving_bytes = 0
        self._logged_causes: set[str] = set()
        self._capacity_checked = 0.0

    def enqueue(self, keys: Sequence[ObjectKey]) -> None:
        """Under the tier's lock, as writes of ``keys`` are submitted to the I/O pool: a
        delete before they start cancels them (NOTE 4)."""
        self.queued.update(keys)

    def _leave_queue(self, key: ObjectKey) -> bool:
        """Under the tier's lock, as a write of ``key`` starts (or is given up): it leaves
        the queue; True when a delete cancelled it while it waited (NOTE 4)."""
        if self.queued.get(key, 0) <= 0:
            return False  # not submitted through enqueue (or already left)
        self.queued[key] -= 1
        if not self.queued[key]:
            del self.queued[key]
        if self.cancelled_queued.get(key, 0) <= 0:
            return False
        self.cancelled_queued[key] -= 1
        if not self.cancelled_queued[key]:
            del self.cancelled_queued[key]
        return True

    def mark_leaving(self, key: ObjectKey, size: int) -> None:
        """Under the tier's lock: the indexed file of ``key`` (``size`` bytes) will be
        deleted; it no longer counts against writes (NOTE 5)."""
        if key not in self.leaving:
            self.leaving[key] = size
            self.leaving_bytes += size

    def left(self, key: ObjectKey) -> None:
        """Under the tier's lock: ``key``'s file no longer leaves — its entry left the index,
        or a later decision keeps it (``tier`` NOTE 4) — and stops counting as leaving
        (NOTE 5)."""
        size = self.leaving.pop(key, None)
        if size is not None:
            self.leaving_bytes -= size

    def _committed(self) -> int:
        """Under the tier's lock: the bytes writes are measured against — held, less
        what is leaving (NOTE 5), plus what writes in flight reserved."""
        return self._access.held() - self.leaving_bytes + self.reserved

    def keep(self, key: ObjectKey) -> bool:
        """Under the tier's lock: a write of ``key`` decided after a delete that cancelled
        the write in flight (``tier`` NOTE 4): that write completes after all. True if
        there was one."""
        if self.writing.get(key):
            self.writing[key] = False
            return True
        return False

    def cancel(self, key: ObjectKey) -> None:
        """Under the tier's lock: a write of ``key`` in flight is cancelled (its file is
        removed once written), and so is every one still queued (NOTE 4)."""
        waiting = self.queued.get(key, 0) - self.cancelled_queued.get(key, 0)
        if waiting > 0:
            self.cancelled_queued[key] += waiting
        if key in self.writing:
            self.writing[key] = True

    def write_batch(
        self, keys: list[ObjectKey], buffers: list[Any], metas: Mapping[ObjectKey, ObjectMeta]
    ) -> tuple[list[ObjectKey], list[ObjectKey], list[ObjectKey], int]:
        """Write ``keys`` with the headers ``metas`` gives (``UNKNOWN_META`` for a key it
        lacks); returns (ok, failed, stored, payload bytes written): ``ok`` = stored or
        present already. Never raises."""
        ok: list[ObjectKey] = []
        failed: list[ObjectKey] = []
        stored: list[ObjectKey] = []
        written = 0
        dirs: set[Path] = set()
        self._maybe_recheck_capacity()
        meta = [metas.get(key, UNKNOWN_META) for key in keys]
        reserved, skip = self._shared_reserve(keys, buffers, meta)
        for i, key in enumerate(keys):
            if key in skip:  # shared: another server stored it, or over the budget
                with self._lock:
                    self._leave_queue(key)
                (ok if skip[key] == "present" else failed).append(key)
                continue
            try:
                outcome, nbytes, path = self._write_one(key, buffers[i], meta[i],
                                                        key in reserved)
            except BaseException as exc:  # its local reservation released; unreserved below
                self.not_persisted(key, exc)
                failed.append(key)
                continue
            if outcome == "failed":
                failed.append(key)
                continue
            ok.append(key)
            if outcome == "stored":
                stored.append(key)
                written += nbytes
                dirs.add(path.parent)
        if self.config.fsync:
            for d in dirs:
                with contextlib.suppress(OSError):
                    df.fsync_dir(d)
        self.stats["objects_written"] += len(stored)
        if self.shared is not None and stored:
            written_with = zip(keys, zip(buffers, meta, strict=True), strict=True)
            self._shared_commit(stored, dict(written_with))
        if unwritten := reserved.difference(stored):
            assert self.shared is not None  # only a shared folder reserves
            self.shared.unreserve(list(unwritten))
        return ok, failed, stored, written

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
        ``deployment_reserved``: a shared folder's deployment reserved it (NOTE 3).

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
            # Leaving the queue and entering ``writing`` under one lock hold: a delete
            # finds the write in one of the two (NOTE 4).
            if self._leave_queue(key):
                self.stats["writes_cancelled_queued"] += 1
                return "present", 0, path
            if key in self.writing or (key in self._index and not deployment_reserved):
                # Already persisted (objects are immutable), or a concurrent writer owns
                # it and reports its outcome.
                return "present", 0, path
            if deployment_reserved:  # NOTE 3
                stale = self._index.pop(key, None)
                self.left(key)
            elif self._committed() + size > self._access.capacity():
                self.stats["not_persisted_capacity"] += 1
                return "failed", 0, path
            if share is not None and self._committed() + size > share:
                self.stats["not_persisted_degraded_share"] += 1  # shared_link NOTE 4
                return "failed", 0, path
            self.reserved += size
            self.writing[key] = False
        if stale is not None:
            self._access.deleted([key], [stale.size])
            self.stats["stale_entries_replaced"] += 1
        try:
            df.write_object(
                path, oid, view, kind=kind, depth=depth, parent=parent,
                fsync=self.config.fsync, direct=self.config.direct_io,
            )
        except BaseException:
            with self._lock:
                self.reserved -= size
                self.writing.pop(key, None)
            raise
        # NOTE 2: bytes are accounted before the key becomes visible in the index, so a
        # delete (which only finds indexed keys) can never subtract them first.
        self._access.stored([key], [size])
        with self._lock:
            self.reserved -= size
            cancelled = self.writing.pop(key, False)
            if not cancelled:
                self._index[key] = DiskEntry(size, len(view), kind, depth, parent, time.time())
        if cancelled:
            # Deleted while being written: it must not outlive its delete.
            with contextlib.suppress(OSError):
                path.unlink()
            self._access.deleted([key], [size])
            self.stats["writes_cancelled"] += 1
            return "present", 0, path
        return "stored", len(view), path

    def not_persisted_all(self, keys: Sequence[ObjectKey], exc: BaseException) -> None:
        """A whole batch failed before its objects were tried (e.g. a bad buffer)."""
        with self._lock:
            for key in keys:
                self._leave_queue(key)
        for key in keys:
            self.not_persisted(key, exc)

    def not_persisted(self, key: ObjectKey, exc: BaseException) -> None:
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

    # --------------------------------------------------------------- capacity
    def _maybe_recheck_capacity(self) -> None:
        if self._access.capacity() < self.config.capacity_bytes and (
            time.monotonic() - self._capacity_checked >= RECHECK_S
        ):
            self.recheck_capacity()

    def recheck_capacity(self) -> None:
        """Set the capacity to min(configured, held + in flight + free); report a change.

        Writes in flight count as held: their temporary files already take the space.
        """
        try:
            with self._lock:
                held = self._access.held() + self.reserved
            limit = min(self.config.capacity_bytes, capacity_limit(self.root, held))
        except OSError as exc:
            logger.warning("HiState disk tier: cannot measure free space: %s", exc)
            return
        self._capacity_checked = time.monotonic()
        with self._lock:
            changed = limit != self._access.capacity()
            self._access.set_capacity(limit)
        if not changed:
            return
        self.stats["capacity_changes"] += 1
        logger.warning(
            "HiState disk tier: capacity now %d bytes (configured %d; %d held + free space)",
            limit, self.config.capacity_bytes, held,
        )
        self._access.capacity_changed(limit)
