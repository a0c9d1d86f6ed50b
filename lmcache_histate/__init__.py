"""HiState for LMCache: prefix caching for hybrid LLMs under agentic workloads."""

__version__ = "0.1.0"
