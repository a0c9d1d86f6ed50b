"""The policy core for the server's one hybrid model, sized from its registered layouts.

HiState manages one hybrid model per server: the first one seen with both attention and
recurrent object groups gets the core; objects of other models (or of a model without both
kinds) are left to the fallback LRU in L1. ``ModelCore`` owns that core and what tells the
model's objects apart: which object groups hold attention KV and which the recurrent state
(learned from the registered layouts' ``group_kinds``, never from group ids), and the bytes
of each part of one chunk. Callers hold the runtime lock.

Invariants: ``core`` is created at most once; once it exists ``model``, ``kinds``,
``kv_chunk_bytes`` and ``snapshot_bytes`` describe it and never change; the core's disk
capacity counts payload bytes only (``payload_capacity``).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

from lmcache_histate.backends.server.disk import file_format as df

from lmcache_histate.config import HiStateConfig, cache_config
from lmcache_histate.core.cache import CacheConfig, HiStateCache
from lmcache_histate.core.model_geometry import snapshot_tokens
from lmcache_histate.core.tiers import (
    KV,
    SNAPSHOT,
    PlacementListener,
    PlacementRules,
    ServerTier,
    TierSpec,
)

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey

logger = logging.getLogger("lmcache_histate.runtime")

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

    def __init__(self, cfg: HiStateConfig, stats: Counter[str]) -> None:
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
        listener: PlacementListener,
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
        self.core = HiStateCache(cache_cfg, listener=listener)
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
