"""The Redis connection of the shared index: bounded waits, degraded mode, counters.

Invariants:

* no call waits longer than ``op_timeout_s`` (``connect_timeout_s`` to connect); a call
  that fails with a connection or timeout error puts the connection in **degraded** mode
  and returns the caller's fallback: the caller serves from its local view;
* while degraded, calls are not attempted at all (they return the fallback at once and
  are counted as ``skipped``): the hot path never pays a timeout per request. Only
  ``poll`` (a background thread's job, e.g. the runtime's janitor) probes Redis, at most
  every ``retry_s``; when a probe succeeds the connection leaves degraded mode and the
  recovery listeners run (``registration`` re-registers the server's objects);
* each outage is logged once when it starts and once when it ends (with the number of
  calls it skipped), never per call;
* credentials never reach a log line or an exception message this module raises: the
  password is read from ``password_file`` and handed to redis-py only; logs name the
  URL with any password masked (``redacted_url``).

Counters (``counters()``, read by the metrics module): ``calls``, ``failures`` (calls
that raised a connection/timeout error), ``skipped`` (calls not attempted while
degraded), ``outages`` (entries into degraded mode), ``recoveries``, ``probes``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from lmcache_histate.exposure import read_secret
from lmcache_histate.shared_index_config import SharedIndexConfig, redacted_url

__all__ = ["IndexConnection", "Unavailable"]

logger = logging.getLogger("lmcache_histate.shared_index")

T = TypeVar("T")
_FAULTS = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError, OSError)


class Unavailable(RuntimeError):
    """Raised by ``require`` when Redis cannot be reached (start-up checks)."""


def make_client(cfg: SharedIndexConfig) -> redis.Redis:
    """A redis-py client for ``cfg`` (nothing is connected until the first command)."""
    kwargs: dict[str, Any] = {
        "socket_timeout": cfg.op_timeout_s,
        "socket_connect_timeout": cfg.connect_timeout_s,
        "health_check_interval": 0,
        "decode_responses": True,
        # NOTE 1: redis-py retries a failed command (3 times with backoff by default):
        # that multiplies the bounded wait. One attempt; degraded mode does the retrying.
        "retry": Retry(NoBackoff(), 0),
    }
    if cfg.password_file is not None:
        kwargs["password"] = read_secret(cfg.password_file)
    if cfg.tls_ca_file is not None:
        kwargs["ssl_ca_certs"] = cfg.tls_ca_file
    return redis.Redis.from_url(cfg.url, **kwargs)


class IndexConnection:
    """One client with degraded mode (module docstring)."""

    def __init__(
        self,
        cfg: SharedIndexConfig,
        *,
        client: redis.Redis | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.client = client if client is not None else make_client(cfg)
        self._clock = clock
        self._lock = threading.Lock()
        self._degraded_since: float | None = None
        self._last_probe = 0.0
        self._skipped_in_outage = 0
        self._stats: Counter[str] = Counter()
        self._recovery: list[Callable[[], None]] = []
        self.where = redacted_url(cfg.url)

    # --------------------------------------------------------------- state
    @property
    def degraded(self) -> bool:
        return self._degraded_since is not None

    def degraded_for(self) -> float:
        """Seconds since the current outage began (0 when connected)."""
        since = self._degraded_since
        return 0.0 if since is None else self._clock() - since

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)

    def on_recovery(self, listener: Callable[[], None]) -> None:
        """``listener()`` runs (in ``poll``'s thread) each time an outage ends."""
        self._recovery.append(listener)

    # --------------------------------------------------------------- calls
    def call(self, fn: Callable[[redis.Redis], T], fallback: T) -> T:
        """``fn(client)``, or ``fallback`` when Redis is (or just became) unreachable.

        Errors other than connection/timeout faults (a script error, a bad argument) are
        bugs and propagate.
        """
        with self._lock:
            if self._degraded_since is not None:
                self._stats["skipped"] += 1
                self._skipped_in_outage += 1
                return fallback
            self._stats["calls"] += 1
        try:
            return fn(self.client)
        except _FAULTS as exc:
            self._enter_degraded(exc)
            return fallback

    def require(self, fn: Callable[[redis.Redis], T]) -> T:
        """``fn(client)`` or ``Unavailable`` naming the URL (never a credential)."""
        try:
            return fn(self.client)
        except redis.AuthenticationError:
            raise Unavailable(
                f"shared_index: Redis at {self.where} refused the credentials "
                f"(check the URL's user and shared_index.password_file)"
            ) from None
        except _FAULTS as exc:
            raise Unavailable(
                f"shared_index: Redis at {self.where} is unreachable: {type(exc).__name__}"
            ) from None

    def poll(self) -> bool:
        """Probe Redis if degraded and due; True when connected after the call."""
        with self._lock:
            if self._degraded_since is None:
                return True
            now = self._clock()
            if now - self._last_probe < self.cfg.retry_s:
                return False
            self._last_probe = now
            self._stats["probes"] += 1
        try:
            self.client.ping()
        except _FAULTS:
            return False
        with self._lock:
            outage = self._clock() - (self._degraded_since or 0.0)
            skipped, self._skipped_in_outage = self._skipped_in_outage, 0
            self._degraded_since = None
            self._stats["recoveries"] += 1
        logger.warning(
            "shared index: Redis at %s reachable again after %.1fs (%d calls served from the "
            "local view); re-registering this server's objects", self.where, outage, skipped,
        )
        for listener in self._recovery:
            listener()
        return True

    def _enter_degraded(self, exc: BaseException) -> None:
        with self._lock:
            self._stats["failures"] += 1
            if self._degraded_since is not None:
                return
            self._degraded_since = self._last_probe = self._clock()
            self._stats["outages"] += 1
        logger.warning(
            "shared index: Redis at %s unreachable (%s); serving from the local view "
            "until it returns (probed every %.1fs)", self.where, type(exc).__name__,
            self.cfg.retry_s,
        )

    def close(self) -> None:
        self.client.close()
