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
to disk, then delete it from L1). Each chunk node of the core owns the ``ObjectKey``s of
its two parts: KV = the attention object group(s), snapshot = the recurrent group(s)
(learned from the registered layouts' ``group_kinds``, never from group ids).

Locking: ``self.lock`` guards the core and the maps. It is never held while calling
into LMCache's L1 manager or waiting on disk I/O: core operations collect actions,
which run after the lock is released. Callbacks that LMCache makes while holding its
own L1 lock (``note_l1_removed``) only append to a queue; the queue is drained under
``self.lock`` before every core operation and by a janitor thread.

Sessions: LMCache has no session ids. A request continues the session whose end lies on
its chain (``HiStateCache.session_for``); otherwise it starts a new one (an explicit id
can be passed as ``request_configs["histate.session_id"]``). A lookup that matches
cached KV but passes no session end is an access inside a context (an internal hit
position) and is counted as such by the hit model. Idle sessions expire.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmcache_histate.config import HiStateConfig
from lmcache_histate.core.cache import CacheConfig, HiStateCache, RequestHandle
from lmcache_histate.core.index import Node
from lmcache_histate.core.placement import KV, SNAPSHOT, PlacementRules, TierSpec

from . import diskfile as df

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey

    from .disk_tier import HiStateDiskAdapter

logger = logging.getLogger("lmcache_histate.runtime")

__all__ = ["CPU", "DISK", "HiStateRuntime", "get_runtime", "install_runtime", "node_key"]

CPU, DISK = 0, 1
TIER_NAMES = ("cpu", "disk")
ATTENTION, RECURRENT = "attention", "recurrent"
SESSION_HINT = "histate.session_id"
_LINKS_MAX = 1 << 21
_RERANK_BUDGET = 4096  # nodes re-ranked per janitor tick (4 ticks/s) during a sweep

_RUNTIME: HiStateRuntime | None = None


def get_runtime() -> HiStateRuntime | None:
    """The runtime installed in this process, if any (None under a stock lmcache server)."""
    return _RUNTIME


def install_runtime(runtime: HiStateRuntime | None) -> None:
    global _RUNTIME
    _RUNTIME = runtime


def node_key(chunk_hash: bytes, salt: str = "") -> int:
    """The core's int key of a chunk: its rolling prefix hash (salted per cache_salt)."""
    if salt:
        chunk_hash = hashlib.blake2b(salt.encode() + b"\0" + chunk_hash, digest_size=8).digest()
    return int.from_bytes(chunk_hash[:8].ljust(8, b"\0"), "little")


@dataclass(slots=True)
class StoreRecord:
    """One STORE request as the server received it (before its objects are committed)."""

    request_id: str
    chain: tuple[int, ...]  # node keys of chunks [0, end)
    start: int  # first chunk stored by this request
    session_hint: str | None


@dataclass(slots=True)
class Link:
    """Where a chunk sits in its prefix: what the chunk hash alone does not say."""

    parent: int | None
    parent_hash: bytes
    depth: int
    chunk_hash: bytes
    salt: str
    record: StoreRecord | None = None


@dataclass(slots=True)
class RequestState:
    sid: str | None
    handle: RequestHandle | None
    seen: float


@dataclass(slots=True)
class Actions:
    """Effects decided under the lock, run after it is released."""

    l1_delete: list[ObjectKey] = field(default_factory=list)
    disk_delete: list[ObjectKey] = field(default_factory=list)
    demote: list[tuple[int, str, list[ObjectKey]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.l1_delete or self.disk_delete or self.demote)


class _CoreListener:
    """Turns the core's placement events into ``Actions`` and counters."""

    def __init__(self, runtime: HiStateRuntime) -> None:
        self.rt = runtime

    def stored(self, node: Node, part: str, tier: int) -> None:
        rt = self.rt
        rt._touched.add(node.key)
        rt.stats[f"{part}_stored.{TIER_NAMES[tier]}"] += 1
        keys = rt._keys(node.key, part)
        if tier == DISK and keys and not set(keys) <= rt._batch:
            rt._actions.demote.append((node.key, part, keys))

    def moved(self, node: Node, part: str, src: int, dst: int) -> None:
        rt = self.rt
        rt._touched.add(node.key)
        rt.stats[f"{part}_evicted.{TIER_NAMES[src]}"] += 1
        rt.stats[f"{part}_stored.{TIER_NAMES[dst]}"] += 1
        if src == CPU and dst == DISK:
            rt.stats[f"{part}_demoted"] += 1
        keys = rt._keys(node.key, part)
        if not keys:
            return
        if dst == DISK and not set(keys) <= rt._batch:
            rt._actions.demote.append((node.key, part, keys))
        elif dst == CPU:  # the core never promotes; keep the objects consistent anyway
            rt._actions.disk_delete.extend(keys)

    def dropped(self, node: Node, part: str, tiers: int) -> None:
        rt = self.rt
        rt._touched.add(node.key)
        keys = rt._keys(node.key, part)
        for tier in (CPU, DISK):
            if tiers & (1 << tier):
                rt.stats[f"{part}_evicted.{TIER_NAMES[tier]}"] += 1
                if keys:
                    (rt._actions.l1_delete if tier == CPU else rt._actions.disk_delete).extend(
                        keys
                    )


class HiStateRuntime:
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
        self.chunk = cfg.chunk_size
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
        self._listener = _CoreListener(self)
        self._stop = threading.Event()
        self._janitor: threading.Thread | None = None
        self._foreign_warned: set[tuple[str, int]] = set()
        self._rank_basis: tuple[int, float] = (0, cfg.end_probability_prior)
        self._sweep: list[int] | None = None
        self._unsupported: set[tuple[str, int]] = set()

    # ================================================================ wiring
    def attach_adapter(self, adapter: HiStateDiskAdapter) -> None:
        self.adapter = adapter
        adapter.meta_provider = self.object_meta
        adapter.write_listener = self.on_disk_written
        adapter.loss_listener = self.on_disk_lost

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

    # ============================================================ the model
    def _ensure_core(self, model_name: str, world_size: int) -> HiStateCache | None:
        """The core for this server's model, created from its registered layout."""
        if self.core is not None:
            if self.model == (model_name, world_size):
                return self.core
            if (model_name, world_size) not in self._foreign_warned:
                self._foreign_warned.add((model_name, world_size))
                logger.warning(
                    "HiState manages one model per server (%s, world size %d); objects of "
                    "%s (world size %d) are left to the fallback LRU in L1",
                    *self.model, model_name, world_size,  # type: ignore[misc]
                )
            return None
        if self.ctx is None or (model_name, world_size) in self._unsupported:
            return None
        registry = self.ctx.layout_desc_registry
        try:
            attn = registry.find_attn_desc(model_name, world_size)
        except ValueError:
            return None
        layouts = registry.find_group_layout_descs(model_name, world_size) or {}
        kinds = dict(enumerate(attn.group_kinds))
        sizes = {g: _layout_bytes(layouts[g]) for g in kinds if g in layouts}
        kv = sum(sizes.get(g, 0) for g, k in kinds.items() if k == ATTENTION) * world_size
        snap = sum(sizes.get(g, 0) for g, k in kinds.items() if k == RECURRENT) * world_size
        if kv <= 0 or snap <= 0:
            logger.error(
                "model %s has no %s object group (group kinds %s): HiState needs a hybrid "
                "model registered with --separate-object-groups; objects stay under LRU",
                model_name, "recurrent" if kv > 0 else "attention", attn.group_kinds,
            )
            self._unsupported.add((model_name, world_size))
            return None
        cfg = self.cfg
        disk_capacity = cfg.disk_bytes
        if self.adapter is not None:
            disk_capacity = self.adapter.config.capacity_bytes
        # The core counts payload bytes; files also carry a header (diskfile).
        header = df.header_size(df.ObjectId(model_name, 0, 0, b"\0" * 32), b"\0" * 32) + 64
        disk_core = disk_capacity - header * (disk_capacity // (min(kv, snap) + header))
        cache_cfg = CacheConfig(
            chunk_tokens=self.chunk,
            kv_chunk_bytes=kv,
            snapshot_bytes=snap,
            tiers=(TierSpec("cpu", int(cfg.cpu_bytes * cfg.cpu_fill)), TierSpec("disk", disk_core)),
            rules=PlacementRules(kv_tier=CPU, snapshot_tier=DISK, final_tier=CPU,
                                 final_copy_tier=DISK),
            tau=cfg.tau,
            refresh_all=cfg.refresh_all,
            supported_intervals=tuple(i for i in cfg.intervals if i % self.chunk == 0) or None,
            ema_alpha=cfg.ema_alpha,
            end_probability_prior=cfg.end_probability_prior,
        )
        self.core = HiStateCache(cache_cfg, listener=self._listener)
        self.model = (model_name, world_size)
        self.kinds = kinds
        self.kv_chunk_bytes, self.snapshot_bytes = kv, snap
        geometry = cfg.geometry
        logger.info(
            "HiState core for %s (world size %d): group kinds %s, KV %d B/chunk, snapshot "
            "%d B (N_s = %.1f tokens; config model %s: N_s = %.1f), tiers cpu %d B, disk %d B",
            model_name, world_size, attn.group_kinds, kv, snap, snap / max(1, kv // self.chunk),
            cfg.model, geometry.snapshot_tokens, cache_cfg.tiers[0].capacity, disk_core,
        )
        self._recover_from_disk()
        return self.core

    def _kind(self, key: ObjectKey) -> str | None:
        kind = self.kinds.get(key.object_group_id)
        return {ATTENTION: KV, RECURRENT: SNAPSHOT}.get(kind or "")

    def _ours(self, key: ObjectKey) -> bool:
        return self.model == (key.model_name, key.kv_rank >> 24 or 1)

    def _keys(self, nk: int, part: str) -> list[ObjectKey]:
        return list(self.objects.get(nk, {}).get(part, ()))

    def _register(self, nk: int, part: str, key: ObjectKey) -> None:
        parts = self.objects.setdefault(nk, {})
        keys = parts.setdefault(part, [])
        if key not in keys:
            keys.append(key)
        self.part_of[key] = (nk, part)

    def _unregister_part(self, nk: int, part: str) -> list[ObjectKey]:
        parts = self.objects.get(nk)
        if not parts:
            return []
        keys = parts.pop(part, [])
        if not parts:
            del self.objects[nk]
        for key in keys:
            self.part_of.pop(key, None)
        return keys

    def _tiers(self, nk: int, part: str) -> int:
        node = self.core.index.get(nk) if self.core is not None else None
        if node is None:
            return 0
        return node.kv_tiers if part == KV else node.snap_tiers

    def _reconcile(self) -> None:
        """Forget (and delete) the objects of parts the core no longer holds anywhere.

        Usually their deletion is already queued by the core's ``dropped`` events; this
        also catches parts made of several objects (tensor-parallel shards) of which one
        was lost: the others are useless alone. Deleting what is already gone is a no-op.
        """
        touched, self._touched = self._touched, set()
        for nk in touched:
            for part in (KV, SNAPSHOT):
                if not self._tiers(nk, part) and part in self.objects.get(nk, {}):
                    keys = self._unregister_part(nk, part)
                    self._actions.l1_delete.extend(keys)
                    self._actions.disk_delete.extend(keys)

    def _take_actions(self) -> Actions:
        self._reconcile()
        actions, self._actions = self._actions, Actions()
        return actions

    # ============================================================ chains
    def _link_chain(
        self, hashes: Sequence[bytes], salt: str, record: StoreRecord | None, start: int = 0
    ) -> list[int]:
        chain: list[int] = []
        parent: int | None = None
        parent_hash = b""
        for depth, h in enumerate(hashes):
            nk = node_key(h, salt)
            link = self.links.get(nk)
            if link is None:
                link = Link(parent, parent_hash, depth, h, salt)
                self.links[nk] = link
            else:
                self.links.move_to_end(nk)
            if record is not None and depth >= start:
                link.record = record
            chain.append(nk)
            parent, parent_hash = nk, h
        self._trim_links()
        return chain

    def _trim_links(self) -> None:
        core = self.core
        scans = 0
        while len(self.links) > _LINKS_MAX and scans < 1024:
            nk, _link = next(iter(self.links.items()))
            scans += 1
            if core is not None and nk in core.index.nodes:
                self.links.move_to_end(nk)
            else:
                del self.links[nk]

    def object_meta(self, key: ObjectKey) -> tuple[int, int, bytes]:
        """(kind, depth, parent chunk hash) for the disk header of ``key``."""
        link = self.links.get(node_key(key.chunk_hash, key.cache_salt))
        part = self._kind(key)
        kind = df.KIND_KV if part == KV else df.KIND_SNAPSHOT if part == SNAPSHOT else df.KIND_OTHER
        if link is None:
            return kind, -1, b""
        return kind, link.depth, link.parent_hash

    def _hashes(self, token_ids: Sequence[int], end: int) -> list[bytes]:
        hasher = self.ctx.token_hasher
        raw = hasher.compute_chunk_hashes(list(token_ids), end=end)
        return [hasher.hash_to_bytes(h) for h in raw]

    # ============================================================ requests
    def note_store(self, key: Any) -> None:
        """STORE received (before its objects are committed): record the chain."""
        if self.ctx is None:
            return
        end = min(key.end, len(key.token_ids))
        end -= end % self.chunk
        if end <= 0:
            return
        # LMCache resolves the STORE's keys through the request's session right after this
        # (engine_context.resolve_obj_keys); hashing through it computes each hash once.
        session = self.ctx.session_manager.get_or_create(key.request_id)
        session.set_tokens(list(key.token_ids))
        hashes = [self.ctx.token_hasher.hash_to_bytes(h) for h in session.get_hashes(0, end)]
        configs = key.request_configs or {}
        hint = configs.get(SESSION_HINT) if isinstance(configs, dict) else None
        with self.lock:
            record = StoreRecord(key.request_id, (), key.start // self.chunk,
                                 str(hint) if hint else None)
            record.chain = tuple(self._link_chain(hashes, key.cache_salt, record, record.start))

    def on_lookup(self, key: Any) -> None:
        """LOOKUP received: refresh-all on the hit prefix, pin it, count the hit."""
        if self.ctx is None:
            return
        end = min(key.end, len(key.token_ids))
        end -= end % self.chunk
        hashes = self._hashes(key.token_ids, end) if end > 0 else []
        now = self.clock()
        with self.lock:
            self._drain_locked()
            chain = self._link_chain(hashes, key.cache_salt, None)
            core = self._ensure_core(key.model_name, key.world_size)
            if core is None or not chain:
                return
            old = self.requests.pop(key.request_id, None)
            if old is not None and old.handle is not None:
                core.release(old.handle)
            configs = key.request_configs or {}
            hint = configs.get(SESSION_HINT) if isinstance(configs, dict) else None
            sid = str(hint) if hint else core.session_for(chain)
            continues = sid is not None and sid in core.index.sessions
            if sid is None:
                sid = self._new_sid()
            handle = core.begin(sid, chain, now)
            match = handle.match
            if not continues and match.kv_chunks > 0:
                # Matched cached context without passing any session's end: an access
                # at an internal position (a rewrite, a shared prefix).
                core.hit_model.observe(False)
            self.stats["lookups"] += 1
            if match.hit_chunks:
                node = match.hit_node
                kind = "end" if node is not None and node.ends else "internal"
                self.stats[f"hits.{kind}"] += 1
                self.stats["hit_tokens"] += match.hit_chunks * self.chunk
            self.requests[key.request_id] = RequestState(sid, handle, now)
            self.session_seen[sid] = now
            actions = self._take_actions()
        self._run(actions)

    def on_end_session(self, request_id: str) -> None:
        with self.lock:
            state = self.requests.pop(request_id, None)
            if state is not None and state.handle is not None and self.core is not None:
                self.core.release(state.handle)
            actions = self._take_actions()
        self._run(actions)

    def _new_sid(self) -> str:
        return f"s{next(self._sids)}"

    def _session_for_store(self, record: StoreRecord, chain: Sequence[int]) -> str:
        core = self.core
        assert core is not None
        if record.session_hint:
            return record.session_hint
        state = self.requests.get(record.request_id)
        if state is not None and state.sid is not None:
            return state.sid
        # Later stores of the same request continue through this one's end.
        return core.session_for(chain) or self._new_sid()

    # ============================================================ commits
    def on_committed(self, keys: Sequence[ObjectKey]) -> set[ObjectKey]:
        """Objects just committed to L1 (one or more STOREs): place them.

        Returns the keys to write to the disk tier now. Objects the core did not accept
        (a gap before them, no room) are deleted
        from L1; objects of other models or of auxiliary groups are left alone.
        """
        if not keys or self.ctx is None:
            return set()
        now = self.clock()
        route: set[ObjectKey] = set()
        with self.lock:
            self._drain_locked()
            core = self._ensure_core(keys[0].model_name, keys[0].kv_rank >> 24 or 1)
            if core is None:
                return route
            records: dict[int, tuple[StoreRecord, dict[int, dict[str, list[ObjectKey]]]]] = {}
            unknown: list[ObjectKey] = []
            for key in keys:
                part = self._kind(key)
                if part is None or not self._ours(key):
                    continue
                link = self.links.get(node_key(key.chunk_hash, key.cache_salt))
                if link is None or link.record is None:
                    unknown.append(key)
                    continue
                rec = link.record
                entry = records.setdefault(id(rec), (rec, {}))
                entry[1].setdefault(link.depth, {}).setdefault(part, []).append(key)
            rejected: set[ObjectKey] = set(unknown)
            if unknown:
                self.stats["objects_rejected.unknown_chain"] += len(unknown)
            self._batch = set(keys)
            try:
                for rec, by_depth in records.values():
                    rejected.update(self._commit_record(core, rec, by_depth, now))
            finally:
                self._batch = set()
            for key in keys:
                where = self.part_of.get(key)
                if where is None:
                    continue
                tiers = self._tiers(*where)
                if tiers & (1 << DISK):
                    route.add(key)
            actions = self._take_actions()
            # Committed objects the core does not hold on the CPU tier and that are not
            # about to be written to disk have no business in L1.
            for key in keys:
                where = self.part_of.get(key)
                if key in route:
                    continue
                if where is None:
                    if key in rejected:
                        actions.l1_delete.append(key)
                elif not self._tiers(*where) & (1 << CPU):
                    actions.l1_delete.append(key)
        self._run(actions)
        return route

    def _commit_record(
        self,
        core: HiStateCache,
        rec: StoreRecord,
        by_depth: dict[int, dict[str, list[ObjectKey]]],
        now: float,
    ) -> list[ObjectKey]:
        chain = rec.chain
        first = min(by_depth)
        every = [k for parts in by_depth.values() for ks in parts.values() for k in ks]
        walk = core.index.walk(chain[:first])
        if len(walk) < first or not all(n.kv_tiers for n in walk):
            self.stats["objects_rejected.gap"] += len(every)
            return every
        end = first
        while end < len(chain):
            node = core.index.get(chain[end])
            if KV in by_depth.get(end, {}) or (node is not None and node.kv_tiers):
                end += 1
            else:
                break
        rejected: list[ObjectKey] = []
        snaps: list[int] = []
        for depth, parts in sorted(by_depth.items()):
            node = core.index.get(chain[depth])
            if depth >= end:
                rejected += [k for ks in parts.values() for k in ks]
                self.stats["objects_rejected.gap"] += sum(len(ks) for ks in parts.values())
                continue
            for part, ks in parts.items():
                held = self._tiers(chain[depth], part)
                for k in ks:
                    self._register(chain[depth], part, k)
                if held:
                    # The part is already placed: these objects join it where it lives
                    # (another worker's shard of the chunk; or a fresh L1 copy of an
                    # object demoted to disk, which is routed there — a no-op — and then
                    # leaves L1).
                    self.stats["objects_joined"] += len(ks)
                    continue
                if part == SNAPSHOT:
                    snaps.append(depth)
                self._touched.add(chain[depth])
        sid = self._session_for_store(rec, chain[:end])
        state = self.requests.get(rec.request_id)
        if state is not None and state.handle is not None:
            core.release(state.handle)  # the lookup's pins: what it loaded is in place now
            state.handle = None
        handle = core.attach(sid, chain[:end])
        boundaries = [(d + 1) * self.chunk for d in sorted(snaps)]
        core.complete(handle, end * self.chunk, now, boundaries=boundaries)
        self.session_seen[sid] = now
        self.last_segment_tokens = max(self.chunk, (end - first) * self.chunk)
        for depth, parts in by_depth.items():
            if depth >= end:
                continue
            for part, ks in parts.items():
                if not self._tiers(chain[depth], part) and self.objects.get(chain[depth], {}).get(
                    part
                ):
                    self._unregister_part(chain[depth], part)
                    rejected += ks
                    self.stats[f"{part}_not_placed"] += len(ks)
        return rejected

    def after_persisted(self, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        """Objects written to disk by the store controller: those not kept on the CPU tier
        leave L1 now. Deleted here rather than by the store controller, which ignores a
        delete refused because a lookup holds a read lock; here it is retried.

        Returns the keys deleted or queued for deletion.
        """
        out = self._leaving_l1(keys)
        self._l1_delete(out)
        return out

    def _leaving_l1(self, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        with self.lock:
            return [k for k in keys if not self.is_cpu_tracked(k)]

    # ============================================================ disk events
    def on_disk_written(self, stored: list[ObjectKey], failed: list[ObjectKey]) -> None:
        if not failed:
            return
        with self.lock:
            self._drain_locked()
            for key in failed:
                where = self.part_of.get(key)
                if where is None or self.core is None:
                    continue
                if self._tiers(*where) & (1 << DISK):
                    self.stats[f"{where[1]}_not_persisted"] += 1
                    self.core.lose(where[0], where[1], DISK)
                    self._touched.add(where[0])
            actions = self._take_actions()
            for key in failed:
                where = self.part_of.get(key)
                if where is None or not self._tiers(*where) & (1 << CPU):
                    actions.l1_delete.append(key)
        self._run(actions)

    def on_disk_lost(self, keys: list[ObjectKey]) -> None:
        """Files found corrupted or missing on load (already removed by the adapter)."""
        with self.lock:
            self._drain_locked()
            for key in keys:
                where = self.part_of.get(key)
                if where is None or self.core is None:
                    continue
                if self._tiers(*where) & (1 << DISK):
                    self.stats[f"{where[1]}_lost.disk"] += 1
                    self.core.lose(where[0], where[1], DISK)
                    self._touched.add(where[0])
            actions = self._take_actions()
        self._run(actions)

    # ============================================================ L1 events
    def note_l1_removed(self, keys: list[ObjectKey]) -> None:
        """Called by LMCache under its L1 lock: queue only."""
        if keys:
            self._events.append(list(keys))

    def _expect_removals(self, keys: Iterable[ObjectKey]) -> None:
        with self._expected_lock:
            for key in keys:
                self._expected[key] += 1

    def _unexpect(self, keys: Iterable[ObjectKey]) -> None:
        with self._expected_lock:
            for key in keys:
                if self._expected[key] <= 1:
                    self._expected.pop(key, None)
                else:
                    self._expected[key] -= 1

    def _drain_locked(self) -> None:
        """Apply queued L1 removals: the ones nobody here decided are losses."""
        core = self.core
        while self._events:
            keys = self._events.popleft()
            for key in keys:
                with self._expected_lock:
                    if self._expected.get(key):
                        self._expected[key] -= 1
                        if not self._expected[key]:
                            del self._expected[key]
                        continue
                where = self.part_of.get(key)
                if where is None or core is None:
                    continue
                if self._tiers(*where) & (1 << CPU):
                    self.stats[f"{where[1]}_lost.cpu"] += 1
                    core.lose(where[0], where[1], CPU)
                    self._touched.add(where[0])

    def is_cpu_tracked(self, key: ObjectKey) -> bool:
        where = self.part_of.get(key)
        return where is not None and bool(self._tiers(*where) & (1 << CPU))

    def _rerank_step(self, budget: int | None) -> None:
        """Re-rank queued units when the global inputs of ``C`` drifted (under the lock).

        The core re-ranks a unit when it changes or is accessed, and lazily re-checks a
        candidate whose ``H`` *rose*; but ``C`` also depends on the number of live
        sessions and on ``p_end``, which drift for every unit at once and can make every
        stored ``H`` too high (e.g. the first sessions of a fresh server were ranked with
        1, 2, 3 sessions). When either drifted noticeably since the last full re-rank, a
        sweep re-ranks every node, ``budget`` nodes at a time (janitor ticks), or all at
        once (``budget=None``) before the L1 eviction loop picks victims.
        """
        core = self.core
        if core is None:
            return
        if self._sweep is None:
            n = len(core.index.sessions)
            p = core.hit_model.end_probability
            n0, p0 = self._rank_basis
            if abs(n - n0) <= 0.1 * max(n0, 1) and abs(p - p0) <= 0.02:
                return
            self._rank_basis = (n, p)
            self._sweep = list(core.index.nodes)
            self.stats["rerank_sweeps"] += 1
        sweep = self._sweep
        take = len(sweep) if budget is None else min(budget, len(sweep))
        nodes = core.index.nodes
        for nk in sweep[len(sweep) - take :]:
            node = nodes.get(nk)
            if node is not None:
                core.queue.update(node)
        del sweep[len(sweep) - take :]
        if not sweep:
            self._sweep = None

    def evict_cpu(self, need_bytes: int) -> int:
        """Push units out of the CPU tier by lowest H until ``need_bytes`` are freed."""
        now = self.clock()
        freed = 0
        with self.lock:
            self._drain_locked()
            core = self.core
            if core is None:
                return 0
            self._rerank_step(None)
            store = core.store
            while freed < need_bytes:
                before = store.used[CPU]
                found = core.queue.victim(CPU)
                if found is None:
                    break
                anchor, rank = found
                store.evict(anchor, CPU, now, rank)
                gain = before - store.used[CPU]
                if gain <= 0:
                    break
                freed += gain
            self.stats["l1_policy_evictions"] += 1 if freed else 0
            actions = self._take_actions()
        self._run(actions)
        return freed

    # ============================================================ actions
    def _run(self, actions: Actions) -> None:
        if not actions:
            return
        if actions.disk_delete and self.adapter is not None:
            try:
                self.adapter.delete(list(dict.fromkeys(actions.disk_delete)))
            except Exception:
                logger.exception("HiState: disk delete failed")
        for nk, part, keys in actions.demote:
            self._demote(nk, part, keys)
        if actions.l1_delete:
            self._l1_delete(list(dict.fromkeys(actions.l1_delete)))

    def _l1_delete(self, keys: list[ObjectKey]) -> None:
        if self.l1 is None or not keys:
            return
        from lmcache.v1.distributed.error import L1Error

        self._expect_removals(keys)
        try:
            result = self.l1.delete(keys)
        except Exception:
            logger.exception("HiState: L1 delete failed")
            self._unexpect(keys)
            return
        locked = [k for k, err in result.items() if err == L1Error.KEY_IS_LOCKED]
        gone = [k for k, err in result.items() if err != L1Error.SUCCESS]
        self._unexpect(gone)
        if locked:
            with self._retry_lock:
                self._retry_l1.update(locked)

    def _demote(self, nk: int, part: str, keys: list[ObjectKey]) -> None:
        """Write L1 objects to the disk tier, then let them leave L1."""
        from lmcache.v1.distributed.error import L1Error

        adapter, l1 = self.adapter, self.l1
        if adapter is None or l1 is None:
            self.on_disk_written([], keys)
            return
        result = l1.reserve_read(keys)
        found = [k for k in keys if result[k][0] == L1Error.SUCCESS]
        objs = [result[k][1] for k in found]
        missing = [k for k in keys if k not in found]
        if missing:
            if found:
                l1.finish_read(found)
            self.stats[f"{part}_demote_missing"] += 1
            self.on_disk_written([], keys)
            return

        def done(ok: list[ObjectKey], failed: list[ObjectKey]) -> None:
            l1.finish_read(found)
            self._l1_delete(self._leaving_l1(ok))

        adapter.write_objects(found, [o.byte_array for o in objs], done)

    # ============================================================ restart
    def _recover_from_disk(self) -> None:
        """Rebuild the index from the disk tier's files (called once, core just made)."""
        adapter, core = self.adapter, self.core
        if adapter is None or core is None or self.model is None:
            return
        entries = adapter.entries()
        if not entries:
            return
        _model, world_size = self.model
        ours: dict[int, dict[str, list[ObjectKey]]] = {}
        meta: dict[int, tuple[int, bytes, bytes, str, float]] = {}
        orphans: list[ObjectKey] = []
        foreign = 0
        for key, entry in entries.items():
            if not self._ours(key):
                foreign += entry.size
                continue
            part = self._kind(key)
            want = {df.KIND_KV: KV, df.KIND_SNAPSHOT: SNAPSHOT}.get(entry.kind)
            if part is None or part != want or entry.depth < 0:
                orphans.append(key)
                continue
            nk = node_key(key.chunk_hash, key.cache_salt)
            ours.setdefault(nk, {}).setdefault(part, []).append(key)
            old = meta.get(nk)
            mtime = max(entry.mtime, old[4]) if old else entry.mtime
            meta[nk] = (entry.depth, entry.parent, key.chunk_hash, key.cache_salt, mtime)
        if foreign:
            store = core.store
            spec = store.tiers[DISK]
            store.tiers = (store.tiers[CPU], TierSpec(spec.name, max(0, spec.capacity - foreign)))
            logger.warning("HiState: %d bytes on disk belong to other models; left alone", foreign)
        groups = {k: v for k, v in self.kinds.items()}
        need = {
            KV: sum(1 for k in groups.values() if k == ATTENTION) * world_size,
            SNAPSHOT: sum(1 for k in groups.values() if k == RECURRENT) * world_size,
        }
        nbytes = {KV: self.kv_chunk_bytes, SNAPSHOT: self.snapshot_bytes}
        chains: dict[int, list[int] | None] = {}

        def chain_of(nk: int) -> list[int] | None:
            if nk in chains:
                return chains[nk]
            depth, parent_hash, _h, salt, _m = meta[nk]
            if depth == 0:
                result: list[int] | None = [nk]
            else:
                parent = node_key(parent_hash, salt)
                above = chain_of(parent) if parent in meta else None
                result = [*above, nk] if above is not None and len(above) == depth else None
            chains[nk] = result
            return result

        adopted = 0
        for part in (KV, SNAPSHOT):
            for nk in sorted(ours, key=lambda n: meta[n][0]):
                keys = ours[nk].get(part)
                if not keys:
                    continue
                chain = chain_of(nk)
                ok = (
                    chain is not None
                    and len(keys) == need[part]
                    and core.adopt(chain, part, DISK, nbytes[part], meta[nk][4])
                )
                if ok:
                    depth, parent_hash, chunk_hash, salt, _ = meta[nk]
                    parent = node_key(parent_hash, salt) if depth else None
                    self.links[nk] = Link(parent, parent_hash, depth, chunk_hash, salt)
                    for key in keys:
                        self._register(nk, part, key)
                    adopted += len(keys)
                else:
                    orphans += keys
        if orphans:
            adapter.delete(orphans)
        self.stats["restart_adopted"] += adopted
        self.stats["restart_orphans_removed"] += len(orphans)
        logger.info(
            "HiState restart: %d disk objects adopted, %d unreachable removed (a snapshot "
            "whose KV did not survive can never be hit)", adopted, len(orphans),
        )

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
                self._rerank_step(_RERANK_BUDGET)
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

    # ============================================================ reporting
    def plan(self, start_tokens: int, input_tokens: int) -> list[int]:
        """Token positions whose states HiState wants saved for a new segment."""
        with self.lock:
            if self.core is None:
                return []
            return self.core.snapshot_plan(start_tokens, input_tokens)

    def status(self) -> dict[str, Any]:
        with self.lock:
            core = self.core
            out: dict[str, Any] = {
                "policy": self.cfg.policy,
                "model": None if self.model is None else list(self.model),
                "chunk_tokens": self.chunk,
                "counters": dict(sorted(self.stats.items())),
                "pending_l1_retries": len(self._retry_l1),
                "queued_l1_events": len(self._events),
                "requests": len(self.requests),
            }
            if self.adapter is not None:
                out["disk"] = self.adapter.report_status()
            if core is None:
                return out
            store = core.store
            segment = self.last_segment_tokens or self.chunk
            choice = core.interval.choose(segment)
            out.update(
                {
                    "kv_chunk_bytes": self.kv_chunk_bytes,
                    "snapshot_bytes": self.snapshot_bytes,
                    "nodes": len(core.index),
                    "sessions": len(core.index.sessions),
                    "objects": len(self.part_of),
                    "tiers": {
                        TIER_NAMES[t]: {"used_bytes": store.used[t],
                                        "capacity_bytes": store.tiers[t].capacity}
                        for t in (CPU, DISK)
                    },
                    "pressure_factor": core.interval.pressure_factor,
                    "interval_tokens": choice.interval,
                    "interval_segment_tokens": segment,
                    "end_probability": core.hit_model.end_probability,
                    "kv_residence_s": core.residence.kv_ema,
                    "snapshot_residence_s": core.residence.snapshot_ema,
                }
            )
            return out

    def check(self) -> None:
        """Core invariants plus object bookkeeping consistency (tests)."""
        with self.lock:
            if self.core is None:
                return
            self.core.check()
            for nk, parts in self.objects.items():
                for part, keys in parts.items():
                    assert self._tiers(nk, part), (nk, part, keys)
                    for key in keys:
                        assert self.part_of.get(key) == (nk, part)


def _layout_bytes(desc: Any) -> int:
    total = 0
    for shape, dtype in zip(desc.shapes, desc.dtypes, strict=True):
        n = 1
        for d in shape:
            n *= int(d)
        total += n * _itemsize(dtype)
    return total


def _itemsize(dtype: Any) -> int:
    size = getattr(dtype, "itemsize", None)
    if size is None:
        import torch

        size = torch.empty((), dtype=dtype).element_size()
    return int(size)

