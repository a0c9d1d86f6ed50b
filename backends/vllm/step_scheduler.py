"""``HiStateScheduler``: vLLM's scheduler, ending prefill steps only where a snapshot is planned.

Load it with ``--scheduler-cls lmcache_histate.backends.vllm.step_scheduler.HiStateScheduler``
(``SCHEDULER_CLS``) together with the HiState connector; keep vLLM's default
``--max-num-batched-tokens``.

Why a scheduler. In Mamba ``align`` mode a recurrent state exists only where a prefill step
ends: the blocks of a step's interior get the null block
(``vllm/v1/core/single_type_kv_cache_manager.py`` 1832-1842, ``MambaManager.allocate_new_blocks``:
``num_skipped_blocks`` nulls) and the GDN kernel writes only the step's final state; the
manager offers each retained step-end state to the connector
(``cache_blocks``, 1993-2007, ``_pending_boundary_state_offloads``). A snapshot the plan keeps
at a boundary needs a step to end there, and nothing else does.

What it changes in the schedule. Exactly one thing: after vLLM's own
``_mamba_block_aligned_split`` (``vllm/v1/core/sched/scheduler.py`` 443-556: block-aligned
ends below the prompt end, the last cacheable block boundary, the prompt's hash-tail
checkpoint, a shared-prefix junction), a prefill step that would run past the next
boundary the connector's plan keeps for that request ends there instead
(``HiStateConnector.planned_step_end``). The step budget stays vLLM's, so

* a request whose plan keeps no boundary below vLLM's own stops prefills in exactly the steps
  stock vLLM takes (its final snapshot is vLLM's last-cacheable-block stop when the LMCache
  chunk is the block size, the usual setting);
* a plan with ``k`` boundaries inside the prompt costs at most ``k`` extra step ends: with
  step ends forced at ``b_1 < ... < b_k`` and budget ``B`` the greedy split takes
  ``sum_i ceil(l_i / B)`` steps for the pieces ``l_0 ... l_k`` (sum ``L``), at most
  ``ceil(L / B) + k`` (``ceil(x) + ceil(y) <= ceil(x + y) + 1``), and no split with those
  step ends takes fewer.

The split runs for both places vLLM calls it: running requests (``schedule``, scheduler.py
724-727) and newly admitted ones (1173-1179), the latter after
``connector.get_num_new_matched_tokens`` (978-981) set the request's hits, which is all the
plan needs (its segment starts at the longer of the two hits). The scheduler reads the plan
through the connector it owns (``self.connector``); there is no shared state.

The step price. The plan prices each extra step end at ``σ`` tokens of prefill time
(``core/interval.py``), which only the engine can measure: the scheduler times the period
between consecutive ``update_from_output`` calls while the engine stayed busy against each
step's ``total_num_scheduled_tokens`` (:class:`StepPriceFit`: ``σ`` = fixed step time /
per-token time) and hands every estimate to the same connector
(``HiStateConnector.set_step_price``), which sends it with its next ``histate.plan``
requests. Until the fit can tell (NOTE 4) nothing is sent and the server keeps the price
it has. Only the engine can measure the price (``CacheConfig.step_price``;
``core/interval.py``: ``cost(I) = I/2 + F·N_s·L/I + σ·(L/I)·(ceil(I/B) − I/B)``);
:class:`StepPriceFit` is pure: the caller passes the clock values.

Algorithm of the fit. A step of ``x`` scheduled tokens takes ``t = a + b·x`` seconds: ``a``
the fixed time every step pays whatever it computes (scheduler pass, input preparation, the
sync that ends the step), ``b`` the time per token. Splitting a prefill at one more point adds
one step and no tokens, so it costs ``a`` seconds, ``a / b`` tokens of prefill time:

    σ = a / b   (tokens)

For each step the engine ran back to back with the one before (NOTE 3) the period between
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
of at least ``min_spread_tokens`` (NOTE 4) and while the fitted per-token time is not
positive; a step that followed an idle engine, or scheduled no token, never enters the
sums (NOTE 3).

Worked example (decay 1): three back-to-back steps of 100, 200 and 400 tokens taking 0.2,
0.3 and 0.5 s lie on ``t = 0.1 + 0.001·x``: ``W`` = 3, ``x̄`` = 233.3, ``t̄`` = 0.3333,
``var`` = 70,000/3 − 233.3² = 15,555.6, ``Sxy/W`` = 93.333, ``b`` = (93.333 − 77.778) /
15,555.6 = 0.001, ``a`` = 0.3333 − 0.2333 = 0.1, so ``σ`` = 100 tokens: one more step end
costs as much as prefilling 100 more tokens. What the figure means on a GPU: the
simulator's H100 estimate is 2 ms fixed per step over 80 µs per prefill token, ``σ`` = 25
tokens (``core/interval.py``'s worked example; ``sim/capture.py`` ``STEP_OVERHEAD_S``);
vLLM-CPU on the tiny model measured 12.5 ms over 77.9 µs, ``σ`` ≈ 160
(``benchmarks/live/results-step-overhead/step_overhead.md``).

What the line leaves out: attention's work grows with the context a step attends to, so a
step's time is not linear in its new tokens alone; the fit averages over the contexts the
engine saw recently.

Async scheduling. ``SchedulerConfig.get_scheduler_cls`` (``vllm/config/scheduler.py`` 228-253)
returns a configured class as is, so naming this class would drop vLLM's
``AsyncScheduler`` where the engine schedules asynchronously (the GPU default). Constructing
``HiStateScheduler`` returns a :class:`HiStateAsyncScheduler` (a subclass of both) when
``scheduler_config.async_scheduling`` is on (NOTE 1).

NOTE 1 (one name for both schedulers): vLLM decides ``async_scheduling`` after the flags are
parsed (platform hooks, speculative decoding), so the launcher cannot know which base class
to name. ``__new__`` returning an instance of a subclass keeps Python's ``__init__`` call
(the instance is a ``HiStateScheduler``), and the MRO ``HiStateAsyncScheduler ->
HiStateScheduler -> AsyncScheduler -> Scheduler`` runs vLLM's async initialisation.

NOTE 2 (the split on the state's block grid): vLLM's split aligns step ends to
``cache_config.block_size`` (``scheduler.py`` 469), which its invariant takes to be the Mamba
block ("slot p holds the state after exactly (p + 1) * block_size tokens", 501-505). On
vllm-cpu 0.32.0 the scheduler's ``cache_config.block_size`` is 128 tokens, the CPU
platform's default (``platforms/cpu.py`` 292-293), while its KV cache groups' block and its
own ``block_size`` are the Mamba page's, 384 tokens for the tiny model (both read in the
running scheduler; the raise to the Mamba page, ``platforms/interface.py`` 1093-1095, runs
in the worker process, ``multiproc_executor.py`` 701). So a 2,048-token step
from 0 ended at 2,048; the Mamba manager keeps that state in the slot of the block ending at
2,304, and vLLM's prefix cache and a connector that stores states by block position (stock
LMCache, ``lmcache_mp_metadata.append_block_ids``) file it as the state at 2,304. Measured
on the live benchmark's stock-LMCache stack: a prompt restored at 2,304 with the state at
2,048, first-step logprobs 6.1e-2 off recompute. HiState's own stores take vLLM's
per-boundary offers at planned step ends and were exact, but its unplanned step ends fell
off the grid too. The split therefore runs with ``cache_config.block_size`` set to the Mamba
group's block for the call (the scheduler thread is the field's only reader while it runs);
where the two agree nothing changes. On one GPU vLLM's own scheduler already splits on that
grid (the raise runs in the engine core's process with the ``uni`` executor); the live
benchmark's ``vllm-grid`` stack is vLLM alone with this class and no connector, its ``vllm``
stack vLLM's own scheduler with the CPU grid (``benchmarks/live/stacks.py`` NOTE 6).

NOTE 3 (busy steps only). The period between two step outputs is the later step's time
only while the engine went straight from one to the next: after the scheduler ran out of
unfinished requests the engine waited for the next one, and that gap is idle time, not
step time (fitted, it would add seconds to ``a``). A step that scheduled no token (every
request waiting for a load) runs no forward pass, so it says nothing about either
coefficient. With asynchronous scheduling the engine schedules step ``n + 1`` before it
processes step ``n``'s output, so consecutive outputs are still one step period apart.

NOTE 4 (a spread of token counts). A line through steps of one size is undetermined
(``var`` = 0), and through sizes a few tokens apart (decode batches) its slope is the
steps' timing jitter: at 80 µs per token, a spread of 4 tokens moves a step by 0.3 ms,
inside one step's noise, and ``σ = a / b`` divides by that slope. So the fit answers only
once its steps span ``min_spread_tokens`` (weighted standard deviation), which prefill
steps of different lengths do, and only after ``min_steps`` of them.

Version guard: written against vLLM 0.32.0's ``Scheduler._mamba_block_aligned_split(request,
num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens)``, which 0.33.0
and 0.34.0 keep (their callers gain ``num_hash_lookahead_tokens``, not the method; checked
statically by ``make compat``); a vLLM outside the checked series, or that method with other
parameters, stops the engine at start with an error naming both (``check_vllm``).
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Protocol

import vllm
from lmcache_histate.backends.upstream.versions import VLLM
from lmcache_histate.backends.vllm.connector_config import SCHEDULER_CLS
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

__all__ = [
    "SUPPORTED_VLLM",
    "HiStateAsyncScheduler",
    "HiStateScheduler",
    "StepCost",
    "StepPlanner",
    "StepPriceFit",
    "check_vllm",
    "is_step_scheduler",
    "state_block_size",
]

logger = logging.getLogger("lmcache_histate.step_scheduler")

SUPPORTED_VLLM = tuple(sorted({v.rsplit(".", 1)[0] + "." for v in VLLM}))
"""vLLM release series whose scheduler this module was checked against (prefixes): the
checked versions (``upstream.versions``)."""
_SPLIT_PARAMS = (
    "self", "request", "num_new_tokens", "num_new_local_computed_tokens",
    "num_external_computed_tokens",
)


@dataclass(frozen=True)
class StepCost:
    """A fitted step time ``t = a + b·x`` (``x`` scheduled tokens): ``σ = a / b``."""

    step_s: float
    """``a``: the fixed seconds every step pays (negative where the cost curves)."""
    token_s: float
    """``b``: seconds per scheduled token."""


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
        it answers (NOTE 4)."""
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
        processed. The step is fitted when the previous one left the engine busy (NOTE 3)."""
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
    def coefficients(self) -> StepCost | None:
        """The fitted line, or None (too few steps, too little spread: NOTE 4)."""
        if self._steps < self.min_steps:
            return None
        w = self._sw
        mean_x, mean_t = self._sx / w, self._sy / w
        var = self._sxx / w - mean_x * mean_x
        if not var >= self.min_spread_tokens ** 2:
            return None
        b = (self._sxy / w - mean_x * mean_t) / var
        return StepCost(mean_t - b * mean_x, b)

    @property
    def sigma(self) -> float | None:
        """``σ = a / b`` tokens of prefill per step end, at least 0; None while the fit
        cannot tell (NOTE 4) or its per-token time is not positive."""
        fit = self.coefficients
        if fit is None or not fit.token_s > 0.0:
            return None
        sigma = max(0.0, fit.step_s / fit.token_s)
        return sigma if math.isfinite(sigma) else None


class StepPlanner(Protocol):
    """What the scheduler needs from the connector (``HiStateConnector`` provides it)."""

    def planned_step_end(self, request_id: str, start: int, end: int) -> int:
        """The end of a prefill step ``[start, end)``: the first planned boundary strictly
        inside it, else ``end``."""
        ...

    def set_step_price(self, sigma: float) -> None:
        """Send ``sigma`` (tokens of prefill per step end) with the next plan requests."""
        ...


def check_vllm(version: str = vllm.__version__, split: Any = None) -> None:
    """Raise ``RuntimeError`` unless vLLM's split is the one this module was written for."""
    split = Scheduler._mamba_block_aligned_split if split is None else split
    params = tuple(inspect.signature(split).parameters)
    if not version.startswith(SUPPORTED_VLLM) or params != _SPLIT_PARAMS:
        raise RuntimeError(
            f"HiStateScheduler supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)} "
            f"(Scheduler._mamba_block_aligned_split{_SPLIT_PARAMS[1:]}); this is vLLM "
            f"{version} with _mamba_block_aligned_split{params[1:]}. Drop --scheduler-cls and "
            "set --max-num-batched-tokens to the block size N instead (every step one block)"
        )


class HiStateScheduler(Scheduler):  # type: ignore[misc]
    """vLLM's scheduler whose prefill steps also end at the connector's planned boundaries."""

    def __new__(cls, *args: Any, **kwargs: Any) -> HiStateScheduler:
        config = kwargs.get("vllm_config", args[0] if args else None)
        asynchronous = bool(getattr(getattr(config, "scheduler_config", None),
                                    "async_scheduling", False))
        if cls is HiStateScheduler and asynchronous:
            cls = HiStateAsyncScheduler  # NOTE 1
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_vllm()
        super().__init__(*args, **kwargs)
        planner = self.connector
        self._histate_planner: StepPlanner | None = (
            planner if callable(getattr(planner, "planned_step_end", None)) else None
        )
        self._histate_steps = StepPriceFit()
        self._histate_priced = False
        self._histate_state_block = state_block_size(self.kv_cache_config)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        """vLLM's update; the step's period and tokens also go into the step-price fit."""
        now = time.monotonic()  # the step's output is in: its period ends here
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._histate_planner is None:  # no HiState connector: nobody to send σ to
            return outputs
        steps = self._histate_steps
        steps.step_ended(now, int(scheduler_output.total_num_scheduled_tokens),
                         self.has_unfinished_requests())
        sigma = steps.sigma
        if sigma is None:
            return outputs
        if not self._histate_priced:  # once: what the plans are priced with from now on
            self._histate_priced = True
            fit = steps.coefficients or StepCost(0.0, 0.0)
            logger.info("HiState: step price measured over %d busy steps: %.2f ms per step, "
                        "%.1f us per token, sigma = %.1f tokens", steps.steps,
                        fit.step_s * 1e3, fit.token_s * 1e6, sigma)
        self._histate_planner.set_step_price(sigma)
        return outputs

    def _mamba_block_aligned_split(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        num = self._split_on_state_grid(
            request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens
        )
        if num <= 0:
            return num
        # The same start vLLM's split uses (scheduler.py 458-462).
        start = (request.num_computed_tokens + num_new_local_computed_tokens
                 + num_external_computed_tokens)
        if start >= request.num_prompt_tokens:
            return num  # decode, or replaying output tokens after a resume: no plan there
        return self.prefill_step_length(request, start, num, num_new_tokens)

    def _split_on_state_grid(self, *args: Any) -> int:
        """vLLM's split, aligned to the recurrent state's block (NOTE 2)."""
        config = self.cache_config
        grid = self._histate_state_block
        if grid is None or config.block_size == grid:
            return super()._mamba_block_aligned_split(*args)
        engine_block = config.block_size
        config.block_size = grid
        try:
            return super()._mamba_block_aligned_split(*args)
        finally:
            config.block_size = engine_block

    def prefill_step_length(self, request: Any, start: int, num: int, allowed: int) -> int:
        """Tokens of ``request``'s prefill step from ``start``, given vLLM's split ``num`` of
        the ``allowed`` tokens it may schedule: up to the next planned boundary."""
        if self._histate_planner is None:
            return num
        return self._histate_planner.planned_step_end(request.request_id, start, start + num) \
            - start


class HiStateAsyncScheduler(HiStateScheduler, AsyncScheduler):  # type: ignore[misc]
    """:class:`HiStateScheduler` on vLLM's asynchronous scheduler (NOTE 1)."""


def state_block_size(kv_cache_config: Any) -> int | None:
    """The block size of the recurrent-state (Mamba) KV cache group; None without one."""
    from vllm.v1.kv_cache_interface import MambaSpec

    sizes = {group.kv_cache_spec.block_size for group in kv_cache_config.kv_cache_groups
             if isinstance(group.kv_cache_spec, MambaSpec)}
    return sizes.pop() if len(sizes) == 1 else None


def is_step_scheduler(scheduler_cls: Any) -> bool:
    """Whether vLLM's configured ``scheduler_cls`` (a class, a qualified name or None) is
    :class:`HiStateScheduler` or a subclass of it."""
    if scheduler_cls is None:
        return False
    if isinstance(scheduler_cls, str):
        if scheduler_cls == SCHEDULER_CLS:
            return True
        from vllm.utils.import_utils import resolve_obj_by_qualname

        scheduler_cls = resolve_obj_by_qualname(scheduler_cls)
    return isinstance(scheduler_cls, type) and issubclass(scheduler_cls, HiStateScheduler)
