"""A real Redis Cluster of three masters on loopback for tests, started, killed and restarted.

Each node is a ``support.redis_server.RedisServer`` (Debian's ``redis-server`` 7, no data
on disk) started with ``--cluster-enabled yes`` and ``maxmemory-policy noeviction`` (the
store never evicts: HiState does, ``docs/multi-node.md``); ``redis-cli --cluster create``
joins them with no replicas and the fixture waits until every node reports
``cluster_state:ok`` (about 3 s on the loaded 2-core machine). A node keeps its
``nodes.conf`` in its own folder, so a node killed and started again on the same port
rejoins the cluster with its slots, and empty: the worst case the shared tier must survive.

``cluster-node-timeout`` is 1 s (the default 15 s would make a test wait 15 s for the
cluster to notice a dead master); ``cluster-require-full-coverage`` is Redis's default
(``yes``): one master down turns the whole cluster to ``cluster_state:fail``.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from lmcache_histate.backends.demo.servers import free_ports

from support.redis_server import RedisServer

__all__ = ["RedisClusterNodes", "redis_cluster"]

NODE_TIMEOUT_MS = 1000
BUS_OFFSET = 10000
"""A node's cluster bus listens on its port + 10000: both must be free, the bus at most
65535."""


class RedisClusterNodes:
    """Three ``redis-server`` cluster nodes; ``nodes`` are their ``host:port`` names."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        if shutil.which("redis-cli") is None:
            pytest.fail("redis-cli is not installed: run `bash scripts/setup.sh` "
                        "(apt-get install redis-server, which ships it)")
        self.servers = [
            RedisServer(workdir / f"node-{i}", "--cluster-enabled", "yes",
                        "--cluster-config-file", "nodes.conf",
                        "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                        "--maxmemory-policy", "noeviction", port=port)
            for i, port in enumerate(bus_ports(masters))
        ]

    @property
    def nodes(self) -> list[str]:
        return [f"127.0.0.1:{s.port}" for s in self.servers]

    def start(self, timeout: float = 30.0) -> None:
        """Start every node; create the cluster the first time; wait for ``ok``."""
        fresh = not (self.servers[0].workdir / "nodes.conf").exists()
        for server in self.servers:
            if server.proc is None:
                server.start()
        if fresh:
            out = subprocess.run(
                ["redis-cli", "--cluster", "create", *self.nodes, "--cluster-replicas", "0",
                 "--cluster-yes"], capture_output=True, text=True, timeout=timeout,
            )
            if out.returncode != 0:
                pytest.fail(f"redis-cli --cluster create failed: {out.stdout[-400:]}"
                            f"{out.stderr[-400:]}")
        self.wait_state("ok", timeout)

    def state(self, index: int = 0) -> str:
        """``cluster_state`` as node ``index`` reports it ("" when it does not answer)."""
        out = subprocess.run(["redis-cli", "-p", str(self.servers[index].port), "cluster",
                              "info"], capture_output=True, text=True, timeout=5)
        for line in out.stdout.splitlines():
            if line.startswith("cluster_state:"):
                return line.split(":", 1)[1].strip()
        return ""

    def wait_state(self, state: str, timeout: float = 30.0) -> None:
        """Wait until every running node reports ``cluster_state:<state>``."""
        deadline = time.monotonic() + timeout
        running = [i for i, s in enumerate(self.servers) if s.proc is not None]
        while time.monotonic() < deadline:
            if all(self.state(i) == state for i in running):
                return
            time.sleep(0.1)
        pytest.fail(f"the cluster did not reach cluster_state:{state} within {timeout}s "
                    f"(states: {[self.state(i) for i in running]})")

    def kill(self, index: int) -> None:
        """SIGKILL one master: its slots' data is gone."""
        self.servers[index].kill()

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def bus_ports(count: int) -> list[int]:
    """``count`` free ports whose cluster bus ports (port + 10000) are free as well."""
    out: list[int] = []
    while len(out) < count:
        for port in free_ports(8):
            if port + BUS_OFFSET <= 65535 and port not in out and _free(port + BUS_OFFSET):
                out.append(port)
                break
    return out[:count]


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisClusterNodes]:
    """A 3-master Redis Cluster on loopback for one test (import it into a conftest or a
    test module to use it)."""
    cluster = RedisClusterNodes(tmp_path / "cluster")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
