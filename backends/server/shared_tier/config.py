"""``adapter_params`` of the shared tier, validated when LMCache builds the adapter.

As the disk tier's (``disk/config.py``): the params are the server YAML's ``shared_tier``
section under ``shared_tier`` plus ``index_model`` (the namespace's model name, which the
launcher derives from ``model``), validated with the server schema's own checks
(``config.parse_shared_tier``), and ``io_workers``.
"""

from __future__ import annotations

from typing import Any

from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

from lmcache_histate.config import SHARED_TIER, ConfigError, SharedTierConfig, parse_shared_tier

__all__ = ["HiStateSharedAdapterConfig"]

IO_WORKERS = 4


class HiStateSharedAdapterConfig(L2AdapterConfigBase):
    """The shared tier's validated ``adapter_params``: ``tier`` (the section), ``model``
    (the index namespace's model name), ``io_workers`` (threads moving values)."""

    def __init__(self, tier: SharedTierConfig, model: str, io_workers: int = IO_WORKERS) -> None:
        self.tier = tier
        self.model = model
        self.io_workers = io_workers

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HiStateSharedAdapterConfig:
        errors: list[str] = []
        unknown = sorted(set(d) - {SHARED_TIER, "index_model"})
        errors += [f"{k}: unknown key; allowed keys: {SHARED_TIER}, index_model" for k in unknown]
        tier = parse_shared_tier(d.get(SHARED_TIER), None, None, errors)
        model = d.get("index_model", "model")
        if not isinstance(model, str) or not model:
            errors.append(f"index_model: must be a non-empty string, got {model!r}")
        if errors or tier is None:
            raise ConfigError("invalid HiState shared tier: " + "; ".join(errors))
        return cls(tier, model)

    @classmethod
    def help(cls) -> str:
        return ("HiState shared tier fields:\n"
                "- shared_tier (mapping): the server YAML's shared_tier section (required)\n"
                "- index_model (str): the namespace's model name")
