"""``adapter_params`` of the HiState disk tier, validated when LMCache builds the adapter.

LMCache's plugin contract (0.5.6, ``l2_adapters/config.py``): an adapter's config class
subclasses ``L2AdapterConfigBase`` and builds itself with ``from_dict`` from the JSON of
``--l2-adapter``. The JSON's ``adapter_params`` are the server YAML's disk keys under the
same names (``config.DISK_TIER_KEYS``) plus ``index_model``; ``from_dict`` validates them
with the server schema's own checks (``config.parse_disk_tier``, NOTE 5 there), so a bad
value is refused with one message whether it came from the YAML or from a hand-written
``--l2-adapter``. This class holds the validated values in the units the tier uses
(bytes, not GiB).
"""

from __future__ import annotations

from typing import Any

from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

from lmcache_histate.config import SharedIndexConfig, parse_disk_tier

__all__ = ["HiStateDiskAdapterConfig"]


class HiStateDiskAdapterConfig(L2AdapterConfigBase):
    """The disk tier's validated ``adapter_params``.

    ``path``: the folder (created); ``capacity_bytes`` (> 0): hard limit on the sum of file
    sizes, ``disk_gib`` in whole bytes as the server counts it; ``io_workers``: threads;
    ``fsync``: each file before it is renamed into place; ``direct_io``: O_DIRECT writes
    where the filesystem allows them (``file_format`` NOTE 2); ``adopt``: use a non-empty folder
    that has no tier marker (``folder``); ``shared_index``: the folder is shared by the
    servers of a deployment through Redis (``shared_link``), in the namespace of ``model``.
    """

    def __init__(self, params: dict[str, Any]) -> None:
        """``params``: what ``config.parse_disk_tier`` returns."""
        self.path: str = params["disk_path"]
        self.capacity_bytes = int(params["disk_gib"] * 2**30)
        self.io_workers: int = params["disk_io_workers"]
        self.fsync: bool = params["disk_fsync"]
        self.adopt: bool = params["disk_adopt"]
        self.direct_io: bool = params["disk_direct_io"]
        self.shared_index: SharedIndexConfig | None = params["shared_index"]
        self.model: str = params["index_model"]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HiStateDiskAdapterConfig:
        return cls(parse_disk_tier(d))

    @classmethod
    def help(cls) -> str:
        return (
            "HiState disk tier fields (the server YAML's keys of the same names):\n"
            "- disk_path (str): the folder for the object files (required)\n"
            "- disk_gib (number): hard limit on the files' bytes, in GiB (required)\n"
            "- disk_io_workers (int): I/O threads, at most 64 (default 4)\n"
            "- disk_fsync (bool): fsync each file before it is renamed into place "
            "(default true)\n"
            "- disk_direct_io (bool): O_DIRECT writes where the filesystem allows "
            "(default true)\n"
            "- disk_adopt (bool): use a non-empty folder without the tier's marker "
            "(default false)\n"
            "- shared_index (mapping): the server YAML's shared_index section (default none)\n"
            "- index_model (str): the shared index namespace's model name"
        )
