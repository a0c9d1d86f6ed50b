"""What a server's runtime tells the deployment, and what it reads back: ``H``, EMAs, sessions.

The disk tier's link (``disk/shared_link.py``) makes the file-level calls; this part makes
the policy-level ones, for the runtime's core, once per janitor tick (never on a
LOOKUP's or a STORE's path), in one pipeline (``SharedIndex.sync``):

* **score inputs** (deployment-wide ``H``): for the objects on the shared disk tier that
  this server's core holds, the core's ``(t, C, M)`` of the unit each object leaves the
  disk with (``HiStateCache.eviction_inputs``), published with ``rescore`` as this
  server's share of ``C`` (``scripts`` NOTE 3) and the age of its last access. Only
  changed values go out (NOTE 1); a sweep covers ``SWEEP_BUDGET`` nodes per tick, nodes
  the core just changed or a LOOKUP just refreshed (refresh-all) first. An object that
  left this core's disk view is published with a zero share (this server's sessions no
  longer need it);
* **residence samples**: every object leaving this server's cache for good (dropped
  from its CPU tier; files leave the deployment through ``drop``, which feeds the same
  EMAs) is one sample of ``kv`` or ``state`` (``observe``), so the deployment EMAs pool
  every server's evictions;
* **session starts**: each session that began a request here since the last tick, with
  its final snapshot's id (``session``): the deployment's re-access gap EMA (``tau`` of
  the ranking in Redis with ``tau: auto``) and the sessions' owners;
* and it reads the deployment EMAs back: the core's interval controller plans with the
  pooled ``T_KV`` / ``T_state`` (``HiStateCache.follow_residence``), so pressure seen
  by any server changes every server's intervals. While Redis is unreachable the last
  values read stay in effect and samples queue (bounded, ``MAX_QUEUED``).

Interior KV of the disk tier (a KV chunk with snapshots below it) leaves the disk with no
unit: the core drops it only after every unit below it (``rank.unit_nodes``). It is
published with ``C/M = PROTECTED_RATIO`` (``ln`` = 20.7: it goes after any unit unless it
is more than 20.7 re-access scales older), and re-published as soon as the units below
it left and it became a tail.

NOTE 1 (what counts as changed): ``H`` moves with ``ln(C/M)`` and with ``t``; a share
whose ``C/M`` moved by less than 1 % (``ln`` by 0.01, i.e. 0.01·τ seconds of ``H``) and
whose last access did not move is not sent again.

State owned here (callers hold the runtime lock for ``collect`` / ``apply`` / ``placed``;
``sync`` runs outside it): the last published value per object id, the sweep in progress,
the queued samples and session starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmcache_histate.core.rank import MIN_RATIO, log_ratio
from lmcache_histate.core.tiers import KV, SNAPSHOT, ServerTier

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey

    from lmcache_histate.core.cache import HiStateCache, PlacementEvent

    from .index import SharedIndex

__all__ = ["PROTECTED_RATIO", "SWEEP_BUDGET", "DeploymentSync", "SyncBatch"]

DISK = ServerTier.DISK
SWEEP_BUDGET = 512
"""Nodes whose score inputs are recomputed per janitor tick (4 ticks/s)."""
MAX_QUEUED = 4096
"""Residence samples and session starts kept while Redis is unreachable."""
PROTECTED_RATIO = 1.0 / MIN_RATIO
"""``C/M`` published for interior KV of the disk tier (module docstring)."""
_CHANGED = 0.01  # NOTE 1


@dataclass(slots=True)
class SyncBatch:
    """One tick's exchange, collected under the runtime lock and sent outside it."""

    samples: list[tuple[str, float]] = field(default_factory=list)
    updates: list[tuple[str, float, float, float]] = field(default_factory=list)
    sessions: list[tuple[str, str, int]] = field(default_factory=list)


class DeploymentSync:
    """The runtime's policy-level exchange with the shared index (module docstring).

    ``keys_of(node key, part)`` gives the part's object keys, ``id_of(key)`` an object's
    index id (the digest naming its file), ``clock()`` the runtime's time.
    """

    def __init__(
        self,
        keys_of: Callable[[int, str], list[ObjectKey]],
        id_of: Callable[[ObjectKey], str],
        clock: Callable[[], float],
    ) -> None:
        self._keys_of = keys_of
        self._id_of = id_of
        self._clock = clock
        self._published: dict[str, tuple[float, float]] = {}  # id -> (ln(C/M), t)
        self._sweep: list[int] = []
        self._touched: set[int] = set()
        self._samples: list[tuple[str, float]] = []
        self._withdrawn: set[str] = set()  # ids whose share goes to 0
        self._begun: dict[str, None] = {}
        self._recoveries = -1
        self.stats: dict[str, int] = {"published": 0, "samples": 0, "sessions": 0,
                                      "syncs": 0}

    # ------------------------------------------------- placement events (observer)
    def placed(self, events: Iterable[PlacementEvent]) -> None:
        """The core's placement events, as the runtime drains them (``TierActions``
        NOTE 2: the parts' objects are still in the object map). Every event touches its
        node; a part that left the disk is withdrawn, one that left every tier but the
        disk is a residence sample."""
        for event in events:
            self._touched.add(event[1])
            if event[0] != "dropped":
                continue
            _, nk, part, tiers, _nbytes, held, since, _access, _alone = event
            if tiers & (1 << DISK):
                self._withdrawn.update(self._id_of(key) for key in self._keys_of(nk, part))
            elif tiers == held and len(self._samples) < MAX_QUEUED:
                name = "kv" if part == KV else "state"
                self._samples.append((name, max(0.0, self._clock() - since)))

    # ------------------------------------------------------------- requests
    def began(self, sid: str, chain: Iterable[int] = ()) -> None:
        """A request of session ``sid`` began here (LOOKUP) on ``chain``: told at the next
        tick, with the accesses the core just gave the chain's nodes (refresh-all)."""
        if len(self._begun) < MAX_QUEUED:
            self._begun[sid] = None
            self._touched.update(chain)

    # ------------------------------------------------------------- the tick
    def collect(self, core: HiStateCache, nodes: Callable[[], Iterable[int]], chunk: int,
                recoveries: int) -> SyncBatch:
        """This tick's batch (under the runtime lock). ``nodes``: every node key holding
        objects (a new sweep starts from them when the last one ended); ``recoveries``:
        the connection's count, whose change (Redis came back, maybe empty) re-publishes
        everything."""
        if recoveries != self._recoveries:
            self._recoveries = recoveries
            self._published.clear()
        now = self._clock()
        batch = SyncBatch(self._samples, [], [])
        self._samples = []
        for oid in self._withdrawn:
            self._published.pop(oid, None)
            batch.updates.append((oid, 0.0, -1.0, -1.0))  # M unchanged
        self._withdrawn = set()
        if not self._sweep:
            self._sweep = list(nodes())
        todo = list(self._touched)
        self._touched = set()
        take = min(SWEEP_BUDGET, len(self._sweep))
        todo += self._sweep[len(self._sweep) - take :]
        del self._sweep[len(self._sweep) - take :]
        for nk in dict.fromkeys(todo):
            for part in (KV, SNAPSHOT):
                self._inputs(core, nk, part, now, batch.updates)
        for sid in self._begun:
            batch.sessions.append(_session_end(core, sid, chunk, self._keys_of, self._id_of))
        self._begun = {}
        return batch

    def score_of(self, core: HiStateCache, nk: int, part: str) -> tuple[float, float] | None:
        """``(C, M)`` to commit a part's object with (the disk tier's ``score_of``):
        what ``collect`` would publish for it; None when the core holds it on no disk."""
        found = _disk_inputs(core, nk, part)
        return None if found is None else (found[1], found[2])

    def _inputs(self, core: HiStateCache, nk: int, part: str, now: float,
                out: list[tuple[str, float, float, float]]) -> None:
        found = _disk_inputs(core, nk, part)
        if found is None:
            return
        t, cost, freed = found
        ratio = log_ratio(cost, freed)
        for key in self._keys_of(nk, part):
            oid = self._id_of(key)
            last = self._published.get(oid)
            if last is not None and abs(last[0] - ratio) < _CHANGED and last[1] == t:
                continue
            self._published[oid] = (ratio, t)
            out.append((oid, cost, freed, max(0.0, now - t)))

    def sync(self, index: SharedIndex, batch: SyncBatch) -> dict[str, float] | None:
        """Send the batch, read the deployment EMAs (outside the runtime lock). On a
        failure the samples and session starts are queued again for the next tick."""
        emas = index.sync(batch.samples, batch.updates, batch.sessions)
        if emas is None:
            self._samples = (batch.samples + self._samples)[:MAX_QUEUED]
            for sid, _, _ in batch.sessions:
                self.began(sid)
            self._withdrawn.update(u[0] for u in batch.updates if u[2] < 0)
            self._recoveries = -1  # re-publish everything once Redis answers
            return None
        self.stats["syncs"] += 1
        self.stats["published"] += len(batch.updates)
        self.stats["samples"] += len(batch.samples)
        self.stats["sessions"] += len(batch.sessions)
        return emas

    @staticmethod
    def apply(core: HiStateCache, emas: dict[str, float]) -> float:
        """The core's interval controller follows the deployment EMAs (under the lock);
        returns the pressure factor in effect."""
        return core.follow_residence(
            emas.get("kv", 0.0), int(emas.get("kv_n", 0)),
            emas.get("state", 0.0), int(emas.get("state_n", 0)),
        )

    def status(self) -> dict[str, Any]:
        return dict(self.stats)


def _disk_inputs(core: HiStateCache, nk: int, part: str) -> tuple[float, float, float] | None:
    """``(t, C, M)`` of a part the core holds on the disk (interior KV: protected)."""
    if not (core.tiers_of(nk, part) >> DISK) & 1:
        return None
    found = core.eviction_inputs(nk, part, DISK)
    if found is not None:
        return found
    node = core.node(nk)
    return (0.0 if node is None else node.access), PROTECTED_RATIO, 1.0


def _session_end(
    core: HiStateCache, sid: str, chunk: int,
    keys_of: Callable[[int, str], list[ObjectKey]], id_of: Callable[[ObjectKey], str],
) -> tuple[str, str, int]:
    """``(sid, id of its final snapshot object or "", its end in tokens)``."""
    nk = core.session_end(sid)
    node = None if nk is None else core.node(nk)
    if nk is None or node is None:
        return sid, "", 0
    keys = keys_of(nk, SNAPSHOT)
    return sid, (id_of(keys[0]) if keys else ""), (node.depth + 1) * chunk
