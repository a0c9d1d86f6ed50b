"""Start-up checks of ``histate-server``: what would fail later, caught before anything starts.

``check(cfg)`` runs after the configuration is validated and before ``lmcache server`` is
imported. Each problem raises ``ConfigError`` with ONE line naming the key, e.g.
``port: 5555 on 127.0.0.1 is in use``, which the launcher prints before exiting with
status 2. Without these the same faults surfaced as tracebacks, some only after 12-16 s
of LMCache start-up (a ZMQ bind error).

Read-only: nothing is created (the disk tier creates and claims its folder itself).
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from lmcache_histate.config import ConfigError, HiStateConfig

from .disk.folder import FolderError, capacity_limit, check_claim, check_free, held_bytes

__all__ = ["check", "check_disk", "check_listen", "check_memory", "check_shared_index",
           "memory_limit"]

VIRTUAL_ROOTS = ("/proc", "/sys", "/dev")
"""Kernel filesystems: a folder there is never a disk (``/dev/shm``, a tmpfs, excepted)."""


def check(cfg: HiStateConfig) -> None:
    """Every start-up check; raises ``ConfigError`` (one line, naming the key)."""
    check_memory(cfg)
    check_disk(cfg)
    check_listen(cfg)
    check_shared_index(cfg)


# -------------------------------------------------------------------------- memory
CGROUP_MEMORY_MAX = Path("/sys/fs/cgroup/memory.max")
"""cgroup v2: the memory this process's group may use (``max`` = no limit)."""


def memory_limit() -> int:
    """Bytes of memory this process may use: the machine's RAM or a smaller cgroup limit."""
    limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        text = CGROUP_MEMORY_MAX.read_text().strip()
    except OSError:
        return limit
    return min(limit, int(text)) if text.isdigit() else limit


def check_memory(cfg: HiStateConfig) -> None:
    """``cpu_gib`` fits in memory: LMCache allocates its L1 tier whole at start, and one
    larger than the memory fails there with a traceback (or is killed later)."""
    limit = memory_limit()
    if cfg.cpu_bytes > limit:
        raise ConfigError(
            f"cpu_gib: {cfg.cpu_gib:g} GiB is more than the memory this server may use "
            f"({limit / 2**30:.3g} GiB)"
        )


# ---------------------------------------------------------------------------- disk
def _existing_ancestor(path: Path) -> Path:
    """The deepest existing path on the way to ``path``; a file there is an error."""
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(
            f"disk_path: {str(path)!r} is under a file ({str(probe)!r} is not a folder)"
        )
    return probe


def check_disk(cfg: HiStateConfig) -> None:
    """The disk folder can be created, written and claimed, and ``disk_gib`` fits."""
    path = Path(os.path.realpath(cfg.disk_path))
    shm = Path("/dev/shm")
    for root in VIRTUAL_ROOTS:
        if (path == Path(root) or Path(root) in path.parents) and not (
            path == shm or shm in path.parents
        ):
            raise ConfigError(
                f"disk_path: {cfg.disk_path!r} is on the kernel's virtual filesystem {root}; "
                "choose a folder on a disk"
            )
    base = _existing_ancestor(path)
    if not os.access(base, os.W_OK | os.X_OK):
        try:
            read_only = bool(os.statvfs(base).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        why = "is on a read-only filesystem" if read_only else "is not writable by this user"
        raise ConfigError(f"disk_path: {str(base)!r} {why}")
    if path.exists():
        try:
            check_claim(path, adopt=cfg.disk_adopt)
            check_free(path, shared=cfg.shared_index is not None)
        except FolderError as exc:
            raise ConfigError(f"disk_path: {exc}") from None
    held = held_bytes(path) if path.exists() else 0
    limit = capacity_limit(base, held)
    if cfg.disk_bytes > limit:
        raise ConfigError(
            f"disk_gib: {cfg.disk_gib:g} GiB is more than the filesystem of disk_path can "
            f"hold ({limit / 2**30:.3g} GiB: {(limit - held) / 2**30:.3g} GiB free + "
            f"{held / 2**30:.3g} GiB already in the tier)"
        )


# --------------------------------------------------------------------- shared index
def check_shared_index(cfg: HiStateConfig) -> None:
    """With ``shared_index``: Redis answers, takes the credentials, and the user may run
    every command of the index on its namespace (``shared_index.rights``)."""
    if cfg.shared_index is None:
        return
    from .shared_index.connection import Unavailable
    from .shared_index.layout import KeySpace, index_model_name
    from .shared_index.rights import check_rights

    try:
        check_rights(cfg.shared_index,
                     KeySpace(cfg.shared_index.deployment, index_model_name(cfg.model)))
    except Unavailable as exc:
        raise ConfigError(str(exc)) from None


# --------------------------------------------------------------------------- ports
def check_listen(cfg: HiStateConfig) -> None:
    """``host:port`` (ZMQ) and ``http_host:http_port`` (HTTP) can be bound right now, as
    the servers bind them: ZMQ over IPv4 only (``config`` NOTE 7), uvicorn either."""
    for host_key, port_key, family in (("host", "port", socket.AF_INET),
                                       ("http_host", "http_port", socket.AF_UNSPEC)):
        host, port = getattr(cfg, host_key), getattr(cfg, port_key)
        try:
            infos = socket.getaddrinfo(host, port, family=family, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        except (socket.gaierror, UnicodeError) as exc:
            if family == socket.AF_INET and _resolves(host):
                raise ConfigError(
                    f"{host_key}: {host!r} has no IPv4 address; LMCache binds its ZMQ port "
                    "over IPv4 only: use 127.0.0.1"
                ) from None
            raise ConfigError(f"{host_key}: {host!r} is not a valid address ({exc})") from None
        family, kind, proto, _canon, address = infos[0]
        with socket.socket(family, kind, proto) as sock:
            # As the servers bind: a port in TIME_WAIT is reusable, one listened on is not.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ConfigError(
                        f"{port_key}: {port} on {host} is in use (another server?)"
                    ) from None
                if exc.errno == errno.EADDRNOTAVAIL:
                    raise ConfigError(
                        f"{host_key}: {host!r} is not an address of this machine"
                    ) from None
                raise ConfigError(f"{port_key}: cannot bind {host}:{port}: {exc}") from None


def _resolves(host: str) -> bool:
    try:
        return bool(socket.getaddrinfo(host, None))
    except (socket.gaierror, UnicodeError):
        return False
