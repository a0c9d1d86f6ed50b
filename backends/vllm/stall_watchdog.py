"""A watchdog for requests whose connector state makes no progress.

A request the scheduler polls (``get_num_new_matched_tokens``) again and again without ever
being admitted (``update_state_after_alloc``) or finished is stalled: either vLLM has no
blocks for it (a pool held by someone), or it waits for a load that never lands. Such a
loop is silent in vLLM (the scheduler just polls again next step); the watchdog makes it one
log line with the request's state, and a recompute where a load is awaited.

Invariants:
* ``polls[r]`` counts the polls of request ``r`` since its last progress; a scheduled
  step, an admission or the request's end resets it (``progressed``);
* a request is reported at most once per stall (``reported``), whatever the poll count;
* the watchdog never changes a request that progresses: it only answers ``stalled`` True
  for a request past ``limit`` polls whose LMCache tracker waits for a load.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["StallWatchdog"]

logger = logging.getLogger(__name__)

WAITING_FOR_LOAD = "WAITING_FOR_LOAD"


class StallWatchdog:
    """Counts polls without progress per request; logs once and asks for a bypass."""

    def __init__(self, limit: int) -> None:
        """``limit``: polls without progress before a request is reported, at least 1
        (``histate.stall_polls``, checked by ``connector_config.ConnectorConfig``)."""
        self.limit = limit
        self.polls: dict[str, int] = {}
        self.reported: set[str] = set()

    def progressed(self, request_id: str) -> None:
        self.polls.pop(request_id, None)
        self.reported.discard(request_id)

    def scheduled(self, scheduler_output: Any) -> None:
        """Requests scheduled in a step made progress."""
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            self.progressed(new.req_id)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        for request_id in getattr(cached, "req_ids", None) or ():
            self.progressed(request_id)

    def stalled(self, request: Any, tracker: Any) -> bool:
        """Count one poll; True when the request should fall back to recompute."""
        request_id = request.request_id
        polls = self.polls[request_id] = self.polls.get(request_id, 0) + 1
        if polls < self.limit:
            return False
        state = getattr(getattr(tracker, "state", None), "name", str(getattr(tracker, "state", "")))
        if request_id not in self.reported:
            self.reported.add(request_id)
            logger.warning(
                "HiState watchdog: request %s polled %d times without progress (status %s, "
                "computed %d of %d tokens, connector state %s, LMCache hit %d, vLLM hit %d)%s",
                request_id, polls, getattr(request, "status", "?"),
                getattr(request, "num_computed_tokens", -1),
                getattr(request, "num_prompt_tokens", -1), state,
                getattr(tracker, "num_lmcache_hit_tokens", -1),
                getattr(tracker, "num_vllm_hit_tokens", -1),
                "; falling back to recompute" if state == WAITING_FOR_LOAD else "",
            )
        return state == WAITING_FOR_LOAD


class RepeatFilter(logging.Filter):
    """Lets a per-request progress line through ``limit`` times per request.

    LMCache's scheduler logs ``<resume-load> req=... `` at INFO on every poll of a preempted
    request (``LMCacheMPConnector.get_num_new_matched_tokens``, lmcache 0.5.6): a request
    waiting for blocks writes it once per scheduler step. The first lines say what happened;
    the rest is what the watchdog reports once.
    """

    def __init__(self, prefix: str, limit: int = 3) -> None:
        super().__init__()
        self.prefix = prefix
        self.limit = limit
        self.seen: dict[Any, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str) or not record.msg.startswith(self.prefix):
            return True
        key = record.args[0] if isinstance(record.args, tuple) and record.args else None
        count = self.seen[key] = self.seen.get(key, 0) + 1
        if len(self.seen) > 4096:  # bounded: forget the oldest requests
            self.seen.pop(next(iter(self.seen)))
        return count <= self.limit
