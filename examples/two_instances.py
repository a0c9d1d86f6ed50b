"""Two vLLM instances, two histate-servers, one disk folder, one Redis index: a session moves.

Run from the repository root after ``make setup`` (a few minutes on 2 CPU cores, nothing
downloaded; needs ``redis-server`` on the PATH, which ``scripts/setup.sh`` installs)::

    .venv/bin/python examples/two_instances.py

What it does (docs/shared-index.md; docs/deployment.md §8):

1. starts ``redis-server`` on a free loopback port (no persistence);
2. starts two ``histate-server`` processes from ``configs/shared-index-a.yaml`` and
   ``-b.yaml`` with the tiny generated hybrid model, free ports, a temporary folder as the
   one ``disk_path`` and this Redis as the ``shared_index`` url. Each server's CPU tier is
   sized below one chunk (``cpu_fill``), so every object it keeps lands on the shared disk
   tier: the deployment's copy another instance can load (a session's KV that only
   server A's CPU tier holds is not visible to B; docs/shared-index.md §6);
3. starts two vLLM CPU engines (offline ``vllm.LLM``, ``HiStateConnector``), engine A on
   server A and engine B on server B;
4. sends a session's first turn to engine A, then its second turn (the first turn's tokens
   plus the answer and a new user message) to engine B, as a router would after moving the
   session, and prints the tokens B did not compute (``cached_tokens``) and what server B
   loaded from files server A wrote.

``--workdir`` keeps configs, logs and the shared folder; ``--json FILE`` writes the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@contextlib.contextmanager
def redis_server(workdir: Path, port: int) -> Iterator[str]:
    """``redis-server`` on ``port`` (loopback, nothing saved) for the duration of the block."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (bash scripts/setup.sh installs it)")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        import redis

        client = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("redis-server did not start") from None
                time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def server_config(name: str, model: Path, work: Path, url: str, layout: Any,
                  ports: tuple[int, int]) -> Path:
    """``configs/shared-index-<name>.yaml`` made runnable here: the tiny model, its layout,
    ``ports`` (request, HTTP), a temporary shared folder, this Redis."""
    cfg = yaml.safe_load((CONFIGS / f"shared-index-{name}.yaml").read_text())
    cfg.update({
        "model": str(model / "config.json"),
        **layout.server_settings(),
        "cpu_gib": 0.1,
        "cpu_fill": 0.001,  # < one chunk: every object the server keeps goes to disk
        "disk_path": str(work / "shared-disk"),
        "disk_gib": 0.2,
        "disk_fsync": False,
        "tau": 3600.0,
        "port": ports[0],
        "http_port": ports[1],
        "platform": "cpu",
        "kv_connector": "HiStateConnector",
        "kv_connector_module_path": "lmcache_histate.backends.vllm.connector",
    })
    cfg["shared_index"].update({"url": url, "deployment": "two-instances-example"})
    path = work / f"shared-index-{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run(work: Path) -> dict[str, Any]:
    from lmcache_histate.backends.demo.engine_proc import EngineProcess, engine_kwargs
    from lmcache_histate.backends.demo.servers import ServerProcess, free_ports
    from lmcache_histate.backends.demo.tiny_model import ensure_tiny_model
    from lmcache_histate.backends.server.launcher import kv_transfer_config
    from lmcache_histate.backends.vllm.engine_facts import probe

    from lmcache_histate.config import load_config

    model = ensure_tiny_model()
    layout = probe(model)
    chunk = layout.block_size
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    rng = random.Random(12)
    turn1 = [rng.randrange(4, vocab) for _ in range(3 * chunk + chunk // 2)]
    ask = {"cached_token_stats": True}
    out: dict[str, Any] = {"chunk_tokens": chunk}
    # Every port at once: ports picked one after the other can be equal.
    redis_port, *server_ports = free_ports(5)
    with redis_server(work, redis_port) as url:
        configs = {n: server_config(n, model, work, url, layout,
                                    (server_ports[2 * i], server_ports[2 * i + 1]))
                   for i, n in enumerate(("a", "b"))}
        servers = {n: ServerProcess(configs[n], work, f"server-{n}") for n in configs}
        try:
            for server in servers.values():
                server.wait_ready()
            engines = {
                n: engine_kwargs(model, chunk_tokens=chunk, kv_cache_memory_bytes=64 << 20,
                                 kv_transfer_config=kv_transfer_config(load_config(configs[n])))
                for n in configs
            }
            with EngineProcess(engines["a"], workdir=work, name="engine-a",
                               block_size=chunk) as engine_a:
                first = engine_a.generate(turn1, max_tokens=8, kv_transfer_params=ask)
                servers["a"].settle()
            user = [rng.randrange(4, vocab) for _ in range(chunk // 2)]
            turn2 = turn1 + list(first["token_ids"]) + user
            with EngineProcess(engines["b"], workdir=work, name="engine-b",
                               block_size=chunk) as engine_b:
                second = engine_b.generate(turn2, max_tokens=8, kv_transfer_params=ask)
                status_b = servers["b"].settle()["histate"]["disk"]
        finally:
            for server in servers.values():
                server.stop()
    loads = {k: v for k, v in status_b["stats"].items() if k.startswith("loads_group")}
    out["turns"] = [
        {"instance": "A", "prompt_tokens": len(turn1), "cached_tokens": first["num_cached_tokens"]},
        {"instance": "B", "prompt_tokens": len(turn2),
         "cached_tokens": second["num_cached_tokens"]},
    ]
    out["b_files_loaded_from_a"] = sum(loads.values())
    out["b_shared_index"] = {k: status_b["shared_index"][k]
                             for k in ("mode", "used_bytes", "budget_bytes")}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", help="keep configs, logs and the shared folder here")
    parser.add_argument("--json", help="write the numbers printed at the end to this file")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="histate-two-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        result = run(work)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    a, b = result["turns"]
    print(f"turn 1 -> instance A: {a['prompt_tokens']} prompt tokens, {a['cached_tokens']} cached")
    print(f"turn 2 -> instance B: {b['prompt_tokens']} prompt tokens, {b['cached_tokens']} cached "
          f"(hit tokens from A's snapshots; {result['b_files_loaded_from_a']} files loaded)")
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
