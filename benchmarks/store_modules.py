"""How many HiState modules one store crosses in a real ``lmcache server``.

    .venv/bin/python benchmarks/store_modules.py [--code DIR] [--json OUT]

Starts the HiState launcher (a real ``lmcache server`` with HiState's store policy, server
module and disk tier; ``tests/support/lmcache_mp``'s harness, free ports, a temporary
folder), stores one warm-up prompt, then measures a second store of 4 chunks with snapshots
after chunks 1 and 3, as LMCache's engine client sends it: the STORE request, the commit to
L1, the store policy's routing, the disk writes on the tier's I/O threads, their reports
and the store controller's completion, until the server has settled.

How it counts: the server process runs with a profile hook on every thread
(``sys.setprofile`` + ``threading.setprofile``, installed before the launcher starts);
while recording, it notes the file of every Python function entered. A HiState module is a
file of the package (``lmcache_histate/`` and ``backends/``, installed as
``lmcache_histate.backends``). The store is the engine client's whole request, as vLLM's
connector sends it (LOOKUP, STORE, END_SESSION). Three kinds of thread are left out, none
part of a store: the janitor's periodic tick; the HTTP API on the main thread (uvicorn's
event loop runs the ASGI app there: the client's ``/status`` polls while it waits for the
server to settle); and that event loop's default executor, ``uvloop_N`` (uvloop 0.23.0
``loop.pyx``:2755, ``run_in_executor``: ``ThreadPoolExecutor(thread_name_prefix='uvloop')``),
where ``data_plane.DataPlaneGate`` runs each poll's ``DataPlaneProbe.check`` through
``asyncio.to_thread``. An executor thread is left out only while every function it entered
is in ``data_plane.py`` (the gate's probe); otherwise it is counted and its functions are
printed. Recording is switched by a control file a thread of the server polls, so the
client's start and stop bracket exactly the store and its settling.

``--code DIR`` runs another checkout's package code (a ``git worktree`` of the base
branch, for a before/after comparison) with this script and the test harness unchanged.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CODE_ENV = "STORE_MODULES_CODE"  # the package checkout the server runs (``--code``)
CTL_ENV = "STORE_MODULES_CTL"  # the control file the server polls
# Not the store's: the janitor's periodic tick, and the HTTP API on the main thread (the
# client's ``/status`` polls while it waits for the server to settle).
SKIP_THREADS = ("histate-janitor", "MainThread")
# The HTTP event loop's default executor, left out while it runs the data-plane probe only.
PROBE_THREADS, PROBE_MODULE = "uvloop_", "backends/server/data_plane.py"
CHUNK = 16


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """Resolve ``lmcache_histate`` and ``lmcache_histate.backends`` in another checkout
    (their submodules then follow their packages' ``__path__``)."""

    def __init__(self, code: Path) -> None:
        self.roots = {"lmcache_histate": code / "lmcache_histate",
                      "lmcache_histate.backends": code / "backends"}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        root = self.roots.get(fullname)
        if root is not None:
            return importlib.util.spec_from_file_location(
                fullname, root / "__init__.py", submodule_search_locations=[str(root)])
        if fullname.startswith("lmcache_histate.") and path is not None:
            # Ahead of the editable install's finder, which maps names to this checkout
            # and would miss a module only the other checkout has.
            return importlib.machinery.PathFinder.find_spec(fullname, path, target)
        return None


def use_checkout(code: str | None) -> None:
    if code:
        sys.meta_path.insert(0, _CheckoutFinder(Path(code).resolve()))


# ------------------------------------------------------------------------- server side
class Recorder:
    """The profile hook: files of package functions entered per thread, while on, named
    relative to the checkout (``backends/server/...``, ``lmcache_histate/core/...``)."""

    def __init__(self, checkout: Path) -> None:
        self.checkout = str(checkout) + os.sep
        self.roots = (self.checkout + "lmcache_histate" + os.sep,
                      self.checkout + "backends" + os.sep)
        self.on = False
        self.seen: dict[str, set[str]] = {}

    def hook(self, frame: FrameType, event: str, _arg: Any) -> None:
        if not self.on or event != "call":
            return
        path = frame.f_code.co_filename
        if path.startswith(self.roots):
            name = threading.current_thread().name
            self.seen.setdefault(name, set()).add(
                f"{path[len(self.checkout):]}:{frame.f_code.co_qualname}")

    def poll(self, ctl: Path) -> None:
        """``start`` clears and records; ``stop <out>`` stops and writes the JSON there."""
        while True:
            time.sleep(0.005)
            try:
                command = ctl.read_text().split()
            except OSError:
                continue
            if command[:1] == ["start"] and not self.on:
                self.seen = {}
                self.on = True
                ctl.write_text("started")
            elif command[:1] == ["stop"] and self.on:
                self.on = False
                Path(command[1]).write_text(json.dumps(
                    {name: sorted(paths) for name, paths in self.seen.items()}))
                ctl.write_text("stopped")


def serve(argv: list[str]) -> int:
    """The server process: the profile hook on every thread, then the launcher."""
    use_checkout(os.environ.get(CODE_ENV))
    import lmcache_histate

    recorder = Recorder(Path(lmcache_histate.__file__).resolve().parents[1])
    threading.Thread(target=recorder.poll, args=(Path(os.environ[CTL_ENV]),),
                     name="store-modules-ctl", daemon=True).start()
    threading.setprofile(recorder.hook)
    sys.setprofile(recorder.hook)
    from lmcache_histate.backends.server.launcher import main

    return main(argv)


# ------------------------------------------------------------------------- client side
def _command(ctl: Path, command: str, expect: str, timeout: float = 30.0) -> None:
    ctl.write_text(command)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ctl.read_text() == expect:
            return
        time.sleep(0.01)
    raise RuntimeError(f"the server did not answer {command!r}")


def measure(code: str | None) -> dict[str, list[str]]:
    """Modules entered per thread during one store (the second of two)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import yaml
    from support.lmcache_mp import EngineGeometry, HybridEngineClient, TokenSource, lmcache_server

    with tempfile.TemporaryDirectory(prefix="store-modules-") as tmp:
        work = Path(tmp)
        cfg = work / "histate.yaml"
        cfg.write_text(yaml.safe_dump({
            "model": "tiny-qwen3-next", "chunk_size": CHUNK, "cpu_gib": 0.05,
            "disk_path": str(work / "disk"), "disk_gib": 0.01, "disk_fsync": False}))
        ctl, out = work / "trace.ctl", work / "modules.json"
        ctl.write_text("")
        env = {CTL_ENV: str(ctl), **({CODE_ENV: str(Path(code).resolve())} if code else {})}
        command = [sys.executable, str(Path(__file__).resolve()), "--serve", "--config", str(cfg)]
        tokens = TokenSource(seed=32)
        with (
            lmcache_server(workdir=work / "srv", chunk_size=CHUNK, command=command, env=env,
                           startup_timeout=240) as server,
            HybridEngineClient(server.endpoints.zmq_url, EngineGeometry(num_blocks=512))
            as engine,
        ):
            engine.store_chunks(tokens.tokens(4 * CHUNK), snapshot_chunks=[1, 3])  # warm-up
            server.histate_settled()
            _command(ctl, "start", "started")
            engine.store_chunks(tokens.tokens(4 * CHUNK), snapshot_chunks=[1, 3])
            status = server.histate_settled()
            _command(ctl, f"stop {out}", "stopped")
            written = status["disk"]["stats"].get("objects_written", 0)
            if written < 4:  # both stores' two snapshots each
                raise RuntimeError(f"expected 4 objects written, the disk tier says {written}")
            return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--serve"]:
        return serve(args[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--code", help="another checkout's root whose package code to run")
    parser.add_argument("--json", help="also write the per-thread module lists here")
    opts = parser.parse_args(args)
    seen = measure(opts.code)
    per_thread = {t: sorted({f.partition(":")[0] for f in funcs})
                  for t, funcs in seen.items() if not t.startswith(SKIP_THREADS)}
    for t, paths in list(per_thread.items()):
        if t.startswith(PROBE_THREADS):
            if paths == [PROBE_MODULE]:
                del per_thread[t]
            else:
                print(f"counted: {t} ran more than the data-plane probe: {sorted(seen[t])}")
    modules = sorted({m for paths in per_thread.values() for m in paths})
    backends = [m for m in modules if m.startswith("backends/")]
    print(f"HiState modules entered by one store: {len(modules)} "
          f"({len(backends)} in backends/, {len(modules) - len(backends)} in lmcache_histate/)")
    for m in modules:
        threads = sorted({"histate-disk" if t.startswith("histate-disk") else t
                          for t, paths in per_thread.items() if m in paths})
        print(f"  {m:55s} {', '.join(threads)}")
    if opts.json:  # every function entered, per thread
        Path(opts.json).write_text(json.dumps(seen, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
