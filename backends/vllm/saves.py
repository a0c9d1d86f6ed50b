"""A request's saves: its plan, the state blocks it pins, its STOREs' rewrite, their progress.

The vLLM side of HiState's interval control (docs/design.md §2.2, §5.2). For every request the
connector (``connector.HiStateConnector``) stores the attention KV of every chunk but the
recurrent object only at the boundaries the interval controller chose for the request's new
segment, plus the segment's final boundary. This module holds what the connector tracks per
request, from the plan to the moment its last store has its data:

* the plan: :func:`sanitize_plan` (what the connector accepts from a planner),
  :func:`planned_step_end` (where a prefill step must end for it) and :class:`LocalPlanner`
  (the fallback plan: the core's ``IntervalController``, pressure factor 1, when the LMCache
  server has no HiState module);
* the pins: :class:`RequestSaves` with its :class:`StatePin` s, the references the connector
  holds on boundary-state blocks of vLLM's pool;
* the rewrite of one STORE request's block ids (:func:`rewrite_store_block_ids`, returning a
  :class:`StoreRewrite`). It happens on the scheduler side, when the store is planned, i.e.
  before any byte is copied: a chunk whose recurrent block ids are all the null block is
  skipped by LMCache's STORE (``all_null_chunk_masks`` in
  ``lmcache/v1/multiprocess/modules/lmcache_driven_transfer.py``), so a dropped state costs
  no transfer at all;
* the store progress: which of a request's STOREs have their data (:class:`StoreSteps` on the
  worker, :class:`StoreReport` back to the scheduler), which releases the pins.

The vLLM settings these need (prefix caching, align mode, step ends at planned boundaries)
are checked at start by ``connector_config``.

Where the recurrent state of a boundary lives. vLLM ≥ 0.32 in Mamba ``align`` mode hands the
exact block of every retained boundary state to the connector in the step that computes it
(``SchedulerOutput.kv_connector_block_state.boundary_state_offloads``:
``{req_id: [(group_id, block_id, boundary_tokens)]}``). An align-mode block table is not
append-only (interior states are nulled and freed, speculative blocks relocate), so the
connector never resolves a state block by position: a chosen boundary gets the block vLLM
offered for exactly that boundary, or no recurrent object at all.

Segment. A request's new segment is ``[cached prefix end, prompt end)``: the cached prefix is
what the request did not compute (LMCache's hit or vLLM's own prefix-cache hit, whichever is
longer); its states at and below the segment start belong to earlier segments.

Store progress. The connector holds a reference on each boundary-state block it will store
until the STORE carrying it has its data (connector NOTE 1-2). The worker is where that is
known: LMCache's worker adapter keeps, per request, the future of the request's LATEST store
(``LMCacheMPWorkerAdapter.store_futures``, lmcache 0.5.6
``integration/vllm/vllm_multi_process_adapter.py``), replacing it at every new store. After
each step's ``wait_for_save`` submitted the step's stores, :meth:`StoreSteps.submitted`
reads that map and records, per request, each future it has not seen before with the
scheduler step that planned it (the step travels on the connector metadata).
:meth:`StoreSteps.report` drops a request's recorded futures from the oldest while they are
complete, and reports for each request the oldest step whose store is still in flight. The
scheduler then releases the pins of every store planned before that step
(:meth:`RequestSaves.stores_done`); a request absent from the report has every store planned
up to the report's step done.

NOTE 1 (why not "busy while any store is in flight"): a request in prefill submits a store
every step, and ``get_finished`` runs in the same step right after ``wait_for_save``, so the
store just submitted is nearly always still in flight: read that way a request was busy for
its whole prefill and every pin of the prompt stayed held until the prefill ended (on a
32 MiB pool, the blocks that made vLLM preempt where stock LMCache did not).

NOTE 2 (a future LMCache no longer holds): LMCache removes a request's entry only when its
latest store completed, or when it drains all futures after the server became unhealthy;
either way none of the request's stores will report later, so its record is dropped.

Invariants: a pin lives until the store carrying it has its data or no store will carry it
(:class:`StatePin`); for each request the recorded store steps are increasing and each
future is recorded once; a step is reported only while its future is incomplete and LMCache
still tracks the request.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from lmcache_histate.core.interval import IntervalController, supported_intervals

__all__ = [
    "NULL_BLOCK",
    "LocalPlanner",
    "RequestSaves",
    "StatePin",
    "StoreReport",
    "StoreRewrite",
    "StoreSteps",
    "planned_step_end",
    "rewrite_store_block_ids",
    "sanitize_plan",
]

NULL_BLOCK = 0
"""vLLM's null block id, also LMCache's default ``--null-block-id``."""


# ----------------------------------------------------------------------------- plans


def sanitize_plan(
    boundaries: Iterable[int], start_tokens: int, input_tokens: int, chunk: int
) -> list[int]:
    """Chunk-aligned boundaries in ``(start, end]`` plus the final one ``end``.

    ``start`` and ``end`` are ``start_tokens`` / ``input_tokens`` rounded down to the chunk
    grid; empty when the segment has no full chunk.
    """
    start = start_tokens - start_tokens % chunk
    end = input_tokens - input_tokens % chunk
    if end <= start:
        return []
    kept = {int(b) for b in boundaries if start < int(b) <= end and int(b) % chunk == 0}
    kept.add(end)
    return sorted(kept)


def planned_step_end(plan: Sequence[int], start: int, end: int) -> int:
    """The end of a prefill step ``[start, end)`` that must not run past a kept boundary:
    the first boundary of ``plan`` (sorted) strictly inside the step, else ``end``."""
    i = bisect.bisect_right(plan, start)
    return plan[i] if i < len(plan) and plan[i] < end else end


class LocalPlanner:
    """The core's interval controller with pressure factor 1 (no live server pressure)."""

    def __init__(
        self,
        chunk_tokens: int,
        snapshot_tokens: float,
        supported: Sequence[int] | None = None,
        max_interval_chunks: int = 64,
    ) -> None:
        self.chunk_tokens = chunk_tokens
        self.controller = IntervalController(
            chunk_tokens,
            snapshot_tokens,
            supported or supported_intervals(chunk_tokens, max_interval_chunks),
        )

    def plan(self, start_tokens: int, input_tokens: int) -> list[int]:
        return self.controller.boundaries(start_tokens, input_tokens, factor=1.0)


# ------------------------------------------------------------------------- per request


@dataclass
class StatePin:
    """One reference the connector holds on a boundary-state block of vLLM's pool.

    Invariant: a pin lives from the step vLLM offered the block until the STORE that carries
    it has its data (``RequestSaves.stores_done``), or until it is known that no store will
    carry it (``planned`` passed it, ``preempted``, the request finished). It never outlives
    that: a held block is a block vLLM cannot give to another request.
    """

    block_id: int
    boundary: int
    stored_step: int | None = None
    """Scheduler step whose STORE carries this block; None while no store was planned."""


@dataclass
class RequestSaves:
    """What the connector knows about one request's recurrent-state saves."""

    request_id: str
    plan: list[int] | None = None
    """Chosen boundaries (token positions, chunk ends), set at the request's first store."""
    plan_source: str = ""
    segment: tuple[int, int] = (0, 0)
    offered: dict[int, dict[int, int]] = field(default_factory=dict)
    """``boundary_tokens -> {vLLM group id: block id}`` from vLLM's boundary-state hand-offs."""
    pins: list[StatePin] = field(default_factory=list)
    """State blocks this connector holds a reference on (see :class:`StatePin`)."""
    kept: list[int] = field(default_factory=list)
    """Chunk ends whose recurrent object was sent to LMCache."""
    dropped: int = 0
    """Chunks stored without their recurrent object (not chosen)."""
    missing: list[int] = field(default_factory=list)
    """Chosen chunk ends for which vLLM offered no state block (stored without it)."""

    @property
    def untouched(self) -> bool:
        """Nothing was offered, pinned or stored under the current plan yet."""
        return not (self.offered or self.pins or self.kept or self.dropped or self.missing)

    @property
    def pinned(self) -> list[int]:
        """Block ids held now (one entry per reference taken)."""
        return [pin.block_id for pin in self.pins]

    def pin(self, block_id: int, boundary_tokens: int) -> None:
        self.pins.append(StatePin(int(block_id), int(boundary_tokens)))

    def _take(self, leaving: list[StatePin]) -> list[int]:
        if leaving:
            gone = {id(pin) for pin in leaving}
            self.pins = [pin for pin in self.pins if id(pin) not in gone]
        return [pin.block_id for pin in leaving]

    def planned(self, kept: Iterable[int], store_end: int, step: int) -> list[int]:
        """A STORE up to ``store_end`` was planned in scheduler step ``step``.

        Pins at a kept boundary now wait for that store (``stored_step = step``); pins at a
        boundary the store passed without keeping it will never be stored (stores of a
        request are planned in token order) and are returned for release now.
        """
        kept = set(kept)
        leaving = []
        for pin in self.pins:
            if pin.stored_step is not None:
                continue
            if pin.boundary in kept:
                pin.stored_step = step
            elif pin.boundary <= store_end:
                leaving.append(pin)
        return self._take(leaving)

    def stores_done(self, step: int) -> list[int]:
        """The worker reported, at the end of step ``step``, no store of this request in
        flight: every store planned at or before ``step`` has its data (NOTE 2 of the
        connector); their pins are returned for release."""
        return self._take([p for p in self.pins
                           if p.stored_step is not None and p.stored_step <= step])

    def preempted(self) -> list[int]:
        """vLLM preempted the request and freed its blocks: pins whose store was not planned
        yet are returned for release, and every offered block is forgotten (after the
        resume vLLM offers fresh ones; a stale id could name a reused block)."""
        self.offered.clear()
        return self._take([p for p in self.pins if p.stored_step is None])

    def release_all(self) -> list[int]:
        return self._take(list(self.pins))

    def offer(self, group_id: int, block_id: int, boundary_tokens: int) -> bool:
        """Record a hand-off; True if it is new (the caller then pins the block)."""
        groups = self.offered.setdefault(int(boundary_tokens), {})
        if groups.get(group_id) == block_id:
            return False
        groups[group_id] = int(block_id)
        return True


@dataclass(frozen=True)
class StoreRewrite:
    """One STORE's block ids after :func:`rewrite_store_block_ids`, and what it kept.

    Invariant: every chunk end of the store's range is in exactly one of ``kept`` or the
    ``dropped`` count; ``missing`` is the part of the chosen ends not in ``kept``.
    """

    block_ids: list[list[int]]
    """Per engine group, the ids to store: attention groups unchanged, recurrent groups
    with the null block everywhere but at a kept chunk's last slot."""
    kept: list[int]
    """Chunk ends whose recurrent object is stored (chosen and offered in every group)."""
    dropped: int
    """Chunks stored without their recurrent object."""
    missing: list[int]
    """Chosen chunk ends vLLM offered no block for in some recurrent group."""


def rewrite_store_block_ids(
    block_ids: Sequence[Sequence[int]],
    *,
    start: int,
    end: int,
    chunk_tokens: int,
    group_tokens_per_block: Sequence[int],
    recurrent_groups: Sequence[int],
    keep: Iterable[int],
    offered: Mapping[int, Mapping[int, int]],
) -> StoreRewrite:
    """Block ids of one STORE ``[start, end)`` with the recurrent state only at ``keep``.

    ``block_ids[g]`` holds engine group ``g``'s ids for the range (``(end - start) /
    group_tokens_per_block[g]`` of them). Attention groups are returned unchanged. For every
    recurrent group and chunk ``j`` (ending at ``e = start + (j + 1) * chunk_tokens``): if
    ``e`` is kept and vLLM offered a block for ``e`` in *every* recurrent group, the chunk's
    last block slot gets that block and its other slots the null block; otherwise all its
    slots are null, so LMCache stores no recurrent object for the chunk.

    """
    if (end - start) % chunk_tokens or start % chunk_tokens:
        raise ValueError(f"store range [{start}, {end}) is not aligned to {chunk_tokens}")
    keep = set(keep)
    out = [list(ids) for ids in block_ids]
    kept: list[int] = []
    missing: list[int] = []
    dropped = 0
    rec = [g for g in recurrent_groups if g < len(out) and group_tokens_per_block[g] > 0]
    if not rec:
        return StoreRewrite(out, kept, dropped, missing)
    num_chunks = (end - start) // chunk_tokens
    for j in range(num_chunks):
        chunk_end = start + (j + 1) * chunk_tokens
        blocks = offered.get(chunk_end, {})
        use = chunk_end in keep and all(g in blocks for g in rec)
        if chunk_end in keep and not use:
            missing.append(chunk_end)
        if use:
            kept.append(chunk_end)
        else:
            dropped += 1
        for g in rec:
            per_chunk = chunk_tokens // group_tokens_per_block[g]
            lo = j * per_chunk
            for slot in range(lo, lo + per_chunk):
                out[g][slot] = NULL_BLOCK
            if use:
                out[g][lo + per_chunk - 1] = blocks[g]
    return StoreRewrite(out, kept, dropped, missing)


# ------------------------------------------------------------------- store progress


@dataclass(frozen=True)
class StoreReport(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Worker -> scheduler at the end of scheduler step ``step``: for each request with a
    STORE still in flight, the oldest scheduler step whose store has not got its data."""

    step: int
    pending: Mapping[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Tensor-parallel ranks: a store has its data once every rank's copy has it."""
        assert isinstance(other, StoreReport)
        pending = dict(self.pending)
        for request_id, step in other.pending.items():
            pending[request_id] = min(step, pending.get(request_id, step))
        return StoreReport(min(self.step, other.step), pending)

    def done_through(self, request_id: str) -> int:
        """The latest scheduler step up to which every store of ``request_id`` has its data."""
        oldest = self.pending.get(request_id)
        return self.step if oldest is None else oldest - 1


class StoreSteps:
    """Per request, the store futures LMCache handed out and the steps that planned them."""

    def __init__(self) -> None:
        self._inflight: dict[str, deque[tuple[int, Any]]] = {}

    def submitted(self, step: int, store_futures: Mapping[str, Any]) -> None:
        """Record the futures of stores submitted in ``step`` (new objects in LMCache's map)."""
        for request_id, future in store_futures.items():
            queue = self._inflight.setdefault(request_id, deque())
            if not queue or queue[-1][1] is not future:
                queue.append((step, future))

    def report(self, step: int, store_futures: Mapping[str, Any]) -> StoreReport:
        """The report for the end of ``step`` (``store_futures``: LMCache's map, read now)."""
        pending: dict[str, int] = {}
        for request_id, future in store_futures.items():
            if request_id not in self._inflight:
                # Submitted outside wait_for_save: its step is unknown, so it holds every
                # pin of the request until it completes (step 0 precedes any store plan).
                self._inflight[request_id] = deque([(0, future)])
        for request_id in list(self._inflight):
            queue = self._inflight[request_id]
            if request_id not in store_futures:  # NOTE 2
                del self._inflight[request_id]
                continue
            while queue and queue[0][1].query():
                queue.popleft()
            if queue:
                pending[request_id] = queue[0][0]
            else:
                del self._inflight[request_id]
        return StoreReport(step, pending)
