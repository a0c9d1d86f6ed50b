"""Stopping a served stack completely: its process group, and the KV pool it left in /dev/shm.

NOTE 1 (shared memory left behind): on CPU, HiStateConnector moves vLLM's KV pool into a named
shared-memory segment (``/dev/shm/torch_<worker pid>_*``, docs/vllm-cpu.md §2 bug 2) which
torch's ``torch_shm_manager`` unlinks when the worker is gone. vLLM 0.32's shutdown kills every
child process, the manager included, so the segment (the whole KV pool) would stay until
reboot. :func:`stop_group` therefore removes the segments of the group's processes once the
group is gone. Used by ``examples/serve_openai.py`` and ``benchmarks/live``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["group_pids", "stop_group"]


def group_pids(pgid: int) -> set[int]:
    """Processes of process group ``pgid`` (from ``/proc/<pid>/stat``: pgrp is the 3rd field
    after the command name)."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                pids.add(int(stat.parent.name))
    return pids


def stop_group(proc: subprocess.Popen[bytes], grace: float = 60.0) -> None:
    """SIGTERM the group leader (vLLM and lmcache server stop their own children), wait, then
    SIGKILL whatever is left of the group and remove its processes' shm segments (NOTE 1).
    ``proc`` must have been started with ``start_new_session=True``."""
    pids = group_pids(proc.pid)
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    deadline = time.monotonic() + 15
    with contextlib.suppress(ProcessLookupError, PermissionError):
        while time.monotonic() < deadline:
            os.killpg(proc.pid, 0)  # raises once the group is empty
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids:
        for segment in Path("/dev/shm").glob(f"torch_{pid}_*"):
            segment.unlink(missing_ok=True)
