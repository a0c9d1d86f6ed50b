"""The disk tier's in-memory entries, and their rebuild from an own folder at start.

One ``DiskEntry`` per object file the tier indexes; lookups read these, never the disk.
An ``ObjectMeta`` is what a write carries down from whoever decided it (the HiState
runtime, under its lock, at the routing decision): the header fields that the payload
alone does not say, and the score a shared index commits the object with.
``recover_entries`` rebuilds them from the files of a folder only this server uses
(``file_format.scan``: leftover temporaries and invalid files are removed, nothing else
is touched). A folder shared by several servers is never scanned this way
(``tier`` NOTE 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from lmcache.v1.distributed.api import ObjectKey

from . import file_format as df

__all__ = ["UNKNOWN_META", "DiskEntry", "ObjectMeta", "recover_entries", "to_key"]


def to_key(oid: df.ObjectId) -> ObjectKey:
    """The LMCache ``ObjectKey`` a file's id names (``df.ObjectId.of`` inverted)."""
    return ObjectKey(chunk_hash=oid.chunk_hash, model_name=oid.model_name,
                     kv_rank=oid.kv_rank, object_group_id=oid.object_group_id,
                     cache_salt=oid.cache_salt)


class ObjectMeta(NamedTuple):
    """What a write of one object carries down to the disk tier.

    ``kind`` / ``depth`` / ``parent`` go into the file header (``file_format``: a restart
    rebuilds the prefix tree from them); ``score`` is the core's ``(C, M)`` a shared index
    commits the object with (``shared_link`` NOTE 2), None without one.
    """

    kind: int
    depth: int
    parent: bytes
    score: tuple[float, float] | None = None


UNKNOWN_META = ObjectMeta(df.KIND_OTHER, -1, b"")
"""The header of a write nobody described (a stock ``lmcache server``, no runtime)."""


@dataclass(slots=True)
class DiskEntry:
    """One object on disk."""

    size: int  # file size (header + payload): what capacity accounting counts
    payload_len: int
    kind: int
    depth: int
    parent: bytes
    mtime: float


def recover_entries(root: Path) -> tuple[dict[ObjectKey, DiskEntry], df.ScanResult]:
    """The entries of ``root``'s valid object files, and what the scan removed."""
    result = df.scan(root)
    entries = {
        to_key(header.oid): DiskEntry(
            header.file_size, header.payload_len, header.kind, header.depth, header.parent,
            mtime,
        )
        for _path, header, mtime in result.objects
    }
    return entries, result
