"""``histate-server`` processes for the demo: started from a config, awaited, settled, stopped.

Each server runs in its own process group with its output in a log file; ``stop`` ends the
whole group, so nothing outlives a run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

__all__ = ["ServerProcess", "free_port", "free_ports"]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct free ports on ``host`` (loopback by default). Every socket stays
    bound until all are chosen: a port closed at once can be handed out again by the next
    bind (a server config then got the same number for ``port`` and ``http_port``)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def free_port() -> int:
    return free_ports(1)[0]


class ServerProcess:
    """``histate-server --config FILE`` in its own process group, output to a log file."""

    def __init__(self, config: Path, workdir: Path, name: str) -> None:
        cfg = yaml.safe_load(config.read_text())
        self.http = f"http://127.0.0.1:{cfg['http_port']}"
        self.log_path = workdir / f"{name}-server.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lmcache_histate.backends.server.launcher", "--config",
                 str(config)],
                cwd=workdir, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"},
                start_new_session=True,
            )

    def get(self, path: str, timeout: float = 10.0) -> Any:
        with urllib.request.urlopen(self.http + path, timeout=timeout) as response:
            return json.loads(response.read())

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"histate-server exited with {self.proc.returncode}\n"
                                   f"{self.log_tail()}")
            with contextlib.suppress(OSError, ValueError):
                if self.get("/healthcheck", 2.0).get("status") == "healthy":
                    return
            time.sleep(0.2)
        raise RuntimeError(f"histate-server not ready after {timeout}s\n{self.log_tail()}")

    def settle(self, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until no store or disk write is pending; the full ``/status``."""
        deadline = time.monotonic() + timeout
        quiet = 0
        status: dict[str, Any] = {}
        while time.monotonic() < deadline and quiet < 2:
            status = self.get("/status")
            controllers = status.get("storage_manager", {}).get("store_controllers", {})
            busy = any(c.get("pending_keys_count") or c.get("in_flight_task_count")
                       for c in controllers.values())
            hs = status.get("histate") or {}
            busy = busy or bool((hs.get("disk") or {}).get("writes_in_flight"))
            quiet = 0 if busy else quiet + 1
            time.sleep(0.1)
        return status

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


