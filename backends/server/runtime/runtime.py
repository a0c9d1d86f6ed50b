"""The HiState runtime: the pure policy core driven by what an ``lmcache server`` sees.

One ``HiStateRuntime`` lives in the server process. The launcher builds it and hands it to
LMCache once, bound into the two policy factories LMCache calls (``policies.install``);
every other part reaches it through what LMCache built, never through a module global:

* the server module (``server_module.py``) finds it as the store policy of the server
  context's storage manager (``policies.runtime_of``), hands it the context
  (``attach_server``, which also attaches the HiState disk tier found among the storage
  manager's L2 adapters) and reports each LOOKUP (refresh-all, pins, hit counters), STORE
  (the request's ordered chunk-hash chain: positions and parents of the objects about to be
  committed) and END_SESSION;
* LMCache's L1 manager tells it of every object committed to L1 the moment the write
  finishes (``CommitListener``, registered by ``attach_server``); the store policy
  (``policies.HiStateStorePolicy``) hands the same objects over later, from the store
  controller's thread, and asks where they go (NOTE 3); after a disk write it asks which
  may leave L1;
* the L1 eviction policy (``policies.HiStateL1EvictionPolicy``) reports L1 removals and
  asks for victims when LMCache's eviction loop finds L1 above its watermark;
* the disk tier (``disk.tier.HiStateDiskAdapter``) is told the header of every write the
  runtime decides (``TierActions.run``, before the write is submitted) and queues what
  its I/O threads saw (``DiskReport``: writes done or failed, files lost, capacity
  changed) for the runtime to drain under its lock (``TierActions.drain``). It never
  calls the runtime.

Its verbs, named by who calls them: ``on_<event>`` for what LMCache saw (``on_store``,
``on_lookup``, ``on_end_session``, ``on_committed``, ``on_persisted``,
``on_l1_committed``, ``on_l1_removed``); a plain verb for what a caller asks of it
(``plan``, ``status``, ``evict_cpu``, ``tick``, ``check``, and the reads
``is_cpu_tracked``, ``cpu_used_bytes``); ``attach_server`` / ``start_janitor`` /
``close`` for its wiring.

The runtime is composed of parts, each owning its state, built here with what it needs:

* ``ModelCore`` (``model_core``): the one ``HiStateCache`` (tier 0 = CPU = LMCache L1,
  tier 1 = disk), created for the first hybrid model seen, and its object identity;
* ``ObjectMap`` (``object_map``): node part <-> ``ObjectKey``, chunk positions and STORE
  records along request chains, and committed objects placed by the core;
* ``SessionTracker`` (``sessions``): requests in flight and sessions;
* ``TierActions`` (``tier_actions``): the core's placement events turned into L1 / disk
  actions, and L1 / disk losses reported back;
* ``CpuEvictor`` (``cpu_eviction``): L1 victims by lowest ``H``, re-rank sweeps;
* ``recover_from_disk`` (``recovery``) and ``StatusReport`` (``reporting``);
* with a shared disk tier (``shared_index``), ``DeploymentSync``
  (``shared_index/deployment``): the core's score inputs, residence samples and session
  starts published, and the deployment's EMAs read back, once per janitor tick.

Locking: ``self.lock`` guards the core and every part. It is never held while calling
into LMCache's L1 manager or waiting on disk I/O: each entry point that changes the core
runs inside ``TierActions.step`` (lock → drain the queued L1 removals and disk reports →
the parts → take the collected ``Actions`` → release → run them), the one place that
sequence is written. Callbacks that LMCache makes while holding its own L1 lock
(``on_l1_removed``) only append to a queue, as the disk tier's I/O threads do with their
reports; the janitor's tick drains both too, so none waits longer than a tick. The runtime
calls the disk tier (``expect_headers``, ``delete``, ``write_objects``) only with
``self.lock`` released, and no disk I/O thread ever takes it.

NOTE 1 (events are stamped under the lock). The core assumes its clock never runs back
(a session's re-access gap is ``now − last access``; a negative one is clamped to 0). An
entry point that read the clock before taking the lock could apply its event after a
later-stamped one from another thread (LMCache serves stores and lookups on different
threads), and a session's re-access gap would come out negative: a lone negative gap
calibrates ``τ`` to exactly 0. So every ``now`` is read once the lock is held, and events
reach the core in the order of their stamps.

NOTE 2 (finding the disk tier). LMCache builds the disk tier from ``--l2-adapter`` with
its config only, before any server module exists, and exposes no public list of a storage
manager's L2 adapters in 0.5.6; ``attach_server`` reads ``_l2_adapters`` (as it reads
``_l1_manager``). A stock ``lmcache server`` attaches nothing: the tier then has no
driver: it queues no reports and writes the ``UNKNOWN_META`` header.

NOTE 3 (commits are placed when first seen). LMCache serves a LOOKUP from every object in
L1, but hands committed objects to the store policy later, on its store controller's
thread (``StoreListener`` queues them, the controller's loop calls
``select_store_targets``; lmcache 0.5.6 ``storage_controllers/store_controller.py``). A
LOOKUP arriving in between (an agent's next turn right after the last one's store, or any
turn while the controller is busy submitting disk writes) would hit objects the core does
not know: no hit counted, nothing refreshed or pinned. So the L1 manager's write-finished
callback (``CommitListener``, run under LMCache's L1 lock) only queues the keys, and both
a LOOKUP and the store policy's hand-off place every queued commit first
(``_place_commits``). The route decided for each key (to disk or not) waits in
``_routes`` until the store controller asks for it. Both listeners are called one after
the other in the same ``finish_write``, so a hand-off can come in the instant before our
callback queues the same keys: ``on_committed`` then waits up to ``COMMIT_WAIT_S`` for
them, and places any still missing itself (``_direct`` then skips their queued copy).
What is left is a LOOKUP that overlaps the STORE's own commit: LMCache commits from a
stream callback after the STORE has answered, and serves a LOOKUP from a prefetch task,
so a LOOKUP sent while the copy is still running can be served objects committed after
our hook ran (a window of one copy, where the store controller's was unbounded).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lmcache.v1.distributed.internal_api import L1ManagerListener

from lmcache_histate.config import HiStateConfig
from lmcache_histate.core.cache import HiStateCache
from lmcache_histate.core.tiers import ServerTier

from ..disk.entries import ObjectMeta
from ..disk.shared_link import SharedIndexLink, key_id
from ..disk.tier import HiStateDiskAdapter
from ..shared_index.deployment import DeploymentSync
from ..shared_tier.plan import to_shared
from ..shared_tier.scores import unit_inputs
from ..shared_tier.tier import HiStateSharedAdapter
from .cpu_eviction import RERANK_BUDGET, CpuEvictor
from .model_core import ModelCore
from .object_map import ObjectMap, node_key
from .recovery import recover_from_disk
from .reporting import StatusReport
from .sessions import SessionTracker
from .tier_actions import TierActions, take_one

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey

logger = logging.getLogger("lmcache_histate.runtime")

__all__ = ["CommitListener", "HiStateRuntime"]

# How long a hand-off waits for ``CommitListener`` to queue its keys (NOTE 3): the callback
# is one call away under the same L1 lock, so it is microseconds unless the host stalls.
COMMIT_WAIT_S = 0.05


class HiStateRuntime:
    """The HiState policy core wired to one LMCache server process (see module doc)."""

    def __init__(self, cfg: HiStateConfig, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.clock = clock
        self.lock = threading.RLock()
        self.stats: Counter[str] = Counter()
        self.model = ModelCore(cfg, self.stats)
        self.objects = ObjectMap(self.model, self.stats)
        self.deployment = DeploymentSync(self.objects.keys, key_id, clock)
        self.actions = TierActions(self.lock, self.model, self.objects, self.deployment,
                                   self.stats, clock)
        self.sessions = SessionTracker(cfg, self.model, self.objects, self.stats)
        self.evictor = CpuEvictor(cfg.end_probability_prior, self.stats)
        self.report = StatusReport(
            cfg, self.model, self.sessions, self.objects, self.actions, self.stats
        )
        self.ctx: Any = None
        # NOTE 3: commits queued by ``CommitListener``, routes decided for them before the
        # store controller asked, and keys it placed before their queued copy arrived.
        self._commits: deque[list[ObjectKey]] = deque()
        self._routes: dict[ObjectKey, bool] = {}
        self._direct: Counter[ObjectKey] = Counter()
        self._listening = False
        self._stop = threading.Event()
        self._janitor: threading.Thread | None = None
        self.shared_tier: HiStateSharedAdapter | None = None
        """The shared tier among the server's L2 adapters (``attach_server``), or None."""

    @property
    def core(self) -> HiStateCache | None:
        """The policy core, once the model's layout is known (None before)."""
        return self.model.core

    # ================================================================ wiring
    def _drive_disk_tier(self, disk: HiStateDiskAdapter) -> None:
        """Drive ``disk``: its writes, deletes and demotions follow the core, and its
        reports are drained at each step (``attach_server`` calls it with the server's)."""
        self.actions.disk = disk
        disk.start_reports()
        if disk.shared is not None:  # one disk folder for the deployment
            # It sees each placement event too (``CoreListener.observers``).
            self.actions.listener.observers.append(self.deployment)

    def _shared(self) -> SharedIndexLink | None:
        disk = self.actions.disk
        return None if disk is None else disk.shared

    def attach_server(self, ctx: Any) -> None:
        """Called by the server module once the server context exists; ``start_janitor``
        then runs ``tick`` in the background."""
        self.ctx = ctx
        sm = ctx.storage_manager
        # LMCache 0.5.6 exposes no public per-key L1 delete/read-lock API on the storage
        # manager (delete_l1_keys returns counts only); the single L1 manager is needed
        # for per-key results and for read-locking objects while they are demoted.
        l1 = getattr(sm, "_l1_manager", None)
        if l1 is None or not callable(getattr(l1, "delete", None)):
            raise RuntimeError("HiState needs LMCache's single-L1 storage manager (0.5.6)")
        self.actions.l1 = l1
        if not self._listening and callable(getattr(l1, "register_listener", None)):
            l1.register_listener(CommitListener(self))  # NOTE 3
            self._listening = True
        # NOTE 2: the disk tier LMCache built from ``--l2-adapter``, among its L2 adapters.
        disks = [a for a in dict(getattr(sm, "_l2_adapters", None) or {}).values()
                 if isinstance(a, HiStateDiskAdapter)]
        if disks and self.actions.disk is None:
            self._drive_disk_tier(disks[0])
        shared = [a for a in dict(getattr(sm, "_l2_adapters", None) or {}).values()
                  if isinstance(a, HiStateSharedAdapter)]
        if shared:
            self.shared_tier = shared[0]
        if ctx.chunk_size != self.model.chunk:
            logger.warning(
                "server chunk size %d differs from the configuration's %d; using %d",
                ctx.chunk_size, self.model.chunk, ctx.chunk_size,
            )
            self.model.chunk = ctx.chunk_size

    def start_janitor(self) -> None:
        """Run ``tick`` every 0.25 s on a daemon thread until ``close`` (once)."""
        if self._janitor is None:
            self._janitor = threading.Thread(target=self._janitor_loop, name="histate-janitor",
                                             daemon=True)
            self._janitor.start()

    def close(self) -> None:
        self._stop.set()
        if self._janitor is not None:
            self._janitor.join(timeout=5)

    def _core_for(self, model_name: str, world_size: int) -> HiStateCache | None:
        """The core for this model (under the lock); made, and recovered from the disk
        tier's files, the first time a hybrid model is seen."""
        disk = self.actions.disk
        if self.model.core is not None:  # made: this model's, or another model's objects
            return self.model.ensure(self.ctx, model_name, world_size, 0, self.actions.listener)
        capacity = disk.capacity_bytes() if disk is not None else self.cfg.disk_bytes
        core = self.model.ensure(self.ctx, model_name, world_size, capacity,
                                 self.actions.listener)
        if core is not None and disk is not None:
            recover_from_disk(disk, self.model, self.objects, self.stats, self.clock())
        return core

    # ============================================================ server module
    def on_store(self, key: Any) -> None:
        """STORE received (before its objects are committed): record the chain."""
        if self.ctx is None:
            return
        chunk = self.model.chunk
        end = min(key.end, len(key.token_ids))
        end -= end % chunk
        if end <= 0:
            return
        # LMCache resolves the STORE's keys through the request's session right after this
        # (engine_context.resolve_obj_keys); hashing through it computes each hash once.
        session = self.ctx.session_manager.get_or_create(key.request_id)
        session.set_tokens(list(key.token_ids))
        hashes = [self.ctx.token_hasher.hash_to_bytes(h) for h in session.get_hashes(0, end)]
        with self.lock:
            self.sessions.record_store(key, hashes)

    def on_lookup(self, key: Any) -> None:
        """LOOKUP received: refresh-all on the hit prefix, pin it, count the hit. Objects
        committed to L1 but not handed over yet are placed first (NOTE 3)."""
        if self.ctx is None:
            return
        chunk = self.model.chunk
        end = min(key.end, len(key.token_ids))
        end -= end % chunk
        hashes = _chain_hashes(self.ctx, key.token_ids, end) if end > 0 else []
        with self.actions.step():
            now = self.clock()  # under the lock: NOTE 1
            core = self._core_for(key.model_name, key.world_size)
            if core is not None:
                self._place_commits(core, now)
            chain = self.objects.link_chain(hashes, key.cache_salt, None)
            if core is None or not chain:
                return
            self.sessions.lookup(core, key, chain, now)
            if self._shared() is not None:  # told to the deployment at the next tick
                self.deployment.began(self.sessions.requests[key.request_id].sid or "", chain)

    def on_end_session(self, request_id: str) -> None:
        with self.actions.step():
            self.sessions.end_request(self.model.core, request_id)

    def plan(
        self, start_tokens: int, input_tokens: int, step_tokens: int | None = None,
        step_price: float | None = None,
    ) -> list[int]:
        """Token positions whose states HiState wants saved for a new segment, on the step
        grid the engine reports (``step_tokens``; None keeps the grid it has) at the step
        price it measured (``step_price``; None keeps the price it has)."""
        with self.lock:
            core = self.model.core
            if core is None:
                return []
            grid = core.step_grid if step_tokens is None else step_tokens
            if grid != core.step_grid or step_price is not None:
                core.set_step_grid(grid, step_price)
            return core.snapshot_plan(start_tokens, input_tokens)

    def status(self) -> dict[str, Any]:
        with self.lock:
            out = self.report.status()
            if self._shared() is not None:  # the janitor's exchange with the deployment
                out["deployment_sync"] = self.deployment.status()
        if self.shared_tier is not None:  # its own lock; never under the runtime's
            out["shared_tier"] = self.shared_tier.report_status()
        return out

    # ============================================================ store policy
    def on_committed(self, keys: Sequence[ObjectKey]) -> set[ObjectKey]:
        """Objects committed to L1, handed over by the store controller: placed now unless
        a LOOKUP placed them first (NOTE 3); returns the keys to write to disk."""
        if not keys or self.ctx is None:
            return set()
        deadline = time.monotonic() + COMMIT_WAIT_S
        while True:
            with self.actions.step():  # the routed writes' headers go down as it ends
                now = self.clock()  # under the lock: NOTE 1
                core = self._core_for(keys[0].model_name, keys[0].kv_rank >> 24 or 1)
                own = self.model.core
                if own is not None:
                    self._place_commits(own, now)
                else:  # no hybrid model yet: nothing queued is ours
                    self._commits.clear()
                unseen = [k for k in keys if k not in self._routes]
                if not unseen or not self._listening or time.monotonic() >= deadline:
                    return self._hand_over(core, keys, unseen, now)
            time.sleep(0.001)  # the listener is queuing them (NOTE 3)

    def _hand_over(self, core: HiStateCache | None, keys: Sequence[ObjectKey],
                   unseen: list[ObjectKey], now: float) -> set[ObjectKey]:
        """The route of a hand-off's ``keys`` (under the lock): decided earlier for the ones
        already placed, now for the ``unseen`` ones."""
        route = {k for k in keys if self._routes.pop(k, False)}
        if not unseen:
            return route
        if self._listening:  # their queued copies are still to come: skip those
            self.stats["commits.unseen"] += len(unseen)
            self._direct.update(unseen)
        if core is None:
            return route
        return route | self.objects.place(core, unseen, now, self.sessions, self.actions)

    def _place_commits(self, core: HiStateCache, now: float) -> None:
        """Place every commit ``CommitListener`` queued (under the lock), keeping each
        key's route for the store controller's hand-off (NOTE 3)."""
        batch: list[ObjectKey] = []
        while self._commits:
            batch.extend(k for k in self._commits.popleft() if not take_one(self._direct, k))
        if not batch:
            return
        route = self.objects.place(core, batch, now, self.sessions, self.actions)
        self.stats["commits.queued"] += len(batch)
        for key in batch:
            self._routes[key] = key in route

    def on_l1_committed(self, keys: list[ObjectKey]) -> None:
        """Called by LMCache under its L1 lock when writes finish: queue only (NOTE 3)."""
        if keys:
            self._commits.append(list(keys))

    def resumable(self, token_ids: Sequence[int], cache_salt: str = "") -> dict[str, Any]:
        """How much of a prompt this node resumes from its own tiers (``routing_api``):
        ``resumable_tokens`` at the deepest boundary with a snapshot within the KV prefix
        the core holds, ``kv_tokens`` the KV prefix alone."""
        shared = self.shared_tier
        out: dict[str, Any] = {
            "instance": None if shared is None else shared.config.tier.instance,
            "chunk_tokens": self.model.chunk, "kv_tokens": 0, "resumable_tokens": 0,
            "shared_tier": None if shared is None else (
                "degraded" if shared.degraded else "connected"),
        }
        chunk = self.model.chunk
        end = len(token_ids) - len(token_ids) % chunk
        if self.ctx is None or end <= 0:
            return out
        hashes = _chain_hashes(self.ctx, token_ids, end)
        keys = [node_key(h, cache_salt) for h in hashes]
        with self.lock:
            core = self.model.core
            if core is None:
                return out
            match = core.lookup(keys)
        out["kv_tokens"] = match.kv_chunks * chunk
        out["resumable_tokens"] = match.hit_chunks * chunk
        return out

    def shared_route(self, keys: Sequence[ObjectKey], route: set[ObjectKey]) -> list[ObjectKey]:
        """Which committed ``keys`` go to the shared tier: of those the core holds (kept
        or routed to disk, ``route``), what ``shared_tier.plan.to_shared`` picks — every
        KV chunk and the snapshots at a session's end. Their headers go to the shared
        tier before the store controller submits the write (a snapshot is final when it
        ends the request whose STORE carried it: an interval STORE ends inside the
        request), with the core's ``(C, M)``
        of the unit each leaves its lowest tier with (``shared_tier.scores``: re-scored
        at every janitor tick after that)."""
        shared = self.shared_tier
        if shared is None:
            return []
        out: list[ObjectKey] = []
        metas: dict[ObjectKey, ObjectMeta] = {}
        with self.lock:
            core = self.model.core
            for key in keys:
                where = self.objects.where(key)
                if core is None or where is None or not self.model.ours(key):
                    continue
                if not (key in route or self.objects.key_tiers(key)):
                    continue
                link = self.objects.link_of(key)
                final = (link is not None and link.record is not None
                         and link.depth + 1 == link.record.request_chunks)
                if to_shared(where[1], final=final):
                    out.append(key)
                    found = unit_inputs(core, *where)
                    metas[key] = ObjectMeta(*self.objects.object_meta(key),
                                            score=None if found is None else found[1:])
                    shared.scores.wrote(where, key_id(key))
        shared.expect_headers(metas)
        self.stats["shared_tier.routed"] += len(out)
        return out

    def _rescore_shared(self, shared: HiStateSharedAdapter) -> None:
        """The janitor's re-scoring of what this node wrote to the shared tier
        (``shared_tier.scores``): collected under the lock, sent outside it."""
        with self.lock:
            core = self.model.core
            updates = [] if core is None else shared.scores.collect(core, self.clock())
        shared.rescore(updates)

    def on_persisted(self, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        """Objects written to disk by the store controller: those not kept on the CPU tier
        leave L1 now (``TierActions.on_persisted``)."""
        return self.actions.on_persisted(keys)

    # ======================================================= L1 eviction policy
    def on_l1_removed(self, keys: list[ObjectKey]) -> None:
        """Called by LMCache under its L1 lock: queue only."""
        self.actions.on_l1_removed(keys)

    def is_cpu_tracked(self, key: ObjectKey) -> bool:
        return self.objects.is_cpu_tracked(key)

    def cpu_used_bytes(self) -> int:
        core = self.model.core
        return 0 if core is None else core.stats().used_bytes[ServerTier.CPU]

    def evict_cpu(self, need_bytes: int) -> int:
        """Push units out of the CPU tier by lowest H until ``need_bytes`` are freed."""
        with self.actions.step():
            now = self.clock()  # under the lock: NOTE 1
            core = self.model.core
            if core is None:
                return 0
            return self.evictor.evict(core, need_bytes, now)

    def _sync_deployment(self, link: SharedIndexLink) -> None:
        """The janitor's exchange with the deployment (``DeploymentSync``): collected under
        the lock, sent outside it, the EMAs applied under it."""
        recoveries = link.index.conn.counters().get("recoveries", 0)
        with self.lock:
            core = self.model.core
            if core is None:
                return
            batch = self.deployment.collect(core, self.objects.nodes,
                                            self.model.chunk, recoveries)
        emas = self.deployment.sync(link.index, batch)
        if emas is not None:
            with self.lock:
                if self.model.core is not None:
                    self.deployment.apply(self.model.core, emas)

    # ================================================================ checks
    def check(self) -> None:
        """Assert the core's invariants and the object bookkeeping's (O(n))."""
        with self.lock:
            core = self.model.core
            if core is None:
                return
            core.check()
            self.objects.check()

    # ============================================================ janitor
    def _janitor_loop(self) -> None:
        while not self._stop.wait(0.25):
            try:
                self.tick()
            except Exception:
                logger.exception("HiState janitor failed")

    def tick(self) -> None:
        with self.actions.step():
            now = self.clock()  # under the lock: NOTE 1
            core = self.model.core
            if core is not None:
                self.evictor.rerank_step(core, RERANK_BUDGET)
                self.sessions.expire(core, now)
        self.actions.retry_refused()
        link = self._shared()
        if link is not None:
            self._sync_deployment(link)
        if self.shared_tier is not None:
            self._rescore_shared(self.shared_tier)
        # /status janitor_ticks: the background thread is alive (a stalled count is a
        # janitor stuck on the lock or on I/O).
        self.stats["janitor_ticks"] += 1


class CommitListener(L1ManagerListener):
    """Hears LMCache's L1 manager: the keys of each finished write reach the runtime's
    commit queue (NOTE 3). Every callback runs under LMCache's L1 lock; the others are
    other parts' business (removals reach the runtime through the L1 eviction policy)."""

    def __init__(self, runtime: HiStateRuntime) -> None:
        self.runtime = runtime

    def on_l1_keys_write_finished(self, keys: list[ObjectKey]) -> None:
        self.runtime.on_l1_committed(keys)

    def on_l1_keys_reserved_read(self, keys: list[ObjectKey]) -> None:
        return None

    def on_l1_keys_read_finished(self, keys: list[ObjectKey]) -> None:
        return None

    def on_l1_keys_reserved_write(self, keys: list[ObjectKey]) -> None:
        return None

    def on_l1_keys_finish_write_and_reserve_read(self, keys: list[ObjectKey]) -> None:
        return None  # a prefetch from disk: no commit

    def on_l1_keys_deleted_by_manager(self, keys: list[ObjectKey]) -> None:
        return None

    def on_l1_keys_accessed(self, keys: list[ObjectKey]) -> None:
        return None


def _chain_hashes(ctx: Any, token_ids: Sequence[int], end: int) -> list[bytes]:
    """The chunk hashes of ``token_ids[:end]`` with the server's token hasher."""
    hasher = ctx.token_hasher
    raw = hasher.compute_chunk_hashes(list(token_ids), end=end)
    return [hasher.hash_to_bytes(h) for h in raw]
