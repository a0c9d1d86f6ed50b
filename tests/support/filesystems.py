"""Real small filesystems for fault tests: a tmpfs of a chosen size, optionally read-only.

Mounting needs root (CAP_SYS_ADMIN); where it is refused the test is skipped with the
reason, because the fault (a full or read-only disk) cannot be caused for real otherwise.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["fill_to", "tmpfs"]


@contextlib.contextmanager
def tmpfs(mount: Path, size: str, *, read_only: bool = False) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (e.g. ``"256k"``) at ``mount`` for the block."""
    mount.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    try:
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "histate-test", str(mount)],
            capture_output=True, text=True, check=False, timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot run mount here: {exc}")
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip() or result.stdout}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)


def fill_to(mount: Path, free_bytes: int) -> Path:
    """Write a filler file so that about ``free_bytes`` stay free on ``mount``'s filesystem."""
    st = os.statvfs(mount)
    filler = mount / "filler"
    size = max(0, st.f_bavail * st.f_frsize - free_bytes)
    with open(filler, "wb") as f:
        f.write(b"\0" * size)
    return filler
