"""The disk tier's O_DIRECT write path writes exactly the bytes of the buffered one.

``file_format.write_object(direct=True)`` streams header + payload through an aligned bounce
buffer, writes the header block last and cuts the padding with ftruncate
(``disk.file_format`` NOTE 2).
Each size below sits on one of its edges; the file must be byte-identical to the buffered
write's, its size header + payload, and it must load back.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from lmcache_histate.backends.server.disk import file_format as df
from support.filesystems import tmpfs

OID = df.ObjectId("tiny-hybrid", 0, 1, bytes(range(32)))
PARENT = bytes(range(100, 132))
# Header: fixed 32 bytes (struct "<4sHBBiQIHHI": 4+2+1+1+4+8+4+2+2+4) + key + parent.
# Key: 2 + 11 ("tiny-hybrid") + 10 (rank, group, hash length "<IIH") + 32 (hash) + 2 (salt
# length) + 0 = 57 bytes; parent 32 bytes -> 32 + 57 + 32 = 121 bytes.
HEADER = 121
BLOCK = 4096
CHUNK = 4 << 20
SIZES = [
    0,                      # the header block alone
    1,
    BLOCK - HEADER,         # 3,975: header + payload fill the first block exactly
    BLOCK - HEADER + 1,     # one byte into the second block
    CHUNK,                  # a full bounce chunk after the header block, then a 3,975-byte tail
    CHUNK + BLOCK - HEADER,  # ends exactly on a chunk boundary: no padding
    2 * CHUNK + 12_345,     # several chunks and a padded tail
]


def _payload(n: int) -> bytes:
    return bytes((i * 7 + n) & 0xFF for i in range(min(n, 65_536))) * (n // 65_536) + bytes(
        (i * 7 + n) & 0xFF for i in range(n % 65_536)
    )


def test_header_size_is_the_hand_count() -> None:
    assert df.header_size(OID, PARENT) == HEADER


@pytest.mark.parametrize("n", SIZES)
def test_direct_write_is_byte_identical_to_buffered(tmp_path: Path, n: int) -> None:
    payload = _payload(n)
    direct = tmp_path / "direct" / "obj.hsf"
    buffered = tmp_path / "buffered" / "obj.hsf"
    size = df.write_object(direct, OID, payload, kind=df.KIND_SNAPSHOT, depth=3,
                           parent=PARENT, direct=True)
    df.write_object(buffered, OID, payload, kind=df.KIND_SNAPSHOT, depth=3, parent=PARENT,
                    direct=False)
    assert size == HEADER + n
    assert direct.stat().st_size == HEADER + n
    assert direct.read_bytes() == buffered.read_bytes()
    out = bytearray(n)
    status, why = df.read_object(direct, OID, memoryview(out))
    assert status is df.ReadStatus.OK, why
    assert out == payload
    assert list(direct.parent.iterdir()) == [direct]  # no temporary file left


def test_filesystem_refusing_o_direct_falls_back_to_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every filesystem this suite can mount accepts O_DIRECT (tmpfs does since Linux 6.6),
    # so the refusal (EINVAL at open, as older tmpfs and some FUSE filesystems answer) is
    # the one fault simulated here.
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    payload = _payload(10_000)
    path = tmp_path / "obj.hsf"
    assert df.write_object(path, OID, payload, kind=df.KIND_KV, depth=0, parent=PARENT,
                           direct=True) == HEADER + 10_000
    out = bytearray(10_000)
    assert df.read_object(path, OID, memoryview(out))[0] is df.ReadStatus.OK
    assert out == payload


def test_a_full_disk_still_raises_enospc_and_leaves_no_file(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "256k") as mount:
        with pytest.raises(OSError) as caught:
            df.write_object(mount / "obj.hsf", OID, _payload(1 << 20), kind=df.KIND_KV,
                            depth=0, parent=PARENT, direct=True)
        assert caught.value.errno == errno.ENOSPC
        assert list(mount.iterdir()) == []
