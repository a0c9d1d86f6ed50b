"""The helpers on tier bitmasks (bit ``t`` = tier ``t``): ``index.bits``, ``placement.only_on``."""

from __future__ import annotations

import pytest

from lmcache_histate.core.index import bits
from lmcache_histate.core.placement import only_on
from lmcache_histate.core.tiers import TierSpec


@pytest.mark.parametrize(
    ("mask", "tier", "lower", "expected"),
    [
        (0b001, 0, 1, True),   # on tier 0 only: must move to 1
        (0b011, 0, 1, False),  # a copy is already on 1: nothing to move
        (0b100, 0, 1, False),  # on tier 2 only: nothing on 0 to move
        (0b010, 1, 2, True),   # on tier 1 only, moving to 2
        (0b110, 1, 2, False),  # already on 2 (bit 4)
        (0b101, 0, 1, True),   # on 0 and 2, none on 1: the copy on 0 moves
    ],
)
def test_only_on_reads_the_two_tiers_bits(mask: int, tier: int, lower: int, expected: bool) -> None:
    assert only_on(mask, tier, lower) is expected


def test_bits_lists_tiers_fast_to_slow() -> None:
    # 0b1011 = tiers 0, 1 and 3.
    assert bits(0b1011) == [0, 1, 3]
    assert bits(0) == []


def test_tier_capacity_must_not_be_negative() -> None:
    assert TierSpec("cpu", 0).capacity == 0
    with pytest.raises(ValueError, match="'cpu': capacity must be ≥ 0, got -1"):
        TierSpec("cpu", -1)
