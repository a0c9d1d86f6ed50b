"""Where the shared index keeps what: the Redis key layout of one deployment and model.

Every key of one (deployment, model) pair starts with the same prefix, whose ``{...}`` part
is a Redis Cluster hash tag, so all of them live in one hash slot and every Lua script can
touch them atomically (NOTE 1)::

    histate:{<deployment>:<model>}:used   string  bytes held on the shared disk tier
                                          (stored + being written + being evicted)
    histate:{...}:budget                  string  the deployment's disk budget, bytes
    histate:{...}:epoch                   string  a random token set by the first join
                                          after the keys were empty (``index`` NOTE 1)
    histate:{...}:evicting                string  bytes claimed for eviction, not yet freed
    histate:{...}:o:<id>                  hash    one object (``ENTRY_FIELDS``)
    histate:{...}:rank                    zset    <id> -> H of every stored object
    histate:{...}:lease:<id>              zset    <holder> -> lease expiry (ms, Redis clock)
    histate:{...}:ema                     hash    deployment EMAs (``EMA_FIELDS``)
    histate:{...}:s:<session>             hash    one session's facts (``SESSION_FIELDS``)
    histate:{...}:sessions                zset    <session> -> last access (s)
    histate:{...}:servers                 zset    <instance> -> 0 (the servers that joined)

``<id>`` is the object's 128-bit BLAKE2b digest of its encoded key (the disk format's
``encode_id``: model, rank, object group, chunk hash, salt), in hex: bounded, and the
same digest the disk tier puts in the object's file name.

An object entry moves through three states::

    (absent) --reserve--> writing --commit--> stored --claim--> evicting --drop--> (absent)
                              \\__ expired: reconcile __/            \\__ file gone: forget
                                                                    (expired: reconcile)

Only ``stored`` entries are found by lookups, leased, and ranked.

NOTE 1 (one slot): scripts build the per-object key names from the prefix. Redis Cluster
asks scripts to declare their keys; they declare the ``used`` key, which routes the call
to the slot that holds every key of the prefix, and touch no key outside that slot.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "EMA_FIELDS",
    "ENTRY_FIELDS",
    "SESSION_FIELDS",
    "STATES",
    "KeySpace",
    "ObjectRecord",
    "index_model_name",
    "object_id",
]

ENTRY_FIELDS = (
    "state", "owner", "tier", "path", "size", "crc", "kind", "depth", "parent",
    "t", "cost", "freed", "born", "until", "claimant", "oid",
)
"""Fields of an object entry: state (``STATES``), owning instance, tier (1 = disk),
path relative to the shared folder, file size and payload crc32, kind / depth / parent
hash (hex) from the file header, last access ``t`` (s, Redis clock), the owner's ``C``
(``cost``) and ``M`` (``freed``) for ``H``, ``born`` (commit time, s), ``until`` (ms
deadline of a reservation or an eviction claim), the eviction ``claimant``, and ``oid``
(the encoded object key, hex)."""
STATES = ("writing", "stored", "evicting")
EMA_FIELDS = ("kv", "kv_n", "state", "state_n", "gap", "gap_n")
"""Deployment EMAs: residence time of evicted KV objects and of snapshots (s) with
their sample counts (the interval controller's ``T_KV``, ``T_state``), and the
sessions' re-access gap (s, the score's ``tau``)."""
SESSION_FIELDS = ("owner", "end", "end_tokens", "t", "requests")
"""A session's facts: the instance that served its last request, the id of its final
snapshot object, its end position in tokens, last access (s) and request count."""

_NAME = re.compile(r"[A-Za-z0-9._/-]{1,128}")


def index_model_name(model: str) -> str:
    """The namespace's model name for a configuration's ``model``: the model directory's
    (or preset's) name, in the characters a key name allows."""
    name = Path(model.rstrip("/")).name
    if name == "config.json":
        name = Path(model).parent.name
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:128] or "model"
_DIGEST_BYTES = 16


def object_id(encoded_key: bytes) -> str:
    """The index id of an object: hex BLAKE2b-128 of its encoded key (``file_format.encode_id``)."""
    return hashlib.blake2b(encoded_key, digest_size=_DIGEST_BYTES).hexdigest()


@dataclass(frozen=True, slots=True)
class ObjectRecord:
    """One object on the shared disk tier, as a server registers it.

    ``cost`` and ``freed`` are the registering server's ``C`` and ``M`` of the eviction
    unit the object heads (``core/rank.py``); ``H`` is computed from them in Redis with
    the deployment's ``tau`` and the entry's last access.
    """

    oid: bytes  # encoded object key (file_format.encode_id)
    path: str  # relative to the shared folder, e.g. "ab/<file name>"
    size: int  # file size in bytes (header + payload): what the budget counts
    crc: int  # payload crc32, as in the file header
    kind: int = 0
    depth: int = -1
    parent: bytes = b""
    cost: float = 0.0
    freed: float = 0.0
    tier: int = 1

    @property
    def id(self) -> str:
        return object_id(self.oid)


class KeySpace:
    """The key names of one (deployment, model) namespace (module docstring)."""

    __slots__ = ("deployment", "model", "prefix")

    def __init__(self, deployment: str, model: str) -> None:
        for what, value in (("deployment", deployment), ("model", model)):
            if not _NAME.fullmatch(value):
                raise ValueError(
                    f"{what}: must be 1-128 characters of [A-Za-z0-9._/-], got {value!r}"
                )
        self.deployment = deployment
        self.model = model
        self.prefix = f"histate:{{{deployment}:{model}}}:"

    @property
    def used(self) -> str:
        """The routing key every script declares (NOTE 1)."""
        return self.prefix + "used"

    @property
    def budget(self) -> str:
        return self.prefix + "budget"

    @property
    def rank(self) -> str:
        return self.prefix + "rank"

    @property
    def ema(self) -> str:
        return self.prefix + "ema"

    @property
    def sessions(self) -> str:
        return self.prefix + "sessions"

    @property
    def epoch(self) -> str:
        return self.prefix + "epoch"

    @property
    def servers(self) -> str:
        return self.prefix + "servers"

    @property
    def object_pattern(self) -> str:
        """``SCAN MATCH`` pattern of every object entry (the hash tag's braces escaped)."""
        return _glob_escape(self.prefix) + "o:*"

    def entry(self, oid: str) -> str:
        return f"{self.prefix}o:{oid}"

    def lease(self, oid: str) -> str:
        return f"{self.prefix}lease:{oid}"

    def session(self, sid: str) -> str:
        return f"{self.prefix}s:{sid}"

    def id_of(self, entry_key: str) -> str:
        """The object id in an entry key name (inverse of ``entry``)."""
        return entry_key[len(self.prefix) + 2 :]


def _glob_escape(text: str) -> str:
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)
