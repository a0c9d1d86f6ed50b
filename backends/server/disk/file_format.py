"""On-disk format of the HiState disk tier: one self-describing file per object.

Layout (little-endian)::

    fixed header  <4s H B B i Q I H H I   magic "HSD1", version, kind, flags, depth,
                                          payload length, payload crc32, key length,
                                          parent length, header crc32
    key           key length bytes        the object's identity (see ``ObjectId``)
    parent        parent length bytes     chunk hash of the previous chunk (b"" at depth 0)
    payload       payload length bytes    the raw object bytes, exactly as held in L1

``kind`` and ``depth``/``parent`` let a restarted server rebuild the prefix tree from the
files alone (a chunk hash is a rolling prefix hash: it names a prefix but does not say
which chunk precedes it). The header crc covers the fixed header (with the field zeroed),
key and parent, so a torn or overwritten header is detected before any payload is read;
the payload crc32 is checked on every load. A file is written under a temporary name,
fsynced and renamed into place, so a reader (or a restart) never sees a partial file
under a final name; leftover temporary files are removed by ``scan``.

Folder layout: ``<root>/<first byte of the chunk hash, 2 hex>/<file_name(oid)>``; names
are bounded and collision-free (NOTE 1) and ``scan`` touches only names of this layout.

Writes are buffered, or with ``direct`` O_DIRECT (``_write_direct``, NOTE 2): the bytes
pass through a page-aligned bounce buffer (one per I/O thread, reused: an anonymous mmap
is page aligned), because O_DIRECT needs the memory address, length and file offset
aligned to the logical block; the crc32 is computed on the bounce buffer while it is
cache-hot, and the file's tail is padded and then cut back with ftruncate. The header
holds the payload crc, known only at the end, so the first aligned block (header + the
first payload bytes) is written last, at offset 0. Invariant: the file's bytes equal a
buffered write of ``header + payload`` (tested byte for byte at every alignment edge); a
crash before the rename leaves only a temporary file, removed by ``scan``, as with
buffered writes.

NOTE 2 (why O_DIRECT): a buffered write copies the object into the page cache and fsync
then waits for the kernel's writeback of dirty pages, which on the machines measured
reached 20-40 % of the device's sequential bandwidth for 51.5 MB snapshots (dirty-page
throttling, writeback in small pieces; benchmarks/README.md "live"). O_DIRECT hands the
device aligned 4 MiB writes, as ``dd oflag=direct`` does.

NOTE 3: the trade-off: the page cache no longer holds a copy of what was just written, so a
load right after a store reads the device (the tier is measured as a disk, not as spare
DRAM); ``disk_direct_io: false`` keeps buffered writes.

Pure Python (no lmcache import): ``ObjectId.of`` reads an LMCache ``ObjectKey``'s fields
by name.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import hashlib
import itertools
import mmap
import os
import re
import struct
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

MAGIC = b"HSD1"
VERSION = 1
SUFFIX = ".hsf"
TMP_SUFFIX = ".tmp"
_FIXED = struct.Struct("<4sHBBiQIHHI")
_KEY = struct.Struct("<IIH")  # kv_rank, object_group_id, chunk hash length
_READ_BLOCK = 8 << 20
_ALIGN = 4096
_DIRECT_CHUNK = 4 << 20

KIND_KV = 0
KIND_SNAPSHOT = 1
KIND_OTHER = 2


class ObjectId(NamedTuple):
    """Identity of a stored object (mirrors lmcache's ``ObjectKey`` fields)."""

    model_name: str
    kv_rank: int
    object_group_id: int
    chunk_hash: bytes
    cache_salt: str = ""

    @classmethod
    def of(cls, key: Any) -> ObjectId:
        """The id of an LMCache ``ObjectKey`` (the same five fields, read by name)."""
        return cls(key.model_name, key.kv_rank, key.object_group_id, key.chunk_hash,
                   key.cache_salt)


@dataclass(frozen=True, slots=True)
class Header:
    oid: ObjectId
    kind: int
    depth: int
    parent: bytes
    payload_len: int
    payload_crc: int

    @property
    def size(self) -> int:
        return header_size(self.oid, self.parent)

    @property
    def file_size(self) -> int:
        return self.size + self.payload_len


class ReadStatus(enum.Enum):
    OK = "ok"
    MISSING = "missing"
    CORRUPT = "corrupt"


class FormatError(ValueError):
    """A file is not a valid HiState disk-tier object (torn, corrupted, foreign)."""


# -------------------------------------------------------------------- encoding
def encode_id(oid: ObjectId) -> bytes:
    model = oid.model_name.encode()
    salt = oid.cache_salt.encode()
    return b"".join(
        (
            struct.pack("<H", len(model)),
            model,
            _KEY.pack(oid.kv_rank, oid.object_group_id, len(oid.chunk_hash)),
            oid.chunk_hash,
            struct.pack("<H", len(salt)),
            salt,
        )
    )


def decode_id(data: bytes) -> ObjectId:
    try:
        (n,) = struct.unpack_from("<H", data, 0)
        pos = 2
        model = data[pos : pos + n].decode()
        pos += n
        rank, group, hlen = _KEY.unpack_from(data, pos)
        pos += _KEY.size
        chunk_hash = bytes(data[pos : pos + hlen])
        pos += hlen
        (s,) = struct.unpack_from("<H", data, pos)
        pos += 2
        salt = data[pos : pos + s].decode()
        pos += s
    except (struct.error, UnicodeDecodeError) as exc:
        raise FormatError(f"bad object key: {exc}") from exc
    if pos != len(data) or len(chunk_hash) != hlen:
        raise FormatError("bad object key length")
    return ObjectId(model, rank, group, chunk_hash, salt)


def header_size(oid: ObjectId, parent: bytes) -> int:
    return _FIXED.size + len(encode_id(oid)) + len(parent)


def encode_header(
    oid: ObjectId, kind: int, depth: int, parent: bytes, payload_len: int, payload_crc: int
) -> bytes:
    key = encode_id(oid)
    fixed = _FIXED.pack(
        MAGIC, VERSION, kind, 0, depth, payload_len, payload_crc, len(key), len(parent), 0
    )
    crc = zlib.crc32(parent, zlib.crc32(key, zlib.crc32(fixed)))
    fixed = fixed[:-4] + struct.pack("<I", crc)
    return fixed + key + parent


def parse_header(fixed_and_rest: bytes) -> tuple[Header, int]:
    """Parse a header from the first bytes of a file; returns (header, header length)."""
    if len(fixed_and_rest) < _FIXED.size:
        raise FormatError("file shorter than the header")
    magic, version, kind, _flags, depth, plen, pcrc, klen, parlen, hcrc = _FIXED.unpack_from(
        fixed_and_rest, 0
    )
    if magic != MAGIC:
        raise FormatError(f"bad magic {magic!r}")
    if version != VERSION:
        raise FormatError(f"unsupported version {version}")
    end = _FIXED.size + klen + parlen
    if len(fixed_and_rest) < end:
        raise FormatError("file shorter than its header")
    zeroed = fixed_and_rest[: _FIXED.size - 4] + b"\0\0\0\0"
    key = fixed_and_rest[_FIXED.size : _FIXED.size + klen]
    parent = bytes(fixed_and_rest[_FIXED.size + klen : end])
    if zlib.crc32(parent, zlib.crc32(key, zlib.crc32(zeroed))) != hcrc:
        raise FormatError("header checksum mismatch")
    return Header(decode_id(bytes(key)), kind, depth, parent, plen, pcrc), end


# ---------------------------------------------------------------------- paths
# NOTE 1: a file name must be bounded (NAME_MAX is 255 bytes), valid on any filesystem
# (no NUL, no separators) and collision-free for any key a client can send. The readable
# part (model name reduced to [A-Za-z0-9._-], cut at 48 characters; the chunk hash cut at
# 64 hex digits) is for people; uniqueness comes from the 128-bit BLAKE2b digest of the
# whole encoded key, so two keys share a name only on a digest collision. The header stays
# authoritative: a load checks that the file holds the object asked for.
_READABLE_MAX = 48
_HASH_HEX_MAX = 64
_DIGEST_BYTES = 16
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_NAME_BODY = (
    rf"[A-Za-z0-9._-]{{0,{_READABLE_MAX}}}@0x[0-9a-f]{{8}}@[0-9a-f]{{1,8}}"
    rf"@[0-9a-f]{{0,{_HASH_HEX_MAX}}}@[0-9a-f]{{{2 * _DIGEST_BYTES}}}"
)
OWN_NAME = re.compile(_NAME_BODY + re.escape(SUFFIX))
"""Names of the tier's object files (``scan`` touches nothing else)."""
OWN_TMP_NAME = re.compile(_NAME_BODY + re.escape(SUFFIX) + r"\.\d+\.\d+" + re.escape(TMP_SUFFIX))
"""Names of its temporary files (``<final name>.<pid>.<n>.tmp``)."""
SHARD_NAME = re.compile(r"[0-9a-f]{2}")
"""Its shard folders: the first byte of the chunk hash in hex."""
_tmp_counter = itertools.count()
_bounce = threading.local()  # each I/O thread's O_DIRECT bounce buffer (NOTE 2)


def file_name(oid: ObjectId) -> str:
    """Bounded (< 200 bytes), filesystem-safe, collision-free name of ``oid`` (NOTE 1)."""
    readable = _UNSAFE.sub("_", oid.model_name[:_READABLE_MAX])[:_READABLE_MAX]
    digest = hashlib.blake2b(encode_id(oid), digest_size=_DIGEST_BYTES).hexdigest()
    return (
        f"{readable}@{oid.kv_rank:#010x}@{oid.object_group_id:x}"
        f"@{oid.chunk_hash[: _HASH_HEX_MAX // 2].hex()}@{digest}{SUFFIX}"
    )


def object_path(root: Path, oid: ObjectId) -> Path:
    """``root/<first byte of the chunk hash>/<name>``: 256 shards keep folders small."""
    shard = oid.chunk_hash[:1].hex() or "00"
    return root / shard / file_name(oid)


# ---------------------------------------------------------------------- write
def write_object(
    path: Path,
    oid: ObjectId,
    payload: memoryview | bytes,
    *,
    kind: int,
    depth: int,
    parent: bytes,
    fsync: bool = True,
    direct: bool = False,
) -> int:
    """Atomically create ``path``: temporary file, (fsync), rename. Returns file size.

    ``direct`` writes with ``O_DIRECT`` through an aligned bounce buffer (NOTE 2)
    and falls back to buffered writes where the filesystem refuses it (EINVAL). Raises
    ``OSError`` (e.g. ENOSPC) after removing the temporary file.
    """
    view = memoryview(payload).cast("B")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{next(_tmp_counter)}{TMP_SUFFIX}")
    try:
        size = None
        if direct:
            size = _write_direct(
                tmp, view, header_size(oid, parent),
                lambda crc: encode_header(oid, kind, depth, parent, len(view), crc), fsync,
            )
        if size is None:
            size = _write_buffered(tmp, oid, view, kind, depth, parent, fsync)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return size


def _bounce_buffer(size: int) -> memoryview:
    """This thread's page-aligned scratch buffer of at least ``size`` bytes."""
    buf = getattr(_bounce, "buf", None)
    if buf is None or len(buf) < size:
        buf = memoryview(mmap.mmap(-1, size))
        _bounce.buf = buf
    return buf


def _write_direct(
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


def _write_buffered(
    tmp: Path, oid: ObjectId, view: memoryview, kind: int, depth: int, parent: bytes, fsync: bool
) -> int:
    header = encode_header(oid, kind, depth, parent, len(view), zlib.crc32(view))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, header)
        _write_all(fd, view)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return len(header) + len(view)


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        view = view[n:]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------- read
def read_header(path: Path) -> Header:
    """The header of ``path``, checked against the file size. Raises FormatError/OSError."""
    with open(path, "rb", buffering=0) as f:
        head = f.read(4096)
        header, end = _parse_growing(f, head)
        size = os.fstat(f.fileno()).st_size
    if size != end + header.payload_len:
        raise FormatError(f"file is {size} bytes, header says {end + header.payload_len}")
    return header


def _parse_growing(f, head: bytes) -> tuple[Header, int]:  # type: ignore[no-untyped-def]
    try:
        return parse_header(head)
    except FormatError:
        if len(head) < 4096:
            raise
    # Very long keys: read the exact header length and retry once.
    _m, _v, _k, _f, _d, _pl, _pc, klen, parlen, _hc = _FIXED.unpack_from(head, 0)
    more = f.read(_FIXED.size + klen + parlen - len(head))
    return parse_header(head + more)


def read_object(path: Path, oid: ObjectId, dst: memoryview) -> tuple[ReadStatus, str]:
    """Read the payload of ``path`` into ``dst`` (exact size) and verify everything.

    Returns (OK, "") or (MISSING | CORRUPT, reason). Never raises for bad content.
    """
    view = memoryview(dst).cast("B")
    try:
        f = open(path, "rb", buffering=0)  # noqa: SIM115
    except FileNotFoundError:
        return ReadStatus.MISSING, "no such file"
    except OSError as exc:
        return ReadStatus.MISSING, str(exc)
    with f:
        try:
            head = f.read(4096)
            header, end = _parse_growing(f, head)
        except FormatError as exc:
            return ReadStatus.CORRUPT, str(exc)
        if header.oid != oid:
            return ReadStatus.CORRUPT, "file holds another object"
        if header.payload_len != len(view):
            return ReadStatus.CORRUPT, (
                f"payload is {header.payload_len} bytes, the buffer {len(view)}"
            )
        # The first read may already hold the start of the payload.
        have = head[end : end + len(view)]
        view[: len(have)] = have
        pos = len(have)
        while pos < len(view):
            n = f.readinto(view[pos : pos + _READ_BLOCK])
            if not n:
                return ReadStatus.CORRUPT, f"truncated payload ({pos} of {len(view)} bytes)"
            pos += n
        if f.read(1):
            return ReadStatus.CORRUPT, "trailing bytes after the payload"
    if zlib.crc32(view) != header.payload_crc:
        return ReadStatus.CORRUPT, "payload checksum mismatch"
    return ReadStatus.OK, ""


# ----------------------------------------------------------------------- scan
@dataclass(frozen=True, slots=True)
class ScanResult:
    objects: list[tuple[Path, Header, float]]  # path, header, mtime
    removed_tmp: int
    removed_corrupt: int


def iter_files(root: Path) -> Iterator[Path]:
    """Every file in the tier's shard folders (``SHARD_NAME``); nothing else is visited."""
    if not root.is_dir():
        return
    for shard in sorted(root.iterdir()):
        if SHARD_NAME.fullmatch(shard.name) and shard.is_dir() and not shard.is_symlink():
            yield from sorted(shard.iterdir())


def scan(root: Path) -> ScanResult:
    """Index what survived in ``root``: remove its own temporaries and invalid files.

    Invariant: only files whose names match ``OWN_TMP_NAME`` / ``OWN_NAME`` inside shard
    folders are ever removed; anything else (another program's ``draft.tmp``, a
    ``model.hsf`` with a foreign name, other folders) is left untouched. Only headers are
    read (and checked against the file size): payload checksums are verified on load.
    """
    objects: list[tuple[Path, Header, float]] = []
    tmp = corrupt = 0
    for path in iter_files(root):
        name = path.name
        if OWN_TMP_NAME.fullmatch(name):
            with contextlib.suppress(OSError):
                path.unlink()
                tmp += 1
            continue
        if not OWN_NAME.fullmatch(name) or path.is_symlink():
            continue
        try:
            header = read_header(path)
            st = path.stat()
            valid = name == file_name(header.oid) and path.parent.name == object_path(
                root, header.oid
            ).parent.name
        except (FormatError, OSError, ValueError, struct.error):
            valid = False
        if not valid:
            with contextlib.suppress(OSError):
                path.unlink()
                corrupt += 1
            continue
        objects.append((path, header, st.st_mtime))
    return ScanResult(objects, tmp, corrupt)
