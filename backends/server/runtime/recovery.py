"""Restart recovery: the core's index rebuilt from the disk tier's files.

Each file header carries the object's kind, depth and parent chunk hash; objects whose
full chain and all shards survived are adopted on the disk tier, the rest are deleted
(a snapshot whose KV did not survive can never be hit).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lmcache_histate.backends.server.disk import file_format as df

from lmcache_histate.core.tiers import KV, SNAPSHOT, ServerTier

from .objects import Link, ModelCore, ObjectMap, node_key
from .stats import Stats

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache_histate.backends.server.disk.tier import HiStateDiskAdapter

logger = logging.getLogger("lmcache_histate.runtime")


def recover_from_disk(
    disk: HiStateDiskAdapter,
    model: ModelCore,
    objects: ObjectMap,
    stats: Stats,
    now: float,
) -> None:
    """Rebuild the core's index from the disk tier's files (once, the core just made).

    Objects of other models keep their bytes: the core's disk tier shrinks by them.
    """
    core = model.core
    if core is None or model.model is None:
        return
    entries = disk.entries()
    if not entries:
        return
    ours: dict[int, dict[str, list[ObjectKey]]] = {}
    meta: dict[int, tuple[int, bytes, bytes, str, float]] = {}
    orphans: list[ObjectKey] = []
    foreign = 0
    for key, entry in entries.items():
        if not model.ours(key):
            foreign += entry.size
            continue
        part = model.part(key)
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
        disk_tier = ServerTier.DISK
        core.set_capacity(disk_tier, max(0, core.stats().capacity_bytes[disk_tier] - foreign), now)
        logger.warning("HiState: %d bytes on disk belong to other models; left alone", foreign)
    chains_of: dict[int, list[int] | None] = {}

    def chain_of(nk: int) -> list[int] | None:
        if nk in chains_of:
            return chains_of[nk]
        depth, parent_hash, _h, salt, _m = meta[nk]
        if depth == 0:
            result: list[int] | None = [nk]
        else:
            parent = node_key(parent_hash, salt)
            above = chain_of(parent) if parent in meta else None
            result = [*above, nk] if above is not None and len(above) == depth else None
        chains_of[nk] = result
        return result

    adopted = 0
    for part in (KV, SNAPSHOT):
        need, nbytes = model.objects_per_part(part), model.part_bytes(part)
        for nk in sorted(ours, key=lambda n: meta[n][0]):
            keys = ours[nk].get(part)
            if not keys:
                continue
            chain = chain_of(nk)
            ok = (
                chain is not None
                and len(keys) == need
                and core.recover(chain, part, ServerTier.DISK, nbytes, meta[nk][4])
            )
            if ok:
                depth, parent_hash, chunk_hash, salt, _ = meta[nk]
                parent = node_key(parent_hash, salt) if depth else None
                link = Link(parent, parent_hash, depth, chunk_hash, salt)
                objects.map_recovered(nk, link, part, keys)
                adopted += len(keys)
            else:
                orphans += keys
    if orphans:
        disk.delete(orphans)
    stats["restart_adopted"] += adopted
    stats["restart_orphans_removed"] += len(orphans)
    logger.info(
        "HiState restart: %d disk objects adopted, %d unreachable removed (a snapshot "
        "whose KV did not survive can never be hit)", adopted, len(orphans),
    )
