#!/usr/bin/env bash
# The device part of scripts/gpu_costs.py in ONE call of the `device` tool's `run`
# (benchmarks/gpu_costs.md has the call): on the lent GPU machine (CUDA PyTorch, no vLLM,
# no internet), in the checkout's root, with $OUT the folder whose files come back.
#
# 1. Records the machine: nvidia-smi, the disks (lsblk), the checkout's filesystem, torch.
# 2. Unpacks the carried wheels in .gpu_wheels/ (fla-core 0.6.0 and einops, fetched here by
#    `pip download`; a wheel is a zip, so no pip is needed there) into a scratch folder put
#    on PYTHONPATH. Without them gpu_costs.py runs the PyTorch reference GDN kernel.
# 3. Runs scripts/gpu_costs.py (full geometry: CUDA is there) with its JSON and log in $OUT;
#    the JSON is rewritten after every section, so a run cut short still returns what it
#    measured. BUDGET_S (default 420) bounds the measurement.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/gpu-costs-out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
{
    nvidia-smi
    lsblk -o NAME,MODEL,ROTA,SIZE,TYPE,TRAN,MOUNTPOINT
    df -hT .
    "$PY" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda)'
} >"$OUT/machine.txt" 2>&1
DEPS="$(mktemp -d)"
for wheel in .gpu_wheels/*.whl; do
    [ -e "$wheel" ] || continue
    "$PY" -m zipfile -e "$wheel" "$DEPS" && echo "[gpu_costs_device] unpacked $wheel"
done
export PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}"
"$PY" scripts/gpu_costs.py --json "$OUT/gpu_costs.json" --budget-s "${BUDGET_S:-420}" "$@" \
    2>&1 | tee "$OUT/gpu_costs.log"
exit "${PIPESTATUS[0]}"
