"""The LMCache L1 rule ``runtime.tier_actions`` NOTE 1 relies on (lmcache 0.5.6).

An L1 delete decided under the runtime lock runs after the lock is released. It removes
the object it was decided for only if no new object of the same key can be committed
while the old one is resident. LMCache's ``L1Manager`` guarantees that: a key with a
resident object cannot be staged (``KEY_NOT_WRITABLE``), and a staged copy whose key
became resident meanwhile is discarded by ``finish_write`` without a commit event, the
event HiState places commits from (``plugins.CommitListener``). A real ``L1Manager`` on a
1 MiB CPU pool, no server.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lmcache") is None, reason="needs the live extra (lmcache)"
)


class Commits:
    """An ``L1ManagerListener``: the commit events LMCache emits
    (``on_l1_keys_write_finished``), in order."""

    def __init__(self) -> None:
        self.events: list[list[object]] = []

    def on_l1_keys_write_finished(self, keys: list) -> None:
        self.events.append(list(keys))

    def on_l1_keys_reserved_read(self, keys: list) -> None: ...
    def on_l1_keys_read_finished(self, keys: list) -> None: ...
    def on_l1_keys_reserved_write(self, keys: list) -> None: ...
    def on_l1_keys_finish_write_and_reserve_read(self, keys: list) -> None: ...
    def on_l1_keys_deleted_by_manager(self, keys: list) -> None: ...
    def on_l1_keys_accessed(self, keys: list) -> None: ...


def test_a_resident_key_is_committed_again_only_after_its_object_left() -> None:
    import torch
    from lmcache.v1.distributed import api
    from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig
    from lmcache.v1.distributed.error import L1Error
    from lmcache.v1.distributed.l1_manager import L1Manager

    l1 = L1Manager(L1ManagerConfig(memory_config=L1MemoryManagerConfig(
        size_in_bytes=1 << 20, use_lazy=False, shm_name="")))
    commits = Commits()
    l1.register_listener(commits)
    key = api.ObjectKey(b"c" * 16, "tiny", 0)
    layout = api.MemoryLayoutDesc([torch.Size([16])], [torch.float32])

    def stage(tag: str) -> object:
        return l1.reserve_write([key], [False], layout, tag=tag)[key][0]

    assert stage("a") == L1Error.SUCCESS
    assert l1.finish_write([key], tag="a") == {key: L1Error.SUCCESS}
    assert commits.events == [[key]]
    # Resident: another store of the same chunk cannot stage it.
    assert stage("b") == L1Error.KEY_NOT_WRITABLE

    # Gone: two writers may stage it; the first to finish commits, the second's copy is
    # discarded with no second commit event.
    assert l1.delete([key]) == {key: L1Error.SUCCESS}
    assert (stage("a"), stage("b")) == (L1Error.SUCCESS, L1Error.SUCCESS)
    assert l1.finish_write([key], tag="a") == {key: L1Error.SUCCESS}
    assert l1.finish_write([key], tag="b") == {key: L1Error.SUCCESS}
    assert commits.events == [[key], [key]]
    assert l1.delete([key]) == {key: L1Error.SUCCESS}
