"""Start-up faults of ``histate-server``: one line naming the key, before anything starts.

Each case runs the real launcher (``python -m lmcache_histate.backends.server.launcher``) on a bad
setting and expects exit status 2, a single ``histate-server: <key>: ...`` line on stderr,
no traceback, within a few seconds (the same faults used to surface as tracebacks, a ZMQ
bind error only after 12-16 s of LMCache start-up).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from lmcache_histate.backends.demo.servers import free_port
from support.filesystems import tmpfs

LAUNCHER = "lmcache_histate.backends.server.launcher"
pytestmark = pytest.mark.timeout(120)


def start(tmp_path: Path, **values: Any) -> tuple[int, str, float]:
    """Run the launcher on a config with ``values``: (exit status, stderr, seconds)."""
    cfg = {
        "model": "tiny-qwen3-next", "chunk_size": 16, "cpu_gib": 0.05,
        "disk_path": str(tmp_path / "disk"), "disk_gib": 0.01,
        "port": 1, "http_port": 2,  # privileged: must never be reached in these tests
        **values,
    }
    config = tmp_path / "histate.yaml"
    config.write_text(yaml.safe_dump(cfg))
    t0 = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", LAUNCHER, "--config", str(config)],
        capture_output=True, text=True, timeout=90, check=False,
    )
    return result.returncode, result.stderr, time.monotonic() - t0


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda t: {"disk_path": str(t / "file" / "disk")},
         "disk_path: '{t}/file/disk' is under a file ('{t}/file' is not a folder)"),
        (lambda t: {"disk_path": "/proc/histate-disk"},
         "disk_path: '/proc/histate-disk' is on the kernel's virtual filesystem /proc"),
        (lambda t: {"disk_path": str(t / "foreign")},
         "disk_path: '{t}/foreign' is not empty (1 entries: notes.txt) and has no "
         ".histate-disk marker"),
        (lambda t: {"disk_gib": 10**6},
         "disk_gib: 1e+06 GiB is more than the filesystem of disk_path can hold"),
        (lambda t: {"cpu_gib": 1e-12},
         "cpu_gib: 1e-12 GiB rounds to 0 bytes; must be at least 1 byte"),
        (lambda t: {"host": "0.0.0.0"}, "host: '0.0.0.0' is not a loopback address"),
    ],
    ids=["under-a-file", "in-proc", "foreign-folder", "disk-larger-than-fs", "size-0-bytes",
         "remote-without-opt-in"],
)
def test_bad_setting_is_one_line_naming_the_key(
    tmp_path: Path, make: Any, expected: str
) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("keep me")
    rc, stderr, seconds = start(tmp_path, **make(tmp_path))
    assert rc == 2, stderr
    assert expected.format(t=tmp_path) in one_line(stderr)
    assert seconds < 10
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "keep me"
    assert not (tmp_path / "disk").exists()  # nothing was created


def test_port_in_use_and_bad_hosts_fail_before_lmcache_starts(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("a-shared-secret-0123456789")
    token.chmod(0o600)
    remote = {"allow_remote": True, "auth_token_file": str(token)}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc, stderr, seconds = start(tmp_path, port=port, http_port=free_port())
        assert rc == 2
        assert f"port: {port} on 127.0.0.1 is in use" in one_line(stderr)
        assert seconds < 10
        rc, stderr, _ = start(tmp_path, port=free_port(), http_port=port)
        assert f"http_port: {port} on 127.0.0.1 is in use" in one_line(stderr)
    rc, stderr, _ = start(tmp_path, host="192.0.2.1", port=free_port(), **remote)
    assert rc == 2
    assert "host: '192.0.2.1' is not an address of this machine" in one_line(stderr)
    rc, stderr, _ = start(tmp_path, http_host="no-such-host.invalid", http_port=free_port(),
                          **remote)
    assert "http_host: 'no-such-host.invalid' is not a valid address" in one_line(stderr)


def test_read_only_filesystem_is_one_line(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "ro", "64k", read_only=True) as mount:
        rc, stderr, _ = start(tmp_path, disk_path=str(mount / "disk"))
    assert rc == 2
    assert f"disk_path: '{mount}' is on a read-only filesystem" in one_line(stderr)


def test_a_disk_folder_in_use_is_one_line(tmp_path: Path) -> None:
    from lmcache_histate.backends.server.disk.tier import HiStateDiskAdapter

    disk = tmp_path / "disk"
    tier = HiStateDiskAdapter({"disk_path": str(disk), "disk_gib": 1 / 1024})
    try:
        rc, stderr, _ = start(tmp_path)
    finally:
        tier.close()
    assert rc == 2
    assert f"disk_path: '{disk}' is in use by another HiState disk tier" in one_line(stderr)
