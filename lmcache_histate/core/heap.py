"""An addressable min-heap: the priority queue behind every eviction decision.

Eviction ranks change constantly (each structural change re-ranks the units around it,
each victim check may re-rank the top), so the queue must support update and removal
by key, not only push/pop. Ties are broken by an optional ``tie`` and then by insertion
order, so the order is deterministic for a given sequence of operations.

**Algorithm: a binary heap with lazy deletion.** The heap list holds entries
``(priority, tie, order, version, key)``; ``_live[key]`` is the key's current entry.
``set`` pushes a new entry and makes it current (the previous one goes stale in place);
``discard`` forgets the current entry. ``peek`` and ``pop`` first discard stale entries
from the top (an entry is stale when it is not ``_live[key]``). When stale entries
outnumber live ones the list is rebuilt from the live entries (``heapify``, O(n),
paid once per n stale entries: O(1) amortised). Every operation is therefore a
``heapq`` push or pop, O(log n) in C, where the sift loops of a heap in Python were the
queue's hottest code (``benchmarks/core_ops.py``).

Invariants:
  * ``_live[key]`` is in ``_heap`` for every live key; ``len(self)`` counts live keys;
  * ``_heap`` is a ``heapq`` heap; at most ``max(len(_live), COMPACT_MIN)`` of its
    entries are stale.

NOTE 1. Entries are compared as whole tuples: ``version`` is unique, so a comparison
never reaches the key (keys need not be orderable). ``order`` is the key's insertion
number, kept when its priority moves, so equal ``(priority, tie)`` go by insertion as
in a heap updated in place; a key discarded and set again is inserted anew.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

__all__ = ["IndexedHeap"]

COMPACT_MIN = 64


class IndexedHeap(Generic[K]):
    """Min-heap of ``(priority, key)`` with ``set`` / ``discard`` by key in O(log n).

    Equal priorities are ordered by an optional ``tie`` (lower first), then by insertion.
    """

    __slots__ = ("_heap", "_live", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, int, K]] = []
        self._live: dict[K, tuple[float, int, int, int, K]] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._live))

    def priority(self, key: K) -> float:
        return self._live[key][0]

    def set(self, key: K, priority: float, tie: int = 0) -> None:
        """Insert ``key`` or move it to ``(priority, tie)``."""
        old = self._live.get(key)
        self._seq += 1
        if old is None:
            order = self._seq
        elif old[0] == priority and old[1] == tie:
            return
        else:
            order = old[2]
        entry = (priority, tie, order, self._seq, key)
        live, heap = self._live, self._heap
        live[key] = entry
        heapq.heappush(heap, entry)
        # ``_compact``'s condition, inline: this runs for every re-rank.
        if old is not None and len(heap) > 2 * len(live) and len(heap) > 2 * COMPACT_MIN:
            self._compact()

    def discard(self, key: K) -> bool:
        """Remove ``key`` if present; returns whether it was."""
        live = self._live
        if live.pop(key, None) is None:
            return False
        n = len(self._heap)
        if n > 2 * len(live) and n > 2 * COMPACT_MIN:
            self._compact()
        return True

    def peek(self) -> tuple[K, float] | None:
        heap, live = self._heap, self._live
        while heap:
            top = heap[0]
            if live.get(top[4]) is top:
                return top[4], top[0]
            heapq.heappop(heap)
        return None

    def pop(self) -> tuple[K, float]:
        top = self.peek()
        if top is None:
            raise IndexError("pop from an empty IndexedHeap")
        del self._live[top[0]]
        heapq.heappop(self._heap)
        return top

    def _compact(self) -> None:
        """Rebuild from the live entries; callers do so once stale entries outnumber live
        ones (and ``COMPACT_MIN``): ``len(_heap) > 2 · max(len(_live), COMPACT_MIN)``."""
        self._heap = list(self._live.values())
        heapq.heapify(self._heap)
