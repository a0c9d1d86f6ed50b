"""Every route to a non-loopback bind or to ``/run_script`` is refused by the real launcher,
and a loopback configuration listens on loopback only (read from the kernel's socket table).

The refused starts run ``histate-server`` exactly as an operator would (no ``--dry-run``),
on free ports: exit status 2, one line on stderr, no traceback, and the ports stay free.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from lmcache_histate.backends.demo.servers import free_ports
from test_backend_server import LAUNCHER, histate

pytestmark = pytest.mark.timeout(240)


def launch(tmp_path: Path, extra: list[str], argv: list[str]) -> tuple[int, str, int, int]:
    """(exit status, stderr, zmq port, http port) of one start."""
    port, http_port = free_ports(2)
    cfg = {"model": "tiny-qwen3-next", "chunk_size": 16, "cpu_gib": 0.05,
           "disk_path": str(tmp_path / "disk"), "disk_gib": 0.01, "platform": "cpu",
           "port": port, "http_port": http_port, "extra_server_args": extra}
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = subprocess.run([sys.executable, "-m", LAUNCHER, "--config", str(path), *argv],
                            capture_output=True, text=True, timeout=120, check=False)
    return result.returncode, result.stderr, port, http_port


def can_bind(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize(
    ("extra", "argv", "line"),
    [
        (["--http-host", "0.0.0.0"], [],
         "histate-server: extra_server_args: --http-host is set by the YAML key http_host"),
        (["--host", "0.0.0.0"], [],
         "histate-server: extra_server_args: --host is set by the YAML key host"),
        (["--run-script-api-enabled"], [],
         "histate-server: extra_server_args: --run-script-api-enabled opens /run_script"),
        (["--server-module", '{"module_path": "os", "factory_name": "system"}'], [],
         "histate-server: extra_server_args: --server-module imports a Python module"),
        ([], ["--ho", "0.0.0.0", "--http-ho", "0.0.0.0"],
         "histate-server: command line: '--ho' abbreviates --host"),
        ([], ["--http-host", "0.0.0.0"],
         "histate-server: invalid HiState configuration: http_host: '0.0.0.0' is not a "
         "loopback address"),
        ([], ["--run-script-api-enabled"],
         "histate-server: command line: --run-script-api-enabled opens /run_script"),
    ],
    ids=["extra-http-host", "extra-host", "extra-run-script", "extra-server-module",
         "cli-abbreviated-hosts", "cli-http-host", "cli-run-script"],
)
def test_bypass_routes_are_refused_before_binding(
    tmp_path: Path, extra: list[str], argv: list[str], line: str
) -> None:
    status, stderr, port, http_port = launch(tmp_path, extra, argv)
    lines = [x for x in stderr.splitlines() if x.strip()]
    assert status == 2, stderr
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith(line), lines[0]
    assert can_bind(port) and can_bind(http_port)


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state owned by ``pid``."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A = TCP_LISTEN
                continue
            hex_addr, hex_port = cols[1].split(":")
            raw = bytes.fromhex(hex_addr)
            if width == 8:
                addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
            else:  # four little-endian 32-bit words
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                addr = socket.inet_ntop(socket.AF_INET6, words)
            out.add((addr, int(hex_port, 16)))
    return out


def test_loopback_config_listens_on_loopback_only(tmp_path: Path) -> None:
    with histate(tmp_path / "srv", tmp_path / "disk") as server:
        bound = listening(server.pid)
        ends = server.endpoints
        assert ("127.0.0.1", ends.zmq_port) in bound and ("127.0.0.1", ends.http_port) in bound
        assert {addr for addr, _ in bound} <= {"127.0.0.1", "::1"}, bound
        # /run_script stays off: the script is never run.
        boundary = "histate-boundary"
        body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"script\"; "
                f"filename=\"s.py\"\r\n\r\nresult = 6*7\r\n--{boundary}--\r\n").encode()
        request = urllib.request.Request(
            ends.http_url + "/run_script", data=body, method="POST",
            headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                status, text = response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read().decode()
        assert status != 200 and "42" not in text, (status, text)
