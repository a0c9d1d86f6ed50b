"""An addressable binary min-heap: the priority queue behind every eviction decision.

Eviction ranks change constantly (each access refreshes timestamps, each insert shifts
neighbouring costs), so the queue must support O(log n) update and removal by key, not
only push/pop. Ties are broken by a monotonically increasing sequence number so that the
order is deterministic for a given sequence of operations.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

__all__ = ["IndexedHeap"]


class IndexedHeap(Generic[K]):
    """Min-heap of ``(priority, key)`` with O(log n) ``set`` / ``remove`` by key.

    Equal priorities are ordered by an optional ``tie`` (lower first), then by insertion.

    Invariants:
      * ``self._pos[key]`` is the index of ``key`` in ``self._heap``;
      * every entry's ``(priority, tie, seq)`` is ≤ its children's.

    NOTE 1. Entries are compared as whole ``(priority, tie, seq, key)`` tuples: ``seq``
    is unique, so a comparison never reaches the key (keys need not be orderable), and
    no slice is built per comparison (the sifts are the queue's hottest loop).
    """

    __slots__ = ("_heap", "_pos", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, K]] = []
        self._pos: dict[K, int] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, key: object) -> bool:
        return key in self._pos

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._pos))

    def priority(self, key: K) -> float:
        return self._heap[self._pos[key]][0]

    def set(self, key: K, priority: float, tie: int = 0) -> None:
        """Insert ``key`` or move it to ``(priority, tie)``."""
        i = self._pos.get(key)
        if i is None:
            self._seq += 1
            self._heap.append((priority, tie, self._seq, key))
            self._pos[key] = len(self._heap) - 1
            self._sift_up(len(self._heap) - 1)
            return
        entry = self._heap[i]
        new = (priority, tie, entry[2], key)
        if entry[0] == priority and entry[1] == tie:
            return
        self._heap[i] = new
        if new < entry:
            self._sift_up(i)
        else:
            self._sift_down(i)

    def discard(self, key: K) -> bool:
        """Remove ``key`` if present; returns whether it was."""
        i = self._pos.pop(key, None)
        if i is None:
            return False
        last = self._heap.pop()
        if i < len(self._heap):
            self._heap[i] = last
            self._pos[last[3]] = i
            self._sift_up(i)
            self._sift_down(self._pos[last[3]])
        return True

    def peek(self) -> tuple[K, float] | None:
        if not self._heap:
            return None
        pri, _, _, key = self._heap[0]
        return key, pri

    def pop(self) -> tuple[K, float]:
        if not self._heap:
            raise IndexError("pop from an empty IndexedHeap")
        pri, _, _, key = self._heap[0]
        self.discard(key)
        return key, pri

    def _sift_up(self, i: int) -> None:
        heap, pos = self._heap, self._pos
        item = heap[i]
        while i > 0:
            parent = (i - 1) >> 1
            if heap[parent] <= item:
                break
            heap[i] = heap[parent]
            pos[heap[i][3]] = i
            i = parent
        heap[i] = item
        pos[item[3]] = i

    def _sift_down(self, i: int) -> None:
        heap, pos = self._heap, self._pos
        n = len(heap)
        item = heap[i]
        while True:
            child = 2 * i + 1
            if child >= n:
                break
            right = child + 1
            if right < n and heap[right] < heap[child]:
                child = right
            if item <= heap[child]:
                break
            heap[i] = heap[child]
            pos[heap[i][3]] = i
            i = child
        heap[i] = item
        pos[item[3]] = i
