"""The model-name length the disk tier stores, at its exact bound (docs/reliability.md,
promise 4).

The header's key field holds at most 65,535 bytes (a ``u16`` length in ``file_format``'s
fixed part): 2 (name length) + n (name) + 10 (rank, group, hash length) + 32 (LMCache's
chunk hash) + 2 (salt length) + 0 (no salt) = n + 46, so a name of n ≤ 65,489 bytes is
stored and a longer one is refused as ``bad_key``.
"""

from __future__ import annotations

from pathlib import Path

from test_backend_disk_tier import adapter, load, lookup, odd_key, store

LONGEST = 65_535 - 46


def test_the_longest_storable_name_round_trips_and_one_byte_more_is_refused(
    tmp_path: Path,
) -> None:
    a = adapter(tmp_path)
    try:
        longest = odd_key("m" * LONGEST, 1)
        assert store(a, [longest], [b"p" * 64])
        assert lookup(a, [longest]) == [0]
        hits, data = load(a, [longest], [64])
        assert hits == [0] and data == [b"p" * 64]
        for n in (LONGEST + 1, 65_535):
            assert not store(a, [odd_key("m" * n, 2)], [b"q" * 64])
        assert a.stats["not_persisted_bad_key"] == 2
    finally:
        a.close()
