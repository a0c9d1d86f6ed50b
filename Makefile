# The two commands of the README. Both do all set-up first (scripts/setup.sh is idempotent).
.PHONY: setup demo test test-fast test-avx2 lint fuzz mutants planted-mutants hooks compat

# The AVX2 re-run (test-avx2) runs the tests marked `vllm_layout` in these files: those whose
# outcome depends on the layout vLLM picks per CPU ISA (block size, GDN state dtype, kernel
# library) -- the probe against a running engine, restores bit for bit, the interval saves'
# boundaries and the local plan (N_s from the allocated state), the production geometry, the
# mixed hits and the preemption on the mixed-hit pool. The rest add nothing there: pure
# arithmetic (the settings checks, plan sanitising, layout rules, the hand-derived rows of
# both layouts), start-up refusals whose check is that arithmetic, the shared secret, the
# two-block LMCache chunk (token offsets, vLLM's block grid is exercised by the mixed hits),
# and test_preemption.py (pins are released per block id, whatever the block size; the
# AVX2 preemption runs in test_mixed_hits.py). docs/testing.md 3.3.
VLLM_TESTS = tests/live/test_vllm_cpu_roundtrip.py tests/live/test_vllm_interval_saves.py \
             tests/live/test_model_sizes.py tests/live/test_mixed_hits.py

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python -m lmcache_histate.backends.demo

# tests/conftest.py loads the derandomised ci hypothesis profile unless HYPOTHESIS_PROFILE
# names another: with or without CI=1, make test runs the examples CI runs.
test: setup lint
	.venv/bin/python -m pytest --durations=10
	$(MAKE) --no-print-directory test-avx2

# The fast tier: every test that starts no real part (tests/support/live_marker.py), about a
# minute here. For the edit-test loop; `make test` runs everything.
test-fast: setup lint
	.venv/bin/python -m pytest -q -m "not live" --durations=5

# vLLM picks the block size and state dtypes per CPU ISA. On an AVX-512 machine the vLLM
# tests run once more on vLLM's AVX2 path (tests/support/force_avx2), so both layouts are
# checked wherever the suite runs; an AVX2-only CPU cannot run the AVX-512 kernels.
test-avx2: setup
	@if grep -qw avx512f /proc/cpuinfo; then \
	    echo "[test] vLLM tests again on vLLM's AVX2 path (HISTATE_TEST_ISA=avx2)"; \
	    HISTATE_TEST_ISA=avx2 .venv/bin/python -m pytest -q --durations=5 -m vllm_layout $(VLLM_TESTS); \
	else \
	    echo "[test] AVX2-only CPU: the suite above ran vLLM's AVX2 path; no AVX-512 here"; \
	fi

lint:
	.venv/bin/ruff check .

# Every upstream class, method and signature we use, checked statically in the wheels of
# each vLLM and LMCache version of docs/support.md (downloaded once, no deps, cached under
# ~/.cache/histate-compat or $$HISTATE_COMPAT_CACHE), then `pip install --dry-run` of the
# cuda extra for each vLLM. COMPAT_ARGS: --offline (cached wheels only), --no-resolve,
# --abi (also LMCache's cuda_ops against the torch wheels, ~1.3 GB). scripts/compat.py.
compat:
	.venv/bin/python scripts/compat.py $(COMPAT_ARGS)

# Property tests of the core and the simulator on fresh random examples (docs/testing.md):
# one pass after another, each from a new printed seed, FUZZ_SCALE (20) times each test's
# own example budget, until FUZZ_MINUTES (10) have passed; stops at the first failure.
# `make fuzz FUZZ_SEED=N` replays the pass of seed N once.
FUZZ_TESTS = tests/core tests/sim
FUZZ_MINUTES ?= 10
fuzz: setup
	@run() { echo "[fuzz] seed $$1 (replay: make fuzz FUZZ_SEED=$$1)"; \
	    HYPOTHESIS_PROFILE=fuzz nice -n 10 .venv/bin/python -m pytest -q -x -m hypothesis \
	        -p no:cacheprovider --hypothesis-seed=$$1 $(FUZZ_TESTS) || \
	        { echo "[fuzz] FAILED with seed $$1"; exit 1; }; }; \
	if [ -n "$(FUZZ_SEED)" ]; then run $(FUZZ_SEED); exit; fi; \
	end=$$(( $$(date +%s) + 60 * $(FUZZ_MINUTES) )); passes=0; \
	while [ $$(date +%s) -lt $$end ]; do \
	    run $$(od -An -N4 -tu4 /dev/urandom | tr -d ' ') || exit 1; passes=$$((passes + 1)); \
	done; echo "[fuzz] clean: $$passes seeded passes in $(FUZZ_MINUTES) min"

# Mutation testing (docs/testing.md): mutmut over lmcache_histate/core and the simulator's
# report and server model, each mutant run against the fast tests ([tool.mutmut] in
# pyproject.toml). Needs the dev extra (.venv/bin/pip install -e '.[dev,sim]'). ~1 h on 2 shared
# cores; `.venv/bin/mutmut results` lists the survivors, `mutmut show NAME` shows one.
mutants:
	rm -rf mutants
	HYPOTHESIS_PROFILE=mutants nice -n 15 .venv/bin/mutmut run --max-children 2
	.venv/bin/mutmut export-cicd-stats
	@cat mutants/mutmut-cicd-stats.json; echo

# The 13 planted mutants of scripts/planted_mutants.py, re-applied one by one (a few minutes).
planted-mutants:
	.venv/bin/python scripts/planted_mutants.py

# The commit rule of CONTRIBUTING.md as this clone's commit-msg hook (scripts/commit_rule.py).
hooks:
	git config core.hooksPath scripts/hooks
	@echo "[hooks] commit messages are checked by scripts/hooks/commit-msg"
