"""The fast tier's guard: a test outside the live folders cannot start a real part."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.live_marker import real_part


def test_real_parts_are_named_by_program_or_module() -> None:
    assert real_part(["/usr/bin/redis-server", "--port", "0"]) == "redis-server"
    assert real_part("mount -t tmpfs none /mnt") == "mount"
    assert real_part([sys.executable, "-m", "vllm.entrypoints.openai.api_server"]) == (
        "python -m vllm.entrypoints.openai.api_server"
    )
    assert real_part([sys.executable, "-m", "lmcache_histate.backends.server.launcher"]) == (
        "python -m lmcache_histate.backends.server.launcher"
    )
    # Short tools and code that merely names an engine are not real parts.
    assert real_part(["git", "log"]) is None
    assert real_part([sys.executable, "-c", "import sys; 'vllm' in sys.modules"]) is None
    assert real_part([sys.executable, "-m", "lmcache_histate.cli", "simulate"]) is None


def test_a_test_outside_the_live_folders_cannot_start_a_server() -> None:
    # The guard refuses before the process exists: no redis-server is left behind.
    with pytest.raises(RuntimeError, match=r"starts a real part \(redis-server\).*not marked live"):
        subprocess.Popen(["redis-server", "--port", "0"])


@pytest.mark.live
def test_a_marked_test_may_start_one() -> None:
    proc = subprocess.Popen(["redis-server", "--version"], stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=30)
    assert b"Redis server" in out


def test_not_live_deselects_every_test_of_a_live_folder() -> None:
    # tests/shared_index/test_shared_index_config.py holds 18 tests (collect it to see).
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", "not live", "tests/shared_index/test_shared_index_config.py"],
        capture_output=True, text=True, timeout=120,
    )
    assert "no tests collected (18 deselected)" in out.stdout, out.stdout[-400:]
