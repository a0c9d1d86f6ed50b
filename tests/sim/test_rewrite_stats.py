"""``sim.rewrite_stats``: where requests cut their predecessors' context, counted by hand."""

from __future__ import annotations

import pytest

from lmcache_histate.sim.rewrite_stats import rewrite_stats, rewriting_requests
from lmcache_histate.sim.trace_model import Request, Session, Trace


def _session(sid: str, chains: list[tuple[int, ...]]) -> Session:
    reqs = tuple(
        Request(sid, k, float(k), 0.0, len(c), 1, c) for k, c in enumerate(chains)
    )
    return Session(sid, None, reqs)


def test_cuts_are_located_in_the_turn_that_appended_them() -> None:
    """Session A, appended spans (s_k, n_k) by hand:
    r0 (1,2,3): (0, 3); r1 extends: (3, 5); r2 keeps 4 of r1's 5 chunks: a rewrite at
    c = 4, inside r1's span (3, 5) → 0 turns back, offset (4 − 3)/(5 − 3) = 0.5; its span
    (4, 6); r3 extends: (6, 7); r4 keeps 1 chunk: c = 1 lies only in r0's span (0, 3) →
    (4 − 1) − 0 = 3 turns back; r5 keeps nothing: a reset. Session B never rewrites; its
    r1 repeats r0 exactly (s = n = 2: not a rewrite)."""
    a = _session("a", [(1, 2, 3), (1, 2, 3, 4, 5), (1, 2, 3, 4, 9, 10),
                       (1, 2, 3, 4, 9, 10, 11), (1, 7), (8,)])
    b = _session("b", [(5, 6), (5, 6)])
    st = rewrite_stats(Trace("t", 64, (a, b)))
    assert (st.requests, st.rewrites, st.resets) == (8, 3, 1)
    assert dict(st.turns_back) == {0: 1, 3: 1}
    assert st.last_turn_offsets == [0.5]
    assert st.last_turn_share == pytest.approx(1 / 3)
    # The same three, by key: A's r2 (the cut at 4), r4 (the cut at 1), r5 (the reset).
    assert rewriting_requests(Trace("t", 64, (a, b))) == {("a", 2), ("a", 4), ("a", 5)}


def test_a_shorter_prompt_that_keeps_a_prefix_is_a_rewrite() -> None:
    """r1 (1,2) keeps 2 of r0's 4 chunks and appends nothing: a cut at c = 2 in r0's span
    (0, 4), offset 2/4; r2 (1,2,3) extends r1 (s = 2 = n_1): no rewrite."""
    st = rewrite_stats(Trace("t", 64, (_session("a", [(1, 2, 3, 4), (1, 2), (1, 2, 3)]),)))
    assert (st.rewrites, st.resets, dict(st.turns_back)) == (1, 0, {0: 1})
    assert st.last_turn_offsets == [0.5]


def test_no_rewrites_no_share() -> None:
    st = rewrite_stats(Trace("t", 64, (_session("a", [(1,), (1, 2)]),)))
    assert (st.requests, st.rewrites, st.last_turn_share) == (2, 0, 0.0)
