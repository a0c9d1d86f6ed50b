"""``file-lru``: the paper's file-level LRU ablation (``sim/baselines/file_lru.py``).

Tiny geometry so every number can be worked out by hand: 4-token chunks, 1 KV byte per
token (a KV chunk = 4 B), an 8 B snapshot (N_s = 8 tokens).
"""

from __future__ import annotations

from lmcache_histate.sim.baselines import BASELINES, baseline_policies
from lmcache_histate.sim.baselines.file_lru import FileLRUPolicy, file_lru_policy
from lmcache_histate.sim.capture import Capture, capture_of, capture_time
from lmcache_histate.sim.trace_model import Request

GEO = {"chunk_tokens": 4, "kv_bytes_per_token": 1, "snapshot_bytes": 8}


def request(sid: str, keys: list[int], tokens: int) -> Request:
    return Request(sid, 0, 0.0, 0.0, tokens, 1, tuple(keys))


def row(gpu_bytes: int = 1000) -> FileLRUPolicy:
    """The row over 1,000 B CPU and disk tiers, after equal KV and snapshot residence
    times (5 s each): pressure factor 1, the choice the tests below derive by hand (with
    nothing seen leaving, F = 0 would give a state at every chunk: ``core.interval``)."""
    pol = file_lru_policy("file-lru", [("gpu", gpu_bytes), ("cpu", 1000), ("disk", 1000)], **GEO)
    pol.interval.residence.observe_kv(5.0)
    pol.interval.residence.observe_snapshot(5.0)
    assert pol.interval.pressure_factor == 1.0
    return pol


def test_row_is_registered_after_the_lru_rows() -> None:
    assert BASELINES[-3:] == ("lru", "lru-refresh-all", "file-lru")
    row = baseline_policies(**GEO, gpu_bytes=100, cpu_bytes=100, disk_bytes=100)["file-lru"]()
    assert isinstance(row, FileLRUPolicy) and row.name == "file-lru"


def test_placement_and_interval_are_histate_s() -> None:
    # One 48-token segment, pressure factor 1 (``row``): the interval cost is
    # I/2 + 8·48/I over multiples of 4: I = 24 → 12 + 16 = 28; I = 28 → 14 + 13.71 =
    # 27.71; I = 32 → 16 + 12 = 28. So I = 28: states at 28 tokens (chunk 7, an
    # intermediate → disk) and at 48 (chunk 12, the final → GPU); KV on the GPU.
    pol = row()
    keys = list(range(1, 13))
    req = request("A", keys, 48)
    pol.complete(req, pol.begin(req, 1.0), 1.0)
    nodes = [pol.engine.index.get(k) for k in keys]
    assert [i + 1 for i, n in enumerate(nodes) if n.has_snapshot] == [7, 12]
    assert pol.resident(nodes[6]) == ("gpu", "disk")
    assert pol.resident(nodes[11]) == ("gpu", "gpu")
    assert all(pol.resident(n)[0] == "gpu" for n in nodes)


def test_objects_leave_one_by_one_not_as_units() -> None:
    # GPU 56 B: session A's 12 KV chunks (48 B) + its final state (8 B) fill it; A's
    # intermediate state (chunk 7) is on disk. Session B (t = 2) stores 2 chunks + its
    # final (a 8-token segment: I = 8 → 4 + 8 = 12, I = 12 → 6 + 5.33 = 11.33, > 8, so
    # the final only): 16 B, so four 4-B objects of A must go down. All of A's objects
    # were released at t = 1; KV wins ties and the deepest chunk was queued first, so
    # A's KV chunks 12, 11, 10, 9 move to the CPU while A's final state (chunk 12) stays
    # on the GPU without its KV: a split a bundle never makes.
    pol = row(gpu_bytes=56)
    a = list(range(1, 13))
    req = request("A", a, 48)
    pol.complete(req, pol.begin(req, 1.0), 1.0)
    b = [101, 102]
    req = request("B", b, 8)
    pol.complete(req, pol.begin(req, 2.0), 2.0)
    index = pol.engine.index
    tiers = [pol.resident(index.get(k)) for k in a]
    assert [t[0] for t in tiers] == ["gpu"] * 8 + ["cpu"] * 4
    assert tiers[11] == ("cpu", "gpu")
    assert tiers[6] == ("gpu", "disk")
    assert [pol.resident(index.get(k)) for k in b] == [("gpu", None), ("gpu", "gpu")]
    pol.engine.check()


def test_interval_states_are_charged_as_histate_charges_them() -> None:
    # The 48-token segment of test_placement_and_interval_are_histate_s plans states at
    # chunks 7 (intermediate) and 12 (final). HiState's bill for such a plan
    # (``histate_capture``): prefill in steps of one 4-token chunk and one device → host
    # copy (the intermediate state). With a 2 ms step overhead, an 8,192-token engine
    # step and 8 B/s copies: 48 recomputed tokens take ceil(48/4) = 12 small steps
    # instead of ceil(48/8192) = 1, so 11 more steps = 0.022 s; one 8-B copy = 1.0 s.
    pol = row()
    keys = list(range(1, 13))
    req = request("A", keys, 48)
    lookup = pol.begin(req, 1.0)
    cap = capture_of(pol, req, lookup)
    assert cap == Capture(step_tokens=4, splits=0, host_states=1)
    compute, copy = capture_time(
        cap, 48, 8, step_overhead_s=2e-3, engine_step_tokens=8192, copy_bytes_per_s=8.0
    )
    assert (round(compute, 9), copy) == (0.022, 1.0)
    # What is charged is what is stored: states at chunks 7 and 12, nothing else.
    pol.complete(req, lookup, 1.0)
    nodes = [pol.engine.index.get(k) for k in keys]
    assert [i + 1 for i, n in enumerate(nodes) if n.has_snapshot] == [7, 12]


def test_a_request_adding_no_segment_plans_and_stores_no_state() -> None:
    # A repeats A's 12 chunks: the KV match covers the prompt, so there is no new
    # segment, no interval state (no host copy) and the final state stays the one saved.
    pol = row()
    keys = list(range(1, 13))
    req = request("A", keys, 48)
    pol.complete(req, pol.begin(req, 1.0), 1.0)
    again = pol.begin(req, 2.0)
    assert again.handle.plan.chunks == []
    assert capture_of(pol, req, again).host_states == 0
