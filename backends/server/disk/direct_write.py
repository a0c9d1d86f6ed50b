"""The disk tier's O_DIRECT write: one object file through an aligned bounce buffer.

Why O_DIRECT (NOTE 1): a buffered write copies the object into the page cache and fsync then
waits for the kernel's writeback of dirty pages, which on the machines measured reached
20-40 % of the device's sequential bandwidth for 51.5 MB snapshots (dirty-page throttling,
writeback in small pieces; benchmarks/README.md "live"). O_DIRECT hands the device aligned
4 MiB writes, as ``dd oflag=direct`` does.

How: O_DIRECT needs the memory address, length and file offset aligned to the logical block,
so the bytes pass through a page-aligned bounce buffer (one per I/O thread, reused: an
anonymous mmap is page aligned), the crc32 is computed on the bounce buffer while it is
cache-hot, and the file's tail is padded and then cut back with ftruncate. The header holds
the payload crc, known only at the end, so the first aligned block (header + the first
payload bytes) is written last, at offset 0.

Invariants: the file's bytes equal a buffered write of ``header + payload`` (tested byte for
byte at every alignment edge); a crash before the caller's rename leaves only a temporary
file, removed by the disk tier's scan, as with buffered writes.

NOTE 2: the trade-off: the page cache no longer holds a copy of what was just written, so a
load right after a store reads the device (the tier is measured as a disk, not as spare
DRAM); ``disk_direct_io: false`` keeps buffered writes.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

__all__ = ["write_direct"]

_ALIGN = 4096
_DIRECT_CHUNK = 4 << 20
_bounce = threading.local()


def _bounce_buffer(size: int) -> memoryview:
    """This thread's page-aligned scratch buffer of at least ``size`` bytes."""
    buf = getattr(_bounce, "buf", None)
    if buf is None or len(buf) < size:
        buf = memoryview(mmap.mmap(-1, size))
        _bounce.buf = buf
    return buf


def write_direct(
    tmp: Path, view: memoryview, hlen: int, make_header: Callable[[int], bytes], fsync: bool
) -> int | None:
    """Write ``make_header(crc32(view)) + view`` to ``tmp`` with O_DIRECT; returns its size.

    ``make_header`` must return ``hlen`` bytes whatever the crc. Returns None, having written
    nothing usable, if the filesystem refuses O_DIRECT (the caller writes buffered instead);
    raises any other ``OSError`` (ENOSPC included; the caller removes ``tmp``).
    """
    first = -(-hlen // _ALIGN) * _ALIGN  # the aligned block(s) holding the header
    head = min(first - hlen, len(view))  # payload bytes that share them
    buf = _bounce_buffer(max(_DIRECT_CHUNK, first))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise
    try:
        crc = zlib.crc32(view[:head])
        done, pos = head, first
        while done < len(view):
            n = min(_DIRECT_CHUNK, len(view) - done)
            buf[:n] = view[done : done + n]
            crc = zlib.crc32(buf[:n], crc)
            _pwrite_aligned(fd, buf, n, pos)
            done += n
            pos += n
        header = make_header(crc)
        if len(header) != hlen:
            raise ValueError(f"header is {len(header)} bytes, expected {hlen}")
        buf[:hlen] = header
        buf[hlen : hlen + head] = view[:head]
        _pwrite_aligned(fd, buf, hlen + head, 0)
        os.ftruncate(fd, hlen + len(view))
        if fsync:
            os.fsync(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return None  # some filesystems accept the flag at open and refuse the write
    finally:
        os.close(fd)
    return hlen + len(view)


def _pwrite_aligned(fd: int, buf: memoryview, n: int, pos: int) -> None:
    """Write ``buf[:n]`` at ``pos``, zero-padded to the alignment (cut back by ftruncate)."""
    padded = -(-n // _ALIGN) * _ALIGN
    if padded > n:
        buf[n:padded] = bytes(padded - n)
    done = 0
    while done < padded:  # a short write (disk nearly full) is retried: the retry says ENOSPC
        n = os.pwrite(fd, buf[done:padded], pos + done)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n
