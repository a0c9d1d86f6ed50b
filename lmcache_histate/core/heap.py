"""An addressable min-heap: the priority queue behind every eviction decision.

Eviction ranks change constantly (each structural change re-ranks the units around it,
each victim check may re-rank the top), so the queue must support update and removal
by key, not only push/pop. Ties are broken by an optional ``tie`` and then by insertion
order, so the order is deterministic for a given sequence of operations.

**Algorithm: a heap of priorities over buckets of entries, with lazy deletion.** An
entry is ``(tie, order, version, key, priority)``; ``_live[key]`` is the key's current
entry. Entries of equal priority share a *bucket* (``_buckets[priority]``, a ``heapq``
heap ordered by ``(tie, order, version)``), and ``_heap`` is a ``heapq`` heap of the
buckets' priorities: plain floats. ``set`` adds a new entry to its priority's bucket
(pushing the priority when the bucket is new) and makes it current: the previous one
goes stale in place. ``discard`` forgets the current entry. ``peek`` and ``pop`` first
discard stale entries from the top bucket, and empty buckets from the top of ``_heap``
(an entry is stale when it is not ``_live[key]``). When stale entries outnumber live
ones everything is rebuilt from the live entries (O(n), paid once per n stale
entries: O(1) amortised). Every operation is therefore a ``heapq`` push or pop,
O(log n) in C.

Invariants:
  * ``_live[key]`` is in ``_buckets[_live[key][4]]`` for every live key; ``len(self)``
    counts live keys;
  * a bucket is one entry (a tuple) or a ``heapq`` list of two or more, never empty,
    and its priority is in ``_heap`` (a priority may also be there once more per bucket
    it had before: such a copy finds no bucket, or the current one, when it reaches the
    top, and is popped with it);
  * ``_entries`` counts the entries in all buckets; at most ``max(len(_live),
    COMPACT_MIN)`` of them are stale.

NOTE 1 (why a heap of floats). Until round 11 the heap was one ``heapq`` list of entry
tuples ``(priority, tie, order, version, key)``. Comparing two tuples costs an equality
and an order comparison of their first items, behind a pointer to each tuple, and the
pops of a heap of 10⁵–10⁶ entries are bound by those reads: a pop of 372K tuples took
2.7–3.1 µs, a pop of 372K floats 0.7 µs, and the victim search of an eviction pops
about three times (``benchmarks/README.md`` "core_ops" round 11). Where ranks are ``H``
(sums of floats) equal priorities are rare, so a bucket is the entry itself (no list)
and costs one dict lookup per operation; where they tie (``t`` alone, refresh-all
gives a prefix one ``t``) a bucket is a small ``heapq`` list of tuples, the old cost.

NOTE 2 (the order). It is the one of whole entries ``(priority, tie, order, version)``:
``version`` is unique, so a comparison never reaches the key (keys need not be
orderable). ``order`` is the key's insertion number, kept when its priority moves, so
equal ``(priority, tie)`` go by insertion as in a heap updated in place; a key
discarded and set again is inserted anew. Priorities are compared as floats (``-0.0``
and ``0.0`` share a bucket, as they compared equal in a tuple) and must not be NaN.

NOTE 3 (the rebuild's pause). A rebuild hashes every live priority into a new dict:
about 0.2–0.3 µs per live entry (0.11 s for 400K, against 0.04 s for the ``heapify`` of
tuples it replaced). Amortised over the stale entries that trigger it that is well under
a pop saved, but it is paid at once: at 1M objects (about 200K units per tier's heap)
a heap pauses for about 0.05 s once per 200K re-ranks.
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
        live = self._live
        old = live.get(key)
        self._seq += 1
        if old is None:
            order = self._seq
        elif old[4] == priority and old[0] == tie:
            return
        else:
            order = old[1]
        entry = (tie, order, self._seq, key, priority)
        live[key] = entry
        buckets = self._buckets
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
        n = self._entries
        if old is not None and n > 2 * len(live) and n > 2 * COMPACT_MIN:
            self._compact()

    def discard(self, key: K) -> bool:
        """Remove ``key`` if present; returns whether it was."""
        live = self._live
        if live.pop(key, None) is None:
            return False
        n = self._entries
        if n > 2 * len(live) and n > 2 * COMPACT_MIN:
            self._compact()
        return True

    def peek(self) -> tuple[K, float] | None:
        heap, buckets, live = self._heap, self._buckets, self._live
        while heap:
            priority = heap[0]
            bucket = buckets.get(priority)
            if type(bucket) is tuple:
                if live.get(bucket[3]) is bucket:
                    return bucket[3], bucket[4]
                self._entries -= 1
                del buckets[priority]
            elif bucket is not None:
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
        """Rebuild from the live entries; callers do so once stale entries outnumber live
        ones (and ``COMPACT_MIN``): ``_entries > 2 · max(len(_live), COMPACT_MIN)``."""
        live = self._live
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
