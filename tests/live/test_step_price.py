"""The step-price fit the step scheduler feeds (``step_scheduler.StepPriceFit``).

Pure: the steps are fed with the clock values a scheduler would read, no engine. Every
expected value is derived by hand in the test's docstring.
"""

from __future__ import annotations

import pytest
from lmcache_histate.backends.vllm.step_scheduler import StepCost, StepPriceFit


def run(fit: StepPriceFit, steps: list[tuple[int, float]], start: float = 0.0) -> float:
    """Feed back-to-back steps ``(tokens, seconds)``: a first output at ``start`` opens a
    busy period, each step's output comes its seconds after the previous one. Returns the
    clock at the last output."""
    now = start
    fit.step_ended(now, 1, busy=True)
    for tokens, seconds in steps:
        now += seconds
        fit.step_ended(now, tokens, busy=True)
    return now


def line(a: float, b: float, tokens: list[int]) -> list[tuple[int, float]]:
    return [(x, a + b * x) for x in tokens]


SPREAD = [100, 200, 300, 400, 500, 600, 700, 800]


def test_steps_on_a_line_give_its_intercept_over_its_slope() -> None:
    """t = 0.1 + 0.001·x: 0.1 s per step, 1 ms per token -> σ = 0.1 / 0.001 = 100 tokens.
    The first output only opens the period (nothing before it to time), so 8 steps fit."""
    fit = StepPriceFit()
    run(fit, line(0.1, 0.001, SPREAD))
    assert fit.steps == 8
    assert fit.coefficients == StepCost(pytest.approx(0.1), pytest.approx(0.001))
    assert fit.sigma == pytest.approx(100.0)


def test_an_idle_gap_and_an_empty_step_are_not_fitted() -> None:
    """After the engine ran out of requests (``busy`` False) the next output comes 50 s
    later: that period is idle time, not the step's; fitted, it would put (800, 50.9)
    among points on t = 0.1 + 0.001·x. A step that scheduled no token is not fitted
    either. σ stays 100 and the count 8."""
    fit = StepPriceFit()
    now = run(fit, line(0.1, 0.001, SPREAD))
    fit.step_ended(now + 0.2, 0, busy=True)  # every request waiting for a load
    fit.step_ended(now + 0.4, 100, busy=False)  # fitted: the engine was busy before it
    assert fit.steps == 9 and fit.sigma == pytest.approx(100.0)
    fit.step_ended(now + 50.4, 800, busy=True)  # the first step after the idle gap
    assert fit.steps == 9 and fit.sigma == pytest.approx(100.0)


def test_no_price_before_enough_steps_with_a_spread_of_token_counts() -> None:
    """Defaults: 8 steps whose token counts have a (weighted) standard deviation of at
    least 64. Seven steps on the line: None; the eighth: 100. Eight steps of 200 tokens:
    variance 0, None. With decay 1 (equal weights), 8 steps alternating 100 / 200 tokens
    have mean 150 and standard deviation 50 < 64: None; alternating 100 / 300, deviation
    100: σ = 100. Decode-sized steps (1..4 tokens) never answer."""
    fit = StepPriceFit()
    now = run(fit, line(0.1, 0.001, SPREAD[:7]))
    assert fit.steps == 7 and fit.sigma is None and fit.coefficients is None
    fit.step_ended(now + 0.9, 800, busy=True)
    assert fit.sigma == pytest.approx(100.0)

    same = StepPriceFit()
    run(same, line(0.1, 0.001, [200] * 8))
    assert same.sigma is None

    narrow, wide = StepPriceFit(decay=1.0), StepPriceFit(decay=1.0)
    run(narrow, line(0.1, 0.001, [100, 200] * 4))
    run(wide, line(0.1, 0.001, [100, 300] * 4))
    assert narrow.sigma is None and wide.sigma == pytest.approx(100.0)

    decode = StepPriceFit()
    run(decode, line(0.01, 0.001, [1, 2, 3, 4] * 10))
    assert decode.steps == 40 and decode.sigma is None


def test_a_negative_intercept_prices_a_step_end_at_zero() -> None:
    """t = −0.01 + 0.001·x (every step still takes 0.09 s or more): a = −0.01 < 0, a curved
    cost rather than a negative price -> σ = 0. A slope ≤ 0 (steps take 0.5 s whatever
    their tokens) has no σ at all."""
    fit = StepPriceFit()
    run(fit, line(-0.01, 0.001, SPREAD))
    assert (fit.coefficients or StepCost(0.0, 0.0)).step_s == pytest.approx(-0.01)
    assert fit.sigma == 0.0
    flat = StepPriceFit()
    run(flat, line(0.5, 0.0, SPREAD))
    assert flat.sigma is None


def test_decay_weighs_older_steps_less_and_forgets_them() -> None:
    """Three steps (100, 0.2), (200, 0.4), (300, 0.5), not on one line. Decay 0.5: the
    weights are 0.25, 0.5, 1, so W = 1.75, Sx = 425, Sy = 0.75, Sxx = 112,500, Sxy = 195:
    b = (W·Sxy − Sx·Sy) / (W·Sxx − Sx²) = (341.25 − 318.75) / (196,875 − 180,625) =
    22.5 / 16,250 = 9/6,500, a = (Sy − b·Sx) / W = (0.75 − 0.5885) / 1.75 = 6/65, σ =
    a/b = 200/3 = 66.7. Decay 1 (equal weights): W = 3, Sx = 600, Sy = 1.1, Sxx = 140,000,
    Sxy = 250: b = (750 − 660) / (420,000 − 360,000) = 0.0015, a = (1.1 − 0.9) / 3 = 1/15,
    σ = 400/9 = 44.4. Then 60 steps on t = 0.3 + 0.001·x (σ = 300) after 8 on
    t = 0.1 + 0.001·x: at decay 0.5 the old steps weigh 2^−60 of the newest, σ = 300."""
    points = [(100.0, 0.2), (200.0, 0.4), (300.0, 0.5)]
    halved, equal = (StepPriceFit(decay=d, min_steps=3, min_spread_tokens=1.0)
                     for d in (0.5, 1.0))
    for x, t in points:
        halved.add(x, t)
        equal.add(x, t)
    assert halved.coefficients == StepCost(pytest.approx(6 / 65), pytest.approx(9 / 6500))
    assert halved.sigma == pytest.approx(200 / 3)
    assert equal.sigma == pytest.approx(400 / 9)

    drifting = StepPriceFit(decay=0.5)
    now = run(drifting, line(0.1, 0.001, SPREAD))
    assert drifting.sigma == pytest.approx(100.0)
    for _ in range(8):
        for x, t in line(0.3, 0.001, [100, 400, 200, 800, 300, 600, 500]):
            now += t
            drifting.step_ended(now, x, busy=True)
    assert drifting.steps == 8 + 56
    for x, t in line(0.3, 0.001, [700, 100, 300, 200]):
        now += t
        drifting.step_ended(now, x, busy=True)
    assert drifting.sigma == pytest.approx(300.0)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"decay": 0.0}, "decay must be in"), ({"decay": 1.5}, "decay must be in"),
     ({"min_steps": 1}, "min_steps must be at least 2"),
     ({"min_spread_tokens": 0.0}, "min_spread_tokens positive")],
)
def test_bad_settings_are_refused(kwargs: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        StepPriceFit(**kwargs)
