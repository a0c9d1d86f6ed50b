"""The disk tier's link to the shared index: one folder, one budget, for several servers.

Built by ``HiStateDiskAdapter`` when its ``adapter_params`` carry a ``shared_index``
section (the launcher passes the server YAML's, ``docs/shared-index.md`` §9). The adapter
stays the one that reads and writes files; this part answers, per hook:

| adapter event | call |
|---|---|
| start | ``join`` (refused on a budget mismatch or an unreachable Redis), ``reconcile`` |
| lookup-and-lock | ``lookup`` of every key (one script): stored ones are hits, leased |
| unlock (load done) | leases this server no longer needs queued for ``release`` |
| load found a file gone / corrupt | ``forget_stored`` |
| write batch | ``reserve_with_eviction`` before, ``Registrar.committed`` after the rename, |
| | ``unreserve`` for the reserved objects not written (a failed or skipped write) |
| a victim this server claimed | file deleted, own local entry forgotten, ``drop`` |
| background thread | ``release`` (NOTE 3), ``poll`` (re-registration), ``reconcile`` |

Invariants:

* while Redis answers, the deployment's entries are the truth: a key is a hit only if its
  entry is ``stored``, and then this server holds a load lease on it until the unlock, so
  no other server deletes the file while it is read (``claim`` skips leased entries);
* a file is deleted only by the server that claimed its entry (``budget``), never by a
  server's local eviction (NOTE 1);
* while Redis is unreachable every answer is ``None`` and the adapter uses its local
  view (the files it wrote itself), as a single server does.

NOTE 1 (local eviction in shared mode): the runtime's core evicts from its own view of the
disk tier (its objects, its capacity). In shared mode a file may be another server's hit
at that moment, and the deployment's ranking, not one server's, decides which files go;
so ``forget_local`` drops the object from this server's view only, and the file stays
registered until the deployment's ``H`` ranking claims it at a write that needs room.

NOTE 2 (``C`` and ``M``): an object is committed with its core's ``C`` and ``M`` (the
unit it leaves the disk with), which the HiState runtime computed under its lock when it
decided the write and which came down with it (``entries.ObjectMeta.score``), so the
deployment ranks it by the same ``H`` from its first second; the runtime re-publishes
them on its janitor tick when they change (``shared_index/deployment``). Without a
runtime (a stock ``lmcache server``), or for an object the core does not hold, ``C`` =
``M`` = the file size: ``ln(C/M) = 0`` and ``H`` = last access.

NOTE 3 (release off the path): the unlock runs on LMCache's request path right after the
load; a second round trip there would add to every LOOKUP that reads from disk. Leases
are handed to the background thread, which gives them back at once (woken by the
unlock), so a lease outlives its load by one thread wake-up, far below ``lease_ttl_s``.

NOTE 4 (degraded writes): without Redis a write has no reservation, and every degraded
server sees only its own files. So each one keeps what the deployment looked like at its
last heartbeat (every ``HEARTBEAT_S``): the bytes used, the servers alive (heartbeat at
most ``ALIVE_S`` old, itself included) and its own bytes then; while degraded it holds at
most its own bytes then plus an equal share of the free bytes then, ``own + (budget −
used) // alive``. Summed over the servers alive, own files then + shares ≤ used + free =
the budget, however many of them are degraded at once (up to the writes of one
heartbeat period, which the heartbeats of different servers do not see alike). Deletes
while degraded (``budget.local_delete_allowed``) only lower this. The filesystem's
limit (ENOSPC) stays the last guard.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmcache_histate.config import SharedIndexConfig

from ..shared_index import open_index
from ..shared_index.budget import delete_victims, reserve_with_eviction
from ..shared_index.index import Victim
from ..shared_index.layout import ObjectRecord, object_id
from ..shared_index.reconcile import reconcile
from ..shared_index.registration import Registrar
from . import file_format as df

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey

logger = logging.getLogger("lmcache_histate.shared_index")

__all__ = ["RECONCILE_S", "SharedIndexLink", "key_id"]

RECONCILE_S = 300.0
"""Seconds between two reconciles of the shared folder (one more at start)."""
POLL_S = 0.5
"""Seconds between two polls of a degraded connection (it probes every ``retry_s``)."""
HEARTBEAT_S = 5.0
"""Seconds between two heartbeats of this server (``SharedIndex.heartbeat``)."""
ALIVE_S = 30.0
"""A server whose last heartbeat is older than this no longer counts as alive (NOTE 4)."""
GRACE_S = 60.0
"""A file or temporary younger than this is left alone by a reconcile (its commit may be
on its way)."""


def key_id(key: ObjectKey) -> str:
    """The object's id in the index: the digest naming its file (``layout.object_id``)."""
    return object_id(df.encode_id(df.ObjectId.of(key)))


class SharedIndexLink:
    """One disk tier's calls to the shared index (module docstring)."""

    def __init__(
        self,
        cfg: SharedIndexConfig,
        model: str,
        root: Path,
        budget_bytes: int,
        forget_local: Callable[[list[ObjectKey]], None],
        own_bytes: Callable[[], int] = lambda: 0,
    ) -> None:
        self.root = root
        self.index = open_index(cfg, model, tau=None)
        self.index.join(budget_bytes)  # raises BudgetMismatch / Unavailable
        self.budget_bytes = budget_bytes
        self._own_bytes = own_bytes
        self.alive, self._used_seen, self._own_seen = 1, budget_bytes, 0
        self._last_heartbeat = 0.0
        self.heartbeat()  # NOTE 4
        self.registrar = Registrar(self.index, budget_bytes)
        self.stats: Counter[str] = Counter()
        self._forget_local = forget_local  # own objects whose files a claim deleted
        self._own: dict[str, ObjectKey] = {}  # id -> key of the objects this server wrote
        self._own_lock = threading.Lock()
        self._releases: list[str] = []  # lease ids to give back (background thread)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._last_reconcile = 0.0
        self.last_reconcile: dict[str, int] = {}
        self._reconcile()
        self._thread = threading.Thread(target=self._loop, name="histate-shared-index",
                                        daemon=True)
        self._thread.start()

    def heartbeat(self) -> None:
        """Tell the deployment this server is alive; remember what it looked like (NOTE 4)."""
        own = self._own_bytes()
        self._last_heartbeat = time.monotonic()
        seen = self.index.heartbeat(ALIVE_S)
        if seen is not None:
            self.alive, self._used_seen = seen
            self._own_seen = own

    def degraded_share(self) -> int | None:
        """The bytes of own files this server may hold while Redis is unreachable (NOTE
        4); None while connected (the index's reservations bound the writes)."""
        if not self.index.conn.degraded:
            return None
        free = max(0, self.budget_bytes - self._used_seen)
        return self._own_seen + free // max(1, self.alive)

    # ------------------------------------------------------------------ reads
    def lookup(self, keys: Sequence[ObjectKey]) -> list[bool] | None:
        """Per key, whether it is stored in the deployment (and now leased by this
        server); None when Redis is unreachable (use the local view)."""
        ids = [key_id(k) for k in keys]
        found = self.index.lookup(ids)
        if found is None:
            return None
        self.stats["lookups"] += 1
        self.stats["lookup_hits"] += len(found)
        return [i in found for i in ids]

    def release(self, keys: Sequence[ObjectKey]) -> None:
        """Give the leases back, off the request's path: the background thread sends them
        (NOTE 3)."""
        if keys:
            with self._own_lock:
                self._releases.extend(key_id(k) for k in keys)
            self._wake.set()

    def lost(self, keys: Sequence[ObjectKey]) -> None:
        """Files found gone or corrupt on load: their entries go, wherever they came from."""
        ids = [key_id(k) for k in keys]
        self.stats["forgotten_on_load"] += self.index.forget_stored(ids)
        self.registrar.removed(ids)
        with self._own_lock:
            for i in ids:
                self._own.pop(i, None)

    # ----------------------------------------------------------------- writes
    def reserve(
        self, items: Sequence[tuple[ObjectKey, int]]
    ) -> tuple[set[str], set[str], set[str]] | None:
        """Reserve ``(key, file size)`` objects under the deployment budget, evicting by
        the deployment ranking for those that do not fit. Returns ``(reserved, present,
        full)`` ids: reserved for this server (write them, then ``commit_written`` or
        ``unreserve`` each), stored already by another server (write nothing), over
        budget (not persisted). None when Redis is unreachable."""
        rows = [(key_id(k), size, self._relative(k)) for k, size in items]
        got = reserve_with_eviction(self.index, rows, self._delete_claimed)
        if got is None:
            return None
        self.stats["reserved"] += len(got.reserved)
        self.stats["present"] += len(got.present)
        self.stats["over_budget"] += len(got.full)
        return set(got.reserved), set(got.present), set(got.full)

    def unreserve(self, keys: Sequence[ObjectKey]) -> None:
        """Reserved objects this server did not write: their bytes go back to the budget
        now (Redis unreachable: at their deadline, by a reconcile's ``forget_expired``)."""
        given = self.index.unreserve([key_id(k) for k in keys])
        self.stats["unreserved"] += given or 0

    def commit_written(
        self,
        written: Sequence[tuple[ObjectKey, int, Any, int, int, bytes, tuple[float, float] | None]],
    ) -> None:
        """Files renamed into place: ``(key, file size, payload, kind, depth, parent,
        (C, M) or None)``."""
        records = []
        for k, size, payload, kind, depth, parent, score in written:
            cost, freed = score if score is not None else (float(size), float(size))  # NOTE 2
            records.append(ObjectRecord(
                df.encode_id(df.ObjectId.of(k)), self._relative(k), size,
                zlib.crc32(memoryview(payload).cast("B")), kind, depth, parent,
                cost=cost, freed=freed,
            ))
        if records:
            with self._own_lock:
                self._own.update((r.id, w[0]) for r, w in zip(records, written, strict=True))
            self.registrar.committed(records)

    def _delete_claimed(self, victims: list[Victim]) -> list[str]:
        """Delete the files of entries this server claimed; returns the ids now gone."""
        gone = delete_victims(self.root)(victims)
        if gone:
            self.stats["evicted"] += len(gone)
            self.registrar.removed(gone)
            with self._own_lock:
                keys = [k for k in (self._own.pop(i, None) for i in gone) if k is not None]
            if keys:
                self._forget_local(keys)
        return gone

    def _relative(self, key: ObjectKey) -> str:
        return str(df.object_path(self.root, df.ObjectId.of(key)).relative_to(self.root))

    # ------------------------------------------------------------- background
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(POLL_S)
            self._wake.clear()
            try:
                with self._own_lock:
                    ids, self._releases = self._releases, []
                self.index.release(ids)
                self.index.conn.poll()
                if time.monotonic() - self._last_heartbeat >= HEARTBEAT_S:
                    self.heartbeat()
                if time.monotonic() - self._last_reconcile >= RECONCILE_S:
                    self._reconcile()
            except Exception:
                logger.exception("shared index: background step failed")

    def _reconcile(self) -> None:
        self._last_reconcile = time.monotonic()
        report = reconcile(self.index, self.root, grace_s=GRACE_S, delete=self._delete_claimed)
        if report is not None:
            self.last_reconcile = dict(report)
            self.stats["reconciles"] += 1

    def status(self) -> dict[str, Any]:
        """Mode, counters and the deployment's disk usage (``/status``, ``/metrics``)."""
        conn = self.index.conn
        usage = None if conn.degraded else self.index.usage()
        out: dict[str, Any] = {
            "mode": "degraded" if conn.degraded else "connected",
            "url": conn.where,
            "deployment": self.index.keys.deployment,
            "instance": self.index.instance,
            "connection": conn.counters(),
            "registrar": dict(self.registrar.stats),
            "link": dict(self.stats),
            "last_reconcile": self.last_reconcile,
        }
        if usage is not None:
            out["used_bytes"], out["budget_bytes"], out["evicting_bytes"] = usage
        return out

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self.index.conn.close()
