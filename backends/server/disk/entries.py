"""The disk tier's in-memory entries, and their rebuild from an own folder at start.

One ``DiskEntry`` per object file the tier indexes; lookups read these, never the disk.
``recover_entries`` rebuilds them from the files of a folder only this server uses
(``file_format.scan``: leftover temporaries and invalid files are removed, nothing else
is touched). A folder shared by several servers is never scanned this way
(``tier`` NOTE 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lmcache.v1.distributed.api import ObjectKey

from . import file_format as df
from .keys import to_key

__all__ = ["DiskEntry", "recover_entries"]


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
