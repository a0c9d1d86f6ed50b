"""Who may reach the server: loopback by default, beyond it only on request, with a secret.

Validated when the configuration is loaded (``config.parse_config`` calls
``check_exposure``); pure, no lmcache import. The secret is enforced by
``backends/server/access.py`` (HTTP) and the HiState server module (RPCs).
"""

from __future__ import annotations

import ipaddress
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["check_exposure", "check_secret_file", "is_loopback", "read_secret"]

MIN_SECRET = 16
"""Shortest accepted shared secret, in characters."""


def read_secret(path: str | Path) -> str:
    """The shared secret held in ``path`` (surrounding whitespace removed)."""
    return Path(path).read_text().strip()


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_exposure(
    data: Mapping[str, Any], values: dict[str, Any], base_dir: Path | None, errors: list[str]
) -> None:
    """NOTE 1 (protected mode, as Redis does it): LMCache's ZMQ and HTTP APIs have no
    authentication, so binding beyond loopback is refused unless ``allow_remote: true``
    says so and ``auth_token_file`` holds a shared secret (docs/deployment.md, Security)."""
    remote = values.get("allow_remote", False)
    token = data.get("auth_token_file")
    if token is not None:
        values["auth_token_file"] = check_secret_file("auth_token_file", token, base_dir, errors)
    elif remote:
        errors.append(
            "auth_token_file: required when allow_remote is true (a file holding the shared "
            "secret for HiState's RPCs and the HTTP API)"
        )
    if remote:
        return
    for key in ("host", "http_host"):
        host = values.get(key)
        if host is not None and not is_loopback(host):
            errors.append(
                f"{key}: {host!r} is not a loopback address; LMCache's ZMQ and HTTP APIs "
                "have no authentication: set allow_remote: true and auth_token_file to "
                "bind beyond this machine (docs/deployment.md, Security)"
            )


def check_secret_file(
    key: str, value: Any, base_dir: Path | None, errors: list[str], min_length: int = MIN_SECRET
) -> str | None:
    """The absolute path of a secret file named by ``key``, or None with the problem in
    ``errors``: a regular file, not readable by group or others, holding at least
    ``min_length`` characters. The secret itself never appears in a message."""
    if not isinstance(value, str) or not value.strip():
        errors.append(f"{key}: must be a non-empty string (a file path), got {value!r}")
        return None
    p = Path(value).expanduser()
    if not p.is_absolute() and base_dir is not None:
        p = base_dir / p
    try:
        st = p.stat()
        secret = read_secret(p) if stat.S_ISREG(st.st_mode) else ""
    except (OSError, UnicodeDecodeError) as exc:
        errors.append(f"{key}: cannot read {str(p)!r}: {exc}")
        return None
    if not stat.S_ISREG(st.st_mode):
        errors.append(f"{key}: {str(p)!r} is not a regular file")
    elif st.st_mode & 0o077:
        errors.append(
            f"{key}: {str(p)!r} is readable by other users (mode {st.st_mode & 0o777:o}); "
            "chmod 600 it"
        )
    elif len(secret) < min_length:
        errors.append(f"{key}: the secret in {str(p)!r} must be at least {min_length} characters")
    else:
        return str(p)
    return None
