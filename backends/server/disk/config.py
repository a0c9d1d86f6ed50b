"""``adapter_params`` of the HiState disk tier, validated when LMCache builds the adapter."""

from __future__ import annotations

from typing import Any

from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

from lmcache_histate.shared_index_config import SharedIndexConfig, parse_shared_index

__all__ = ["HiStateDiskAdapterConfig"]


class HiStateDiskAdapterConfig(L2AdapterConfigBase):
    """``adapter_params`` of the disk tier.

    Fields: ``path`` (folder, created), ``capacity_bytes`` (> 0; hard limit on the sum of
    file sizes), ``io_workers`` (threads, default 4), ``fsync`` (default true), ``direct_io``
    (default true: O_DIRECT writes where the filesystem allows them, ``direct_write``),
    ``adopt`` (default false: use a non-empty folder that has no tier marker; see
    ``folder``), ``shared_index`` (the server YAML's section, as a mapping: the folder is
    shared by the servers of a deployment through Redis, ``shared_link``) with ``model``
    (the index namespace's model name).
    """

    def __init__(
        self,
        path: str,
        capacity_bytes: int,
        io_workers: int = 4,
        fsync: bool = True,
        adopt: bool = False,
        direct_io: bool = True,
        shared_index: SharedIndexConfig | None = None,
        model: str = "model",
    ) -> None:
        self.path = path
        self.capacity_bytes = capacity_bytes
        self.io_workers = io_workers
        self.fsync = fsync
        self.adopt = adopt
        self.direct_io = direct_io
        self.shared_index = shared_index
        self.model = model

    @classmethod
    def from_dict(cls, d: dict) -> HiStateDiskAdapterConfig:
        path = d.get("path")
        if not isinstance(path, str) or not path:
            raise ValueError("path must be a non-empty string")
        cap = d.get("capacity_bytes")
        if isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0:
            raise ValueError(f"capacity_bytes must be a positive integer, got {cap!r}")
        workers = d.get("io_workers", 4)
        if isinstance(workers, bool) or not isinstance(workers, int) or workers <= 0:
            raise ValueError(f"io_workers must be a positive integer, got {workers!r}")
        flags = {}
        for name, default in (("fsync", True), ("adopt", False), ("direct_io", True)):
            flags[name] = d.get(name, default)
            if not isinstance(flags[name], bool):
                raise ValueError(f"{name} must be a boolean, got {flags[name]!r}")
        allowed = {"path", "capacity_bytes", "io_workers", "fsync", "adopt", "direct_io",
                   "shared_index", "model"}
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise ValueError(
                f"unknown adapter_params {unknown}; allowed: {', '.join(sorted(allowed))}"
            )
        shared = _shared(d.get("shared_index"))
        model = d.get("model", "model")
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a non-empty string, got {model!r}")
        return cls(path, cap, workers, flags["fsync"], flags["adopt"], flags["direct_io"],
                   shared, model)

    @classmethod
    def help(cls) -> str:
        return (
            "HiState disk tier fields:\n"
            "- path (str): folder for the object files (required)\n"
            "- capacity_bytes (int): hard limit on bytes on disk (required)\n"
            "- io_workers (int): I/O threads (default 4)\n"
            "- fsync (bool): fsync each file before it is renamed into place (default true)\n"
            "- adopt (bool): use a non-empty folder without the tier's marker (default false)\n"
            "- direct_io (bool): O_DIRECT writes where the filesystem allows (default true)\n"
            "- shared_index (mapping): the server YAML's shared_index section (default none)\n"
            "- model (str): the shared index namespace's model name"
        )


def _shared(value: Any) -> SharedIndexConfig | None:
    """The ``shared_index`` parameter, validated like the server YAML's section."""
    if value is None:
        return None
    errors: list[str] = []
    cfg = parse_shared_index(value, None, None, errors)
    if cfg is None:
        raise ValueError("; ".join(errors))
    return cfg
