"""Names the vLLM connector and the HiState server module share on LMCache's wire.

The two ends run in different processes (vLLM's engine, ``lmcache server``) and import
nothing from each other; what one sends and the other reads is named here once.

* ``STATUS_METHOD`` / ``PLAN_METHOD``: the server module's extension RPCs
  (``server_module_call``), answered by ``backends/server/plugins.py`` and called by
  ``backends/vllm/plan_client.py``.
* ``RESUMED_CONFIG``: a request config (LMCache carries ``request_configs`` with every
  lookup, store and retrieve key of a request, outside the cache identity: lmcache 0.5.6
  ``v1/multiprocess/custom_types.py: IPCCacheServerKey.request_configs``, ``compare=False``)
  that the connector sets on a request vLLM re-admits after a preemption, so the server
  counts that request's loads apart, as vLLM's own counters do.
"""

from __future__ import annotations

__all__ = ["PLAN_METHOD", "RESUMED_CONFIG", "STATUS_METHOD"]

STATUS_METHOD = "histate.status"
PLAN_METHOD = "histate.plan"
RESUMED_CONFIG = "lmcache.histate.resumed"
