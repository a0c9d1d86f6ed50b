from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmcache_histate.core.eviction import IndexedHeap


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["set", "discard", "pop"]),
            st.integers(0, 20),
            st.floats(-1e6, 1e6, allow_nan=False),
        )
    )
)
def test_heap_matches_a_dict_model(ops: list[tuple[str, int, float]]) -> None:
    heap: IndexedHeap[int] = IndexedHeap()
    model: dict[int, float] = {}
    for op, key, pri in ops:
        if op == "set":
            heap.set(key, pri)
            model[key] = pri
        elif op == "discard":
            assert heap.discard(key) == (key in model)
            model.pop(key, None)
        elif model:
            k, p = heap.pop()
            assert p == min(model.values())
            assert model.pop(k) == p
        assert len(heap) == len(model)
        top = heap.peek()
        assert (top is None) == (not model)
        if top is not None:
            assert top[1] == min(model.values())


def test_equal_priorities_go_by_tie_then_insertion() -> None:
    # a, b, c all at 1.0; b has tie −3, c tie −3 inserted after b, a tie 0:
    # order (1.0, −3, seq 2) b, (1.0, −3, seq 3) c, (1.0, 0, seq 1) a.
    heap: IndexedHeap[str] = IndexedHeap()
    heap.set("a", 1.0)
    heap.set("b", 1.0, -3)
    heap.set("c", 1.0, -3)
    assert [heap.pop()[0] for _ in range(3)] == ["b", "c", "a"]
    # Changing only the tie moves an entry: d (0) then e (−1) at 2.0 → e first.
    heap.set("d", 2.0)
    heap.set("e", 2.0)
    heap.set("e", 2.0, -1)
    assert heap.pop()[0] == "e"


def test_moved_entries_are_compacted_and_the_order_survives() -> None:
    # Three keys re-set 1,000 times each leave 2,997 stale entries behind; the heap is
    # rebuilt whenever it holds over 2·max(live, 64) = 128 entries, so never more than
    # 129, and the last priorities (a 3.0, b 1.0, c 2.0) decide the order.
    heap: IndexedHeap[str] = IndexedHeap()
    for i in range(1000):
        for key, base in (("a", 3.0), ("b", 1.0), ("c", 2.0)):
            heap.set(key, base + (999 - i))
            assert len(heap._heap) <= 129
    assert len(heap) == 3
    assert [heap.pop() for _ in range(3)] == [("b", 1.0), ("c", 2.0), ("a", 3.0)]
    assert heap.peek() is None


def test_pop_returns_the_minimum_and_refuses_an_empty_heap() -> None:
    heap: IndexedHeap[str] = IndexedHeap()
    heap.set("x", 3.0)
    heap.set("y", -1.0)
    assert heap.pop() == ("y", -1.0)
    assert ("y" in heap, "x" in heap, len(heap)) == (False, True, 1)
    assert heap.pop() == ("x", 3.0)
    with pytest.raises(IndexError, match="empty IndexedHeap"):
        heap.pop()
    assert heap.peek() is None


def test_pop_from_an_empty_heap_says_so() -> None:
    with pytest.raises(IndexError, match=r"^pop from an empty IndexedHeap$"):
        IndexedHeap().pop()


def test_a_key_moved_away_and_back_keeps_its_insertion_place() -> None:
    """a and b at (1, tie 0), a inserted first. a moves to 2 and back to 1: it keeps its
    insertion number, so it still goes before b (``eviction`` NOTE 10)."""
    heap: IndexedHeap[str] = IndexedHeap()
    heap.set("a", 1.0)
    heap.set("b", 1.0)
    heap.set("a", 2.0)
    heap.set("a", 1.0)
    assert [heap.pop()[0] for _ in range(2)] == ["a", "b"]


def test_set_moves_a_key_whenever_priority_or_tie_changes() -> None:
    heap: IndexedHeap[str] = IndexedHeap()
    heap.set("k", 5.0, 0)
    heap.set("k", 0.0, 0)  # the new priority equals the old tie: still a move
    assert heap.priority("k") == 0.0
    # k (1.0, tie 0) inserted before j (1.0, tie 0); k's tie becomes 1: j goes first.
    heap.set("k", 1.0, 0)
    heap.set("j", 1.0, 0)
    heap.set("k", 1.0, 1)
    assert [heap.pop()[0] for _ in range(2)] == ["j", "k"]
    assert heap.discard("j") is False
    heap.set("j", 3.0)
    assert heap.discard("j") is True


def at_the_floor(live: int) -> IndexedHeap[int]:
    """``live`` keys at distinct priorities −1 … −live, then re-set in turn (the i-th
    re-set gives key ``i % live`` priority ``i + 1``) until the heap holds 128 =
    2·COMPACT_MIN priorities, none rebuilt: 128 is not above the floor. Each key is alone
    at its priority, so a re-set drops its old entry at once (``eviction`` NOTE 11):
    ``live`` entries."""
    heap: IndexedHeap[int] = IndexedHeap()
    for k in range(live):
        heap.set(k, -1.0 - k)
    for i in range(128 - live):
        heap.set(i % live, float(i + 1))
    assert (len(heap._heap), heap._entries) == (128, live)
    return heap


def test_set_compacts_exactly_when_stale_entries_outnumber_live_ones() -> None:
    """The rebuild waits until the heap holds over 2·max(live, COMPACT_MIN = 64) priorities.

    200 keys at distinct priorities, then each re-set once: after the i-th re-set the heap
    holds 200 + i priorities (i stale), at most 400 = 2·200 after the 200th, so none
    compacts; one more re-set makes 401 > 400 and the heap is rebuilt from the 200 live
    ones. With 10 keys the floor
    decides: 10 + 118 re-sets reach 128 = 2·64 entries without a rebuild, the next one
    (129) rebuilds to 10.
    """
    heap: IndexedHeap[int] = IndexedHeap()
    for k in range(200):
        heap.set(k, float(k))
    sizes = []
    for k in range(200):
        heap.set(k, 1000.0 + k)
        sizes.append(len(heap._heap))
    assert sizes == list(range(201, 401))
    heap.set(0, 5000.0)
    assert len(heap._heap) == 200

    small = at_the_floor(10)  # 118 re-sets: the i-th gives key i % 10 priority i + 1
    small.set(0, 999.0)
    assert len(small._heap) == 10
    # Last priorities: key k < 8 from i = 110 + k (111..117 for 1..7), 8 and 9 from
    # i = 108, 109 (109, 110), key 0 now 999: the rebuilt heap keeps that order.
    assert [small.pop()[0] for _ in range(10)] == [8, 9, 1, 2, 3, 4, 5, 6, 7, 0]


def test_discard_compacts_exactly_when_stale_entries_outnumber_live_ones() -> None:
    """150 keys discarded one by one: after the j-th discard the heap still holds 150
    priorities for 150 − j live keys; 150 > 2·(150 − j) first at j = 76 (74 live), where it
    is rebuilt to 74. Below the floor nothing compacts: 40 keys re-set to 128 = 2·64
    entries, then one discard (39 live, 128 not > 128) keeps all 128."""
    heap: IndexedHeap[int] = IndexedHeap()
    for k in range(150):
        heap.set(k, float(k))
    sizes = []
    for k in range(76):
        heap.discard(k)
        sizes.append(len(heap._heap))
    assert sizes == [150] * 75 + [74]
    assert heap.pop() == (76, 76.0)

    small = at_the_floor(40)
    small.discard(0)
    assert len(small._heap) == 128


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["set", "set", "discard", "pop"]),
            st.integers(0, 29),
            st.sampled_from([-1.0, -0.0, 0.0, 2.5, 7.0]),
            st.integers(-2, 0),
        ),
        max_size=600,
    )
)
def test_equal_priorities_match_a_model_of_the_whole_order(
    ops: list[tuple[str, int, float, int]],
) -> None:
    """Few distinct priorities, so entries share buckets and stale ones sit inside them,
    and enough re-sets to compact (over 128 entries): every pop is the model's minimum
    by ``(priority, tie, insertion)``, where a moved key keeps its insertion number and
    a discarded one gets a new one when it is set again (``eviction`` NOTE 10)."""
    heap: IndexedHeap[int] = IndexedHeap()
    model: dict[int, tuple[float, int, int]] = {}
    inserted = 0
    for op, key, pri, tie in ops:
        if op == "set":
            inserted += 1
            order = model[key][2] if key in model else inserted
            heap.set(key, pri, tie)
            model[key] = (pri, tie, order)
        elif op == "discard":
            assert heap.discard(key) == (key in model)
            model.pop(key, None)
        elif model:
            want = min(model, key=lambda k: model[k])
            assert heap.pop() == (want, model.pop(want)[0])
        assert len(heap) == len(model)
        top = heap.peek()
        if model:
            want = min(model, key=lambda k: model[k])
            assert top == (want, model[want][0])
        else:
            assert top is None
    assert [heap.pop()[0] for _ in range(len(model))] == sorted(model, key=lambda k: model[k])


def test_a_stale_entry_inside_a_shared_priority_is_skipped() -> None:
    """a, b, c at 1.0 share a bucket (insertion order a, b, c). b moves to 0.5: its old
    entry stays in the 1.0 bucket, stale. Pops: b (0.5), then a and c; the stale b is
    never returned. After a re-set to 1.0 with tie −1, a goes before c."""
    heap: IndexedHeap[str] = IndexedHeap()
    for key in "abc":
        heap.set(key, 1.0)
    heap.set("b", 0.5)
    assert heap._entries == 4
    assert heap.pop() == ("b", 0.5)
    heap.set("c", 1.0, -1)
    assert [heap.pop() for _ in range(2)] == [("c", 1.0), ("a", 1.0)]
    assert heap.peek() is None
    assert heap._entries == 0


def test_a_rebuild_keeps_equal_priorities_in_tie_then_insertion_order() -> None:
    """70 keys at 7.0 with tie −(k mod 3) share one bucket (70 entries). Each key in turn
    moves to 3.0 with its tie: its old entry stays in the 7.0 bucket, stale, so after the
    j-th move there are 70 + j entries, 140 = 2·70 after the 70th, and no rebuild. Key 0
    moved back to 7.0 makes 141 and rebuilds from the 70 live entries. The 69 keys at 3.0
    pop first, tie −2 (k = 2, 5, …, 68), then −1 (1, 4, …, 67), then 0 (3, 6, …, 69), each
    group in insertion order (a move keeps it), then key 0."""
    heap: IndexedHeap[int] = IndexedHeap()
    for k in range(70):
        heap.set(k, 7.0, -(k % 3))
    sizes = []
    for k in range(70):
        heap.set(k, 3.0, -(k % 3))
        sizes.append(heap._entries)
    assert sizes == list(range(71, 141))
    heap.set(0, 7.0)
    assert (heap._entries, len(heap._heap)) == (70, 2)
    rest = [heap.pop()[0] for _ in range(69)]
    assert rest == list(range(2, 70, 3)) + list(range(1, 70, 3)) + list(range(3, 70, 3))
    assert heap.pop() == (0, 7.0)


def test_a_key_alone_at_its_priority_leaves_it_at_once() -> None:
    """a at 1.0, b at 2.0, c at 4.0, then a moved to 3.0: a's old entry goes at once (3
    entries), its priority 1.0 stays in the heap (4 priorities) until it reaches the
    top: the next peek drops it (3 left) and returns b. Discarding b drops its entry at
    once (2), not its priority; the next pop drops 2.0 on its way to a (3.0)."""
    heap: IndexedHeap[str] = IndexedHeap()
    heap.set("a", 1.0)
    heap.set("b", 2.0)
    heap.set("c", 4.0)
    heap.set("a", 3.0)
    assert (heap._entries, len(heap._heap)) == (3, 4)
    assert heap.peek() == ("b", 2.0)
    assert (heap._entries, len(heap._heap)) == (3, 3)
    heap.discard("b")
    assert (heap._entries, len(heap._heap)) == (2, 3)
    assert heap.pop() == ("a", 3.0)
    assert (heap._entries, len(heap._heap)) == (1, 1)
    assert heap.pop() == ("c", 4.0)
    assert (heap._entries, len(heap._heap)) == (0, 0)


def test_a_rebuild_of_the_priorities_alone_keeps_shared_buckets() -> None:
    """64 keys at 5.0 share one bucket; each moves to 100 + k, leaving a stale entry
    there: 128 entries (64 stale, not above 2·64), 65 priorities. Key 0 is then re-set to
    200, 201, …: its old entry, alone, goes each time (128 entries stay), and a priority
    is added: 65 + r after r re-sets. At r = 64 the heap holds 129 > 128 priorities and is
    rebuilt; the entries are within the bound, so only the priorities are: one per bucket,
    65 (the 5.0 bucket, all stale, and 64 singles). The next peek drops the 64 stale
    entries and returns key 1; the order is keys 1 … 63, then 0 (263.0)."""
    heap: IndexedHeap[int] = IndexedHeap()
    for k in range(64):
        heap.set(k, 5.0)
    for k in range(64):
        heap.set(k, 100.0 + k)
    assert (heap._entries, len(heap._heap)) == (128, 65)
    for r in range(64):
        heap.set(0, 200.0 + r)
        if r == 62:
            assert (heap._entries, len(heap._heap)) == (128, 128)
    assert (heap._entries, len(heap._heap)) == (128, 65)
    assert heap.peek() == (1, 101.0)
    assert (heap._entries, len(heap._heap)) == (64, 64)
    assert [heap.pop()[0] for _ in range(64)] == [*range(1, 64), 0]


def test_the_default_tie_is_zero() -> None:
    """x set without a tie, then y with tie 0, both at 5.0: equal ties, so x (inserted
    first) goes first."""
    heap: IndexedHeap[str] = IndexedHeap()
    heap.set("x", 5.0)
    heap.set("y", 5.0, 0)
    assert [heap.pop()[0] for _ in range(2)] == ["x", "y"]
