"""Smoke tests of the MP harness against a stock ``lmcache server`` (no project code).

They pin down the LMCache 0.5.6 behaviour the HiState backend relies on (docs/design.md §5.1):
hybrid chunks of two object groups round-trip byte-exactly through L1 and through the stock
``fs`` L2 adapter, and a hit of L chunks needs the recurrent snapshot of chunk L-1 only, so a
missing snapshot shortens the hit to the last chunk that has one.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.lmcache_mp import (
    REC_GROUP,
    HybridEngineClient,
    LMCacheServer,
    LMCacheServerError,
    TokenSource,
    lmcache_server,
)

CHUNK = 16


def fs_adapter_args(path: Path) -> list[str]:
    """``--l2-adapter`` flags for the stock filesystem adapter writing under ``path``."""
    return ["--l2-adapter", json.dumps({"type": "fs", "base_path": str(path)})]


@pytest.fixture(scope="module")
def l1_only_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LMCacheServer]:
    """One L1-only server shared by the tests that do not restart or clear it."""
    with lmcache_server(workdir=tmp_path_factory.mktemp("l1only"), chunk_size=CHUNK) as server:
        yield server


@pytest.fixture
def tokens(request: pytest.FixtureRequest) -> TokenSource:
    """Random prefixes seeded by the test's id: reproducible, and distinct per test, so tests
    sharing a server never see each other's chunks."""
    return TokenSource(seed=zlib.crc32(request.node.nodeid.encode()))


def test_round_trip_without_l2(l1_only_server: LMCacheServer, tokens: TokenSource) -> None:
    with HybridEngineClient(l1_only_server.endpoints.zmq_url) as engine:
        prefix = tokens.tokens(3 * CHUNK)
        stored = engine.store_chunks(prefix)
        got = engine.lookup_and_retrieve(prefix)
        assert got.hit_chunks == 3
        assert engine.matches(stored, got)
        # A longer query with an unseen tail still hits exactly the stored prefix.
        longer = engine.lookup_and_retrieve(prefix + tokens.tokens(2 * CHUNK))
        assert longer.hit_chunks == 3
        assert engine.matches(stored, longer)


def test_missing_snapshot_shortens_hit(l1_only_server: LMCacheServer, tokens: TokenSource) -> None:
    """Attention KV for 4 chunks but snapshots only after chunks 0 and 1: the hit is 2 chunks,
    served with the snapshot of chunk 1 (fold.py: window-1 group needs chunk L-1 only)."""
    with HybridEngineClient(l1_only_server.endpoints.zmq_url) as engine:
        prefix = tokens.tokens(4 * CHUNK)
        stored = engine.store_chunks(prefix, snapshot_chunks=[0, 1])
        got = engine.lookup_and_retrieve(prefix)
        assert got.hit_chunks == 2
        assert engine.matches(stored, got)
        # No snapshot at all: no hit, although every attention chunk is cached.
        bare = engine.store_chunks(tokens.tokens(2 * CHUNK), snapshot_chunks=[], wait=False)
        assert engine.probe(bare.token_ids) == 0


def test_round_trip_through_fs_l2_and_restart(tmp_path: Path, tokens: TokenSource) -> None:
    """Store 3 chunks of both groups, flush to the fs adapter, clear L1 over HTTP and read
    them back from L2; then kill the server hard and read them from a fresh server too."""
    l2_dir = tmp_path / "l2"
    prefix = tokens.tokens(3 * CHUNK)
    with lmcache_server(fs_adapter_args(l2_dir), workdir=tmp_path, chunk_size=CHUNK) as server:
        with HybridEngineClient(server.endpoints.zmq_url) as engine:
            stored = engine.store_chunks(prefix)
            server.wait_l2_flushed()
            files = sorted(p.name for p in l2_dir.glob("*.data"))
            assert len(files) == 6  # 3 chunks x (attention + recurrent)
            rec_key = engine.object_keys(prefix, REC_GROUP)[-1]
            assert any(f"@{REC_GROUP:x}@{rec_key.chunk_hash.hex()}" in name for name in files)

            server.clear_l1()
            assert server.l1_object_count() == 0
            got = engine.lookup_and_retrieve(prefix)
            assert got.hit_chunks == 3
            assert engine.matches(stored, got)

            expected = engine.stored_bytes(stored, 3)
            assert server.kill() == -9
            assert not server.is_running

        with (
            lmcache_server(fs_adapter_args(l2_dir), workdir=tmp_path, chunk_size=CHUNK) as fresh,
            HybridEngineClient(fresh.endpoints.zmq_url) as engine2,
        ):
            assert fresh.l1_object_count() == 0
            got = engine2.lookup_and_retrieve(prefix)
            assert got.hit_chunks == 3
            assert got.ok
            assert engine2.retrieved_bytes(got) == expected


def test_bad_arguments_fail_fast_with_log_tail(tmp_path: Path) -> None:
    bad = ["--l2-adapter", json.dumps({"type": "no-such-adapter"})]
    with (
        pytest.raises(LMCacheServerError, match="no-such-adapter"),
        lmcache_server(bad, workdir=tmp_path, startup_timeout=60),
    ):
        pass
