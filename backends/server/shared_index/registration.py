"""This server's own objects, kept locally so that Redis can be told again after an outage.

The index in Redis is a cache of facts the servers hold: every object a server committed
is in its ``Registrar`` until the server deletes it. When Redis comes back (possibly
restarted empty, possibly only unreachable for a while) the connection's recovery
listener runs ``reregister``: the deployment budget and this server are registered
again (``SharedIndex.rejoin``) and every own object is committed again in batches.
``commit`` is idempotent: an entry still stored is left as it is (status 0), a missing
one is registered (status 2, counted ``reregistered``). Objects this server deleted
while Redis was away are forgotten there (``forget_stored``: their files are gone).

Objects committed while degraded are kept here and reach Redis at the recovery, so no
completed object is lost from the index by an outage.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

from .index import SharedIndex
from .layout import ObjectRecord

__all__ = ["Registrar"]


class Registrar:
    """Own objects of one server (module docstring)."""

    def __init__(self, index: SharedIndex, budget_bytes: int, *, batch: int = 512) -> None:
        self.index = index
        self.budget_bytes = budget_bytes
        self.batch = batch
        self._lock = threading.Lock()
        self._own: dict[str, ObjectRecord] = {}
        self._removed_offline: set[str] = set()
        self.stats: Counter[str] = Counter()
        index.conn.on_recovery(self.reregister)

    def committed(self, records: Iterable[ObjectRecord]) -> list[int] | None:
        """Objects this server wrote: remembered, then committed (None = degraded)."""
        records = list(records)
        with self._lock:
            for r in records:
                self._own[r.id] = r
                self._removed_offline.discard(r.id)
        return self.index.commit(records)

    def removed(self, ids: Iterable[str]) -> None:
        """Objects this server deleted (after ``drop``, or locally while degraded)."""
        ids = list(ids)
        degraded = self.index.conn.degraded
        with self._lock:
            for i in ids:
                self._own.pop(i, None)
                if degraded:
                    self._removed_offline.add(i)

    def own(self) -> list[ObjectRecord]:
        with self._lock:
            return list(self._own.values())

    def reregister(self) -> int:
        """Tell Redis everything this server holds; returns the entries registered anew."""
        if not self.index.rejoin(self.budget_bytes):
            return 0
        with self._lock:
            gone, self._removed_offline = list(self._removed_offline), set()
        if gone:
            self.stats["forgotten_after_outage"] += self.index.forget_stored(gone)
        records = self.own()
        fresh = 0
        for start in range(0, len(records), self.batch):
            status = self.index.commit(records[start : start + self.batch])
            if status is None:  # unreachable again: the next recovery starts over
                break
            fresh += sum(1 for s in status if s == 2)
            # Adopted by another server's reconcile meanwhile: back to this server's
            # ranking (scripts NOTE 4).
            self.stats["taken_back"] += sum(1 for s in status if s == 3)
        self.stats["reregistered"] += fresh
        self.stats["reregister_runs"] += 1
        return fresh
