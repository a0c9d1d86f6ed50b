"""Redis Cluster clients of the shared tier, with every wait bounded.

Two clients over the same startup nodes: one decoding replies (the index's scripts and
pipelines, ``shared_index.connection.IndexConnection`` drives it) and one returning bytes
(object values). Neither retries a failed command (``Retry(NoBackoff(), 0)``): the
connection's degraded mode does the retrying, off the request path (NOTE 1).

NOTE 1 (no retries, short connects). redis-py's cluster client retries a command that hit
a connection error after refreshing the slot map, by default 3 times with backoff, each
try waiting up to the connect timeout on every node it asks; a lookup's one call could so
wait seconds (LMCache's valkey adapter, with glide's own retries, took 7.7 s per lookup
once the cluster reported ``cluster_state:fail``). One attempt, a 0.5 s connect timeout
and the degraded mode bound the cost of an outage to one call; after it, calls are not
attempted until a probe passes.
"""

from __future__ import annotations

from typing import Any

from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from lmcache_histate.config import SharedTierConfig
from lmcache_histate.exposure import read_secret

__all__ = ["cluster_client"]


def cluster_client(cfg: SharedTierConfig, *, decode: bool) -> RedisCluster:
    """A cluster client for ``cfg`` (connects to a startup node to read the slot map:
    raises a ``redis.RedisError`` when none answers)."""
    kwargs: dict[str, Any] = {
        "socket_timeout": cfg.op_timeout_s,
        "socket_connect_timeout": cfg.connect_timeout_s,
        "decode_responses": decode,
        "retry": Retry(NoBackoff(), 0),  # NOTE 1
        "require_full_coverage": False,
    }
    if cfg.username:
        kwargs["username"] = cfg.username
    if cfg.password_file is not None:
        kwargs["password"] = read_secret(cfg.password_file)
    if cfg.tls:
        kwargs["ssl"] = True
        if cfg.tls_ca_file is not None:
            kwargs["ssl_ca_certs"] = cfg.tls_ca_file
    nodes = [ClusterNode(*_host_port(n)) for n in cfg.nodes]
    return RedisCluster(startup_nodes=nodes, **kwargs)


def _host_port(node: str) -> tuple[str, int]:
    host, _, port = node.rpartition(":")
    return host.strip("[]"), int(port)
