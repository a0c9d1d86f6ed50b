"""The HiState runtime: the pure policy core driven by what an ``lmcache server`` sees.

One ``HiStateRuntime`` lives in the server process. The launcher builds it and hands it to
LMCache once, bound into the two policy factories LMCache calls and onto the HTTP app's
state (``plugins.install``): the store policy's, registered, and the L1 eviction
policy's, bound for the server's run (``upstream.route_l1_eviction_policy``); every other
part reaches it through what LMCache built, never through a module global:

* the server module (``plugins.build_server_modules``) takes it from the app's state
  (``plugins.runtime_of``, plugins NOTE 2), hands it the context (``attach_server``,
  which also attaches the HiState disk tier found among the storage manager's L2
  adapters) and reports each LOOKUP (refresh-all, pins, hit counters), STORE (the
  request's ordered chunk-hash chain: positions and parents of the objects about to be
  committed) and END_SESSION;
* LMCache's L1 manager tells it of every object committed to L1 the moment the write
  finishes (``plugins.CommitListener``, registered by ``attach_server``); the store policy
  (``plugins.HiStateStorePolicy``) hands the same objects over later, from the store
  controller's thread, and asks where they go (NOTE 3); after a disk write it asks which
  may leave L1;
* the L1 eviction policy (``plugins.HiStateL1EvictionPolicy``) reports L1 removals and
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
``not_cpu_tracked``, ``cpu_used_bytes``); ``attach_server`` / ``start_janitor`` /
``close`` for its wiring; ``step``, the one way in to the core (Locking, below).

The runtime is composed of parts, each owning its state, built here with what it needs:

* ``ModelCore`` and ``ObjectMap`` (``objects``): the one ``HiStateCache`` (tier 0 = CPU =
  LMCache L1, tier 1 = disk), created for the first hybrid model seen, its object
  identity (group kinds, part sizes), and node part <-> ``ObjectKey`` with chunk positions
  and STORE records along request chains;
* ``TierActions`` (``tier_actions``): the core's placement events turned into L1 / disk
  actions, and L1 / disk losses reported back;
* ``Stats`` (``stats``): the counters, under declared keys;
* ``CpuEvictor`` (``cpu_eviction``): L1 victims by lowest ``H``, re-rank sweeps;
* ``recover_from_disk`` (``recovery``) and ``StatusReport`` (``reporting``);
* the runtime itself: the step, commit placement (``_place``, below) and sessions
  (requests in flight, each session's last activity; ``_lookup``, ``_expire``);
* with a shared disk tier (``shared_index``), ``DeploymentSync``
  (``shared_index/deployment``): the core's score inputs, residence samples and session
  starts published, and the deployment's EMAs read back, once per janitor tick.

Calls go one way, down: the runtime drives its parts (and the core through them), the tier
actions read the object map, the object map reads the core; no part calls back up.

Sessions: LMCache has no session ids. A request continues the session whose end lies on
its chain (``HiStateCache.session_for``); otherwise it starts a new one (an explicit id
can be passed as ``request_configs["histate.session_id"]``). A lookup that matches cached
KV but passes no session end is an access inside a context (an internal hit position) and
is counted as such by the hit model. The runtime keeps the requests in flight (their
session and the core's handle, whose pins hold what the lookup matched until the store
lands), each session's last activity (idle ones and forgotten requests expire at the
janitor's tick) and the length of the last stored segment (for ``/status``).

Placing a commit batch (``_place``, within a step): a batch may mix several STOREs; each
record's objects are placed together (``HiStateCache.attach`` + ``complete``) along the
record's chain, from the first stored chunk up to the first one whose KV neither the batch
nor the core holds. Objects the core does not accept leave L1; the ones the core puts on
the disk tier are routed there by the store policy (their headers go with the step's
actions).

Locking: one lock guards the core and every part, and one context takes it: ``step``
(lock → drain the queued L1 removals and disk reports → read the clock (NOTE 1) → the
caller's reads and changes → take the collected ``Actions`` → release → run them). Every
entry point that reads or changes the core goes through it, readers too (``plan``,
``status``, ``resumable``, ``shared_route``, ``check``, the L1 eviction policy's questions),
so no reader sees the core before the queued losses are applied. The lock is never held
while calling into LMCache's L1 manager or waiting on disk I/O: the actions run after it
is released. Callbacks that LMCache makes while holding its own L1 lock
(``on_l1_removed``) only append to a queue, as the disk tier's I/O threads do with their
reports; the janitor's tick drains both too, so none waits longer than a tick. The runtime
calls the disk tier (``expect_headers``, ``delete``, ``write_objects``) only with the lock
released, and no disk I/O thread ever takes it.

NOTE 1 (events are stamped under the lock). The core assumes its clock never runs back
(a session's re-access gap is ``now − last access``; a negative one is clamped to 0). An
entry point that read the clock before taking the lock could apply its event after a
later-stamped one from another thread (LMCache serves stores and lookups on different
threads), and a session's re-access gap would come out negative: a lone negative gap
calibrates ``τ`` to exactly 0. So ``step`` reads ``now`` once the lock is held and hands it
to the caller, and events reach the core in the order of their stamps.

NOTE 2 (finding the disk tier and the L1 manager). LMCache builds the disk tier from
``--l2-adapter`` with its config only, before any server module exists; ``attach_server``
finds it among the storage manager's L2 adapters through the public
``StorageManager.l2_adapters()`` (lmcache 0.5.6 ``v1/distributed/storage_manager.py``:1229,
the ``(descriptor, adapter)`` pairs in adapter-id order). The L1 manager has no public
accessor in 0.5.6 (the storage manager's public L1 calls, ``delete_l1_keys``:701 and
``get_l1_usage``:862, return counts only, and HiState needs per-key deletes and read locks),
so ``attach_server`` reads ``_l1_manager`` (set at :152, the first of its L1 managers) and
refuses a storage manager with several (``is_multi_l1``:1277, public). A stock ``lmcache
server`` attaches nothing: the tier then has no driver: it queues no reports and writes the
``UNKNOWN_META`` header.

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

import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmcache.v1.distributed.internal_api import L1ManagerListener

from lmcache_histate.config import HiStateConfig
from lmcache_histate.core.cache import HiStateCache, RequestHandle
from lmcache_histate.core.tiers import KV, SNAPSHOT, ServerTier

from ..disk.entries import ObjectMeta
from ..disk.shared_link import SharedIndexLink, key_id
from ..disk.tier import HiStateDiskAdapter
from ..shared_index.deployment import DeploymentSync
from ..shared_tier.plan import to_shared
from ..shared_tier.scores import unit_inputs
from ..shared_tier.tier import HiStateSharedAdapter
from .cpu_eviction import RERANK_BUDGET, CpuEvictor
from .objects import ModelCore, ObjectMap, StoreRecord, node_key
from .recovery import recover_from_disk
from .reporting import StatusReport
from .stats import Stats
from .tier_actions import TierActions, take_one

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey

logger = logging.getLogger("lmcache_histate.runtime")

__all__ = ["SESSION_HINT", "HiStateRuntime", "RequestState"]

# How long a hand-off waits for ``CommitListener`` to queue its keys (NOTE 3): the callback
# is one call away under the same L1 lock, so it is microseconds unless the host stalls.
COMMIT_WAIT_S = 0.05
SESSION_HINT = "histate.session_id"
_CPU_BIT, _DISK_BIT = 1 << ServerTier.CPU, 1 << ServerTier.DISK
# node key's depth -> part -> the objects of that part committed in this batch
ByDepth = dict[int, dict[str, list["ObjectKey"]]]


@dataclass(slots=True)
class RequestState:
    """A request in flight: its session and the core's handle (the lookup's pins)."""

    sid: str | None
    handle: RequestHandle | None
    seen: float


def session_hint(key: Any) -> str | None:
    """The explicit session id a request carries, if any."""
    configs = key.request_configs or {}
    hint = configs.get(SESSION_HINT) if isinstance(configs, dict) else None
    return str(hint) if hint else None


class HiStateRuntime:
    """The HiState policy core wired to one LMCache server process (see module doc)."""

    def __init__(self, cfg: HiStateConfig, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.clock = clock
        self._lock = threading.RLock()  # taken only by ``step``
        self.stats = Stats()
        self.model = ModelCore(cfg, self.stats)
        self.objects = ObjectMap(self.model)
        self.deployment = DeploymentSync(self.objects.keys, key_id, clock)
        self.actions = TierActions(self.model, self.objects, self.deployment,
                                   self.stats, clock)
        self.evictor = CpuEvictor(cfg.end_probability_prior, self.stats)
        self.report = StatusReport(cfg, self.model, self.objects, self.actions, self.stats)
        # Sessions (module doc): requests in flight, each session's last activity.
        self.requests: dict[str, RequestState] = {}
        self.session_seen: dict[str, float] = {}
        self.last_segment_tokens = 0
        self._sids = itertools.count(1)
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
        self.metrics_registered = False
        """Whether ``/metrics`` reads this runtime (``metrics.register_metrics`` sets it)."""

    @property
    def core(self) -> HiStateCache | None:
        """The policy core, once the model's layout is known (None before)."""
        return self.model.core

    # ================================================================ the step
    @contextmanager
    def step(self) -> Iterator[float]:
        """The one way in to the core: lock → drain → ``now`` (NOTE 1), yielded → the
        caller's reads and changes → take the actions; they run once the lock is released.
        A caller that raises runs nothing: what it collected waits for the next step."""
        with self._lock:
            self.actions.drain()
            yield self.clock()
            actions = self.actions.take()
        self.actions.run(actions)

    # ================================================================ wiring
    def _drive_disk_tier(self, disk: HiStateDiskAdapter) -> None:
        """Drive ``disk``: its writes, deletes and demotions follow the core, and its
        reports are drained at each step (``attach_server`` calls it with the server's)."""
        self.actions.disk = disk
        disk.start_reports()
        if disk.shared is not None:  # one disk folder for the deployment
            # It sees each drained batch of placement events too (``TierActions.observers``).
            self.actions.observers.append(self.deployment.placed)

    def _shared(self) -> SharedIndexLink | None:
        disk = self.actions.disk
        return None if disk is None else disk.shared

    def attach_server(self, ctx: Any, commits: L1ManagerListener | None = None) -> None:
        """Called by the server module once the server context exists; ``start_janitor``
        then runs ``tick`` in the background. ``commits``: the listener that queues each
        L1 commit (``plugins.CommitListener``, NOTE 3), registered once on the L1 manager."""
        self.ctx = ctx
        sm = ctx.storage_manager
        # NOTE 2: the single L1 manager (no public accessor in 0.5.6), for per-key deletes
        # and for read-locking objects while they are demoted.
        l1 = getattr(sm, "_l1_manager", None)
        if (l1 is None or not callable(getattr(l1, "delete", None))
                or getattr(sm, "is_multi_l1", False)):
            raise RuntimeError("HiState needs LMCache's single-L1 storage manager (0.5.6)")
        self.actions.l1 = l1
        if commits is not None and not self._listening and callable(
                getattr(l1, "register_listener", None)):
            l1.register_listener(commits)  # NOTE 3
            self._listening = True
        # NOTE 2: the disk tier LMCache built from ``--l2-adapter``, among its L2 adapters.
        adapters = [adapter for _desc, adapter in sm.l2_adapters()]
        disks = [a for a in adapters if isinstance(a, HiStateDiskAdapter)]
        if disks and self.actions.disk is None:
            self._drive_disk_tier(disks[0])
        shared = [a for a in adapters if isinstance(a, HiStateSharedAdapter)]
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
            return self.model.ensure(self.ctx, model_name, world_size, 0)
        capacity = disk.capacity_bytes() if disk is not None else self.cfg.disk_bytes
        core = self.model.ensure(self.ctx, model_name, world_size, capacity)
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
        with self.step():
            record = StoreRecord(key.request_id, (), key.start // chunk, session_hint(key),
                                 len(key.token_ids) // chunk)
            record.chain = tuple(
                self.objects.link_chain(hashes, key.cache_salt, record, record.start))

    def on_lookup(self, key: Any) -> None:
        """LOOKUP received: refresh-all on the hit prefix, pin it, count the hit. Objects
        committed to L1 but not handed over yet are placed first (NOTE 3)."""
        if self.ctx is None:
            return
        chunk = self.model.chunk
        end = min(key.end, len(key.token_ids))
        end -= end % chunk
        hashes = _chain_hashes(self.ctx, key.token_ids, end) if end > 0 else []
        with self.step() as now:
            core = self._core_for(key.model_name, key.world_size)
            if core is not None:
                self._place_commits(core, now)
            chain = self.objects.link_chain(hashes, key.cache_salt, None)
            if core is None or not chain:
                return
            sid = self._lookup(core, key, chain, now)
            if self._shared() is not None:  # told to the deployment at the next tick
                self.deployment.began(sid, chain)

    def _lookup(self, core: HiStateCache, key: Any, chain: Sequence[int], now: float) -> str:
        """Refresh-all on the hit prefix, pin it, count the hit (within a step); returns
        the request's session."""
        old = self.requests.pop(key.request_id, None)
        if old is not None and old.handle is not None:
            core.release(old.handle)
        sid = session_hint(key) or core.session_for(chain)
        continues = sid is not None and core.has_session(sid)
        if sid is None:
            sid = self._new_sid()
        handle = core.begin(sid, chain, now)
        match = handle.match
        if not continues and match.kv_chunks > 0:
            # Matched cached context without passing any session's end: an access
            # at an internal position (a rewrite, a shared prefix).
            core.note_internal_access()
        self.stats["lookups"] += 1
        if match.hit_chunks:
            node = match.hit_node
            kind = "end" if node is not None and node.ends else "internal"
            self.stats[f"hits.{kind}"] += 1
            self.stats["hit_tokens"] += match.hit_chunks * self.model.chunk
        self.requests[key.request_id] = RequestState(sid, handle, now)
        self.session_seen[sid] = now
        return sid

    def _new_sid(self) -> str:
        return f"s{next(self._sids)}"

    def on_end_session(self, request_id: str) -> None:
        with self.step():
            state = self.requests.pop(request_id, None)
            core = self.model.core
            if state is not None and state.handle is not None and core is not None:
                core.release(state.handle)

    def plan(
        self, start_tokens: int, input_tokens: int, step_tokens: int | None = None,
        step_price: float | None = None,
    ) -> list[int]:
        """Token positions whose states HiState wants saved for a new segment, on the step
        grid the engine reports (``step_tokens``; None keeps the grid it has) at the step
        price it measured (``step_price``; None keeps the price it has)."""
        with self.step():
            core = self.model.core
            if core is None:
                return []
            grid = core.step_grid if step_tokens is None else step_tokens
            if grid != core.step_grid or step_price is not None:
                core.set_step_grid(grid, step_price)
            return core.snapshot_plan(start_tokens, input_tokens)

    def status(self) -> dict[str, Any]:
        with self.step():
            out = self.report.status(len(self.requests), self.last_segment_tokens)
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
            with self.step() as now:  # the routed writes' headers go down as it ends
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
        return route | self._place(core, unseen, now)

    def _place_commits(self, core: HiStateCache, now: float) -> None:
        """Place every commit ``CommitListener`` queued (under the lock), keeping each
        key's route for the store controller's hand-off (NOTE 3)."""
        batch: list[ObjectKey] = []
        while self._commits:
            batch.extend(k for k in self._commits.popleft() if not take_one(self._direct, k))
        if not batch:
            return
        route = self._place(core, batch, now)
        self.stats["commits.queued"] += len(batch)
        for key in batch:
            self._routes[key] = key in route

    def _place(self, core: HiStateCache, keys: Sequence[ObjectKey], now: float) -> set[ObjectKey]:
        """Objects just committed to L1 (one or more STOREs): place them with the core and
        map them (within a step; module doc).

        Returns the keys to write to the disk tier now (their headers go with the step's
        actions). Objects the core did not accept (a gap before them, no room) are deleted
        from L1; objects of other models or of auxiliary groups are left alone.
        """
        objects, actions = self.objects, self.actions
        records: dict[int, tuple[StoreRecord, ByDepth]] = {}
        unknown: list[ObjectKey] = []
        for key in keys:
            part = self.model.part(key)
            if part is None or not self.model.ours(key):
                continue
            link = objects.link_of(key)
            if link is None or link.record is None:
                unknown.append(key)
                continue
            rec = link.record
            entry = records.setdefault(id(rec), (rec, {}))
            entry[1].setdefault(link.depth, {}).setdefault(part, []).append(key)
        rejected: set[ObjectKey] = set(unknown)
        if unknown:
            self.stats["objects_rejected.unknown_chain"] += len(unknown)
        with actions.committing(keys):
            for rec, by_depth in records.values():
                rejected.update(self._place_record(core, rec, by_depth, now))
        route = {key for key in keys if objects.key_tiers(key) & _DISK_BIT}
        actions.expect_writes(route)
        # Committed objects the core does not hold on the CPU tier and that are not
        # about to be written to disk have no business in L1. (Decided before ``take``
        # reconciles: a part it forgets holds no tier here, so it is deleted either way.)
        l1_delete = actions.pending.l1_delete
        for key in keys:
            if key in route:
                continue
            if objects.where(key) is None:
                if key in rejected:
                    l1_delete.append(key)
            elif not objects.key_tiers(key) & _CPU_BIT:
                l1_delete.append(key)
        return route

    def _place_record(
        self, core: HiStateCache, rec: StoreRecord, by_depth: ByDepth, now: float
    ) -> list[ObjectKey]:
        """One STORE's committed objects along its chain (within a step); returns the ones
        the core did not take."""
        objects = self.objects
        chain, chunk = rec.chain, self.model.chunk
        first = min(by_depth)
        every = [k for parts in by_depth.values() for ks in parts.values() for k in ks]
        if not core.holds_kv_prefix(chain[:first]):
            self.stats["objects_rejected.gap"] += len(every)
            return every
        end = first
        while end < len(chain):
            if KV in by_depth.get(end, {}) or core.tiers_of(chain[end], KV):
                end += 1
            else:
                break
        rejected: list[ObjectKey] = []
        snaps: list[int] = []
        for depth, parts in sorted(by_depth.items()):
            if depth >= end:
                rejected += [k for ks in parts.values() for k in ks]
                self.stats["objects_rejected.gap"] += sum(len(ks) for ks in parts.values())
                continue
            for part, ks in parts.items():
                held = objects.tiers(chain[depth], part)
                for k in ks:
                    objects.register(chain[depth], part, k)
                if held:
                    # The part is already placed: these objects join it where it lives
                    # (another worker's shard of the chunk; or a fresh L1 copy of an
                    # object demoted to disk, which is routed there — a no-op — and then
                    # leaves L1).
                    self.stats["objects_joined"] += len(ks)
                    continue
                if part == SNAPSHOT:
                    snaps.append(depth)
                self.actions.touched.add(chain[depth])
        # The request's session: named, its lookup's, or the one whose end this store
        # continues (later stores of a request continue through this one's end).
        state = self.requests.get(rec.request_id)
        sid = (rec.session_hint or (state.sid if state is not None else None)
               or core.session_for(chain[:end]) or self._new_sid())
        if state is not None and state.handle is not None:  # what it loaded is in place:
            core.release(state.handle)  # its lookup's pins are no longer needed
            state.handle = None
        handle = core.attach(sid, chain[:end])
        boundaries = [(d + 1) * chunk for d in sorted(snaps)]
        core.complete(handle, end * chunk, now, boundaries=boundaries)
        self.actions.drain_core()  # before any object below changes (``tier_actions`` NOTE 2)
        self.session_seen[sid] = now
        self.last_segment_tokens = max(chunk, (end - first) * chunk)
        for depth, parts in by_depth.items():
            if depth >= end:
                continue
            for part, ks in parts.items():
                if not objects.tiers(chain[depth], part) and objects.has_part(chain[depth], part):
                    objects.unregister_part(chain[depth], part)
                    rejected += ks
                    self.stats[f"{part}_not_placed"] += len(ks)
        return rejected

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
        with self.step():
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
        at every janitor tick once committed)."""
        shared = self.shared_tier
        if shared is None:
            return []
        out: list[ObjectKey] = []
        metas: dict[ObjectKey, ObjectMeta] = {}
        with self.step():
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
                    shared.scores.wrote(where, key_id(key), found)
        shared.expect_headers(metas)
        self.stats["shared_tier.routed"] += len(out)
        return out

    def _rescore_shared(self, shared: HiStateSharedAdapter) -> None:
        """The janitor's re-scoring of what this node wrote to the shared tier
        (``shared_tier.scores``): collected under the lock, sent outside it."""
        with self.step() as now:
            core = self.model.core
            updates = [] if core is None else shared.scores.collect(core, now)
        shared.rescore(updates)

    def on_persisted(self, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        """Objects written to disk by the store controller: those not kept on the CPU tier
        leave L1 now (``TierActions.leave_l1``); returns the keys deleted or retried."""
        with self.step():
            return self.actions.leave_l1(keys)

    # ======================================================= L1 eviction policy
    def on_l1_removed(self, keys: list[ObjectKey]) -> None:
        """Called by LMCache under its L1 lock: queue only."""
        self.actions.on_l1_removed(keys)

    def not_cpu_tracked(self, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        """The ``keys`` the core does not hold on the CPU tier (objects HiState does not
        manage, or copies it released), in their order: one step for the whole list (the
        L1 eviction policy asks about every object in L1)."""
        with self.step():
            return self.objects.not_cpu_tracked(keys)

    def cpu_used_bytes(self) -> int:
        with self.step():
            core = self.model.core
            return 0 if core is None else core.stats().used_bytes[ServerTier.CPU]

    def evict_cpu(self, need_bytes: int) -> int:
        """Push units out of the CPU tier by lowest H until ``need_bytes`` are freed."""
        with self.step() as now:
            core = self.model.core
            if core is None:
                return 0
            return self.evictor.evict(core, need_bytes, now)

    def _sync_deployment(self, link: SharedIndexLink) -> None:
        """The janitor's exchange with the deployment (``DeploymentSync``): collected under
        the lock, sent outside it, the EMAs applied under it."""
        recoveries = link.index.conn.counters().get("recoveries", 0)
        with self.step():
            core = self.model.core
            if core is None:
                return
            batch = self.deployment.collect(core, self.objects.nodes,
                                            self.model.chunk, recoveries)
        emas = self.deployment.sync(link.index, batch)
        if emas is not None:
            with self.step():
                if self.model.core is not None:
                    self.deployment.apply(self.model.core, emas)

    def _expire(self, core: HiStateCache, now: float) -> None:
        """Forget requests and sessions idle past their TTLs (the janitor's step)."""
        ttl = self.cfg.request_ttl_s
        for rid, state in list(self.requests.items()):
            if now - state.seen > ttl:
                if state.handle is not None:
                    core.release(state.handle)
                del self.requests[rid]
        idle = self.cfg.session_ttl_s
        for sid, seen in list(self.session_seen.items()):
            if now - seen > idle:
                core.drop_session(sid)
                del self.session_seen[sid]

    # ================================================================ checks
    def check(self) -> None:
        """Assert the core's invariants, the object bookkeeping's (O(n)) and the
        counters'."""
        with self.step():
            self.stats.check()
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
        with self.step() as now:
            core = self.model.core
            if core is not None:
                self.evictor.rerank_step(core, RERANK_BUDGET)
                self._expire(core, now)
            self.actions.leave_l1(self.actions.take_refused())  # a reader's lock refused them
        link = self._shared()
        if link is not None:
            self._sync_deployment(link)
        if self.shared_tier is not None:
            self._rescore_shared(self.shared_tier)
        # /status janitor_ticks: the background thread is alive (a stalled count is a
        # janitor stuck on the lock or on I/O).
        self.stats["janitor_ticks"] += 1


def _chain_hashes(ctx: Any, token_ids: Sequence[int], end: int) -> list[bytes]:
    """The chunk hashes of ``token_ids[:end]`` with the server's token hasher."""
    hasher = ctx.token_hasher
    raw = hasher.compute_chunk_hashes(list(token_ids), end=end)
    return [hasher.hash_to_bytes(h) for h in raw]
