"""The ``shared_tier`` section of the server YAML: validated at load, every message naming
``shared_tier.<key>`` (``lmcache_histate/config.py`` NOTE 8); the example config loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_histate.config import ConfigError, load_config, parse_config

REPO = Path(__file__).resolve().parents[1]


def test_config_errors_name_the_key() -> None:
    base = {"model": "qwen3.5-9b", "chunk_size": 256, "cpu_gib": 1, "disk_path": "/tmp/x",
            "disk_gib": 1}
    cases = {
        "shared_tier.nodes": {"deployment": "d", "budget_gib": 1, "nodes": ["nohost"]},
        "shared_tier.budget_gib": {"deployment": "d", "budget_gib": -1, "nodes": ["h:1"]},
        "shared_tier.deployment": {"deployment": "a b", "budget_gib": 1, "nodes": ["h:1"]},
        "shared_tier.tls_ca_file": {"deployment": "d", "budget_gib": 1, "nodes": ["h:1"],
                                    "tls_ca_file": "/nonexistent"},
        "shared_tier.bogus": {"deployment": "d", "budget_gib": 1, "nodes": ["h:1"], "bogus": 1},
    }
    for name, section in cases.items():
        with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
            parse_config({**base, "shared_tier": section})
    cfg = parse_config({**base, "shared_tier": {"deployment": "d", "budget_gib": 2,
                                                "nodes": ["10.0.0.5:6379"]}})
    assert cfg.shared_tier is not None and cfg.shared_tier.budget_bytes == 2 << 30


def test_the_example_node_config_loads() -> None:
    cfg = load_config(REPO / "configs" / "shared-tier-node-a.yaml")
    tier = cfg.shared_tier
    assert tier is not None
    assert tier.nodes == ("127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002")
    assert (tier.deployment, tier.instance, tier.budget_bytes) == ("example", "node-a", 64 << 30)
    assert tier.index_config().url == "redis://127.0.0.1:7000/0"
