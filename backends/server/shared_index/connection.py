"""The Redis connection of the shared index: bounded waits, degraded mode, counters.

Invariants:

* no call waits longer than ``op_timeout_s`` (``connect_timeout_s`` to connect); a call
  that fails with any Redis fault puts the connection in **degraded** mode and returns
  the caller's fallback: the caller serves from its local view. Faults are classified
  (``classify``): ``unreachable`` (connection, timeout), ``credentials refused``
  (authentication), ``permission denied`` (an ACL right revoked, also when Redis reports
  it from inside a script) and ``script error`` (any other error reply);
* while degraded, calls are not attempted at all (they return the fallback at once and
  are counted as ``skipped``): the hot path never pays a timeout per request. Only
  ``poll`` (a background thread's job, e.g. the runtime's janitor) probes Redis, first
  ``retry_s`` after the fault, then every ``retry_s`` while it is unreachable, or with the
  wait doubled after each refused probe up to ``MAX_BACKOFF`` × ``retry_s`` (NOTE 2);
  when a probe succeeds the connection leaves degraded mode and the recovery listeners
  run (``registration`` re-registers the server's objects). The probe is ``PING``
  unless the owner sets a stronger one (``SharedIndex`` runs the rights probe,
  ``rights.probe_rights``: a revoked right is back only when every command works again,
  not when ``PING`` answers);
* each outage is logged once when it starts (with its class) and once when it ends (with
  the number of calls it skipped), never per call;
* credentials never reach a log line or an exception message this module raises: the
  password is read from ``password_file`` and handed to redis-py only; logs name the
  URL with any password masked (``redacted_url``).

NOTE 2 (backoff for refusals only): a Redis that refuses (a revoked right, a wrong
password, a failing script) refuses every probe the same way until an operator acts;
probing each ``retry_s`` would cost a round trip and a Redis-side log line every
``retry_s`` for nothing, so the wait doubles after each refused probe. An unreachable
Redis is probed every ``retry_s``: a failed connect costs nothing on Redis, and every
second degraded is a second of lookups answered from the local view only (misses of
other servers' objects). A refusal that begins within ``2 × MAX_BACKOFF × retry_s`` of
the last recovery continues the backoff: a probe that passes while calls still fail must
not turn into a log line per ``retry_s``.

Counters (``counters()``, read by the metrics module): ``calls``, ``failures`` (calls
that raised a connection/timeout error), ``skipped`` (calls not attempted while
degraded), ``outages`` (entries into degraded mode), ``recoveries``, ``probes``,
``restarts_seen`` (keys lost without a failed call, ``data_lost``).
"""

from __future__ import annotations

import logging
import ssl
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

from lmcache_histate.config import SharedIndexConfig, redacted_url
from lmcache_histate.exposure import read_secret

__all__ = ["IndexConnection", "Unavailable", "tls_hint"]

logger = logging.getLogger("lmcache_histate.shared_index")

T = TypeVar("T")
_FAULTS = (redis.RedisError, ConnectionError, TimeoutError, OSError)
MAX_BACKOFF = 8
"""The longest wait between probes, in multiples of ``retry_s`` (NOTE 2)."""
_DENIED = ("noperm", "can't run", "can't access", "no permissions")


def classify(exc: BaseException) -> str:
    """The class of a Redis fault, for the one log line of an outage."""
    if isinstance(exc, redis.AuthenticationError):
        return "credentials refused"
    if isinstance(exc, redis.exceptions.NoPermissionError) or (
        isinstance(exc, redis.ResponseError) and any(d in str(exc).lower() for d in _DENIED)
    ):
        return "permission denied"
    if isinstance(exc, RedisConnectionError | RedisTimeoutError | ConnectionError
                  | TimeoutError | OSError):
        return "unreachable"
    return "script error"


def _detail(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in out:
        out.append(current)
        current = current.__cause__ or current.__context__
    return out


def tls_hint(exc: BaseException, cfg: SharedIndexConfig) -> str:
    """What a failed connection says about TLS, as a clause naming the keys ("" if nothing).

    The three faults an operator meets (measured with redis-py against redis-server 7.0):
    a certificate the CA file does not trust (``SSLCertVerificationError``), ``rediss://``
    to a plain port (the TLS handshake times out: the server waits for a command), and
    ``redis://`` to a TLS port (the server resets the connection)."""
    chain = _chain(exc)
    text = " ".join(str(e) for e in chain)
    if any(isinstance(e, ssl.SSLCertVerificationError) for e in chain) or (
        "CERTIFICATE_VERIFY_FAILED" in text
    ):
        why = next((str(e.verify_message) for e in chain
                    if isinstance(e, ssl.SSLCertVerificationError)), "not trusted")
        trusted = (f"shared_index.tls_ca_file {cfg.tls_ca_file!r}" if cfg.tls_ca_file
                   else "the system's CAs (set shared_index.tls_ca_file)")
        return f"; TLS: the server's certificate is not trusted by {trusted}: {why}"
    if cfg.tls and ("handshake" in text or any(isinstance(e, ssl.SSLError) for e in chain)):
        return ("; TLS handshake failed: is the url's port Redis's TLS port (tls-port)? "
                "A plain port needs redis://")
    if not cfg.tls and any(isinstance(e, ConnectionResetError) for e in chain):
        return "; the server reset the connection: if its port speaks TLS, use rediss://"
    return ""


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
        label: str = "shared index",
        recovery: str = "re-registering this server's objects",
    ) -> None:
        """``label`` names the connection in its log lines, ``recovery`` what its recovery
        listeners do (the shared tier's differ from the shared index's)."""
        self.cfg = cfg
        self.label = label
        self.recovery = recovery
        self.client = client if client is not None else make_client(cfg)
        self._clock = clock
        self._lock = threading.Lock()
        self._degraded_since: float | None = None
        self._last_probe = 0.0
        self._probe_wait = cfg.retry_s
        self._recovered_at: float | None = None
        self._skipped_in_outage = 0
        self.probe: Callable[[redis.Redis], object] = lambda c: c.ping()
        """What ``poll`` runs to decide that Redis serves again (module docstring)."""
        self.fault = ""
        """The class of the current outage (``classify``); empty when connected."""
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
        """``fn(client)``, or ``fallback`` when Redis is (or just became) unusable (any
        Redis fault, classified in the outage's log line)."""
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
        except redis.ResponseError as exc:
            raise Unavailable(
                f"shared_index: Redis at {self.where}: {classify(exc)} ({_detail(exc)})"
            ) from None
        except _FAULTS as exc:
            raise Unavailable(
                f"shared_index: Redis at {self.where} is unreachable: {type(exc).__name__}"
                + tls_hint(exc, self.cfg)
            ) from None

    def poll(self) -> bool:
        """Probe Redis if degraded and due; True when connected after the call."""
        with self._lock:
            if self._degraded_since is None:
                return True
            now = self._clock()
            if now - self._last_probe < self._probe_wait:
                return False
            self._last_probe = now
            self._stats["probes"] += 1
        try:
            self.probe(self.client)
        except _FAULTS:
            with self._lock:
                if self.fault != "unreachable":  # NOTE 2: only a refusal backs off
                    self._probe_wait = min(self._probe_wait * 2, MAX_BACKOFF * self.cfg.retry_s)
            return False
        with self._lock:
            outage = self._clock() - (self._degraded_since or 0.0)
            skipped, self._skipped_in_outage = self._skipped_in_outage, 0
            self._degraded_since = None
            self._recovered_at = self._clock()
            fault, self.fault = self.fault, ""
            self._stats["recoveries"] += 1
        logger.warning(
            "%s: Redis at %s usable again after %.1fs (%s before; %d calls served "
            "from the local view); %s", self.label, self.where, outage, fault, skipped,
            self.recovery,
        )
        for listener in self._recovery:
            listener()
        return True

    def data_lost(self) -> None:
        """Redis lost the deployment's keys without a failed call (a restart between two
        calls: ``index`` NOTE 1): one log line, then the recovery listeners, as after an
        outage. Counted ``restarts_seen``."""
        with self._lock:
            self._stats["restarts_seen"] += 1
        logger.warning(
            "shared index: Redis at %s lost the deployment's keys (restarted empty between "
            "two calls); re-registering this server's objects", self.where,
        )
        for listener in self._recovery:
            listener()

    def _enter_degraded(self, exc: BaseException) -> None:
        with self._lock:
            self._stats["failures"] += 1
            if self._degraded_since is not None:
                return
            now = self._degraded_since = self._last_probe = self._clock()
            cap = MAX_BACKOFF * self.cfg.retry_s
            self.fault = classify(exc)
            recent = self._recovered_at is not None and now - self._recovered_at <= 2 * cap
            if recent and self.fault != "unreachable":
                # The refusal back at once: the probe passed too early; keep backing off.
                self._probe_wait = min(self._probe_wait * 2, cap)
            else:
                self._probe_wait = self.cfg.retry_s  # NOTE 2: a new outage
            self._stats["outages"] += 1
        logger.warning(
            "%s: Redis at %s %s (%s%s); serving from the local view until it "
            "serves again (probed every %.1fs%s)", self.label, self.where, self.fault,
            _detail(exc), tls_hint(exc, self.cfg),
            self.cfg.retry_s, "" if self.fault == "unreachable"
            else f", backing off to {MAX_BACKOFF * self.cfg.retry_s:.1f}s",
        )

    def close(self) -> None:
        self.client.close()
