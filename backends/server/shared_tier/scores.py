"""This node's share of the shared tier's ranking, kept current after commit.

An entry of the shared tier is committed with the writing node's ``(C, M)`` of the unit
the object leaves its lowest tier with (``unit_inputs``). Both move afterwards: ``C`` as
sessions come back to the unit or move on, ``M`` as a session's chain grows past it
(a final bundle becomes interior KV and a historical snapshot), and so does ``t`` with
every hit the node serves from its own tiers, which the shared tier never sees (LMCache
asks an L2 tier only for what L1 lacks). A shared disk folder's entries follow through
``shared_index.deployment``; the shared tier's through this part, with the same inputs
and the same script (``SharedIndex.rescore``: ``C`` as this node's share, ``scripts``
NOTE 3; ``t`` moves forward only; ``H`` re-queued):

* ``wrote`` (the runtime's ``shared_route``, under its lock): the object ids sent to the
  shared tier, by node part, each with the ``(t, C, M)`` its header carries: the value
  its entry holds once committed, so the value published (NOTE 2);
* ``committed`` (the shared tier's write, after the index's ``commit``): the ids whose
  entry now exists; until then an id is not collected (NOTE 2). An id that was in the
  tier already holds another write's value: it is sent at the next ``collect``;
* ``collect`` (the janitor tick, under the runtime lock): for at most ``SWEEP_BUDGET``
  parts per tick, in a round over every part written, the core's current ``(t, C, M)``;
  a value whose ``ln(C/M)`` moved by less than ``CHANGED`` from the last one published
  and whose ``t`` did not move is not sent (``deployment`` NOTE 1's rule);
* ``sent`` (the janitor tick, outside the lock): the batch went through ``rescore``; a
  batch that did not (degraded) is collected again.

NOTE 1 (a part the node let go keeps its last share). A shared disk folder's server
withdraws its share when its core lets an object go. The shared tier is where an object
lives after the node let it go: another node resumes from it there. So a part the core
holds nowhere is only dropped from this node's round; its entry keeps the last share
published, and its ``t`` keeps moving with the lookups that read it (``lookup`` script).

NOTE 2 (an id is collected once its entry exists, against the header's value). The
index's ``rescore`` skips an id whose entry is not stored yet, and ``commit`` then writes
the header's value. The write runs on the tier's own threads, so a janitor tick can fall
between ``shared_route`` and the commit: a value collected there would count as
published although nothing held it, and a change the core made in that window (a next
turn retiring the final snapshot the header priced) would reach the entry or not
depending on when the tick ran. So the header's value is the published one from
``wrote`` on (a part that does not change is never sent again), and an id is collected
only after ``committed``: the first value sent is always a move from what the entry holds.

State: the ids per part, the last value published per id and the ids not yet
committed, bounded by what this node's core holds (a part leaves at the round that finds
it gone). Thread-safe (one lock): ``wrote`` runs on the store controller's thread,
``committed`` on the tier's writers, the rest on the janitor's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from lmcache_histate.core.rank import log_ratio

if TYPE_CHECKING:
    from lmcache_histate.core.cache import HiStateCache

__all__ = ["CHANGED", "SWEEP_BUDGET", "SharedScores", "unit_inputs"]

SWEEP_BUDGET = 512
"""Parts whose inputs are recomputed per janitor tick (4 ticks/s)."""
CHANGED = 0.01
"""``ln(C/M)`` moves less than this: not sent again (``deployment`` NOTE 1)."""

Update = tuple[str, float, float, float]
"""``(id, C, M, age)``: ``SharedIndex.rescore``'s argument."""


def unit_inputs(core: HiStateCache, nk: int, part: str) -> tuple[float, float, float] | None:
    """``(t, C, M)`` of the unit ``part`` of node ``nk`` leaves its lowest tier with: what
    the shared tier ranks the object by. None when the core holds it nowhere or it leaves
    with no unit (interior KV of the last tier)."""
    tiers = core.tiers_of(nk, part)
    if not tiers:
        return None
    return core.eviction_inputs(nk, part, tiers.bit_length() - 1)


class SharedScores:
    """The ids this node wrote to the shared tier and the last ``(ln C/M, t)`` published."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: dict[tuple[int, str], list[str]] = {}
        self._published: dict[str, tuple[float, float]] = {}
        self._pending: set[str] = set()
        self._round: list[tuple[int, str]] = []

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)

    def wrote(self, where: tuple[int, str], oid: str,
              score: tuple[float, float, float] | None) -> None:
        """Object ``oid`` of part ``where`` = ``(node key, part)`` goes to the shared tier
        with ``score`` = the ``(t, C, M)`` its header carries (None: none, the entry is
        priced by its size); not collected until ``committed`` (NOTE 2)."""
        with self._lock:
            ids = self._ids.setdefault(where, [])
            if oid not in ids:
                ids.append(oid)
            self._pending.add(oid)
            if score is None:
                self._published.pop(oid, None)
            else:
                self._published[oid] = (log_ratio(score[1], score[2]), score[0])

    def committed(self, stored: Iterable[str], present: Iterable[str] = ()) -> None:
        """The entries of ``stored`` ids now hold their header's value; ``present`` ids
        were in the tier already, with another write's value: sent at the next collect."""
        with self._lock:
            for oid in stored:
                self._pending.discard(oid)
            for oid in present:
                self._pending.discard(oid)
                self._published.pop(oid, None)

    def collect(self, core: HiStateCache, now: float) -> list[Update]:
        """This tick's updates (module docstring), ``now`` on the core's clock."""
        out: list[Update] = []
        with self._lock:
            if not self._round:
                self._round = list(self._ids)
            take = min(SWEEP_BUDGET, len(self._round))
            todo = self._round[len(self._round) - take:]
            del self._round[len(self._round) - take:]
            for where in todo:
                ids = self._ids.get(where)
                if ids is None:
                    continue
                found = unit_inputs(core, *where)
                if found is None:
                    if not core.tiers_of(*where):  # NOTE 1: let go, the entry keeps its share
                        for oid in self._ids.pop(where):
                            self._published.pop(oid, None)
                            self._pending.discard(oid)
                    continue
                t, cost, freed = found
                ratio = log_ratio(cost, freed)
                for oid in ids:
                    if oid in self._pending:  # NOTE 2: no entry to re-score yet
                        continue
                    last = self._published.get(oid)
                    if last is not None and abs(last[0] - ratio) < CHANGED and last[1] == t:
                        continue
                    self._published[oid] = (ratio, t)
                    out.append((oid, cost, freed, max(0.0, now - t)))
        return out

    def sent(self, updates: Sequence[Update], ok: bool) -> None:
        """``updates`` went out (``ok``) or not: those not sent go again next round."""
        if ok or not updates:
            return
        with self._lock:
            for oid, *_ in updates:
                self._published.pop(oid, None)

