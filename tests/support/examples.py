"""Run a script of ``examples/`` as a user does: its own process, bounded in time, cleaned up.

The example scripts start servers in their own process groups and stop them when they unwind
(``with`` blocks; SIGTERM is turned into ``SystemExit``). So on a time-out the script gets
SIGTERM first -- never a bare SIGKILL that would orphan its servers -- and a minute to stop.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(
    name: str,
    args: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> str:
    """Run ``examples/<name>`` with ``args``; return its output (stdout + stderr).

    Fails the test with the output's tail when the script exits non-zero or runs longer
    than ``timeout`` seconds.
    """
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLES / name), *args],
        env={**os.environ, **(env or {})}, cwd=cwd,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the example stops its servers on SIGTERM
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        pytest.fail(f"{name} still running after {timeout:.0f} s:\n{output[-3000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{name} exited with {proc.returncode}:\n{output[-3000:]}")
    return output
