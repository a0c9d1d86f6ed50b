"""The policy core for the server's model, sized from its registered layouts.

HiState manages one hybrid model per server: the first one seen with both attention and
recurrent object groups gets the core; the others are left to the fallback LRU in L1.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from lmcache_histate.backends.server.disk import file_format as df

from lmcache_histate.core.cache import CacheConfig, HiStateCache
from lmcache_histate.core.placement import PlacementRules, TierSpec

from .object_map import ATTENTION, CPU, DISK, RECURRENT

logger = logging.getLogger("lmcache_histate.runtime")


class CoreSetupMixin:
    """``_ensure_core`` of ``HiStateRuntime``."""

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
            disk_capacity = self.adapter.capacity_bytes()
        disk_core = _payload_capacity(disk_capacity, model_name, min(kv, snap))
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
        geometry = self.configured_geometry
        logger.info(
            "HiState core for %s (world size %d): group kinds %s, KV %d B/chunk, snapshot "
            "%d B (N_s = %.1f tokens; config model %s: N_s = %.1f), tiers cpu %d B, disk %d B",
            model_name, world_size, attn.group_kinds, kv, snap, snap / max(1, kv // self.chunk),
            cfg.model, geometry["snapshot_bytes"] / geometry["kv_bytes_per_token"],
            cache_cfg.tiers[0].capacity, disk_core,
        )
        self._recover_from_disk()
        return self.core

    def on_disk_capacity(self, disk_bytes: int) -> None:
        """The disk tier's real capacity changed (ENOSPC, space freed): resize the core's.

        NOTE 1: the core has no resize API (lmcache_histate/core is not the backends'
        to change); its tiers are frozen ``TierSpec``s, so the disk one is replaced and
        ``make_room(DISK, 0)`` evicts by lowest H until what it holds fits. Units that
        cannot go (pinned by a request in flight) keep the capacity at what is held.
        """
        with self.lock:
            core = self.core
            if core is None or self.model is None:
                return
            store = core.store
            target = _payload_capacity(
                disk_bytes, self.model[0], min(self.kv_chunk_bytes, self.snapshot_bytes)
            )
            store.tiers = _with_capacity(store.tiers, DISK, target)
            store.make_room(DISK, 0, self.clock())
            if store.used[DISK] > target:  # pinned units stay; hold what is held
                store.tiers = _with_capacity(store.tiers, DISK, store.used[DISK])
            self.stats["disk_capacity_changes"] += 1
            actions = self._take_actions()
        self._run(actions)


def _with_capacity(tiers: tuple[TierSpec, ...], tier: int, nbytes: int) -> tuple[TierSpec, ...]:
    return tuple(
        replace(spec, capacity=nbytes) if t == tier else spec for t, spec in enumerate(tiers)
    )


def _payload_capacity(disk_bytes: int, model_name: str, smallest_object: int) -> int:
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
