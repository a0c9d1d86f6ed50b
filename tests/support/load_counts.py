"""The HiState server's loaded-token counter against what vLLM took: one check for the live tests.

``histate_loaded_tokens_total`` (the server's ``loaded_tokens`` counter, ``server_module.
LoadCounter``) counts the tokens its RETRIEVEs wrote into vLLM's blocks. vLLM's side of the
same number is ``vllm:external_prefix_cache_hits_total``: the scheduler records
``connector_prefix_cache_hits = num_external_computed_tokens`` and passes that same value
to the connector's ``update_state_after_alloc`` (vllm 0.32.0
``v1/core/sched/scheduler.py:1042`` and ``:1289-1300``). An offline ``LLM`` engine exports no
Prometheus counter, so for the engine child (``EngineProcess``) the check reads the
connector's ``external_hit_tokens``, the sum of those values (``connector.py``
``update_state_after_alloc``); an OpenAI server's ``/metrics`` have vLLM's counter itself
(``tests/examples/test_serve_openai.py``, ``tests/live/test_preemption.py``).
"""

from __future__ import annotations

from typing import Any


def reconciled_loads(server: Any, engine: Any) -> int:
    """Assert that ``server`` (``support.lmcache_mp.LMCacheServer`` running HiState) counted
    as loaded exactly the tokens ``engine`` (``EngineProcess``) took from its connector, and
    return that number so the test can compare it with its hand-derived hits. Loads of
    preempted requests are counted apart on both sides; none may have happened here."""
    counters = server.status()["histate"]["counters"]
    loaded = int(counters.get("loaded_tokens", 0))
    resumed = int(counters.get("loaded_tokens_resumed", 0))
    taken = int(engine.stats()["histate"].get("external_hit_tokens", 0))
    assert resumed == 0, f"loads of preempted requests ({resumed} tokens) in a test without any"
    assert loaded == taken, (
        f"the server counted {loaded} loaded tokens, vLLM took {taken} from the connector")
    return loaded
