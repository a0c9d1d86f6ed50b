"""The L1 / disk action executor: the core's placement events made real.

The core decides placement in terms of node parts and tiers and queues its ``stored`` /
``moved`` / ``dropped`` events (``core.placement``, "Events"); ``TierActions`` drains them
(``drain_core``) and turns them into ``Actions`` on LMCache objects (delete from L1,
delete from disk, demote = write an L1 object to disk, then delete it from L1). Actions
are collected under the runtime lock and run after it is released (never call into
LMCache's L1 manager or wait on disk I/O under it). The feedback paths live here too, both
queues drained under the lock: L1 removals nobody here decided (queued by LMCache's
callback) and the disk tier's reports (queued by its I/O threads, ``disk.tier`` NOTE 3) —
failed writes and lost files become losses in the core, a new capacity resizes the core's
disk tier, demoted objects leave L1.

Every runtime entry point goes through the runtime's ``step`` (``runtime`` module doc),
written once there: take the runtime lock, ``drain`` both queues, let the caller change
the core, drain the core's events (NOTE 2), ``take`` the collected ``Actions`` (with the
header of every disk write they decide, ``header``), release the lock, ``run`` them.
Nothing here takes the runtime lock. Running hands the disk tier the headers before it
submits the writes, so the tier's I/O threads never read runtime state (``disk.tier`` NOTE
2), and they never call into it either: they only queue. Taking tells the tier the disk
deletes and writes decided, still under the lock (a bookkeeping call, no I/O): a write
submitted before the deletes run is measured against the room they make (``disk.tier``
NOTE 9), and a delete decided before a write of the same object does not remove its file
(``disk.tier`` NOTE 4).

Threads: ``drain`` and ``take`` run within the runtime's step on whichever thread calls it
(LMCache's request and controller threads, the janitor); ``run`` and ``l1_delete`` are
called with the lock released; ``on_l1_removed`` is called under LMCache's L1 lock and only
appends to a queue. No disk I/O thread runs code of this module.

State owned here: the pending ``Actions``, the chunk nodes touched since the last
``take`` (reconciled then), the objects of a commit batch in flight, the queue of L1
removal events and the removals HiState itself asked for (``expected``, which are not
losses), the L1 deletes a reader's lock refused (retried by the janitor), and the
demotions that never reached the disk tier (applied as failed writes at the next drain).

NOTE 1 (an L1 delete needs no write bookkeeping). A disk delete is voided by a later
write of the same object (``disk.tier`` NOTE 4) because a file can be written again while
its delete waits. An L1 object cannot: LMCache refuses to stage a key that has a resident
object (``L1Manager.reserve_write``: ``KEY_NOT_WRITABLE``) and discards, without a commit
event, a staged copy whose key became resident meanwhile (``finish_write``; lmcache
0.5.6). So the core can only place a new commit of a key it dropped after the old object
has left L1, and an L1 delete decided under the lock, run after it, removes the object
it was decided for. The order this leaves open needs a removal nobody here decided
(``POST /cache/clear``) and a new commit of the same key, both between ``take`` and the
delete: the delete would then remove the new object as an expected removal.

NOTE 2 (when the core's events are drained). An event names a node part; its LMCache
objects are read from the object map when the event is applied, so it must be applied
while the map still holds the objects the core decided about. Every core call that
places, evicts or loses something is followed by a drain before the object map changes:
the runtime drains right after the ``complete`` of each STORE record
(``HiStateRuntime._place_record``) (the next record
may register new objects for a node this one dropped, and unplaced parts are
unregistered right after it); ``lose`` and ``set_capacity`` here drain at the end of the
report or queue that caused them; ``take`` drains first of all (the L1 eviction policy's
``evict``, recovery's ``set_capacity`` and ``recover``, which change no object of the map
before it). Observers (``observers``) see each drained batch after it is applied, with
the objects still in the map.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from lmcache_histate.core.cache import PlacementEvent
from lmcache_histate.core.tiers import KV, SNAPSHOT, ServerTier

from ..disk.entries import ObjectMeta
from ..disk.tier import CapacityChanged, DiskReport, FilesLost, WriteDone
from ..shared_index.deployment import DeploymentSync
from .objects import ModelCore, ObjectMap
from .stats import Stats

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache_histate.backends.server.disk.tier import HiStateDiskAdapter

logger = logging.getLogger("lmcache_histate.runtime")

__all__ = ["Actions", "TierActions", "take_one"]

CPU, DISK = ServerTier.CPU, ServerTier.DISK
TIER_NAMES = {t: t.name.lower() for t in ServerTier}


def take_one(counts: Counter[Any], key: Any) -> bool:
    """Take one of ``key``'s pending count: True (and one fewer, no entry at zero) when it
    had one, False when it had none. Invariant kept: ``counts`` holds no zero entries."""
    if not counts.get(key):
        return False
    if counts[key] == 1:
        del counts[key]
    else:
        counts[key] -= 1
    return True


@dataclass(slots=True)
class Actions:
    """Effects decided under the lock, run after it is released. ``headers``: those of the
    disk writes decided (the store policy's routed objects and the demotions)."""

    l1_delete: list[ObjectKey] = field(default_factory=list)
    disk_delete: list[ObjectKey] = field(default_factory=list)
    demote: list[tuple[int, str, list[ObjectKey]]] = field(default_factory=list)
    headers: dict[ObjectKey, ObjectMeta] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.l1_delete or self.disk_delete or self.demote or self.headers)


class TierActions:
    """Collects and runs the L1 / disk actions; reports losses to the core."""

    def __init__(
        self,
        model: ModelCore,
        objects: ObjectMap,
        deployment: DeploymentSync,
        stats: Stats,
        clock: Callable[[], float],
    ) -> None:
        self.clock = clock
        self.model = model
        self.objects = objects
        self.deployment = deployment
        self.stats = stats
        # Each sees every drained batch of the core's events (NOTE 2); it must not block.
        self.observers: list[Callable[[list[PlacementEvent]], None]] = []
        self.disk: HiStateDiskAdapter | None = None
        self.l1: Any = None
        self.pending = Actions()
        self.touched: set[int] = set()
        self.batch: set[ObjectKey] = set()
        self.events: deque[list[ObjectKey]] = deque()
        self.not_demoted: deque[list[ObjectKey]] = deque()
        self._expected: Counter[ObjectKey] = Counter()
        self._expected_lock = threading.Lock()
        self.retry_l1: set[ObjectKey] = set()
        self._retry_lock = threading.Lock()

    # ================================================================ core events
    def drain_core(self) -> None:
        """Apply the core's queued placement events (under the lock; NOTE 2): each becomes
        counters, touched nodes and pending actions, as it names them (below); then the
        observers see the batch (a shared disk tier's ``DeploymentSync`` learns there what
        this server holds, ``HiStateRuntime._drive_disk_tier``)."""
        core = self.model.core
        if core is None:
            return
        events = core.take_events()
        if not events:
            return
        for event in events:
            match event:
                case ("stored", nk, part, tier, _nbytes):
                    self._stored(nk, part, tier)
                case ("moved", nk, part, src, dst, _nbytes):
                    self._moved(nk, part, src, dst)
                case ("dropped", nk, part, tiers, *_):
                    self._dropped(nk, part, tiers)
        for observer in self.observers:
            observer(events)

    def _stored(self, nk: int, part: str, tier: int) -> None:
        """A part placed on ``tier``: on disk, its L1 objects are written there (a
        demotion) unless the store policy routes them there already (a commit batch)."""
        self.touched.add(nk)
        self.stats[f"{part}_stored.{TIER_NAMES[tier]}"] += 1
        keys = self.objects.keys(nk, part)
        if tier == DISK and keys and not set(keys) <= self.batch:
            self.pending.demote.append((nk, part, keys))

    def _moved(self, nk: int, part: str, src: int, dst: int) -> None:
        self.touched.add(nk)
        self.stats[f"{part}_evicted.{TIER_NAMES[src]}"] += 1
        self.stats[f"{part}_stored.{TIER_NAMES[dst]}"] += 1
        if src == CPU and dst == DISK:
            self.stats[f"{part}_demoted"] += 1
        keys = self.objects.keys(nk, part)
        if dst == DISK and keys and not set(keys) <= self.batch:
            self.pending.demote.append((nk, part, keys))
        elif dst == CPU:  # the core never promotes here; keep the objects consistent anyway
            self.pending.disk_delete.extend(keys)

    def _dropped(self, nk: int, part: str, tiers: int) -> None:
        self.touched.add(nk)
        keys = self.objects.keys(nk, part)
        for tier in (CPU, DISK):
            if tiers & (1 << tier):
                self.stats[f"{part}_evicted.{TIER_NAMES[tier]}"] += 1
                if keys:
                    target = self.pending.l1_delete if tier == CPU else self.pending.disk_delete
                    target.extend(keys)

    # ================================================================ collecting
    @contextmanager
    def committing(self, keys: Iterable[ObjectKey]) -> Iterator[None]:
        """While a commit batch is placed: its objects are in L1 already, the disk tier
        gets them from the store policy, so the core's events need no demotion for them."""
        self.batch = set(keys)
        try:
            yield
        finally:
            self.batch = set()

    def take(self) -> Actions:
        """The actions collected so far (under the lock), after reconciling touched nodes.

        Reconciling forgets (and deletes) the objects of parts the core no longer holds
        anywhere. Usually their deletion is already queued by the core's ``dropped``
        events; this also catches parts made of several objects (tensor-parallel shards) of
        which one was lost: the others are useless alone. Deleting what is gone is a no-op.
        The core's events still queued are applied first (NOTE 2).
        """
        self.drain_core()
        touched, self.touched = self.touched, set()
        objects = self.objects
        for nk in touched:
            for part in (KV, SNAPSHOT):
                if not objects.tiers(nk, part) and objects.has_part(nk, part):
                    keys = objects.unregister_part(nk, part)
                    self.pending.l1_delete.extend(keys)
                    self.pending.disk_delete.extend(keys)
        for _nk, _part, keys in self.pending.demote:
            self.expect_writes(keys)
        if self.disk is not None and (self.pending.disk_delete or self.pending.headers):
            # Before the lock is released, in its order: a write the store controller
            # submits once it is must already see these files as leaving (``disk.tier``
            # NOTE 9), and a delete decided before a write of the same object must not
            # run (``disk.tier`` NOTE 4). What the core holds on disk now decides.
            on_disk = 1 << DISK
            self.pending.disk_delete = [k for k in dict.fromkeys(self.pending.disk_delete)
                                        if not objects.key_tiers(k) & on_disk]
            self.disk.mark_decisions(
                self.pending.disk_delete,
                [k for k in self.pending.headers if objects.key_tiers(k) & on_disk])
        actions, self.pending = self.pending, Actions()
        return actions

    def expect_writes(self, keys: Iterable[ObjectKey]) -> None:
        """The disk tier will write ``keys`` (under the lock): their headers go with the
        actions."""
        headers = self.pending.headers
        for key in keys:
            if key not in headers:
                headers[key] = self.header(key)

    def header(self, key: ObjectKey) -> ObjectMeta:
        """What a disk write of ``key`` carries (under the lock): kind, depth and parent
        for its file header, and with a shared index the core's ``(C, M)``."""
        kind, depth, parent = self.objects.object_meta(key)
        score = None
        disk, core = self.disk, self.model.core
        if disk is not None and disk.shared is not None and core is not None:
            where = self.objects.where(key)
            if where is not None:
                score = self.deployment.score_of(core, *where)
        return ObjectMeta(kind, depth, parent, score)

    # ================================================================ disk events
    def apply_disk_report(self, report: DiskReport) -> None:
        """One report of the disk tier (under the lock, from ``drain``): failed writes and
        lost files are losses on disk (a failed object leaves L1 unless the core keeps it
        on the CPU tier), a demotion's written objects leave L1 likewise (a store task's
        are let go by the store policy, ``on_persisted``), a new capacity resizes the
        core's disk tier. Called before ``take``: a part it reconciles away is not
        CPU-tracked here either."""
        if isinstance(report, WriteDone):
            self._lose_on_disk(report.failed, "not_persisted")
            leaving = report.failed if report.store_task else [*report.failed, *report.ok]
            self.pending.l1_delete.extend(self.objects.not_cpu_tracked(leaving))
        elif isinstance(report, FilesLost):
            self._lose_on_disk(report.keys, "lost.disk")
        elif isinstance(report, CapacityChanged):
            self.model.resize_disk(report.capacity_bytes, self.clock())
        self.drain_core()  # the losses' and the resize's events (NOTE 2)

    def _lose_on_disk(self, keys: list[ObjectKey], counter: str) -> None:
        """Tell the core the disk copies of ``keys``' parts are gone (under the lock)."""
        core = self.model.core
        for key in keys:
            where = self.objects.where(key)
            if where is None or core is None:
                continue
            if self.objects.tiers(*where) & (1 << DISK):
                self.stats[f"{where[1]}_{counter}"] += 1
                core.lose(where[0], where[1], DISK)
                self.touched.add(where[0])

    # ================================================================ L1 events
    def on_l1_removed(self, keys: list[ObjectKey]) -> None:
        """Called by LMCache under its L1 lock: queue only."""
        if keys:
            self.events.append(list(keys))

    def drain(self) -> None:
        """Apply the queued L1 removals (the ones nobody here decided are losses), the disk
        tier's reports (``apply_disk_report``) and the demotions that never reached it, under
        the lock."""
        if self.disk is not None:
            for report in self.disk.take_reports():
                self.apply_disk_report(report)
        while self.not_demoted:
            self.apply_disk_report(WriteDone([], self.not_demoted.popleft(), store_task=True))
        core = self.model.core
        while self.events:
            for key in self.events.popleft():
                with self._expected_lock:
                    if take_one(self._expected, key):
                        continue
                where = self.objects.where(key)
                if where is None or core is None:
                    continue
                if self.objects.tiers(*where) & (1 << CPU):
                    self.stats[f"{where[1]}_lost.cpu"] += 1
                    core.lose(where[0], where[1], CPU)
                    self.touched.add(where[0])
        self.drain_core()  # the losses' events (NOTE 2)

    def leave_l1(self, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        """Objects written to disk (the store controller's, or a delete a reader's lock
        refused, ``take_refused``): those not kept on the CPU tier leave L1 when the
        actions run (under the lock). Deleted here rather than by the store controller,
        which ignores a delete refused because a lookup holds a read lock; here it is
        retried. Returns the keys to delete."""
        out = self.objects.not_cpu_tracked(keys)
        self.pending.l1_delete.extend(out)
        return out

    def take_refused(self) -> list[ObjectKey]:
        """The L1 deletes a reader's lock refused, to retry (janitor; any thread)."""
        with self._retry_lock:
            retry, self.retry_l1 = list(self.retry_l1), set()
        return retry

    # ================================================================ running
    def run(self, actions: Actions) -> None:
        """Run actions taken under the lock (never call with the lock held; the L1 deletes
        then remove the objects they were decided for, NOTE 1)."""
        if not actions:
            return
        if actions.headers and self.disk is not None:  # before any write is submitted
            self.disk.expect_headers(actions.headers)
        if actions.disk_delete and self.disk is not None:
            try:
                self.disk.delete(list(dict.fromkeys(actions.disk_delete)))
            except Exception:
                logger.exception("HiState: disk delete failed")
        for nk, part, keys in actions.demote:
            self._demote(nk, part, keys)
        if actions.l1_delete:
            self.l1_delete(list(dict.fromkeys(actions.l1_delete)))

    def l1_delete(self, keys: list[ObjectKey]) -> None:
        if self.l1 is None or not keys:
            return
        from lmcache.v1.distributed.error import L1Error

        self._expect_removals(keys)
        try:
            result = self.l1.delete(keys)
        except Exception:
            logger.exception("HiState: L1 delete failed")
            self._unexpect(keys)
            return
        locked = [k for k, err in result.items() if err == L1Error.KEY_IS_LOCKED]
        gone = [k for k, err in result.items() if err != L1Error.SUCCESS]
        self._unexpect(gone)
        if locked:
            with self._retry_lock:
                self.retry_l1.update(locked)

    def _expect_removals(self, keys: Iterable[ObjectKey]) -> None:
        with self._expected_lock:
            for key in keys:
                self._expected[key] += 1

    def _unexpect(self, keys: Iterable[ObjectKey]) -> None:
        with self._expected_lock:
            for key in keys:
                take_one(self._expected, key)

    def _demote(self, nk: int, part: str, keys: list[ObjectKey]) -> None:
        """Write L1 objects to the disk tier, then let them leave L1."""
        from lmcache.v1.distributed.error import L1Error

        disk, l1 = self.disk, self.l1
        if disk is None or l1 is None:
            self._not_demoted(keys)
            return
        result = l1.reserve_read(keys)
        found = [k for k in keys if result[k][0] == L1Error.SUCCESS]
        objs = [result[k][1] for k in found]
        missing = [k for k in keys if k not in found]
        if missing:
            if found:
                l1.finish_read(found)
            self.stats[f"{part}_demote_missing"] += 1
            self._not_demoted(keys)
            return
        # The read lock goes as soon as the write is done (LMCache's own call, on the I/O
        # thread); which objects then leave L1 is decided at the next drain.
        disk.write_objects(found, [o.byte_array for o in objs], partial(l1.finish_read, found))

    def _not_demoted(self, keys: list[ObjectKey]) -> None:
        """A demotion that never reached the disk tier: its disk copies are lost, as a
        failed write's are, at the next drain (called with the lock released)."""
        self.not_demoted.append(keys)
