"""``refresh_learned`` (``eviction`` NOTE 8): the learned worth of a pass, by hand.

``PassValue`` with ``α = 0.5`` (both classes' sums halve at every resume), then the queue
on ``test_cost_and_rank``'s tree: KV on tier 0 (the engine's pool, ranked by ``t``),
snapshots on tier 1 (the last).
"""

from __future__ import annotations

import pytest
from test_cost_and_rank import TOKEN_BYTES, tree

from lmcache_histate.core.eviction import EvictionQueue, PassValue
from lmcache_histate.core.rank import HitModel, ReaccessScale

USE, PASS = False, True


def test_pass_value_is_the_ratio_of_the_two_resume_rates_clipped_to_one() -> None:
    v = PassValue(0.5)
    assert (v.weight, v.samples) == (1.0, 0)
    # A resume of a passed snapshot before any used one was resumed from: no evidence
    # that a use outweighs a pass, the weight stays 1.
    v.resume(PASS, 10.0)
    assert v.weight == 1.0
    v = PassValue(0.5)
    v.expose(USE, 100.0)
    v.expose(PASS, 1000.0)
    v.expose(PASS, -5.0)  # a negative time at risk counts as none
    assert v.exposure == [100.0, 1000.0]
    # Halve, then add: resumes [1, 0], seconds [50 + 100, 500]. No passed snapshot was
    # resumed from: w = 0.
    v.resume(USE, 100.0)
    assert (v.resumes, v.exposure, v.weight) == ([1.0, 0.0], [150.0, 500.0], 0.0)
    # Resumes [0.5, 1], seconds [75, 250 + 500]: rates 0.5/75 = 1/150 and 1/750, w = 0.2.
    v.resume(PASS, 500.0)
    assert v.resumes == [0.5, 1.0] and v.exposure == [75.0, 750.0]
    assert v.weight == pytest.approx(0.2)
    # Resumes [0.25, 1.5], seconds [37.5, 375]: 1/150 against 1/250, w = 0.6.
    v.resume(PASS, 0.0)
    assert v.weight == pytest.approx(0.6)
    # Resumes [0.125, 1.75], seconds [18.75, 187.5]: 1/150 against 1/107.14, 1.4: w = 1.
    v.resume(PASS, 0.0)
    assert (v.weight, v.samples) == (1.0, 4)
    with pytest.raises(ValueError, match="alpha"):
        PassValue(0.0)


def test_refresh_learned_ranks_a_snapshot_between_its_last_use_and_its_last_pass() -> None:
    """Every node read at 100, snapshots stored at 0 (``used`` 0); S4 also resumed from at
    100 (``used`` 100: the use class), S2 and S6 in the pass class (``access > used``).

    Hit from S4 at 200 (path 1–4): S2 is passed, at risk 100 s (pass class); S4 is
    resumed from after 100 s (use class). Sums [0, 0]·0.5, then resumes [1, 0], seconds
    [100, 100·0.5 = 50]: w = 0. S2 (used 0, access 200) ranks on tier 0 at
    0 + 0·200 = 0, as ``refresh_used`` would.

    Hit from S6 at 300 (path 1–6): S2 passed again, at risk 100 s in the pass class; S4,
    used at 200 and passed now, 100 s in the use class: seconds [200, 150]. S6 (access
    100 > used 0, pass class) resumed from after 200 s: halve, resumes [0.5, 1], seconds
    [100, 75 + 200 = 275]: rates 0.005 and 1/275, w = 200/275 = 8/11. On tier 0 S2
    (used 0, access 300) ranks at 8/11·300 = 218.1818, S4 (used 200, access 300) at
    200 + 8/11·100 = 272.7273; the bundle S6 at its access, 300. The engine's release of
    the same hit (``sample=False``) learns nothing; S2 dropped from the last tier at 400
    adds its 100 s to the pass class and leaves w as it is (it moves at resumes only).
    """
    index, n = tree(kv_tier=0, snap_tier=1)
    n[4].used = 100.0
    q = EvictionQueue(index, 2, tau=10.0, token_bytes=TOKEN_BYTES, hit_model=HitModel(prior=0.9),
                      reaccess=ReaccessScale(0.5), refresh_all=True, refresh_learned=True,
                      recency_tiers=1)
    for node in index.nodes.values():
        q.update(node)
    a = [n[k] for k in (1, 2, 3, 4, 5, 6)]
    q.touch(a, 4, 200.0)
    v = q.pass_value
    assert (v.resumes, v.exposure, v.weight, v.samples) == ([1.0, 0.0], [100.0, 50.0], 0.0, 1)
    assert q.rank(n[2], 0) == 0.0
    q.check()
    q.touch(a, 6, 300.0)
    assert v.resumes == [0.5, 1.0] and v.exposure == [100.0, 275.0]
    assert v.weight == pytest.approx(8 / 11)
    assert q.rank(n[2], 0) == pytest.approx(2400 / 11)
    assert q.rank(n[4], 0) == pytest.approx(200 + 800 / 11)
    assert q.rank(n[6], 0) == 300.0
    q.check()
    q.touch(a, 6, 310.0, sample=False)
    assert (v.samples, v.exposure) == (2, [100.0, 275.0])
    n[2].access = 300.0  # the release above refreshed it: back to its last lookup's time
    q.observe_demotion(n[2], 1, 400.0)
    assert v.exposure == [100.0, 375.0] and v.weight == pytest.approx(8 / 11)
