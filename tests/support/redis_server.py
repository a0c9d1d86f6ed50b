"""A real ``redis-server`` for tests, on a free loopback port, started and killed at will.

Nothing is skipped: without the binary the fixture fails, saying how to install it
(``scripts/setup.sh`` does). Each server keeps no data on disk (``--save ''``, no AOF), so
a kill and a restart on the same port is a Redis that lost everything, the worst case
the shared index must survive.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from lmcache_histate.backends.demo.servers import free_ports

__all__ = ["RedisServer", "self_signed"]


def self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made with openssl (installed with Debian)."""
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key


class RedisServer:
    """One ``redis-server`` process; ``start`` / ``kill`` / ``start`` again keeps the port."""

    def __init__(
        self, workdir: Path, *extra: str, config: str = "", tls: tuple[Path, Path] | None = None,
        port: int | None = None,
    ) -> None:
        """``extra``: command-line options; ``config``: redis.conf lines (e.g. ``user``
        directives, whose spaces the command line would not keep); ``tls``: (certificate,
        key) files: a TLS port is opened too (``tls_url``), the plain one stays for the
        readiness probe; ``port``: the port to use (default: a free one)."""
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail(
                "redis-server is not installed: the shared-index tests run a real one. "
                "Install it with `bash scripts/setup.sh` (apt-get install redis-server)."
            )
        self.binary = binary
        self.workdir = workdir
        self.extra = extra
        self.config = config
        self.port, *tls_ports = free_ports(2 if tls else 1)
        if port is not None:
            self.port = port
        self.tls_port = tls_ports[0] if tls_ports else None
        if tls is not None:
            cert, key = tls
            self.extra = (*extra, "--tls-port", str(self.tls_port), "--tls-cert-file", str(cert),
                          "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
                          "--tls-auth-clients", "no")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def tls_url(self) -> str:
        return f"rediss://127.0.0.1:{self.tls_port}/0"

    def start(self, timeout: float = 10.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "redis.conf"
        conf.write_text(self.config)
        self.proc = subprocess.Popen(
            [self.binary, str(conf), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"redis-server exited at start (status {self.proc.returncode})")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    reply = s.recv(64)
                    if reply.startswith((b"+PONG", b"-NOAUTH")):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        pytest.fail(f"redis-server did not answer on port {self.port} within {timeout}s")

    def kill(self) -> None:
        """SIGKILL: no shutdown, no save (the server's data is gone)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real ``redis-server`` on a free port for one test (import it into a conftest or
    a test module to use it)."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()
