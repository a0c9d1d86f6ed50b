"""The server's loaded-token counters split as vLLM's external-hit counters do.

vLLM exports a request's external hits only from its first scheduling; the hits of a request
re-admitted after a preemption go to ``preempted_hits``, which is not exported. The connector
marks such a request in its keys' request configs. The counter is fed LMCache's own key
type, with the arguments LMCache's RETRIEVE handler receives (``instance_id, gpu_block_ids,
event_ipc_handle, skip_first_n_tokens``).
"""

from __future__ import annotations

import importlib.util
from collections import Counter

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lmcache") is None, reason="needs the live extra (lmcache)"
)


def key(request: str, start: int, end: int, worker: int | None = 0, resumed: bool = False):
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

    configs = {"lmcache.histate.resumed": True} if resumed else None
    return IPCCacheServerKey(model_name="tiny", world_size=1, worker_id=worker,
                             token_ids=tuple(range(end)), start=start, end=end,
                             request_id=request, request_configs=configs)


def test_a_resumed_request_is_counted_apart_from_first_loads() -> None:
    from lmcache_histate.backends.server.plugins import LoadCounter

    stats: Counter = Counter()
    count = LoadCounter(stats)
    count(key("a", 0, 3072), 1, [[0]], b"", 768)     # 3072 - 768 vLLM already had = 2304
    count(key("b", 0, 1536), 1, [[0]], b"")          # no skip: 1536
    count(key("a", 0, 3840, resumed=True), 1, [[0]], b"", skip_first_n_tokens=384)  # 3456
    count(key("c", 0, 768, resumed=True), 1, [[0]], b"")  # first load, but after preemption
    count(key("b", 0, 1536, worker=1), 1, [[0]], b"")  # rank 1 of a TP pair: not counted
    assert stats == Counter({"loaded_tokens": 2304 + 1536, "loaded_tokens_resumed": 3456 + 768})


def test_a_malformed_key_is_an_error_count_not_an_exception() -> None:
    from lmcache_histate.backends.server.plugins import LoadCounter

    stats: Counter = Counter()
    LoadCounter(stats)(object(), 1, [[0]], b"")
    assert stats == Counter({"errors.retrieve": 1})
