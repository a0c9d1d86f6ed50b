"""Where each chunk sits in its prefix: the chains of STORE and LOOKUP requests.

A chunk hash alone does not say its depth or parent, which the core's index and the disk
file headers need. Every request's ordered chunk-hash chain is recorded as ``Link``s
(LRU-bounded, nodes still in the core are kept); a STORE also leaves its ``StoreRecord`` on
the chunks it stores, so objects committed later can be traced back to their request.
``ChunkChains`` owns the links; callers hold the runtime lock. That includes the disk
headers (``object_meta``): ``TierActions.header`` reads them when a write is decided, and the
header travels down with the write, so the disk tier's I/O threads never call in here.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmcache_histate.backends.server.disk import file_format as df

from lmcache_histate.core.placement import KV, SNAPSHOT

from .model_core import ModelCore

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey

_LINKS_MAX = 1 << 21


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


class ChunkChains:
    """The recorded ``Link`` of every chunk seen in a request chain (LRU-bounded)."""

    def __init__(self, model: ModelCore) -> None:
        self.model = model
        self.links: OrderedDict[int, Link] = OrderedDict()

    def link_chain(
        self, hashes: Sequence[bytes], salt: str, record: StoreRecord | None, start: int = 0
    ) -> list[int]:
        """Record a request's chain; returns its node keys. A STORE's ``record`` is left on
        the chunks from ``start`` on (the ones it stores)."""
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

    def restore(self, nk: int, link: Link) -> None:
        """A chunk found again on disk after a restart (``recovery``)."""
        self.links[nk] = link

    def object_meta(self, key: ObjectKey) -> tuple[int, int, bytes]:
        """(kind, depth, parent chunk hash) for the disk header of ``key``."""
        link = self.link_of(key)
        part = self.model.part(key)
        kind = df.KIND_KV if part == KV else df.KIND_SNAPSHOT if part == SNAPSHOT else df.KIND_OTHER
        if link is None:
            return kind, -1, b""
        return kind, link.depth, link.parent_hash


def chain_hashes(ctx: Any, token_ids: Sequence[int], end: int) -> list[bytes]:
    """The chunk hashes of ``token_ids[:end]`` with the server's token hasher."""
    hasher = ctx.token_hasher
    raw = hasher.compute_chunk_hashes(list(token_ids), end=end)
    return [hasher.hash_to_bytes(h) for h in raw]
