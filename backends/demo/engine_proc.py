"""A vLLM offline engine (``vllm.LLM``) in a child process, driven over a pipe.

Used by the demo (``backends/demo/runs.py``) and the live vLLM tests. Why a child process: vLLM
binds CPU threads and keeps global state, a crashed engine must not take its caller down, two
configurations (HiState and a baseline) must not share one process, and the child controls
its import order (``upstream.install_vllm_cpu_inprocess_fix`` before vLLM resolves the
LMCache connector). The engine itself runs in-process inside the child
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: start-up in seconds).

Protocol: one JSON object per line; commands on the child's stdin, replies on a dedicated
pipe (vLLM logs to stdout/stderr, which go to a log file). Commands:

* ``{"op": "generate", "prompt": [ids], "max_tokens": n, "logprobs": k | null,
  "kv_transfer_params": {...} | null, "reset": bool}`` → token ids, per-step top-k logprobs
  (exact floats: JSON round-trips Python floats), ``num_cached_tokens``, the connector's
  ``kv_transfer_params``, ``seconds`` (wall time of ``LLM.generate``; with ``max_tokens=1``
  this is the time to first token) and, with ``reset``, the engine steps it took to reset
  vLLM's own prefix cache afterwards;
* ``{"op": "generate_batch", "prompts": [[ids], ...], "priorities": [int] | null, ...}`` →
  ``{"outputs": [...]}``, one
  ``generate`` answer per prompt, all submitted to one ``LLM.generate`` call so that vLLM
  schedules them together (a pool smaller than their sum preempts one);
* ``{"op": "reset"}`` → run engine steps until ``LLM.reset_prefix_cache()`` succeeds (the
  LMCache connector frees a finished request's blocks one step after it ends);
* ``{"op": "info"}`` → block size, scheduler settings and KV cache groups as vLLM made them,
  plus the HiState connector's counters;
* ``{"op": "exit"}``.

Run as ``python -m lmcache_histate.backends.demo.engine_proc --spec FILE --reply-fd N``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lmcache_histate.backends.vllm.engine_facts import OFFLINE_ENV

__all__ = [
    "ENGINE_DTYPE",
    "ENGINE_ENV",
    "EngineError",
    "EngineProcess",
    "engine_kwargs",
]

ENGINE_DTYPE = "bfloat16"
"""The tiny model's dtype in every engine :func:`engine_kwargs` builds; the layout probe
(``engine_facts.probe``) must be given the same, or the block size may differ."""

ENGINE_ENV: Mapping[str, str] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **OFFLINE_ENV}
"""The engine child: :data:`OFFLINE_ENV` + the in-process engine (start-up in seconds)."""


class EngineError(RuntimeError):
    """The engine child failed (the message carries the tail of its log)."""


def engine_kwargs(
    model: str | os.PathLike[str],
    *,
    chunk_tokens: int,
    kv_transfer_config: Mapping[str, Any] | None = None,
    max_model_len: int = 4096,
    kv_cache_memory_bytes: int = 48 << 20,
    **overrides: Any,
) -> dict[str, Any]:
    """``vllm.LLM`` arguments for a hybrid model with HiState's interval saves.

    ``chunk_tokens`` is the LMCache chunk = vLLM's block size N for this model on this
    machine (``engine_facts.probe``; never a constant: 384 with AVX-512-BF16, 256 with AVX2
    for the tiny model). HiState's scheduler (``step_scheduler``) with vLLM's default step
    budget: a prefill step ends early only where the request's plan keeps a snapshot;
    ``prefix_cache_retention_interval=None``: vLLM hands every boundary state to the
    connector (see ``saves``). Pass the same number as
    ``EngineProcess(block_size=...)`` so a disagreeing engine fails at start.
    """
    from lmcache_histate.backends.vllm.connector_config import SCHEDULER_CLS

    kwargs: dict[str, Any] = {
        "model": str(model),
        "dtype": ENGINE_DTYPE,
        "seed": 0,
        "max_model_len": max_model_len,
        "max_num_seqs": 4,
        "scheduler_cls": SCHEDULER_CLS,
        "enable_prefix_caching": True,
        "mamba_cache_mode": "align",
        "prefix_cache_retention_interval": None,
        "enforce_eager": True,  # no torch.compile: start-up in seconds
        # On CPU the whole KV pool is moved into /dev/shm by the connector: keep it small.
        "kv_cache_memory_bytes": kv_cache_memory_bytes,
    }
    if kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = dict(kv_transfer_config)
    kwargs.update(overrides)
    return kwargs


class EngineProcess:
    """Parent-side handle on an engine child. Use as a context manager."""

    def __init__(
        self,
        kwargs: Mapping[str, Any],
        *,
        workdir: str | os.PathLike[str],
        name: str = "engine",
        start_timeout: float = 300.0,
        env: Mapping[str, str] | None = None,
        block_size: int | None = None,
    ) -> None:
        """Start the child; ``block_size``: the block size the caller derived its chunks and
        prompts from -- an engine that chose another one is an :class:`EngineError` naming
        both (a chunk that disagrees with the engine silently changes every hit count)."""
        work = Path(workdir)
        work.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.log_path = work / f"{name}.log"
        spec = work / f"{name}.json"
        spec.write_text(json.dumps(dict(kwargs)))
        read_fd, write_fd = os.pipe()
        child_env = {**os.environ, **ENGINE_ENV, **(env or {})}
        self._log = self.log_path.open("wb")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lmcache_histate.backends.demo.engine_proc",
                 "--spec", str(spec), "--reply-fd", str(write_fd)],
                stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT,
                env=child_env, cwd=work, pass_fds=(write_fd,),
            )
        finally:
            os.close(write_fd)
        self._replies = os.fdopen(read_fd, "rb")
        self._lock = threading.Lock()
        self.info: dict[str, Any] = self._read(start_timeout, "start-up")
        if block_size is not None and self.info["block_size"] != block_size:
            self.close()
            raise EngineError(
                f"{name}: vLLM chose block size {self.info['block_size']} but the caller "
                f"derived its chunks from {block_size} (engine_facts.probe must be given the "
                "same engine arguments)"
            )

    # ----------------------------------------------------------------------- plumbing
    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "<no engine log>"
        return "\n".join(text.splitlines()[-lines:])

    def _read(self, timeout: float, what: str) -> dict[str, Any]:
        import select

        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise EngineError(f"{self.name}: no reply to {what} after {timeout:.0f}s\n"
                                  f"--- log tail ---\n{self.log_tail()}")
            ready, _, _ = select.select([self._replies], [], [], min(left, 1.0))
            if ready:
                line = self._replies.readline()
                if line:
                    break
            if self.proc.poll() is not None and not ready:
                raise EngineError(
                    f"{self.name}: engine exited with {self.proc.returncode} during {what}\n"
                    f"--- log tail ---\n{self.log_tail()}"
                )
            if ready and not line:
                self.proc.wait(timeout=30)
                raise EngineError(
                    f"{self.name}: engine exited with {self.proc.returncode} during {what}\n"
                    f"--- log tail ---\n{self.log_tail()}"
                )
        reply = json.loads(line)
        if "error" in reply:
            raise EngineError(f"{self.name}: {what} failed: {reply['error']}\n"
                              f"--- log tail ---\n{self.log_tail(30)}")
        return reply

    def call(self, op: str, timeout: float = 300.0, **args: Any) -> dict[str, Any]:
        with self._lock:
            if self.proc.poll() is not None:
                raise EngineError(f"{self.name}: engine is not running "
                                  f"(exit {self.proc.returncode})\n{self.log_tail()}")
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
            self.proc.stdin.flush()
            return self._read(timeout, op)

    # ------------------------------------------------------------------------ commands
    def generate(
        self,
        prompt: list[int],
        *,
        max_tokens: int = 1,
        logprobs: int | None = None,
        kv_transfer_params: Mapping[str, Any] | None = None,
        reset: bool = False,
        timeout: float = 300.0,
    ) -> dict[str, Any]:
        return self.call(
            "generate", timeout, prompt=list(prompt), max_tokens=max_tokens, logprobs=logprobs,
            kv_transfer_params=dict(kv_transfer_params) if kv_transfer_params else None,
            reset=reset,
        )

    def generate_batch(
        self,
        prompts: list[list[int]],
        *,
        max_tokens: int = 1,
        logprobs: int | None = None,
        kv_transfer_params: Mapping[str, Any] | None = None,
        reset: bool = False,
        priorities: list[int] | None = None,
        timeout: float = 300.0,
    ) -> list[dict[str, Any]]:
        """Like :meth:`generate`, for ``prompts`` scheduled together in one call;
        ``priorities`` need an engine with ``scheduling_policy="priority"`` (the larger
        value is served later and preempted first)."""
        return list(self.call(
            "generate_batch", timeout, prompts=[list(p) for p in prompts],
            max_tokens=max_tokens, logprobs=logprobs,
            kv_transfer_params=dict(kv_transfer_params) if kv_transfer_params else None,
            reset=reset, priorities=priorities,
        )["outputs"])

    def reset(self) -> int:
        return int(self.call("reset")["steps"])

    def stats(self) -> dict[str, Any]:
        return self.call("info")

    def close(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.call("exit", timeout=timeout)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._replies.close()
        self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.kill()
        self.close()


# ================================================================================ child


def _info(llm: Any) -> dict[str, Any]:
    core = llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    config = scheduler.kv_cache_config
    vcfg = llm.llm_engine.vllm_config
    groups = []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        groups.append({
            "layers": list(group.layer_names),
            "spec": type(spec).__name__,
            "block_size": spec.block_size,
            "page_size_bytes": spec.page_size_bytes,
            "shapes": [list(s) for s in getattr(spec, "shapes", ())],
            "dtypes": [str(d) for d in getattr(spec, "dtypes", ())],
        })
    connector = getattr(scheduler, "connector", None)
    return {
        "block_size": vcfg.cache_config.block_size,
        "max_num_batched_tokens": vcfg.scheduler_config.max_num_batched_tokens,
        "mamba_cache_mode": vcfg.cache_config.mamba_cache_mode,
        "prefix_cache_retention_interval": vcfg.cache_config.prefix_cache_retention_interval,
        "num_blocks": config.num_blocks,
        "groups": groups,
        "histate": dict(getattr(connector, "histate_stats", {}) or {}),
    }


def _reset(llm: Any, tries: int = 50) -> int:
    for attempt in range(tries):
        if llm.reset_prefix_cache():
            return attempt
        llm.llm_engine.step()
        time.sleep(0.02)
    raise RuntimeError(f"vLLM prefix cache still not resettable after {tries} steps")


def _generate(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """One ``generate`` answer, or with ``prompts`` a ``generate_batch`` answer."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    kv_params = cmd.get("kv_transfer_params")
    params = SamplingParams(
        max_tokens=int(cmd.get("max_tokens", 1)),
        temperature=0.0,
        logprobs=cmd.get("logprobs"),
        extra_args={"kv_transfer_params": kv_params} if kv_params else None,
    )
    prompts = cmd["prompts"] if "prompts" in cmd else [cmd["prompt"]]
    started = time.monotonic()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False, priority=cmd.get("priorities"))
    seconds = time.monotonic() - started
    results = []
    for prompt, out in zip(prompts, outs, strict=True):
        completion = out.outputs[0]
        results.append({
            "seconds": seconds,
            "num_prompt_tokens": len(prompt),
            "num_cached_tokens": out.num_cached_tokens,
            "token_ids": list(completion.token_ids),
            "logprobs": (
                [{str(t): lp.logprob for t, lp in step.items()} for step in completion.logprobs]
                if completion.logprobs is not None else None
            ),
            "kv_transfer_params": getattr(out, "kv_transfer_params", None),
        })
    result: dict[str, Any] = {"outputs": results} if "prompts" in cmd else results[0]
    if cmd.get("reset"):
        result["reset_steps"] = _reset(llm)
    return result


def child_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--reply-fd", type=int, required=True)
    args = parser.parse_args(argv)
    replies = os.fdopen(args.reply_fd, "w", buffering=1)

    def reply(obj: dict[str, Any]) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    try:
        kwargs = json.loads(Path(args.spec).read_text())
        # Before vLLM resolves the LMCache connector (which imports numba/llvmlite).
        from lmcache_histate.backends.upstream import install_vllm_cpu_inprocess_fix
        from lmcache_histate.backends.vllm.cpu_support import is_cpu_platform

        if is_cpu_platform():
            install_vllm_cpu_inprocess_fix()
        from vllm import LLM

        started = time.monotonic()
        llm = LLM(**kwargs)
        info = _info(llm)
        info["init_seconds"] = time.monotonic() - started
        if is_cpu_platform():
            from lmcache_histate.backends.vllm.engine_facts import (
                cpu_vector_isa,
                loaded_kernel_library,
            )

            info["isa"], info["kernel_library"] = cpu_vector_isa(), loaded_kernel_library()
    except Exception as exc:
        import traceback

        traceback.print_exc()
        reply({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    reply(info)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op in ("generate", "generate_batch"):
                reply(_generate(llm, cmd))
            elif op == "reset":
                reply({"steps": _reset(llm)})
            elif op == "info":
                reply(_info(llm))
            elif op == "exit":
                # One more step lets the last END_SESSION reach the server before the
                # worker unregisters (docs/vllm-cpu.md, bug 8).
                with contextlib.suppress(Exception):
                    _reset(llm, tries=5)
                reply({"ok": True})
                break
            else:
                reply({"error": f"unknown op {op!r}"})
        except Exception as exc:
            import traceback

            traceback.print_exc()
            reply({"error": f"{type(exc).__name__}: {exc}"})
    replies.close()
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
