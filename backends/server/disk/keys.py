"""LMCache's ``ObjectKey`` <-> the disk format's ``ObjectId`` (same fields, no lmcache in
``file_format``)."""

from __future__ import annotations

from lmcache.v1.distributed.api import ObjectKey

from . import file_format as df

__all__ = ["to_key", "to_oid"]


def to_oid(key: ObjectKey) -> df.ObjectId:
    return df.ObjectId(
        key.model_name, key.kv_rank, key.object_group_id, key.chunk_hash, key.cache_salt
    )


def to_key(oid: df.ObjectId) -> ObjectKey:
    return ObjectKey(
        chunk_hash=oid.chunk_hash,
        model_name=oid.model_name,
        kv_rank=oid.kv_rank,
        object_group_id=oid.object_group_id,
        cache_salt=oid.cache_salt,
    )
