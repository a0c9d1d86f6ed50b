"""The disk tier's write-behind backlog: how old the oldest accepted, unfinished write is,
and the bound that keeps it from growing without limit.

An acknowledged STORE is in LMCache's L1 (memory); the disk tier writes it afterwards, on
its I/O threads. When STOREs arrive faster than the disk writes, the queue of writes grows,
and so does the time an acknowledged object waits before it is on disk: under a kill -9
those objects are lost. The probe measured objects acknowledged more than 2 s before a
kill missing after restart (270 of 582, ``lru``), with nothing reporting the lag.

:class:`WriteBacklog` keeps the submit time of every write task not yet finished, in
submit order: ``lag_s`` (exported as ``histate_disk_write_lag_seconds``) is the age of the
oldest. ``admit`` refuses a new write while that age is over ``max_lag_s``: the tier then
completes the write as not persisted (counted ``not_persisted_backlog``, logged once) and
the object stays in L1 only. The lag is therefore at most ``max_lag_s`` plus the time of
the writes already queued when it was crossed (NOTE 1).

NOTE 1 (why refuse, not wait): the tier's submit calls come from LMCache's store
controller thread, which also hands completions back; making it wait for the disk stalls
every L1-to-L2 hand-off. A refused write is what a full disk already produces (a failed
store task), a path LMCache and the HiState core handle. Under the bound, nothing changes.

Invariant: ``pending`` counts tasks admitted and not ``done``; O(1) per call (a dict in
submit order; the oldest is its first entry).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

__all__ = ["MAX_WRITE_LAG_S", "WriteBacklog", "WriteBacklogFull"]

MAX_WRITE_LAG_S = 10.0
"""Seconds: no new disk write is accepted while an accepted one has waited longer."""


class WriteBacklogFull(RuntimeError):
    """A write refused because the oldest accepted write is older than the bound."""


class WriteBacklog:
    """Submit times of the unfinished writes (module docstring)."""

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
