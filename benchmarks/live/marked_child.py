"""Run a measurement in a child process and read back the JSON lines it marks.

The live probes (``step_overhead.py``, ``step_split_probe.py``) start each engine in its
own process, so that no engine state outlives its case; the child prints ``MARK + json``
lines (vLLM's engine core, a grandchild, may print them too) among vLLM's own output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any


def run_marked(script: str, args: Sequence[str], mark: str,
               env: Mapping[str, str] | None = None, timeout: float = 900.0
               ) -> tuple[list[dict[str, Any]], subprocess.CompletedProcess[str]]:
    """``script args`` under this interpreter; the marked items of its stdout, then of its
    stderr, in order, and the finished process (for its return code and log tail)."""
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                          timeout=timeout, check=False,
                          env={**os.environ, "VLLM_NO_USAGE_STATS": "1", **(env or {})})
    items = []
    for line in proc.stdout.splitlines() + proc.stderr.splitlines():
        i = line.find(mark)
        if i >= 0:
            items.append(json.loads(line[i + len(mark):]))
    return items, proc
