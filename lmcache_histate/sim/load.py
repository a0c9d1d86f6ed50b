"""The load rule: a think-time cap derived from a target request rate.

A trace's think times decide how many requests per hour a closed-loop replay issues,
and a cap on them (``SimSetup.max_think_s``) sets that rate. A cap chosen once for one
set of sessions does not carry: a sample with one long, chatty session replays at half
the rate under the same cap. So a set-up may state its load as a TARGET instead,
``target_rate_per_h``: the requests per hour over the bulk of the run
(``report.bulk_rate``: the central 90 % of requests by arrival, which a session left
alone at the end cannot drag down), and the cap is derived from the trace at hand.

Algorithm (``calibrate``): replay the trace, unjittered, through the ``unlimited``
reference row (it never evicts, so no policy's hits enter the load), and bisect the cap
geometrically between ``LOW_S`` and ``HIGH_S`` for ``STEPS`` steps on whether the bulk
rate is above the target (the rate falls as the cap grows: longer pauses, the same
requests). The cap returned is the smallest one found whose rate is at or below the
target; it is the same for every row of a table, so all rows see the same timing.
``STEPS = 9`` halves the log-range 9 times: the cap is known within a factor
``(HIGH_S / LOW_S) ** (1 / 512)`` ≈ 1.012, i.e. ±1.2 %.

Where the target cannot be reached (the rate with the smallest cap is already below
it), the smallest cap is used and ``Calibration.reached`` is False: the report says so.

Example: the shared Weka subset ≤ 100K tokens at ≤ 24 sessions, 10 s apart, with a
target of 1,261 requests per hour (the paper's rate, 3,784 requests in 3 h).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import SimSetup
from .report import bulk_rate
from .server import simulate
from .trace_model import Trace

__all__ = ["HIGH_S", "LOW_S", "STEPS", "Calibration", "calibrate", "with_target_load"]

LOW_S = 1.0
HIGH_S = 7200.0
STEPS = 9


@dataclass(frozen=True, slots=True)
class Calibration:
    """The derived cap, the bulk rate it gives, and whether the target was reached."""

    target_rate_per_h: float
    max_think_s: float
    bulk_rate: float
    reached: bool

    def line(self) -> str:
        state = "" if self.reached else " (NOT reached: the smallest cap is already slower)"
        return (f"think gaps capped at {self.max_think_s:.0f} s, derived from a target of "
                f"{self.target_rate_per_h:,.0f} requests/h over the bulk of the run: "
                f"{self.bulk_rate:,.0f}/h on the reference replay{state}")


def _rate(trace: Trace, setup: SimSetup, cap: float) -> float:
    from .baselines.unlimited import UnlimitedPolicy

    policy = UnlimitedPolicy(
        chunk_tokens=setup.chunk_tokens, kv_bytes_per_token=setup.kv_bytes_per_token,
        snapshot_bytes=setup.snapshot_bytes,
    )
    run = simulate(trace, policy, setup.with_(max_think_s=cap))
    return bulk_rate(r.arrival for r in run.results)


def calibrate(trace: Trace, setup: SimSetup, target_rate_per_h: float) -> Calibration:
    """The cap of ``setup`` for ``trace`` that meets ``target_rate_per_h`` (module doc)."""
    if not target_rate_per_h > 0:
        raise ValueError(f"target_rate_per_h must be > 0, got {target_rate_per_h!r}")
    lo, hi = math.log(LOW_S), math.log(HIGH_S)
    low_rate = _rate(trace, setup, LOW_S)
    if low_rate <= target_rate_per_h:
        return Calibration(target_rate_per_h, LOW_S, low_rate, False)
    best = (HIGH_S, _rate(trace, setup, HIGH_S))
    for _ in range(STEPS):
        mid = (lo + hi) / 2
        rate = _rate(trace, setup, math.exp(mid))
        if rate <= target_rate_per_h:
            hi, best = mid, (math.exp(mid), rate)
        else:
            lo = mid
    return Calibration(target_rate_per_h, best[0], best[1], best[1] <= target_rate_per_h)


def with_target_load(trace: Trace, setup: SimSetup) -> tuple[SimSetup, Calibration | None]:
    """``setup`` with its think cap derived from its ``target_rate_per_h`` (None: as is)."""
    if setup.target_rate_per_h is None:
        return setup, None
    cal = calibrate(trace, setup, setup.target_rate_per_h)
    return setup.with_(max_think_s=cal.max_think_s), cal
