"""What every HiState L2 adapter owes LMCache's controllers: task ids, results, event fds,
and the headers of writes the runtime described before submitting them.

LMCache 0.5.6's L2 adapter contract (``l2_adapters/base.py``): each ``submit_*`` returns a
task id at once; the work finishes on another thread, which records the result and
signals the matching event fd; the controller then collects it (``pop_completed_store_tasks``,
``query_lookup_and_lock_result``, ``query_load_result``). ``TaskBoard`` holds that, one
per adapter (the disk tier, the shared tier); its lock guards only its own dicts.

``ExpectedHeaders``: the headers (kind, depth, parent, the core's score) the runtime hands
down before a write is submitted (``disk.tier`` NOTE 2), bounded: headers of writes that
never come are dropped oldest first.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2TaskId
from lmcache.v1.platform import create_event_notifier

from .disk.entries import ObjectMeta

__all__ = ["HEADERS_MAX", "ExpectedHeaders", "TaskBoard"]

HEADERS_MAX = 1 << 16
"""Expected headers kept for writes not yet submitted; the oldest go first."""


class TaskBoard:
    """Task ids, finished results and the three event fds of one L2 adapter."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._stores: dict[L2TaskId, L2StoreResult] = {}
        self._lookups: dict[L2TaskId, Bitmap] = {}
        self._loads: dict[L2TaskId, Bitmap] = {}
        self.store_efd, self.lookup_efd, self.load_efd = (
            create_event_notifier(), create_event_notifier(), create_event_notifier())

    def new_id(self) -> L2TaskId:
        with self._lock:
            tid = self._next
            self._next += 1
            return tid

    def store_done(self, tid: L2TaskId, result: L2StoreResult) -> None:
        with self._lock:
            self._stores[tid] = result
        self.store_efd.notify()

    def lookup_done(self, tid: L2TaskId, bitmap: Bitmap) -> None:
        with self._lock:
            self._lookups[tid] = bitmap
        self.lookup_efd.notify()

    def load_done(self, tid: L2TaskId, bitmap: Bitmap) -> None:
        with self._lock:
            self._loads[tid] = bitmap
        self.load_efd.notify()

    def pop_stores(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    def pop_lookup(self, tid: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._lookups.pop(tid, None)

    def pop_load(self, tid: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loads.pop(tid, None)

    def close(self) -> None:
        self.store_efd.close()
        self.lookup_efd.close()
        self.load_efd.close()


class ExpectedHeaders:
    """Headers of writes about to be submitted, by key, at most ``HEADERS_MAX``."""

    def __init__(self, stats: Counter[str]) -> None:
        self._lock = threading.Lock()
        self._headers: OrderedDict[ObjectKey, ObjectMeta] = OrderedDict()
        self._stats = stats

    def expect(self, metas: Mapping[ObjectKey, ObjectMeta]) -> None:
        if not metas:
            return
        with self._lock:
            self._headers.update(metas)
            for key in metas:
                self._headers.move_to_end(key)
            while len(self._headers) > HEADERS_MAX:
                self._headers.popitem(last=False)
                self._stats["headers_dropped"] += 1

    def take(self, keys: Sequence[ObjectKey]) -> dict[ObjectKey, ObjectMeta]:
        """The headers of ``keys`` that were expected (each handed out once)."""
        with self._lock:
            return {k: m for k in keys if (m := self._headers.pop(k, None)) is not None}
