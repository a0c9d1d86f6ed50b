"""LMCache's objects as the core knows them: ``ObjectKey`` <-> (chunk node, part), the
chains that place each chunk in its prefix, the model's group kinds and the core's sizing.

The core knows chunk nodes (int keys) with two parts, KV (the attention object group(s))
and snapshot (the recurrent group(s)); LMCache knows objects. Two structures sit between
them, both read and changed only within the runtime's step (``HiStateRuntime.step``), with
no lock of their own, and neither calls anything above it (the runtime drives them):

* ``ModelCore``: the one ``HiStateCache`` of this server, created for the first hybrid
  model seen, and what tells that model's objects apart: which object groups hold
  attention KV and which the recurrent state (learned from the registered layouts'
  ``group_kinds``, never from group ids), and the bytes of each part of one chunk. Objects
  of other models (or of a model without both kinds) are left to the fallback LRU in L1.
* ``ObjectMap``, three maps:

  * ``links``: node key -> ``Link``, where a chunk sits in its prefix (depth, parent),
    which the chunk hash alone does not say. Every request's ordered chunk-hash chain is
    linked (``link_chain``); a STORE also leaves its ``StoreRecord`` on the chunks it
    stores, so objects committed later are traced back to their request (the runtime's
    commit placement). LRU-bounded to ``_LINKS_MAX``: links of nodes the core still holds
    are kept.
  * ``parts``: node key -> part -> its objects (several with tensor parallelism, one per
    shard), and ``part_of``, the inverse: object -> (node key, part).

Where a part lives (its tiers) is the core's answer (``HiStateCache.tiers_of``), never
stored here. The disk header of an object (``object_meta``: kind, depth, parent chunk hash)
is read from the links when a write is decided (``TierActions.header``) and travels down
with the write, so the disk tier's I/O threads never call in here.

Invariants of ``ModelCore``: ``core`` is created at most once; once it exists ``model``,
``kinds``, ``kv_chunk_bytes`` and ``snapshot_bytes`` describe it and never change; the core's
disk capacity counts payload bytes only (``payload_capacity``).

Invariants of ``ObjectMap`` (``check``, O(n)):

1. every registered part is held by the core in at least one tier;
2. ``parts`` and ``part_of`` are inverse maps, and no part is registered with no object;
3. every registered node has its ``Link`` (trimming keeps the links of nodes in the core);
4. a link at depth 0 has no parent, a deeper one has one; a link's ``StoreRecord``, if
   any, names the link's node at the link's depth of the record's chain.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmcache_histate.backends.server.disk import file_format as df

from lmcache_histate.config import HiStateConfig, cache_config
from lmcache_histate.core.cache import CacheConfig, HiStateCache
from lmcache_histate.core.model_geometry import snapshot_tokens
from lmcache_histate.core.tiers import (
    KV,
    SNAPSHOT,
    PlacementRules,
    ServerTier,
    TierSpec,
)

from .stats import Stats

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey

logger = logging.getLogger("lmcache_histate.runtime")

__all__ = ["Link", "ModelCore", "ObjectMap", "StoreRecord", "core_config", "node_key",
           "payload_capacity"]

# ====================================================================== the model
ATTENTION, RECURRENT = "attention", "recurrent"
_PART_OF_KIND = {ATTENTION: KV, RECURRENT: SNAPSHOT}


def core_config(
    cfg: HiStateConfig, chunk: int, kv_chunk_bytes: int, snapshot_bytes: int, disk_bytes: int
) -> CacheConfig:
    """The core's configuration for one model: the YAML's rule knobs (``config.cache_config``,
    the mapping the simulator's HiState rows use too: ``config`` NOTE 9) over the server's
    two tiers (KV and final snapshots in CPU memory, intermediate snapshots and final copies
    on disk; the engine's own block pool is not a tier here). ``disk_bytes``: the disk
    tier's payload capacity (``payload_capacity``)."""
    return cache_config(
        cfg.knobs,
        chunk_tokens=chunk,
        kv_chunk_bytes=kv_chunk_bytes,
        snapshot_bytes=snapshot_bytes,
        tiers=(TierSpec("cpu", int(cfg.cpu_bytes * cfg.cpu_fill)), TierSpec("disk", disk_bytes)),
        rules=PlacementRules(kv_tier=ServerTier.CPU, snapshot_tier=ServerTier.DISK,
                             final_tier=ServerTier.CPU, final_copy_tier=ServerTier.DISK),
    )


class ModelCore:
    """The one ``HiStateCache`` of this server and the identity of its model's objects."""

    def __init__(self, cfg: HiStateConfig, stats: Stats) -> None:
        self.cfg = cfg
        self.stats = stats
        self.chunk = cfg.chunk_tokens  # the server's chunk size replaces it (attach_server)
        self.core: HiStateCache | None = None
        self.model: tuple[str, int] | None = None
        self.kinds: dict[int, str] = {}
        self.kv_chunk_bytes = 0
        self.snapshot_bytes = 0
        self._foreign_warned: set[tuple[str, int]] = set()
        self._unsupported: set[tuple[str, int]] = set()
        # The configured geometry, reported in /status for the connector's start-up check;
        # read once (a model path means parsing config.json, and /metrics polls status()).
        geometry = cfg.geometry
        self.configured_geometry: dict[str, Any] = {
            "model": cfg.model,
            "snapshot_bytes": geometry.snapshot_bytes,
            "kv_bytes_per_token": geometry.kv_bytes_per_token,
            "state_dtypes": [t.dtype for t in geometry.state_tensors],
        }

    # ------------------------------------------------------------ object identity
    def part(self, key: ObjectKey) -> str | None:
        """``KV`` or ``SNAPSHOT`` for an object of a known group kind, else None."""
        return _PART_OF_KIND.get(self.kinds.get(key.object_group_id) or "")

    def ours(self, key: ObjectKey) -> bool:
        return self.model == (key.model_name, key.kv_rank >> 24 or 1)

    def part_bytes(self, part: str) -> int:
        return self.kv_chunk_bytes if part == KV else self.snapshot_bytes

    def objects_per_part(self, part: str) -> int:
        """How many objects (one per group of the part's kind, per shard) make one part."""
        kind = ATTENTION if part == KV else RECURRENT
        world_size = self.model[1] if self.model is not None else 1
        return sum(1 for k in self.kinds.values() if k == kind) * world_size

    # ------------------------------------------------------------------ creation
    def ensure(
        self,
        ctx: Any,
        model_name: str,
        world_size: int,
        disk_capacity: int,
    ) -> HiStateCache | None:
        """The core for ``(model_name, world_size)``: created from its registered layout
        the first time a hybrid model is seen; None for any other model."""
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
        if ctx is None or (model_name, world_size) in self._unsupported:
            return None
        registry = ctx.layout_desc_registry
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
        disk_core = payload_capacity(disk_capacity, model_name, min(kv, snap))
        cache_cfg = core_config(cfg, self.chunk, kv, snap, disk_core)
        self.core = HiStateCache(cache_cfg)
        self.model = (model_name, world_size)
        self.kinds = kinds
        self.kv_chunk_bytes, self.snapshot_bytes = kv, snap
        geometry = self.configured_geometry
        logger.info(
            "HiState core for %s (world size %d): group kinds %s, KV %d B/chunk, snapshot "
            "%d B (N_s = %.1f tokens; config model %s: N_s = %.1f), tiers cpu %d B, disk %d B",
            model_name, world_size, attn.group_kinds, kv, snap, cache_cfg.snapshot_tokens,
            cfg.model, snapshot_tokens(geometry["snapshot_bytes"], geometry["kv_bytes_per_token"]),
            cache_cfg.tiers[ServerTier.CPU].capacity, disk_core,
        )
        return self.core

    def resize_disk(self, disk_bytes: int, now: float) -> None:
        """The disk tier's real capacity changed (ENOSPC, space freed): resize the core's.

        The core evicts by lowest H until what it holds fits; units that cannot go (pinned
        by a request in flight) keep the capacity at what is held (``set_capacity``).
        """
        if self.core is None or self.model is None:
            return
        target = payload_capacity(
            disk_bytes, self.model[0], min(self.kv_chunk_bytes, self.snapshot_bytes)
        )
        self.core.set_capacity(ServerTier.DISK, target, now)
        self.stats["disk_capacity_changes"] += 1


def payload_capacity(disk_bytes: int, model_name: str, smallest_object: int) -> int:
    """The core's disk capacity: it counts payload bytes; files also carry a header."""
    header = df.header_size(df.ObjectId(model_name, 0, 0, b"\0" * 32), b"\0" * 32) + 64
    return max(0, disk_bytes - header * (disk_bytes // (smallest_object + header)))


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


# ================================================================= the object map
_LINKS_MAX = 1 << 21
_CPU_BIT, _DISK_BIT = 1 << ServerTier.CPU, 1 << ServerTier.DISK


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
    request_chunks: int = 0  # whole chunks of the request's tokens: its final state's end


@dataclass(slots=True)
class Link:
    """Where a chunk sits in its prefix: what the chunk hash alone does not say."""

    parent: int | None
    parent_hash: bytes
    depth: int
    chunk_hash: bytes
    salt: str
    record: StoreRecord | None = None


class ObjectMap:
    """``ObjectKey`` <-> (node key, part), and each chunk's ``Link`` (module doc)."""

    def __init__(self, model: ModelCore) -> None:
        self.model = model
        self.links: OrderedDict[int, Link] = OrderedDict()
        self.parts: dict[int, dict[str, list[ObjectKey]]] = {}
        self.part_of: dict[ObjectKey, tuple[int, str]] = {}

    # ================================================================ chains
    def link_chain(
        self, hashes: Sequence[bytes], salt: str, record: StoreRecord | None, start: int = 0
    ) -> list[int]:
        """Record a request's chain; returns its node keys. A STORE's ``record`` is left on
        the chunks from ``start`` on (the ones it stores)."""
        chain: list[int] = []
        parent: int | None = None
        parent_hash = b""
        links = self.links
        for depth, h in enumerate(hashes):
            nk = node_key(h, salt)
            link = links.get(nk)
            if link is None:
                link = Link(parent, parent_hash, depth, h, salt)
                links[nk] = link
            else:
                links.move_to_end(nk)
            if record is not None and depth >= start:
                link.record = record
            chain.append(nk)
            parent, parent_hash = nk, h
        self._trim()
        return chain

    def _trim(self) -> None:
        core = self.model.core
        scans = 0
        while len(self.links) > _LINKS_MAX and scans < 1024:
            nk, _link = next(iter(self.links.items()))
            scans += 1
            if core is not None and nk in core:
                self.links.move_to_end(nk)
            else:
                del self.links[nk]

    def link_of(self, key: ObjectKey) -> Link | None:
        return self.links.get(node_key(key.chunk_hash, key.cache_salt))

    def object_meta(self, key: ObjectKey) -> tuple[int, int, bytes]:
        """(kind, depth, parent chunk hash) for the disk header of ``key``."""
        link = self.link_of(key)
        part = self.model.part(key)
        kind = df.KIND_KV if part == KV else df.KIND_SNAPSHOT if part == SNAPSHOT else df.KIND_OTHER
        if link is None:
            return kind, -1, b""
        return kind, link.depth, link.parent_hash

    # ================================================================ objects
    def __len__(self) -> int:
        return len(self.part_of)

    def nodes(self) -> list[int]:
        """The node keys with registered objects."""
        return list(self.parts)

    def keys(self, nk: int, part: str) -> list[ObjectKey]:
        return list(self.parts.get(nk, {}).get(part, ()))

    def has_part(self, nk: int, part: str) -> bool:
        return bool(self.parts.get(nk, {}).get(part))

    def where(self, key: ObjectKey) -> tuple[int, str] | None:
        """``(node key, part)`` of a registered object."""
        return self.part_of.get(key)

    def register(self, nk: int, part: str, key: ObjectKey) -> None:
        keys = self.parts.setdefault(nk, {}).setdefault(part, [])
        if key not in keys:
            keys.append(key)
        self.part_of[key] = (nk, part)

    def unregister_part(self, nk: int, part: str) -> list[ObjectKey]:
        parts = self.parts.get(nk)
        if not parts:
            return []
        keys = parts.pop(part, [])
        if not parts:
            del self.parts[nk]
        for key in keys:
            self.part_of.pop(key, None)
        return keys

    def map_recovered(self, nk: int, link: Link, part: str, keys: Sequence[ObjectKey]) -> None:
        """A part found again on disk after a restart (``recovery``), which the core now
        holds (``HiStateCache.recover``): its chunk's link and its objects."""
        self.links[nk] = link
        for key in keys:
            self.register(nk, part, key)

    def tiers(self, nk: int, part: str) -> int:
        """Bitmask of the tiers the core holds this part in (0: nowhere, or no core)."""
        core = self.model.core
        return core.tiers_of(nk, part) if core is not None else 0

    def key_tiers(self, key: ObjectKey) -> int:
        """``tiers`` of the part ``key`` belongs to (0 for an unregistered object)."""
        where = self.part_of.get(key)
        return self.tiers(*where) if where is not None else 0

    def not_cpu_tracked(self, keys: Iterable[ObjectKey]) -> list[ObjectKey]:
        """The ``keys`` whose part the core does not hold on the CPU tier (unregistered
        objects included), in their order: the L1 copies HiState no longer keeps."""
        return [k for k in keys if not self.key_tiers(k) & _CPU_BIT]

    # ================================================================ checks
    def check(self) -> None:
        """Assert the invariants of the module docstring (each message names its number)."""
        for nk, parts in self.parts.items():
            assert nk in self.links, f"invariant 3: node {nk:#x} has objects and no link"
            for part, keys in parts.items():
                assert keys, f"invariant 2: {part} of node {nk:#x} registered with no object"
                assert self.tiers(nk, part), f"invariant 1: {part} of node {nk:#x} held nowhere"
                for key in keys:
                    assert self.part_of.get(key) == (nk, part), \
                        f"invariant 2: part_of[{key}] is not ({nk:#x}, {part})"
        held = sum(len(keys) for parts in self.parts.values() for keys in parts.values())
        assert len(self.part_of) == held, "invariant 2: part_of holds an object no part holds"
        for nk, link in self.links.items():
            assert (link.parent is None) == (link.depth == 0), \
                f"invariant 4: node {nk:#x} at depth {link.depth} with parent {link.parent}"
            rec = link.record
            assert rec is None or not rec.chain or rec.chain[link.depth] == nk, \
                f"invariant 4: node {nk:#x}'s STORE record has another node at {link.depth}"
