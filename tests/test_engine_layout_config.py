"""``chunk_size: auto`` and the engine-dtype keys of the server YAML (no engine needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmcache_histate.config import ConfigError, parse_config

BASE = {"cpu_gib": 1, "disk_path": "/tmp/histate-test-disk", "disk_gib": 1}


def _tiny_config_dir(tmp_path: Path) -> Path:
    from lmcache_histate.core.model_presets import PRESET_CONFIGS

    (tmp_path / "config.json").write_text(
        json.dumps(PRESET_CONFIGS["tiny-qwen3-next"])  # a model directory's config
    )
    return tmp_path


def test_auto_needs_a_model_directory_not_a_preset() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({**BASE, "model": "qwen3.5-9b", "chunk_size": "auto"})
    assert "chunk_size: 'auto'" in str(err.value) and "qwen3.5-9b" in str(err.value)


def test_auto_is_kept_until_the_launcher_resolves_it(tmp_path: Path) -> None:
    cfg = parse_config({**BASE, "model": str(_tiny_config_dir(tmp_path)), "chunk_size": "auto"})
    assert cfg.chunk_size == "auto"
    with pytest.raises(ConfigError, match="chunk_size"):
        _ = cfg.chunk_tokens  # no number yet: using it before resolution is an error
    resolved = cfg.with_overrides(chunk_size=256, mamba_ssm_cache_dtype="bfloat16")
    assert resolved.chunk_tokens == 256


def test_engine_dtypes_set_the_geometry(tmp_path: Path) -> None:
    model = str(_tiny_config_dir(tmp_path))
    # Tiny model: 3 GDN layers x (conv 3 x 1024 x 2 B = 6,144 + SSM 8 x 64 x 64 x {4|2} B).
    fp32 = parse_config({**BASE, "model": model, "chunk_size": 384})
    assert fp32.geometry.snapshot_bytes == 3 * (6_144 + 131_072)  # HF default: float32 SSM
    bf16 = parse_config({**BASE, "model": model, "chunk_size": 256,
                         "mamba_ssm_cache_dtype": "bfloat16"})
    assert bf16.geometry.snapshot_bytes == 3 * (6_144 + 65_536)


@pytest.mark.parametrize("key", ["dtype", "mamba_ssm_cache_dtype"])
def test_engine_dtype_keys_name_the_allowed_values(key: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({**BASE, "model": "qwen3.5-9b", "chunk_size": 528, key: "fp8"})
    assert key in str(err.value) and "bfloat16" in str(err.value)
