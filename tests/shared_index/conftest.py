"""Fixtures of the shared-index tests: a real redis-server and a shared disk folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def shared_dir(tmp_path: Path) -> Path:
    root = tmp_path / "shared-disk"
    root.mkdir()
    return root
