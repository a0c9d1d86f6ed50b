from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lmcache_histate.core.heap import IndexedHeap


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
