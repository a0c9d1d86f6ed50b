"""A ``histate-server`` and the ``histate serve`` it prints the flags for, as a user starts them.

Used by the live tests that need vLLM's OpenAI server with a HiState or baseline server
beside it. ``so`` is ``examples/serve_openai.py`` (the documented deployment's process
helpers: process groups, readiness polls, the quiet environment)."""

from __future__ import annotations

import contextlib
import json
import re
import shlex
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ServedStack:
    base: str
    """vLLM's OpenAI server, ``http://127.0.0.1:<port>``."""
    vllm_log: Path
    server_http: str
    """The HiState/LMCache server's HTTP endpoint."""


@contextlib.contextmanager
def served_stack(so: Any, model: Path, work: Path, *, policy: str, serve_args: Sequence[str],
                 env: Mapping[str, str] | None = None) -> Iterator[ServedStack]:
    """Start ``histate-server`` (``policy``, 0.25 GiB CPU, 0.5 GiB disk under ``work``), then
    ``histate serve`` of ``model`` as ``tiny`` with the flags the server printed and
    ``serve_args``; stop both on exit."""
    vllm_port, zmq_port, http_port = so.free_ports(3)
    config = work / "server.yaml"
    config.write_text(json.dumps({
        "policy": policy, "model": str(model / "config.json"), "chunk_size": "auto",
        "cpu_gib": 0.25, "disk_path": str(work / "disk"), "disk_gib": 0.5,
        "disk_fsync": False, "port": zmq_port, "http_port": http_port, "platform": "cpu",
    }))
    server_log = work / "server.log"
    server_http = f"http://127.0.0.1:{http_port}"
    with so.process([str(so.BIN / "histate-server"), "--config", str(config)], server_log,
                    so.QUIET) as server:
        line = so.wait_for(server, server_log, lambda: re.search(
            r"^vLLM flags: (.*)$", server_log.read_text(), re.MULTILINE), "server", 300)
        so.wait_for(server, server_log, lambda: "healthy" in so.get(
            server_http + "/healthcheck"), "server", 300)
        serve = [str(so.BIN / "histate"), "serve", str(model), "--served-model-name", "tiny",
                 "--host", "127.0.0.1", "--port", str(vllm_port),
                 *shlex.split(line.group(1)), *serve_args]
        vllm_log = work / "vllm.log"
        with so.process(serve, vllm_log, {**so.QUIET, **(env or {})}) as vllm:
            base = f"http://127.0.0.1:{vllm_port}"
            so.wait_for(vllm, vllm_log, lambda: so.get(base + "/health") == "", "vLLM", 400)
            yield ServedStack(base, vllm_log, server_http)
