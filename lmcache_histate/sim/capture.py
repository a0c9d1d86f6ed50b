"""What capturing recurrent states costs a request, and how much memory a row has.

A recurrent state exists only where a prefill step ends (vLLM ``align`` mode,
docs/design.md §5.2), so WHERE a row keeps states decides how the engine must run the prefill,
and every state kept off the GPU is copied there from the device. ``Capture`` is a
request's bill beyond a plain prefill; the server model (``server``) turns it into time
with the cost model's constants (``capture_time``) and charges it on the request's path:

* **Planned step ends.** HiState's rows run with the live scheduler
  (``backends/vllm/step_scheduler.py``): the engine's step budget, and a step end at each
  state the plan keeps below its final one (the final one is vLLM's own last-block stop,
  which every row has). A prefill of ``L`` tokens split at those ends into pieces
  ``l_0 … l_k`` takes ``Σ ceil(l_i / B)`` steps instead of ``ceil(L / B)``
  (``planned_extra_steps``), at most one more per planned state.
* **Small steps.** A row that captures states at arbitrary chunk boundaries with vLLM's own
  scheduler (a state at every chunk for ``unlimited``, ``file-lru``; HiState's rows in
  :data:`SMALL_STEP_ROWS`, the ablation of the rule above) must run every prefill in
  steps of one chunk (``max_num_batched_tokens`` in [N, 2N)):
  ``ceil(L / N) − ceil(L / engine_step_tokens)`` more steps for ``L`` recomputed tokens.
* **Forced step ends**: vLLM's shared-prefix junction, Marconi's branch point (one step
  each). SGLang reads its mid-chunk states from the chunked kernel's intermediate ``h``:
  no split.
* **Device → host copies** of mid-prefill states kept on a host tier (51.5 MB each for
  Qwen3.5-9B), at the PCIe bandwidth. NOTE 1: charged serially on the request's path, an
  upper bound: LMCache's server and vLLM's OffloadingConnector copy asynchronously, so
  the true cost lies between 0 and this. The final state and the KV, which every tiered
  row writes alike, are not charged.

Constants (NOTE 2: estimates with their sources, not measured on an H100;
``benchmarks/sim_weka.md`` shows HiState's row with ``step_overhead_s`` 0 and twice the
default as well; ``scripts/gpu_costs.py`` measures the price of a step end on a GPU and
``scripts/gpu_costs_fit.py`` writes it into a measured cost model, ``benchmarks/gpu_costs.md``):

* ``ENGINE_STEP_TOKENS`` = 8,192: vLLM's default ``max_num_batched_tokens`` for an
  OpenAI server on a ≥ 70 GiB non-A100 GPU (vllm 0.32 ``engine/arg_utils.py``,
  ``default_max_num_batched_tokens``); SGLang's ``--chunked-prefill-size`` on an 80 GB
  GPU is the same (``arg_groups/memory_hook.py``).
* ``STEP_OVERHEAD_S`` = 2 ms: the fixed cost of one more prefill step beyond its
  per-token work: the scheduler pass, input preparation, the host sync that ends every
  step, and the launch of a forward pass that is not CUDA-graphed (vLLM captures graphs
  up to 512 tokens on Hopper, ``config/vllm.py`` ``default_max_graph_size``, so a
  528-token step runs eagerly: ≈ 600 kernel launches for 32 layers at a few µs each,
  mostly hidden behind the ~40 ms of GPU work of such a step) — 1 to 3 ms, we take the
  middle. The lower matmul efficiency of 528-token steps (vs 8,192) is NOT charged: a
  bias in favour of the rows that need small steps.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .policy import HiStatePolicy, Lookup, Policy
from .trace_model import Request

__all__ = [
    "ENGINE_STEP_TOKENS",
    "SMALL_STEP_ROWS",
    "STEP_OVERHEAD_S",
    "Capture",
    "capacity_of",
    "capture_of",
    "capture_time",
    "histate_capture",
    "planned_extra_steps",
]

ENGINE_STEP_TOKENS = 8192
STEP_OVERHEAD_S = 2.0e-3
SMALL_STEP_ROWS = frozenset({"histate-small-steps"})
"""HiState rows charged one-chunk steps instead of planned step ends (the ablation)."""


@dataclass(frozen=True, slots=True)
class Capture:
    """A request's state capture: the step budget it needs (``step_tokens``; None = the
    engine's default is enough), extra forced step ends (``splits``), the plan's step ends
    as token offsets from the recompute start (``step_ends``, charged by
    :func:`planned_extra_steps`) and mid-prefill states copied device → host
    (``host_states``)."""

    step_tokens: int | None = None
    splits: int = 0
    host_states: int = 0
    step_ends: tuple[int, ...] = ()


def planned_extra_steps(step_ends: tuple[int, ...], tokens: int, step_tokens: int) -> int:
    """Steps a prefill of ``tokens`` takes with a step ending at each of ``step_ends``
    (offsets; those outside ``(0, tokens)`` are ignored), beyond its ``ceil(tokens / B)``."""
    if tokens <= 0:
        return 0
    cuts = [0, *sorted({e for e in step_ends if 0 < e < tokens}), tokens]
    steps = sum(-(-(b - a) // step_tokens) for a, b in itertools.pairwise(cuts))
    return steps - -(-tokens // step_tokens)


def capture_time(
    capture: Capture,
    recomputed_tokens: int,
    snapshot_bytes: int,
    *,
    step_overhead_s: float,
    engine_step_tokens: int,
    copy_bytes_per_s: float,
) -> tuple[float, float]:
    """``(compute, copy)`` seconds: extra prefill steps (GPU time) and host copies."""
    steps = capture.splits + planned_extra_steps(capture.step_ends, recomputed_tokens,
                                                 engine_step_tokens)
    if capture.step_tokens is not None and recomputed_tokens > 0:
        small = -(-recomputed_tokens // capture.step_tokens)
        default = -(-recomputed_tokens // engine_step_tokens)
        steps += max(0, small - default)
    return steps * step_overhead_s, capture.host_states * snapshot_bytes / copy_bytes_per_s


def histate_capture(policy: HiStatePolicy, request: Request, lookup: Lookup) -> Capture:
    """The capture of the HiState core's rows (``HiStatePolicy``), from its own plan.

    The plan is the one ``HiStatePolicy.complete`` follows (same segment, same hashed
    end), evaluated when the request is scheduled: the engine must know where to end
    steps before it prefills (the live connector asks ``histate.plan`` then; the
    pressure factor may move a little before ``complete``). The engine keeps its step
    budget and ends a step at every planned state below the final one (a row whose plan is
    the final state only, ``histate-align``, pays nothing); rows in
    :data:`SMALL_STEP_ROWS` pay a step end at every chunk instead. The recompute starts
    at the hit. Every planned state but the final one goes to the snapshot tier, off the
    GPU.
    """
    cache = policy.cache
    chunk = cache.config.chunk_tokens
    handle = lookup.handle
    plan = cache.snapshot_plan(
        handle.match.kv_chunks * chunk,
        min(request.input_tokens, len(handle.keys) * chunk),
        handle.kind,
        handle.segment_start,
    )
    host_states = max(0, len(plan) - 1)
    if policy.name in SMALL_STEP_ROWS:
        small = cache.config.fixed_interval != 0
        return Capture(step_tokens=chunk if small else None, host_states=host_states)
    hit = lookup.hit_tokens
    return Capture(step_ends=tuple(b - hit for b in plan[:-1] if b > hit),
                   host_states=host_states)


def capture_of(policy: Policy, request: Request, lookup: Lookup) -> Capture:
    """A row's own ``capture(request, lookup)``, or the HiState core's, or nothing."""
    own = getattr(policy, "capture", None)
    if own is not None:
        return own(request, lookup)
    if isinstance(policy, HiStatePolicy):
        return histate_capture(policy, request, lookup)
    return Capture()


def capacity_of(policy: Policy) -> float:
    """Bytes of memory ``policy`` caches in over all its tiers (its ``capacity_bytes()``,
    the HiState core's tier capacities; 0 if it does not say)."""
    own = getattr(policy, "capacity_bytes", None)
    if own is not None:
        return float(own())
    if isinstance(policy, HiStatePolicy):
        return float(sum(t.capacity for t in policy.cache.config.tiers))
    return 0.0
