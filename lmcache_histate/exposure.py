"""Who may reach the server: reading the shared secret and telling loopback hosts apart.

The rule (loopback by default, beyond it only with ``allow_remote`` and a secret) is
validated with the rest of the server configuration (``config``, NOTE 4); these helpers
serve that check and the parts that enforce the secret at run time
(``backends/server/access.py`` for HTTP, the HiState server module for RPCs). Pure, no
lmcache import.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

__all__ = ["is_loopback", "read_secret"]


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
