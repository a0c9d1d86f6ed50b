"""The HiState runtime's bookkeeping against a stand-in L1 (no server, no sockets).

The server tests (``test_backend_server.py``) cover the normal paths end to end; these pin
down the cases that are hard to provoke through a real server: tensor-parallel workers
storing the shards of one chunk separately, stores whose prefix is not cached, commits
without a recorded STORE, objects removed from L1 behind HiState's back, session inference.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey, ipc_key_to_object_keys
from lmcache.v1.distributed.error import L1Error
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
from lmcache.v1.multiprocess.session import SessionManager
from lmcache.v1.multiprocess.token_hasher import TokenHasher
from lmcache_histate.backends.server.disk.tier import WriteDone
from lmcache_histate.backends.server.runtime.objects import node_key
from lmcache_histate.backends.server.runtime.runtime import HiStateRuntime
from lmcache_histate.backends.server.runtime.tier_actions import take_one

from lmcache_histate.config import parse_config
from lmcache_histate.core.cache import PlacementEvent
from lmcache_histate.core.tiers import KV, SNAPSHOT, ServerTier

CPU, DISK = ServerTier.CPU, ServerTier.DISK

CHUNK = 16
MODEL = "m"
KV_BYTES = 2 * 16 * 2 * 8 * 2  # [2, 16, 2, 8] bf16
SNAP_BYTES = 2 * 16 * 32 * 4  # [2, 16, 32] fp32


@dataclass
class AttnDesc:
    group_kinds: tuple[str, ...] = ("attention", "recurrent")


ATTN_LAYOUT = MemoryLayoutDesc(shapes=[torch.Size([2, 16, 2, 8])], dtypes=[torch.bfloat16])
REC_LAYOUT = MemoryLayoutDesc(shapes=[torch.Size([2, 16, 32])], dtypes=[torch.float32])


@dataclass
class Registry:
    kinds: tuple[str, ...] = ("attention", "recurrent")

    def find_attn_desc(self, model: str, world_size: int) -> AttnDesc:
        return AttnDesc(self.kinds)

    def find_group_layout_descs(self, model: str, world_size: int) -> dict:
        return {g: ATTN_LAYOUT if k == "attention" else REC_LAYOUT
                for g, k in enumerate(self.kinds)}


class Obj:
    """Stands in for LMCache's MemoryObj: the disk tier only touches ``byte_array``."""

    def __init__(self, size: int) -> None:
        self.byte_array = bytearray(size)


@dataclass
class FakeL1:
    runtime: HiStateRuntime | None = None
    resident: set[ObjectKey] = field(default_factory=set)
    locked: set[ObjectKey] = field(default_factory=set)

    def reserve_read(self, keys: list[ObjectKey]) -> dict[ObjectKey, tuple[L1Error, Any]]:
        """A resident object reads as zero bytes of its group's size (group 0: KV)."""
        return {k: (L1Error.SUCCESS, Obj(KV_BYTES if k.object_group_id == 0 else SNAP_BYTES))
                if k in self.resident else (L1Error.KEY_NOT_EXIST, None) for k in keys}

    def finish_read(self, keys: list[ObjectKey]) -> None:
        return None

    def delete(self, keys: list[ObjectKey], force: bool = False) -> dict[ObjectKey, L1Error]:
        out, gone = {}, []
        for k in keys:
            if k not in self.resident:
                out[k] = L1Error.KEY_NOT_EXIST
            elif k in self.locked:
                out[k] = L1Error.KEY_IS_LOCKED
            else:
                self.resident.discard(k)
                gone.append(k)
                out[k] = L1Error.SUCCESS
        if gone and self.runtime is not None:
            self.runtime.on_l1_removed(gone)  # what the L1 eviction-policy bridge does
        return out

    def clear(self) -> None:
        gone = [k for k in self.resident if k not in self.locked]
        self.resident -= set(gone)
        assert self.runtime is not None
        self.runtime.on_l1_removed(gone)


@dataclass
class StorageManager:
    """What the runtime reads of LMCache 0.5.6's ``StorageManager`` (runtime NOTE 2): its
    single L1 manager, ``is_multi_l1`` and the public ``l2_adapters()``, the ``(descriptor,
    adapter)`` pairs in adapter-id order (here the id stands for the descriptor)."""

    _l1_manager: FakeL1
    adapters: dict[int, Any] = field(default_factory=dict)
    is_multi_l1: bool = False

    def l2_adapters(self) -> list[tuple[Any, Any]]:
        return sorted(self.adapters.items())


@dataclass
class Ctx:
    storage_manager: StorageManager
    layout_desc_registry: Registry = field(default_factory=Registry)
    token_hasher: TokenHasher = field(default_factory=lambda: TokenHasher(CHUNK, "blake3"))
    chunk_size: int = CHUNK

    def __post_init__(self) -> None:
        self.session_manager = SessionManager(self.token_hasher)


def runtime_on_fake_l1(tmp_path: Path, clock: Callable[[], float]) -> HiStateRuntime:
    """A runtime with its disk tier in ``tmp_path``, attached to a ``FakeL1``, no janitor
    thread started (tests call ``tick()``)."""
    cfg = parse_config(
        {"model": "tiny-qwen3-next", "chunk_size": CHUNK, "cpu_gib": 1, "cpu_fill": 0.5,
         "disk_path": str(tmp_path), "disk_gib": 1}
    )
    runtime = HiStateRuntime(cfg, clock=clock)
    l1 = FakeL1()
    runtime.attach_server(Ctx(StorageManager(l1)))
    l1.runtime = runtime
    return runtime


@pytest.fixture
def rt(tmp_path: Path) -> Any:
    clock = iter(float(t) for t in range(1, 10_000))
    return runtime_on_fake_l1(tmp_path, lambda: next(clock))


def ipc(tokens: list[int], start: int, end: int, rid: str, ws: int = 1, worker: int | None = 0,
        configs: dict | None = None) -> IPCCacheServerKey:
    return IPCCacheServerKey(
        model_name=MODEL, world_size=ws, worker_id=worker, token_ids=tuple(tokens), start=start,
        end=end, request_id=rid, num_kv_readers=1, request_configs=configs,
    )


def objects(rt: Any, key: IPCCacheServerKey, chunks: list[int], group: int) -> list[ObjectKey]:
    hashes = [TokenHasher.hash_to_bytes(h)
              for h in rt.ctx.token_hasher.compute_chunk_hashes(list(key.token_ids), end=key.end)]
    keys = ipc_key_to_object_keys(key, hashes, [group])[0]
    return [keys[i] for i in chunks]


def commit(rt: Any, key: IPCCacheServerKey, kv: list[int], snaps: list[int]) -> set[ObjectKey]:
    """STORE then commit: what LMCache does for one request."""
    rt.on_store(key)
    keys = objects(rt, key, kv, 0) + objects(rt, key, snaps, 1)
    rt.actions.l1.resident.update(keys)
    return rt.on_committed(keys)


def toks(n: int, seed: int) -> list[int]:
    return [seed * 1000 + i for i in range(n * CHUNK)]


def test_attach_server_refuses_a_storage_manager_with_several_l1s(tmp_path: Path) -> None:
    """HiState drives one L1 manager (runtime NOTE 2): a storage manager with several is
    refused with one clear error, before anything is registered on it."""
    cfg = parse_config(
        {"model": "tiny-qwen3-next", "chunk_size": CHUNK, "cpu_gib": 1, "cpu_fill": 0.5,
         "disk_path": str(tmp_path), "disk_gib": 1}
    )
    runtime = HiStateRuntime(cfg)
    with pytest.raises(RuntimeError, match=r"^HiState needs LMCache's single-L1 storage manager"):
        runtime.attach_server(Ctx(StorageManager(FakeL1(), is_multi_l1=True)))
    assert runtime.actions.l1 is None


def test_store_routes_snapshots_and_keeps_finals(rt: Any) -> None:
    t = toks(4, 1)
    key = ipc(t, 0, len(t), "r1")
    route = commit(rt, key, [0, 1, 2, 3], [1, 3])
    assert route == set(objects(rt, key, [1, 3], 1))  # both snapshots go to disk
    # After persisting, the intermediate snapshot leaves L1, the final stays.
    rt.actions.l1.locked.add(objects(rt, key, [1], 1)[0])  # a lookup holds it: retried later
    leave = rt.on_persisted(sorted(route, key=str))
    assert leave == objects(rt, key, [1], 1)
    assert rt.actions.retry_l1 == set(leave)
    rt.actions.l1.locked.clear()
    rt.tick()
    assert not rt.actions.retry_l1 and leave[0] not in rt.actions.l1.resident
    rt.check()


def test_tensor_parallel_shards_join_their_chunk(rt: Any) -> None:
    t = toks(2, 2)
    k0 = ipc(t, 0, len(t), "r", ws=2, worker=0)
    k1 = ipc(t, 0, len(t), "r", ws=2, worker=1)
    commit(rt, k0, [0, 1], [1])
    route = commit(rt, k1, [0, 1], [1])
    assert route == set(objects(rt, k1, [1], 1))  # the second shard follows the first
    nk = rt.objects.part_of[objects(rt, k0, [0], 0)[0]][0]
    assert len(rt.objects.parts[nk][KV]) == 2
    # One shard vanishing from L1 makes the chunk unusable: the other shard goes too.
    shard0, shard1 = objects(rt, k0, [1], 0)[0], objects(rt, k1, [1], 0)[0]
    rt.actions.l1.resident.discard(shard0)
    rt.on_l1_removed([shard0])
    with rt.step():  # drains the removal; the reconciled deletes run as it ends
        pass
    assert shard1 not in rt.actions.l1.resident
    assert objects(rt, k0, [0], 0)[0] in rt.actions.l1.resident  # chunk 0 is intact
    rt.check()


def test_a_store_past_a_gap_is_rejected_and_deleted(rt: Any) -> None:
    t = toks(8, 3)
    key = ipc(t, 4 * CHUNK, len(t), "gap")  # chunks 0-3 were never cached
    keys = objects(rt, key, [4, 5, 6, 7], 0)
    rt.on_store(key)
    rt.actions.l1.resident.update(keys)
    assert rt.on_committed(keys) == set()
    assert not rt.actions.l1.resident  # deleted from L1
    assert rt.stats["objects_rejected.gap"] == 4


def test_objects_without_a_recorded_store_are_deleted(rt: Any) -> None:
    t = toks(2, 4)
    commit(rt, ipc(t, 0, len(t), "warm"), [0, 1], [1])  # creates the core
    other = toks(1, 5)
    keys = objects(rt, ipc(other, 0, len(other), "x"), [0], 0)
    rt.actions.l1.resident.update(keys)
    assert rt.on_committed(keys) == set()
    assert not set(keys) & rt.actions.l1.resident
    assert rt.stats["objects_rejected.unknown_chain"] == 1


def test_l1_removal_behind_our_back_drops_what_depends_on_it(
    rt: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = toks(4, 6)
    key = ipc(t, 0, len(t), "p")
    commit(rt, key, [0, 1, 2, 3], [3])
    first = objects(rt, key, [0], 0)
    rt.actions.l1.resident -= set(first)
    rt.on_l1_removed(first)  # e.g. POST /cache/clear
    taken: list[Any] = []
    take = rt.actions.take
    monkeypatch.setattr(rt.actions, "take", lambda: taken.append(take()) or taken[-1])
    with rt.step():  # drains the removal; what it takes then runs
        pass
    (actions,) = taken
    rest = set(objects(rt, key, [1, 2, 3], 0) + objects(rt, key, [3], 1))
    assert rest <= set(actions.l1_delete)
    assert set(objects(rt, key, [3], 1)) <= set(actions.disk_delete)  # its disk copy too
    assert first[0] not in rt.objects.part_of and not rt.core.nodes()
    rt.check()


def test_own_deletes_are_not_mistaken_for_losses(rt: Any) -> None:
    t = toks(2, 7)
    key = ipc(t, 0, len(t), "own")
    commit(rt, key, [0, 1], [0, 1])
    snap0, snap1 = objects(rt, key, [0, 1], 1)
    leave = rt.on_persisted([snap0, snap1])  # deleted from L1 right away
    assert leave == [snap0]
    assert snap0 not in rt.actions.l1.resident and snap1 in rt.actions.l1.resident
    with rt.step():  # drains the removal events of its own deletes
        pass
    assert rt.stats.get("snapshot_lost.cpu", 0) == 0
    assert rt.objects.key_tiers(snap0) == 1 << DISK  # still cached, on disk
    rt.check()


def test_sessions_continue_through_their_end_and_internal_accesses_count(rt: Any) -> None:
    t = toks(6, 8)
    commit(rt, ipc(t[: 4 * CHUNK], 0, 4 * CHUNK, "turn1"), [0, 1, 2, 3], [1, 3])
    samples = rt.core.stats().hit_samples
    rt.on_lookup(ipc(t, 0, len(t), "turn2", worker=None))  # continues from the end
    assert rt.core.stats().hit_samples == samples + 1
    p_end = rt.core.stats().end_probability
    rewrite = t[: 2 * CHUNK] + toks(3, 9)
    rt.on_lookup(ipc(rewrite, 0, len(rewrite), "edit", worker=None))  # diverges inside
    assert rt.core.stats().end_probability < p_end
    assert rt.stats["hits.internal"] == 1 and rt.stats["hits.end"] == 1
    commit(rt, ipc(t, 0, len(t), "turn2"), [4, 5], [5])
    assert rt.core.stats().sessions == 1  # turn 2 extended turn 1's session
    rt.on_end_session("turn2")
    rt.on_end_session("edit")
    assert all(n.pins == 0 for n in rt.core.nodes())
    hint = ipc(toks(2, 10), 0, 2 * CHUNK, "h", configs={"histate.session_id": "agent-7"})
    commit(rt, hint, [0, 1], [1])
    assert rt.core.has_session("agent-7")
    rt.check()


def test_failed_disk_write_is_not_persisted(rt: Any) -> None:
    t = toks(4, 11)
    key = ipc(t, 0, len(t), "w")
    commit(rt, key, [0, 1, 2, 3], [1, 3])
    inter, final = objects(rt, key, [1], 1)[0], objects(rt, key, [3], 1)[0]
    with rt.step():  # as a drain applies the disk tier's report of a batch
        rt.actions.apply_disk_report(WriteDone([], [inter, final], store_task=True))
    assert rt.stats["snapshot_not_persisted"] == 2
    assert inter not in rt.objects.part_of  # it only had the disk copy: gone, and out of L1
    assert inter not in rt.actions.l1.resident
    nk = rt.objects.part_of[final][0]
    assert rt.objects.tiers(nk, SNAPSHOT) == 1 << CPU  # the final keeps its CPU copy
    assert not rt.objects.tiers(nk, SNAPSHOT) & (1 << DISK)
    rt.check()


def test_group_kinds_come_from_the_registration_not_the_ids(rt: Any) -> None:
    """A model whose first layer is recurrent (Qwen3-Next) registers the recurrent group
    as object group 0: snapshots must still be recognised as snapshots."""
    rt.ctx.layout_desc_registry = Registry(("recurrent", "attention"))
    t = toks(2, 12)
    key = ipc(t, 0, len(t), "rev")
    rt.on_store(key)
    kv, snaps = objects(rt, key, [0, 1], 1), objects(rt, key, [0, 1], 0)
    rt.actions.l1.resident.update(kv + snaps)
    route = rt.on_committed(kv + snaps)
    assert route == set(snaps)  # both snapshots to disk, no KV
    assert rt.model.kv_chunk_bytes == KV_BYTES and rt.model.snapshot_bytes == SNAP_BYTES
    assert rt.on_persisted(snaps) == snaps[:1]  # chunk 1's is the final: stays in L1
    rt.check()


def test_placement_observers_see_every_core_event_with_its_objects(rt: Any) -> None:
    """The extension point for a shared index: an observer sees each placement while the
    part's objects are still in the object map. Two chunks, snapshots after both: KV of
    chunks 0 and 1 on the CPU tier, chunk 0's (intermediate) snapshot on disk, chunk 1's
    (the final) on the CPU with its durable copy on disk. One object per part (world size
    1, one group of each kind)."""
    seen: set[tuple[str, int, str, int, int]] = set()

    def observer(events: list[PlacementEvent]) -> None:
        for event in events:
            what, nk, part = event[:3]
            if what == "stored":
                seen.add((what, depth[nk], part, event[3], len(rt.objects.keys(nk, part))))
            else:
                seen.add((what, depth[nk], part, event[4 if what == "moved" else 3], 0))

    rt.actions.observers.append(observer)
    t = toks(2, 13)
    key = ipc(t, 0, len(t), "obs")
    depth = {node_key(k.chunk_hash, k.cache_salt): i
             for i, k in enumerate(objects(rt, key, [0, 1], 0))}
    commit(rt, key, [0, 1], [0, 1])
    assert seen == {
        ("stored", 0, KV, CPU, 1), ("stored", 1, KV, CPU, 1),
        ("stored", 0, SNAPSHOT, DISK, 1),
        ("stored", 1, SNAPSHOT, CPU, 1), ("stored", 1, SNAPSHOT, DISK, 1),
    }


def test_every_event_is_stamped_while_the_lock_is_held(tmp_path: Path) -> None:
    """Runtime NOTE 1: a ``now`` read before taking the lock could reach the core after a
    later stamp from another thread (a negative re-access gap). The clock here records,
    at each read, whether the calling thread holds the runtime's lock (``RLock._is_owned``,
    what ``threading.Condition`` checks); a commit, a lookup, a CPU eviction and a janitor
    tick each read it, and every read must be under the lock. A plan, a status and an L1
    eviction policy's question each read it once: they go through the same step."""
    held: list[bool] = []
    ticks = iter(float(t) for t in range(1, 10_000))

    def clock() -> float:
        held.append(runtime._lock._is_owned())  # type: ignore[attr-defined]
        return next(ticks)

    runtime = runtime_on_fake_l1(tmp_path, clock)
    t = toks(4, 12)
    commit(runtime, ipc(t[: 2 * CHUNK], 0, 2 * CHUNK, "a"), [0, 1], [1])
    runtime.on_lookup(ipc(t, 0, len(t), "b", worker=None))
    runtime.evict_cpu(1)
    runtime.tick()
    assert len(held) >= 4 and all(held), held
    # Readers and ``plan`` (which sets the core's step grid) go through the same step.
    reads = len(held)
    runtime.plan(0, 4 * CHUNK, 2 * CHUNK, 1.0)
    runtime.status()
    never = objects(runtime, ipc(t, 0, len(t), "b"), [0], 1)  # no snapshot after chunk 0
    assert runtime.not_cpu_tracked(never) == never
    assert len(held) == reads + 3 and all(held), held


def _register_unheld_part(rt: Any, key: IPCCacheServerKey, nk: list[int]) -> None:
    rt.objects.register(nk[0], SNAPSHOT, objects(rt, key, [0], 1)[0])  # no snapshot after 0


def _forget_inverse(rt: Any, key: IPCCacheServerKey, nk: list[int]) -> None:
    del rt.objects.part_of[objects(rt, key, [0], 0)[0]]


def _stray_inverse(rt: Any, key: IPCCacheServerKey, nk: list[int]) -> None:
    rt.objects.part_of[objects(rt, key, [0], 1)[0]] = (nk[0], SNAPSHOT)


def _drop_link(rt: Any, key: IPCCacheServerKey, nk: list[int]) -> None:
    del rt.objects.links[nk[1]]


def _orphan_link(rt: Any, key: IPCCacheServerKey, nk: list[int]) -> None:
    rt.objects.links[nk[1]].parent = None


def _swap_record_chain(rt: Any, key: IPCCacheServerKey, nk: list[int]) -> None:
    record = rt.objects.links[nk[1]].record
    record.chain = (nk[1], nk[0])


@pytest.mark.parametrize(("breaks", "invariant"), [
    (_register_unheld_part, "invariant 1"),
    (_forget_inverse, "invariant 2"),
    (_stray_inverse, "invariant 2"),
    (_drop_link, "invariant 3"),
    (_orphan_link, "invariant 4"),
    (_swap_record_chain, "invariant 4"),
])
def test_objects_check_names_each_broken_invariant(
    rt: Any, breaks: Callable[[Any, IPCCacheServerKey, list[int]], None], invariant: str
) -> None:
    """A store of two chunks (KV of both, the snapshot after chunk 1) leaves a map that
    passes ``check``; each mutation breaks one numbered invariant of ``objects``'
    docstring, and ``check`` fails naming it."""
    t = toks(2, 1)
    key = ipc(t, 0, len(t), "r1")
    commit(rt, key, [0, 1], [1])
    rt.check()
    nk = [node_key(k.chunk_hash, k.cache_salt) for k in objects(rt, key, [0, 1], 0)]
    breaks(rt, key, nk)
    with pytest.raises(AssertionError, match=invariant):
        rt.check()


def test_take_one_counts_down_and_leaves_no_zero_entry() -> None:
    """``take_one`` (the pending-count step shared by the commit queue and the expected L1
    removals): a key counted twice is taken twice, then refused; a key never counted is
    refused; no entry is left at zero."""
    counts: Counter[str] = Counter({"a": 2, "b": 1})
    assert take_one(counts, "a") and counts == Counter({"a": 1, "b": 1})
    assert take_one(counts, "a") and "a" not in counts
    assert not take_one(counts, "a") and "a" not in counts
    assert take_one(counts, "b") and not take_one(counts, "c")
    assert dict(counts) == {}


def test_a_plan_request_with_the_engines_step_price_moves_the_plan(rt: Any) -> None:
    """``histate.plan`` through the server module, on the runtime's core (chunks C = 16,
    pressure factor 0: no snapshot has left; ``p_end`` at its prior 0.9, so q = 0.1), for a
    256-token segment (L = 16C) on the engine's grid B = 240 (15C), as in the H100 worked
    example of ``core/interval.py`` NOTE 3 at these sizes. Unpriced (NOTE 2): the states that
    cost no step end, [240, 256]. At σ = 2 tokens per step end the cost is
    cost₀(kC) = 0.1·16k/2 + 2·(16/k)·(ceil(k/15) − k/15): k = 4: 3.2 + 5.867 = 9.067;
    5: 4 + 4.267 = 8.267; 6: 4.8 + 3.2 = 8.0; 7: 5.6 + 2.438 = 8.038; 8: 6.4 + 1.867 =
    8.267; 15: 12 + 0 -> every 6 chunks: [96, 192, 256]. A request without the keys keeps
    grid and price; σ = 0 unprices it again. ``/status`` reports what the plans use; a bad
    price is refused, naming the key, and changes nothing."""
    from lmcache_histate.backends.server.access import RpcRefused
    from lmcache_histate.backends.server.plugins import HiStateServerModule

    module = HiStateServerModule(rt.ctx, rt)
    rt.on_lookup(ipc(toks(2, 7), 0, 2 * CHUNK, "r"))  # the core is made at its first lookup

    def plan(**extra: Any) -> list[int]:
        payload = json.dumps({"start_tokens": 0, "input_tokens": 256, **extra}).encode()
        return json.loads(module.plan_rpc(payload))["boundaries"]

    assert rt.status()["step_tokens"] is None and rt.status()["step_price"] == 0.0
    assert plan(step_tokens=240) == [240, 256]
    assert plan(step_tokens=240, step_price=2) == [96, 192, 256]
    assert (rt.status()["step_tokens"], rt.status()["step_price"]) == (240, 2.0)
    assert plan() == [96, 192, 256]
    bad = [json.dumps({"input_tokens": 256, "step_price": v}).encode() for v in (-1, "2", True)]
    for payload in [*bad, b'{"input_tokens": 256, "step_price": NaN}']:
        with pytest.raises(RpcRefused, match=r"step_price must be a finite number >= 0"):
            module.plan_rpc(payload)
    assert rt.status()["step_price"] == 2.0
    assert plan(step_price=0) == [240, 256]
