"""A hit split between a node's own tiers and the shared tier, checked layer by layer.

Node A stores a session P of 4 chunks (snapshot at chunk 3); node B stores P's first 2
chunks itself (snapshot at chunk 1) from an engine seeded otherwise, so B's bytes differ
from A's for the same keys. (Two toy engines with the same seed draw the same random
stream in another order: B's chunk 0 layer 1 would equal A's chunk 2 layer 0, and so on;
the test asserts its 12 slices all differ.) Every 1 KiB slice restored on B (one
attention layer of one chunk, ``GEOMETRY``: 2 x 16 tokens x 2 heads x 8 x bf16) then
names where it came from, and a slice put at another chunk's position (or layer) would
show. B's CPU tier is sized so its two chunks sit in different places: one KV chunk fits
(chunk 0 in L1, chunk 1 on disk), or none (both on disk). LMCache 0.5.6's prefetch then
loads one request from two L2 adapters, the disk tier and the shared tier, each a part
of the batch; a prefix of 2 chunks on B loads from the disk tier alone (L1 + one L2
adapter).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.lmcache_mp import ATTN_GROUP, REC_GROUP, HybridEngineClient, TokenSource
from support.redis_cluster import RedisClusterNodes
from test_backend_server import CHUNK, GEOMETRY, KV, cpu_fill_for, histate, loads, on_disk, settle
from test_shared_tier_servers import shared, shared_loads, tier_section
from test_shared_tier_servers import tokens as tokens  # the fixture

LAYER = KV // GEOMETRY.attn_layers  # bytes of one attention layer of one chunk: 1,024


def layer_slices(engine: HybridEngineClient,
                 blocks: tuple[tuple[int, ...], ...]) -> list[bytes]:
    """Each chunk's attention KV cut per layer: chunk 0 layer 0, chunk 0 layer 1, ..."""
    raws = [engine.read_blocks(ATTN_GROUP, ids) for ids in blocks]
    return [raw[n * LAYER:(n + 1) * LAYER] for raw in raws
            for n in range(GEOMETRY.attn_layers)]


def named(engine: HybridEngineClient, blocks: tuple[tuple[int, ...], ...],
          name: str) -> dict[bytes, str]:
    """Each layer slice of each chunk, named ``<name><chunk>.<layer>``."""
    per = GEOMETRY.attn_layers
    return {part: f"{name}{n // per}.{n % per}"
            for n, part in enumerate(layer_slices(engine, blocks))}


def restored(engine: HybridEngineClient, blocks: tuple[tuple[int, ...], ...],
             names: dict[bytes, str]) -> list[str]:
    """The name of each restored slice, in position order ("?" for unknown bytes)."""
    return [names.get(part, "?") for part in layer_slices(engine, blocks)]


@pytest.mark.parametrize(("b_kv_in_l1", "b_on_disk"), [(1, [1]), (0, [0, 1])])
def test_own_and_shared_chunks_each_land_in_their_place(
    tmp_path: Path, tokens: TokenSource, redis_cluster: RedisClusterNodes,
    b_kv_in_l1: int, b_on_disk: list[int],
) -> None:
    p = tokens.tokens(4 * CHUNK)
    with (
        histate(tmp_path / "a", tmp_path / "disk-a",
                shared_tier=tier_section(redis_cluster, "a")) as a,
        histate(tmp_path / "b", tmp_path / "disk-b", shared_tier=tier_section(redis_cluster, "b"),
                cpu_fill=cpu_fill_for(b_kv_in_l1 * KV)) as b,
    ):
        with HybridEngineClient(a.endpoints.zmq_url, GEOMETRY) as engine_a:
            sa = engine_a.store_chunks(p, snapshot_chunks=[3])
            settle(a)
            names = named(engine_a, sa.attn_blocks, "A")
            a_snap = engine_a.read_blocks(REC_GROUP, sa.rec_blocks[3])
        with HybridEngineClient(b.endpoints.zmq_url, GEOMETRY, seed=7) as engine_b:
            sb = engine_b.store_chunks(p[: 2 * CHUNK], snapshot_chunks=[1])
            settle(b)
            names.update(named(engine_b, sb.attn_blocks, "B"))
            b_snap = engine_b.read_blocks(REC_GROUP, sb.rec_blocks[1])
            assert len(names) == 12  # 8 slices of A, 4 of B: all different, names unique
            # B's placement: its KV chunks not in L1 are on its disk, its snapshot too.
            assert on_disk(tmp_path / "disk-b", engine_b, p, ATTN_GROUP) == b_on_disk
            assert on_disk(tmp_path / "disk-b", engine_b, p, REC_GROUP) == [1]
            assert b.l1_object_count() == b_kv_in_l1
            # The cluster holds A's bytes for chunks 0-1: B's stores found them present.
            assert shared(b)["stats"]["present"] == 2

            # P on B: chunks 0-1 from B's own tiers, 2-3 and the snapshot from the cluster.
            disk0, shared0 = loads(b), shared_loads(b)
            got = engine_b.lookup_and_retrieve(p)
            assert got.ok and got.hit_chunks == 4
            assert restored(engine_b, got.attn_blocks, names) == [
                "B0.0", "B0.1", "B1.0", "B1.1", "A2.0", "A2.1", "A3.0", "A3.1"]
            assert engine_b.read_blocks(REC_GROUP, got.rec_blocks) == a_snap
            assert loads(b)[0] - disk0[0] == len(b_on_disk) and loads(b)[1] == disk0[1]
            assert shared_loads(b) == (shared0[0] + 2, shared0[1] + 1)

            # P's first 2 chunks on B: L1 and the disk tier alone (one L2 adapter).
            disk0, shared0 = loads(b), shared_loads(b)
            got = engine_b.lookup_and_retrieve(p[: 2 * CHUNK])
            assert got.ok and got.hit_chunks == 2
            assert restored(engine_b, got.attn_blocks, names) == ["B0.0", "B0.1", "B1.0", "B1.1"]
            assert engine_b.read_blocks(REC_GROUP, got.rec_blocks) == b_snap
            assert loads(b) == (disk0[0] + len(b_on_disk), disk0[1] + 1)
            assert shared_loads(b) == shared0
