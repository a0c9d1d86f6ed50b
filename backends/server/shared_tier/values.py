"""One object as one value in the cluster: the disk tier's file layout, verified on read.

A value is exactly what the disk tier writes to a file (``disk.file_format``): the header
(magic, version, kind, depth, payload length, payload crc32, the object's key, its
parent, a header crc) followed by the payload. A read checks the header crc, that the
header names the object asked for, that the lengths match the buffer and the value, and
the payload crc (also against the crc the entry was committed with): any mismatch is a
miss and the value is never copied out as the object (``verify``). Values are keyed by the
object id, so a value names one object; the header stays authoritative.
"""

from __future__ import annotations

import zlib
from typing import Any

from ..disk import file_format as df

__all__ = ["encode", "verify"]


def encode(oid: df.ObjectId, payload: Any, kind: int, depth: int,
           parent: bytes) -> tuple[bytes, int]:
    """``(value, payload crc32)`` of one object."""
    view = memoryview(payload).cast("B")
    crc = zlib.crc32(view)
    header = df.encode_header(oid, kind, depth, parent, len(view), crc)
    return header + view.tobytes(), crc


def verify(value: bytes | None, oid: df.ObjectId, dst: Any, crc: int | None) -> str:
    """Copy the payload of ``value`` into ``dst`` if it is ``oid``'s, whole and intact;
    returns "" when copied, else why not (nothing is copied then)."""
    if value is None:
        return "no such value"
    try:
        header, end = df.parse_header(value)
    except df.FormatError as exc:
        return str(exc)
    view = memoryview(dst).cast("B")
    if header.oid != oid:
        return "value holds another object"
    if header.payload_len != len(view) or len(value) != end + header.payload_len:
        return (f"payload is {header.payload_len} bytes, value {len(value) - end}, "
                f"buffer {len(view)}")
    payload = memoryview(value)[end:]
    if zlib.crc32(payload) != header.payload_crc or (crc is not None and crc != header.payload_crc):
        return "payload checksum mismatch"
    view[:] = payload
    return ""
