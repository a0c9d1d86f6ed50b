"""The ``shared_index`` section of the server YAML: where several servers share one index.

Absent (the default): one server, its own disk folder, today's behaviour. Present: the
server registers its disk-tier objects in Redis so that the other servers of the same
``deployment`` (and model) find them, and evicts from one deployment-wide budget
(``backends/server/shared_index``, ``docs/shared-index.md``)::

    shared_index:
      url: rediss://histate@redis.internal:6380/0   # redis://, rediss:// (TLS) or unix://
      password_file: /etc/histate/redis-password    # chmod 600; the AUTH password
      tls_ca_file: /etc/histate/redis-ca.pem        # rediss:// only; default: system CAs
      deployment: prod-a                            # namespace, with the model
      instance: gpu0                                # this server's name in the deployment
      connect_timeout_s: 1.0
      op_timeout_s: 0.25
      lease_ttl_s: 30          # a load lease: no other server deletes the file meanwhile
      claim_ttl_s: 60          # an eviction claim: its file deleted within this, or reclaimed
      write_ttl_s: 120         # a reservation: the file written and committed within this
      retry_s: 2.0             # while Redis is unreachable, how often it is probed

NOTE 1 (no password in the URL): the URL may name the ACL user; the password must come
from ``password_file``. A URL is printed (``--print-config``, start-up logs) and shows
up in process listings of tools that take it as an argument; a file with mode 600 does
not. A URL holding a password is refused at load, naming the key, without echoing it.

Pure (no redis import): validated with the rest of the configuration before anything
starts.
"""

from __future__ import annotations

import math
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .exposure import check_secret_file

__all__ = ["SCHEMES", "SharedIndexConfig", "parse_shared_index", "redacted_url"]

SCHEMES = ("redis", "rediss", "unix")
SECTION = "shared_index"
_NAME = re.compile(r"[A-Za-z0-9._/-]{1,128}")


@dataclass(frozen=True)
class SharedIndexConfig:
    """A validated ``shared_index`` section (module docstring)."""

    url: str
    deployment: str
    instance: str
    password_file: str | None = None
    tls_ca_file: str | None = None
    connect_timeout_s: float = 1.0
    op_timeout_s: float = 0.25
    lease_ttl_s: float = 30.0
    claim_ttl_s: float = 60.0
    write_ttl_s: float = 120.0
    retry_s: float = 2.0

    @property
    def tls(self) -> bool:
        return self.url.startswith("rediss://")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __repr__(self) -> str:
        return f"SharedIndexConfig(url={redacted_url(self.url)!r}, deployment={self.deployment!r})"


ALLOWED = tuple(f.name for f in fields(SharedIndexConfig))
_TIMES = ("connect_timeout_s", "op_timeout_s", "lease_ttl_s", "claim_ttl_s", "write_ttl_s",
          "retry_s")


def redacted_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (safe to log)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


def parse_shared_index(
    value: Any, port: int | None, base_dir: Path | None, errors: list[str]
) -> SharedIndexConfig | None:
    """Validate the section; problems go to ``errors``, each naming ``shared_index.<key>``.

    ``port`` (the server's ZMQ port) names the instance when ``instance`` is not given.
    """
    if not isinstance(value, Mapping):
        errors.append(
            f"{SECTION}: must be a mapping with at least 'url' and 'deployment', "
            f"got {value!r}"
        )
        return None
    n0 = len(errors)
    for key in sorted(str(k) for k in value if k not in ALLOWED):
        errors.append(f"{SECTION}.{key}: unknown key; allowed keys: {', '.join(ALLOWED)}")
    out: dict[str, Any] = {}
    out["url"] = _url(value.get("url"), errors)
    for key in ("deployment", "instance"):
        raw = value.get(key)
        if raw is None and key == "instance":
            raw = f"{socket.gethostname()}-{port or 5555}"
            raw = re.sub(r"[^A-Za-z0-9._/-]", "_", raw)[:128]
        if not isinstance(raw, str) or not _NAME.fullmatch(raw):
            errors.append(
                f"{SECTION}.{key}: must be 1-128 characters of [A-Za-z0-9._/-], got {raw!r}"
            )
        out[key] = raw
    for key in _TIMES:
        if key in value:
            raw = value[key]
            ok = isinstance(raw, int | float) and not isinstance(raw, bool)
            if not ok or not math.isfinite(raw) or raw <= 0:
                errors.append(f"{SECTION}.{key}: must be a positive number (seconds), got {raw!r}")
            else:
                out[key] = float(raw)
    if value.get("password_file") is not None:
        out["password_file"] = check_secret_file(
            f"{SECTION}.password_file", value["password_file"], base_dir, errors, min_length=1
        )
    ca = value.get("tls_ca_file")
    if ca is not None:
        path = Path(str(ca)).expanduser()
        if base_dir is not None and not path.is_absolute():
            path = base_dir / path
        if not isinstance(ca, str) or not path.is_file():
            errors.append(f"{SECTION}.tls_ca_file: must be a readable file, got {ca!r}")
        elif isinstance(out["url"], str) and not out["url"].startswith("rediss://"):
            errors.append(f"{SECTION}.tls_ca_file: only used with a rediss:// (TLS) url")
        out["tls_ca_file"] = str(path)
    if len(errors) > n0:
        return None
    return SharedIndexConfig(**out)


def _url(raw: Any, errors: list[str]) -> str | None:
    key = f"{SECTION}.url"
    if not isinstance(raw, str) or not raw.strip():
        errors.append(f"{key}: required: a redis://, rediss:// or unix:// URL, got {raw!r}")
        return None
    try:
        parts = urlsplit(raw)
        port = parts.port
        password = parts.password
    except ValueError as exc:
        errors.append(f"{key}: not a valid URL ({exc})")
        return None
    shown = redacted_url(raw)
    if parts.scheme not in SCHEMES:
        errors.append(f"{key}: the scheme must be one of {', '.join(SCHEMES)}; got {shown!r}")
        return None
    if password is not None:  # NOTE 1
        errors.append(
            f"{key}: must not hold a password ({shown!r}); put it in "
            f"{SECTION}.password_file (chmod 600)"
        )
        return None
    if parts.scheme == "unix":
        if not parts.path:
            errors.append(f"{key}: a unix:// URL needs the socket path, got {shown!r}")
            return None
    else:
        if not parts.hostname:
            errors.append(f"{key}: names no host, got {shown!r}")
            return None
        if port is not None and not 1 <= port <= 65535:
            errors.append(f"{key}: port must be in 1..65535, got {shown!r}")
            return None
        db = parts.path.strip("/")
        if db and not db.isdigit():
            errors.append(f"{key}: the path must be a database number (e.g. /0), got {shown!r}")
            return None
    return raw
