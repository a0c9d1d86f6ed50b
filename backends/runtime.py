"""The HiState runtime: the pure policy core driven by what an ``lmcache server`` sees.

One ``HiStateRuntime`` lives in the server process (installed by the launcher before
LMCache builds anything). Every HiState piece finds it with ``get_runtime()``:

* the server module (``server_module.py``) hands it the server context and reports each
  LOOKUP (refresh-all, pins, hit counters), STORE (the request's ordered chunk-hash chain:
  positions and parents of the objects about to be committed) and END_SESSION;
* the store policy (``policies.HiStateStorePolicy``) reports every batch of objects
  committed to L1 and asks where they go; after a disk write it asks which may leave L1;
* the L1 eviction policy (``policies.HiStateL1EvictionPolicy``) reports L1 removals and
  asks for victims when LMCache's eviction loop finds L1 above its watermark;
* the disk tier (``disk_tier.HiStateDiskAdapter``) reports failed writes and corrupted or
  missing files, and asks for each object's kind/depth/parent to write in its header.

The runtime keeps ONE ``HiStateCache`` (tier 0 = CPU = LMCache L1, tier 1 = disk) and
turns the core's placement events (``stored`` / ``moved`` / ``dropped``) into real
actions on LMCache objects: delete from L1, delete from disk, demote (write an L1 object
to disk, then delete it from L1), on the ``ObjectKey``s of each chunk node's two parts
(KV, snapshot; see ``object_map``).

Locking: ``self.lock`` guards the core and the maps. It is never held while calling
into LMCache's L1 manager or waiting on disk I/O: core operations collect actions,
which run after the lock is released. Callbacks that LMCache makes while holding its
own L1 lock (``note_l1_removed``) only append to a queue; the queue is drained under
``self.lock`` before every core operation and by a janitor thread.

The runtime's concerns live in their own modules, mixed into ``HiStateRuntime`` (which
holds all the state, listed in ``__init__``, and the one lock):

* ``object_map``: node part <-> ``ObjectKey`` bookkeeping, tier constants;
* ``chains``: chunk positions (``Link``) and STORE records along request chains;
* ``sessions``: LOOKUP / STORE / END_SESSION, requests and sessions;
* ``commits``: objects committed to L1 placed by the core;
* ``tier_actions``: the core's events turned into L1 / disk actions, and L1 / disk losses;
* ``cpu_eviction``: L1 victims by lowest ``H``, re-rank sweeps;
* ``core_setup``: the core sized from the model's registered layouts;
* ``recovery``: the index rebuilt from disk files after a restart;
* ``reporting``: snapshot plans, ``/status``, consistency checks.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lmcache_histate.config import HiStateConfig
from lmcache_histate.core.cache import HiStateCache

from .chains import ChainsMixin, Link, node_key
from .commits import CommitsMixin
from .core_setup import CoreSetupMixin
from .cpu_eviction import RERANK_BUDGET, CpuEvictionMixin
from .object_map import CPU, DISK, ObjectMapMixin
from .recovery import RecoveryMixin
from .reporting import ReportingMixin
from .sessions import RequestState, SessionsMixin
from .tier_actions import Actions, CoreListener, TierActionsMixin

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey

    from .disk_tier import HiStateDiskAdapter

logger = logging.getLogger("lmcache_histate.runtime")

# CPU, DISK and node_key are re-exported: callers and tests import them from here.
__all__ = ["CPU", "DISK", "HiStateRuntime", "get_runtime", "install_runtime", "node_key"]

_RUNTIME: HiStateRuntime | None = None


def get_runtime() -> HiStateRuntime | None:
    """The runtime installed in this process, if any (None under a stock lmcache server)."""
    return _RUNTIME


def install_runtime(runtime: HiStateRuntime | None) -> None:
    global _RUNTIME
    _RUNTIME = runtime


class HiStateRuntime(
    SessionsMixin,
    CommitsMixin,
    TierActionsMixin,
    CpuEvictionMixin,
    CoreSetupMixin,
    RecoveryMixin,
    ChainsMixin,
    ObjectMapMixin,
    ReportingMixin,
):
    """The HiState policy core wired to one LMCache server process (see module doc)."""

    def __init__(self, cfg: HiStateConfig, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.clock = clock
        self.lock = threading.RLock()
        self.core: HiStateCache | None = None
        self.model: tuple[str, int] | None = None
        self.kinds: dict[int, str] = {}
        self.kv_chunk_bytes = 0
        self.snapshot_bytes = 0
        self.chunk = cfg.chunk_tokens
        # The configured geometry, reported in /status for the connector's start-up check;
        # read once (a model path means parsing config.json, and /metrics polls status()).
        geometry = cfg.geometry
        self.configured_geometry: dict[str, Any] = {
            "model": cfg.model,
            "snapshot_bytes": geometry.snapshot_bytes,
            "kv_bytes_per_token": geometry.kv_bytes_per_token,
            "state_dtypes": [t.dtype for t in geometry.state_tensors],
        }
        self.links: OrderedDict[int, Link] = OrderedDict()
        self.objects: dict[int, dict[str, list[ObjectKey]]] = {}
        self.part_of: dict[ObjectKey, tuple[int, str]] = {}
        self.requests: dict[str, RequestState] = {}
        self.session_seen: dict[str, float] = {}
        self.stats: Counter[str] = Counter()
        self.last_segment_tokens = 0
        self.adapter: HiStateDiskAdapter | None = None
        self.ctx: Any = None
        self.l1: Any = None
        self._sids = itertools.count(1)
        self._events: deque[list[ObjectKey]] = deque()
        self._expected: Counter[ObjectKey] = Counter()
        self._expected_lock = threading.Lock()
        self._retry_l1: set[ObjectKey] = set()
        self._retry_lock = threading.Lock()
        self._actions = Actions()
        self._batch: set[ObjectKey] = set()
        self._touched: set[int] = set()
        self._listener = CoreListener(self)
        self._stop = threading.Event()
        self._janitor: threading.Thread | None = None
        self.janitor_ticks = 0  # completed ``tick`` calls: tests wait for one to pass
        self._foreign_warned: set[tuple[str, int]] = set()
        self._rank_basis: tuple[float, float] = (0.0, cfg.end_probability_prior)
        self._sweep: list[int] | None = None
        self._unsupported: set[tuple[str, int]] = set()

    # ================================================================ wiring
    def attach_adapter(self, adapter: HiStateDiskAdapter) -> None:
        self.adapter = adapter
        adapter.meta_provider = self.object_meta
        adapter.write_listener = self.on_disk_written
        adapter.loss_listener = self.on_disk_lost
        adapter.capacity_listener = self.on_disk_capacity

    def attach_server(self, ctx: Any) -> None:
        """Called by the server module once the server context exists."""
        self.ctx = ctx
        sm = ctx.storage_manager
        # LMCache 0.5.6 exposes no public per-key L1 delete/read-lock API on the storage
        # manager (delete_l1_keys returns counts only); the single L1 manager is needed
        # for per-key results and for read-locking objects while they are demoted.
        l1 = getattr(sm, "_l1_manager", None)
        if l1 is None or not callable(getattr(l1, "delete", None)):
            raise RuntimeError("HiState needs LMCache's single-L1 storage manager (0.5.6)")
        self.l1 = l1
        if ctx.chunk_size != self.chunk:
            logger.warning(
                "server chunk size %d differs from the configuration's %d; using %d",
                ctx.chunk_size, self.chunk, ctx.chunk_size,
            )
            self.chunk = ctx.chunk_size
        if self._janitor is None:
            self._janitor = threading.Thread(target=self._janitor_loop, name="histate-janitor",
                                             daemon=True)
            self._janitor.start()

    def close(self) -> None:
        self._stop.set()
        if self._janitor is not None:
            self._janitor.join(timeout=5)

    # ============================================================ janitor
    def _janitor_loop(self) -> None:
        while not self._stop.wait(0.25):
            try:
                self.tick()
            except Exception:
                logger.exception("HiState janitor failed")

    def tick(self) -> None:
        now = self.clock()
        with self.lock:
            self._drain_locked()
            core = self.core
            if core is not None:
                self._rerank_step(RERANK_BUDGET)
                ttl = self.cfg.request_ttl_s
                for rid, state in list(self.requests.items()):
                    if now - state.seen > ttl:
                        if state.handle is not None:
                            core.release(state.handle)
                        del self.requests[rid]
                idle = self.cfg.session_ttl_s
                for sid, seen in list(self.session_seen.items()):
                    if now - seen > idle:
                        core.end_session(sid)
                        del self.session_seen[sid]
            actions = self._take_actions()
        self._run(actions)
        with self._retry_lock:
            retry, self._retry_l1 = list(self._retry_l1), set()
        if retry:
            with self.lock:
                retry = [k for k in retry if not self.is_cpu_tracked(k)]
            self._l1_delete(retry)
        self.janitor_ticks += 1
