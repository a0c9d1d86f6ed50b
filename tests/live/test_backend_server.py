"""HiState in a real ``lmcache server`` started by its launcher (no vLLM).

Each test starts ``python -m lmcache_histate.backends.server.launcher --config <yaml>`` through the
MP harness (free ports; the harness adds ``--chunk-size 16 --l1-size-gb 0.05``, which the
launcher folds into the configuration) and drives it with LMCache's own client classes:
STORE chunks of an attention and a recurrent object group, LOOKUP, RETRIEVE, compare bytes,
clear L1 over HTTP, corrupt files, restart, fill the disk.

Sizes with the harness's default engine geometry: one chunk's attention object is
2,048 B, one recurrent snapshot 8,192 B (N_s = 64 KV tokens).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lmcache.v1.multiprocess.protocols.server_module import ServerModuleCallRequest
from lmcache_histate.backends.server.disk import file_format as df
from support.filesystems import fill_to, tmpfs
from support.lmcache_mp import (
    ATTN_GROUP,
    REC_GROUP,
    EngineGeometry,
    HybridEngineClient,
    LMCacheServer,
    LMCacheServerError,
    TokenSource,
    lmcache_server,
    support_pythonpath,
)

CHUNK = 16
KV = 2048
SNAP = 8192
L1_BYTES = int(0.05 * 2**30)  # the harness's --l1-size-gb
LAUNCHER = "lmcache_histate.backends.server.launcher"
GEOMETRY = EngineGeometry(num_blocks=512)


def cpu_fill_for(nbytes: int) -> float:
    """``cpu_fill`` giving the core's CPU tier ``nbytes`` (+ a little) of the harness's L1."""
    return (nbytes + 512) / L1_BYTES


def write_config(path: Path, disk: Path, **values: Any) -> Path:
    cfg = {
        "model": "tiny-qwen3-next",
        "chunk_size": CHUNK,
        "cpu_gib": 0.05,
        "disk_path": str(disk),
        "disk_gib": 0.01,
        "disk_fsync": False,  # tests do not need durability against power loss
        **values,
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


@contextlib.contextmanager
def histate(workdir: Path, disk: Path, *, test_module: tuple[str, dict[str, Any]] | None = None,
            **values: Any) -> Iterator[LMCacheServer]:
    """The launcher with a configuration of ``values``; ``test_module`` = (name, config)
    of a test-only server module from ``tests/support`` loaded beside HiState's."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = write_config(workdir / "histate.yaml", disk, **values)
    command = [sys.executable, "-m", LAUNCHER, "--config", str(config)]
    extra: list[str] = []
    if test_module is not None:
        name, module_config = test_module
        extra = ["--server-module", json.dumps({"module_path": name, "factory_name":
                                                "build_server_modules",
                                                "config": module_config})]
    with lmcache_server(extra, workdir=workdir, chunk_size=CHUNK, command=command,
                        env=support_pythonpath() if test_module else None) as server:
        yield server


@pytest.fixture
def tokens(request: pytest.FixtureRequest) -> TokenSource:
    return TokenSource(seed=zlib.crc32(request.node.nodeid.encode()))


def hs(server: LMCacheServer) -> dict[str, Any]:
    status = server.status()["histate"]
    assert status["active"], status
    return status


def wait_until(pred: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def settle(server: LMCacheServer) -> dict[str, Any]:
    """Wait until stores, disk writes, deferred deletes and queued L1 events are done."""
    status = server.histate_settled()
    assert status["active"], status
    return status


def on_disk(disk: Path, engine: HybridEngineClient, prefix: list[int], group: int) -> list[int]:
    """Chunk indices of ``prefix`` whose object of ``group`` is a file on the disk tier."""
    out = []
    for i, key in enumerate(engine.object_keys(prefix, group)):
        oid = df.ObjectId(key.model_name, key.kv_rank, key.object_group_id, key.chunk_hash)
        if df.object_path(disk, oid).exists():
            out.append(i)
    return out


def loads(server: LMCacheServer) -> tuple[int, int]:
    stats = hs(server)["disk"]["stats"]
    return stats.get(f"loads_group_{ATTN_GROUP}", 0), stats.get(f"loads_group_{REC_GROUP}", 0)


def counters(server: LMCacheServer) -> dict[str, int]:
    return hs(server)["counters"]


# ------------------------------------------------------------------------------------------
def test_placement_tiers_and_hits_across_them(tmp_path: Path, tokens: TokenSource) -> None:
    """Snapshots are separate files; intermediate ones leave L1, finals stay; KV reaches disk
    only when the CPU tier must make room; a hit loads only its last chunk's snapshot; a
    missing off-interval snapshot falls back to the previous one."""
    disk = tmp_path / "disk"
    # CPU tier: one session (4 KV chunks + its final snapshot) plus some room, not two.
    with (
        histate(tmp_path / "srv", disk, cpu_fill=cpu_fill_for(4 * KV + SNAP + 3 * KV)) as server,
        HybridEngineClient(server.endpoints.zmq_url, GEOMETRY) as engine,
    ):
        p = tokens.tokens(4 * CHUNK)
        sp = engine.store_chunks(p, snapshot_chunks=[1, 3])  # interval 2 chunks
        status = settle(server)
        assert on_disk(disk, engine, p, REC_GROUP) == [1, 3]  # every snapshot, one file each
        assert on_disk(disk, engine, p, ATTN_GROUP) == []  # KV stays on the CPU
        # L1 holds P's 4 KV chunks and its final snapshot; the intermediate one left.
        assert server.l1_object_count() == 5
        assert status["tiers"]["cpu"]["used_bytes"] == 4 * KV + SNAP

        q = tokens.tokens(4 * CHUNK)
        sq = engine.store_chunks(q, snapshot_chunks=[1, 3])
        status = settle(server)
        # The CPU tier had to make room: P's colder units moved to disk by lowest H (its
        # tail bundle: KV of chunks 2-3 and the final snapshot, whose disk copy exists;
        # possibly also the segment above the chunk-1 snapshot), none of Q's.
        demoted = on_disk(disk, engine, p, ATTN_GROUP)
        assert demoted in ([2, 3], [0, 1, 2, 3]), demoted
        assert on_disk(disk, engine, q, ATTN_GROUP) == []
        assert on_disk(disk, engine, q, REC_GROUP) == [1, 3]
        assert status["counters"]["kv_demoted"] == len(demoted)
        assert server.l1_object_count() == 4 - len(demoted) + 5

        # Full hit on P: its KV from wherever it is, one snapshot (chunk 3) from disk.
        a0, r0 = loads(server)
        got = engine.lookup_and_retrieve(p)
        assert got.hit_chunks == 4
        assert engine.matches(sp, got)
        a1, r1 = loads(server)
        assert (a1 - a0, r1 - r0) == (len(demoted), 1)  # the chunk-1 snapshot was not loaded

        # Prefix ending off-interval (chunk 2 has no snapshot): falls back to chunk 1.
        got = engine.lookup_and_retrieve(p[: 3 * CHUNK])
        assert got.hit_chunks == 2
        assert engine.matches(sp, got)
        assert loads(server)[1] - r1 == 1

        got = engine.lookup_and_retrieve(q + tokens.tokens(CHUNK))
        assert got.hit_chunks == 4 and engine.matches(sq, got)

        status = settle(server)
        c = status["counters"]
        assert c["hits.end"] >= 2 and c["hits.internal"] >= 1
        assert c["hit_tokens"] >= 10 * CHUNK
        assert status["sessions"] == 2
        metrics = server.http("GET", "/metrics")
        for name in (
            'histate_snapshots_stored_total{tier="disk"}',
            "histate_kv_chunks_demoted_total",
            'histate_hits_total{kind="internal"}',
            "histate_lookup_hit_tokens_estimate_total",
            "histate_snapshot_interval_tokens",
            "histate_pressure_factor",
            "histate_eviction_tau_seconds",
            "histate_eviction_reaccess_gap_seconds",
        ):
            assert name in metrics, name
        # Every HiState series says what it counts (Prometheus HELP, non-empty), and the
        # lookups' token series says it estimates (metrics NOTE 1).
        typed = re.findall(r"^# TYPE (histate_\w+) ", metrics, re.M)
        helped = dict(re.findall(r"^# HELP (histate_\w+) (.*)$", metrics, re.M))
        assert typed and {n for n in typed if helped.get(n, "").strip()} == set(typed)
        assert helped["histate_lookup_hit_tokens_estimate_total"].startswith("ESTIMATE")
        # tau: auto (the default) -- the score's scale is the online estimate.
        assert status["eviction_tau_calibrated"] is True and status["eviction_tau_s"] > 0
        assert "HiStateDiskAdapter" in json.dumps(server.status()["storage_manager"])

        # The extension RPCs the vLLM connector uses (server_module_call).
        def rpc(method: str, payload: dict[str, Any]) -> dict[str, Any]:
            request = ServerModuleCallRequest(method=method, payload=json.dumps(payload).encode())
            response = engine.client.server_module_call(request).result(timeout=10)
            assert response.success, response.error
            return json.loads(response.payload)

        assert rpc("histate.status", {})["active"] is True
        plan = rpc("histate.plan", {"start_tokens": 0, "input_tokens": 20 * CHUNK + 5})
        boundaries = plan["boundaries"]
        assert boundaries[-1] == 20 * CHUNK  # the segment's final snapshot, on the chunk grid
        assert all(b % CHUNK == 0 for b in boundaries) and boundaries == sorted(boundaries)
        # No snapshot has left this server's cache: storing one is free, pressure factor 0
        # (core/interval.py NOTE 2): a state at every chunk of the 20-chunk segment.
        assert status["pressure_factor"] == 0.0
        assert boundaries == [k * CHUNK for k in range(1, 21)]
        # The engine reports its step grid (its budget in whole chunks, here 6): free states
        # go on its step ends only, 6, 12 and 18 chunks from the start, and the final one.
        # A request without the key keeps the grid the server has.
        grid = {"start_tokens": 0, "input_tokens": 20 * CHUNK + 5, "step_tokens": 6 * CHUNK}
        assert rpc("histate.plan", grid)["boundaries"] == [6 * CHUNK, 12 * CHUNK, 18 * CHUNK,
                                                           20 * CHUNK]
        again = rpc("histate.plan", {"start_tokens": 2 * CHUNK, "input_tokens": 20 * CHUNK})
        assert again["boundaries"] == [8 * CHUNK, 14 * CHUNK, 20 * CHUNK]


def test_lookup_before_the_store_hand_off_is_a_hit_histate_sees(
    tmp_path: Path, tokens: TokenSource
) -> None:
    """LMCache serves a LOOKUP from L1 at once but hands the committed objects to the store
    policy later, on its store controller's thread (runtime NOTE 3). A next turn that
    arrives in between is a hit HiState counts, and the late hand-off still routes the
    snapshots to disk. The hand-off is held back 2 s (``tests/support/slow_store_handoff``)
    so the LOOKUP lands in that gap every time; a loaded host makes the same gap."""
    disk = tmp_path / "disk"
    flag = tmp_path / "hold-hand-off"
    flag.touch()
    module = ("slow_store_handoff", {"flag": str(flag), "delay_s": 2.0})
    with (
        histate(tmp_path / "srv", disk, test_module=module) as server,
        HybridEngineClient(server.endpoints.zmq_url, GEOMETRY) as engine,
    ):
        p = tokens.tokens(4 * CHUNK)
        sp = engine.store_chunks(p, snapshot_chunks=[1, 3], wait=False)
        # Committed to L1 (4 KV chunks, 2 snapshots), seen without a LOOKUP of our own.
        wait_until(lambda: server.l1_object_count() == 6, "the STORE's commit to L1")
        got = engine.lookup_and_retrieve(p + tokens.tokens(CHUNK))  # the next turn
        assert got.hit_chunks == 4 and engine.matches(sp, got)
        held = server.status()["TEST_slow_store_handoff"]
        assert held["held"] >= 1 and held["released"] == 0  # the LOOKUP came first
        flag.unlink()
        wait_until(lambda: server.status()["TEST_slow_store_handoff"]["released"]
                   == held["held"], "the held hand-off")
        status = settle(server)
        c = status["counters"]
        # One LOOKUP; it hit the whole 4-chunk prefix, ending at the stored prompt's end.
        assert c["lookups"] == 1 and c["hit_tokens"] == 4 * CHUNK
        assert c["hits.end"] == 1 and c.get("hits.internal", 0) == 0
        # All six objects (4 KV chunks, 2 snapshots) were placed by the LOOKUP, none by
        # the hand-off, and the hand-off used the routes decided then.
        assert c["commits.queued"] == 6 and c.get("commits.unseen", 0) == 0
        assert on_disk(disk, engine, p, REC_GROUP) == [1, 3]
        assert on_disk(disk, engine, p, ATTN_GROUP) == []
        assert server.l1_object_count() == 5  # 4 KV + the final snapshot


def test_clear_l1_then_hit_from_disk_and_restart(tmp_path: Path, tokens: TokenSource) -> None:
    """After ``POST /cache/clear`` a demoted session is still served, byte-exact, from disk;
    what only lived in L1 is gone (and its snapshot file, which can no longer be hit, is
    removed); a restarted server rebuilds its index from the files and serves them."""
    disk = tmp_path / "disk"
    fill = cpu_fill_for(4 * KV + SNAP + 3 * KV)
    p, q, r = (tokens.tokens(4 * CHUNK) for _ in range(3))
    with histate(tmp_path / "srv1", disk, cpu_fill=fill) as server:
        with HybridEngineClient(server.endpoints.zmq_url, GEOMETRY) as engine:
            sp = engine.store_chunks(p, snapshot_chunks=[3])
            engine.store_chunks(q, snapshot_chunks=[3])  # pushes P's bundle to disk
            settle(server)
            assert on_disk(disk, engine, p, ATTN_GROUP) == [0, 1, 2, 3]
            assert on_disk(disk, engine, q, REC_GROUP) == [3]
            expected = engine.stored_bytes(sp, 4)

            server.clear_l1()
            assert server.l1_object_count() == 0
            settle(server)
            # Q's KV only lived in L1: its snapshot file can never be hit again.
            assert on_disk(disk, engine, q, REC_GROUP) == []
            assert counters(server)["kv_lost.cpu"] >= 1  # the rest of its chain went with it
            assert engine.probe(q) == 0

            a0, r0 = loads(server)
            got = engine.lookup_and_retrieve(p)
            assert got.hit_chunks == 4
            assert engine.retrieved_bytes(got) == expected
            assert loads(server) == (a0 + 4, r0 + 1)

            engine.store_chunks(r, snapshot_chunks=[3])  # KV on the CPU only
            settle(server)
            assert on_disk(disk, engine, r, REC_GROUP) == [3]
        assert server.kill() == -9  # no clean shutdown

    torn = df.object_path(disk, df.ObjectId("histate-toy", 0, 0, b"\xab" * 32))
    torn.parent.mkdir(exist_ok=True)
    (torn.parent / (torn.name + ".9.9" + df.TMP_SUFFIX)).write_bytes(b"half a file")
    with (
        histate(tmp_path / "srv2", disk, cpu_fill=fill) as server,
        HybridEngineClient(server.endpoints.zmq_url, GEOMETRY) as engine,
    ):
        got = engine.lookup_and_retrieve(p)
        assert got.hit_chunks == 4
        assert engine.retrieved_bytes(got) == expected
        status = settle(server)
        c = status["counters"]
        assert c["restart_adopted"] == 5  # P: 4 KV chunks + its snapshot
        assert c["restart_orphans_removed"] >= 1  # R's snapshot: its KV did not survive
        assert status["disk"]["stats"]["restart_tmp_removed"] == 1
        assert on_disk(disk, engine, r, REC_GROUP) == []
        assert engine.probe(r) == 0
        assert status["tiers"]["disk"]["used_bytes"] == 4 * KV + SNAP


def test_corrupted_snapshot_is_a_miss_never_served(tmp_path: Path, tokens: TokenSource) -> None:
    disk = tmp_path / "disk"
    with (
        histate(tmp_path / "srv", disk) as server,
        HybridEngineClient(server.endpoints.zmq_url, GEOMETRY) as engine,
    ):
        p = tokens.tokens(4 * CHUNK)
        sp = engine.store_chunks(p, snapshot_chunks=[1, 3])
        settle(server)
        # The chunk-1 snapshot is an intermediate one: only on disk. Flip a payload byte.
        key = engine.object_keys(p, REC_GROUP)[1]
        path = df.object_path(
            disk, df.ObjectId(key.model_name, key.kv_rank, key.object_group_id, key.chunk_hash)
        )
        raw = bytearray(path.read_bytes())
        raw[-100] ^= 0x01
        path.write_bytes(raw)

        got = engine.lookup_and_retrieve(p[: 2 * CHUNK])
        assert got.hit_chunks == 0  # a miss: the corrupted state is never restored
        status = settle(server)
        assert not path.exists()
        assert status["disk"]["stats"]["corrupt_files"] == 1
        assert status["counters"]["snapshot_lost.disk"] == 1
        assert engine.probe(p[: 2 * CHUNK]) == 0  # gone from the index as well
        got = engine.lookup_and_retrieve(p)  # the final snapshot is intact (and in L1)
        assert got.hit_chunks == 4 and engine.matches(sp, got)


FIG7_DISK_BYTES = 38_000  # the core's disk tier holds exactly four 8 KiB snapshots


@pytest.mark.parametrize(
    ("policy", "tau", "refresh_all", "victim"),
    [
        ("HiState", 600, True, "S2"),
        ("LRU", 0, False, "S1"),
        ("LRU + refresh-all", 0, True, "S6"),
    ],
)
def test_figure7_eviction_order_through_the_server(
    tmp_path: Path, tokens: TokenSource, policy: str, tau: float, refresh_all: bool, victim: str
) -> None:
    """docs/design.md §2.3 / paper Figure 7: session B has S1 after a long prefix, S2 shortly
    after it and its final S3; session C only its final S6; B is read again; a new session
    needs room for one snapshot on disk. LRU evicts S1, LRU + refresh-all S6, HiState S2."""
    disk = tmp_path / "disk"
    with (
        histate(
            tmp_path / "srv", disk, tau=tau, refresh_all=refresh_all,
            disk_gib=FIG7_DISK_BYTES / 2**30,
        ) as server,
        HybridEngineClient(server.endpoints.zmq_url, GEOMETRY) as engine,
    ):
        cap = hs(server).get("tiers", {}).get("disk", {}).get("capacity_bytes")
        b, c, d = tokens.tokens(24 * CHUNK), tokens.tokens(20 * CHUNK), tokens.tokens(10 * CHUNK)
        engine.store_chunks(b[: 20 * CHUNK], snapshot_chunks=[19])  # S1
        engine.store_chunks(b[: 21 * CHUNK], snapshot_chunks=[20])  # S2 (S1 intermediate)
        engine.store_chunks(b, snapshot_chunks=[23])  # S3, B's final
        engine.store_chunks(c, snapshot_chunks=[19])  # S6, C's final
        settle(server)
        cap = hs(server)["tiers"]["disk"]["capacity_bytes"]
        assert 4 * SNAP <= cap < 5 * SNAP
        names = {"S1": (b, 19), "S2": (b, 20), "S3": (b, 23), "S6": (c, 19)}
        for name, (prefix, i) in names.items():
            assert i in on_disk(disk, engine, prefix, REC_GROUP), name
        assert engine.probe(b) == 24  # B is read again
        engine.store_chunks(d, snapshot_chunks=[9])  # one snapshot must go
        settle(server)
        gone = [
            name for name, (prefix, i) in names.items()
            if i not in on_disk(disk, engine, prefix, REC_GROUP)
        ]
        assert gone == [victim], policy
        assert 9 in on_disk(disk, engine, d, REC_GROUP)
        # The end-hit weight is on by default (configs/histate.yaml ``exposed_ends``): the
        # victim left the disk tier after sitting there unread, one sample of its dwell.
        assert hs(server)["eviction_dwell_s"]["disk"] > 0.0
        if victim == "S2":
            assert engine.probe(b[: 22 * CHUNK]) == 20  # falls back to S1
            assert engine.probe(b) == 24
        if victim == "S6":
            assert engine.probe(c) == 0  # C's final bundle left the cache


def test_tiny_disk_degrades_to_not_persisted(tmp_path: Path, tokens: TokenSource) -> None:
    """A disk tier smaller than one snapshot: nothing is persisted, nothing crashes; finals
    are still served from the CPU tier, intermediate snapshots are dropped."""
    disk = tmp_path / "disk"
    with (
        histate(tmp_path / "srv", disk, disk_gib=4096 / 2**30) as server,
        HybridEngineClient(server.endpoints.zmq_url, GEOMETRY) as engine,
    ):
        p = tokens.tokens(4 * CHUNK)
        sp = engine.store_chunks(p, snapshot_chunks=[1, 3])
        status = settle(server)
        assert not list(disk.rglob("*" + df.SUFFIX))
        assert status["counters"]["snapshot_not_placed"] >= 1
        got = engine.lookup_and_retrieve(p)
        assert got.hit_chunks == 4 and engine.matches(sp, got)
        assert engine.probe(p[: 2 * CHUNK]) == 0
        assert server.http("GET", "/healthcheck") == {"status": "healthy"}


FS_BYTES = 256 * 1024  # the real filesystem under the disk tier (tmpfs)
FREE_AFTER_FILL = 40 * 1024  # what another program leaves free on it after the start


def test_real_full_filesystem_feeds_its_size_back_to_the_policy(
    tmp_path: Path, tokens: TokenSource
) -> None:
    """The disk tier starts with room (160 KiB configured on a 256 KiB filesystem), then
    another program fills the filesystem. The first ENOSPC lowers the tier's capacity to
    what it holds + what is free, the core learns it and evicts by H: later snapshots are
    persisted again, failures stay few, nothing is left half-written, and whatever is
    served is byte-exact (the newest session in full)."""
    with tmpfs(tmp_path / "fs", "256k") as mount:
        disk = mount / "disk"
        with (
            histate(tmp_path / "srv", disk, disk_gib=160 * 1024 / 2**30) as server,
            HybridEngineClient(server.endpoints.zmq_url, GEOMETRY) as engine,
        ):
            assert hs(server)["disk"]["capacity_bytes"] == 160 * 1024
            fill_to(mount, FREE_AFTER_FILL)
            stored = []
            for _ in range(6):
                prefix = tokens.tokens(4 * CHUNK)
                sp = engine.store_chunks(prefix, snapshot_chunks=[0, 1, 2, 3], wait=False)
                stored.append((prefix, sp))
                settle(server)
            status = settle(server)
            stats = status["disk"]["stats"]
            assert stats.get("not_persisted_no_space", 0) >= 1
            # The tier and the core now fit the filesystem, not the configured 160 KiB.
            assert status["disk"]["capacity_bytes"] <= FREE_AFTER_FILL
            tier = status["tiers"]["disk"]
            assert tier["used_bytes"] <= tier["capacity_bytes"] <= FREE_AFTER_FILL
            assert status["counters"]["disk_capacity_changes"] >= 1
            # Room was made by evicting: the newest session's snapshots reached the disk,
            # and only the writes in flight when the disk filled failed (24 were tried).
            assert on_disk(disk, engine, stored[-1][0], REC_GROUP)
            assert stats["not_persisted_no_space"] <= 8
            assert not list(disk.rglob("*" + df.TMP_SUFFIX))  # failed writes leave nothing
            for prefix, sp in stored:
                got = engine.lookup_and_retrieve(prefix)
                assert got.hit_chunks == 0 or engine.matches(sp, got)  # never wrong bytes
            got = engine.lookup_and_retrieve(stored[-1][0])
            assert got.hit_chunks == 4 and engine.matches(stored[-1][1], got)
            assert server.http("GET", "/healthcheck") == {"status": "healthy"}


def test_bad_yaml_fails_at_start_naming_the_key(tmp_path: Path) -> None:
    config = write_config(tmp_path / "bad.yaml", tmp_path / "disk", cpu_gib="abc", tau=-1)
    result = subprocess.run(
        [sys.executable, "-m", LAUNCHER, "--config", str(config)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 2
    assert "cpu_gib: must be a positive number, got 'abc'" in result.stderr
    assert "tau: must be 'auto' or a number ≥ 0 (seconds), got -1" in result.stderr
    # Through the harness's real start path as well: the start fails fast, with the reason.
    with (
        pytest.raises(LMCacheServerError, match="cpu_gib"),
        lmcache_server(
            workdir=tmp_path / "srv", chunk_size=CHUNK, startup_timeout=60,
            command=[sys.executable, "-m", LAUNCHER, "--config", str(config)],
        ),
    ):
        pass


def test_dry_run_prints_command_and_kv_transfer_config(tmp_path: Path) -> None:
    config = write_config(tmp_path / "ok.yaml", tmp_path / "disk", port=7001, http_port=7002)
    result = subprocess.run(
        [sys.executable, "-m", LAUNCHER, "--config", str(config), "--dry-run"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    lines = result.stdout.splitlines()
    assert lines[0].startswith("lmcache server ")
    for flag in ("--separate-object-groups", "--chunk-size 16", "--l2-store-policy histate",
                 "--l2-adapter", "--server-module", "--eviction-policy LRU"):
        assert flag in lines[0], flag
    kv = json.loads(lines[1].split(": ", 1)[1])
    assert kv["kv_connector"] == "HiStateConnector"
    assert kv["kv_connector_module_path"] == "lmcache_histate.backends.vllm.connector"
    assert kv["kv_connector_extra_config"] == {
        "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 7001,
    }
    for flag in ("--enable-prefix-caching",
                 "--scheduler-cls lmcache_histate.backends.vllm.step_scheduler.HiStateScheduler",
                 "--mamba-cache-mode align", "--prefix-cache-retention-interval 16"):
        assert flag in lines[2], flag
    assert "--max-num-batched-tokens" not in lines[2]  # the engine's default step budget
    assert not (tmp_path / "disk").exists()  # a dry run creates nothing


def test_baseline_servers_turn_interval_saves_off(tmp_path: Path) -> None:
    """A stock-LRU server has no interval controller: its connector saves every state."""
    from lmcache_histate.backends.server.launcher import kv_transfer_config

    from lmcache_histate.config import parse_config

    base = {"disk_path": str(tmp_path / "disk"), "chunk_size": 16, "model": "tiny-qwen3-next",
            "cpu_gib": 1, "disk_gib": 1}
    lru = kv_transfer_config(parse_config({**base, "policy": "lru"}))
    assert lru["kv_connector_extra_config"]["histate.interval_saves"] is False
    hs = kv_transfer_config(parse_config({**base, "policy": "histate"}))
    assert "histate.interval_saves" not in hs["kv_connector_extra_config"]


def test_lru_baseline_writes_everything_through(tmp_path: Path, tokens: TokenSource) -> None:
    disk = tmp_path / "disk"
    with (
        histate(tmp_path / "srv", disk, policy="lru") as server,
        HybridEngineClient(server.endpoints.zmq_url, GEOMETRY) as engine,
    ):
        p = tokens.tokens(3 * CHUNK)
        sp = engine.store_chunks(p, snapshot_chunks=[0, 2])
        server.wait_l2_flushed()
        assert on_disk(disk, engine, p, ATTN_GROUP) == [0, 1, 2]
        assert on_disk(disk, engine, p, REC_GROUP) == [0, 2]
        assert server.status()["histate"] == {"active": False}  # stock policies
        metrics = server.http("GET", "/metrics")
        assert "histate_disk_write_lag_seconds" in metrics  # for every policy
        server.clear_l1()
        got = engine.lookup_and_retrieve(p)
        assert got.hit_chunks == 3 and engine.matches(sp, got)
        # HiState's RPCs answer at once that HiState is off (with no module loaded they
        # waited out the client's whole timeout, 30 s; < 2 s leaves room for a busy host).
        def timed(method: str) -> tuple[Any, float]:
            t0 = time.monotonic()
            request = ServerModuleCallRequest(method=method, payload=b'{"input_tokens": 64}')
            response = engine.client.server_module_call(request).result(timeout=30)
            return response, time.monotonic() - t0

        status, seconds = timed("histate.status")
        assert status.success and json.loads(status.payload) == {"active": False}
        assert seconds < 2
        plan, seconds = timed("histate.plan")
        assert not plan.success and "runs without HiState (policy lru)" in plan.error
        assert seconds < 2


def test_l1_watermark_eviction_follows_h(tmp_path: Path, tokens: TokenSource) -> None:
    """When LMCache's L1 eviction loop finds L1 above its watermark it asks HiState's L1
    policy, which pushes units out of the CPU tier by lowest H (here: the oldest sessions'
    bundles are demoted to disk; the newest stay in L1)."""
    disk = tmp_path / "disk"
    workdir = tmp_path / "srv"
    workdir.mkdir()
    config = write_config(
        workdir / "histate.yaml", disk, cpu_fill=1.0, l1_eviction_watermark=0.3
    )
    command = [sys.executable, "-m", LAUNCHER, "--config", str(config)]
    with (
        lmcache_server(workdir=workdir, chunk_size=CHUNK, l1_size_gb=0.0002,
                       command=command) as server,
        HybridEngineClient(server.endpoints.zmq_url, GEOMETRY) as engine,
    ):
        prefixes = [tokens.tokens(4 * CHUNK) for _ in range(5)]
        stored = [engine.store_chunks(p, snapshot_chunks=[3]) for p in prefixes]
        wait_until(lambda: counters(server).get("l1_policy_evictions", 0) >= 1,
                   "the L1 eviction loop to ask HiState", timeout=20)
        settle(server)
        demoted = [i for i, p in enumerate(prefixes) if on_disk(disk, engine, p, ATTN_GROUP)]
        assert demoted and demoted == list(range(len(demoted)))  # oldest first
        assert len(demoted) < len(prefixes)
        for p, sp in zip(prefixes, stored, strict=True):
            got = engine.lookup_and_retrieve(p)
            assert got.hit_chunks == 4 and engine.matches(sp, got)
