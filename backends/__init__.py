"""Everything that touches LMCache or vLLM. Installed as ``lmcache_histate.backends``."""
