"""Re-apply the 13 planted mutants (docs/testing.md §5); check that the fast tests kill each.

Each mutant is a small textual patch (one ``old`` snippet that must occur exactly once in
its file, replaced by ``new``). For every mutant the package and the tests are copied to a
temporary directory, the patch is applied there (the working tree is never touched), the
fast tests (``FAST_TESTS``) run against the copy, and the mutant is *killed* when they
fail. docs/testing.md describes each mutant and the test that kills it.

    .venv/bin/python scripts/planted_mutants.py            # all 13
    .venv/bin/python scripts/planted_mutants.py reuse      # those whose name contains 'reuse'

Exit status 0 iff every selected mutant was killed (and the unmutated copy passes).

NOTE 1 (why a copy of the tests too). ``python -m pytest`` puts its working directory
first on ``sys.path``; running from the copy makes ``import lmcache_histate`` resolve to
the mutated package rather than to the editable install of the working tree. The script
checks that it does before trusting a result.
NOTE 2 (mapping to today's code). The audit planted these against an earlier core (the
score was ``τ·C/M`` with a ``1/N`` factor). Each entry's ``audit`` field names the audit's
mutant, and ``old``/``new`` its nearest equivalent in the code as it is now.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The fast tests: everything in tests/core plus the simulator tests that take < 1 s.
FAST_TESTS = (
    "tests/core",
    "tests/sim/test_report.py",
    "tests/sim/test_server.py",
    "tests/sim/test_pinned_results.py",
)


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    audit: str


MUTANTS = (
    Mutant(
        "eviction-no-token-bytes",
        "lmcache_histate/core/eviction.py",
        "return c * self.token_bytes",
        "return c",
        "eviction: dropping token_bytes from the τ·C/M term",
    ),
    Mutant(
        "update-around-skips-snapshot-above",
        "lmcache_histate/core/eviction.py",
        "        if above is not None and above.depth >= 0:\n            update(above, epoch)\n",
        "",
        "eviction: update_around not re-ranking the unit above a new snapshot",
    ),
    Mutant(
        "cost-drops-session-density",
        "lmcache_histate/core/rank.py",
        "internal += to_end * (session.end_tokens - p) / session.end_tokens",
        "internal += to_end * (session.end_tokens - p)",
        "expected recompute: dropping the 1/num_sessions factor (today C has no 1/N by "
        "design, rank docstring; nearest: dropping the 1/P_s hit density of a session)",
    ),
    Mutant(
        "cost-swaps-p-end-weights",
        "lmcache_histate/core/rank.py",
        "mass = (1.0 - end_probability) * internal + end_probability * passes",
        "mass = end_probability * internal + (1.0 - end_probability) * passes",
        "expected recompute: swapping the p_end and 1 − p_end weights",
    ),
    Mutant(
        "hit-model-observes-the-opposite",
        "lmcache_histate/core/cache.py",
        "self._hit_model.observe(at_end)",
        "self._hit_model.observe(not at_end)",
        "expected recompute: the hit model observing end vs internal the wrong way round",
    ),
    Mutant(
        "residence-ema-not-seeded",
        "lmcache_histate/core/ema.py",
        "return value if samples == 0 else ema + alpha * (value - ema)",
        "return ema + alpha * (value - ema)",
        "interval control: the residence EMA not seeded by its first sample",
    ),
    Mutant(
        "boundaries-from-whole-context",
        "lmcache_histate/core/interval.py",
        # The plain grid's choice (positions None), as the audit planted it.
        "split >= end:\n            interval = self.choose(end - start, factor).interval",
        "split >= end:\n            interval = self.choose(end, factor).interval",
        "interval control: boundaries choosing the interval from the whole context",
    ),
    Mutant(
        "cache-fresh-residence-tracker",
        "lmcache_histate/core/cache.py",
        "self._index, self._queue, config.tiers, config.rules, self._residence\n",
        "self._index, self._queue, config.tiers, config.rules, None\n",
        "interval control: the cache wiring a fresh residence tracker (pressure stays 1)",
    ),
    Mutant(
        "demotion-ignores-lower-tier-h",
        "lmcache_histate/core/placement.py",
        "if not self._make_room_for(anchor, lower, need, now):",
        "if not self.make_room(lower, need, now):",
        "placement: demotion ignoring H on the lower tier (evict)",
    ),
    Mutant(
        "retire-ignores-lower-tier-h",
        "lmcache_histate/core/placement.py",
        "if self._make_room_for(node, dst, node.snap_bytes, now):",
        "if self.make_room(dst, node.snap_bytes, now):",
        "placement: demotion ignoring H on the lower tier (a retired final snapshot)",
    ),
    Mutant(
        "kv-to-disk-when-cpu-full",
        "lmcache_histate/core/placement.py",
        "if nbytes <= self.tiers[t].capacity and self.make_room(t, nbytes, now):",
        "if self.free(t) >= nbytes or (t == len(self.tiers) - 1 "
        "and self.make_room(t, nbytes, now)):",
        "placement: new KV written to disk when CPU is full instead of demoting colder KV",
    ),
    Mutant(
        "intermediate-snapshot-on-final-tier",
        "lmcache_histate/core/placement.py",
        "home = self.rules.final_tier if final else self.rules.snapshot_tier",
        "home = self.rules.final_tier",
        "placement: intermediate snapshots placed on the final-snapshot (CPU) tier",
    ),
    Mutant(
        "reuse-sensitive-one-sided",
        "lmcache_histate/sim/report.py",
        "differs = abs(rate[histate][key] - off) >= points - eps",
        "differs = rate[histate][key] - off >= points - eps",
        "report: reuse_sensitive using a one-sided difference",
    ),
)


def _copy_tree(dst: Path) -> None:
    for name in ("lmcache_histate", "tests"):
        shutil.copytree(ROOT / name, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "pyproject.toml", dst / "pyproject.toml")


def _apply(root: Path, m: Mutant) -> None:
    path = root / m.path
    text = path.read_text()
    count = text.count(m.old)
    if count != 1:
        raise SystemExit(f"{m.name}: the snippet occurs {count} times in {m.path}, not once")
    path.write_text(text.replace(m.old, m.new))


def _pytest(cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["CI"] = "1"  # the derandomised hypothesis profile: the same examples every run
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           "--timeout", "120", *FAST_TESTS]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)


def _check_import(cwd: Path) -> None:
    probe = "import lmcache_histate, sys; sys.stdout.write(lmcache_histate.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True, check=True
    ).stdout
    if not Path(out).resolve().is_relative_to(cwd.resolve()):
        raise SystemExit(f"the copy does not shadow the installed package: {out}")


def _first_failure(out: str) -> str:
    for line in out.splitlines():
        if line.startswith(("FAILED", "ERROR")):
            return line.split(" - ")[0]
    return out.strip().splitlines()[-1] if out.strip() else "?"


def main(argv: list[str]) -> int:
    chosen = [m for m in MUTANTS if not argv or any(a in m.name for a in argv)]
    with tempfile.TemporaryDirectory(prefix="planted-") as tmp:
        base = Path(tmp) / "base"
        _copy_tree(base)
        _check_import(base)
        clean = _pytest(base)
        if clean.returncode != 0:
            print(clean.stdout[-3000:])
            raise SystemExit("the fast tests fail on the unmutated copy")
        survived = []
        for m in chosen:
            work = Path(tmp) / m.name
            shutil.copytree(base, work)
            _apply(work, m)
            run = _pytest(work)
            killed = run.returncode != 0
            verdict = f"killed by {_first_failure(run.stdout)}" if killed else "SURVIVED"
            print(f"{m.name:38s} {verdict}", flush=True)
            if not killed:
                survived.append(m.name)
            shutil.rmtree(work)
    print(f"{len(chosen) - len(survived)}/{len(chosen)} planted mutants killed")
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
