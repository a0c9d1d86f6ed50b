"""Which of a request's STOREs have their data: tracked by the worker, reported each step.

The connector holds a reference on each boundary-state block it will store until the STORE
carrying it has its data (connector NOTE 1-2). The worker is where that is known: LMCache's
worker adapter keeps, per request, the future of the request's LATEST store
(``LMCacheMPWorkerAdapter.store_futures``, lmcache 0.5.6
``integration/vllm/vllm_multi_process_adapter.py``), replacing it at every new store.

Algorithm. After each step's ``wait_for_save`` submitted the step's stores,
:meth:`StoreSteps.submitted` reads that map and records, per request, each future it has not
seen before with the scheduler step that planned it (the step travels on the connector
metadata). :meth:`StoreSteps.report` drops a request's recorded futures from the oldest while
they are complete, and reports for each request the oldest step whose store is still in
flight. The scheduler then releases the pins of every store planned before that step; a
request absent from the report has every store planned up to the report's step done.

NOTE 1 (why not "busy while any store is in flight"): a request in prefill submits a store
every step, and ``get_finished`` runs in the same step right after ``wait_for_save``, so the
store just submitted is nearly always still in flight: read that way a request was busy for
its whole prefill and every pin of the prompt stayed held until the prefill ended (on a
32 MiB pool, the blocks that made vLLM preempt where stock LMCache did not).

NOTE 2 (a future LMCache no longer holds): LMCache removes a request's entry only when its
latest store completed, or when it drains all futures after the server became unhealthy;
either way none of the request's stores will report later, so its record is dropped.

Invariants: for each request the recorded steps are increasing and each future is recorded
once; a step is reported only while its future is incomplete and LMCache still tracks the
request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

__all__ = ["StoreReport", "StoreSteps"]


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
