"""The ``live`` marker: which tests start a real part, and a guard that keeps it true.

``pytest -m "not live"`` (``make test-fast``) is the fast tier: the policy core, the
simulator and the package checks, no server. A test is live when it may start a real
part: an ``lmcache server``, a vLLM CPU engine, ``redis-server``, a tmpfs mount.

NOTE 1 (the folder decides). Every test under ``LIVE_FOLDERS`` is marked live: a server
fixture shared by a module would otherwise have to be marked on whichever test happens to
set it up first, and a pure test there only moves to the slower tier.

NOTE 2 (the marker cannot go stale). While a test that is not marked live is set up, run
or torn down, starting a process whose command line names a real part (``REAL_PARTS``)
raises at once, naming the test and the process. Short tools (git, a shell script, the
``histate`` CLI) are not real parts and stay allowed.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

LIVE_FOLDERS = ("live", "examples", "shared_index")
REAL_PROGRAMS = frozenset({"redis-server", "lmcache", "vllm", "histate-server", "mount"})
REAL_MODULES = ("lmcache", "vllm", "lmcache_histate.backends")


def real_part(args: Any) -> str | None:
    """The real part a ``Popen`` argument list starts, or None (NOTE 2)."""
    if isinstance(args, str | bytes | os.PathLike):
        args = os.fsdecode(args).split() if isinstance(args, str | bytes) else [args]
    words = [os.fsdecode(w) if isinstance(w, bytes | os.PathLike) else str(w) for w in args]
    if not words:
        return None
    program = os.path.basename(words[0])
    if program in REAL_PROGRAMS:
        return program
    if program.startswith("python") and "-m" in words[1:-1]:
        module = words[words.index("-m", 1) + 1]
        if any(module == m or module.startswith(m + ".") for m in REAL_MODULES):
            return f"python -m {module}"
    return None


class LiveGuard:
    """Marks the live tests and refuses real parts started by the others (NOTE 2)."""

    def __init__(self, tests_root: Path) -> None:
        self.tests_root = tests_root
        self.item: pytest.Item | None = None
        self._popen_init = subprocess.Popen.__init__

    def install(self) -> None:
        guard = self
        opened = self._popen_init

        def guarded(popen: Any, args: Any, *rest: Any, **kwargs: Any) -> None:
            guard.check(args)
            opened(popen, args, *rest, **kwargs)

        subprocess.Popen.__init__ = guarded  # type: ignore[method-assign]

    def uninstall(self) -> None:
        subprocess.Popen.__init__ = self._popen_init  # type: ignore[method-assign]

    def mark(self, items: list[pytest.Item]) -> None:
        for item in items:
            parts = Path(str(item.path)).resolve().relative_to(self.tests_root).parts
            if parts and parts[0] in LIVE_FOLDERS:
                item.add_marker(pytest.mark.live)

    def check(self, args: Any) -> None:
        item = self.item
        if item is None or item.get_closest_marker("live") is not None:
            return
        part = real_part(args)
        if part is not None:
            raise RuntimeError(
                f"{item.nodeid} starts a real part ({part}) but is not "
                f"marked live: put it under tests/{{{','.join(LIVE_FOLDERS)}}}/ or mark it "
                "@pytest.mark.live (tests/support/live_marker.py NOTE 2)"
            )

    def running(self, item: pytest.Item) -> Iterator[None]:
        self.item = item
        try:
            yield
        finally:
            self.item = None

    # pytest hooks (registered as a plugin object by tests/conftest.py)
    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Iterator[None]:
        return (yield from self.running(item))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        return (yield from self.running(item))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Iterator[None]:
        return (yield from self.running(item))
