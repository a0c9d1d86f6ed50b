"""An addressable min-heap: the priority queue behind every eviction decision.

Eviction ranks change constantly (each structural change re-ranks the units around it,
each victim check may re-rank the top), so the queue must support update and removal
by key, not only push/pop. Ties are broken by an optional ``tie`` and then by insertion
order, so the order is deterministic for a given sequence of operations.

**Algorithm: a heap of priorities over buckets of entries, with lazy deletion.** An
entry is ``(tie, order, version, key, priority)``; ``_live[key]`` is the key's current
entry. Entries of equal priority share a *bucket* (``_buckets[priority]``: the entry
itself when it is alone, else a ``heapq`` list ordered by ``(tie, order, version)``),
and ``_heap`` is a ``heapq`` heap of the buckets' priorities: plain floats. ``set``
adds a new entry to its priority's bucket (pushing the priority when the bucket is new)
and makes it current; ``discard`` forgets the current entry. An entry that stops being
current leaves its bucket at once if it was alone there (its priority stays in
``_heap``, stale, until it reaches the top), and stays in a shared bucket, stale, until
that bucket reaches the top (an entry is stale when it is not ``_live[key]``). ``peek``
and ``pop`` discard stale entries and priorities from the top. When stale priorities
or entries outnumber the live keys they are rebuilt from what is live (O(n), paid once
per n stale ones: O(1) amortised). Every operation is therefore a ``heapq`` push or
pop, O(log n) in C, and a dict lookup or two.

Invariants:
  * ``_live[key]`` is in ``_buckets[_live[key][4]]`` for every live key; ``len(self)``
    counts live keys;
  * a bucket is one live entry (a tuple) or a ``heapq`` list of two or more entries,
    live or stale, never empty; its priority is in ``_heap`` (a priority may also be
    there once more per bucket it had before: such a copy finds no bucket, or the
    current one, when it reaches the top, and is popped with it);
  * ``_entries`` counts the entries in all buckets; at most ``max(len(_live),
    COMPACT_MIN)`` of them are stale, and at most as many priorities in ``_heap``.

NOTE 1 (why a heap of floats). A heap of entry tuples ``(priority, tie, order, version,
key)`` would be the plain design. Comparing two tuples costs an equality
and an order comparison of their first items, behind a pointer to each tuple, and the
pops of a heap of 10⁵–10⁶ entries are bound by those reads: a pop of 372K tuples took
about 3 µs, a pop of 372K floats 0.7–0.9 µs (``benchmarks/heap_pops.py``), and the
victim search of an eviction pops about three times (``benchmarks/README.md``
"core_ops"). Where ranks are ``H`` (sums of floats) equal priorities are rare,
so a bucket is the entry itself (no list) and costs a dict lookup; where they tie (``t``
alone: refresh-all gives a prefix one ``t``) a bucket is a small ``heapq`` list of
tuples, the plain design's cost.

NOTE 2 (the order). It is the one of whole entries ``(priority, tie, order, version)``:
``version`` is unique, so a comparison never reaches the key (keys need not be
orderable). ``order`` is the key's insertion number, kept when its priority moves, so
equal ``(priority, tie)`` go by insertion as in a heap updated in place; a key
discarded and set again is inserted anew. Priorities are compared as floats (``-0.0``
and ``0.0`` share a bucket, as they compared equal in a tuple) and must not be NaN.

NOTE 3 (an entry alone leaves at once). Most stale entries were alone at their
priority, and taking them out of the dict when they go stale (one lookup) keeps the
common rebuild to the floats: ``list(_buckets)`` and a ``heapify``, 0.04 s for 400K
live keys, as fast as a ``heapify`` of 400K entry tuples (a rebuild of the
buckets themselves hashes every live priority anew: 0.11 s; it runs only when stale
entries of shared buckets pile up). It also means that a bucket of one entry is live,
which ``peek`` takes without a lookup.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

__all__ = ["IndexedHeap"]

COMPACT_MIN = 64

_heappush, _heappop = heapq.heappush, heapq.heappop

# An entry ``(tie, order, version, key, priority)``; a bucket is the one entry of its
# priority, or a ``heapq`` list of two or more.
_Entry = tuple[int, int, int, K, float]
_Bucket = _Entry[K] | list[_Entry[K]]


class IndexedHeap(Generic[K]):
    """Min-heap of ``(priority, key)`` with ``set`` / ``discard`` by key in O(log n).

    Equal priorities are ordered by an optional ``tie`` (lower first), then by insertion.
    """

    __slots__ = ("_buckets", "_entries", "_heap", "_live", "_seq")

    def __init__(self) -> None:
        self._heap: list[float] = []
        self._buckets: dict[float, _Bucket[K]] = {}
        self._live: dict[K, _Entry[K]] = {}
        self._seq = 0
        self._entries = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._live))

    def priority(self, key: K) -> float:
        return self._live[key][4]

    def set(self, key: K, priority: float, tie: int = 0) -> None:
        """Insert ``key`` or move it to ``(priority, tie)``."""
        live, buckets = self._live, self._buckets
        old = live.get(key)
        self._seq += 1
        if old is None:
            order = self._seq
        elif old[4] == priority and old[0] == tie:
            return
        else:
            order = old[1]
            if buckets.get(old[4]) is old:
                # Alone at its priority: the bucket goes now, its float stays (NOTE 3).
                del buckets[old[4]]
                self._entries -= 1
        entry = (tie, order, self._seq, key, priority)
        live[key] = entry
        bucket = buckets.get(priority)
        if bucket is None:
            buckets[priority] = entry
            _heappush(self._heap, priority)
        elif type(bucket) is list:
            _heappush(bucket, entry)
        else:
            buckets[priority] = [bucket, entry] if bucket < entry else [entry, bucket]
        self._entries += 1
        # ``_compact``'s condition, inline: this runs for every re-rank.
        if old is not None:
            n, e = len(self._heap), self._entries
            if e > n:
                n = e
            if n > 2 * len(live) and n > 2 * COMPACT_MIN:
                self._compact()

    def discard(self, key: K) -> bool:
        """Remove ``key`` if present; returns whether it was."""
        live, buckets = self._live, self._buckets
        old = live.pop(key, None)
        if old is None:
            return False
        if buckets.get(old[4]) is old:
            del buckets[old[4]]
            self._entries -= 1
        n, e = len(self._heap), self._entries
        if e > n:
            n = e
        if n > 2 * len(live) and n > 2 * COMPACT_MIN:
            self._compact()
        return True

    def peek(self) -> tuple[K, float] | None:
        heap, buckets, live = self._heap, self._buckets, self._live
        while heap:
            priority = heap[0]
            bucket = buckets.get(priority)
            if type(bucket) is tuple:
                # A bucket of one entry is live: a stale one leaves at once (NOTE 3).
                return bucket[3], bucket[4]
            if bucket is not None:
                while bucket:
                    top = bucket[0]
                    if live.get(top[3]) is top:
                        return top[3], top[4]
                    _heappop(bucket)
                    self._entries -= 1
                del buckets[priority]
            _heappop(heap)
        return None

    def pop(self) -> tuple[K, float]:
        top = self.peek()
        if top is None:
            raise IndexError("pop from an empty IndexedHeap")
        key, priority = top
        del self._live[key]
        bucket = self._buckets[priority]
        self._entries -= 1
        if type(bucket) is list:
            _heappop(bucket)
            if bucket:
                return top
        del self._buckets[priority]
        _heappop(self._heap)
        return top

    def _compact(self) -> None:
        """Drop stale priorities and entries; callers do so once either outnumbers the live
        keys (and ``COMPACT_MIN``): ``max(len(_heap), _entries) > 2 · max(len(_live),
        COMPACT_MIN)``. Stale entries sit only in shared buckets (NOTE 3): while they are
        within that bound only the floats are rebuilt, from the buckets' priorities."""
        live = self._live
        if self._entries <= 2 * max(len(live), COMPACT_MIN):
            self._heap = list(self._buckets)
            heapq.heapify(self._heap)
            return
        # One entry per priority, the common case, in one pass; then the equal ones.
        buckets: dict[float, _Bucket[K]] = {entry[4]: entry for entry in live.values()}
        if len(buckets) < len(live):
            equal: dict[float, list[_Entry[K]]] = {}
            for entry in live.values():
                first = buckets[entry[4]]
                if first is not entry:
                    group = equal.get(entry[4])
                    if group is None:
                        equal[entry[4]] = [first, entry]
                    else:
                        group.append(entry)
            for priority, group in equal.items():
                heapq.heapify(group)
                buckets[priority] = group
        self._buckets = buckets
        self._heap = list(buckets)
        heapq.heapify(self._heap)
        self._entries = len(live)
