"""Fixtures of the shared-index tests: a real redis-server and a shared disk folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.redis_server import redis_server  # noqa: F401 (the fixture)


@pytest.fixture
def shared_dir(tmp_path: Path) -> Path:
    root = tmp_path / "shared-disk"
    root.mkdir()
    return root
