"""Everything that touches LMCache or vLLM. Installed as ``lmcache_histate.backends``.

Rooms, by who calls them: ``server/`` (the ``lmcache server`` side: launcher, plugins,
runtime in ``server/runtime/``, disk tier in ``server/disk/``), ``vllm/`` (the engine side:
connector, interval saves), ``upstream/`` (every patch of LMCache / vLLM code) and
``demo/`` (the demo and the tiny test model).
"""
