"""Restart recovery: the core's index rebuilt from the disk tier's files.

Each file header carries the object's kind, depth and parent chunk hash; objects whose
full chain and all shards survived are adopted on the disk tier, the rest are deleted
(a snapshot whose KV did not survive can never be hit).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lmcache_histate.backends.server.disk import file_format as df

from lmcache_histate.core.placement import KV, SNAPSHOT, TierSpec

from .chains import Link, node_key
from .object_map import ATTENTION, CPU, DISK, RECURRENT

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey

logger = logging.getLogger("lmcache_histate.runtime")


class RecoveryMixin:
    """``_recover_from_disk`` of ``HiStateRuntime``."""

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
