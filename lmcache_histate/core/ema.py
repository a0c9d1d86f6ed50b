"""Seeded exponential moving averages: the online estimates the core keeps.

The residence times behind the interval controller's pressure factor (``interval``) and
the re-access scale behind the eviction score's ``τ`` (``rank``) are both EMAs over
event samples. The first sample *seeds* the average instead of being shrunk towards an
arbitrary zero, so an estimate is usable after one observation.
"""

from __future__ import annotations

__all__ = ["DEFAULT_ALPHA", "SeededEMA", "check_alpha", "seeded_step"]

DEFAULT_ALPHA = 0.05
"""The weight of the newest sample (``CacheConfig.ema_alpha``'s default)."""


def check_alpha(alpha: float) -> float:
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    return alpha


def seeded_step(ema: float, samples: int, value: float, alpha: float) -> float:
    """The average after one more non-negative sample (``samples`` seen before it)."""
    value = max(0.0, float(value))
    return value if samples == 0 else ema + alpha * (value - ema)


class SeededEMA:
    """One seeded EMA: ``value`` after ``samples`` observations (0.0 before any)."""

    __slots__ = ("alpha", "samples", "value")

    def __init__(self, alpha: float = DEFAULT_ALPHA) -> None:
        self.alpha = check_alpha(alpha)
        self.value = 0.0
        self.samples = 0

    def observe(self, sample: float) -> None:
        self.value = seeded_step(self.value, self.samples, sample, self.alpha)
        self.samples += 1
